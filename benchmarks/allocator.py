"""What the C allocator costs a CPU step: freed buffers given back to the kernel, or kept.

Every training step allocates and frees the same large buffers. glibc's malloc gives freed
blocks above a threshold back to the kernel, and the next step maps them again as fresh pages
that the kernel faults in and zeroes one at a time. ``nanolm train`` raises the thresholds on a
CPU under ``--process-tuning auto`` (``nanolm.instruments.process.keep_freed_memory_for_reuse``)
so that the blocks stay in the process.

Each configuration runs in its own fresh process (the allocator's state is per process), with
the blocks kept (what ``nanolm train`` does) or given back (glibc's default), alternated
round by round; each process times ``--steps`` forward and backward passes of one model after
two warm-up passes, and reports their median. By default: the TinyStories speedrun's model
(3 layers of width 128, BPE 4,096, 16 × 128 tokens, bf16 autocast where the CPU has native
bf16) with and without QK-norm.

    python benchmarks/allocator.py                   # 2 threads, 3 rounds
    python benchmarks/allocator.py --threads 1 --precision fp32 --vocab 65 --seq-len 64 --batch 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one_process(args) -> None:
    """Inside the child: set up as training does, time the passes, print the median in ms."""
    import torch

    from nanolm.batches import Batch
    from nanolm.instruments.process import keep_freed_memory_for_reuse
    from nanolm.model import GPT, GPTConfig
    from nanolm.precision import resolve_precision
    from nanolm.step import accumulate_gradients

    torch.set_num_threads(args.threads)
    kept = args.keep == "1" and keep_freed_memory_for_reuse(torch.device("cpu"))
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=args.vocab,
            seq_len=args.seq_len,
            n_layer=args.layers,
            n_head=4,
            n_embd=args.width,
            qk_norm=args.qk_norm,
        )
    )
    idx, targets = torch.randint(args.vocab, (2, args.batch, args.seq_len))
    doc_ids = (torch.arange(args.seq_len) >= args.seq_len // 2).int().expand_as(idx).contiguous()
    batch = Batch(idx, targets, torch.ones_like(idx, dtype=torch.bool), doc_ids)
    autocast = resolve_precision(args.precision, torch.device("cpu")).autocast
    times = []
    for i in range(args.steps + 2):
        start = time.perf_counter()
        accumulate_gradients(model, [batch], idx.numel(), autocast)
        model.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - start)
    print(json.dumps({"kept": kept, "ms": round(statistics.median(times) * 1e3, 2)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per configuration, alternated")
    p.add_argument("--steps", type=int, default=10, help="timed forward and backward passes per process")
    p.add_argument("--precision", default="auto", help="auto: bf16 autocast where the CPU multiplies bf16 natively")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--qk-norm", default="off,on", help="comma-separated: off, on")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--keep", default="1", help=argparse.SUPPRESS)  # the child's: 1 keeps freed blocks, 0 does not
    args = p.parse_args()
    if args.child:
        args.qk_norm = args.qk_norm == "on"
        one_process(args)
        return
    shape = [
        "--threads",
        str(args.threads),
        "--steps",
        str(args.steps),
        "--precision",
        args.precision,
        "--vocab",
        str(args.vocab),
        "--seq-len",
        str(args.seq_len),
        "--batch",
        str(args.batch),
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
    ]
    configs = [(qk, keep) for qk in args.qk_norm.split(",") for keep in ("1", "0")]
    runs: dict = {c: [] for c in configs}
    for r in range(args.rounds):
        for qk, keep in configs if r % 2 == 0 else list(reversed(configs)):
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--keep", keep, "--qk-norm", qk, *shape],
                check=True,
                capture_output=True,
                text=True,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            ).stdout
            runs[(qk, keep)].append(json.loads(out.strip().splitlines()[-1]))
    results = []
    for qk in args.qk_norm.split(","):
        kept, given_back = (statistics.median(r["ms"] for r in runs[(qk, k)]) for k in ("1", "0"))
        results.append(
            {
                "qk_norm": qk,
                "kept_ms": kept,
                "given_back_ms": given_back,
                "applied": all(r["kept"] for r in runs[(qk, "1")]),
                "speedup_kept": round(given_back / kept, 2),
                "kept_ms_each": [r["ms"] for r in runs[(qk, "1")]],
                "given_back_ms_each": [r["ms"] for r in runs[(qk, "0")]],
            }
        )
    print(
        json.dumps(
            {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "shape": shape, "results": results}, indent=2
        )
    )


if __name__ == "__main__":
    main()
