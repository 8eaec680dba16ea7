"""Guards: catch non-finite values and spikes during training, and recover as an expert would.

**What is watched.** After the backward pass of every step, before the update: the step's
loss and its global gradient norm (one read of two numbers from the device). A value that is
not finite is a NaN event. A value far above its recent history is a spike: the detector
keeps the last ``window`` finite values and measures how many robust standard deviations
(1.4826 × the median absolute deviation) the new one sits above their median. The median
and MAD, unlike a mean and a standard deviation, are not dragged up by the spikes they are
meant to catch. Gradient norms are compared on a log scale, since they vary by factors.

**What is done** (``--on-nan``, ``--on-spike``):

* ``skip``: drop this step's update; the batch that caused it is never trained on.
* ``rollback``: reload the last good checkpoint (weights, optimizer, loss scale), keep the
  data sampler where it is, so the offending batches (and those since the checkpoint) are
  skipped rather than replayed, optionally scale the learning rate down
  (``--rollback-lr-scale``), and continue. After ``--max-rollbacks`` the run stops with a
  report instead of looping.
* ``warn`` (spikes only): record the event, take the step.
* ``stop`` (NaN only): record the event and stop.

Nothing non-finite is ever checkpointed (``save_checkpoint`` refuses it), so a rollback
always lands on finite weights.

**Where a NaN came from.** :func:`nan_origin` re-runs the offending micro-batch with forward
hooks on every module and names the first one whose output is not finite, or, when the
forward pass is finite, the first parameter whose gradient is not, and says whether the
batch held token ids outside the vocabulary.

Every event goes to ``events.jsonl`` with its evidence: the recent losses, gradient norms
and learning rates, the step, the action taken.
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path

import torch

from ..base import disk
from ..base.documents import read_jsonl
from ..base.files import naming_the_file
from ..errors import NanolmError

NAN_ACTIONS = ("stop", "skip", "rollback")
SPIKE_ACTIONS = ("off", "warn", "skip", "rollback")


def reads_every_step(on_nan: str, on_spike: str) -> bool:
    """A guard that may skip or roll back needs every step's numbers before the update; one
    that only stops on a NaN (``--on-nan stop --on-spike off``) reads none, and the observer
    stops the run when a logged row's loss is not finite."""
    return on_nan != "stop" or on_spike != "off"


class SpikeDetector:
    """Robust z-score of a new value against the last ``window`` values."""

    def __init__(self, window: int = 50, threshold: float = 6.0, min_history: int = 20, log_scale: bool = False):
        self.values: deque[float] = deque(maxlen=window)
        self.threshold, self.min_history, self.log_scale = threshold, min_history, log_scale

    def _scaled(self, value: float) -> float:
        return math.log(max(value, 1e-30)) if self.log_scale else value

    def zscore(self, value: float) -> float | None:
        """How far above the recent median ``value`` is, in robust standard deviations."""
        if len(self.values) < self.min_history:
            return None
        history = sorted(self.values)
        median = history[len(history) // 2]
        mad = sorted(abs(v - median) for v in history)[len(history) // 2]
        scale = 1.4826 * mad + 1e-3 * abs(median) + 1e-12  # a floor: a flat history is not infinitely sure
        return (self._scaled(value) - median) / scale

    def is_spike(self, value: float) -> tuple[bool, float | None]:
        z = self.zscore(value)
        return (z is not None and z > self.threshold), z

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(self._scaled(value))


class Guard:
    """Decides, each step, whether to take the update, skip it, roll back or stop, and records why.

    It owns its fallbacks: a rollback with no checkpoint to return to is a skip, one more
    rollback than ``--max-rollbacks`` is a stop, and each rollback scales the learning rate by
    ``--rollback-lr-scale``. Its count of rollbacks and that scale are its own state: a
    rollback restores the run from a checkpoint but never rewinds them, so no fault (or bug)
    that comes back can make a run loop forever.

    ``rollback_to()`` returns the checkpoint a rollback would return to (None: there is none
    yet); ``explain_nan(batch)`` re-runs a batch to name where a NaN was born. ``out_dir`` None
    decides without writing ``events.jsonl`` (every rank but the first, a replay).
    """

    def __init__(
        self,
        *,
        out_dir,
        on_nan: str = "rollback",
        on_spike: str = "warn",
        window: int = 50,
        threshold: float = 6.0,
        max_rollbacks: int = 3,
        rollback_lr_scale: float = 1.0,
        log=print,
        rollback_to=None,
        explain_nan=None,
    ):
        self.on_nan, self.on_spike, self.max_rollbacks = on_nan, on_spike, max_rollbacks
        self.reads_every_step = reads_every_step(on_nan, on_spike)
        self.loss = SpikeDetector(window, threshold)
        self.grad = SpikeDetector(window, threshold, log_scale=True)
        self.history: deque[dict] = deque(maxlen=window)
        self.events_path = Path(out_dir) / "events.jsonl" if out_dir is not None else None
        self.out_dir = out_dir
        self.rollbacks = 0
        self.lr_scale = 1.0
        self.rollback_lr_scale = rollback_lr_scale
        self.rollback_to, self.explain_nan = rollback_to, explain_nan
        self.log = log

    # ---------------------------------------------------------------- what a run asks of it
    @classmethod
    def from_options(cls, options, *, out_dir, log=print, rollback_to=None, explain_nan=None) -> "Guard":
        """A guard as the run's ``[guard]`` section (``nanolm.run.config.GuardOptions``) says."""
        return cls(
            out_dir=out_dir,
            on_nan=options.on_nan,
            on_spike=options.on_spike,
            window=options.spike_window,
            threshold=options.spike_threshold,
            max_rollbacks=options.max_rollbacks,
            rollback_lr_scale=options.rollback_lr_scale,
            log=log,
            rollback_to=rollback_to,
            explain_nan=explain_nan,
        )

    def decide(self, step: int, loss: float, grad_norm: float, lr: float):
        """:meth:`check`, then the fallbacks: (action, event, the checkpoint to roll back to)."""
        action, event = self.check(step, loss, grad_norm, lr)
        checkpoint = self.rollback_to() if action == "rollback" and self.rollback_to is not None else None
        if action == "rollback" and checkpoint is None:
            action, event["note"] = "skip", "no checkpoint yet: skipped instead of rolled back"
        if action == "rollback" and self.rollbacks >= self.max_rollbacks:
            action, event["note"] = "stop", f"already rolled back {self.max_rollbacks} times (--max-rollbacks)"
        return action, event, checkpoint

    def settle(self, result, micro_batches) -> None:
        """Write down a step's event with its evidence (for a NaN, the first module that
        produced it); a rollback's is written once it has landed (:meth:`rolled_back`). A
        ``stop`` ends the run here, with one line naming the step and the cause."""
        event = result.event
        if event["kind"] == "nan" and self.explain_nan is not None:
            event.update(self.explain_nan(micro_batches[0]))
        if result.action == "rollback":
            return
        self.record(event, {"take": "warn"}.get(result.action, result.action))
        if result.action == "stop":
            raise NanolmError(
                f"training stopped at step {result.step} on a {event['kind']} event "
                f"({event.get('origin') or event.get('note') or 'see events.jsonl'}); "
                f"run `nanolm diagnose {self.out_dir}`"
            )

    def rolled_back(self, event: dict, to_step: int) -> None:
        """The run is back at ``to_step``: count it, lower the learning rate if asked, record
        it, and forget the recent values (they belong to a discarded trajectory)."""
        self.rollbacks += 1
        self.lr_scale *= self.rollback_lr_scale
        self.record(event, "rollback", to_step=to_step, lr_scale=self.lr_scale)
        self.reset_history()

    def state_dict(self) -> dict:
        return {"rollbacks": self.rollbacks, "lr_scale": self.lr_scale}

    def load_state_dict(self, state: dict) -> None:
        self.rollbacks, self.lr_scale = int(state["rollbacks"]), float(state["lr_scale"])

    def check(self, step: int, loss: float, grad_norm: float, lr: float) -> tuple[str, dict | None]:
        """The action for this step (``take``, ``skip``, ``rollback`` or ``stop``) and its event."""
        evidence = {"recent": list(self.history)}
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            event = {
                "step": step,
                "kind": "nan",
                "loss": _json_number(loss),
                "grad_norm": _json_number(grad_norm),
                "lr": lr,
                **evidence,
            }
            return self.on_nan, event
        spike_loss, z_loss = self.loss.is_spike(loss)
        spike_grad, z_grad = self.grad.is_spike(grad_norm)
        self.history.append({"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr})
        if self.on_spike != "off" and (spike_loss or spike_grad):
            event = {
                "step": step,
                "kind": "spike",
                "on": [n for n, s in (("loss", spike_loss), ("grad_norm", spike_grad)) if s],
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "z_loss": z_loss,
                "z_grad_norm": z_grad,
                **evidence,
            }
            action = {"warn": "take"}.get(self.on_spike, self.on_spike)
            if action == "take":  # a warned spike still belongs to the history
                self.loss.add(loss)
                self.grad.add(grad_norm)
            return action, event
        self.loss.add(loss)
        self.grad.add(grad_norm)
        return "take", None

    def record(self, event: dict, action: str, **details) -> None:
        """Append the event, with the action taken, to ``events.jsonl`` and say it in one line."""
        event = {**event, "action": action, **details}
        self._append(event)
        what = "non-finite loss or gradient" if event["kind"] == "nan" else f"{'/'.join(event['on'])} spike"
        extra = f"; first non-finite: {event['origin']}" if event.get("origin") else ""
        self.log(
            f"guard: {what} at step {event['step']} (loss {event['loss']}, grad norm {event['grad_norm']}"
            f"{extra}): {action}"
        )

    def note(self, kind: str, step: int, **details) -> None:
        """Record a non-guard event that diagnosis needs (a resume, a rollback landing)."""
        self._append({"step": step, "kind": kind, **details})

    def _append(self, event: dict) -> None:
        if self.events_path is not None:
            with naming_the_file(self.events_path), disk.create(self.events_path, "a", encoding="utf-8") as f:
                disk.write(f, json.dumps(event) + "\n", self.events_path)

    def reset_history(self) -> None:
        """After a rollback the recent values belong to a discarded trajectory."""
        self.history.clear()
        self.loss.values.clear()
        self.grad.values.clear()


def _json_number(x: float):
    return x if math.isfinite(x) else str(x)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_EVENT_FIELDS = {
    "step": lambda v: type(v) is int and v >= 0,
    "kind": lambda v: isinstance(v, str),
    "action": lambda v: isinstance(v, str),
    "origin": lambda v: isinstance(v, str),
    "note": lambda v: isinstance(v, str),
    "on": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "recent": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    "to_step": lambda v: type(v) is int,
    "bad_ids": lambda v: type(v) is int,
    "loss": lambda v: _is_number(v) or v in ("nan", "inf", "-inf"),
    "grad_norm": lambda v: _is_number(v) or v in ("nan", "inf", "-inf"),
}
"""What each field of an event holds (see :meth:`Guard.check` and :meth:`Guard.record`);
any other field holds a number, text, a boolean or null."""


def _is_event(event) -> bool:
    """An event every reader may trust: each field of :data:`_EVENT_FIELDS` of its kind, and
    the step and kind present. Any other shape is damage (left out, counted)."""
    if not (isinstance(event, dict) and "step" in event and "kind" in event):
        return False
    for key, value in event.items():
        check = _EVENT_FIELDS.get(key)
        ok = check(value) if check is not None else (value is None or isinstance(value, (str, int, float)))
        if not ok:
            return False
    return True


def read_events(run_dir, warn=None) -> list[dict]:
    """The events of a run; damaged lines and events of the wrong shape (:func:`_is_event`)
    are left out (``warn`` hears how many)."""
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        return []
    rows, damaged = read_jsonl(path)
    events = [e for e in rows if _is_event(e)]
    if warn is not None and damaged + len(rows) - len(events):
        warn(f"warning: {path}: {damaged + len(rows) - len(events)} damaged line(s) left out")
    return events


def nan_origin(model: torch.nn.Module, batch, autocast, vocab_size: int) -> dict:
    """Re-run ``batch`` with hooks: the first module whose output, or else the first
    parameter whose gradient, is not finite; and whether the ids are out of range.

    ``batch`` is a micro-batch as the loop holds it, on the host: it goes to the model's device."""
    report: dict = {}
    batch = batch.to(next(model.parameters()).device)
    ids = batch.idx
    bad_ids = int(((ids < 0) | (ids >= vocab_size)).sum())
    if bad_ids:
        report["bad_ids"] = bad_ids
    first: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        if not first and torch.is_tensor(out) and out.is_floating_point() and not torch.isfinite(out).all():
            first.append(names.get(module) or type(module).__name__)

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    was_training = model.training
    try:
        model.zero_grad(set_to_none=True)
        with autocast():
            logits, _ = model(batch.idx.clamp(0, vocab_size - 1), doc_ids=batch.doc_ids, positions=batch.positions)
        from ..model import masked_cross_entropy

        loss = masked_cross_entropy(logits, batch.targets.clamp(0, vocab_size - 1), batch.loss_mask)
    finally:
        for h in handles:
            h.remove()
    if first:
        report["origin"] = f"the output of {first[0]}"
        model.zero_grad(set_to_none=True)
        return report
    if not torch.isfinite(loss):
        report["origin"] = "the loss (finite logits, non-finite cross-entropy)"
        return report
    loss.backward()
    for name, p in reversed(list(model.named_parameters())):  # backward visits the last layers first
        if p.grad is not None and not torch.isfinite(p.grad).all():
            report["origin"] = f"the gradient of {name}"
            break
    else:
        report["origin"] = "none on a re-run of the batch (the fault did not come from this batch's forward/backward)"
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return report
