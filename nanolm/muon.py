"""Muon with the matrices of one shape orthogonalised together: ``torch.optim.Muon``'s update,
fewer and larger matrix products.

Why it exists: PyTorch's Muon runs its Newton-Schulz iteration one matrix at a time, and a small
model's matrices are too small for each product to use a CPU's matrix units well. The numbers
are PyTorch's (``tests/test_optim.py`` compares them step by step); the speed is measured by
``benchmarks/muon_step.py`` (docs/benchmarks.md). The course's optimizer file, ``nanolm.optim``,
says what Muon does and which parameters it gets; this module is only how it is made fast.
"""

from __future__ import annotations

import math

import torch


def newton_schulz_batched(updates: torch.Tensor, coefficients, steps: int, eps: float,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The nearest orthogonal matrix to each of ``updates`` (n, rows, cols), all at once.

    The same quintic Newton-Schulz iteration as ``torch.optim.Muon`` (each matrix scaled to
    Frobenius norm 1 first, a wide matrix's Gram matrix rather than a tall one's, in bf16 by
    default), with every product a batched one over the n matrices. The iteration's matrices
    are small (128 × 384 or 128 × 352 for a 128-wide model): one at a time, each product is too
    short to keep a CPU's matrix units busy, and the per-call cost dominates.
    """
    a, b, c = coefficients
    x = updates.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def muon_lr_factor(adjust_lr_fn: str | None, shape) -> float:
    """``torch.optim.Muon``'s scaling of the rate for a matrix of ``shape`` (its options)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


# torch.optim.Muon ships with PyTorch 2.9; on an older one the class below is never built
# (--optimizer muon is refused, muon_available), but the module must still import
_MUON = getattr(torch.optim, "Muon", torch.optim.Optimizer)


class GroupedMuon(_MUON):
    """``torch.optim.Muon``, with the matrices of one shape orthogonalised together.

    PyTorch's Muon updates one matrix at a time: ~15 small matrix products per matrix per
    step, 225 for a 3-layer model, each too small to use a CPU's matrix units well (what the
    optimizer step then costs beside AdamW's: docs/benchmarks.md, ``benchmarks/muon_step.py``). Here the momentum is updated for all matrices
    at once and the Newton-Schulz iteration runs once per shape (a transformer block has four:
    qkv, proj, the MLP's gate and up, its down), batched. Same algorithm, same state
    (``momentum_buffer``, so checkpoints load either way), same options: the same numbers as
    PyTorch's (``test_grouped_muon_takes_the_steps_of_torch_muon``; to the bit on the
    development CPU, ``benchmarks/muon_step.py``).

    A batch holds at most ``BATCH_ELEMENTS`` (16M) elements, a few 4096 × 1024 matrices: the
    iteration's stacked copies of a whole shape at once would otherwise cost a large model
    gigabytes that PyTorch's one-at-a-time loop never holds.

    One difference, on a CPU without native bf16 (no AVX512-BF16 or AMX): there bf16 matrix
    products are emulated, orders of magnitude slower than fp32, and the iteration would take
    seconds per step (docs/speedrun.md, "Muon"), so it runs in fp32, which is also the more exact.
    """

    BATCH_ELEMENTS = 2**24

    def newton_schulz_dtype(self, device: torch.device) -> torch.dtype:
        from .precision import cpu_has_native_bf16

        return torch.float32 if device.type == "cpu" and not cpu_has_native_bf16() else torch.bfloat16

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            buffers = [self.state[p]["momentum_buffer"] for p in params]
            momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            if decay:
                torch._foreach_mul_(params, 1 - lr * decay)
            by_shape: dict[tuple, list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault((tuple(p.shape), p.device), []).append(i)
            for (shape, device), members in by_shape.items():
                per_batch = max(1, self.BATCH_ELEMENTS // math.prod(shape))
                for start in range(0, len(members), per_batch):
                    batch = members[start:start + per_batch]
                    orthogonal = newton_schulz_batched(torch.stack([updates[i] for i in batch]),
                                                       group["ns_coefficients"], group["ns_steps"], group["eps"],
                                                       self.newton_schulz_dtype(device))
                    torch._foreach_add_([params[i] for i in batch], list(orthogonal.unbind(0)),
                                        alpha=-lr * muon_lr_factor(group["adjust_lr_fn"], shape))
        return loss
