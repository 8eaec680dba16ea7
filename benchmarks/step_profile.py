"""The 60 s record's step: its MFU, its cost against a plain PyTorch loop, and where its time goes.

The shape is ``configs/tinystories_60s.toml``'s (3 blocks of width 128, 4 heads, ReLU², QK-norm,
a context of 256 tokens x 8 sequences, BPE 4,096, documents of ~230 tokens packed with the
document mask), on random tokens (a step costs the same whatever the tokens say). Printed as JSON:

* **MFU** of nanolm's step (:func:`nanolm.step.train_step`, the config's Muon) in each number
  format: tokens/s x the model's FLOPs per token, against the matmul peak measured here
  (``nanolm.machine.hardware``), the figure a run's log shows.
* **Against a plain loop** (fp32 by default, ``--formats`` for more): the same model and batches,
  AdamW in both, alternated step by step in this process (the machine's noise hits both alike),
  median step times. The plain loop is what a tutorial writes: the logits whole, ``F.cross_entropy``
  with the masked positions ignored, the mean's backward, ``clip_grad_norm_``, ``AdamW.step`` (its
  fused kernel, as nanolm's), ``zero_grad``. ``ratio`` is plain / nanolm: above 1, nanolm is faster.
* **``--profile``**: ``torch.profiler``'s self CPU time of nanolm's step by operator, grouped
  (matmuls, attention, norms and activations, the head and loss, the optimizer's kernels, other),
  and its top operators: the table of ``dev/measurements.md``, "The 60 s step, op by op".

    python benchmarks/step_profile.py --threads 2
    python benchmarks/step_profile.py --threads 2 --profile --formats bf16,fp32
    python benchmarks/step_profile.py --threads 2 --compile --formats bf16,fp32 --plain-formats bf16,fp32
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nanolm.batches import pack_windows
from nanolm.machine.hardware import measure_matmul_flops
from nanolm.model import GPT, compile_blocks
from nanolm.optim import optimizer_for
from nanolm.precision import resolve_precision
from nanolm.run.config import add_run_arguments, config_from_args
from nanolm.step import StepSetup, train_step

REPO = Path(__file__).resolve().parent.parent
GROUPS = (  # (group, substrings of an operator's name), the first match wins
    ("optimizer", ("adam", "_foreach", "newton", "muon", "lerp", "addcdiv", "baddbmm")),
    ("attention", ("scaled_dot_product", "_flash_attention", "_efficient_attention", "attention")),
    ("head and loss", ("cross_entropy", "log_softmax", "nll_loss", "logsumexp", "_softmax")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("norms and activations", ("rms_norm", "relu", "pow", "silu", "gelu", "_fused_rms")),
)


def the_config(args):
    import argparse as ap

    parser = ap.ArgumentParser()
    add_run_arguments(parser)
    flags = ["--config", str(REPO / "configs/tinystories_60s.toml"), "--time-budget", "off", "--steps", "700"]
    return config_from_args(parser.parse_args(flags + args))


def batches(cfg, count: int, seed: int = 0) -> list:
    """``count`` micro-batches of the config's shape from random tokens, a document every ~230."""
    rng = np.random.default_rng(seed)
    vocab, seq_len, b = cfg.data.vocab_size, cfg.model.seq_len, cfg.train.batch_size
    tokens = rng.integers(1, vocab, size=200_000).astype(np.int32)
    tokens[rng.random(tokens.size) < 1 / 230] = 0  # EOS, id 0
    out = []
    for _ in range(count):
        starts = rng.integers(0, tokens.size - seq_len - 1, size=b)
        out.append(pack_windows(tokens, starts, seq_len, 0, doc_mask=True))
    return out


def nanolm_step(cfg, model, precision, compile=False):
    if compile:
        compile_blocks(model)  # what --compile does
    optimizer = optimizer_for(model, cfg, precision)
    setup = StepSetup(
        model, optimizer, schedule=lambda s: cfg.optim.lr, clip=cfg.optim.clip, autocast=precision.autocast
    )
    counter = iter(range(1, 10**9))
    return lambda batch: train_step(setup, next(counter), [batch])


def plain_step(cfg, model, precision):
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay, fused=True
    )

    def step(batch):
        with precision.autocast():
            logits, _ = model(batch.idx, doc_ids=batch.doc_ids, positions=batch.positions)
            targets = batch.targets.masked_fill(~batch.loss_mask, -100)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def timed(step, batch) -> float:
    start = time.perf_counter()
    step(batch)
    return time.perf_counter() - start


def group_of(name: str) -> str:
    lowered = name.lower()
    return next((group for group, keys in GROUPS if any(k.lower() in lowered for k in keys)), "other")


def profile(step, data, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for batch in data[:3]:
        step(batch)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in data[3 : 3 + steps]:
            step(batch)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    groups: dict[str, float] = {}
    for e in events:
        groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.self_cpu_time_total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
    return {
        "ms_per_step": round(total / steps / 1000, 2),
        "groups_share": {k: round(v / total, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_ops": [
            {"op": e.key, "share": round(e.self_cpu_time_total / total, 3), "calls_per_step": e.count // steps}
            for e in top
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="timed steps of each loop, alternated")
    p.add_argument("--formats", default="bf16,fp32", help="number formats for the MFU (bf16 needs native units)")
    p.add_argument("--plain-formats", default="fp32", help="formats in which to time the plain loop beside nanolm")
    p.add_argument("--profile", action="store_true", help="add torch.profiler's table of nanolm's step")
    p.add_argument("--compile", action="store_true", help="add nanolm's step with --compile (its compile untimed)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    results = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "formats": {},
    }
    for name in args.formats.split(","):
        precision = resolve_precision(name, cpu)
        cfg = the_config(["--precision", name])
        model = GPT(cfg.model.gpt_config(cfg.data.vocab_size))
        data = batches(cfg, 3 + args.steps)
        tokens = cfg.train.batch_size * cfg.model.seq_len
        peak = measure_matmul_flops("cpu", precision.autocast_dtype or torch.float32)
        loops = {"nanolm (Muon)": nanolm_step(cfg, model, precision)}
        if args.compile:
            loops["nanolm (Muon), --compile"] = nanolm_step(cfg, copy.deepcopy(model), precision, compile=True)
        if name in args.plain_formats.split(","):
            adamw = the_config(["--precision", name])
            adamw.optim.optimizer, adamw.optim.muon_lr = "adamw", None  # the config's AdamW settings, on every matrix
            loops["nanolm (AdamW)"] = nanolm_step(adamw, copy.deepcopy(model), precision)
            loops["plain loop (AdamW)"] = plain_step(adamw, copy.deepcopy(model), precision)
        times = {k: [] for k in loops}
        for batch in data[:3]:  # warm up every loop
            for step in loops.values():
                step(batch)
        for batch in data[3:]:
            for k, step in loops.items():
                times[k].append(timed(step, batch))
        figures = {}
        for k, ts in times.items():
            median = statistics.median(ts)
            figures[k] = {
                "ms_per_step": round(1000 * median, 2),
                "tokens_per_s": round(tokens / median),
                "mfu": round(tokens / median * model.flops_per_token() / peak, 3),
            }
        entry = {"peak_tflops": round(peak / 1e12, 4), "loops": figures}
        if "plain loop (AdamW)" in figures:
            entry["plain_over_nanolm_adamw"] = round(
                figures["plain loop (AdamW)"]["ms_per_step"] / figures["nanolm (AdamW)"]["ms_per_step"], 3
            )
        if args.profile:
            entry["profile"] = profile(nanolm_step(cfg, copy.deepcopy(model), precision), data, min(10, args.steps))
            if args.compile:
                entry["profile_compiled"] = profile(
                    nanolm_step(cfg, copy.deepcopy(model), precision, compile=True), data, min(10, args.steps)
                )
        results["formats"][name] = entry
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
