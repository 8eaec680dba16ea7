"""The output head and the loss, whole or in chunks: what the vocabulary size costs a step.

A step ends with the output head (hidden states × the vocabulary matrix) and the cross-entropy
over its logits. For one micro-batch of the TinyStories config (16 × 128 tokens) the fp32
logits are 8 MB at a vocabulary of 1,024, 16 MB at 2,048 and 33 MB at 4,096: past the CPU's
last-level cache, every pass over them (the upcast to fp32, log-softmax, its gradient, the cast
back) goes to main memory, and the cost grows faster than the vocabulary. Computing the head
and the loss a few hundred rows at a time keeps each chunk's logits in cache.

This script times the head and the loss, forward and backward, on random hidden states, for
each vocabulary size: *whole* (the logits of every position at once, then
``masked_cross_entropy_sum``: what nanolm's step did before it fused them) and *fused*
(``head_cross_entropy_sum``, what the step does now: ``--rows`` positions at a time, each
chunk's gradient computed while its logits are in cache; ``--rows 0`` is nanolm's own choice,
``loss_chunk_positions``), alternated round by round; it also checks that both give the same
loss and gradients. Then the same comparison for a whole forward and backward pass of the
TinyStories model at that vocabulary (``step_*``): what the fusion is worth to a training step.

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

from nanolm.batches import Batch
from nanolm.fused_loss import head_cross_entropy_sum, loss_chunk_positions
from nanolm.model import GPT, GPTConfig, masked_cross_entropy_sum
from nanolm.step import accumulate_gradients, summed_token_loss


def head_and_loss(hidden, weight, targets, autocast, rows: int | None) -> None:
    """Forward and backward of the head and the summed loss: the logits whole (``rows`` None) or fused."""
    with autocast():
        if rows is None:
            total, _ = masked_cross_entropy_sum(hidden @ weight.t(), targets)
        else:
            total, _ = head_cross_entropy_sum(hidden, weight, targets, chunk=rows)
    total.backward()


def timed(fn, device: str) -> float:
    """Seconds ``fn()`` takes, waiting for a GPU's queued work to finish."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def peak_memory_mb(fn, device: str) -> float | None:
    """The most GPU memory allocated while ``fn()`` runs (None on a CPU)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round(torch.cuda.max_memory_allocated() / 2**20, 1)


def measure(vocab: int, tokens: int, width: int, rows: int, autocast, rounds: int, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    weight = (torch.randn(vocab, width, device=device) * 0.02).requires_grad_()
    hidden = torch.randn(tokens, width, device=device).requires_grad_()
    targets = torch.randint(vocab, (tokens,), device=device)
    grads = {}
    for name, chunk in (("whole", None), ("fused", rows)):
        weight.grad = hidden.grad = None
        head_and_loss(hidden, weight, targets, autocast, chunk)
        grads[name] = (hidden.grad.clone(), weight.grad.clone())
    # the same up to rounding: bf16 rounds each chunk's products, and the fused head scales its gradients after
    tolerance = 1e-2 if autocast is not contextlib.nullcontext else 1e-5
    same = all(float((a - b).norm() / b.norm()) < tolerance for a, b in zip(grads["whole"], grads["fused"]))
    times = {"whole": [], "fused": []}
    for i in range(rounds):
        for name, chunk in (("whole", None), ("fused", rows)) if i % 2 == 0 else (("fused", rows), ("whole", None)):
            weight.grad = hidden.grad = None
            times[name].append(timed(lambda: head_and_loss(hidden, weight, targets, autocast, chunk), device))
    # to the microsecond, and the speedup is of the two figures printed: on a small problem each is
    # a fraction of a millisecond, where rounding to 0.01 ms would move the ratio by several percent
    whole, fused = (round(statistics.median(times[n]) * 1e3, 3) for n in ("whole", "fused"))
    peaks = {
        f"peak_mb_{name}": peak_memory_mb(lambda: head_and_loss(hidden, weight, targets, autocast, chunk), device)
        for name, chunk in (("whole", None), ("fused", rows))
    }
    return {
        "vocab": vocab,
        "rows_per_chunk": rows or loss_chunk_positions(vocab, device),
        **peaks,
        "logits_mb_fp32": round(tokens * vocab * 4 / 2**20, 1),
        "whole_ms": whole,
        "fused_ms": fused,
        "speedup_fused": round(whole / fused, 2),
        "same_gradients": same,
        **measure_step(vocab, tokens, width, rows, autocast, rounds, device),
    }


def loss_of_whole_logits(model, batch):
    """The step's loss as it was before the fusion: every logit at once, then the masked loss."""
    logits, _ = model(batch.idx, doc_ids=batch.doc_ids, positions=batch.positions)
    return masked_cross_entropy_sum(logits, batch.targets, batch.loss_mask)[0]


def measure_step(vocab: int, tokens: int, width: int, rows: int, autocast, rounds: int, device: str = "cpu") -> dict:
    """A whole forward and backward pass of the TinyStories model (4 blocks, context 128, two
    documents per window) at this vocabulary: its loss from the whole logits, or fused."""
    seq_len = min(128, tokens)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, seq_len=seq_len, n_layer=4, n_head=4, n_embd=width, loss_chunk=rows)).to(
        device
    )
    idx, targets = torch.randint(vocab, (2, tokens // seq_len, seq_len), device=device)
    doc_ids = (torch.arange(seq_len, device=device) >= seq_len // 2).int().expand_as(idx).contiguous()
    batch = Batch(idx, targets, torch.ones_like(idx, dtype=torch.bool), doc_ids)
    times = {"whole": [], "fused": []}
    for i in range(rounds):
        for name in ("whole", "fused") if i % 2 == 0 else ("fused", "whole"):
            loss_fn = loss_of_whole_logits if name == "whole" else summed_token_loss
            times[name].append(
                timed(lambda: accumulate_gradients(model, [batch], idx.numel(), autocast, loss_fn=loss_fn), device)
            )
            model.zero_grad(set_to_none=True)
    whole, fused = (round(statistics.median(times[n]) * 1e3, 2) for n in ("whole", "fused"))
    return {"step_whole_ms": whole, "step_fused_ms": fused, "step_speedup_fused": round(whole / fused, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", default="1024,2048,4096", help="comma-separated vocabulary sizes")
    p.add_argument(
        "--tokens", type=int, default=16 * 128, help="rows: tokens of one micro-batch (TinyStories: 16 × 128)"
    )
    p.add_argument("--width", type=int, default=128, help="n_embd")
    p.add_argument("--rows", type=int, default=0, help="positions per chunk (0: nanolm's choice for each vocabulary)")
    p.add_argument(
        "--precision", choices=["bf16", "fp32"], default="bf16", help="the head's matmul under autocast or not"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda also reports the peak memory of each (peak_mb_*): what chunking saves on a GPU",
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this PyTorch sees no CUDA GPU; run on a GPU machine or drop --device")
    torch.set_num_threads(args.threads)
    autocast = (
        (lambda: torch.autocast(args.device, dtype=torch.bfloat16))
        if args.precision == "bf16"
        else contextlib.nullcontext
    )
    results = [
        measure(int(v), args.tokens, args.width, args.rows, autocast, args.rounds, args.device)
        for v in args.vocab.split(",")
    ]
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "torch": torch.__version__,
                "cpu": f"{os.cpu_count()} cores",
                "device": args.device,
                "threads": args.threads,
                "precision": args.precision,
                "tokens": args.tokens,
                "width": args.width,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
