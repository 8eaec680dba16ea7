"""A finished run's final weights, and loading a run for ``sample``, ``eval`` and ``export``.

**Final weights** — a finished run's ``model.safetensors`` comes with ``final.json``, the
manifest of the weights, config and tokenizer that ``nanolm sample``/``eval``/``export``
load; it is written last, so its presence means the run finished.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..base import disk
from ..base.documents import read_json
from ..base.files import (
    atomic_write_text,
    check_seal,
    is_sha256,
    manifest,
    remove_abandoned_writes,
    sealed,
    sha256_file,
)
from ..base.sharded import load_sharded
from ..checkpoint import (
    FORMAT,
    _is_int,
    _is_number,
    _json_float,
    _warn,
    latest_valid_checkpoint,
    load_weights,
    save_weights,
    step_of,
    verify_checkpoint,
    weights_are_finite,
)
from ..errors import NanolmError
from ..model import GPT
from ..tokenizer import Tokenizer
from .config import RunConfig, load_run_config

FINAL = "final.json"


def save_final_weights(dist, model, run_dir, step: int, summary: dict) -> torch.nn.Module | None:
    """Write the whole model to one ``model.safetensors`` (gathered from the shards under
    FSDP), then ``final.json``. Returns, on rank 0, a plain GPT holding the weights (None on
    the others)."""
    if not dist.sharded:
        dist.from_main(lambda: write_final(run_dir, model, step, summary))
        return model if dist.is_main else None
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    gathered = []

    def write():
        with torch.device("meta"):
            plain = GPT(model.config)
        plain.load_state_dict(full, assign=True)
        if model.config.tie_embeddings:
            plain.lm_head.weight = plain.embed.weight
        write_final(run_dir, plain, step, summary)
        gathered.append(plain)

    dist.from_main(write)
    return gathered[0] if gathered else None


def write_final(run_dir, model: torch.nn.Module, step: int, summary: dict | None = None) -> None:
    """Write ``model.safetensors``, then ``final.json``: the finished run's manifest.

    ``final.json`` comes last, so a kill at any moment leaves either no claim of a finished
    run or a true one; a rerun of the same command writes whatever is missing, and removes the
    temporary files such a kill left (the caller holds the run's lock).
    """
    run_dir = Path(run_dir)
    disk.remove(run_dir / FINAL, missing_ok=True)
    remove_abandoned_writes(run_dir, [FINAL, "model.safetensors"])
    save_weights(model, run_dir / "model.safetensors")
    summary = summary or {}
    meta = {
        "format": FORMAT,
        "step": step,
        "val_loss": _json_float(summary.get("val_loss")),
        "val_bpb": _json_float(summary.get("val_bpb")),
        "files": manifest(run_dir, ("model.safetensors", "config.toml", "tokenizer.json")),
    }
    if summary.get("time_budget_s") is not None:  # the run ended where its time budget did, not at --steps
        meta["time_budget_s"] = float(summary["time_budget_s"])
    atomic_write_text(run_dir / FINAL, json.dumps(sealed(meta), indent=2))


def read_final(run_dir) -> dict | None:
    """``final.json`` of a finished run after checking its files, None for an unfinished run;
    a damaged one is a :class:`NanolmError`."""
    run_dir = Path(run_dir)
    if not (run_dir / FINAL).exists():
        return None
    what = f"{run_dir}'s final weights"
    meta = read_json(run_dir / FINAL, f"{run_dir / FINAL}")
    if isinstance(meta, dict):
        check_seal(meta, f"{run_dir / FINAL}")
    if not (
        isinstance(meta, dict)
        and meta.get("format") == FORMAT
        and _is_int(meta.get("step"))
        and all(meta.get(k) is None or _is_number(meta.get(k)) for k in ("val_loss", "val_bpb", "time_budget_s"))
        and isinstance(meta.get("files"), dict)
        and set(meta["files"]) == {"model.safetensors", "config.toml", "tokenizer.json"}
    ):
        raise NanolmError(f"{run_dir / FINAL} is malformed")
    for name, expected in meta["files"].items():
        path = run_dir / name
        if not is_sha256(expected) or not path.is_file() or path.is_symlink() or sha256_file(path) != expected:
            raise NanolmError(f"{what}: {name} is missing or corrupt (its checksum does not match)")
    return meta


def clear_final(run_dir) -> None:
    """The run is about to train on: it is no longer finished."""
    disk.remove(Path(run_dir) / FINAL, missing_ok=True)


def load_run(run_dir, device="cpu", log=_warn) -> tuple[GPT, Tokenizer, RunConfig]:
    """Model (in eval mode), tokenizer and configuration of a run (or of one checkpoint).

    Uses the final weights of a finished run when they verify, else the newest valid
    checkpoint, with a warning (on stderr: stdout may be the generated text).
    """
    run_dir = Path(run_dir)
    if step_of(run_dir) is not None and (run_dir / "meta.json").is_file():
        return _load_checkpoint_model(run_dir, device)
    if not run_dir.is_dir() or not (run_dir / "config.toml").is_file():
        raise NanolmError(f"{run_dir} is not a run directory (no config.toml)")
    try:
        final = read_final(run_dir)
    except NanolmError as e:
        final = None
        log(f"warning: {e}; using the newest valid checkpoint instead")
    if final is not None:
        config = load_run_config(run_dir / "config.toml")
        tokenizer = Tokenizer.load(run_dir / "tokenizer.json")
        model = GPT(config.model.gpt_config(tokenizer.vocab_size))
        load_weights(model, run_dir / "model.safetensors")
        return model.to(device).eval(), tokenizer, config
    for _ in range(100):  # a live run may discard the checkpoint being loaded: load the newest again
        checkpoint = latest_valid_checkpoint(run_dir, log)
        if checkpoint is None:
            raise NanolmError(f"{run_dir} has neither verified final weights nor a valid checkpoint")
        try:
            return _load_checkpoint_model(checkpoint, device)
        except (NanolmError, FileNotFoundError):
            if checkpoint.is_dir():
                raise
    raise NanolmError(f"{run_dir}: its checkpoints were discarded faster than they could be read; try again")


def _load_checkpoint_model(checkpoint: Path, device) -> tuple[GPT, Tokenizer, RunConfig]:
    meta = verify_checkpoint(checkpoint)
    config = load_run_config(checkpoint / "config.toml")
    tokenizer = Tokenizer.load(checkpoint / "tokenizer.json")
    model = GPT(config.model.gpt_config(tokenizer.vocab_size))
    if meta["layout"] == "single":
        load_weights(model, checkpoint / "model.safetensors")
    else:  # an FSDP checkpoint: gather its shards into the whole model
        load_sharded(checkpoint, model)
    if not weights_are_finite(model):
        raise NanolmError(f"checkpoint {checkpoint} holds non-finite weights")
    return model.to(device).eval(), tokenizer, config
