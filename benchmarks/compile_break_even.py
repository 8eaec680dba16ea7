"""When does ``--compile`` pay? Compile time against the time it saves per step. Prints JSON.

``torch.compile`` makes each step faster but costs time up front (tracing and code generation
at the first step). This times the training loop's own step (:func:`nanolm.step.train_step`)
eager and compiled on the same model and batches, each compiled variant in a process of its own:

* ``blocks``: what ``--compile`` does (:func:`nanolm.model.compile_blocks`: one block compiled,
  every block runs it);
* ``model``: ``torch.compile`` of the whole model, what ``--compile`` did before 2026-12-08.

For each: its first steps on an empty compile cache (``cold``: a machine that never compiled
this shape), the same again after ``torch._dynamo.reset()`` from the cache the first compile
left on disk (``warm``: the second run of the same command), then the median of ``--steps``
steps of it and of eager, alternated, and the MFU of each against the matmul peak measured in
the same process. The break-even is the number of steps after which the compiled run has caught
up: (first compiled steps - the same number of eager steps) / (eager step - compiled step).

    python benchmarks/compile_break_even.py                                      # nanolm train's default model
    python benchmarks/compile_break_even.py --config configs/tinystories_60s.toml --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # step_profile's random batches


def run_config(args):
    """The options of ``nanolm train`` with ``--config`` (or none) and the shape flags given."""
    from nanolm.run.config import add_run_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    flags = ["--config", args.config] if args.config else []
    flags += ["--time-budget", "off", "--precision", args.precision]
    for name in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return config_from_args(parser.parse_args(flags))


def one_variant(args) -> dict:
    """In this process (its compile cache empty): eager and ``args.one``, timed as the docstring says."""
    import torch
    from step_profile import batches as random_batches

    from nanolm.machine.hardware import measure_matmul_flops
    from nanolm.model import GPT, compile_blocks
    from nanolm.optim import optimizer_for
    from nanolm.precision import resolve_precision
    from nanolm.step import StepSetup, train_step

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = run_config(args)
    precision = resolve_precision(cfg.train.precision, torch.device("cpu"))
    cfg.data.vocab_size = vocab = cfg.data.vocab_size or 256  # nanolm train's default: characters, ~100 of them
    seq_len, batch_size = cfg.model.seq_len, cfg.train.batch_size
    batches = random_batches(cfg, 2 * args.first + args.steps + 1)  # documents packed: the mask is compiled too

    def variant(kind: str):
        torch.manual_seed(0)
        model = GPT(cfg.model.gpt_config(vocab))
        if kind == "blocks":
            compile_blocks(model)
        setup = StepSetup(
            model,
            optimizer_for(model, cfg, precision),
            schedule=lambda step: cfg.optim.lr,
            clip=cfg.optim.clip,
            step_model=torch.compile(model) if kind == "model" else None,
            autocast=precision.autocast,
        )
        state = {"step": 0}

        def step() -> float:
            state["step"] += 1
            start = time.perf_counter()
            float(train_step(setup, state["step"], [batches[state["step"] % len(batches)]]).loss)
            return time.perf_counter() - start

        return step, model

    eager, model = variant("eager")
    eager_first = sum(eager() for _ in range(args.first))
    compiled, _ = variant(args.one)
    compiled_first = sum(compiled() for _ in range(args.first))
    torch._dynamo.reset()  # forget what this process compiled; the disk cache stays
    compiled, _ = variant(args.one)
    warm_first = sum(compiled() for _ in range(args.first))
    times = {"eager": [], args.one: []}
    for i in range(args.steps):
        pair = (("eager", eager), (args.one, compiled))
        for name, run in pair if i % 2 == 0 else pair[::-1]:
            times[name].append(run())
    e, c = statistics.median(times["eager"]), statistics.median(times[args.one])
    peak = measure_matmul_flops("cpu", precision.autocast_dtype or torch.float32)
    flops_per_step = model.flops_per_token() * seq_len * batch_size

    def break_even(first):
        return round((first - eager_first) / (e - c)) if e > c else None

    return {
        "eager_step_ms": round(1000 * e, 1),
        "compiled_step_ms": round(1000 * c, 1),
        "speedup": round(e / c, 3),
        "mfu": {"eager": round(flops_per_step / e / peak, 3), "compiled": round(flops_per_step / c / peak, 3)},
        f"first_{args.first}_steps_s": {
            "eager": round(eager_first, 2),
            "cold": round(compiled_first, 2),
            "warm": round(warm_first, 2),
        },
        "break_even_steps": {"cold": break_even(compiled_first), "warm": break_even(warm_first)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="a run's TOML (its model, batch, optimizer); none: nanolm train's defaults")
    p.add_argument("--precision", default="auto", help="as nanolm train's --precision")
    for name in ("n-layer", "n-head", "n-embd", "seq-len", "batch-size"):
        p.add_argument(f"--{name}", type=int, help="the shape, over the config's")
    p.add_argument("--variants", default="blocks,model", help="comma-separated: blocks (--compile), model")
    p.add_argument("--steps", type=int, default=30, help="timed steps of each, after the compile")
    p.add_argument("--first", type=int, default=3, help="first steps counted as the compile")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process's variant
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_variant(args)))
        return
    results = {"torch_threads": args.threads or os.cpu_count(), "config": args.config, "variants": {}}
    for kind in args.variants.split(","):
        with tempfile.TemporaryDirectory() as cache:  # an empty compile cache: the cold compile
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(REPO)}
            out = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--one", kind], env=env, capture_output=True, text=True
            )
            if out.returncode != 0:
                raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
            results["variants"][kind] = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
