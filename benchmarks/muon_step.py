"""What one Muon step costs: PyTorch's ``torch.optim.Muon`` (one matrix at a time) against
nanolm's ``GroupedMuon`` (the matrices of one shape together), and AdamW's step for scale.

Each optimizer updates its own copy of the same model's parameters from the same gradients,
alternated step by step in one process, so that the machine's noise hits all of them alike;
the figures are medians. The last lines compare the weights both Muons leave.
By default: the TinyStories speedrun's model (3 layers of width 128: 15 hidden matrices of
4 shapes).

    python benchmarks/muon_step.py
    python benchmarks/muon_step.py --layers 6 --width 384 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from nanolm.model import GPT, GPTConfig
from nanolm.muon import GroupedMuon
from nanolm.optim import build_optimizer, muon_available, split_for_muon


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="timed steps of each optimizer, alternated")
    args = p.parse_args()
    if not muon_available():
        raise SystemExit("muon_step.py: torch.optim.Muon needs PyTorch 2.9 or later")
    torch.set_num_threads(args.threads)
    config = GPTConfig(vocab_size=args.vocab, seq_len=128, n_layer=args.layers, n_head=max(1, args.width // 32),
                       n_embd=args.width, qk_norm=True)
    models = {}
    for name in ("torch_muon", "grouped_muon", "adamw"):
        torch.manual_seed(0)
        models[name] = GPT(config)
    options = dict(lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    optimizers = {"torch_muon": torch.optim.Muon(split_for_muon(models["torch_muon"]), **options),
                  "grouped_muon": GroupedMuon(split_for_muon(models["grouped_muon"]), **options),
                  "adamw": build_optimizer(models["adamw"], 3e-3, 0.1)}
    generator = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for step in range(args.steps + 3):
        grads = [torch.randn(p.shape, generator=generator) * 1e-2 for p in models["adamw"].parameters()]
        order = list(optimizers) if step % 2 == 0 else list(reversed(optimizers))
        for name in order:
            for p, g in zip(models[name].parameters(), grads):
                p.grad = g.clone()
            start = time.perf_counter()
            optimizers[name].step()
            if step >= 3:
                times[name].append(time.perf_counter() - start)
    ms = {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}
    pairs = list(zip(models["torch_muon"].parameters(), models["grouped_muon"].parameters()))
    same = all(torch.equal(a, b) for a, b in pairs)
    largest_difference = max((a - b).abs().max().item() for a, b in pairs)
    shapes = sorted({tuple(p.shape) for p in split_for_muon(models["grouped_muon"])})
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cpus": os.cpu_count(), "threads": args.threads,
        "matrices": len(split_for_muon(models["grouped_muon"])), "shapes": shapes,
        "step_ms": ms, "grouped_over_torch": round(ms["torch_muon"] / ms["grouped_muon"], 2),
        "grouped_over_adamw": round(ms["grouped_muon"] / ms["adamw"], 2),
        "same_weights_to_the_bit": same, "largest_weight_difference": largest_difference}, indent=2))


if __name__ == "__main__":
    main()
