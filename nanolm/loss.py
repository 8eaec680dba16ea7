"""Cross-entropy over the positions that count, and only those.

Not every position of a batch should count: padding, a prompt we condition on, the
token after a document boundary when that option is on. The loss is

    sum over counted positions of -log p(target)   ÷   number of counted positions

Masked positions contribute nothing at all, whatever their logits hold. The division
is kept separate (:func:`masked_cross_entropy_sum`) because with gradient accumulation
the right denominator is the count of the *whole optimizer step*, not of one
micro-batch: averaging micro-batch means would give a short micro-batch's tokens more
weight than a long one's.

**The output head and the loss together, a chunk of positions at a time**
(:func:`head_cross_entropy_sum`). The logits of one micro-batch are big: positions ×
vocabulary, 33 MB in fp32 for 16 × 128 positions and 4,096 tokens, more than a CPU's
last-level cache. Computed whole, every pass over them (the fp32 upcast, log-softmax, its
gradient, the cast back) goes to main memory, and the head and loss cost 2–3× what they do
a few hundred positions at a time, each chunk's logits used up while they are still in
cache. The chunked version computes each chunk's gradient right away, in the forward pass
(the loss is a plain sum, so its gradient is known up to the factor that backward brings),
and never holds the logits whole. The numbers are those of :func:`masked_cross_entropy_sum`
on the head's logits up to rounding (the order of a sum).
"""

from __future__ import annotations

import math

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


def head_cross_entropy_sum(hidden, weight, targets, mask=None, chunk: int = 0):
    """(sum of per-token cross-entropy, number of counted positions) of the logits
    ``hidden @ weight.T``, computed ``chunk`` positions at a time without holding them whole.

    ``hidden`` (..., C) are the final hidden states, ``weight`` (V, C) the output head,
    ``targets`` and ``mask`` as in :func:`masked_cross_entropy_sum`, whose numbers this
    matches; ``chunk`` 0 picks :func:`loss_chunk_positions`. The head's matrix product runs in
    the autocast dtype when autocast is on (as ``nn.Linear`` would), the softmax in fp32.
    """
    if mask is None:
        mask = targets >= 0
    mask = mask.bool()
    counted_targets = torch.where(mask, targets, torch.full_like(targets, IGNORE)).reshape(-1)
    chunk = chunk or loss_chunk_positions(weight.shape[0], hidden.device)
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    device = hidden.device.type
    product_dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                     else torch.promote_types(hidden.dtype, weight.dtype))
    hidden = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedHeadLoss.apply(hidden, weight, counted_targets, chunk, wants_grad, product_dtype), mask.sum()


def loss_chunk_positions(vocab_size: int, device) -> int:
    """Positions per chunk of :func:`head_cross_entropy_sum` when none is chosen.

    On a CPU, ~2**20 logits (4 MB in fp32), at least 64 and at most 1,024 positions: chunks of
    that size stayed in cache and ran 2–2.5× faster than the whole at vocabularies of
    2,048–8,192 (``benchmarks/head_and_loss.py``), smaller ones wasted the matrix units. On a
    GPU, whose caches are no larger but whose kernels want big products, ~2**25 logits (at
    least 256 positions): chunking there saves memory (the fp32 logits of a GPT-2-sized batch
    are gigabytes) rather than time.
    """
    if torch.device(device).type == "cpu":
        return min(1024, max(64, 2**20 // vocab_size))
    return max(256, 2**25 // vocab_size)


LOG2E = 1 / math.log(2)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Sum of cross-entropies of ``hidden @ weight.T`` against ``targets`` (IGNORE: not counted).

    Forward walks the positions a chunk at a time: logits, log-softmax, the loss, and, when a
    gradient is wanted, the gradient of the loss with respect to the chunk's logits (softmax
    minus one-hot) and from it the chunk's share of both input gradients. Backward only
    multiplies them by the incoming factor (the step's 1 / token count, times the fp16 loss
    scale).

    The head's products run in ``product_dtype`` (autocast's, as ``nn.Linear`` would under
    it), with the weight cast once rather than once per chunk. The gradients' products run
    there too, except in fp16: they are computed before the loss scale is known, so an fp16
    product could overflow (or underflow) where the scaled whole-logits path would not, and
    they run in fp32 instead.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, wants_grad, product_dtype):
        device = hidden.device
        grad_dtype = torch.float32 if product_dtype == torch.float16 else product_dtype
        total = torch.zeros((), dtype=torch.float32, device=device)
        if wants_grad:
            grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=device)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device)
        with torch.autocast(device.type, enabled=False):  # the dtypes below are chosen by hand
            w = weight.to(product_dtype)
            w_for_grads = w if grad_dtype == product_dtype else weight.to(grad_dtype)
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h, t = hidden[rows], targets[rows]
                counted = (t != IGNORE)[:, None]
                safe_t = torch.where(counted, t[:, None], 0)
                logits = h.to(product_dtype) @ w.t()
                log_probs = torch.log_softmax(logits.float(), dim=-1)
                token_loss = -log_probs.gather(1, safe_t)
                total += torch.where(counted, token_loss, 0.0).sum()
                if not wants_grad:
                    continue
                # softmax minus one-hot; exp(x) as 2**(x·log2 e), ~4x faster than exp on CPU
                probs = log_probs.mul_(LOG2E).exp2_()
                d_logits = probs.scatter_add_(1, safe_t, torch.full_like(token_loss, -1.0)).to(grad_dtype)
                # a position that is not counted gives the head nothing: its row of d_logits meets zeros
                h_counted = torch.where(counted, h, torch.zeros_like(h)).to(grad_dtype)
                grad_hidden[rows] = torch.where(counted, d_logits @ w_for_grads, 0.0)
                grad_weight += d_logits.t() @ h_counted
        if wants_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return ((grad_hidden * grad_total).to(hidden_dtype), (grad_weight * grad_total).to(weight_dtype),
                None, None, None, None)


def masked_cross_entropy(logits, targets, mask=None):
    """Mean cross-entropy over counted positions; 0 (not NaN) when none is counted."""
    total, count = masked_cross_entropy_sum(logits, targets, mask)
    return total / count.clamp(min=1)
