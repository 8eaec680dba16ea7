"""What nanolm's step buys per step: the plain loop against nanolm, trained to a loss, in one process.

``benchmarks/throughput.py`` prices a step: at nanoGPT's CPU shape in fp32, eager, nanolm's step
runs at ~0.93x the plain loop a user would write (RoPE and RMSNorm have no fused CPU kernel). A
user does not wait for a step but for a loss. This script trains three models with the same
recipe on the same data and compares their validation loss step by step:

* ``reference``: the plain loop of ``throughput.py`` with nanoGPT's model as its ``train.py``
  trains it (GPT-2 blocks without biases, learned positions, LayerNorm, GELU, nanoGPT's
  initialisation; random windows; ``F.cross_entropy``; ``torch.optim.AdamW`` with nanoGPT's
  parameter groups: every matrix and embedding decayed, norm gains not);
* ``nanolm_model``: nanolm's ``GPT`` (RoPE, RMSNorm, SwiGLU) in that very loop, same
  optimizer and groups, same random windows: what the model alone changes;
* ``nanolm_model_gelu`` (on request, ``--models``): ``nanolm_model`` with a GELU MLP 4x wide in
  place of SwiGLU (``--mlp gelu``, about as many parameters): SwiGLU's share of the difference;
* ``nanolm``: nanolm's training step (``train_step`` on ``TrainBatches``: every window once per
  epoch, the document mask, the loss divided by the step's token count, nanolm's AdamW and its
  groups, which do not decay embeddings): what the rest of nanolm changes on top.

The recipe is nanoGPT's CPU recipe for tiny-shakespeare: 4 layers, 4 heads, width 128, context
64, batch 12, AdamW at 1e-3 with betas (0.9, 0.99) and weight decay 0.1, clipping at 1.0, 100
warmup steps, then a cosine to 1e-4 at ``--steps`` (2,000), fp32. Each model starts from its own
seed's initialisation and draws its own windows; all three are evaluated on the same fixed
windows tiling the held-out split (the last 10 % of the text), every ``--eval-every`` steps.
The models train one after the other, so the step times (medians of the stretches between
evaluations) are of different minutes of a shared machine: ``throughput.py``, which alternates
its runners, is the measure of speed; this one is the measure of loss per step.

Prints JSON: for each seed and model, the validation curve (nats per token and bits per byte),
the first evaluated step at or below ``--target`` bits per byte, and the median milliseconds per
step; then, over the seeds, the median of those.

    python benchmarks/loss_per_step.py --data tinyshakespeare.txt               # 3 seeds, ~20 min on 2 cores
    python benchmarks/loss_per_step.py --data tinyshakespeare.txt --seeds 1337 --eval-every 100
    python benchmarks/loss_per_step.py --steps 30 --eval-every 10 --seeds 1 --val-windows 64   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # beside throughput.py, also when run by runpy
from throughput import SHAPES, RefGPT  # the plain loop's model, written once

from nanolm.batches import TrainBatches, WindowSampler, get_batch
from nanolm.data.corpus import write_stories
from nanolm.data.prepare import prepare
from nanolm.errors import NanolmError
from nanolm.instruments.process import keep_freed_memory_for_reuse
from nanolm.model import GPT, GPTConfig
from nanolm.optim import build_optimizer
from nanolm.step import StepSetup, cosine_lr, train_step

MODELS = ("reference", "nanolm_model", "nanolm")
OPTIONAL = ("nanolm_model_gelu",)


def nanogpt_optimizer(model: torch.nn.Module, lr: float, betas, weight_decay: float) -> torch.optim.AdamW:
    """nanoGPT's ``configure_optimizers``: every tensor of two or more dimensions decayed
    (matrices and embeddings alike), the rest (biases, norm gains) not; PyTorch's AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


class Trainee:
    """One model and the loop that trains it: ``step(n)`` takes optimizer step n (1 for the first)
    at the recipe's rate; ``loss(x, y)`` is its mean cross-entropy, for the evaluation."""

    def __init__(self, name: str, args, vocab: int, train_tokens: np.ndarray, eos: int, seed: int):
        shape = SHAPES["nanogpt"]
        self.name, self.shape, self.tokens = name, shape, train_tokens
        self.lr = lambda step: cosine_lr(step, args.lr, args.warmup, args.steps, args.lr / 10)
        betas = (0.9, args.beta2)
        torch.manual_seed(seed)
        if name == "reference":
            self.model = RefGPT(vocab, shape["seq_len"], shape["n_layer"], shape["n_head"], shape["n_embd"], bias=False)
        else:
            self.model = GPT(
                GPTConfig(
                    vocab_size=vocab,
                    seq_len=shape["seq_len"],
                    n_layer=shape["n_layer"],
                    n_head=shape["n_head"],
                    n_embd=shape["n_embd"],
                    mlp="gelu" if name == "nanolm_model_gelu" else "swiglu",
                )
            )
        if name == "nanolm":
            optimizer = build_optimizer(self.model, args.lr, args.weight_decay, betas=betas)
            self.parts = StepSetup(self.model, optimizer, schedule=self.lr, clip=1.0)
            sampler = WindowSampler(len(train_tokens), shape["seq_len"], shape["batch_size"], seed=seed)
            self.batches = TrainBatches(train_tokens, sampler, shape["seq_len"], eos)
        else:
            self.optimizer = nanogpt_optimizer(self.model, args.lr, betas, args.weight_decay)
            self.generator = torch.Generator().manual_seed(seed)

    def loss(self, x, y) -> torch.Tensor:
        if self.name == "reference":
            return self.model(x, y)
        return self.model(x, targets=y)[1]

    def step(self, n: int) -> None:
        if self.name == "nanolm":
            train_step(self.parts, n, self.batches.next(n))
            return
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(n)
        x, y = get_batch(self.tokens, self.shape["batch_size"], self.shape["seq_len"], self.generator)
        self.loss(x, y).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate(trainee: Trainee, windows: torch.Tensor, token_bytes: torch.Tensor, batch_size: int) -> dict:
    """Mean nats per token and bits per byte over fixed windows (every target counted once)."""
    trainee.model.eval()
    nats = 0.0
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size]
        nats += trainee.loss(w[:, :-1], w[:, 1:]).item() * w[:, 1:].numel()
    trainee.model.train()
    targets = windows[:, 1:]
    n_bytes = int(token_bytes[targets].sum())
    return {"loss": round(nats / targets.numel(), 4), "bpb": round(nats / math.log(2) / max(n_bytes, 1), 4)}


def train_and_evaluate(trainee: Trainee, args, windows, token_bytes) -> dict:
    curve = [{"step": 0, **evaluate(trainee, windows, token_bytes, 64)}]
    ms_per_step = []
    for start in range(1, args.steps + 1, args.eval_every):
        end = min(start + args.eval_every - 1, args.steps)
        t0 = time.perf_counter()
        for n in range(start, end + 1):
            trainee.step(n)
        ms_per_step.append(1000 * (time.perf_counter() - t0) / (end - start + 1))
        curve.append({"step": end, **evaluate(trainee, windows, token_bytes, 64)})
    reached = next((c["step"] for c in curve if c["bpb"] <= args.target), None)
    return {"curve": curve, "reached_target_at_step": reached, "ms_per_step": round(statistics.median(ms_per_step), 1)}


def load_data(data: str | None, tmp: Path):
    """The text prepared with a char tokenizer (the recipe's): train tokens, fixed validation
    windows tiling the held-out split, the bytes each token spells, the vocabulary, EOS."""
    source = Path(data) if data else tmp / "stories.txt"
    if not data:
        write_stories(source, 3000, seed=0)
    prepared = prepare(source, tmp / "prepared", "char", progress=False, log=lambda *_: None)
    T = SHAPES["nanogpt"]["seq_len"]
    val = torch.from_numpy(np.array(prepared.val.tokens, dtype=np.int64))
    n = (len(val) - 1) // T
    if n < 1 or len(prepared.train) < T + 1:
        raise NanolmError(
            f"{source} is too short: each split needs a window of {T + 1} characters (the training "
            f"split holds {len(prepared.train)}, the held-out one {len(val)}); use a longer text"
        )
    windows = torch.stack([val[i * T : i * T + T + 1] for i in range(n)])
    token_bytes = torch.from_numpy(prepared.tokenizer.token_bytes()).long()
    return (
        np.array(prepared.train.tokens),
        windows,
        token_bytes,
        prepared.tokenizer.vocab_size,
        prepared.tokenizer.eos_id,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--data", default=None, help="a text file (tiny-shakespeare for the recipe); default: the built-in story corpus"
    )
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps; the cosine ends there (nanoGPT's 2,000)")
    p.add_argument("--eval-every", type=int, default=250, help="steps between evaluations (nanoGPT's 250)")
    p.add_argument("--seeds", default="1337,1,2", help="comma-separated seeds: each model's initialisation and windows")
    p.add_argument("--models", default=",".join(MODELS), help=f"which of {', '.join(MODELS + OPTIONAL)}")
    p.add_argument(
        "--target",
        type=float,
        default=2.72,
        help="validation bits per byte whose first crossing is reported "
        "(2.72: where nanoGPT's recipe ends on tiny-shakespeare)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help="peak learning rate of every model (nanoGPT's 1e-3); the cosine ends at a tenth of it",
    )
    p.add_argument("--beta2", type=float, default=0.99, help="AdamW's beta2 (nanoGPT's 0.99 for this recipe)")
    p.add_argument(
        "--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay on the decayed group"
    )
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps (nanoGPT's 100)")
    p.add_argument(
        "--val-windows",
        type=int,
        default=0,
        help="evaluate on this many windows, evenly spaced over the "
        "held-out split (0: all of them, every target counted once)",
    )
    p.add_argument("--threads", type=int, default=0, help="PyTorch threads (0: PyTorch's default)")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS + OPTIONAL]
    if unknown or not models:
        p.error(f"--models takes {', '.join(MODELS + OPTIONAL)}; got {args.models!r}")
    if args.steps < 1 or args.eval_every < 1 or args.val_windows < 0:
        p.error("--steps and --eval-every must be positive, --val-windows at least 0")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers; got {args.seeds!r}")
    if args.data and not Path(args.data).is_file():
        p.error(f"--data {args.data}: not a file")
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory_for_reuse(torch.device("cpu"))  # as a nanolm run does, for every model alike

    with tempfile.TemporaryDirectory() as tmp:
        try:
            train_tokens, windows, token_bytes, vocab, eos = load_data(args.data, Path(tmp))
        except NanolmError as e:
            p.error(str(e))
    if args.val_windows and args.val_windows < len(windows):
        windows = windows[np.linspace(0, len(windows) - 1, args.val_windows).round().astype(np.int64)]
    results = {
        "recipe": {k: getattr(args, k) for k in ("steps", "lr", "beta2", "weight_decay", "warmup")},
        "shape": SHAPES["nanogpt"],
        "vocab_size": vocab,
        "threads": torch.get_num_threads(),
        "val_windows": len(windows),
        "target_bpb": args.target,
        "seeds": {},
    }
    for seed in seeds:
        results["seeds"][seed] = {}
        for name in models:
            run = train_and_evaluate(Trainee(name, args, vocab, train_tokens, eos, seed), args, windows, token_bytes)
            results["seeds"][seed][name] = run
            print(
                f"seed {seed} {name:13s} final bpb {run['curve'][-1]['bpb']:.4f}, target {args.target} at step "
                f"{run['reached_target_at_step']}, {run['ms_per_step']} ms/step",
                file=sys.stderr,
                flush=True,
            )
    summary = {}
    for name in models:
        runs = [results["seeds"][s][name] for s in seeds]
        reached = [r["reached_target_at_step"] for r in runs]
        summary[name] = {
            "final_bpb_median": statistics.median(r["curve"][-1]["bpb"] for r in runs),
            "reached_target_at_step": reached,
            "ms_per_step_median": statistics.median(r["ms_per_step"] for r in runs),
            "bpb_median_by_step": {
                c["step"]: statistics.median(r["curve"][i]["bpb"] for r in runs) for i, c in enumerate(runs[0]["curve"])
            },
        }
    results["summary"] = summary
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
