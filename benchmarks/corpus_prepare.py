"""``nanolm prepare`` on a generated corpus of gigabytes, in the forms corpora are published in:
its encoding throughput with one and with two threads, its peak memory, and the limit beside it
(the ``tokenizers`` library's own ``encode_batch`` over the same text, on the same cores).

The corpus is the built-in stories, generated 20 MB at a time with a new seed each (no story
repeats), written once under ``--work`` and reused: a plain ``.txt``, the same documents as a
``.jsonl.zst``, and as a directory of ~100 MB parquet shards. Each prepare runs in its own
process (``python -m nanolm prepare --workers N``); its peak resident memory is the child's own
(``/usr/bin/time``), and its MB/s is the encoding's as prepare reports it (the tokenizer's training, the
same 100 MB whatever the corpus size, is reported apart). The reference reads the same
documents in prepare's pieces and times only the ``encode_batch`` calls, with every core.

    python benchmarks/corpus_prepare.py --gb 1                       # the table in docs/data.md
    python benchmarks/corpus_prepare.py --gb 4 --forms txt --workers 2
    python benchmarks/corpus_prepare.py --gb 0.05 --work /tmp/small   # a quick look
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

CHUNK_STORIES = 55_000  # ~20 MB of stories per seed


def run_measured(cmd: list[str], peak_file: Path, env=None) -> tuple[int, int, str]:
    """Run ``cmd``; (its peak resident memory in MB, its status, its output). Measured by
    ``/usr/bin/time`` where it exists: a child forked from this process would inherit this
    process's own peak (Linux keeps the high-water mark across exec), which holds the corpora."""
    timer = ["/usr/bin/time", "-f", "%M", "-o", str(peak_file)] if Path("/usr/bin/time").exists() else []
    proc = subprocess.Popen(timer + cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    kilobytes = int(peak_file.read_text().split()[-1]) if timer else usage.ru_maxrss
    return round(kilobytes / 1024), os.waitstatus_to_exitcode(status), output


def build_corpus(work: Path, gb: float) -> Path:
    """``corpus.txt`` of about ``gb`` GB of stories (reused when it is there)."""
    from nanolm.data.corpus import write_stories
    from nanolm.tokenizer import EOS

    path = work / f"corpus-{gb:g}gb.txt"
    if path.exists():
        return path
    partial = path.with_suffix(".partial")
    target = int(gb * 1e9)
    with open(partial, "w", encoding="utf-8") as out:
        seed, written = 0, 0
        while written < target:
            piece = work / "piece.txt"
            write_stories(piece, CHUNK_STORIES, seed=1000 + seed)
            text = piece.read_text(encoding="utf-8")
            out.write((f"\n{EOS}\n" if seed else "") + text)
            written += len(text.encode("utf-8"))
            seed += 1
    for leftover in work.glob("piece.txt*"):
        leftover.unlink()
    partial.rename(path)
    return path


def build_form(corpus: Path, form: str) -> Path:
    """The same documents as ``form`` (``txt``, ``jsonl.zst`` or ``parquet``: a shard directory)."""
    from nanolm.data.sources import DocumentSource

    if form == "txt":
        return corpus
    if form == "jsonl.zst":
        import zstandard

        path = corpus.with_suffix(".jsonl.zst")
        if not path.exists():
            with open(path.with_suffix(".partial"), "wb") as raw:
                with zstandard.ZstdCompressor(level=3).stream_writer(raw) as f:
                    for doc in DocumentSource(corpus):
                        f.write((json.dumps({"text": doc}) + "\n").encode("utf-8"))
            path.with_suffix(".partial").rename(path)
        return path
    assert form == "parquet", form
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = corpus.with_suffix(".parquet.d")
    if not directory.exists():
        partial = corpus.with_suffix(".parquet.partial")
        partial.mkdir(exist_ok=True)
        shard, batch, size = 0, [], 0
        for doc in itertools.chain(DocumentSource(corpus), [None]):  # streamed: the corpus may not fit in memory
            if doc is not None:
                batch.append(doc)
                size += len(doc)
            if (doc is None and batch) or size >= 100_000_000:
                pq.write_table(pa.table({"text": batch}), partial / f"train-{shard:05d}.parquet", row_group_size=10_000)
                shard, batch, size = shard + 1, [], 0
        partial.rename(directory)
    return directory


def run_prepare(source: Path, out: Path, workers: int, vocab_size: int) -> dict:
    """One ``nanolm prepare`` in its own process: wall time, encoding MB/s, peak memory."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "nanolm", "prepare", "--data", str(source), "--out", str(out)]
    cmd += ["--vocab-size", str(vocab_size), "--workers", str(workers), "--progress", "lines"]
    start = time.perf_counter()
    peak, status, output = run_measured(cmd, out.parent / "peak.txt", env)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"prepare failed ({status}):\n{output[-2000:]}")
    encoded = re.search(r"encoded ([\d.]+) [MG]B in .*? \(([\d.]+) MB/s\)", output)
    tokenizer = re.search(r"tokenizer trained in ([\d.]+ ?\w+)", output)
    return {
        "workers": workers,
        "wall_s": round(seconds, 1),
        "encoding_mb_per_s": float(encoded.group(2)) if encoded else None,
        "tokenizer_trained_in": tokenizer.group(1) if tokenizer else None,
        "peak_rss_mb": peak,
    }


REFERENCE = """
import json, sys, time
from nanolm.data.sources import DocumentSource
from nanolm.tokenizer import Tokenizer
tok = Tokenizer.load(sys.argv[2])
batch, chars, seconds, text_bytes = [], 0, {"encode_batch": 0.0, "encode_batch_fast": 0.0}, 0
def run(batch):
    global text_bytes
    text_bytes += sum(len(t.encode("utf-8")) for t in batch)
    for name in seconds:
        t = time.perf_counter(); getattr(tok.hf, name)(batch); seconds[name] += time.perf_counter() - t
for doc in DocumentSource(sys.argv[1]):
    batch.append(doc); chars += len(doc)
    if chars >= 8_000_000:
        run(batch); batch, chars = [], 0
if batch:
    run(batch)
print(json.dumps({name: round(text_bytes / 1e6 / s, 2) for name, s in seconds.items()}))
"""


def reference(source: Path, tokenizer: Path) -> dict:
    """MB/s of the tokenizers library's own batch encoding over the same documents, every core."""
    out = subprocess.run(
        [sys.executable, "-c", REFERENCE, str(source), str(tokenizer)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="size of the generated corpus (GB of text)")
    p.add_argument("--forms", default="txt,jsonl.zst,parquet", help="comma-separated: txt, jsonl.zst, parquet")
    p.add_argument("--workers", default="1,2", help="comma-separated thread counts to compare")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--no-reference", action="store_true", help="skip the encode_batch reference")
    p.add_argument("--work", default="/tmp/nanolm-corpus-bench", help="where the corpora and outputs go (kept)")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(work, args.gb)
    rows = []
    for form in args.forms.split(","):
        source = build_form(corpus, form)
        for workers in [int(w) for w in args.workers.split(",")]:
            row = {
                "form": form,
                "gb": args.gb,
                **run_prepare(source, work / f"out-{form}-{workers}", workers, args.vocab_size),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    if not args.no_reference:
        out = work / f"out-{rows[-1]['form']}-{rows[-1]['workers']}"
        ref = reference(corpus, out / "tokenizer.json")
        print(json.dumps({"reference": ref, "cores": len(os.sched_getaffinity(0))}), flush=True)
        best = (
            max((r["encoding_mb_per_s"] or 0) for r in rows if r["form"] == "txt")
            if any(r["form"] == "txt" for r in rows)
            else None
        )
        if best:
            print(f"prepare's encoding over encode_batch's: {best / ref['encode_batch']:.2f}x")
    one = {r["form"]: r["encoding_mb_per_s"] for r in rows if r["workers"] == 1}
    two = {r["form"]: r["encoding_mb_per_s"] for r in rows if r["workers"] == 2}
    for form in one.keys() & two.keys():
        if one[form] and two[form]:
            print(f"{form}: two threads over one: {two[form] / one[form]:.2f}x")


if __name__ == "__main__":
    main()
