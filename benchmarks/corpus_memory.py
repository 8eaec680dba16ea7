"""Peak resident memory of a training run on a prepared corpus of 40 MB and on one 100 times as
large (4 GB of text): the shards are memory-mapped, so the run's memory should not grow with them.

The large corpus is the small one's training tokens repeated 100 times (document starts shifted
to match), sealed as ``nanolm prepare`` seals its output: a run checks it like any other. Each
run is its own process (``python -m nanolm train``, the same options, fixed steps); its peak
resident memory is the child's own (``/usr/bin/time``), file pages mapped from the shards included.

    python benchmarks/corpus_memory.py                 # 40 MB and 4 GB, 200 steps each
    python benchmarks/corpus_memory.py --times 10 --steps 50
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from corpus_prepare import run_measured  # the same measurement of a child's peak


def small_corpus(work: Path, mb: float) -> Path:
    from nanolm.data.corpus import write_stories
    from nanolm.data.prepare import prepare

    out = work / "small"
    if not (out / "meta.json").is_file():
        text = work / "small.txt"
        write_stories(text, int(mb * 1e6 / 370), seed=7)  # ~370 bytes a story
        prepare(text, out, "bpe", 4096, progress=False, compressor_sample_bytes=0)
    return out


def tiled_corpus(small: Path, times: int) -> Path:
    """``small``'s training split repeated ``times`` times, sealed like a prepared directory."""
    from nanolm.base.files import manifest, sealed
    from nanolm.data.shards import DATA_FILES, PreparedData

    big = small.parent / f"tiled{times}"
    if (big / "meta.json").is_file():
        return big
    shutil.rmtree(big, ignore_errors=True)
    big.mkdir()
    data = PreparedData(small)
    tokens = np.fromfile(small / "train.bin", dtype=data.meta["dtype"])
    starts = np.load(small / "train_docs.npy")
    with open(big / "train.bin", "wb") as f:
        for _ in range(times):
            tokens.tofile(f)
    np.save(big / "train_docs.npy", np.concatenate([starts + k * len(tokens) for k in range(times)]))
    for name in ("val.bin", "val_docs.npy", "tokenizer.json"):
        shutil.copy(small / name, big / name)
    meta = {k: v for k, v in data.meta.items() if k != "seal"}
    train = meta["splits"]["train"]
    train.update(tokens=train["tokens"] * times, bytes=train["bytes"] * times, documents=train["documents"] * times)
    meta["files"] = manifest(big, DATA_FILES)
    (big / "meta.json").write_text(json.dumps(sealed(meta), indent=2))
    return big


def peak_memory(data: Path, steps: int, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "nanolm", "train", "--data", str(data), "--out-dir", str(out)]
    cmd += ["--steps", str(steps), "--time-budget", "off", "--n-layer", "3", "--n-embd", "128", "--n-head", "4"]
    cmd += ["--seq-len", "256", "--batch-size", "8", "--eval-every", "100", "--eval-windows", "64", "--threads", "1"]
    start = time.perf_counter()
    peak, status, err = run_measured(cmd, out.parent / "peak.txt")
    if status != 0:
        raise SystemExit(f"train failed:\n{err[-2000:]}")
    return {"peak_rss_mb": peak, "seconds": round(time.perf_counter() - start, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=40, help="text of the small corpus, MB")
    p.add_argument("--times", type=int, default=100, help="the large corpus is the small one this many times")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--work", default="/tmp/nanolm-corpus-memory")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    small = small_corpus(work, args.mb)
    big = tiled_corpus(small, args.times)
    rows = {}
    for name, data in (("small", small), ("large", big), ("small", small), ("large", big)):  # alternated
        row = peak_memory(data, args.steps, work / f"run-{name}")
        rows.setdefault(name, []).append(row)
        size = (data / "train.bin").stat().st_size
        print(json.dumps({"corpus": name, "train_bin_mb": round(size / 1e6), **row}), flush=True)
    small_peak = min(r["peak_rss_mb"] for r in rows["small"])
    large_peak = max(r["peak_rss_mb"] for r in rows["large"])
    print(f"peak resident memory, large corpus over small: {large_peak / small_peak:.2f}x")


if __name__ == "__main__":
    main()
