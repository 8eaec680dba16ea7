"""What watching a run costs: per-layer statistics every K steps, against none. Prints JSON.

Two measurements of the same thing, because a shared machine is noisy:

* ``components``: the median time of the training loop's own step plain, and watched (the
  statistics of :class:`nanolm.watch.stats.LayerStats`: norms, weight copy, probe forward, the
  update ratio and the read-back); the extra time is the difference of the medians. The
  overhead at K is ``extra / (K × step)``: steady, because both are medians over interleaved
  steps.
* ``end_to_end`` (``--repeats`` > 0): whole ``train`` runs with ``--stats-every 0`` and
  ``--stats-every K``, alternated, timed from the first logged step to the last (step 0's
  evaluation and the final one left out). The honest number, and the noisy one.

    python benchmarks/observe_overhead.py                       # components, the default model
    python benchmarks/observe_overhead.py --repeats 3 --steps 200

The model is the default one (4 layers, 128 wide, 128 tokens of context, batch 16) on the
built-in corpus, char tokenizer, CPU unless ``--device`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanolm.batches import TrainBatches, WindowSampler  # noqa: E402
from nanolm.data.corpus import write_stories  # noqa: E402
from nanolm.data.prepare import prepare
from nanolm.model import GPT  # noqa: E402
from nanolm.optim import build_optimizer  # noqa: E402
from nanolm.run.config import RunConfig, TrainOptions  # noqa: E402
from nanolm.step import StepSetup, train_step  # noqa: E402
from nanolm.train import train  # noqa: E402
from nanolm.watch.observer import GradientWatch  # noqa: E402
from nanolm.watch.sinks import read_metrics  # noqa: E402
from nanolm.watch.stats import LayerStats  # noqa: E402


def components(data, cfg: RunConfig, device: str, steps: int) -> dict:
    """Median seconds of the training loop's own step (:func:`nanolm.step.train_step`) plain
    and watched (a :class:`~nanolm.watch.observer.GradientWatch` taking the per-layer statistics, read
    after the update as the observer does), interleaved."""
    torch.manual_seed(0)
    model = GPT(cfg.model.gpt_config(data.tokenizer.vocab_size)).to(device)
    setup = StepSetup(model, build_optimizer(model, 1e-3, 0.1), schedule=lambda step: 1e-3, clip=1.0)
    t = cfg.train
    batches = TrainBatches(
        data.train.tokens,
        WindowSampler(len(data.train), cfg.model.seq_len, t.batch_size, seed=0),
        cfg.model.seq_len,
        data.tokenizer.eos_id,
    )
    plain, watched = [], []
    for i in range(steps):
        micro = batches.next(i + 1)
        watching = i % 2 == 1 and i > 2  # alternate plain and watched steps; the first ones warm up
        t0 = time.perf_counter()
        watch = GradientWatch(model, LayerStats(model, micro[0]), underflow=False) if watching else None
        setup.watch = (lambda step, micro_batches: watch) if watching else None
        result = train_step(setup, i + 1, micro)
        if watch is not None:
            watch.after_update()
        float(result.loss)
        if i > 2:
            (watched if watching else plain).append(time.perf_counter() - t0)
    step_s, watched_s = statistics.median(plain), statistics.median(watched)
    extra_s = watched_s - step_s
    K = TrainOptions().stats_every
    return {
        "step_s": step_s,
        "stats_extra_s": extra_s,
        "stats_cost_in_steps": extra_s / step_s,
        "overhead_at_default_K": extra_s / (K * step_s),
        "overhead_at_K": {k: extra_s / (k * step_s) for k in (10, 20, 50, 100)},
    }


def end_to_end(data_dir: Path, cfg: RunConfig, steps: int, repeats: int, K: int) -> dict:
    times = {0: [], K: []}
    for r in range(repeats):
        for every in (0, K) if r % 2 == 0 else (K, 0):
            with tempfile.TemporaryDirectory() as out:
                c = RunConfig(cfg.model, replace(cfg.data), cfg.optim, replace(cfg.train))
                c.data.data = str(data_dir)
                c.train.steps, c.train.stats_every, c.train.out_dir = steps, every, out
                c.train.eval_every, c.train.sample_tokens, c.train.progress = 10**9, 0, "lines"
                train(c, log=lambda *_: None)
                rows = [row for row in read_metrics(Path(out) / "metrics.jsonl") if "loss" in row]
                times[every].append(rows[-1]["elapsed_s"] - rows[0]["elapsed_s"])
    ratios = [w / b for w, b in zip(times[K], times[0])]
    return {
        "steps": steps,
        "seconds_without_stats": times[0],
        f"seconds_with_stats_every_{K}": times[K],
        "ratio_per_pair": ratios,
        "overhead_median": statistics.median(ratios) - 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--component-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=200, help="steps per end-to-end run")
    parser.add_argument("--repeats", type=int, default=0, help="end-to-end run pairs (0 = components only)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = PyTorch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = RunConfig()
    cfg.data.tokenizer = "char"
    cfg.train.device = args.device
    K = cfg.train.stats_every
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "stories.txt"
        write_stories(source, 2000, seed=0)
        data = prepare(
            source,
            Path(scratch) / "data",
            "char",
            512,
            0.1,
            cfg.data.separator,
            "text",
            seq_len=cfg.model.seq_len,
            progress=False,
            log=lambda *_: None,
        )
        result = {
            "device": args.device,
            "torch_threads": torch.get_num_threads(),
            "default_stats_every": K,
            "model": {k: getattr(cfg.model, k) for k in ("n_layer", "n_embd", "seq_len")},
            "batch_size": cfg.train.batch_size,
            "components": components(data, cfg, args.device, args.component_steps),
        }
        if args.repeats:
            result["end_to_end"] = end_to_end(data.dir, cfg, args.steps, args.repeats, K)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
