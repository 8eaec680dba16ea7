"""One optimizer step: the heart of training, as one function a reader can follow and a
benchmark can time.

In order (:func:`train_step`):

1. set the learning rate for this step: the schedule's rate for the step number (a pure
   function of it) times the guard's scale (1 until a rollback asks for less);
2. count the tokens that count in *all* of the step's micro-batches (on every rank), once;
   then for each micro-batch run forward, divide the sum of its token losses by that
   count, and run backward: the gradients add up;
3. fp16 only: divide the gradients by the loss scale; clip the global gradient norm, once,
   after the last backward pass;
4. let the guard decide: take the update, skip it, roll back, or stop;
5. update the weights (fp16: unless a gradient overflowed) and zero the gradients.

**Why divide each micro-batch's sum by the step's count.** The accumulated gradient is then
exactly the gradient of the mean loss over every counted token of the step, the same as
one big batch. Averaging per-micro-batch means instead would weigh a token in a short
micro-batch more than one in a long micro-batch, and change the effective learning rate
with ``--grad-accum``. Under torchrun the count is summed over every rank and gradients are
summed across ranks after the last micro-batch only (``nanolm.distributed``): the same step,
split over processes.

**One host read per step.** Reading a number from a GPU makes the host wait until the GPU has
computed it, and leaves the GPU idle while the host then prepares the next kernels. The step
reads once: the guard's loss and gradient norm, in one ``tolist()`` (step 4). Nothing else
waits: the token count is host arithmetic on the host's batches, summed over ranks by an
asynchronous all-reduce on the device and used there as the divisor; fp16's overflow check
reuses the guard's reading (without a reading guard it is the one read); its underflow
figure is read once, on logged steps (``nanolm.observer``). ``tests/test_host_reads.py``
counts them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .batches import Batch
from .distributed import Distributed, PendingSum, at_least_one, gradient_sync
from .optim import set_learning_rate
from .precision import DynamicLossScaler


def counted_tokens(micro_batches: list[Batch]) -> int:
    """Targets that count in these micro-batches (the loss mask's True entries).

    Host arithmetic: the step's batches are built on the host and only copies of them go to
    the device (``Batch.to``), so reading these counts waits for no device.
    """
    return sum(int(b.counted) for b in micro_batches)


def summed_token_loss(model, batch: Batch) -> torch.Tensor:
    """The forward pass over one micro-batch: the sum of its counted tokens' losses.

    nanolm's GPT computes its output head and the loss together, a chunk of positions at a
    time (``nanolm.loss.head_cross_entropy_sum``), so the logits are never held whole.
    """
    _, total = model(batch.idx, targets=batch.targets, loss_mask=batch.loss_mask,
                     doc_ids=batch.doc_ids, positions=batch.positions, reduction="sum")
    return total


def accumulate_gradients(model, micro_batches: list[Batch], count: int | torch.Tensor | PendingSum,
                         autocast=contextlib.nullcontext, loss_scale: float = 1.0,
                         loss_fn=summed_token_loss) -> torch.Tensor:
    """Forward and backward over every micro-batch of one optimizer step.

    Each micro-batch backpropagates (sum of its token losses) ÷ ``count``, the counted
    tokens of the whole step (every micro-batch, every rank): the gradients that accumulate
    are exactly those of the mean loss over the step, whatever the split, and a micro-batch
    with nothing to count adds zero. ``loss_fn(model, batch)`` is the forward pass and that
    sum (:func:`summed_token_loss`; the lab plants bugs here). It runs under ``autocast()``
    (see ``nanolm.precision``); the loss, in fp32, is multiplied by ``loss_scale`` before backward
    (fp16; the scaler divides it out of the gradients again). A distributed model reduces
    gradients across ranks in the last micro-batch's backward pass only.

    ``count`` is a number, a device tensor, or a :class:`~nanolm.distributed.PendingSum`
    whose all-reduce is waited for only before the first backward pass (it runs during the
    first forward pass). On one process it is a number, as it always was; under torchrun an
    int64 device tensor, whose quotient is the same fp32 number as the Python count's on a
    CPU (on a GPU, PyTorch applies a Python divisor as a product with its reciprocal, which
    can differ from a true division in the last bit).

    Returns the sum of this process's token losses, detached and unscaled.
    """
    device = next(model.parameters()).device
    denominator = None
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        batch = batch.to(device)
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
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
    of the step number; the guard's ``lr_scale`` multiplies it where the step sets the rate.
    ``step_model`` is what runs forward (the model itself, or its DDP or compiled wrapper);
    ``model`` is the module whose parameters are clipped and updated. ``guard`` None takes
    every step. ``watch(step, micro_batches)``, when given, returns the
    :class:`~nanolm.observer.GradientWatch` that reads this step's gradients (None: nothing to
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
    and ``grad_norm`` (the global norm before clipping) are device tensors, or floats when
    the guard read them. ``updated`` is False when the guard did not take the step or an fp16
    gradient overflowed. ``action``/``event``: the guard's decision and its evidence;
    ``rollback_to``: the checkpoint a rollback returns to. ``watch``: what was read of the
    gradients (None when nothing was)."""

    step: int
    lr: float
    loss: torch.Tensor | float
    grad_norm: torch.Tensor | float
    updated: bool
    action: str = "take"
    event: dict | None = None
    rollback_to: object = None
    watch: object = None


def train_step(setup: StepSetup, step: int, micro_batches: list[Batch]) -> StepResult:
    """Optimizer step number ``step`` (1 for the first) on ``micro_batches``.

    ``setup.watch``, when the observer wants this step's gradient figures, captures the
    gradients after they are unscaled and before they are clipped.
    """
    # 1. the learning rate of this step: the schedule's, times the guard's scale
    lr = setup.schedule(step) * (setup.guard.lr_scale if setup.guard is not None else 1.0)
    set_learning_rate(setup.optimizer, lr)  # every group; Muon's at its own peak ratio

    # 2. forward and backward, every token's loss divided by the step's count of counted tokens
    watch = setup.watch(step, micro_batches) if setup.watch is not None else None
    count = setup.dist.sum_async(counted_tokens(micro_batches))  # every micro-batch of every rank, counted once
    loss_sum = accumulate_gradients(setup.step_model, micro_batches, count, setup.autocast,
                                    setup.scaler.loss_scale, setup.loss_fn)
    loss = setup.dist.global_mean(loss_sum, count.value())

    # 3. fp16: undo the loss scale; clip the global gradient norm once, after every backward pass
    setup.scaler.unscale_(setup.model.parameters())
    if watch is not None:
        watch.capture()
    grad_norm = setup.dist.clip_grad_norm_(setup.model, setup.clip if setup.clip > 0 else math.inf)

    # 4. the guard decides on the step's global numbers (every rank alike)
    action, event, rollback_to = "take", None, None
    if setup.guard is not None and setup.guard.reads_every_step:
        loss, grad_norm = torch.stack([loss.float(), grad_norm.float().to(loss.device)]).tolist()  # the one read
        if not (setup.scaler.enabled and not math.isfinite(grad_norm)):  # an fp16 overflow is the scaler's to skip
            action, event, rollback_to = setup.guard.decide(step, loss, grad_norm, lr)

    # 5. update (unless the guard said otherwise, or an fp16 gradient overflowed) and zero
    updated = action == "take" and setup.scaler.update(grad_norm)
    if updated:
        setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return StepResult(step, lr, loss, grad_norm, updated, action, event, rollback_to, watch)
