"""Number formats for training: autocast, loss scaling for fp16, stochastic rounding for pure bf16.

What each ``--precision`` keeps in which format, why the master weights stay fp32, how the loss
scale moves and why ``auto`` picks what it picks are told once, in docs/precision.md; the
docstrings below say what each piece guarantees. The optimizer for bf16 weights is
``nanolm.optim.BF16AdamW``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import warnings
from dataclasses import dataclass

import torch

from .errors import NanolmError

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "bf16-pure")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """A resolved ``--precision``: never ``auto``; ``reason`` says why it was chosen."""

    name: str
    device_type: str
    reason: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return AUTOCAST_DTYPES.get(self.name)

    @property
    def pure_bf16(self) -> bool:
        return self.name == "bf16-pure"

    @property
    def autocast(self):
        """What makes the context the forward pass runs in (``with precision.autocast():``):
        autocast to 16 bits, or nothing for fp32.

        bf16-pure runs under bf16 autocast as well: its weights are bf16 already, and autocast
        lines up the places where fp32 tensors (the RoPE tables, kept fp32) meet bf16 ones
        before attention.
        """
        if self.autocast_dtype is None:
            return contextlib.nullcontext
        return functools.partial(torch.autocast, self.device_type, dtype=self.autocast_dtype)

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where oneDNN runs
    bf16 matrix multiplies at about twice the fp32 rate; ``auto`` picks bf16 there."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def resolve_precision(name: str, device: torch.device) -> Precision:
    """Turn ``--precision`` into a :class:`Precision` for ``device``, or a one-line error.

    Called before anything is written, so an impossible combination (bf16 on a GPU without
    bf16, a dtype autocast does not support on this device) stops the run cleanly. PyTorch
    itself only *warns* and quietly runs in fp32 when autocast cannot use a dtype; that warning
    is an error here: a run silently trained in another precision than asked is a silent bug.
    """
    if name not in PRECISIONS:
        raise NanolmError(f"unknown precision {name!r}; use one of {', '.join(PRECISIONS)}")
    kind = device.type
    if name == "auto":
        if kind == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
            return Precision("bf16", kind, "auto: this GPU computes in bf16 natively; weights stay fp32")
        if kind == "cuda":
            return Precision(
                "fp16",
                kind,
                "auto: this GPU has no bf16 tensor cores (T4/V100 class); fp16 is its fast "
                "format, with dynamic loss scaling; weights stay fp32",
            )
        if kind == "mps":
            return Precision(
                "fp32",
                kind,
                "auto: on an Apple GPU nanolm has not measured 16-bit autocast to pay; "
                "--precision fp16 or bf16 to try it",
            )
        if kind == "cpu" and cpu_has_native_bf16():
            return Precision(
                "bf16",
                kind,
                "auto: this CPU multiplies bf16 natively, where bf16 reached both speedrun "
                "targets sooner than fp32 with the same final loss "
                "(docs/precision.md); weights stay fp32; --precision fp32 to override",
            )
        return Precision(
            "fp32", kind, f"auto: on {kind} bf16 is usually slower than fp32; ask --precision bf16 to override"
        )
    if name == "fp32":
        return Precision("fp32", kind, "requested")
    if "bf16" in name and kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise NanolmError(
            f"--precision {name}: this GPU ({torch.cuda.get_device_name(device)}) has no bf16 support; "
            "use --precision fp16 (with loss scaling) or fp32"
        )
    dtype = AUTOCAST_DTYPES[name]
    if not torch.amp.is_autocast_available(kind):
        raise NanolmError(f"--precision {name}: PyTorch has no autocast for {kind} devices; use --precision fp32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.autocast(kind, dtype=dtype)
    if caught:
        raise NanolmError(
            f"--precision {name} is not supported on {kind} by this PyTorch "
            f"({str(caught[0].message).strip()}); use --precision fp32"
        )
    reason = "requested"
    if kind == "cpu" and "bf16" in name and cpu_has_native_bf16():
        reason += (
            "; this CPU has native bf16 dot products: the Linear layers' matrix multiplies run "
            "faster than in fp32 (attention stays fp32, see docs/benchmarks.md)"
        )
    elif kind == "cpu":
        reason += "; a CPU without native 16-bit units emulates it, slower than fp32 (fine to check numerics)"
    if "bf16" in name and kind == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        reason += "; this GPU only emulates bf16, which is slow: fp16 is its fast 16-bit format"
    return Precision(name, kind, reason)


def cast_weights_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Store every parameter of ``model`` in ``dtype``, in place; buffers keep theirs.

    The RoPE tables (buffers) stay fp32: they are constants, cost nothing to keep exact, and
    autocast takes care of mixing them with bf16 activations. Tied parameters stay tied.
    """
    for p in model.parameters():
        p.data = p.data.to(dtype)


class DynamicLossScaler:
    """Loss scaling for fp16, with its state in plain sight.

    The loss is multiplied by ``loss_scale`` (2^16 to start) before backward, so every gradient
    is too, and fp16 can represent them. After the last backward pass of a step:

    1. :meth:`unscale_` divides the gradients by the scale, in fp32. This comes *before*
       clipping: clipping compares the gradient norm with ``--clip``, and a norm 65,536 times
       too large would clip every step down to nothing. The scale is always a power of two,
       so dividing by it is exact.
    2. :meth:`update` looks at the (unscaled) global gradient norm. Non-finite means some
       gradient overflowed fp16 (inf) or became NaN: the step must be skipped, since one inf
       in AdamW's moments poisons that weight for good, and the scale is halved. After
       ``growth_interval`` steps in a row without overflow the scale doubles again, so it keeps
       sitting just below the overflow point, where the most small gradients survive.

    Why not ``torch.amp.GradScaler``? It does the same arithmetic, but hides the skip inside
    ``scaler.step(optimizer)``, keeps no count of skipped steps and ties itself to optimizer
    objects. Here the loop reads "unscale, clip, step unless it overflowed", the scale and
    the skipped steps are logged (:meth:`metrics`) and checkpointed (:meth:`state_dict`), and
    the overflow check reuses the gradient norm that clipping computes anyway.

    Disabled (any precision but fp16), the scale is 1, unscaling does nothing and every step
    is taken: a non-finite gradient in fp32 is a real failure, not an overflow to ride out.
    """

    def __init__(
        self,
        enabled: bool = True,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        self.enabled = enabled
        self.loss_scale = float(init_scale) if enabled else 1.0
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.good_steps = 0
        self.skipped_steps = 0

    @torch.no_grad()
    def unscale_(self, parameters) -> None:
        """Divide every gradient by the loss scale (exact: the scale is a power of two).

        One ``_foreach_mul_`` per device and dtype: on a GPU a few kernel launches for the
        whole model instead of one per parameter tensor.
        """
        if not self.enabled:
            return
        inv = 1.0 / self.loss_scale
        for grads in by_device_and_dtype(p.grad for p in parameters if p.grad is not None):
            torch._foreach_mul_(grads, inv)

    def update(self, grad_norm) -> bool:
        """Adapt the scale to this step's gradients; returns whether the step should be taken.

        ``grad_norm`` is the global norm of the unscaled gradients: it is inf or NaN exactly
        when some gradient is (or when the norm itself overflows fp32, a step no one should
        take either). Whether to step must be known on the host, so a device tensor is read
        here: the fp16 step's one host read. When the guard has already read the norm (a
        float), nothing more is read.
        """
        if not self.enabled:
            return True
        if math.isfinite(float(grad_norm)):  # a float: no read; a device tensor: the one read
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.loss_scale *= self.growth_factor
                self.good_steps = 0
            return True
        self.skipped_steps += 1
        self.good_steps = 0
        self.loss_scale *= self.backoff_factor
        if self.loss_scale < 1.0:
            raise NanolmError(
                f"fp16 gradients overflow even without loss scaling ({self.skipped_steps} steps skipped); "
                "the gradients are not finite or exceed fp16's range: use --precision bf16 or fp32, or lower --lr"
            )
        return False

    def metrics(self) -> dict:
        """``loss_scale`` (after this step's update) and ``skipped_steps`` (so far), fp16 only."""
        if not self.enabled:
            return {}
        return {"loss_scale": self.loss_scale, "skipped_steps": self.skipped_steps}

    def state_dict(self) -> dict:
        return {"loss_scale": self.loss_scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.loss_scale = float(state["loss_scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


FP16_SMALLEST_NORMAL = 2.0**-14  # ~6.1e-5: below it fp16 keeps fewer digits (subnormals), below 2^-24 none


@torch.no_grad()
def grad_subnormal_fraction(parameters, loss_scale: float) -> torch.Tensor:
    """Share of gradient values that fp16 held below its normal range: fp16's underflow,
    read from the number format itself.

    During backward a gradient is ``g × loss_scale``; fp16 holds it with all of its 11
    significant bits only from 2^-14 (~6.1e-5) up. Below that it is a subnormal with fewer bits
    (a value near 1e-6 keeps 4), and below 2^-24 (~6e-8) it is 0. So the share of
    values with ``|g| × loss_scale < 2^-14``, exact zeros included, is what fp16 lost or
    blurred, whatever the CPU's or GPU's kernels do with subnormals (some flush them to zero,
    some keep them, some compute in fp32 and round once): the figure depends on the gradients'
    sizes and the scale, never on the kernels. With nanolm's dynamic scale (2^16 at the start)
    it stays near the share of structural zeros; without loss scaling a small model's gradients
    are largely below 6e-5 (docs/health.md has the lab's figures).

    A 0-dim fp32 tensor on the gradients' device, read once by whoever logs it (as
    :func:`grad_zero_fraction`). Under FSDP each count is completed across ranks first.
    """
    limit = FP16_SMALLEST_NORMAL / loss_scale
    return _share_of_gradient_values(parameters, lambda g: g.abs() < limit)


def _share_of_gradient_values(parameters, counted) -> torch.Tensor:
    """The share of all gradient values for which ``counted`` is true, summed on the device."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    counts = [counted(g).sum() for g in grads]
    counts = [c.full_tensor() if hasattr(c, "full_tensor") else c for c in counts]  # FSDP: a shard's count
    return torch.stack(counts).sum().float() / sum(g.numel() for g in grads)


@torch.no_grad()
def grad_zero_fraction(parameters) -> torch.Tensor:
    """Fraction of gradient elements that are exactly zero: fp16's underflow detector.

    A gradient below fp16's smallest number (~6e-8) does not come out small, it comes out 0,
    and training goes on with that weight frozen. A rising share of exact zeros under fp16,
    against the same run in fp32, is the sign; a loss scale that is too low is the usual
    cause. Some zeros are structural and appear in fp32 too (with untied embeddings, the rows
    of tokens absent from the batch). One pass over the gradients: measured on logged steps.

    Returns a 0-dim fp32 tensor on the gradients' device, not a number: the counts are summed
    there, and whoever logs it reads it once (reading one count per parameter tensor would
    stall a GPU once per tensor). Under FSDP each count is completed across ranks first.
    """
    return _share_of_gradient_values(parameters, lambda g: g == 0)


def by_device_and_dtype(tensors) -> list[list[torch.Tensor]]:
    """``tensors`` in lists that share a device and a dtype, the unit a ``torch._foreach_*``
    call takes in one go (its fused kernels want both alike), in first-seen order."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def rounding_seed(seed: int, step: int, index: int) -> int:
    """The seed of the stochastic rounding noise of optimizer step ``step`` for the parameters
    starting at ``index``, in a run seeded ``seed``: repeatable, different for every
    combination, and always a valid generator seed.

    A hash, not arithmetic: ``(seed * 1_000_003 + step) * 65_537 + index`` exceeded the 64
    bits a generator seed may hold once ``--seed`` passed ~2.8e8 (it may go to 2^32), and
    ``--precision bf16-pure`` then failed at its first step. 63 bits of BLAKE2b fit any
    generator, and two combinations share a seed with negligible probability.
    """
    digest = hashlib.blake2b(f"{seed},{step},{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16, up or down at random, so that the *expected* result is ``x``.

    A bf16 number is the top 16 bits of an fp32 one. Adding a uniform random integer in
    [0, 2^16) to the fp32 bit pattern and then cutting the low 16 bits rounds up with
    probability (distance to the lower bf16 neighbour) / (gap between the neighbours): a
    weight of 1.0 receiving +0.001 (an eighth of the gap 2^-7) becomes 1.0078125 one time
    in eight and stays 1.0 otherwise; on average it moved by exactly 0.001. The bit pattern
    holds the magnitude, so the same holds for negative numbers; a carry into the exponent
    is the correct round-up to the next power of two. Round-to-nearest instead returns 1.0
    every time, and the update is lost for good.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_to_bf16 expects fp32, got {x.dtype}")
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    truncated = (bits + noise) & -65536  # -65536 == 0xFFFF0000: keep sign, exponent, top 7 mantissa bits
    return truncated.view(torch.float32).to(torch.bfloat16)  # exact: the dropped bits are zero
