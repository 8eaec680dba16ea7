"""``--threads auto``: run on as many CPU threads as make the steps fastest *now*.

PyTorch splits each CPU kernel across one thread per core, and every thread waits for the
slowest at the end of each kernel. On a machine where another process keeps a core busy, the
thread that shares that core runs late on every one of the thousands of small kernels of a
step, and the whole step waits for it: measured on 2 cores with one kept busy, the README's
quick run took 104 s at PyTorch's default of 2 threads and 58 s at 1 (``benchmarks/busy_machine.py``). Which count is
fastest depends on what else runs, and that changes while a run trains, so it is measured.

How, without changing the run's arithmetic:

* a *trial* times one forward and backward pass of the step's first micro-batch at each
  candidate count (all cores, half of them, one), twice each, keeping the faster time; the
  gradients are thrown away and the random state is put back, so the step that follows is
  exactly the one it would have been;
* the run switches only to a count that was at least 10 % faster than the current one (on an
  idle machine the default stays, and with it the default's numbers);
* a trial runs at the second step of the process, then again when the machine seems to have
  changed: the steps became 30 % slower or faster than at the last decision, or the load
  average moved by a core or more, or a waiting time has passed (1 minute, doubling up to 16
  after each trial that confirms the choice).

A trial costs about four forward/backward passes, once a minute at most: a small share of a
run (docs/benchmarks.md, "A busy machine").
What it cannot promise: that the thread count never changes the numbers. PyTorch does not
guarantee that a kernel gives the same bits at 1 and 2 threads (a reduction may be split
differently); on the development CPU, nanolm's step gives the same bits at both
(``test_environment_a_step_gives_the_same_bits_at_one_and_two_threads``). Runs that must not depend on it
(``--deterministic``) keep a fixed count, and an explicit ``--threads N`` is always obeyed.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

SWITCH_GAIN = 0.10  # switch only for at least this much faster
DRIFT = 1.3  # steps this much slower (or faster) than at the decision: measure again
LOAD_CHANGE = 1.0  # load average moved by this many cores: measure again
FIRST_WAIT_S, LONGEST_WAIT_S = 60.0, 960.0


def candidate_counts(cores: int) -> list[int]:
    """All cores, half of them, one: the counts a trial compares."""
    return sorted({cores, max(1, cores // 2), 1}, reverse=True)


class ThreadTuner:
    """Chooses ``torch.set_num_threads`` between steps when ``--threads auto`` applies (a CPU run
    in one process, not ``--deterministic``); :meth:`fixed` does nothing, for every other run.

    ``trial_pass(batch)`` is what a trial times: the step's own forward and backward pass on one
    micro-batch, its gradients thrown away (``nanolm.step.discarded_pass``). The loop calls
    :meth:`before_step` by name, between drawing a step's batches and taking the step."""

    def __init__(
        self,
        trial_pass: Callable | None,
        log=print,
        cores: int | None = None,
        clock=time.perf_counter,
        load=None,
        enabled: bool = True,
    ):
        self.trial_pass, self.log, self.clock = trial_pass, log, clock
        self.load = load or (lambda: os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)
        self.cores = cores or os.cpu_count() or 1
        self.enabled = enabled and self.cores > 1
        self.steps_seen = 0
        self.intervals: list[float] = []  # seconds between this process's steps, most recent last
        self.last_tick: float | None = None
        self.decided_at: float | None = None  # clock time of the last trial
        self.decided_interval: float | None = None
        self.decided_load = 0.0
        self.wait_s = FIRST_WAIT_S
        self.trials: list[dict] = []  # what each trial measured (tests and the log read it)

    @classmethod
    def fixed(cls) -> "ThreadTuner":
        return cls(None, enabled=False)

    # ---------------------------------------------------------------- when
    def before_step(self, batches: list) -> None:
        """Called before each step with its micro-batches: maybe measure, maybe switch."""
        if not self.enabled:
            return
        now = self.clock()
        if self.last_tick is not None:
            self.intervals = (self.intervals + [now - self.last_tick])[-8:]
        self.last_tick = now
        self.steps_seen += 1
        if self.steps_seen >= 2 and self._due(now):
            self.trial(batches[0])
            self.last_tick = self.clock()  # the trial's own time is not a step's

    def _due(self, now: float) -> bool:
        if self.decided_at is None:
            return True
        if now - self.decided_at >= self.wait_s:
            return True
        if self.decided_interval is None and len(self.intervals) >= 4:
            self.decided_interval = statistics.median(self.intervals)  # the steps at the count just chosen
        elif self.decided_interval is not None:
            ratio = statistics.median(self.intervals[-4:]) / self.decided_interval
            if ratio > DRIFT or ratio < 1 / DRIFT:
                self.wait_s = FIRST_WAIT_S
                return True
        if abs(self.load() - self.decided_load) >= LOAD_CHANGE:
            self.wait_s = FIRST_WAIT_S
            return True
        return False

    # ---------------------------------------------------------------- how
    def trial(self, batch) -> int:
        """Time a forward and backward pass at each candidate count; keep the fastest if it
        is clearly faster than the current count. Returns the count chosen."""
        current = torch.get_num_threads()
        rng = torch.get_rng_state()
        times = {}
        for n in candidate_counts(self.cores):
            torch.set_num_threads(n)
            times[n] = min(self._time_pass(batch) for _ in range(2))
        torch.set_rng_state(rng)  # dropout in the trial passes must not shift the real step's masks
        best = min(times, key=times.get)
        base = times.get(current, min(times.values()))
        chosen = best if times[best] < (1 - SWITCH_GAIN) * base else current
        torch.set_num_threads(chosen)
        confirmed = chosen == current and self.decided_at is not None
        self.wait_s = min(LONGEST_WAIT_S, self.wait_s * 2) if confirmed else FIRST_WAIT_S
        self.decided_at, self.decided_load = self.clock(), self.load()
        self.decided_interval, self.intervals = None, []  # measured again over the next steps
        self.trials.append({"threads": chosen, "from": current, "ms": {n: round(t * 1e3, 1) for n, t in times.items()}})
        if chosen != current:
            shown = ", ".join(f"{n}: {t * 1e3:.0f} ms" for n, t in times.items())
            self.log(f"threads: {current} -> {chosen} (a forward and backward pass at {shown}; --threads N fixes it)")
        return chosen

    def _time_pass(self, batch) -> float:
        start = self.clock()
        self.trial_pass(batch)
        return self.clock() - start
