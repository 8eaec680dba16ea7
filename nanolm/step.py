"""One optimizer step, as one function a reader can follow and a benchmark can time: the learning
rate of a step (the first part of this file), then :func:`train_step`, whose five parts (a to e)
``nanolm/train.py``'s docstring tells in order. What follows is why two of them are as they are.

**Why divide each micro-batch's sum by the step's count.** The accumulated gradient is then
exactly the gradient of the mean loss over every counted token of the step, the same as
one big batch. Averaging per-micro-batch means instead would weigh a token in a short
micro-batch more than one in a long micro-batch, and change the effective learning rate
with ``--grad-accum``. Under torchrun the count is summed over every rank and gradients are
summed across ranks after the last micro-batch only (``nanolm.distributed``): the same step,
split over processes. The ``if dist.active`` and ``if dist.sharded`` lines of
:func:`train_step` are all that changes; on one process they are skipped.

**One host read per step.** Reading a number from a GPU makes the host wait until the GPU has
computed it, and leaves the GPU idle while the host then prepares the next kernels. The step
reads once: the guard's loss and gradient norm, in one ``tolist()`` (part d). Nothing else
waits: the token count is host arithmetic on the host's batches, summed over ranks by an
asynchronous all-reduce on the device and used there as the divisor; fp16's overflow check
reuses the guard's reading (without a reading guard it is the one read); its underflow
figure is read once, on logged steps (``nanolm.watch.observer``). ``tests/test_host_reads.py``
counts them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .batches import Batch
from .distributed import Distributed, PendingSum, gradient_sync
from .precision import DynamicLossScaler


# --------------------------------------------------------------------------- the learning rate of a step
def set_learning_rate(optimizer, lr: float) -> None:
    """Every group at the schedule's rate for this step, times its own peak ratio (1 for
    AdamW's groups, ``muon_lr / lr`` for Muon's)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)


def default_min_lr(max_lr: float) -> float:
    """Where the cosine ends unless told otherwise: a tenth of the peak (the one place this
    default lives; ``--min-lr`` is resolved with it)."""
    return max_lr / 10


def _warmup_peak_decay(
    step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr: float | None, decay_start: int, decay
) -> float:
    """The frame every schedule shares, at optimizer step ``step`` (1 for the first, as the
    loop counts): the linear warmup over steps 1..``warmup_steps``, the peak held through step
    ``decay_start``, then ``decay(progress, max_lr, min_lr)``, where progress is the share of
    the decay's steps (``decay_start`` + 1 .. ``total_steps``) done before this one, then the
    floor ``min_lr`` (10 % of max_lr by default) after the last step.

    * Warmup: the rate climbs linearly from max_lr/warmup_steps at step 1 to max_lr at step
      ``warmup_steps``. Adam's second-moment estimate is noisy in the first steps; full-size
      updates from it can throw a fresh model into a bad region.
    * Decay: lowering the rate at the end lets the weights settle into the minimum the noisy
      high-rate phase found.

    A pure function of the step, so resuming a run needs nothing but the step count. Steps
    count from 1, as the loop does: a step 0 is refused rather than trained at a rate of 0.
    """
    if step < 1:
        raise ValueError(f"optimizer steps count from 1, as the training loop does; got step {step}")
    if min_lr is None:
        min_lr = default_min_lr(max_lr)
    if step <= warmup_steps:
        return max_lr * step / warmup_steps
    if step > total_steps:
        return min_lr
    if step <= decay_start:
        return max_lr
    return decay((step - 1 - decay_start) / max(1, total_steps - decay_start), max_lr, min_lr)


def cosine_lr(step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr: float | None = None) -> float:
    """Learning rate at optimizer step ``step`` (1 for the first): linear warmup, then half a
    cosine from max_lr down toward ``min_lr``, which it reaches after step ``total_steps``."""
    return _warmup_peak_decay(
        step,
        max_lr,
        warmup_steps,
        total_steps,
        min_lr,
        warmup_steps,
        lambda p, top, floor: floor + 0.5 * (top - floor) * (1.0 + math.cos(math.pi * p)),
    )


def wsd_decay_start(warmup_steps: int, total_steps: int, decay_fraction: float) -> int:
    """The last step a WSD schedule holds at its peak (the decay is the steps after it):
    ``decay_fraction`` of the steps before the end (at least two, so that some trained step
    is below the peak whatever the fraction), never inside the warmup."""
    return max(warmup_steps, total_steps - max(2, round(decay_fraction * total_steps)))


def wsd_lr(
    step: int,
    max_lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr: float | None = None,
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate at optimizer step ``step`` (1 for the first): warmup, stable, decay (WSD).

    The same linear warmup as :func:`cosine_lr`, then the peak rate held flat, then a straight
    line down to ``min_lr`` over the last ``decay_fraction`` of ``total_steps``.

    Why it can beat the cosine in a short run: a cosine starts lowering the rate right after
    warmup, so most of the run trains below its peak, and the loss only drops steeply once the
    rate is low. WSD keeps the fast, noisy high-rate phase as long as possible and spends a
    short, steep decay at the end, where the loss falls most. Runs of different lengths can
    also share the stable phase: a checkpoint from it can be resumed with more ``--steps``.
    """
    return _warmup_peak_decay(
        step,
        max_lr,
        warmup_steps,
        total_steps,
        min_lr,
        wsd_decay_start(warmup_steps, total_steps, decay_fraction),
        lambda p, top, floor: top - (top - floor) * p,
    )


SCHEDULES = ("cosine", "wsd")


def learning_rate(step: int, o, total_steps: int) -> float:
    """The rate of optimizer step ``step`` (1 for the first) under the run's optimizer options ``o``
    (``--schedule``, ``--lr``, ``--warmup``, ``--min-lr``, ``--decay-fraction``): the one place
    training, replay and the doctor read the schedule from."""
    if o.schedule == "wsd":
        return wsd_lr(step, o.lr, o.warmup, total_steps, o.min_lr, o.decay_fraction)
    return cosine_lr(step, o.lr, o.warmup, total_steps, o.min_lr)


# --------------------------------------------------------------------------- forward and backward
def counted_tokens(micro_batches: list[Batch]) -> int:
    """Targets that count in these micro-batches (the loss mask's True entries).

    Host arithmetic: the step's batches are built on the host and only copies of them go to
    the device (``Batch.to``), so reading these counts waits for no device.
    """
    return sum(int(b.counted) for b in micro_batches)


def summed_token_loss(model, batch: Batch) -> torch.Tensor:
    """The forward pass over one micro-batch: the sum of its counted tokens' losses.

    nanolm's GPT computes its output head and the loss together, a chunk of positions at a
    time (``nanolm.fused_loss.head_cross_entropy_sum``), so the logits are never held whole.
    """
    _, total = model(
        batch.idx,
        targets=batch.targets,
        loss_mask=batch.loss_mask,
        doc_ids=batch.doc_ids,
        positions=batch.positions,
        reduction="sum",
    )
    return total


def at_least_one(count: int | torch.Tensor) -> int | torch.Tensor:
    """``count``, or 1 when it is 0 (a step with nothing to count divides by 1, adding zero),
    as a number for a number and a tensor for a tensor."""
    return count.clamp(min=1) if torch.is_tensor(count) else max(1, count)


def accumulate_gradients(
    model,
    micro_batches: list[Batch],
    count: int | torch.Tensor | PendingSum,
    autocast=contextlib.nullcontext,
    loss_scale: float = 1.0,
    loss_fn=summed_token_loss,
    across_ranks: bool = False,
) -> torch.Tensor:
    """Forward and backward over every micro-batch of one optimizer step.

    Each micro-batch backpropagates (sum of its token losses) ÷ ``count``, the counted
    tokens of the whole step (every micro-batch, every rank): the gradients that accumulate
    are exactly those of the mean loss over the step, whatever the split, and a micro-batch
    with nothing to count adds zero. ``loss_fn(model, batch)`` is the forward pass and that
    sum (:func:`summed_token_loss`; the lab plants bugs here). It runs under ``autocast()``
    (see ``nanolm.precision``); the loss, in fp32, is multiplied by ``loss_scale`` before backward
    (fp16; the scaler divides it out of the gradients again). ``across_ranks``: the model is
    wrapped for torchrun (DDP or FSDP), and only the last micro-batch's backward pass reduces
    gradients across ranks (``nanolm.distributed.gradient_sync``).

    ``count`` is a number, a device tensor, or a :class:`~nanolm.distributed.PendingSum`
    whose all-reduce is waited for only before the first backward pass (it runs during the
    first forward pass). On one process it is a number; under torchrun an int64 device
    tensor, whose quotient is the same fp32 number as the Python count's on a CPU (on a GPU,
    PyTorch applies a Python divisor as a product with its reciprocal, which can differ from
    a true division in the last bit).

    Returns the sum of this process's token losses, detached and unscaled.
    """
    device = next(model.parameters()).device
    denominator = None
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        batch = batch.to(device)
        last = i == len(micro_batches) - 1
        with gradient_sync(model, enabled=last) if across_ranks else contextlib.nullcontext():
            with autocast():
                micro_sum = loss_fn(model, batch)  # forward: the micro-batch's summed token loss, in fp32
            if denominator is None:
                denominator = at_least_one(count.value() if isinstance(count, PendingSum) else count)
            (micro_sum / denominator * loss_scale).backward()
        loss_sum += micro_sum.detach()
    return loss_sum


@dataclass
class StepSetup:
    """What one optimizer step works with, built once per run (``nanolm.train.build_run``).

    ``schedule(step)`` is the learning rate of step ``step`` (1 for the first), a pure function
    of the step number (:func:`learning_rate`); the guard's ``lr_scale`` multiplies it where
    the step sets the rate.
    ``step_model`` is what runs forward (the model itself, or its DDP or compiled wrapper);
    ``model`` is the module whose parameters are clipped and updated. ``guard`` None takes
    every step. ``watch(step, micro_batches)``, when given, returns the
    :class:`~nanolm.watch.observer.GradientWatch` that reads this step's gradients (None: nothing to
    read this step); the observer owns it and reads it back from the step's result.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Callable[[int], float]
    clip: float = 1.0
    step_model: torch.nn.Module | None = None
    scaler: DynamicLossScaler = field(default_factory=lambda: DynamicLossScaler(enabled=False))
    autocast: Callable = contextlib.nullcontext
    dist: Distributed = field(default_factory=Distributed)
    guard: object | None = None
    loss_fn: Callable = summed_token_loss
    watch: Callable | None = None

    def __post_init__(self):
        self.step_model = self.step_model if self.step_model is not None else self.model


@dataclass
class StepResult:
    """What a step did. ``loss`` (the mean over every counted token of the step, all ranks)
    and ``grad_norm`` (the global norm before clipping) are device tensors; ``read`` is the
    two as host numbers when the guard read them this step (None when nothing was read: the
    observer reads them on a logged step only). ``updated`` is False when the guard did not
    take the step or an fp16 gradient overflowed. ``action``/``event``: the guard's decision
    and its evidence; ``rollback_to``: the checkpoint a rollback returns to. ``watch``: what
    was read of the gradients (None when nothing was)."""

    step: int
    lr: float
    loss: torch.Tensor
    grad_norm: torch.Tensor
    updated: bool
    action: str = "take"
    event: dict | None = None
    rollback_to: object = None
    watch: object = None
    read: tuple[float, float] | None = None


def discarded_pass(model, batch: Batch, autocast=contextlib.nullcontext) -> None:
    """One forward and backward pass of the step on ``batch``, its gradients thrown away: what
    ``--threads auto`` times at each thread count (``nanolm/machine/threads.py``). The weights
    and the optimizer are untouched; the caller keeps the random state."""
    accumulate_gradients(model, [batch], max(1, int(batch.counted)), autocast)
    for p in model.parameters():
        p.grad = None


def train_step(setup: StepSetup, step: int, micro_batches: list[Batch]) -> StepResult:
    """Optimizer step number ``step`` (1 for the first) on ``micro_batches``.

    ``setup.watch``, when the observer wants this step's gradient figures, captures the
    gradients after they are unscaled and before they are clipped.
    """
    # a. the learning rate
    lr = setup.schedule(step) * (setup.guard.lr_scale if setup.guard is not None else 1.0)
    set_learning_rate(setup.optimizer, lr)  # every group; Muon's at its own peak ratio

    # b. forward and backward, each token's loss divided by the step's count
    watch = setup.watch(step, micro_batches) if setup.watch is not None else None
    dist = setup.dist
    count = counted_tokens(micro_batches)  # every micro-batch, counted once
    if dist.active:  # torchrun: every rank's count, summed on the device while the first forward pass runs
        count = dist.sum_async(count)
    loss_sum = accumulate_gradients(
        setup.step_model,
        micro_batches,
        count,
        setup.autocast,
        setup.scaler.loss_scale,
        setup.loss_fn,
        across_ranks=dist.active,
    )
    loss = dist.global_mean(loss_sum, count.value()) if dist.active else loss_sum / at_least_one(count)

    # c. unscale (fp16), clip once
    if setup.scaler.enabled:
        setup.scaler.unscale_(setup.model.parameters())
    if watch is not None:
        watch.capture()
    max_norm = setup.clip if setup.clip > 0 else math.inf
    grad_norm = (
        dist.clip_grad_norm_(setup.model, max_norm)
        if dist.sharded  # FSDP: each rank holds a shard
        else torch.nn.utils.clip_grad_norm_(setup.model.parameters(), max_norm)
    )

    # d. the guard decides, on the step's global numbers (every rank alike)
    action, event, rollback_to, read = "take", None, None, None
    if setup.guard is not None and setup.guard.reads_every_step:
        read = tuple(torch.stack([loss.float(), grad_norm.float().to(loss.device)]).tolist())  # the one read
        if not (setup.scaler.enabled and not math.isfinite(read[1])):  # an fp16 overflow is the scaler's to skip
            action, event, rollback_to = setup.guard.decide(step, read[0], read[1], lr)

    # e. update and zero
    updated = action == "take" and (
        not setup.scaler.enabled or setup.scaler.update(grad_norm if read is None else read[1])
    )
    if updated:
        setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return StepResult(step, lr, loss, grad_norm, updated, action, event, rollback_to, watch, read)
