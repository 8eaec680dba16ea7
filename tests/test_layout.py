"""The week's path stays short: one training step runs code from the files a student reads.

A step that starts calling into the distributed, precision or optimizer modules on one process
is still correct, and a reader following it now opens twice the files: nothing else would
notice. These tests trace which of nanolm's files run during one quiet step.
"""

import sys
from pathlib import Path

import nanolm
import nanolm.train as train_module
from conftest import tiny_run_config

PACKAGE = Path(nanolm.__file__).parent

# The loop, the step, the model with its loss, the batches: the files a reader opens.
WEEKS_FILES = {"train.py", "step.py", "model.py", "batches.py"}
# The components the step consults, one call each, whose contract StepSetup states: the guard's
# decision (take, skip, roll back, stop) and the observer's choice of what to read of the gradients.
COMPONENTS = {"guards.py": {"decide", "check", "is_spike", "zscore", "add", "_scaled"},
              "observer.py": {"gradient_watch", "logs", "is_stats_step"}}


def _files_one_step_runs(tmp_path, monkeypatch, stories_file, **train) -> dict[str, set[str]]:
    """{file: functions} of nanolm's code run by one optimizer step of a default run (the
    batches drawn, then ``train_step``), on a step that logs nothing."""
    ran: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            name = Path(frame.f_code.co_filename).relative_to(PACKAGE).as_posix()
            ran.setdefault(name, set()).add(frame.f_code.co_name)

    def one_quiet_step(run, log=print):
        for step in (1, 2, 3, 4, 5):  # a (re)start logs its first steps; step 5 is quiet
            quiet = step == 5
            assert not quiet or not run.observer.logs(step)
            sys.setprofile(profile if quiet else None)
            try:
                train_module.train_step(run.step_setup, step, run.batches.next(step))
            finally:
                sys.setprofile(None)
        return {}

    monkeypatch.setattr(train_module, "run_loop", one_quiet_step)
    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=50, log_every=10, threads=1, **train)
    train_module.train(cfg, log=lambda *a: None)
    return ran


def test_a_quiet_step_runs_only_the_weeks_files_and_one_call_of_each_component(tmp_path, monkeypatch, stories_file):
    ran = _files_one_step_runs(tmp_path, monkeypatch, stories_file)
    outside = {f: sorted(fns) for f, fns in ran.items() if f not in WEEKS_FILES and f not in COMPONENTS}
    assert not outside, f"one step on one process runs code outside the week's files: {outside}"
    for component, allowed in COMPONENTS.items():
        assert ran.get(component, set()) <= allowed, f"the step calls more of {component}: {ran[component]}"
    assert {"step.py", "model.py", "batches.py"} <= set(ran)  # the trace saw the step


def test_a_quiet_step_without_a_reading_guard_never_enters_the_guard(tmp_path, monkeypatch, stories_file):
    cfg_guard = {"on_nan": "stop", "on_spike": "off"}

    def guard_options(cfg):
        for k, v in cfg_guard.items():
            setattr(cfg.guard, k, v)
        return cfg

    real = train_module.train
    monkeypatch.setattr(train_module, "train", lambda cfg, log=print: real(guard_options(cfg), log=log))
    ran = _files_one_step_runs(tmp_path, monkeypatch, stories_file)
    assert "guards.py" not in ran
