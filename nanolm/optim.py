"""AdamW with the right parameters decayed, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn


def get_param_groups(model: nn.Module, weight_decay: float):
    """Split parameters into a decayed group and a non-decayed one.

    Weight decay pulls weights toward zero. That is a useful pressure on the matrices
    that mix features (attention and MLP projections, an untied output head), but not on:

    * norm gains: they are scale factors whose natural value is 1, not 0;
    * biases: they shift activations and hold little capacity to overfit;
    * embedding tables: a row only receives gradient when its token occurs, yet decay
      shrinks every row at every step, so rare tokens would be eroded toward zero.
      With tied embeddings the same matrix is also the output head; we still treat it as
      an embedding (as OLMo and many recent recipes do) and do not decay it.

    Rule: a parameter is decayed iff it has >= 2 dimensions and is not the weight of an
    ``nn.Embedding``. A tied parameter is listed once.
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() >= 2 and id(p) not in embedding_params:
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95), eps=1e-8):
    """AdamW over :func:`get_param_groups`, with the fused kernel on CUDA and on CPU.

    PyTorch's default AdamW on CPU updates one tensor at a time with ~10 separate
    operations each (lerp, mul, addcmul, sqrt, div, ...): 300 small operations per step for
    a 4-layer model, a few percent of a small model's step. The fused kernel does the whole
    update of a tensor in one pass (one launch per step on CUDA). Same algorithm, same
    state; the floating-point rounding differs in the last bits.

    β2 = 0.95 rather than PyTorch's 0.999: the second-moment estimate then forgets in
    ~20 steps instead of ~1000, so a sudden jump in gradient size is absorbed quickly
    instead of producing an oversized update (standard for LM pretraining since GPT-3).
    """
    device_types = {p.device.type for p in model.parameters()}
    fused = len(device_types) == 1 and device_types <= set(FUSED_ADAMW_DEVICES)
    return torch.optim.AdamW(
        get_param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=fused or None
    )


def default_min_lr(max_lr: float) -> float:
    """Where the cosine ends unless told otherwise: a tenth of the peak (the one place this
    default lives; ``--min-lr`` is resolved with it)."""
    return max_lr / 10


def cosine_lr(step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr: float | None = None) -> float:
    """Learning rate at optimizer step ``step`` (0-based): linear warmup, then cosine decay.

    * Warmup: the rate climbs linearly from max_lr/warmup_steps at step 0 to max_lr at step
      ``warmup_steps``. Adam's second-moment estimate is noisy in the first steps; full-size
      updates from it can throw a fresh model into a bad region.
    * Decay: half a cosine from max_lr down to ``min_lr`` (10 % of max_lr by default) at
      ``total_steps``, then flat. Lowering the rate at the end lets the weights settle into
      the minimum the noisy high-rate phase found.

    A pure function of the step, so resuming a run needs nothing but the step count.
    """
    if min_lr is None:
        min_lr = default_min_lr(max_lr)
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
