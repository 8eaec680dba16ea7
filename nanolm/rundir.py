"""Where a run lives, and what running the same command again does there.

The promise is simple: **run the same command again** and the run continues where it
stopped, however it stopped (Ctrl-C, ``kill -9``, a full disk, a crash before the first
checkpoint), and ends bit-identical to a run that was never interrupted. A finished run is
never trained over, and nothing a user made is ever deleted. For that, a command must map
to the same directory every time, and the directory must say what state the run is in.

**Which directory.** ``--out-dir`` if given. Otherwise ``runs/<data name>`` (``runs/toy``
for ``--data data/toy.txt``, ``runs/stories`` for the built-in corpus), or, when that holds
a *different* run (a changed model shape, other data...), the first of ``runs/<name>-2``,
``-3``... that is free or holds this command's run. The same command therefore lands in the
same directory, and a new experiment never lands on an old one.

**What state.** A directory is a nanolm run when it holds ``config.toml`` (written first).
Then, in order:

* its configuration differs in a way that would mix two runs → refused with the list of
  differences (or, without ``--out-dir``, the next numbered directory is tried);
* ``final.json`` verifies and the run reached its steps → finished: nothing to do;
* a checkpoint verifies → continue from the newest valid one (after the last step, only the
  final weights are still to write: they are written);
* committed checkpoints exist but none verifies → refused, naming each problem: training
  from scratch over them would discard the run;
* no checkpoint at all → the previous attempt stopped before its first checkpoint was
  committed (killed, out of memory, disk full...): it is started again from step 0 in
  place, replacing only the files nanolm writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .checkpoint import (
    CHECKPOINTS,
    check_training_state,
    latest_valid_checkpoint,
    list_checkpoints,
    load_state,
    read_checkpoint_meta,
    read_final,
    verify_checkpoint,
)
from .config import RunConfig, load_run_config, resume_differences
from .errors import NanolmError
from .files import probe_writable

RUN_FILES = ("config.toml", "tokenizer.json", "metrics.jsonl", "events.jsonl", "model.safetensors", "final.json",
             "checkpoints", "data")
"""Every name nanolm writes at the top of a run directory (besides tensorboard/ and wandb/)."""


@dataclass
class RunPlan:
    """What this command will do: where, and from which checkpoint.

    ``checkpoint`` None with ``restart`` False is a new run; ``restart`` True replaces an
    attempt that never committed a checkpoint; ``finished`` means there is nothing to do
    (``message`` says why)."""

    out_dir: Path
    checkpoint: Path | None = None
    restart: bool = False
    finished: bool = False
    message: str = ""


def default_name(cfg: RunConfig) -> str:
    return Path(cfg.data.data.rstrip("/")).stem if cfg.data.data else "stories"


def valid_resume_checkpoint(run_dir, log) -> Path | None:
    """The newest checkpoint that verifies *and* whose state a resume can restore."""
    def loadable(path):
        check_training_state(path, load_state(path))

    return latest_valid_checkpoint(run_dir, log, check=loadable)


def _refused_changes(saved: RunConfig, saved_world: int, cfg: RunConfig, world_size: int) -> list[str]:
    """Differences that would mix two runs. How the global batch is split over micro-batches
    and processes may change; the global batch itself may not."""
    split, refused = resume_differences(saved, cfg, also_allowed={"batch_size", "grad_accum"})
    s, t = saved.train, cfg.train
    before, after = s.batch_size * s.grad_accum * saved_world, t.batch_size * t.grad_accum * world_size
    if before != after:
        refused += [line for line in split if line.startswith(("batch_size:", "grad_accum:"))]
        refused.append(f"global batch (batch_size × grad_accum × world size): {s.batch_size}×{s.grad_accum}×"
                       f"{saved_world} = {before} -> {t.batch_size}×{t.grad_accum}×{world_size} = {after} windows")
    return refused


def _finished(final: dict | None, cfg: RunConfig) -> bool:
    """Whether final weights that verify say the run already ended where this command would."""
    t = cfg.train
    if final is None:
        return False
    reached = 0 < t.target_val_bpb and final.get("val_bpb") is not None and final["val_bpb"] <= t.target_val_bpb
    return final["step"] >= t.steps or reached


def _plan_for(out_dir: Path, cfg: RunConfig, world_size: int, log, quiet_mismatch: bool) -> RunPlan | list[str]:
    """The plan for ``out_dir``, or (when ``quiet_mismatch``) the refused differences of the
    run it holds, for the caller to try another directory."""
    t = cfg.train
    probe_writable(out_dir)
    if not out_dir.exists() or not any((out_dir / name).exists() for name in RUN_FILES):
        return RunPlan(out_dir)
    if not (out_dir / "config.toml").is_file():
        existing = sorted(name for name in RUN_FILES if (out_dir / name).exists())
        raise NanolmError(f"{out_dir} holds {', '.join(existing)} but no config.toml: it is not a nanolm run "
                          f"this command can continue; choose another --out-dir")
    committed = list_checkpoints(out_dir)
    checkpoint = valid_resume_checkpoint(out_dir, log) if committed else None
    try:
        saved = load_run_config((checkpoint or out_dir) / "config.toml")
        saved_world = read_checkpoint_meta(checkpoint)["world_size"] if checkpoint else world_size
    except NanolmError as e:
        if quiet_mismatch:
            return [f"its config.toml is unreadable ({e})"]
        raise NanolmError(f"{out_dir} holds a run whose configuration cannot be read ({e}); "
                          f"choose another --out-dir") from None
    refused = _refused_changes(saved, saved_world, cfg, world_size)
    if refused:
        if quiet_mismatch:
            return refused
        raise NanolmError(f"cannot continue the run in {out_dir}: incompatible changes: {'; '.join(refused)}. "
                          f"Keep those settings, or start a new run with another --out-dir")
    if t.resume == "never" and (committed or (out_dir / "model.safetensors").exists()):
        raise NanolmError(f"{out_dir} already holds a run with checkpoints; --resume never does not train over it: "
                          f"choose another --out-dir")
    try:
        final = read_final(out_dir)
    except NanolmError as e:
        log(f"warning: {e}; the final weights will be written again")
        final = None
    finished_at = final["step"] if _finished(final, cfg) else None  # only verified final weights say so
    if finished_at is not None and (checkpoint is None or _step(checkpoint) <= finished_at):
        return RunPlan(out_dir, finished=True, message=f"{out_dir} finished at step {finished_at} of {t.steps}; "
                       f"nothing to do (raise --steps to train longer, or choose another --out-dir for a new run)")
    if checkpoint is not None:
        return RunPlan(out_dir, checkpoint=checkpoint)
    if committed:
        raise NanolmError(f"{out_dir} has checkpoints but none is valid (see the warnings above); starting over "
                          f"would discard the run: move the directory aside to start again, or --resume PATH")
    if final is not None or (out_dir / "model.safetensors").exists():
        raise NanolmError(f"{out_dir} holds final weights but no checkpoint to continue from; "
                          f"start a new run with another --out-dir")
    log(f"{out_dir} holds a run that stopped before its first checkpoint was saved; starting it again from step 0")
    return RunPlan(out_dir, restart=True)


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def locate_run(cfg: RunConfig, world_size: int = 1, log=print) -> RunPlan:
    """Decide where this command's run lives and whether it starts, continues, restarts or
    is already done. Nothing is written here."""
    t = cfg.train
    if t.out_dir:
        plan = _plan_for(Path(t.out_dir), cfg, world_size, log, quiet_mismatch=False)
    else:
        plan = _first_free_or_same(cfg, world_size, log)
    if t.resume in ("auto", "never"):
        return plan
    checkpoint = resume_checkpoint_at(Path(t.resume), log)  # --resume PATH
    if plan.checkpoint is not None and plan.out_dir.resolve() not in checkpoint.resolve().parents:
        raise NanolmError(f"{plan.out_dir} holds checkpoints of its own; --resume {t.resume} continues another "
                          f"run into a new --out-dir")
    return RunPlan(plan.out_dir, checkpoint=checkpoint, restart=plan.restart)


def _first_free_or_same(cfg: RunConfig, world_size: int, log) -> RunPlan:
    name = default_name(cfg)
    skipped = []
    for n in range(1, 10_000):
        out_dir = Path("runs") / (name if n == 1 else f"{name}-{n}")
        plan = _plan_for(out_dir, cfg, world_size, log, quiet_mismatch=True)
        if isinstance(plan, RunPlan):
            if skipped:
                log(f"{skipped[0][0]} holds a different run ({skipped[0][1]}); this one is {out_dir} "
                    f"(pass --out-dir to choose)")
            return plan
        skipped.append((out_dir, "; ".join(plan[:3]) + (" ..." if len(plan) > 3 else "")))
    raise NanolmError(f"runs/{name} ... runs/{name}-9999 all hold other runs; pass --out-dir")


def resume_checkpoint_at(path: Path, log) -> Path:
    """``--resume PATH``: a checkpoint directory, or a run directory (its newest valid one)."""
    if (path / CHECKPOINTS).is_dir() or not (path / "meta.json").is_file():
        found = valid_resume_checkpoint(path, log)
        if found is None:
            raise NanolmError(f"--resume {path}: no valid checkpoint there")
        return found
    verify_checkpoint(path)
    check_training_state(path, load_state(path))
    return path
