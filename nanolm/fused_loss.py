"""The output head and the loss fused: the sum of cross-entropies of ``hidden @ weight.T``,
computed a chunk of positions at a time, so that the logits of a batch are never held whole.

``GPT.forward`` with targets calls :func:`head_cross_entropy_sum`; it computes exactly what the
reference loss of ``nanolm/model.py`` (``masked_cross_entropy_sum`` over the whole logits)
computes, and ``tests/test_fused_loss.py`` holds the two together in every number format. Read
the reference first: this file is only about doing the same faster and in less memory.
"""

from __future__ import annotations

import math

import torch

IGNORE = -100  # a target that does not count (PyTorch's ignore_index)


def head_cross_entropy_sum(hidden, weight, targets, mask=None, chunk: int = 0):
    """(sum of per-token cross-entropy, number of counted positions) of the logits
    ``hidden @ weight.T``, computed ``chunk`` positions at a time without holding them whole.

    Why a chunk at a time: the logits of one micro-batch are positions × vocabulary, tens of
    megabytes in fp32 at a vocabulary of a few thousand, more than a CPU's last-level cache.
    Computed whole, every pass over them (the fp32 upcast, the log-softmax, its gradient, the
    cast back) goes to main memory; a few hundred positions at a time, each chunk's logits are
    used up while they are still in cache (docs/benchmarks.md has the measurement). Each
    chunk's gradient is computed right away, in the forward pass (the loss is a plain sum, so
    its gradient is known up to the factor that backward brings).

    ``hidden`` (..., C) are the final hidden states, ``weight`` (V, C) the output head,
    ``targets`` and ``mask`` as in :func:`masked_cross_entropy_sum`, whose numbers this
    matches; ``chunk`` 0 picks :func:`loss_chunk_positions`. The head's matrix products (the
    logits and both gradient products) run in the autocast dtype when autocast is on (as
    ``nn.Linear`` and its backward would), the softmax and the sums in fp32.
    """
    if mask is None:
        mask = targets >= 0
    mask = mask.bool()
    counted_targets = torch.where(mask, targets, torch.full_like(targets, IGNORE)).reshape(-1)
    chunk = chunk or loss_chunk_positions(weight.shape[0], hidden.device)
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    device = hidden.device.type
    product_dtype = (
        torch.get_autocast_dtype(device)
        if torch.is_autocast_enabled(device)
        else torch.promote_types(hidden.dtype, weight.dtype)
    )
    hidden = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedHeadLoss.apply(hidden, weight, counted_targets, chunk, wants_grad, product_dtype), mask.sum()


def loss_chunk_positions(vocab_size: int, device) -> int:
    """Positions per chunk of :func:`head_cross_entropy_sum` when none is chosen.

    On a CPU, ~2**20 logits (4 MB in fp32), at least 64 and at most 1,024 positions: chunks of
    that size stayed in cache and ran fastest at vocabularies of 2,048–8,192
    (``benchmarks/head_and_loss.py``; docs/benchmarks.md), smaller ones wasted the matrix units. On a
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

    All three products (the logits and the two gradient products) run in ``product_dtype``
    (autocast's, as ``nn.Linear`` would under it), with the weight cast once rather than once
    per chunk; their results are accumulated in fp32. Under fp16 the gradient products need
    care, because they are computed before the loss scale is known: see :func:`_fp16_scale`.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, wants_grad, product_dtype):
        device = hidden.device
        total = torch.zeros((), dtype=torch.float32, device=device)
        if wants_grad:
            grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=device)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device)
        with torch.autocast(device.type, enabled=False):  # the dtypes below are chosen by hand
            w = weight.to(product_dtype)
            fp16 = wants_grad and product_dtype == torch.float16
            if fp16:  # a row of d @ w is at most sum |d| (<= 2) times the largest weight
                hidden_scale = _fp16_scale(2 * torch.linalg.vector_norm(w, math.inf).float())
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h, t = hidden[rows].to(product_dtype), targets[rows]
                counted = (t != IGNORE)[:, None]
                safe_t = torch.where(counted, t[:, None], 0)
                logits = h @ w.t()
                log_probs = torch.log_softmax(logits.float(), dim=-1)
                token_loss = -log_probs.gather(1, safe_t)
                # not in place: PyTorch 2.11's torch.compile drops the gradient of a Function
                # whose forward mutates its output in place (every gradient 0, the loss right)
                total = total + torch.where(counted, token_loss, 0.0).sum()
                if not wants_grad:
                    continue
                # softmax minus one-hot; exp(x) as 2**(x·log2 e): PyTorch's CPU exp2 is the faster kernel
                probs = log_probs.mul_(LOG2E).exp2_()
                # a position that is not counted gives the head nothing: its row of d_logits meets zeros
                h_counted = torch.where(counted, h, torch.zeros_like(h))
                if fp16:  # row v of d.T @ h: at most the sum over positions of |d| (p, +1 at v's targets) × max |h|
                    largest = torch.linalg.vector_norm(h_counted, math.inf, dim=-1).float()
                    token_scale = _fp16_scale((probs.t() @ largest).index_add_(0, safe_t[:, 0], largest))
                d_logits = probs.scatter_add_(1, safe_t, torch.full_like(token_loss, -1.0))
                if fp16:
                    grad_hidden[rows] = torch.where(counted, (d_logits * hidden_scale).half() @ w, 0.0)
                    grad_weight += ((d_logits * token_scale).half().t() @ h_counted) / token_scale[:, None]
                else:
                    d_logits = d_logits.to(product_dtype)
                    grad_hidden[rows] = torch.where(counted, d_logits @ w, 0.0)
                    grad_weight += d_logits.t() @ h_counted
            if fp16:
                grad_hidden /= hidden_scale  # exact: a power of two
        if wants_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (
            (grad_hidden * grad_total).to(hidden_dtype),
            (grad_weight * grad_total).to(weight_dtype),
            None,
            None,
            None,
            None,
        )


def _fp16_scale(bound: torch.Tensor) -> torch.Tensor:
    """For each entry of ``bound``, the power of two s, at most 2^15, with bound × s < 2^15:
    fp32, on ``bound``'s device, computed there (no host read).

    The head's gradient products under fp16 take the gradient of the logits, d (softmax
    minus one-hot, each entry in [-1, 1]), as an fp16 operand, and they are computed in the
    forward pass, before the step's loss scale and 1 / token count can lift it. Cast as it
    is, d's small entries (the probabilities of unlikely tokens: ~1e-5 on average at a
    vocabulary of 50,000, far less for rare tokens) fall below fp16's smallest normal number
    (6e-5) and lose their digits, or become 0; and a product summed over many positions of
    large hidden states can exceed 65,504. So d is multiplied by s before the cast, as much as
    it can be while no entry of the product can overflow, given a bound on that entry per
    unit of scale (``bound``): one s for the hidden-state gradient, one per token (per row of
    the weight gradient) for the weight gradient, since a rare token's row is made of tiny
    probabilities only. The fp32 result is divided by s again, exactly.

    s is built from the exponent bits of ``bound``, so it is an exact power of two on every
    device.
    """
    biased_exponent = (bound.float().view(torch.int32) >> 23) & 0xFF  # bound < 2^(biased_exponent - 126)
    exponent = (141 - biased_exponent).clamp(-126, 15)  # 141 = 15 + 126
    return ((exponent + 127) << 23).view(torch.float32)
