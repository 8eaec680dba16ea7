"""Checkpoints written as if the machine could crash at any moment, read as if they were hostile.

A checkpoint holds everything that decides what happens next (weights, the optimizer's moments
and step count, the step, the sampler's position, every random generator, the loss scaler,
the counters, the config and tokenizer), so that a resumed run is indistinguishable from one
that never stopped. Its layout, what makes one valid, and how a write survives a crash are
told once, in docs/checkpoints.md; the functions below say what each guarantees. Under
``--dist fsdp`` the weights and optimizer state are sharded (``nanolm.base.sharded``); a
finished run's final weights, and loading a run, are ``nanolm.run.final``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch

from .base import disk
from .base.documents import read_json
from .base.files import (
    ENVIRONMENT_ERRNOS,
    atomic_write_text,
    check_manifest,
    check_seal,
    describe_os_error,
    fsync_dir,
    manifest,
    naming_the_file,
    remove_abandoned_writes,
    replace,
    save_torch,
    sealed,
)
from .base.sharded import SHARDS, load_sharded, save_sharded
from .errors import NanolmError, brief
from .machine.runtime import capture_rng, derived_seed, restore_rng, seed_everything
from .model import GPT
from .tokenizer import Tokenizer

CHECKPOINTS = "checkpoints"
LATEST = "latest"
FORMAT = 1
LAYOUTS = ("single", "sharded")
STANDALONE_FILES = ("state.pt", "config.toml", "tokenizer.json")
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


# --------------------------------------------------------------------------- weights
def save_weights(model: GPT, path) -> None:
    """Weights as safetensors (a tied output head is stored once), written atomically."""
    from safetensors.torch import save_model

    path = Path(path)
    fd, tmp = disk.make_scratch_file(path.parent, f".{path.name}.")
    os.close(fd)
    try:
        with naming_the_file(path):
            with disk.written_by_library(tmp):
                save_model(model, str(tmp))
            with open(tmp, "rb") as f:
                disk.sync(f, tmp)
        replace(tmp, path)
    except BaseException:
        disk.remove(tmp, missing_ok=True)
        raise


def load_weights(model: GPT, path) -> None:
    from safetensors.torch import load_model

    path = Path(path)
    if not path.is_file():
        raise NanolmError(f"no weights at {path}")
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except Exception as e:
        raise NanolmError(f"{path} could not be loaded into this model ({type(e).__name__}: {brief(e)})") from None
    if missing or unexpected:
        raise NanolmError(
            f"{path} does not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )


def weights_are_finite(model: torch.nn.Module) -> bool:
    flags = [torch.isfinite(p).all() for p in model.parameters()]
    return bool(torch.stack(flags).all()) if flags else True


# --------------------------------------------------------------------------- checkpoints
def config_hash(config_toml: str) -> str:
    return hashlib.sha256(config_toml.encode()).hexdigest()[:16]


def step_of(path) -> int | None:
    """The step a checkpoint directory's name says (``step_000500`` -> 500), else None."""
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir) -> list[tuple[int, Path]]:
    """(step, directory) of every committed checkpoint, valid or not, oldest first.

    Temporary directories of a save in progress (``.tmp-step_*``) are not checkpoints: the
    rename that commits one is the last step of a save.
    """
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = step_of(p)
        if step is not None and p.is_dir() and not p.is_symlink():
            found.append((step, p))
    return sorted(found)


def save_checkpoint(
    run_dir,
    step: int,
    model: torch.nn.Module | None,
    state: dict,
    config_toml: str,
    tokenizer: Tokenizer,
    val_loss: float | None = None,
    keep: int = 3,
    *,
    staged: Path | None = None,
    meta_extra: dict | None = None,
) -> Path:
    """Write checkpoint ``step`` crash-safely, move ``latest`` to it, prune old ones.

    ``state`` holds everything but the weights (optimizer, sampler, RNG, counters...), made
    of tensors, numbers, strings, lists and dicts only. Under FSDP the ranks have already
    written their shards into ``staged``, a temporary directory beside the checkpoints, and
    ``model`` is None: the checkpoint is completed there and renamed into place like any
    other. ``meta_extra`` adds entries to ``meta.json`` (world size, layout, data digest).

    A full disk or a directory that cannot be written is a one-line error; the previous
    checkpoint stays intact, so the same command resumes once there is room.
    """
    if model is not None and not weights_are_finite(model):
        raise NanolmError(f"refusing to checkpoint step {step}: the weights hold NaN or inf")
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = None
    try:
        disk.make_dir(root, parents=True, exist_ok=True)
        tmp = Path(staged) if staged is not None else disk.make_scratch_dir(root, f".tmp-step_{step:06d}-")
        if model is not None:
            save_weights(model, tmp / "model.safetensors")
        save_torch(state, tmp / "state.pt")
        atomic_write_text(tmp / "config.toml", config_toml)
        tokenizer.save(tmp / "tokenizer.json")
        for sub in (p for p in tmp.rglob("*") if p.is_dir()):
            fsync_dir(sub)
        meta = {
            "format": FORMAT,
            "step": step,
            "val_loss": _json_float(val_loss),
            "config_hash": config_hash(config_toml),
            "layout": "single" if model is not None else "sharded",
            "world_size": 1,
            "saved_at": time.time(),
            **(meta_extra or {}),
            "files": manifest(tmp),
        }
        atomic_write_text(tmp / "meta.json", json.dumps(sealed(meta), indent=2))
        fsync_dir(tmp)
        if final.exists():  # a checkpoint of the same step from an abandoned attempt
            _discard(final)
        replace(tmp, final)
        fsync_dir(root)
        atomic_write_text(root / LATEST, final.name + "\n")
    except BaseException as e:
        if tmp is not None:
            disk.remove_tree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS:
            raise NanolmError(
                f"could not save the checkpoint of step {step}: {describe_os_error(e)}; the previous "
                f"checkpoint is intact: run the same command again to resume"
            ) from None
        raise
    _prune(run_dir, keep)
    return final


def _json_float(x):
    return None if x is None else float(x)


def _prune(run_dir, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints and the one with the best validation loss; remove
    what killed saves and discards left (the caller holds the run's lock)."""
    for stale in (Path(run_dir) / CHECKPOINTS).glob(".tmp-*"):
        disk.remove_tree(stale, ignore_errors=True)
    remove_abandoned_writes(Path(run_dir) / CHECKPOINTS, [LATEST])
    checkpoints = list_checkpoints(run_dir)
    if keep <= 0 or len(checkpoints) <= keep:
        return
    best, best_loss = None, float("inf")
    for _, path in checkpoints:
        try:
            loss = read_checkpoint_meta(path)["val_loss"]
        except NanolmError:
            continue
        if loss is not None and loss < best_loss:
            best, best_loss = path, loss
    latest = read_latest(run_dir)
    for _, path in checkpoints[:-keep]:
        if path != best and path != latest:
            _discard(path)


def _discard(path: Path) -> None:
    """Delete a checkpoint so that a reader (``nanolm sample`` on a live run) finds it whole
    or gone, never half deleted: renamed aside in one atomic step, then deleted. A reader
    that loses it mid-read reads the newest one again (:func:`latest_valid_checkpoint`)."""
    try:
        aside = disk.make_scratch_dir(path.parent, f".tmp-discarded-{path.name}-")
        replace(path, aside)
    except OSError:
        return
    disk.remove_tree(aside, ignore_errors=True)


def read_latest(run_dir) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names, or None when it is absent or malformed."""
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    try:
        name = pointer.read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return Path(run_dir) / CHECKPOINTS / name if _STEP_DIR.match(name) else None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def read_checkpoint_meta(path) -> dict:
    """``meta.json`` of a checkpoint, parsed and checked: every field with its type, the step
    agreeing with the directory's name. Does not read the other files (see :func:`verify_checkpoint`)."""
    path = Path(path)
    what = f"checkpoint {path}"
    meta = read_json(path / "meta.json", f"{what}: meta.json")
    if not isinstance(meta, dict):
        raise NanolmError(f"{what}: meta.json is not an object")
    check_seal(meta, f"{what}: meta.json")
    expected = {
        "format": _is_int,
        "step": _is_int,
        "config_hash": lambda v: isinstance(v, str),
        "layout": lambda v: v in LAYOUTS,
        "world_size": lambda v: _is_int(v) and v >= 1,
        "val_loss": lambda v: v is None or _is_number(v),
        "files": lambda v: isinstance(v, dict),
    }
    for key, ok in expected.items():
        if key not in meta:
            raise NanolmError(f"{what}: meta.json has no {key!r}")
        if not ok(meta[key]):
            raise NanolmError(f"{what}: meta.json has a malformed {key!r} ({brief(repr(meta[key]), 80)})")
    if meta["format"] != FORMAT:
        raise NanolmError(f"{what}: format {meta['format']} is not one this nanolm reads ({FORMAT})")
    if meta["step"] != step_of(path):
        raise NanolmError(f"{what}: meta.json says step {meta['step']}, the directory's name says {path.name}")
    if "data_digest" in meta and not isinstance(meta["data_digest"], str):
        raise NanolmError(f"{what}: meta.json has a malformed 'data_digest'")
    return meta


def verify_checkpoint(path) -> dict:
    """The checkpoint's validated ``meta.json``, after checking every file against the manifest.

    The manifest must list exactly the files in the directory, each with its checksum, and
    hold what the layout needs; anything else makes the checkpoint invalid.
    """
    path = Path(path)
    meta = read_checkpoint_meta(path)
    files = meta["files"]
    needed = set(STANDALONE_FILES) | ({"model.safetensors"} if meta["layout"] == "single" else set())
    lacking = sorted(needed - set(files))
    if lacking:
        raise NanolmError(
            f"checkpoint {path}: its manifest lacks {lacking[0]}, which a {meta['layout']} checkpoint holds"
        )
    shards = [n for n in files if n.startswith(f"{SHARDS}/")]
    if meta["layout"] == "sharded" and (
        not shards or not all(n.endswith(".safetensors") and n.count("/") == 1 for n in shards)
    ):
        raise NanolmError(
            f"checkpoint {path}: a sharded checkpoint holds safetensors files in {SHARDS}/ and only those"
        )
    if meta["layout"] == "single" and shards:
        raise NanolmError(f"checkpoint {path}: meta.json says layout single, yet it lists files in {SHARDS}/")
    check_manifest(path, files, f"checkpoint {path}", skip=("meta.json",))
    return meta


def latest_valid_checkpoint(run_dir, log=_warn, check=None) -> Path | None:
    """The newest checkpoint whose files all verify; damaged ones are reported and skipped.

    The one ``latest`` names comes first (after a rollback an abandoned trajectory may have
    left a higher-numbered directory), then the others newest first. ``check(path)``, if
    given, is a further test (such as loading its state) whose failure also skips it.
    """
    for _ in range(100):  # a live run may discard a checkpoint while it is read here: list them again
        candidates = [p for _, p in reversed(list_checkpoints(run_dir))]
        latest = read_latest(run_dir)
        if latest is not None and latest in candidates:
            candidates.remove(latest)
            candidates.insert(0, latest)
        for path in candidates:
            try:
                verify_checkpoint(path)
                if check is not None:
                    check(path)
                return path
            except NanolmError as e:
                if not path.is_dir():  # discarded by the run (--keep) while it was read
                    break
                log(f"warning: {e}; falling back to an earlier checkpoint")
        else:
            return None
    return None


def load_state(path) -> dict:
    """``state.pt`` of a checkpoint, refusing anything but tensors and plain data."""
    file = Path(path) / "state.pt"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on the pickle protocol of a refused file
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise NanolmError(
            f"refusing to load {file}: it is not plain tensors and data "
            f"({type(e).__name__}); a checkpoint must not contain code"
        ) from None
    if not isinstance(state, dict) or not _is_int(state.get("step")):
        raise NanolmError(f"{file} is not a training state (no integer 'step')")
    if step_of(path) is not None and state["step"] != step_of(path):
        raise NanolmError(f"{file} says step {state['step']}, its directory {Path(path).name}")
    return state


TRAINING_STATE = {
    "sampler": dict,
    "scaler": dict,
    "progress": dict,
    "guard": dict,
    "observer": dict,
    "rng": dict,
    "optimizer": dict,
}


def check_training_state(path, state: dict) -> None:
    """Refuse a ``state.pt`` that lacks what a resume restores, before anything is restored."""
    for key, kind in TRAINING_STATE.items():
        if not isinstance(state.get(key), kind):
            raise NanolmError(f"checkpoint {path}: state.pt has no valid {key!r}")
    sampler = state["sampler"]
    if not all(_is_int(sampler.get(k)) and sampler[k] >= 0 for k in ("epoch", "cursor", "seed")):
        raise NanolmError(f"checkpoint {path}: state.pt holds a malformed sampler position")
    if "world_size" in state and not (_is_int(state["world_size"]) and state["world_size"] >= 1):
        raise NanolmError(f"checkpoint {path}: state.pt holds a malformed world size")


def valid_resume_checkpoint(run_dir, log) -> Path | None:
    """The newest checkpoint that verifies *and* whose state a resume can restore."""

    def loadable(path):
        check_training_state(path, load_state(path))

    return latest_valid_checkpoint(run_dir, log, check=loadable)


# --------------------------------------------------------------------------- a run's checkpoints
def save_run_checkpoint(
    dist,
    run_dir,
    step: int,
    model,
    optimizer,
    state: dict,
    config_toml: str,
    tokenizer,
    val_loss: float | None = None,
    keep: int = 3,
    meta_extra: dict | None = None,
) -> Path:
    """Save a checkpoint of every rank's state (every rank calls it); returns its directory.

    ``state`` holds what all ranks share (step, sampler, scaler, progress...); this adds the
    optimizer state, every rank's RNG state and the world size. Without sharding rank 0
    writes the single-process layout; under FSDP every rank first writes its shard.
    ``dist`` is the run's :class:`nanolm.distributed.Distributed`.
    """
    rngs = dist.all_gather(capture_rng(dist.device))
    state = dict(state, rng=rngs[0], world_size=dist.world_size)
    if dist.world_size > 1:
        state["rng_ranks"] = rngs
    meta = {**(meta_extra or {}), "world_size": dist.world_size, "layout": "sharded" if dist.sharded else "single"}
    if not dist.sharded:

        def write():
            state["optimizer"] = optimizer.state_dict()
            return save_checkpoint(run_dir, step, model, state, config_toml, tokenizer, val_loss, keep, meta_extra=meta)

        return dist.from_main(write)
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    if dist.sum(int(not finite)):
        raise NanolmError(f"refusing to checkpoint step {step}: the weights hold NaN or inf")
    staged = Path(run_dir) / CHECKPOINTS / f".tmp-step_{step:06d}-sharded"
    dist.from_main(lambda: _fresh_dir(staged))
    state["optimizer"] = save_sharded(staged / SHARDS, model, optimizer)
    return dist.from_main(
        lambda: save_checkpoint(
            run_dir, step, None, state, config_toml, tokenizer, val_loss, keep, staged=staged, meta_extra=meta
        )
    )


def _fresh_dir(path: Path) -> None:
    disk.remove_tree(path, ignore_errors=True)
    disk.make_dir(path, parents=True)


def load_run_checkpoint(dist, checkpoint: Path, state: dict, model, optimizer, log=print, rng: bool = True) -> None:
    """Load weights and optimizer state (``optimizer`` None: weights only), then this rank's
    random state (``rng`` False: keep the live one, as a rollback does, which does not replay
    the past). ``state`` is the checkpoint's ``state.pt``; the layout is the one its
    verified ``meta.json`` states. On another world size the random streams cannot be
    mapped rank to rank: they are re-derived from (seed, step, rank)."""
    checkpoint = Path(checkpoint)
    if read_checkpoint_meta(checkpoint)["layout"] == "sharded":
        load_sharded(checkpoint, model, optimizer, state["optimizer"])
    else:
        if dist.sharded:
            raise NanolmError(
                f"{checkpoint} holds full weights (a --dist none or ddp run); resume it with --dist ddp or none"
            )
        load_weights(model, checkpoint / "model.safetensors")
        if optimizer is not None:
            try:
                optimizer.load_state_dict(state["optimizer"])
            except (KeyError, ValueError, TypeError, IndexError) as e:
                raise NanolmError(
                    f"checkpoint {checkpoint}: the optimizer state does not fit this model ({type(e).__name__}: {e})"
                ) from None
    if not rng:
        return
    saved_world = int(state.get("world_size", 1))
    if saved_world == dist.world_size:
        ranks = state.get("rng_ranks")
        if saved_world > 1 and not (isinstance(ranks, list) and len(ranks) == saved_world):
            raise NanolmError(f"checkpoint {checkpoint}: state.pt lacks the random state of each rank")
        restore_rng(ranks[dist.rank] if saved_world > 1 else state["rng"], dist.device)
    else:
        seed_everything(derived_seed(int(state["sampler"]["seed"]), int(state["step"]), dist.rank))
        log(
            f"resume: the checkpoint was written by {saved_world} process(es), this run has {dist.world_size}: "
            f"random streams (dropout) are re-derived from (seed, step, rank)"
        )


class Checkpointer:
    """When to save, what, and how to come back: the run's checkpoint component.

    It saves every ``every`` steps, at the last step, when a stop signal arrived and when the
    run reached its target; what it saves is the model, the optimizer and the
    ``state_dict()`` of each stateful component of the run (``stateful``: the sampler, the loss
    scaler, the progress counters, the guard, the observer), so that a component owns its own
    state. :meth:`restore` puts all of it back (a resume), or, for a rollback, everything but
    the random streams and the components named in ``kept_by_rollback``: the data position (the
    bad batches are not replayed) and the guard's own count of rollbacks.
    """

    def __init__(
        self,
        *,
        dist,
        run_dir,
        model,
        optimizer,
        stateful: dict,
        config_toml: str,
        tokenizer,
        data_digest: str,
        every: int,
        last_step: int,
        keep: int = 3,
        log=print,
        kept_by_rollback=("sampler", "guard"),
    ):
        self.dist, self.run_dir, self.model, self.optimizer = dist, Path(run_dir), model, optimizer
        self.kept_by_rollback = set(kept_by_rollback)
        self.stateful, self.config_toml, self.tokenizer, self.data_digest = (
            stateful,
            config_toml,
            tokenizer,
            data_digest,
        )
        self.every, self.last_step, self.keep, self.log = every, last_step, keep, log

    @classmethod
    def for_run(
        cls, cfg, *, dist, run_dir, model, optimizer, stateful: dict, tokenizer, data_digest: str, log=print
    ) -> "Checkpointer":
        """The checkpointer of a run configured by ``cfg``: its ``[train]`` section says how
        often (``ckpt_every``), until which step, and how many to keep; the config is saved
        in every checkpoint."""
        t = cfg.train
        return cls(
            dist=dist,
            run_dir=run_dir,
            model=model,
            optimizer=optimizer,
            stateful=stateful,
            config_toml=cfg.to_toml(),
            tokenizer=tokenizer,
            data_digest=data_digest,
            every=t.ckpt_every,
            last_step=t.steps,
            keep=t.keep,
            log=log,
        )

    def due(self, step: int, stop_signal: int | None = None, target_reached: bool = False) -> bool:
        return step % self.every == 0 or step == self.last_step or bool(stop_signal) or target_reached

    def save(self, step: int, val_loss: float | None = None) -> Path:
        state = {"step": step, **{name: c.state_dict() for name, c in self.stateful.items()}}
        return save_run_checkpoint(
            self.dist,
            self.run_dir,
            step,
            self.model,
            self.optimizer,
            state,
            self.config_toml,
            self.tokenizer,
            val_loss,
            self.keep,
            meta_extra={"data_digest": self.data_digest},
        )

    def restore(self, path: Path, keep_data_position: bool = False) -> int:
        """Load checkpoint ``path`` into the live run; returns its step. A rollback
        (``keep_data_position=True``) keeps the sampler and the random streams where they are,
        so the batches that led to the bad step are not drawn again."""
        state = load_state(path)
        load_run_checkpoint(self.dist, path, state, self.model, self.optimizer, self.log, rng=not keep_data_position)
        for name, component in self.stateful.items():
            if not keep_data_position or name not in self.kept_by_rollback:
                try:
                    component.load_state_dict(state[name])
                except NanolmError:
                    raise
                except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
                    raise NanolmError(
                        f"checkpoint {path}: state.pt holds a malformed {name} state ({type(e).__name__}: {brief(e)})"
                    ) from None
        return state["step"]


def rollback_checkpoint(dist, run_dir, log=print) -> Path | None:
    """The newest checkpoint a rollback can return to (every rank gets rank 0's answer): the
    guard's ``rollback_to``."""
    return dist.from_main(lambda: valid_resume_checkpoint(Path(run_dir), log))
