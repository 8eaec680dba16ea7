"""Crash points, enumerated: run a file operation once to count its disk steps, then again with
the process stopped (or the step failed with ENOSPC or EIO) at every one of them, and judge
what each leaves.

The steps are those of ``nanolm.base.disk``, the ground floor every write of nanolm goes
through. An audit hook (``sys.addaudithook``) watches every change Python makes under the
test's directory (opening for writing, renaming, removing, making a directory...) and reports
any that did not go through a step: a change made around the ground floor could neither be
counted nor stopped, and a crash there would go unexamined.

``NANOLM_EXPLORE=1`` adds random schedules: a second fault in the command run again after
the first (a crash while recovering from a crash). With ``NANOLM_CRASH_POINTS_LOG=FILE`` each
enumeration appends a line (JSON: the operation, its steps by kind, the trials) to FILE:
``python tools/crash_test.py --crash-points`` prints them as a table.
"""

from __future__ import annotations

import errno
import json
import os
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nanolm.base import disk

FAULTS = ("stop", errno.ENOSPC, errno.EIO)
"""What happens at the chosen step: the process dies there, or the step fails as a full disk or
a failing disk would make it fail."""
EXPLORE = os.environ.get("NANOLM_EXPLORE") == "1"
EVERY_FAULT = True
"""Every fault at every step (the exhaustive enumeration), or, when False, the stop at every step
and one failure at each, ENOSPC and EIO taking turns: every step is still stopped and failed, and
both errors are still met, at two thirds of the cost (the default suite's share; the code that
meets a failed step does not ask which error it was, and a test of that is its own)."""

_CHANGING_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_CHANGING_EVENTS = {
    "os.rename": 2,
    "os.remove": 1,
    "os.rmdir": 1,
    "os.mkdir": 1,
    "shutil.rmtree": 1,
    "os.chmod": 1,
    "os.truncate": 1,
    "tempfile.mkdtemp": 1,
    "tempfile.mkstemp": 1,
    "shutil.copyfile": 2,
    "os.link": 2,
    "os.symlink": 2,
    "os.utime": 1,
}
"""Audit events that change the disk, and how many of their first arguments are paths."""


@dataclass
class _Watch:
    root: str
    plan: disk.FaultPlan
    around: list = field(default_factory=list)


_watch: _Watch | None = None


def _audit(event: str, args: tuple) -> None:
    watch = _watch
    if watch is None or watch.plan.inside:
        return
    if event == "open":
        path, _, flags = args
        if not isinstance(flags, int) or not flags & _CHANGING_FLAGS:
            return
        paths = [path]
    elif event in _CHANGING_EVENTS:
        paths = list(args[: _CHANGING_EVENTS[event]])
    else:
        return
    for path in paths:
        if isinstance(path, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(path)).startswith(watch.root):
            watch.around.append((event, os.fsdecode(path)))


sys.addaudithook(_audit)


@contextmanager
def _watched(root: Path, plan: disk.FaultPlan):
    """``plan`` decides each step under ``root``; yields the list of changes made around it."""
    global _watch
    watch = _Watch(os.path.abspath(root) + os.sep, plan)
    _watch = watch
    try:
        with disk.faults(plan):
            yield watch.around
    finally:
        _watch = None


@dataclass
class Trial:
    """One run of the operation under a fault: ``at`` (1-based step), ``fault`` and what the
    operation raised (None if it returned)."""

    at: int
    fault: str | int
    step: tuple[str, str]
    raised: BaseException | None

    @property
    def stopped(self) -> bool:
        return self.fault == "stop"

    def __str__(self) -> str:
        fault = self.fault if isinstance(self.fault, str) else errno.errorcode[self.fault]
        return f"{fault} at step {self.at} ({self.step[0]} {self.step[1]})"


def run_under(plan: disk.FaultPlan, root: Path, operation):
    """Run ``operation()`` with ``plan`` in force; returns what it raised (None if nothing) and
    fails if anything changed the disk under ``root`` around the ground floor."""
    raised = None
    with _watched(root, plan) as around:
        try:
            operation()
        except (disk.Stopped, Exception) as e:
            raised = e
    assert not around, f"changed around nanolm.base.disk (neither counted nor stoppable): {around[:3]}"
    return raised


def count_steps(setup, operation, root: Path) -> list[tuple[str, str]]:
    """The disk steps ``operation`` takes from the state ``setup()`` makes (it must succeed)."""
    setup()
    plan = disk.FaultPlan()
    raised = run_under(plan, root, operation)
    assert raised is None, f"the operation fails without any fault: {raised!r}"
    assert plan.steps, "the operation took no disk step"
    return plan.steps


def every_crash_point(name: str, setup, operation, judge, root: Path, faults=FAULTS, seed: int = 0) -> dict:
    """For each fault and each step k of ``operation`` (called ``name`` in the log): ``setup()``,
    run it with that fault at step k, then ``judge(trial)`` (which asserts the invariants, the
    command run again included). Returns {fault: number of steps tried}."""
    steps = count_steps(setup, operation, root)
    tried = {}
    failures = [f for f in faults if f != "stop"]
    for fault in faults:
        tried[fault] = 0
        for k, step in enumerate(steps, start=1):
            if not EVERY_FAULT and fault in failures and failures[(k - 1) % len(failures)] != fault:
                continue
            tried[fault] += 1
            setup()
            raised = run_under(disk.FaultPlan(at=k, fault=fault), root, operation)
            trial = Trial(k, fault, step, raised)
            try:
                judge(trial)
            except AssertionError as e:
                raise AssertionError(f"{trial}: {e}") from None
    if EXPLORE:  # a fault, then another in the command run again to recover
        rng = random.Random(seed)
        for _ in range(4 * len(steps)):
            setup()
            run_under(disk.FaultPlan(at=rng.randint(1, len(steps)), fault=rng.choice(FAULTS)), root, operation)
            again = disk.FaultPlan(at=rng.randint(1, 2 * len(steps)), fault=rng.choice(FAULTS))
            raised = run_under(again, root, operation)
            step = again.steps[again.at - 1] if again.at <= len(again.steps) else ("none", "")
            trial = Trial(again.at, again.fault if step[0] != "none" else "none", step, raised)
            try:
                judge(trial)
            except AssertionError as e:
                raise AssertionError(f"after a first fault, {trial}: {e}") from None
    _log(name, steps, tried)
    return tried


def _log(name: str, steps: list[tuple[str, str]], tried: dict) -> None:
    path = os.environ.get("NANOLM_CRASH_POINTS_LOG")
    if not path:
        return
    kinds: dict[str, int] = {}
    for kind, _ in steps:
        kinds[kind] = kinds.get(kind, 0) + 1
    line = {"operation": name, "steps": len(steps), "kinds": kinds, "trials": sum(tried.values()), "explored": EXPLORE}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def tree(directory: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes] | None:
    """Every file below ``directory`` with its bytes (None when it does not exist)."""
    directory = Path(directory)
    if not directory.exists():
        return None
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in skip
    }
