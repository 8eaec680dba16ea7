"""Deliberate faults: the real training code with one part swapped for a broken one.

``nanolm lab`` (and the tests) break runs the way real bugs and accidents do, so that what
the logs show and what ``nanolm diagnose`` says can be checked against the truth. Each
fault is a *substituted component* of the run (:class:`nanolm.train.Factories`): a model
without the causal mask, a batch stream whose targets are not shifted, a loss whose gradient
is not divided by the accumulation count, a loss scaler that does not scale, a checkpointer
that forgets the optimizer state or kills the process after a save. Nothing in the training
step or the model knows about any of them.

They are switched on by the hidden ``--debug-*`` options (``[debug]`` in a config file),
which :func:`factories` maps to the substitutions; ``nanolm train --help`` does not list
them.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import torch

from ..batches import TrainBatches
from ..checkpoint import Checkpointer
from ..model import GPT, Attention
from ..optim import BF16AdamW
from ..precision import DynamicLossScaler
from ..run.config import RunConfig
from ..step import summed_token_loss


class NonCausalAttention(Attention):
    """Attention over the whole window, the future included (generation, which reads a cache of
    the past only, is left as it is)."""

    def forward(self, x, cos, sin, mask=None, cache=None):
        if cache is None:
            B, T, _ = x.shape
            mask = torch.ones(B, 1, T, T, dtype=torch.bool, device=x.device)
        return super().forward(x, cos, sin, mask, cache)


class NonCausalGPT(GPT):
    """Attention sees the whole window, the future included: the loss falls below what the
    data allows, and generation, which cannot see the future, is garbage."""

    def __init__(self, config):
        super().__init__(config)
        for block in self.blocks:
            block.attn.__class__ = NonCausalAttention


class UnshiftedTargets(TrainBatches):
    """The targets are the inputs themselves, not the next tokens: the model learns to copy."""

    def next(self, step):
        batches = super().next(step)
        for b in batches:
            b.targets = b.idx.clone()
        return batches


class RandomTargets(TrainBatches):
    """Targets drawn uniformly at random, independently of the inputs (a data bug: the labels of
    another stream, or a shuffled one): nothing predicts them, and the loss stays at ln V."""

    def next(self, step):
        batches = super().next(step)
        high = int(np.max(self.tokens)) + 1
        generator = torch.Generator().manual_seed(1_000_003 * step)
        for b in batches:
            b.targets = torch.randint(1, high, b.targets.shape, generator=generator)
        return batches


def decay_everything(model, cfg, precision):
    """AdamW with weight decay on every parameter: norm gains, biases and embeddings are pulled
    toward zero too (the gains lose their scale, rare tokens' rows are eroded). Under
    ``--precision bf16-pure`` it is the bf16 weights' own AdamW, broken the same way."""
    o = cfg.optim
    groups = [{"params": list(dict.fromkeys(model.parameters())), "weight_decay": o.weight_decay}]  # a tied matrix once
    if precision.pure_bf16:
        return BF16AdamW(
            groups, lr=o.lr, betas=(o.beta1, o.beta2), master_weights=cfg.train.fp32_master, seed=cfg.train.seed
        )
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2))


def corrupt_tokens(tokens: np.ndarray, share: float, vocab_size: int, seed: int) -> np.ndarray:
    """One contiguous region of random ids, a third of the way in (a copy: the shards stay intact)."""
    out = np.array(tokens, dtype=np.int64)
    n = int(len(out) * share)
    start = min(len(out) // 3, len(out) - n)  # a third of the way in, or as far as a large share allows
    out[start : start + n] = np.random.default_rng(seed).integers(1, vocab_size, size=n)
    return out


def loss_not_averaged(grad_accum: int):
    """The loss function of a loop that sums micro-batch means instead of averaging them: the
    value it reports is right, its gradient ``grad_accum`` times too large."""

    def loss_fn(model, batch):
        total = summed_token_loss(model, batch)
        return total + (grad_accum - 1) * (total - total.detach())

    return loss_fn


class OneOffBadBatch:
    """The batch of step ``at`` is bad, once (a rollback that comes back to that step draws a
    good one): its loss, and so its gradients, are multiplied by ``factor``. 100 is a loud,
    finite spike; NaN is a non-finite step."""

    def __init__(self, at: int, factor: float):
        self.at, self.factor, self.step, self.spent = at, factor, 0, False

    def batches(self, *args, **kwargs) -> TrainBatches:
        fault = self

        class Marked(TrainBatches):
            def next(self, step):
                fault.spent = fault.spent or fault.step == fault.at
                fault.step = step
                return super().next(step)

        return Marked(*args, **kwargs)

    def loss_fn(self, model, batch):
        total = summed_token_loss(model, batch)
        if self.step == self.at and not self.spent:
            total = total * self.factor
        return total


class ForgetfulCheckpointer(Checkpointer):
    """Restores everything but the optimizer state: Adam's first update after a resume is
    full size again, a visible jolt in the loss and gradient norm."""

    def restore(self, path, keep_data_position: bool = False) -> int:
        optimizer, self.optimizer = self.optimizer, None  # load_run_checkpoint then leaves it as it is
        try:
            return super().restore(path, keep_data_position)
        finally:
            self.optimizer = optimizer


def killing_checkpointer(after_step: int):
    """A checkpointer that SIGKILLs its process right after committing step ``after_step``:
    a crash at the worst ordinary moment, for resume tests."""

    class Killing(Checkpointer):
        def save(self, step, val_loss=None):
            saved = super().save(step, val_loss)
            if step == after_step:
                os.kill(os.getpid(), signal.SIGKILL)
            return saved

    return Killing


def factories(cfg: RunConfig):
    """What the run builds its parts with, the faults ``cfg.debug`` asks for among them (None: nanolm's own)."""
    from ..train import Factories

    debug = cfg.debug
    if debug == type(debug)():
        return None
    chosen = Factories()
    if debug.non_causal:
        chosen.model = NonCausalGPT
    if debug.unshifted_targets:
        chosen.batches = UnshiftedTargets
    if debug.corrupt_data:
        share, seed = debug.corrupt_data, cfg.train.seed
        chosen.batches = _with_corrupt_tokens(chosen.batches, share, seed)
    if debug.random_targets:
        chosen.batches = RandomTargets
    if debug.decay_everything:
        chosen.optimizer = decay_everything
    if debug.loss_not_averaged:
        chosen.loss_fn = loss_not_averaged(cfg.train.grad_accum)
    if debug.no_loss_scaling:
        chosen.scaler = lambda enabled: DynamicLossScaler(enabled=False)
    for at, factor in ((debug.inject_nan_at, float("nan")), (debug.inject_spike_at, 100.0)):
        if at:
            bad = OneOffBadBatch(at, factor)
            chosen.batches, chosen.loss_fn = bad.batches, bad.loss_fn
    if debug.drop_optimizer_state:
        chosen.checkpointer = ForgetfulCheckpointer
    if debug.kill_after_checkpoint:
        chosen.checkpointer = killing_checkpointer(debug.kill_after_checkpoint)
    return chosen


def _with_corrupt_tokens(batches, share: float, seed: int):
    def make(tokens, *args, **kwargs):
        vocab_size = int(np.max(tokens)) + 1
        return batches(corrupt_tokens(tokens, share, vocab_size, seed), *args, **kwargs)

    return make
