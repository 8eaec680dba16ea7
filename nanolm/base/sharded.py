"""Sharded checkpoints for ``--dist fsdp``: every rank writes and reads its own shard.

Under ``--dist fsdp`` every rank holds only a shard of the weights and of the optimizer
state, so those go to ``sharded/`` instead: one safetensors file per rank, written by
``torch.distributed.checkpoint`` with its safetensors storage. DCP's default format keeps
its index in a pickle (``.metadata``) and unpickles it on load, so a crafted checkpoint
could run code; the safetensors storage rebuilds the index from the files' JSON headers, so
nothing in ``sharded/`` can. What that costs against the pickle format, saving and loading,
is measured in docs/checkpoints.md (``benchmarks/sharded_checkpoint.py``). The optimizer's non-tensor
settings (its param groups) go to ``state.pt``.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch

from ..errors import NanolmError
from . import disk

SHARDS = "sharded"


def _storage():
    """DCP's safetensors reader and writer; one line when this PyTorch lacks them (each rank
    writing its own shard, ``save_distributed``, arrived in PyTorch 2.9)."""
    import inspect

    try:
        from torch.distributed.checkpoint import (
            HuggingFaceStorageReader,
            HuggingFaceStorageWriter,
        )
    except ImportError:
        HuggingFaceStorageWriter = None
    if (
        HuggingFaceStorageWriter is None
        or "save_distributed" not in inspect.signature(HuggingFaceStorageWriter).parameters
    ):
        raise NanolmError(
            f"--dist fsdp checkpoints need torch.distributed.checkpoint's safetensors storage with "
            f"per-rank shards (PyTorch >= 2.9); this is PyTorch {torch.__version__}: upgrade it, "
            f"or use --dist ddp"
        )
    return HuggingFaceStorageReader, HuggingFaceStorageWriter


def require_sharded_storage() -> None:
    """Refuse ``--dist fsdp`` before anything is written when its checkpoints could not be saved."""
    _storage()


def _checkpoint_exception() -> type:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _first_cause(error: BaseException) -> str:
    """The innermost message of a (possibly multi-rank) DCP error, on one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [line for line in lines if ":" in line and not line.startswith(("File ", "Traceback", "^"))]
    return (causes[-1] if causes else type(error).__name__)[:300]


def _untied(model_state: dict, model) -> dict:
    """A tied head shares the embedding's tensor; it is stored once, as ``embed.weight``."""
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    return {k: v for k, v in model_state.items() if not (tied and k == "lm_head.weight")}


def save_sharded(directory: Path, model, optimizer) -> dict:
    """Every rank writes its shard of the weights and Adam's moments into ``directory``
    (collective: every rank calls it). Returns what ``state.pt`` must hold besides: the
    optimizer's param groups (plain numbers, rank-independent)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, writer = _storage()
    model_state, optim_state = get_state_dict(model, optimizer)
    with disk.written_by_library(directory):
        dcp.save(
            {"model": _untied(model_state, model), "optim": {"state": optim_state["state"]}},
            storage_writer=writer(str(directory), save_distributed=True),
        )
    return {"param_groups": optim_state["param_groups"]}


def load_sharded(checkpoint: Path, model: torch.nn.Module, optimizer=None, optimizer_state: dict | None = None) -> None:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``), whatever the world size.

    Each rank reads its part of every tensor, resharding when the world size changed; a
    plain (unsharded) model reads whole tensors, in one process too. ``optimizer_state``
    is ``state.pt``'s optimizer entry (the param groups).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    reader, _ = _storage()
    path = Path(checkpoint) / SHARDS
    with warnings.catch_warnings():  # one process reading shards is intended, not a mistake to warn about
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if optimizer is None:
            model_state, optim_state = get_model_state_dict(model), None
        else:
            model_state, optim_state = get_state_dict(model, optimizer)
        tensors = {"model": _untied(model_state, model)}
        if optimizer is not None:
            tensors["optim"] = {"state": optim_state["state"]}
        logging.disable(logging.ERROR)  # DCP logs a failed read with a traceback of its own; we say it in one line
        try:
            dcp.load(tensors, storage_reader=reader(str(path)))
        except (Exception, _checkpoint_exception()) as e:  # DCP's CheckpointException is a BaseException
            raise NanolmError(
                f"checkpoint {checkpoint}: its shards cannot be read into this model ({_first_cause(e)})"
            ) from None
        finally:
            logging.disable(logging.NOTSET)
        loaded = dict(tensors["model"])
        if "lm_head.weight" in model_state and "lm_head.weight" not in loaded:
            loaded["lm_head.weight"] = loaded["embed.weight"]
        if optimizer is None:
            set_model_state_dict(model, loaded)
            return
        groups = (optimizer_state or {}).get("param_groups")
        if not isinstance(groups, list):
            raise NanolmError(f"checkpoint {checkpoint}: state.pt has no optimizer param groups")
        set_state_dict(
            model,
            optimizer,
            model_state_dict=loaded,
            optim_state_dict={"state": tensors["optim"]["state"], "param_groups": groups},
        )
