"""``--time-budget``: a run as long as the user's time, on whatever machine runs it.

A fixed number of steps is the same run on every machine and takes a different time on each: the
per-minute track's steps fit their minute only on the CPU they were fitted to (docs/speedrun.md).
A user's budget is time, so with ``--time-budget 60`` the run plans its own length:

1. **Measure, then plan** (before a new run's first step): a forward and backward pass of one
   micro-batch and one validation batch, each timed on its second run (the first pays for
   allocation and compiling, which the budget's clock counts all the same). That gives the plan
   said at start: about how many steps fit, the warmup (a tenth of them, at most 200, unless
   ``--warmup`` says), and about where the decay will start.
2. **Hold the peak, then decay by the clock.** After every step the run knows the time left and
   what a step costs lately (the median wall time of the last steps, so that an evaluation or a
   save does not pass for a slow step). It starts the warmup-stable-decay line down to
   ``--min-lr`` when what is left fits only ``--decay-fraction`` of the run's steps; the line ends
   on the last step after which the final evaluation still fits.
3. **Draw the line again when the machine changes speed.** If another job takes a core halfway,
   fewer steps fit: the line is drawn again from the rate the next step would have had to the
   floor over the steps that now fit (the rate never jumps), and the log says so. The run ends on
   time with a decayed model. A machine that speeds up gets a longer line the same way.

The learning rate stays a pure function of the step and the plan (:func:`budget_learning_rate`),
and the plan is state: a checkpoint records it with the time spent, so a run stopped and continued
with the same command keeps the budget it had left (the time between its last checkpoint and the
stop is not counted: those steps are trained again). The budget counts the training loop, from the
measurement to the end of the final evaluation; the set-up before it (imports, tokenizer, data) and
the final save and sample after it are outside.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..errors import NanolmError
from ..step import wsd_decay_start

NO_STEP_LIMIT = 10**9
"""``--steps`` of a budgeted run that names none: the clock alone ends it."""

RECENT_STEPS = 5  # a step's cost is the median wall time of this many recent steps: a slowdown shows in three
ESTIMATE_VOTES = 2  # the plan's first estimate counts as this many of them, until real steps replace it
REDRAW_SHARE = 0.05  # a plan that moves by less than this share of the steps left is not said again (nor
# lengthened: a faster machine draws a longer decay only past it)
ESTIMATE_SHARE = 0.1  # before the decay, an estimate of the steps in all is said again when it moves this much
DEFAULT_MAX_WARMUP = 200

_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)$")


def parse_duration(text) -> float | None:
    """Seconds in ``60``, ``90s``, ``2.5m``, ``5min`` or ``1h``; None for ``off`` (no budget)."""
    text = str(text).strip().lower()
    if text in ("off", "none"):
        return None
    match = _DURATION.match(text)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"not a duration: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


parse_duration.__name__ = "duration (60, 90s, 5m, 1h, or off)"  # argparse and config errors name the type by it


def describe_duration(seconds: float) -> str:
    if seconds >= 120 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


@dataclass
class BudgetPlan:
    """What a checkpoint records of a budgeted run: the budget, the time spent, what a step and an
    evaluation cost, and the schedule drawn so far. ``decay_from`` is None until the clock starts
    the decay; from then on the rate falls in a straight line from ``decay_share`` of the way
    between ``--min-lr`` and the peak (1 unless the line was drawn again mid-decay) at step
    ``decay_from + 1`` to the floor after ``last_step``."""

    budget_s: float
    spent_s: float = 0.0
    warmup: int | None = None  # None: not planned yet (a new run before its measurement)
    step_s: float = 0.0
    eval_s: float = 0.0
    last_step: int = 0
    decay_from: int | None = None
    decay_share: float = 1.0
    ended: bool = False


def checked_plan(state: dict) -> BudgetPlan:
    """The plan a checkpoint holds, each field of its type and range (a ValueError otherwise: the
    checkpointer names the state malformed in one line, before any step reads a field of it)."""

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0

    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= NO_STEP_LIMIT

    plan = BudgetPlan(**{f.name: state[f.name] for f in dataclasses.fields(BudgetPlan)})
    ok = (
        all(number(getattr(plan, k)) for k in ("budget_s", "spent_s", "step_s", "eval_s", "decay_share"))
        and plan.decay_share <= 1
        and all(count(getattr(plan, k)) or getattr(plan, k) is None for k in ("warmup", "decay_from"))
        and count(plan.last_step)
        and isinstance(plan.ended, bool)
    )
    if not ok:
        raise ValueError(f"a time budget's plan out of its types or ranges: {state!r:.200}")
    return plan


def budget_learning_rate(step: int, o, plan: BudgetPlan) -> float:
    """The rate of optimizer step ``step`` (1 for the first) of a budgeted run under the optimizer
    options ``o`` (``--lr``, ``--min-lr``): warmup over ``plan.warmup`` steps, the peak, then the
    plan's straight line to the floor (see :class:`BudgetPlan`). A pure function of the step and the
    plan, as :func:`nanolm.step.learning_rate` is of the step and the options."""
    if step < 1:
        raise ValueError(f"optimizer steps count from 1, as the training loop does; got step {step}")
    if plan.decay_from is not None and step > plan.decay_from:
        if step > plan.last_step:
            return o.min_lr
        done = (step - 1 - plan.decay_from) / max(1, plan.last_step - plan.decay_from)
        return o.min_lr + (o.lr - o.min_lr) * plan.decay_share * (1.0 - done)
    if plan.warmup and step <= plan.warmup:
        return o.lr * step / plan.warmup
    return o.lr


class TimeBudget:
    """The clock's part in a run: the plan, the learning rate it implies, and the last step.

    The loop calls :meth:`start` once, before its first step, and :meth:`ends_at` after every
    step: True means this step is the last (the validator evaluates it, the checkpointer saves
    it). :meth:`off` is the budget of a run that has none: it plans nothing and ends nothing
    (``--steps`` does). ``measure()`` returns the seconds of one step's forward and backward
    passes and of one evaluation; ``planned(last_step, warmup)`` tells the observer the steps
    expected. Under torchrun rank 0's clock decides and every rank follows it.
    """

    def __init__(
        self,
        seconds: float | None,
        optim=None,
        *,
        eval_every: int = 0,
        max_steps: int = NO_STEP_LIMIT,
        measure: Callable[[], tuple[float, float]] | None = None,
        planned: Callable[[int, int], None] | None = None,
        dist=None,
        log=print,
        clock: Callable[[], float] = time.perf_counter,
        compiling: bool = False,
    ):
        self.seconds, self.optim, self.compiling = seconds, optim, compiling
        self.eval_every, self.max_steps = eval_every, max_steps
        self.measure, self.planned, self.dist, self.log, self.clock = measure, planned, dist, log, clock
        self.plan = BudgetPlan(budget_s=seconds or 0.0)
        self.started: float | None = None
        self.recent: deque = deque(maxlen=RECENT_STEPS)

    @classmethod
    def off(cls) -> "TimeBudget":
        return cls(None)

    @property
    def active(self) -> bool:
        return self.seconds is not None

    def learning_rate(self, step: int) -> float:
        return budget_learning_rate(step, self.optim, self.plan)

    # ---------------------------------------------------------------- the clock
    def left(self, now: float | None = None) -> float:
        """Seconds of the budget not yet spent."""
        now = self.clock() if now is None else now
        return self.plan.budget_s - self.plan.spent_s - (now - self.started)

    def steps_that_fit(self, step: int, left: float) -> int:
        """Steps after ``step`` that fit in ``left`` seconds with the evaluations due on the way
        (each with its save) and the final one, by the plan's costs; at most ``--steps``."""
        p = self.plan
        per_step = p.step_s + (p.eval_s / self.eval_every if self.eval_every else 0.0)
        # one step's time is kept in hand: the next step may be slower than the recent ones were
        fit = math.floor((left - p.eval_s - p.step_s) / per_step) if per_step > 0 else self.max_steps
        return max(0, min(fit, self.max_steps - step))

    # ---------------------------------------------------------------- the loop's calls
    def start(self, step: int) -> None:
        """Start the clock before the loop's first step (``step``: the steps already trained). A new
        run measures and plans here; a continued one goes on with its plan and the time it has left."""
        if not self.active or self.plan.ended:  # no budget, or one spent: nothing to plan
            return
        self.started = self.clock()
        self.first_step = step + 1
        self.last_mark = self.started
        p = self.plan
        if p.warmup is None:
            measured = self.measure()
            if self.dist is not None and self.dist.active:  # every rank plans with rank 0's figures
                measured = self.dist.broadcast(measured)
            p.step_s, p.eval_s = measured
            if self.left() < p.step_s + p.eval_s:
                raise NanolmError(
                    f"--time-budget {describe_duration(p.budget_s)} is too short for one step and one evaluation "
                    f"on this machine (~{p.step_s:.2g} s a step, ~{p.eval_s:.2g} s an evaluation): give it at "
                    f"least {math.ceil(2 * (p.step_s + p.eval_s) + self.clock() - self.started)} s"
                )
            p.last_step = self.steps_that_fit(step, self.left())
            p.warmup = (
                self.optim.warmup if self.optim.warmup is not None else min(DEFAULT_MAX_WARMUP, p.last_step // 10)
            )
            decay = wsd_decay_start(p.warmup, p.last_step, self.optim.decay_fraction) + 1
            measuring = self.clock() - self.started  # a --compile run compiles here, on the budget's clock
            self.log(
                f"time budget {describe_duration(p.budget_s)}: ~{p.last_step} steps at ~{p.step_s:.2g} s, "
                f"warmup {p.warmup}, decay from step ~{decay} by the clock (~{p.eval_s:.2g} s an evaluation"
                + (f"; {measuring:.1f} s measuring them, the compile included)" if self.compiling else ")")
            )
        else:
            self.log(
                f"time budget {describe_duration(p.budget_s)}: {self.left():.1f} s left at step {step} "
                f"(~{p.step_s:.2g} s a step, ~{p.last_step} steps planned"
                + (f", decaying since step {p.decay_from + 1})" if p.decay_from is not None else ")")
            )
        # the estimate counts as two of the recent steps until real ones push it out: one odd early
        # step (a page fault storm, another job's burst) is then one vote of three, not the whole plan
        self.recent.clear()
        self.recent.extend([p.step_s] * ESTIMATE_VOTES)
        self.announced = p.last_step
        self._tell_observer()

    def ends_at(self, step: int) -> bool:
        """After step ``step``: measure it, move the plan as the clock says, and say whether this
        step is the last."""
        if not self.active:
            return False
        now = self.clock()
        took, self.last_mark = now - self.last_mark, now
        p = self.plan
        after_evaluation = self.eval_every and (step - 1) % self.eval_every == 0 and step - 1 >= self.first_step
        if after_evaluation and len(self.recent) >= 3:  # the previous step's evaluation and save ran in this wall time
            p.eval_s = max(p.eval_s, took - statistics.median(self.recent))
        elif step > self.first_step:  # a process's first step pays for warming up: not a step's cost
            self.recent.append(took)
            p.step_s = statistics.median(self.recent)
        last = self._decide(step, self.steps_that_fit(step, self.left(now)))
        if self.dist is not None and self.dist.active:  # every rank follows rank 0's clock
            self.plan, last = self.dist.broadcast((self.plan, last))
        self._tell_observer()
        return last

    def _decide(self, step: int, fit: int) -> bool:
        p, o = self.plan, self.optim
        if step >= self.max_steps:  # --steps, the plan's limit, reached
            p.last_step, p.ended = step, True
            return True
        if fit == 0:
            if p.decay_from is None or step < p.last_step:
                self.log(
                    f"time budget: no time left for another step; the run ends at step {step}"
                    + ("" if p.decay_from is not None else ", before its decay could start")
                )
            p.last_step, p.ended = step, True
            return True
        end = step + fit
        if p.decay_from is None:
            p.last_step = end
            if fit <= max(2, round(o.decay_fraction * end)):
                self._draw_decay(step, end)
                self.log(
                    f"time budget: decay from step {step + 1} to step {end} by the clock "
                    f"({self.left():.1f} s left, ~{p.step_s:.2g} s a step)"
                )
                self.announced = end
            elif self._moved(step, end, share=ESTIMATE_SHARE):
                self.log(
                    f"time budget: a step now takes ~{p.step_s:.2g} s, so ~{end} steps fit in all, not "
                    f"~{self.announced} ({self.left():.1f} s left)"
                )
                self.announced = end
            return False
        if step >= p.last_step:
            p.ended = True
            return True
        if end < p.last_step or end > p.last_step + max(2, REDRAW_SHARE * (p.last_step - step)):
            self._draw_decay(step, end)
            if self._moved(step, end):
                self.log(
                    f"time budget: a step now takes ~{p.step_s:.2g} s; the decay ends at step {end}, not "
                    f"{self.announced} ({self.left():.1f} s left)"
                )
                self.announced = end
        return False

    def _moved(self, step: int, end: int, share: float = REDRAW_SHARE) -> bool:
        """Whether the plan's end moved enough since it was last said to be said again: by ``share``
        of the steps that were left, and by at least two steps."""
        return abs(end - self.announced) >= max(2, share * (self.announced - step))

    def _draw_decay(self, step: int, end: int) -> None:
        """Start (or draw again) the straight line to the floor: from the rate step ``step + 1``
        would have had, down over the steps to ``end``."""
        o, p = self.optim, self.plan
        rate = self.learning_rate(step + 1)
        p.decay_share = (rate - o.min_lr) / (o.lr - o.min_lr) if o.lr > o.min_lr else 0.0
        p.decay_from, p.last_step = step, max(end, step + 1)

    def _tell_observer(self) -> None:
        if self.planned is not None:
            self.planned(self.plan.last_step, self.plan.warmup)

    def used(self) -> float:
        """Seconds of the budget spent so far, over every process of the run."""
        return self.plan.budget_s - self.left()

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        state = dataclasses.asdict(self.plan)
        if self.started is not None:
            state["spent_s"] = self.plan.spent_s + self.clock() - self.started
        return state

    def load_state_dict(self, state: dict) -> None:
        """A continued run takes its plan and the time spent from the checkpoint. A rollback (the
        clock already running) keeps the live plan and clock: the discarded steps took real time."""
        if self.started is None:
            self.plan = checked_plan(state)


def measure_a_step_and_an_evaluation(
    step_model, model, train_batch, val_batches: list, *, grad_accum: int, autocast, token_bytes, dist
) -> Callable[[], tuple[float, float]]:
    """What :meth:`TimeBudget.start` measures on a new run: the seconds of one optimizer step's
    forward and backward passes (``grad_accum`` of them, on a training micro-batch) and of one
    evaluation (one validation batch, times this rank's share of them). Each is timed on its
    second run; the gradients are thrown away and the random state put back, so the first real
    step is the one it would have been. The optimizer's own update is not in it: the real steps'
    clock takes it in from the first steps on."""
    import torch

    from ..evaluate import estimate_loss
    from ..step import discarded_pass

    device = dist.device

    def timed(fn) -> float:
        for _ in range(2):
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            took = time.perf_counter() - start
        return took

    def measure() -> tuple[float, float]:
        cuda = (
            [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
        )
        with torch.random.fork_rng(devices=cuda):
            step_s = grad_accum * timed(lambda: discarded_pass(step_model, train_batch.to(device), autocast))
        eval_s = 0.0
        if val_batches:
            with autocast():
                one = timed(lambda: estimate_loss(model, val_batches[:1], token_bytes, device))
            dist.reshard(model)  # as after any evaluation: FSDP frees the weights it gathered
            eval_s = one * len(dist.share_of(val_batches))
        return step_s, eval_s

    return measure
