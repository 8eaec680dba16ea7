"""The observer: what a run shows of itself, and when.

One component owns every decision about watching a run, so that the training loop makes two
calls per step (:meth:`Observer.observe`, then :meth:`Observer.record_step` with the
validator's figures when it evaluated) and reads no schedule of its own:

* **when to log**: every ``--log-every`` steps, the first step, every step right after a
  (re)start, statistics steps, evaluation steps and the last one;
* **what a logged step shows**: the step meter's figures (loss, LR, gradient norm, clipping,
  tokens/s, MFU, memory: ``nanolm.watch.meter``), the loss scaler's under fp16, and on statistics
  steps the per-layer figures, taken by a :class:`GradientWatch` inside the step (the gradients
  before clipping) and after the update (how far each layer moved);
* **what an evaluation adds**: the band's verdict on its validation loss, when the run is a
  shipped recipe's (the evaluation itself is the validator's, ``nanolm.watch.validator``,
  which the loop calls; every evaluation step is logged);
* **where it goes**: ``metrics.jsonl``, the terminal, wandb/TensorBoard (``nanolm.watch.sinks``).

Reading numbers from the device costs a synchronisation, so the observer reads once per
logged step and never on the others (unless the guard already read them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import NanolmError
from ..precision import grad_subnormal_fraction, grad_zero_fraction
from ..step import wsd_decay_start
from .guards import reads_every_step
from .meter import StepMeter
from .reference import BandWatch, no_reference_line, setup_digest
from .sinks import Monitor, parse_sinks
from .stats import LayerStats


def is_stats_step(step: int, every: int) -> bool:
    """Per-layer statistics after step 1 (the first update is telling) and every ``every``."""
    return every > 0 and (step == 1 or step % every == 0)


@dataclass(frozen=True)
class ObserverOptions:
    """What the observer is told of the run, taken from its configuration once
    (:meth:`from_config`): when a step is logged, what the step-0 row records of the recipe, where
    the rows go. The observer reads nothing else of the configuration, and hands nothing back."""

    steps: int
    tokens_per_step: int  # every rank's windows of every micro-batch: the tokens one optimizer step trains on
    log_every: int = 10
    stats_every: int = 0
    sinks: tuple[str, ...] = ()
    progress: str = "lines"  # the terminal: a bar, plain lines, or auto
    seed: int = 0
    target_val_bpb: float = 0.0
    loss_read_every_step: bool = False  # the guard reads each step's loss: a NaN is its to stop on
    recipe: dict = field(default_factory=dict)  # the optimizer's settings as configured, for the step-0 row
    config: dict = field(default_factory=dict)  # the whole configuration, for the sinks' record of the run

    @classmethod
    def from_config(cls, cfg, tokens_per_step: int) -> "ObserverOptions":
        t, o = cfg.train, cfg.optim
        # the optimizer's settings, recorded once in the step-0 row: a reader of the logs (and ``nanolm
        # diagnose``) can tell a run without clipping or LR decay from the numbers alone
        recipe = {
            "peak_lr": o.lr,
            "min_lr": o.min_lr,
            "warmup_steps": o.warmup,
            "beta1": o.beta1,
            "beta2": o.beta2,
            "weight_decay": o.weight_decay,
            "clip": o.clip,
            "optimizer": o.optimizer,
            "schedule": o.schedule,
        }
        if t.time_budget is not None:  # the warmup is the plan's, the decay the clock's (its lines say where)
            recipe["time_budget_s"] = t.time_budget
        elif o.schedule == "wsd":  # the peak until decay_start_step by design, then a line to min_lr at decay_end_step
            recipe["decay_start_step"] = wsd_decay_start(o.warmup, t.steps, o.decay_fraction) + 1
            recipe["decay_end_step"] = t.steps + 1
        if o.optimizer == "muon":
            recipe.update(muon_lr=o.muon_lr, muon_momentum=o.muon_momentum)
        return cls(
            steps=t.steps,
            tokens_per_step=tokens_per_step,
            log_every=t.log_every,
            stats_every=t.stats_every,
            sinks=tuple(parse_sinks(t.log)),
            progress=t.progress,
            seed=t.seed,
            target_val_bpb=t.target_val_bpb,
            loss_read_every_step=reads_every_step(cfg.guard.on_nan, cfg.guard.on_spike),
            recipe=recipe,
            config=cfg.to_dict(),
        )


class GradientWatch:
    """What the observer reads of one step's gradients, after unscaling and before clipping
    (:func:`nanolm.step.train_step` asks :meth:`Observer.gradient_watch` for one and calls
    :meth:`capture` there): fp16's share of exact
    zeros (underflow) on logged steps, the per-layer figures on statistics steps."""

    def __init__(self, model, layer_stats: LayerStats | None, underflow: bool, scaler=None):
        self.model, self.layer_stats, self.underflow, self.scaler = model, layer_stats, underflow, scaler
        self.figures: dict = {}

    def capture(self) -> None:
        if self.underflow:  # device tensors, read after the update: the step itself waits for nothing
            self.figures["grad_zero_frac"] = grad_zero_fraction(self.model.parameters())
            scale = self.scaler.loss_scale if self.scaler is not None else 1.0  # the scale backward ran at
            self.figures["grad_subnormal_frac"] = grad_subnormal_fraction(self.model.parameters(), scale)
        if self.layer_stats is not None:
            self.layer_stats.capture()

    def after_update(self) -> dict:
        tensors = [k for k, v in self.figures.items() if torch.is_tensor(v)]
        figures = dict(self.figures)
        if tensors:  # one read for all of them
            figures.update(zip(tensors, torch.stack([self.figures[k].float() for k in tensors]).tolist()))
        return {**figures, **(self.layer_stats.after_update() if self.layer_stats is not None else {})}


class Observer:
    """Logs and per-layer statistics: when each is due and what it records.

    Rank 0 writes (``metrics.jsonl``, the terminal, the sinks). ``evaluates(step)`` is the
    validator's schedule (:meth:`nanolm.watch.validator.Validator.due`): an evaluation step is
    always logged. ``state_dict()`` holds what a resume continues: the count of clipped steps
    and the training time so far.
    """

    def __init__(
        self,
        options: ObserverOptions,
        *,
        dist,
        out_dir: Path,
        model,
        precision,
        scaler,
        progress,
        evaluates,
        peak: tuple[float | None, str],
        log=print,
        optimizer=None,
        setup: dict | None = None,
        reference=None,
    ):
        self.options = options
        self.setup, self.reference = setup, reference  # the run's setup, and the shipped reference it matches (or None)
        self.band = BandWatch(reference, options.seed) if reference is not None else None
        self.optimizer = optimizer
        self.dist, self.model, self.precision, self.scaler = dist, model, precision, scaler
        self.progress, self.evaluates, self.log, self.out_dir = progress, evaluates, log, out_dir
        # one device's peak FLOP/s and where the figure comes from (``nanolm.machine.hardware.peak_flops``); MFU
        # is measured against every rank's together
        self.device_peak, self.peak_source = peak
        self.peak = self.device_peak * dist.world_size if self.device_peak else None
        self.monitor, self.meter, self.resumed = None, None, {}
        self.restarted_at = 0

    def describe_mfu(self) -> str:
        """What MFU is measured against, said once at start."""
        peak = f"{self.device_peak / 1e12:.3g} TFLOP/s" if self.device_peak else "no peak"
        return f"MFU: {self.model.flops_per_token() / 1e6:.2f} MFLOP per token, against {peak} ({self.peak_source})"

    # ---------------------------------------------------------------- the run's start
    def start(self, evaluation: dict | None = None) -> None:
        """Open the logs where the run stands (a resumed run's ``metrics.jsonl`` is cut back to
        its checkpoint's step), start the clocks, and for a new run record its step-0 row: the
        recipe and setup, with the untrained model's ``evaluation`` when there is one."""
        o, step = self.options, self.progress.step
        if self.dist.is_main:
            self.monitor = Monitor(
                self.out_dir, o.steps, list(o.sinks), o.config, self.log, o.progress, resume_step=step if step else None
            )
        self.meter = StepMeter(
            o.steps,
            o.tokens_per_step,
            self.model.flops_per_token(),
            self.peak,
            o.recipe["clip"],
            self.dist.device,
            start_step=step,
            clipped_steps=self.resumed.get("clipped_steps", 0),
            elapsed_s=self.resumed.get("elapsed_s", 0.0),
            host_values=o.loss_read_every_step,
        )
        self.restarted_at = step
        self.announce_reference()
        if step == 0:
            row = {
                "step": 0,
                "elapsed_s": 0.0,
                "n_params": self.model.num_params(),
                **self.meter.constants(),
                **self.recipe(),
                **self.reference_keys(),
            }
            self.record(self.judged({**row, **evaluation}) if evaluation else row)
        self.meter.lap(step)

    def announce_reference(self) -> None:
        """One line: the shipped reference this run is recognised as (its evaluations are then
        judged against its band), or that there is none for this setup (and nothing is judged)."""
        if self.setup is None:
            return
        if self.reference is None and "time_budget_s" in self.options.recipe:
            self.log(
                "reference: a time-budgeted run is judged by no band: its warmup and decay follow this machine's "
                "clock, while a band holds a fixed number of steps (--time-budget off and a recipe's --steps is judged)"
            )
            return
        if self.reference is None:
            self.log(no_reference_line(self.setup))
            return
        self.log(
            f"reference: this is {self.reference.describe()}; each evaluation says whether the validation "
            f"loss is inside its band"
        )
        if self.monitor is not None:
            self.band.resume(self.monitor.metrics.rows)  # a resumed run: since when it is outside, from its rows

    def reference_keys(self) -> dict:
        """The step-0 row's record of the setup (its digest) and the reference it matched."""
        if self.setup is None:
            return {}
        keys = {
            "setup_digest": setup_digest(self.setup),
            **{k: v for k, v in self.setup["run"].items() if k != "val_windows"},
        }
        if self.reference is not None:
            keys["reference"] = self.reference.name
            keys["seed"] = self.options.seed  # a seed the reference trained is judged against its own curve
        return keys

    def recipe(self) -> dict:
        """The optimizer's settings for the step-0 row (:class:`ObserverOptions`), and how many
        norms, biases and embeddings the optimizer really decays, whatever the options say."""
        recipe = dict(self.options.recipe)
        if self.optimizer is not None:  # what the optimizer really decays, not what the options say
            embeddings = {id(m.weight) for m in self.model.modules() if isinstance(m, torch.nn.Embedding)}
            recipe["decayed_norms_biases_embeddings"] = sum(
                1
                for group in self.optimizer.param_groups
                if group.get("weight_decay", 0) > 0
                for p in group["params"]
                if p.dim() < 2 or id(p) in embeddings
            )
        return recipe

    # ---------------------------------------------------------------- one step
    def logs(self, step: int) -> bool:
        o = self.options
        return (
            step % o.log_every == 0
            or self.evaluates(step)
            or step == o.steps
            or step == 1
            or is_stats_step(step, o.stats_every)
            or step - self.restarted_at <= 3
        )  # a (re)start: all shown

    def gradient_watch(self, step: int, micro_batches) -> GradientWatch | None:
        """The watch on this step's gradients, or None when nothing is to be read of them.
        Per-layer figures are read on rank 0's own model; under FSDP no rank holds whole layers."""
        stats = (
            LayerStats(self.model, micro_batches[0], self.precision.autocast)
            if is_stats_step(step, self.options.stats_every) and self.dist.is_main and not self.dist.sharded
            else None
        )
        underflow = self.logs(step) and self.precision.name == "fp16"
        return GradientWatch(self.model, stats, underflow, self.scaler) if stats is not None or underflow else None

    def planned(self, steps: int, warmup: int) -> None:
        """A time budget's plan (``nanolm.run.budget``): the steps it expects in all, which the progress
        display and the ETA count to, and the warmup it chose, which the step-0 row records."""
        if self.meter is None:
            recipe = {**self.options.recipe, "warmup_steps": warmup}
            self.options = dataclasses.replace(self.options, steps=steps, recipe=recipe)
            return
        self.meter.total_steps = steps
        if self.monitor is not None:
            self.monitor.terminal.planned(steps)

    def observe(self, result, last: bool = False) -> dict:
        """After a step that stands: count it; on a logged step (or the ``last``, which a time
        budget decides after it ran), read its figures (one host sync) and return its row, for
        :meth:`record_step` ({} when the step is not logged)."""
        step = result.step
        loss, grad_norm = result.read if result.read is not None else (result.loss, result.grad_norm)  # read once
        if result.updated:
            self.meter.count_clipped(grad_norm)
        if not (self.logs(step) or last):
            return {}
        row = self.meter.row(step, loss, result.lr, grad_norm)  # the one host sync of a logged step
        row["tokens"] = self.progress.tokens_seen
        if self.dist.device.type == "cpu":
            row["threads"] = torch.get_num_threads()  # --threads auto may change it mid-run
        row.update(self.scaler.metrics())
        if result.watch is not None:
            row.update(result.watch.after_update())
        if not (self.options.loss_read_every_step or self.scaler.enabled or math.isfinite(row["loss"])):
            self.record(row)  # a guard that reads no step sees the loss only here (fp16: the scaler's to skip)
            raise NanolmError(f"the loss became {row['loss']} at step {row['step']}; lower --lr or raise --warmup")
        return row

    def record_step(self, row: dict) -> None:
        """Record a logged step's row, with the validator's figures when it evaluated (and the
        band's verdict on them), and start the next step's clock. Nothing for a step not logged."""
        if not row:
            return
        self.record(self.judged(row))
        self.meter.lap(row["step"])

    def judged(self, row: dict) -> dict:
        """``row`` with the band's verdict on its validation loss, when it holds one and the run
        is a shipped recipe's."""
        if self.band is not None and "val_loss" in row:
            row.update(self.band.update(row["step"], row["val_loss"]))
        return row

    def target_reached(self, row: dict) -> bool:
        """``--target-val-bpb``: this evaluation is at or below it (every rank sees the same row)."""
        target = self.options.target_val_bpb
        reached = 0 < target and row.get("val_bpb", math.inf) <= target
        if reached:
            self.log(f"val bpb {row['val_bpb']:.4f} <= --target-val-bpb {target} at step {row['step']}: done")
        return reached

    def record(self, row: dict) -> None:
        if self.monitor is not None:
            self.monitor.record(row)

    def write(self, line: str) -> None:
        """A line for the person watching (above the progress bar, if there is one)."""
        (self.monitor.write if self.monitor is not None else self.log)(line)

    # ---------------------------------------------------------------- rollbacks, checkpoints, the end
    def rewound(self, step: int) -> None:
        """After a rollback to ``step``: its rows after the checkpoint describe a discarded
        trajectory and go; the next steps are all shown, like after a resume."""
        if self.monitor is not None:
            self.monitor.rewind(step)
            if self.band is not None:
                self.band.resume(self.monitor.metrics.rows)
        self.meter.lap(step)
        self.restarted_at = step

    def state_dict(self) -> dict:
        return {"clipped_steps": int(self.meter.clipped_steps), "elapsed_s": self.meter.elapsed()}

    def load_state_dict(self, state: dict) -> None:
        """A resume continues both figures (from :meth:`start`); after a rollback the count of
        clipped steps is the checkpoint's, while the clock keeps running (the discarded steps
        took real time)."""
        if self.meter is None:
            self.resumed = {"clipped_steps": int(state["clipped_steps"]), "elapsed_s": float(state["elapsed_s"])}
        else:
            self.meter.set_clipped_steps(int(state["clipped_steps"]))

    def elapsed(self) -> float:
        return self.meter.elapsed() if self.meter is not None else self.resumed.get("elapsed_s", 0.0)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
