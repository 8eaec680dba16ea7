"""Checkpoints written as if the machine could crash at any moment.

**What a checkpoint holds** — everything that decides what happens next, so that a resumed
run is indistinguishable from one that never stopped: the weights; the optimizer state
(Adam's m and v *and* its step count t, which sets the bias correction); the training step
(the learning rate is a pure function of it); the sampler's position in the data; every
random number generator (Python, NumPy, torch CPU, each CUDA device); the loss scaler's
state; counters (tokens seen, best validation loss); the resolved config and the tokenizer.

**Layout** — one directory per checkpoint, ``checkpoints/step_000500/``:

* ``model.safetensors`` — the weights, raw tensors only;
* ``state.pt`` — the rest, readable with ``torch.load(weights_only=True)``: tensors, numbers,
  strings, lists and dicts only. Loading refuses anything else, so an untrusted checkpoint
  cannot run code (a pickle can);
* ``config.toml``, ``tokenizer.json`` — so a checkpoint stands alone;
* ``meta.json`` — step, validation loss, a hash of the config, the world size that wrote it
  and the SHA-256 of every file.

Under ``--dist fsdp`` every rank holds only a shard of the weights and of the optimizer
state, so those go to ``sharded/`` instead (``torch.distributed.checkpoint``: a file per rank
plus its metadata) and ``state.pt`` holds the rest; see ``nanolm.distributed``.

**Crash safety** — a checkpoint is written into a temporary directory, every file fsynced,
then renamed into place (a rename is atomic), and only then is ``checkpoints/latest`` (a
one-line file naming the newest checkpoint) replaced, itself atomically. A crash at any
moment leaves the previous checkpoint and pointer intact. On load every file's checksum is
verified; a damaged checkpoint is named and skipped in favour of the previous valid one.
Weights that are not finite are never saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .config import RunConfig, load_run_config
from .errors import NanolmError
from .model import GPT
from .tokenizer import Tokenizer

CHECKPOINTS = "checkpoints"
LATEST = "latest"
SHARDS = "sharded"
_STEP_DIR = re.compile(r"^step_(\d+)$")


# --------------------------------------------------------------------------- small files
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- weights
def save_weights(model: GPT, path) -> None:
    """Weights as safetensors (a tied output head is stored once), written atomically."""
    from safetensors.torch import save_model

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_model(model, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_weights(model: GPT, path) -> None:
    from safetensors.torch import load_model

    path = Path(path)
    if not path.is_file():
        raise NanolmError(f"no weights at {path}")
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except Exception as e:
        raise NanolmError(f"{path} could not be loaded into this model ({e})") from None
    if missing or unexpected:
        raise NanolmError(f"{path} does not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")


def weights_are_finite(model: torch.nn.Module) -> bool:
    flags = [torch.isfinite(p).all() for p in model.parameters()]
    return bool(torch.stack(flags).all()) if flags else True


# --------------------------------------------------------------------------- random state
def capture_rng() -> dict:
    """Every generator a training step may draw from, as tensors and plain numbers."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state = {
        "python": {"version": version, "state": list(py_state), "gauss": py_gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            raise NanolmError(f"the checkpoint holds RNG states for {len(state['cuda'])} CUDA devices, "
                              f"this machine has {torch.cuda.device_count()}")
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- checkpoints
def config_hash(config_toml: str) -> str:
    return hashlib.sha256(config_toml.encode()).hexdigest()[:16]


def list_checkpoints(run_dir) -> list[tuple[int, Path]]:
    """(step, directory) of every complete-looking checkpoint, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / "meta.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(run_dir, step: int, model: torch.nn.Module | None, state: dict, config_toml: str,
                    tokenizer: Tokenizer, val_loss: float | None = None, keep: int = 3, *,
                    staged: Path | None = None, meta_extra: dict | None = None) -> Path:
    """Write checkpoint ``step`` crash-safely, move ``latest`` to it, prune old ones.

    ``state`` holds everything but the weights (optimizer, sampler, RNG, counters...), made
    of tensors, numbers, strings, lists and dicts only. Under FSDP the ranks have already
    written their shards into ``staged``, a temporary directory beside the checkpoints, and
    ``model`` is None: the checkpoint is completed there and renamed into place like any
    other. ``meta_extra`` adds entries to ``meta.json`` (the world size that wrote it).
    """
    if model is not None and not weights_are_finite(model):
        raise NanolmError(f"refusing to checkpoint step {step}: the weights hold NaN or inf")
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(staged) if staged is not None else Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-step_{step:06d}-"))
    try:
        if model is not None:
            save_weights(model, tmp / "model.safetensors")
        _torch_save_synced(state, tmp / "state.pt")
        atomic_write_text(tmp / "config.toml", config_toml)
        tokenizer.save(tmp / "tokenizer.json")
        for sub in (p for p in tmp.rglob("*") if p.is_dir()):
            _fsync_dir(sub)
        files = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        meta = {"format": 1, "step": step, "val_loss": val_loss, "config_hash": config_hash(config_toml),
                "files": files, "saved_at": time.time(), **(meta_extra or {})}
        atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=2))
        _fsync_dir(tmp)
        if final.exists():  # a checkpoint of the same step from an abandoned attempt
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / LATEST, final.name + "\n")
    _prune(run_dir, keep)
    return final


def _torch_save_synced(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _prune(run_dir, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints and the one with the best validation loss."""
    checkpoints = list_checkpoints(run_dir)
    if keep <= 0 or len(checkpoints) <= keep:
        return
    best, best_loss = None, float("inf")
    for _, path in checkpoints:
        loss = json.loads((path / "meta.json").read_text()).get("val_loss")
        if loss is not None and loss < best_loss:
            best, best_loss = path, loss
    latest = read_latest(run_dir)
    for _, path in checkpoints[:-keep]:
        if path != best and path != latest:
            shutil.rmtree(path, ignore_errors=True)
    for stale in (Path(run_dir) / CHECKPOINTS).glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def read_latest(run_dir) -> Path | None:
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    return Path(run_dir) / CHECKPOINTS / pointer.read_text().strip()


def verify_checkpoint(path) -> dict:
    """The checkpoint's meta.json after checking every file against its checksum."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NanolmError(f"checkpoint {path}: meta.json is unreadable ({e})") from None
    for name, expected in meta.get("files", {}).items():
        if not (path / name).is_file():
            raise NanolmError(f"checkpoint {path}: {name} is missing")
        if sha256_file(path / name) != expected:
            raise NanolmError(f"checkpoint {path}: {name} is corrupt (its checksum does not match)")
    return meta


def latest_valid_checkpoint(run_dir, log=print) -> Path | None:
    """The newest checkpoint whose files all verify; damaged ones are reported and skipped."""
    candidates = [p for _, p in reversed(list_checkpoints(run_dir))]
    latest = read_latest(run_dir)
    if latest is not None and latest in candidates:  # the pointer first, then older ones
        candidates.remove(latest)
        candidates.insert(0, latest)
    for path in candidates:
        try:
            verify_checkpoint(path)
            return path
        except NanolmError as e:
            log(f"warning: {e}; falling back to an earlier checkpoint")
    return None


def load_state(path) -> dict:
    """``state.pt`` of a checkpoint, refusing anything but tensors and plain data."""
    try:
        return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise NanolmError(
            f"refusing to load {Path(path) / 'state.pt'}: it is not plain tensors and data "
            f"({type(e).__name__}); a checkpoint must not contain code"
        ) from None


# --------------------------------------------------------------------------- runs
def load_run(run_dir, device="cpu") -> tuple[GPT, Tokenizer, RunConfig]:
    """Model (in eval mode), tokenizer and configuration of a run (or of one checkpoint).

    Uses the final ``model.safetensors`` of a finished run, else its newest valid checkpoint.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise NanolmError(f"{run_dir} is not a run directory (no config.toml)")
    config = load_run_config(run_dir / "config.toml")
    tokenizer = Tokenizer.load(run_dir / "tokenizer.json")
    model = GPT(config.model.gpt_config(tokenizer.vocab_size))
    weights = run_dir / "model.safetensors"
    if not weights.is_file():
        checkpoint = latest_valid_checkpoint(run_dir)
        if checkpoint is None:
            raise NanolmError(f"{run_dir} has neither final weights nor a valid checkpoint")
        weights = checkpoint / "model.safetensors"
    if weights.is_file() or not (weights.parent / SHARDS).is_dir():
        load_weights(model, weights)
    else:  # an FSDP checkpoint: gather its shards into the whole model
        from .distributed import load_sharded

        load_sharded(weights.parent, model)
    return model.to(device).eval(), tokenizer, config
