"""What one Muon step costs: PyTorch's ``torch.optim.Muon`` (one matrix at a time) against
nanolm's ``GroupedMuon`` (the matrices of one shape together), and AdamW's step for scale.

Each optimizer updates its own copy of the same model's parameters from the same gradients,
alternated step by step in one process, so that the machine's noise hits all of them alike;
the figures are medians. The last lines compare the weights both Muons leave, against what the
two may differ by: PyTorch's Muon orthogonalises in bf16 everywhere, GroupedMuon in fp32 on a CPU
without bf16 units (``GroupedMuon.newton_schulz_dtype``), so there the two updates differ by bf16's
rounding, and on any other machine only by the order of the sums inside a batched product.
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
from nanolm.optim import GroupedMuon, build_optimizer, muon_available, split_for_muon


def rounding_bound(formats: tuple[torch.dtype, torch.dtype], ns_steps: int) -> float:
    """How far apart the two Muons' weights may be, relative to the path the weights travelled.

    Both start from the same momentum (fp32 in both), so the updates differ only in the
    Newton-Schulz iteration. In two formats: each iteration rounds its three products and the
    input is rounded once, each rounding at most the format's unit roundoff relative (bf16:
    2^-8), and the iteration pulls the singular values back to its fixed interval instead of
    amplifying what came before; so each step's update differs by at most (1 + 3 * steps) *
    (u_a + u_b) of its size, and the weights by that share of the sum of the steps' sizes
    (weight decay only shrinks a difference). In one format the same products run on the same
    numbers, batched or one at a time: only the order of fp32 sums inside a product may differ,
    and the bound is the one ``tests/test_optim.py`` holds the two to step by step.
    """
    if formats[0] == formats[1]:
        return 1e-3
    return (1 + 3 * ns_steps) * sum(torch.finfo(f).eps / 2 for f in formats)


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
    config = GPTConfig(
        vocab_size=args.vocab,
        seq_len=128,
        n_layer=args.layers,
        n_head=max(1, args.width // 32),
        n_embd=args.width,
        qk_norm=True,
    )
    models = {}
    for name in ("torch_muon", "grouped_muon", "adamw"):
        torch.manual_seed(0)
        models[name] = GPT(config)
    options = dict(lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    optimizers = {
        "torch_muon": torch.optim.Muon(split_for_muon(models["torch_muon"]), **options),
        "grouped_muon": GroupedMuon(split_for_muon(models["grouped_muon"]), **options),
        "adamw": build_optimizer(models["adamw"], 3e-3, 0.1),
    }
    generator = torch.Generator().manual_seed(1)
    muon_params = {name: split_for_muon(models[name]) for name in ("torch_muon", "grouped_muon")}
    travelled = [0.0] * len(muon_params["torch_muon"])  # the sum of each matrix's step sizes
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for step in range(args.steps + 3):
        grads = [torch.randn(p.shape, generator=generator) * 1e-2 for p in models["adamw"].parameters()]
        order = list(optimizers) if step % 2 == 0 else list(reversed(optimizers))
        before = [p.detach().clone() for p in muon_params["torch_muon"]]
        for name in order:
            for p, g in zip(models[name].parameters(), grads):
                p.grad = g.clone()
            start = time.perf_counter()
            optimizers[name].step()
            if step >= 3:
                times[name].append(time.perf_counter() - start)
        for i, (b, p) in enumerate(zip(before, muon_params["torch_muon"])):
            travelled[i] += (p - b).norm().item()
    ms = {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}
    pairs = list(zip(models["torch_muon"].parameters(), models["grouped_muon"].parameters()))
    same = all(torch.equal(a, b) for a, b in pairs)
    largest_difference = max((a - b).abs().max().item() for a, b in pairs)
    relative = max((a - b).norm().item() / path for a, b, path in zip(*muon_params.values(), travelled))
    grouped_format = optimizers["grouped_muon"].newton_schulz_dtype(torch.device("cpu"))
    formats = (torch.bfloat16, grouped_format)  # torch.optim.Muon: bf16 on every device
    ns_steps = optimizers["grouped_muon"].param_groups[0]["ns_steps"]
    shapes = sorted({tuple(p.shape) for p in muon_params["grouped_muon"]})
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "torch": torch.__version__,
                "cpus": os.cpu_count(),
                "threads": args.threads,
                "matrices": len(split_for_muon(models["grouped_muon"])),
                "shapes": shapes,
                "step_ms": ms,
                "grouped_over_torch": round(ms["torch_muon"] / ms["grouped_muon"], 2),
                "grouped_over_adamw": round(ms["grouped_muon"] / ms["adamw"], 2),
                "same_weights_to_the_bit": same,
                "largest_weight_difference": largest_difference,
                "orthogonalisation_format": {
                    "torch_muon": str(formats[0]).removeprefix("torch."),
                    "grouped_muon": str(formats[1]).removeprefix("torch."),
                },
                "relative_weight_difference": relative,
                "rounding_bound": rounding_bound(formats, ns_steps),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
