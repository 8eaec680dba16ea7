"""The output head and the loss, whole or in chunks: what the vocabulary size costs a step.

A step ends with the output head (hidden states × the vocabulary matrix) and the cross-entropy
over its logits. For one micro-batch of the TinyStories config (16 × 128 tokens) the fp32
logits are 8 MB at a vocabulary of 1,024, 16 MB at 2,048 and 33 MB at 4,096: past the CPU's
last-level cache, every pass over them (the upcast to fp32, log-softmax, its gradient, the cast
back) goes to main memory, and the cost grows faster than the vocabulary. Computing the head
and the loss a few hundred rows at a time keeps each chunk's logits in cache.

This script times the head and nanolm's loss (``masked_cross_entropy_sum``), forward and
backward, on random hidden states, for each vocabulary size: *whole* (what a training step does
today) and *chunked* (the same rows, ``--rows`` at a time, each chunk's backward run at once),
alternated round by round; it also checks that both give the same loss and gradients. It
measures the lead for a fused, chunked head-and-loss; nanolm's step does not chunk yet.

    python benchmarks/head_and_loss.py                       # vocabularies 1024, 2048, 4096
    python benchmarks/head_and_loss.py --vocab 8192 --precision fp32 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

from nanolm.loss import masked_cross_entropy_sum


def head_and_loss(hidden, weight, targets, autocast, rows: int | None) -> None:
    """Forward and backward of the head and the summed loss, over all rows or ``rows`` at a time."""
    step = rows or hidden.shape[0]
    for start in range(0, hidden.shape[0], step):
        with autocast():
            logits = hidden[start : start + step] @ weight.t()
        total, _ = masked_cross_entropy_sum(logits, targets[start : start + step])
        total.backward()


def measure(vocab: int, tokens: int, width: int, rows: int, autocast, rounds: int) -> dict:
    torch.manual_seed(0)
    weight = (torch.randn(vocab, width) * 0.02).requires_grad_()
    hidden = torch.randn(tokens, width).requires_grad_()
    targets = torch.randint(vocab, (tokens,))
    grads = {}
    for name, chunk in (("whole", None), ("chunked", rows)):
        weight.grad = hidden.grad = None
        head_and_loss(hidden, weight, targets, autocast, chunk)
        grads[name] = (hidden.grad.clone(), weight.grad.clone())
    # the same up to the matmul's own rounding: bf16 rounds each chunk's product, not the whole one's
    tolerance = 1e-2 if autocast is not contextlib.nullcontext else 1e-5
    same = all(float((a - b).norm() / b.norm()) < tolerance for a, b in zip(grads["whole"], grads["chunked"]))
    times = {"whole": [], "chunked": []}
    for i in range(rounds):
        for name, chunk in ((("whole", None), ("chunked", rows)) if i % 2 == 0 else (("chunked", rows), ("whole", None))):
            weight.grad = hidden.grad = None
            start = time.perf_counter()
            head_and_loss(hidden, weight, targets, autocast, chunk)
            times[name].append(time.perf_counter() - start)
    whole, chunked = (statistics.median(times[n]) for n in ("whole", "chunked"))
    return {"vocab": vocab, "logits_mb_fp32": round(tokens * vocab * 4 / 2**20, 1), "whole_ms": round(whole * 1e3, 2),
            "chunked_ms": round(chunked * 1e3, 2), "speedup_chunked": round(whole / chunked, 2),
            "same_gradients": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", default="1024,2048,4096", help="comma-separated vocabulary sizes")
    p.add_argument("--tokens", type=int, default=16 * 128, help="rows: tokens of one micro-batch (TinyStories: 16 × 128)")
    p.add_argument("--width", type=int, default=128, help="n_embd")
    p.add_argument("--rows", type=int, default=256, help="rows per chunk")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="the head's matmul under CPU autocast or not")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.precision == "bf16" else contextlib.nullcontext
    results = [measure(int(v), args.tokens, args.width, args.rows, autocast, args.rounds) for v in args.vocab.split(",")]
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cpu": f"{os.cpu_count()} cores",
                      "threads": args.threads, "precision": args.precision, "tokens": args.tokens, "width": args.width,
                      "rows_per_chunk": args.rows, "results": results}, indent=2))


if __name__ == "__main__":
    main()
