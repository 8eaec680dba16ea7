"""Throughput of ``nanolm prepare`` (MB of text per second), BPE and char, with the compressor
bounds that ``nanolm prepare`` reports and without them, as a training run prepares its data.

The compressors (zlib and xz over up to 2 MB of each split) run beside the encoding and compete
with it for the cores, a fixed cost that dominates on small files; a training run skips them
(``nanolm.data.prepare.prepare``). The two are alternated round by round; the figures are medians.

    python benchmarks/prepare_throughput.py                       # 20 MB of generated stories
    python benchmarks/prepare_throughput.py --data path/to/corpus.txt --vocab-size 8192 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from nanolm.data.corpus import write_stories
from nanolm.data.prepare import COMPRESSOR_SAMPLE_BYTES, prepare


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="text to prepare (default: generated stories)")
    p.add_argument("--stories", type=int, default=55_000, help="generated stories when --data is not given (~20 MB)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizers", default="bpe,char", help="comma-separated, of bpe and char")
    p.add_argument("--rounds", type=int, default=1, help="preparations of each kind, with and without the bounds")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(args.data) if args.data else Path(tmp) / "stories.txt"
        if not args.data:
            write_stories(source, args.stories, seed=0)
        mb = source.stat().st_size / 1e6
        results = {
            "date": time.strftime("%Y-%m-%d"),
            "source": str(args.data or f"{args.stories} generated stories"),
            "mb": round(mb, 2),
            "rounds": args.rounds,
        }
        for kind in args.tokenizers.split(","):
            seconds = {True: [], False: []}
            for r in range(args.rounds):
                for bounds in (True, False) if r % 2 == 0 else (False, True):
                    out = Path(tmp) / f"{kind}_{r}_{bounds}"
                    start = time.perf_counter()
                    data = prepare(
                        source,
                        out,
                        kind,
                        args.vocab_size,
                        progress=False,
                        log=lambda *_: None,
                        compressor_sample_bytes=COMPRESSOR_SAMPLE_BYTES if bounds else 0,
                    )
                    seconds[bounds].append(time.perf_counter() - start)
                    if bounds:
                        meta = data.meta
                    shutil.rmtree(out)
            with_bounds, without = statistics.median(seconds[True]), statistics.median(seconds[False])
            results[kind] = {
                "seconds": round(with_bounds, 2),
                "mb_per_s": round(mb / with_bounds, 2),
                "seconds_as_a_training_run_prepares": round(without, 2),
                "mb_per_s_as_a_training_run_prepares": round(mb / without, 2),
                "tokens": meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"],
                "compressor_bpb": meta["compressor_bpb"],
            }
    results["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
