"""``nanolm replay RUN_DIR --step N``: one step of a past run, again, under the microscope.

When a run's loss jumped at step 8,000, the question is whether *that batch* was bad or the
model was already on the edge. A checkpoint holds everything that decides what happens next
(weights, Adam's moments, the sampler's position, every random stream), so the step can be
replayed exactly: load the newest valid checkpoint before step N, re-train the steps in
between as the run did (bit for bit on the CPU it ran on), then take step N once more with
every instrument on: its loss and gradient norm, the per-layer gradient norms and the update it
makes, the largest attention logit and the dead MLP units per block, where a NaN was born if
there is one, and the text of the batch. The replayed loss is compared with the logged one,
which proves the replay is the run's step. Nothing is written to the run directory; the
faults of a lab run (``[debug]`` in its config) are replayed too.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from pathlib import Path

import torch

from ..batches import WindowSampler
from ..checkpoint import (
    Checkpointer,
    check_training_state,
    list_checkpoints,
    load_state,
    read_checkpoint_meta,
    verify_checkpoint,
)
from ..data.shards import PreparedData
from ..distributed import Distributed
from ..errors import NanolmError
from ..machine.device import resolve_device
from ..machine.runtime import configure_determinism, settings_restored
from ..precision import cast_weights_, resolve_precision
from ..run.budget import TimeBudget
from ..run.config import load_run_config
from ..step import StepSetup, counted_tokens, learning_rate, train_step
from ..tokenizer import Tokenizer
from ..train import Factories, Progress
from ..watch.guards import Guard, nan_origin, read_events
from ..watch.observer import GradientWatch
from ..watch.sinks import read_metrics
from ..watch.stats import LayerStats
from .faults import factories as fault_factories


class _Ignored:
    """Stands in for the components of a run that a replay does not need (its observer)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def checkpoint_before(run_dir: Path, step: int, log=print) -> Path:
    """The newest checkpoint strictly before ``step`` whose files verify and whose state loads."""
    for ckpt_step, path in reversed(list_checkpoints(run_dir)):
        if ckpt_step >= step:
            continue
        try:
            verify_checkpoint(path)
            check_training_state(path, load_state(path))
            return path
        except NanolmError as e:
            log(f"warning: {e}; trying an earlier checkpoint")
    raise NanolmError(
        f"{run_dir} has no valid checkpoint before step {step} to replay from "
        f"(checkpoints are kept with --keep; --keep 0 keeps them all)"
    )


def replay(run_dir, step: int, device: str | None = None, log=print) -> dict:
    """Replay optimizer step ``step`` of the run in ``run_dir``; returns what it showed. The
    run's determinism setting applies during the replay only."""
    with settings_restored():
        return _replay(run_dir, step, device, log)


def _replay(run_dir, step: int, device: str | None, log) -> dict:
    run_dir = Path(run_dir)
    if step < 1:
        raise NanolmError(f"--step must be at least 1, got {step}")
    if not (run_dir / "config.toml").is_file():
        raise NanolmError(f"{run_dir} is not a run directory (no config.toml)")
    checkpoint = checkpoint_before(run_dir, step, log)
    meta = read_checkpoint_meta(checkpoint)
    cfg = load_run_config(checkpoint / "config.toml")
    t, o, d, g = cfg.train, cfg.optim, cfg.data, cfg.guard
    if step > t.steps:
        raise NanolmError(f"the run has {t.steps} steps; there is no step {step} to replay")
    tokenizer = Tokenizer.load(checkpoint / "tokenizer.json")
    data = PreparedData(run_dir / "data" if (run_dir / "data").is_dir() else Path(d.data))
    if meta.get("data_digest", data.digest) != data.digest:
        raise NanolmError(f"{data.dir} is not the data the checkpoint was trained on")
    dev = resolve_device(device or t.device)
    precision = resolve_precision(t.precision, dev)
    configure_determinism(t.deterministic)
    factories = fault_factories(cfg) or Factories()

    world = int(meta["world_size"])  # a multi-process run is replayed as one process on its global batch
    model = factories.model(cfg.model.gpt_config(tokenizer.vocab_size)).to(dev)
    if precision.pure_bf16:
        cast_weights_(model, torch.bfloat16)
    optimizer = factories.optimizer(model, cfg, precision)
    scaler = factories.scaler(enabled=precision.name == "fp16")
    sampler = WindowSampler(
        len(data.train), cfg.model.seq_len, t.batch_size * world, seed=t.seed, random_offset=d.random_offset
    )
    batches = factories.batches(
        data.train.tokens,
        sampler,
        cfg.model.seq_len,
        tokenizer.eos_id,
        t.grad_accum,
        doc_mask=d.doc_mask,
        reset_positions=d.reset_positions,
        mask_boundary=d.mask_boundary,
    )
    guard = Guard.from_options(g, out_dir=None, log=log)
    budget = TimeBudget(t.time_budget, o) if t.time_budget is not None else TimeBudget.off()
    checkpointer = Checkpointer.for_run(
        cfg,
        dist=Distributed("none", dev),
        run_dir=run_dir,
        model=model,
        optimizer=optimizer,
        tokenizer=tokenizer,
        data_digest=data.digest,
        log=log,
        stateful={
            "sampler": batches,
            "scaler": scaler,
            "progress": Progress(),
            "guard": guard,
            "observer": _Ignored(),
            **({"budget": budget} if budget.active else {}),
        },
    )
    start = checkpointer.restore(checkpoint)
    # a time-budgeted run's rates are its plan's as the checkpoint holds it (a decay the clock drew
    # again between the checkpoint and the replayed step is not known to it)
    schedule = budget.learning_rate if budget.active else partial(learning_rate, o=o, total_steps=t.steps)
    step_setup = StepSetup(
        model,
        optimizer,
        schedule=schedule,
        clip=o.clip,
        scaler=scaler,
        autocast=precision.autocast,
        guard=guard,
        loss_fn=factories.loss_fn,
    )
    log(f"replay: from {checkpoint.name}, re-training steps {start + 1}..{step - 1}, then step {step}")
    for s in range(start + 1, step):
        result = train_step(step_setup, s, batches.next(s))
        if result.action in ("rollback", "stop"):
            raise NanolmError(
                f"the run's guard acted at step {s} ({result.action}; see events.jsonl): a replay "
                f"can go up to step {s}, not past it"
            )

    micro_batches = batches.next(step)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    watch = GradientWatch(model, LayerStats(model, micro_batches[0], precision.autocast), precision.name == "fp16")
    # step N is examined, whatever the guard would have decided, at the rate the run used (its guard's scale)
    lr_scale = guard.lr_scale
    examined = dataclasses.replace(
        step_setup,
        guard=None,
        watch=lambda s, batches: watch,
        schedule=lambda s: schedule(s) * lr_scale,
    )
    result = train_step(examined, step, micro_batches)
    loss, grad_norm = float(result.loss), float(result.grad_norm)
    report = {
        "run": str(run_dir),
        "step": step,
        "from_checkpoint": checkpoint.name,
        "replayed_steps": step - 1 - start,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": result.lr,
        "clipped": o.clip > 0 and grad_norm > o.clip,
        "counted_tokens": counted_tokens(micro_batches),
        "layers": watch.after_update(),
        "first_window": tokenizer.decode(micro_batches[0].idx[0].tolist())[:300],
    }
    logged = (
        next((r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("step") == step and "loss" in r), None)
        if (run_dir / "metrics.jsonl").is_file()
        else None
    )
    rolled = [
        e
        for e in read_events(run_dir)
        if e.get("action") == "rollback" and isinstance(e.get("to_step"), int) and e["to_step"] < step <= e["step"]
    ]
    if rolled:  # the logged row is the second pass's: the run went back past this step and drew new batches
        report["note"] = (
            f"the run rolled back from step {rolled[0]['step']} to {rolled[0]['to_step']}: this replay is "
            f"the first pass through step {step}; metrics.jsonl keeps the second"
        )
    elif logged is not None:
        report["logged_loss"] = logged["loss"]
        report["matches_the_log"] = _same(loss, logged["loss"])
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        model.load_state_dict(before)
        report.update(nan_origin(model, micro_batches[0], precision.autocast, tokenizer.vocab_size))
    return report


def _same(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return str(a) == str(b)
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def format_replay(r: dict) -> str:
    lines = [
        f"step {r['step']} of {r['run']}, replayed from {r['from_checkpoint']} ({r['replayed_steps']} steps "
        f"re-trained first)",
        f"  loss {r['loss']:.4f} | grad norm {r['grad_norm']:.3f}{' (clipped)' if r['clipped'] else ''} | "
        f"lr {r['lr']:.2e} | {r['counted_tokens']} counted tokens",
    ]
    if "note" in r:
        lines.append(f"  note: {r['note']}")
    if "logged_loss" in r:
        lines.append(
            f"  the run logged loss {r['logged_loss']:.4f} at this step: "
            + (
                "the replay is that step"
                if r["matches_the_log"]
                else "the replay differs (another device or thread count, or --compile, changes the last bits)"
            )
        )
    layers = r["layers"]
    for key, label in (
        ("grad_norm", "gradient norm"),
        ("update_ratio", "update/weight"),
        ("attn_logit_max", "max attention logit"),
        ("mlp_dead_frac", "dead MLP units"),
    ):
        values = {k.split("/", 1)[1]: v for k, v in layers.items() if k.startswith(key + "/")}
        if values:
            lines.append(f"  {label:20s} " + "  ".join(f"{name} {v:.3g}" for name, v in values.items()))
    if "origin" in r:
        lines.append(
            f"  first non-finite: {r['origin']}"
            + (f"; {r['bad_ids']} token ids out of range" if r.get("bad_ids") else "")
        )
    lines.append("  first window: " + repr(r["first_window"][:160]))
    return "\n".join(lines)
