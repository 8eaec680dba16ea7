"""nanolm: train small GPTs from scratch, with runs you can trust."""

__version__ = "0.1.0"

from .errors import NanolmError
from .model import (
    GPT,
    GPTConfig,
    head_cross_entropy_sum,
    masked_cross_entropy,
    masked_cross_entropy_sum,
)
from .optim import get_param_groups
from .step import cosine_lr, wsd_lr

__all__ = [
    "GPT",
    "GPTConfig",
    "NanolmError",
    "cosine_lr",
    "get_param_groups",
    "head_cross_entropy_sum",
    "masked_cross_entropy",
    "masked_cross_entropy_sum",
    "wsd_lr",
]
