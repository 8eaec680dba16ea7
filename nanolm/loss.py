"""Cross-entropy over the positions that count, and only those.

Not every position of a batch should count: padding, a prompt we condition on, the
token after a document boundary when that option is on. The loss is

    sum over counted positions of -log p(target)   ÷   number of counted positions

Masked positions contribute nothing at all, whatever their logits hold. The division
is kept separate (:func:`masked_cross_entropy_sum`) because with gradient accumulation
the right denominator is the count of the *whole optimizer step*, not of one
micro-batch: averaging micro-batch means would give a short micro-batch's tokens more
weight than a long one's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def masked_cross_entropy_sum(logits, targets, mask=None):
    """(sum of per-token cross-entropy over counted positions, number of counted positions).

    Computed in fp32 whatever the logits' dtype. Both results are tensors on the logits'
    device, so no host synchronisation happens here.
    """
    if mask is None:
        mask = targets >= 0
    mask = mask.bool()
    counted_targets = torch.where(mask, targets, torch.full_like(targets, IGNORE))
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        counted_targets.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return total, mask.sum()


def masked_cross_entropy(logits, targets, mask=None):
    """Mean cross-entropy over counted positions; 0 (not NaN) when none is counted."""
    total, count = masked_cross_entropy_sum(logits, targets, mask)
    return total / count.clamp(min=1)
