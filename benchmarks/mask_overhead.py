"""Step time with the document mask vs plain causal attention, same shape, same process.

Runs the real training step (packing, forward, masked loss, backward, AdamW) on the
built-in story corpus, alternating mask-on and mask-off rounds so that machine noise
hits both alike, and prints JSON with the median step times and their ratio.

    python benchmarks/mask_overhead.py                # nanoGPT's CPU shape
    python benchmarks/mask_overhead.py --seq-len 256 --n-embd 256 --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nanolm.batches import WindowSampler, pack_windows
from nanolm.data.corpus import write_stories
from nanolm.data.prepare import boundary_crossing_windows, prepare
from nanolm.model import GPT, GPTConfig
from nanolm.optim import build_optimizer
from nanolm.step import StepSetup, train_step


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=20, help="steps per round")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        write_stories(Path(tmp) / "s.txt", 2000, seed=0)
        data = prepare(
            Path(tmp) / "s.txt", Path(tmp) / "d", "bpe", args.vocab_size, progress=False, log=lambda *_: None
        )
        tokens = data.train.tokens.copy()
    eos = data.tokenizer.eos_id
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=data.tokenizer.vocab_size,
            seq_len=args.seq_len,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
        )
    )
    setup = StepSetup(model, build_optimizer(model, 1e-3, 0.1), schedule=lambda step: 1e-3, clip=1.0)
    sampler = WindowSampler(len(tokens), args.seq_len, args.batch_size, seed=0)

    def run(doc_mask: bool, steps: int) -> float:
        start = time.perf_counter()
        for i in range(steps):
            batch = pack_windows(tokens, sampler.next_starts(), args.seq_len, eos, doc_mask=doc_mask)
            train_step(setup, i + 1, [batch])  # the training loop's own step
        return (time.perf_counter() - start) / steps

    run(True, 5), run(False, 5)  # warm up both paths
    times = {True: [], False: []}
    for r in range(args.rounds):
        for mask in (True, False) if r % 2 == 0 else (False, True):
            times[mask].append(run(mask, args.steps))
    on, off = statistics.median(times[True]), statistics.median(times[False])
    tokens_per_step = args.batch_size * args.seq_len
    crossing, windows = boundary_crossing_windows(data.train.doc_starts, len(tokens), args.seq_len)
    print(
        json.dumps(
            {
                "shape": vars(args),
                "threads": torch.get_num_threads(),
                "mask_on_ms_per_step": round(on * 1e3, 2),
                "mask_off_ms_per_step": round(off * 1e3, 2),
                "mask_on_tokens_per_sec": round(tokens_per_step / on),
                "mask_off_tokens_per_sec": round(tokens_per_step / off),
                "ratio_on_over_off": round(on / off, 3),
                "windows_crossing_a_document_boundary": round(crossing / windows, 3),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
