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

**One writer.** The plan is made while holding the directory's lock (``nanolm.base.lock``), and
the lock is held until the run ends: a second command on a live run is refused in one line
naming the process that writes it, instead of planning from a state that is changing under
it. A numbered directory that another process is writing is skipped when it holds a
different run, like any other. After ``kill -9`` the lock is gone with its process, and the
same command continues the run.

The run's data lives here too: tokenized once into the run directory (``data/``), checked
on every resume, and prepared again from its source if it was damaged.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..base import disk
from ..base.documents import read_json
from ..base.files import atomic_write_text, move_directory, probe_writable, remove_abandoned_writes
from ..base.lock import DirectoryBusy, ReadLock, RunLock, busy_refusal, held_by_another
from ..batches import eval_window_count, fewer_tokens_than_a_window
from ..checkpoint import (
    CHECKPOINTS,
    check_training_state,
    list_checkpoints,
    load_state,
    read_checkpoint_meta,
    valid_resume_checkpoint,
    verify_checkpoint,
)
from ..data.prepare import load_training_data
from ..data.shards import PreparedData
from ..errors import NanolmError
from .config import RunConfig, load_run_config
from .final import read_final
from .resume import check_resume_compatible, data_moved_to, refused_changes

RUN_FILES = (
    "config.toml",
    "tokenizer.json",
    "metrics.jsonl",
    "events.jsonl",
    "model.safetensors",
    "final.json",
    "checkpoints",
    "data",
)
"""Every name nanolm writes at the top of a run directory (besides tensorboard/ and wandb/)."""


def _is_run_directory(path: Path) -> bool:
    """A directory ``nanolm train`` writes: config.toml (written first) and any other run file."""
    return (path / "config.toml").is_file() and any(
        (path / name).exists() for name in RUN_FILES if name != "config.toml"
    )


def _checked_by_manifest(path: Path) -> bool:
    """A directory whose meta.json lists its files (a checkpoint, prepared data): nanolm refuses
    it once it holds a file the list does not name."""
    meta = path / "meta.json"
    if not meta.is_file():
        return False
    try:
        value = read_json(meta)
        return isinstance(value, dict) and "files" in value
    except NanolmError:
        return True  # damaged, but still nanolm's: nothing of another command belongs there


def refuse_output_inside_a_run(path, flag: str) -> None:
    """Refuse an output path that would land among a run's own files or inside a directory
    nanolm checks against a manifest, before anything is written.

    ``nanolm export --out RUN/checkpoints/step_000100/hf`` used to succeed, and the run then
    fell back past its newest checkpoint, which now held a file its manifest did not list; a
    report, prepared data or a second run inside a run's ``checkpoints/`` or ``data/`` breaks it
    the same way. Beside them (``RUN/report``, ``RUN/hf``) is fine. The path is followed through
    symbolic links, so a link into a checkpoint is refused too; a link that points nowhere is
    refused here in one line rather than by ``mkdir`` as a traceback."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise NanolmError(
            f"{flag} {path} is a symbolic link to {os.readlink(path)}, which does not exist; remove the "
            f"link or choose another {flag}"
        )
    real = Path(os.path.realpath(path))
    child = real
    for ancestor in real.parents:
        if _checked_by_manifest(ancestor):
            kind = "a checkpoint" if CHECKPOINTS in ancestor.parts else "prepared data"
            raise NanolmError(
                f"{flag} {path} is inside {ancestor}, {kind} whose files nanolm checks against its "
                f"manifest: anything written there makes it invalid; choose another {flag}"
            )
        if child.name in RUN_FILES and _is_run_directory(ancestor):
            holder = held_by_another(ancestor)
            if holder is not None:  # name the process writing it: the user may not know it runs
                raise busy_refusal(path, holder, flag, inside=ancestor)
            raise NanolmError(
                f"{flag} {path} is {'inside ' if child != real else ''}{ancestor / child.name}, which "
                f"the run in {ancestor} writes; choose a path beside it, such as {ancestor / 'export'}, "
                f"or another {flag}"
            )
        child = ancestor


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
    data_moved: bool = False  # --data names another path that holds the very data the checkpoint trained on
    eval_windows: int | None = None  # the validation set of the run this continues (kept unless asked otherwise)


def default_name(cfg: RunConfig) -> str:
    """A run's directory is named after its data (a trailing slash of the path is no part of the name)."""
    return Path(cfg.data.data).stem if cfg.data.data else "stories"


def _finished(final: dict | None, cfg: RunConfig) -> bool:
    """Whether final weights that verify say the run already ended where this command would."""
    t = cfg.train
    if final is None:
        return False
    reached = 0 < t.target_val_bpb and final.get("val_bpb") is not None and final["val_bpb"] <= t.target_val_bpb
    spent = t.time_budget is not None and final.get("time_budget_s") == t.time_budget  # ended by its time budget
    return final["step"] >= t.steps or reached or spent


def _plan_for(
    out_dir: Path, cfg: RunConfig, world_size: int, log, quiet_mismatch: bool, lock: RunLock
) -> RunPlan | list[str]:
    """The plan for ``out_dir``, made holding its lock, or (when ``quiet_mismatch``) the
    refused differences of the run it holds, for the caller to try another directory."""
    t = cfg.train
    refuse_output_inside_a_run(out_dir, "--out-dir")
    probe_writable(out_dir)
    lock.take(out_dir, log=log)
    if not out_dir.exists() or not any((out_dir / name).exists() for name in RUN_FILES):
        return RunPlan(out_dir)
    if not (out_dir / "config.toml").is_file():
        existing = sorted(name for name in RUN_FILES if (out_dir / name).exists())
        raise NanolmError(
            f"{out_dir} holds {', '.join(existing)} but no config.toml: it is not a nanolm run "
            f"this command can continue; choose another --out-dir"
        )
    committed = list_checkpoints(out_dir)
    checkpoint = valid_resume_checkpoint(out_dir, log) if committed else None
    try:
        saved = load_run_config((checkpoint or out_dir) / "config.toml")
        saved_world = read_checkpoint_meta(checkpoint)["world_size"] if checkpoint else world_size
    except NanolmError as e:
        if quiet_mismatch:
            return [f"its config.toml is unreadable ({e})"]
        raise NanolmError(
            f"{out_dir} holds a run whose configuration cannot be read ({e}); choose another --out-dir"
        ) from None
    refused = refused_changes(saved, saved_world, cfg, world_size)
    if refused and cfg.data.data and not Path(cfg.data.data).exists() and not (out_dir / "data").is_dir():
        # prepared data the run read where it was is gone: that, not the tokenizer options its absence
        # changed, is what to say
        raise NanolmError(
            f"data path {cfg.data.data} does not exist: the run in {out_dir} trained on it; restore "
            f"it, or start a new run with another --out-dir"
        )
    moved = [line for line in refused if line.startswith("data:")]
    data_moved = bool(moved) and checkpoint is not None and data_moved_to(cfg, checkpoint)
    if data_moved:
        refused = [line for line in refused if line not in moved]
    elif moved and checkpoint is not None:
        refused = [
            f"{line} (not the data the run trained on: compared by content, not by name)" if line in moved else line
            for line in refused
        ]
    if refused:
        if quiet_mismatch:
            return refused
        raise NanolmError(
            f"cannot continue the run in {out_dir}: incompatible changes: {'; '.join(refused)}. "
            f"Keep those settings, or start a new run with another --out-dir"
        )
    if t.resume == "never" and (committed or (out_dir / "model.safetensors").exists()):
        raise NanolmError(
            f"{out_dir} already holds a run with checkpoints; --resume never does not train over it: "
            f"choose another --out-dir"
        )
    try:
        final = read_final(out_dir)
    except NanolmError as e:
        log(f"warning: {e}; the final weights will be written again")
        final = None
    finished_at = final["step"] if _finished(final, cfg) else None  # only verified final weights say so
    if finished_at is not None and (checkpoint is None or _step(checkpoint) <= finished_at):
        return RunPlan(
            out_dir,
            finished=True,
            message=_past_steps(out_dir, finished_at, t.steps)
            or (
                f"{out_dir} finished at step {finished_at}, where its time budget of {t.time_budget:g} s ended; "
                f"nothing to do (choose another --out-dir for a new run)"
                if t.time_budget is not None and final.get("time_budget_s") == t.time_budget
                else None
            )
            or (
                f"{out_dir} finished at step {finished_at} of {t.steps}; nothing to do (raise --steps to train longer, "
                f"or choose another --out-dir for a new run)"
            ),
        )
    if checkpoint is not None:
        return RunPlan(out_dir, checkpoint=checkpoint, data_moved=data_moved, eval_windows=saved.train.eval_windows)
    if committed:
        raise NanolmError(
            f"{out_dir} has checkpoints but none is valid (see the warnings above); starting over "
            f"would discard the run: move the directory aside to start again, or --resume PATH"
        )
    if final is not None or (out_dir / "model.safetensors").exists():
        raise NanolmError(
            f"{out_dir} holds final weights but no checkpoint to continue from; start a new run with another --out-dir"
        )
    return RunPlan(out_dir, restart=True)


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def locate_run(cfg: RunConfig, lock: RunLock, world_size: int, log=print) -> RunPlan:
    """Decide where this command's run lives and whether it starts, continues, restarts or
    is already done, and lock that directory with ``lock`` (held until the caller lets go).
    Nothing else is written here."""
    t = cfg.train
    if t.out_dir:
        plan = _plan_for(Path(t.out_dir), cfg, world_size, log, quiet_mismatch=False, lock=lock)
    else:
        plan = _first_free_or_same(cfg, world_size, log, lock)
    if t.resume not in ("auto", "never"):  # --resume PATH
        checkpoint = resume_checkpoint_at(Path(t.resume), log)
        if plan.checkpoint is not None and plan.out_dir.resolve() not in checkpoint.resolve().parents:
            raise NanolmError(
                f"{plan.out_dir} holds checkpoints of its own; --resume {t.resume} continues another "
                f"run into a new --out-dir"
            )
        saved = load_run_config(checkpoint / "config.toml")
        moved = saved.data.data != cfg.data.data and data_moved_to(cfg, checkpoint)
        plan = RunPlan(
            plan.out_dir,
            checkpoint=checkpoint,
            restart=plan.restart,
            data_moved=moved,
            eval_windows=saved.train.eval_windows,
        )
    if plan.restart:  # an attempt that never saved: its logs give way to this run's
        log(
            f"{plan.out_dir} holds a run that stopped before its first checkpoint was saved; "
            + (
                f"its files give way to the run continued from {plan.checkpoint}"
                if plan.checkpoint is not None
                else "starting it again from step 0"
            )
        )
    past = _past_steps(plan.out_dir, _step(plan.checkpoint), t.steps) if plan.checkpoint is not None else ""
    if past:
        log(past)
    return plan


def _past_steps(out_dir: Path, step: int, steps: int) -> str:
    """What a run already past ``--steps`` does (nothing but its final weights, from where it
    is: training does not go back), said in one line; empty when it is not past them."""
    return (
        (f"{out_dir} is at step {step}, past --steps {steps}: nothing to train; its final weights are from step {step}")
        if step > steps
        else ""
    )


def _first_free_or_same(cfg: RunConfig, world_size: int, log, lock: RunLock) -> RunPlan:
    name = default_name(cfg)
    skipped = []
    for n in range(1, 10_000):
        out_dir = Path("runs") / (name if n == 1 else f"{name}-{n}")
        try:
            plan = _plan_for(out_dir, cfg, world_size, log, quiet_mismatch=True, lock=lock)
        except DirectoryBusy:
            plan = _live_differences(out_dir, cfg, world_size)
            if not plan:  # this very run, or one whose configuration is not written yet
                raise
        if isinstance(plan, RunPlan):
            if skipped:
                log(
                    f"{skipped[0][0]} holds a different run ({skipped[0][1]}); this one is {out_dir} "
                    f"(pass --out-dir to choose)"
                )
            return plan
        lock.release()
        skipped.append((out_dir, "; ".join(plan[:3]) + (" ..." if len(plan) > 3 else "")))
    raise NanolmError(f"runs/{name} ... runs/{name}-9999 all hold other runs; pass --out-dir")


def _live_differences(out_dir: Path, cfg: RunConfig, world_size: int) -> list[str]:
    """How the run another process is writing in ``out_dir`` differs from this command's
    (its ``config.toml`` is written whole, first): none means this command's own run."""
    try:
        saved = load_run_config(out_dir / "config.toml")
    except NanolmError:
        return []
    return refused_changes(saved, world_size, cfg, world_size)


def resume_checkpoint_at(path: Path, log) -> Path:
    """``--resume PATH``: a checkpoint directory, or a run directory (its newest valid one).

    A checkpoint of a run that is training now can be pruned under this command at any moment
    (the run keeps ``--keep`` of them): it is copied first, and this command continues from
    the copy; a copy whose source vanished half-way is made again from the newest one."""
    is_run = (path / CHECKPOINTS).is_dir() or not (path / "meta.json").is_file()
    run_dir = path if is_run else path.parent.parent
    holder = held_by_another(run_dir)
    for _ in range(5 if holder is not None else 1):
        found = valid_resume_checkpoint(path, log) if is_run else path
        if found is None:
            raise NanolmError(f"--resume {path}: no valid checkpoint there")
        if holder is not None:
            source = found
            try:
                found = _private_copy(source)
                verify_checkpoint(found)
            except (OSError, shutil.Error, NanolmError):
                if source.exists():
                    raise
                if is_run:
                    continue  # pruned while copied: the run has a newer one by now
                raise NanolmError(
                    f"--resume {path}: its run removed that checkpoint while it was read (a live run "
                    f"keeps --keep of them); pass the run directory to continue from its newest"
                ) from None
            log(f"resume: {run_dir} is training now; continuing from a copy of {found.name} (it may be pruned there)")
        elif is_run:
            return found  # valid_resume_checkpoint verified it and checked its state
        else:
            verify_checkpoint(found)
        check_training_state(found, load_state(found))
        return found
    raise NanolmError(f"--resume {path}: its checkpoints were pruned faster than they could be copied; try again")


def _private_copy(checkpoint: Path) -> Path:
    """A copy of ``checkpoint`` in a temporary directory of this process, removed at its exit."""
    import atexit

    scratch = Path(tempfile.mkdtemp(prefix="nanolm-resume-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    copy = scratch / checkpoint.name
    shutil.copytree(checkpoint, copy)
    return copy


# --------------------------------------------------------------------------- the run's data
def open_run_data(run_data: Path, checkpoint: Path, cfg: RunConfig, scratch: Path, log=print) -> PreparedData:
    """The tokenized data a resumed run trained on, checked against its manifest.

    A damaged copy is not trained on: the data is prepared again from its source, and if
    that gives back exactly the files the checkpoint was trained on (its data digest), the
    fresh copy replaces the damaged one (the caller moves it in); else the resume stops.
    """
    try:
        return PreparedData(run_data)
    except NanolmError as e:
        log(f"warning: {e}; preparing the run's data again from its source")
    data = load_training_data(cfg, scratch, log, compressor_bounds=False)
    if read_checkpoint_meta(checkpoint).get("data_digest") != data.digest:
        raise NanolmError(
            f"{run_data} is damaged, and its source ({cfg.data.data or 'the built-in corpus'}) no "
            f"longer gives the data the run was trained on; restore the source, or start a new run "
            f"with another --out-dir"
        )
    return data


def hold_prepared_data(cfg: RunConfig, reading: ReadLock) -> None:
    """With ``--data DIR`` made by ``nanolm prepare``, share DIR's lock for the whole run: a
    prepare into DIR meanwhile is refused (``nanolm.base.lock``), and one writing it now
    refuses this run."""
    if cfg.data.data and (Path(cfg.data.data) / "meta.json").is_file():
        reading.take(cfg.data.data, "--data")


def use_prepared_tokenizer(cfg: RunConfig) -> None:
    """With ``--data DIR`` made by ``nanolm prepare`` the tokenizer is the one in DIR: the
    config says so (``--tokenizer``/``--vocab-size`` do not apply), so that two commands on
    the same shards have the same configuration."""
    d = cfg.data
    meta = Path(d.data) / "meta.json" if d.data else None
    if meta is not None and meta.is_file():
        prepared = read_json(meta)
        if (
            isinstance(prepared, dict)
            and prepared.get("tokenizer") in ("bpe", "char")
            and isinstance(prepared.get("vocab_size"), int)
            and not isinstance(prepared["vocab_size"], bool)
        ):
            d.tokenizer, d.vocab_size = prepared["tokenizer"], prepared["vocab_size"]
            return
        # said here, not as the tokenizer options left in force (a continued run would name those)
        raise NanolmError(
            f"prepared data {meta.parent}: its meta.json does not say which tokenizer the shards use "
            f"(damaged, or not written by nanolm prepare); prepare the data again"
        )


def set_up_run_directory(cfg: RunConfig, dist, plan: RunPlan, precision: str, log=print) -> PreparedData:
    """Check everything, then write the run directory; returns the run's data.

    The data is validated and tokenized in a scratch directory and every check that can
    refuse the run (a window longer than the data, a resume that would mix two runs, token
    ids outside the vocabulary, a step that cannot fit in memory) runs before ``out_dir`` is
    touched. Then rank 0 writes ``config.toml`` first (it marks the directory as a nanolm
    run), the tokenizer, and moves the data in; the other ranks read what it wrote.
    """
    from .plan import check_memory

    t, out_dir, checkpoint = cfg.train, plan.out_dir, plan.checkpoint
    with dist.main_first(), tempfile.TemporaryDirectory(prefix="nanolm-", ignore_cleanup_errors=True) as scratch:
        scratch = Path(scratch)
        run_data = out_dir / "data"
        if not dist.is_main and (run_data / "meta.json").is_file():
            data = PreparedData(run_data, verify=False)  # rank 0 has just written or verified it
        elif checkpoint is not None and run_data.exists() and not plan.restart:
            data = open_run_data(run_data, checkpoint, cfg, scratch, log)  # tokenized once, checked
        else:
            data = load_training_data(cfg, scratch, log, compressor_bounds=False)  # nothing in a run reads them
        if len(data.train) < cfg.model.seq_len + 1:
            raise fewer_tokens_than_a_window(len(data.train), cfg.model.seq_len)
        if checkpoint is not None:
            check_resume_compatible(checkpoint, cfg, data.tokenizer, log, dist, data, plan.data_moved)
        data.check_vocab(data.tokenizer.vocab_size)
        windows = eval_window_count(len(data.val), cfg.model.seq_len, t.eval_windows)
        if 0 < windows < t.eval_windows:  # no window at all has its own warning, once the run is built
            log(
                f"validation: the split holds {windows} windows of {cfg.model.seq_len} tokens, fewer than "
                f"--eval-windows {t.eval_windows}; all {windows} are scored"
            )
        check_memory(
            cfg.model.gpt_config(data.tokenizer.vocab_size),
            precision,
            dist,
            t.batch_size,
            windows,
            cfg.optim.optimizer,
            grad_accum=t.grad_accum,
        )
        if dist.is_main:
            disk.make_dir(out_dir, parents=True, exist_ok=True)
            remove_abandoned_writes(out_dir, ["config.toml", "tokenizer.json", "metrics.jsonl"])  # killed writes
            if plan.restart:  # the logs of an attempt that never committed a checkpoint
                for stale in ("metrics.jsonl", "events.jsonl", "final.json"):
                    disk.remove(out_dir / stale, missing_ok=True)
            atomic_write_text(out_dir / "config.toml", cfg.to_toml())
            data.tokenizer.save(out_dir / "tokenizer.json")
            if data.dir.parent == scratch:
                if run_data.exists():  # such an attempt's data, or a damaged copy prepared again
                    disk.remove_tree(run_data)
                move_directory(data.dir, run_data)
                data = PreparedData(run_data, verify=False)
    return data
