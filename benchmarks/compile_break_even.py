"""When does ``--compile`` pay? Compile time against the time it saves per step. Prints JSON.

``torch.compile`` makes each step faster but costs time up front (tracing and code generation
at the first step, and again whenever a shape changes). This times the training loop's own
step (:func:`nanolm.step.train_step`) eager and compiled on the same model and batches, in one
process: the compiled variant's first steps (the compile), then the median of ``--steps``
steps of each, alternated. The break-even is the number of steps after which the compiled run
has caught up: (first compiled steps − the same number of eager steps) ÷ (eager − compiled step).

    python benchmarks/compile_break_even.py                    # nanolm train's default model
    python benchmarks/compile_break_even.py --n-layer 6 --n-embd 384 --seq-len 256 --batch-size 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanolm.batches import TrainBatches, WindowSampler  # noqa: E402
from nanolm.data.corpus import write_stories  # noqa: E402
from nanolm.data.prepare import prepare
from nanolm.model import GPT, GPTConfig  # noqa: E402
from nanolm.optim import build_optimizer  # noqa: E402
from nanolm.step import StepSetup, train_step  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=30, help="timed steps of each variant, after the compile")
    p.add_argument("--first", type=int, default=3, help="first steps counted as the compile")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        write_stories(Path(tmp) / "s.txt", 1000, seed=0)
        data = prepare(Path(tmp) / "s.txt", Path(tmp) / "d", "char", progress=False, log=lambda *_: None)
    tokens, eos, vocab = data.train.tokens.copy(), data.tokenizer.eos_id, data.tokenizer.vocab_size

    def variant(compile: bool):
        torch.manual_seed(0)
        model = GPT(
            GPTConfig(
                vocab_size=vocab, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
            )
        )
        setup = StepSetup(
            model,
            build_optimizer(model, 1e-3, 0.1),
            schedule=lambda step: 1e-3,
            step_model=torch.compile(model) if compile else model,
        )
        batches = TrainBatches(
            tokens, WindowSampler(len(tokens), args.seq_len, args.batch_size, seed=0), args.seq_len, eos
        )
        state = {"step": 0}

        def step() -> float:
            state["step"] += 1
            start = time.perf_counter()
            result = train_step(setup, state["step"], batches.next(state["step"]))
            float(result.loss)
            return time.perf_counter() - start

        return step

    eager, compiled = variant(False), variant(True)
    eager_first = sum(eager() for _ in range(args.first))
    compiled_first = sum(compiled() for _ in range(args.first))
    times = {"eager": [], "compiled": []}
    for i in range(args.steps):
        for name, run in (
            (("eager", eager), ("compiled", compiled)) if i % 2 == 0 else (("compiled", compiled), ("eager", eager))
        ):
            times[name].append(run())
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    overhead = compiled_first - eager_first
    print(
        json.dumps(
            {
                "shape": {k: getattr(args, k) for k in ("n_layer", "n_embd", "seq_len", "batch_size")},
                "torch_threads": torch.get_num_threads(),
                "eager_step_s": round(e, 5),
                "compiled_step_s": round(c, 5),
                "speedup": round(e / c, 3),
                f"first_{args.first}_steps_s": {"eager": round(eager_first, 2), "compiled": round(compiled_first, 2)},
                "compile_overhead_s": round(overhead, 2),
                "break_even_steps": round(overhead / (e - c)) if e > c else None,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
