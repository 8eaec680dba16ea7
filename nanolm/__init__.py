"""nanolm: train small GPTs from scratch, with runs you can trust.

The names below import on first use (PEP 562): ``import nanolm`` stays light, so that the
``nanolm`` command starts by setting up its process (a Ctrl-C while PyTorch loads is one
line, not a traceback) before anything heavy is imported.
"""

__version__ = "0.1.0"

from .errors import NanolmError

_WHERE = {
    "GPT": "model",
    "GPTConfig": "model",
    "head_cross_entropy_sum": "fused_loss",
    "masked_cross_entropy": "model",
    "masked_cross_entropy_sum": "model",
    "get_param_groups": "optim",
    "cosine_lr": "step",
    "wsd_lr": "step",
}

__all__ = ["NanolmError", *sorted(_WHERE)]


def __getattr__(name: str):
    if name in _WHERE:
        from importlib import import_module

        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'nanolm' has no attribute {name!r}")
