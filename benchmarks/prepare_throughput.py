"""Throughput of ``nanolm prepare`` (MB of text per second), BPE and char.

    python benchmarks/prepare_throughput.py                       # 20 MB of generated stories
    python benchmarks/prepare_throughput.py --data path/to/corpus.txt
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from nanolm.corpus import write_stories
from nanolm.data import prepare


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="text to prepare (default: generated stories)")
    p.add_argument("--stories", type=int, default=55_000, help="generated stories when --data is not given (~20 MB)")
    p.add_argument("--vocab-size", type=int, default=4096)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(args.data) if args.data else Path(tmp) / "stories.txt"
        if not args.data:
            write_stories(source, args.stories, seed=0)
        mb = source.stat().st_size / 1e6
        results = {"source": str(args.data or f"{args.stories} generated stories"), "mb": round(mb, 2)}
        for kind in ("bpe", "char"):
            start = time.perf_counter()
            data = prepare(source, Path(tmp) / kind, kind, args.vocab_size, progress=False, log=lambda *_: None)
            seconds = time.perf_counter() - start
            results[kind] = {
                "seconds": round(seconds, 2),
                "mb_per_s": round(mb / seconds, 2),
                "tokens": data.meta["splits"]["train"]["tokens"] + data.meta["splits"]["val"]["tokens"],
                "compressor_bpb": data.meta["compressor_bpb"],
            }
    results["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
