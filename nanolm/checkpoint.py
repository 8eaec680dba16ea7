"""Saving and loading what a run produces.

A run directory holds ``config.toml`` (the resolved options), ``tokenizer.json`` and the
final weights in ``model.safetensors``. Safetensors stores raw tensors only: loading a
file cannot execute code, unlike a pickle.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from .config import RunConfig, load_run_config
from .errors import NanolmError
from .model import GPT
from .tokenizer import Tokenizer


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
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_weights(model: GPT, path) -> None:
    """Weights as safetensors; a tied output head is stored once."""
    from safetensors.torch import save_model

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_model(model, str(tmp))
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


def load_run(run_dir, device="cpu") -> tuple[GPT, Tokenizer, RunConfig]:
    """Model (in eval mode), tokenizer and configuration of a finished run."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise NanolmError(f"{run_dir} is not a run directory (no config.toml)")
    config = load_run_config(run_dir / "config.toml")
    tokenizer = Tokenizer.load(run_dir / "tokenizer.json")
    model = GPT(config.model.gpt_config(tokenizer.vocab_size))
    load_weights(model, run_dir / "model.safetensors")
    return model.to(device).eval(), tokenizer, config
