"""The validation set's evaluation: when it is due, and what it records.

Evaluation is a component of its own (torchtitan calls it the validator): the loop asks
:meth:`Validator.due` and calls :meth:`Validator.evaluate` by name, between taking a step and
recording its row, so a reader of the loop sees where the time of an evaluation goes. Every
rank scores its share of the fixed validation set and the sums are combined
(``nanolm.evaluate.estimate_loss``), so every rank gets the same figures.
"""

from __future__ import annotations

import torch

from ..evaluate import estimate_loss
from .sinks import perplexity


class Validator:
    """Evaluates the fixed validation set every ``every`` steps, at ``last_step``, and at step 0
    when ``at_start`` (the untrained model's loss: the reference ``nanolm diagnose`` reads). Each
    evaluation is kept in the run's ``progress`` (the last and best validation loss, which a
    checkpoint saves)."""

    def __init__(
        self,
        *,
        model,
        dist,
        precision,
        batches: list,
        token_bytes: torch.Tensor,
        progress,
        every: int,
        last_step: int,
        at_start: bool,
        floor: dict | None = None,
    ):
        self.model, self.dist, self.precision, self.batches = model, dist, precision, batches
        self.token_bytes, self.progress, self.floor = token_bytes, progress, floor
        self.every, self.last_step, self.at_start = every, last_step, at_start

    @classmethod
    def for_run(
        cls,
        cfg,
        *,
        model,
        dist,
        precision,
        batches: list,
        token_bytes: torch.Tensor,
        progress,
        floor: dict | None = None,
    ) -> "Validator":
        """The validator of a run configured by ``cfg``: its ``[train]`` section says how often
        (``eval_every``), until which step, and whether step 0 is evaluated."""
        t = cfg.train
        return cls(
            model=model,
            dist=dist,
            precision=precision,
            batches=batches,
            token_bytes=token_bytes,
            progress=progress,
            every=t.eval_every,
            last_step=t.steps,
            at_start=t.eval_at_start,
            floor=floor,
        )

    def due(self, step: int) -> bool:
        """Whether ``step`` is an evaluation step (the observer logs every one of them)."""
        if step == 0:
            return self.at_start
        return step % self.every == 0 or step == self.last_step

    def evaluate(self, step: int) -> dict:
        """The validation loss, bits per byte and perplexity of the model now, with the data's
        floor when it is known; {} when the validation split holds no window."""
        if not self.batches:
            return {}
        with self.precision.autocast():
            result = estimate_loss(
                self.model,
                self.dist.share_of(self.batches),
                self.token_bytes,
                self.dist.device,
                reduce=self.dist.sum_tensors if self.dist.active else None,
            )
        self.dist.reshard(self.model)
        figures = {
            "step": step,
            "val_loss": result["loss"],
            "val_bpb": result["bpb"],
            "val_ppl": perplexity(result["loss"]),
        }
        if self.floor:
            figures.update(floor_bpb=self.floor["bpb"], floor_loss=self.floor["nats_per_token"])
        self.progress.evaluated(result["loss"], result["bpb"])
        return figures
