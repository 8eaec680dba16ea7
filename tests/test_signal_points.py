"""A stop signal at any point of a run's life, alone or followed by another, keeps the run's
promises: the first signal's status, one line, no step and at most one save after it, and the
same command finishing the run bit-identically, leaving nothing behind (tests/signal_points.py).
"""

import os
import signal
from pathlib import Path

import pytest
from conftest import run_harness
from signal_points import EXHAUSTIVE_STRIDE, PHASES, SUITE_STRIDE

from nanolm.machine.runtime import SAME_REQUEST_SECONDS, StopAtOnce, StopOnSignal, StoppedAtOnce, TrainingInterrupted

pytestmark = pytest.mark.skipif(os.name == "nt" or not hasattr(os, "fork"), reason="POSIX signals and fork")


@pytest.mark.parametrize(
    "stride, every_signal",
    [(SUITE_STRIDE, False), pytest.param(EXHAUSTIVE_STRIDE, True, marks=pytest.mark.exhaustive)],
    ids=["suite", "exhaustive"],
)
def test_a_signal_at_any_point_of_a_run_keeps_its_status_its_work_and_a_bit_identical_resume(
    tmp_path, stories_file, stride, every_signal
):
    """Every phase with a signal (each of the three in turn, and all three during a step; in CI's
    exhaustive run all three in every phase), every ordered pair during a step, every tenth disk
    step of the run (its lock, data preparation, metadata, both checkpoints' saves, final weights;
    every third in the exhaustive run) with a signal and with a pair, and a late second Ctrl-C
    during a step and during a save. ``python tests/signal_points.py --every`` runs every point
    with every signal and pair."""
    options = ["--stride", stride] + (["--every-signal"] if every_signal else [])
    outcome = run_harness(Path(__file__).with_name("signal_points.py"), stories_file, tmp_path, *options)
    steps, alone = outcome["disk_steps"], 3 * len(PHASES) if every_signal else len(PHASES) + 2
    assert steps > 100 and outcome["cases"] >= alone + 17 + 2 * (steps // stride), outcome  # the enumeration ran


def _handled(stop, signum) -> None:
    """The handler run as a signal would run it; a stop at once (a KeyboardInterrupt, which
    pytest would take for the user's) fails the test instead."""
    try:
        stop._handle(signum, None)
    except KeyboardInterrupt as e:
        pytest.fail(f"the signal stopped the run at once: {e!r}")


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_second_ctrl_c_soon_after_a_stop_signal_is_the_same_request():
    """torchrun forwards to its workers the Ctrl-C the terminal already gave them: the pair
    arrives within milliseconds, and must not abandon the checkpoint the first asked for."""
    clock = _Clock()
    stop = StopOnSignal(clock)
    _handled(stop, signal.SIGTERM)
    clock.now += SAME_REQUEST_SECONDS * 0.9
    _handled(stop, signal.SIGINT)
    _handled(stop, signal.SIGHUP)
    assert stop.requested == signal.SIGTERM


def test_a_second_ctrl_c_exactly_at_the_limit_is_still_the_same_request():
    clock = _Clock()
    stop = StopOnSignal(clock)
    _handled(stop, signal.SIGINT)
    clock.now += SAME_REQUEST_SECONDS
    _handled(stop, signal.SIGINT)
    assert stop.requested == signal.SIGINT


def test_train_called_from_python_gets_its_signal_handlers_back_and_the_inner_loop_its_outer_one():
    """A notebook or a sweep calling ``train()`` keeps its own handlers (only the command's entry
    may leave the signals ignored once it is on its way out); a loop inside another (the lab
    trains inside its own command) hands the stop requests back to the outer one."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with StopOnSignal() as outer:
        with StopOnSignal() as inner:
            assert StopOnSignal.active is inner
        assert StopOnSignal.active is outer
        with StopAtOnce("while testing"):
            pass
        outer.request(signal.SIGTERM)  # a run stopped by a signal: its handlers come back too
    assert StopOnSignal.active is None
    assert {sig: signal.getsignal(sig) for sig in before} == before
    with pytest.raises(TrainingInterrupted), StopAtOnce("while testing") as stop:
        stop._handle(signal.SIGHUP, None)
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_second_ctrl_c_long_after_stops_at_once_with_the_first_signals_status():
    clock = _Clock()
    stop = StopOnSignal(clock)
    _handled(stop, signal.SIGHUP)
    clock.now += SAME_REQUEST_SECONDS * 0.9
    _handled(stop, signal.SIGTERM)  # only a Ctrl-C stops at once, however late
    clock.now += SAME_REQUEST_SECONDS * 10
    _handled(stop, signal.SIGTERM)
    with pytest.raises(StoppedAtOnce) as stopped:
        stop._handle(signal.SIGINT, None)
    assert stopped.value.exit_code == 128 + signal.SIGHUP
    assert str(stopped.value).startswith("SIGINT after SIGHUP: stopped at once")


def test_a_sighup_long_after_a_stop_request_is_not_a_second_ctrl_c():
    """A run stopped by a Ctrl-C or a scheduler's SIGTERM may still be saving when its terminal
    closes: that SIGHUP is nobody's second keypress, and must not abandon the save."""
    for first in (signal.SIGINT, signal.SIGTERM):
        clock = _Clock()
        stop = StopOnSignal(clock)
        _handled(stop, first)
        clock.now += SAME_REQUEST_SECONDS * 10
        _handled(stop, signal.SIGHUP)
        assert stop.requested == first


def test_a_signal_while_a_phase_with_nothing_to_save_cleans_up_changes_nothing():
    """The first signal raises so that the cleanup runs; a second one raising inside that
    cleanup would leave half of what it was removing, with the second signal's status."""
    stop = StopAtOnce("while testing")
    with pytest.raises(TrainingInterrupted) as first:
        stop._handle(signal.SIGTERM, None)
    assert first.value.exit_code == 128 + signal.SIGTERM
    _handled(stop, signal.SIGINT)
    _handled(stop, signal.SIGHUP)
    assert stop.requested == signal.SIGTERM
