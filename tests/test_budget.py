"""``--time-budget``: a run plans its steps from its own clock and ends inside its budget.

The planning is tested on a simulated clock (a step costs what the test says, the machine slows
when the test says), so each promise is checked exactly and in milliseconds; one short real run
checks that the loop, the checkpoint and a rerun keep the same promises."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import TINY_TRAIN, run_main

from nanolm.run.budget import NO_STEP_LIMIT, BudgetPlan, TimeBudget, budget_learning_rate, parse_duration

PEAK = 1e-2


class SimulatedRun:
    """The training loop's calls to the budget, on a clock that advances by what each part costs:
    ``step_cost(t)`` seconds a step at simulated time ``t``, ``eval_s`` an evaluation (with its
    save), every ``eval_every`` steps and after the last."""

    def __init__(
        self,
        budget_s,
        step_cost,
        *,
        eval_s=0.5,
        eval_every=100,
        decay_fraction=0.3,
        max_steps=NO_STEP_LIMIT,
        compile_s=None,
    ):
        self.clock, self.step_cost, self.eval_s, self.eval_every = 0.0, step_cost, eval_s, eval_every
        self.compile_s = compile_s
        self.lines, self.rates = [], {}
        optim = SimpleNamespace(lr=PEAK, min_lr=0.0, warmup=None, decay_fraction=decay_fraction)
        self.budget = TimeBudget(
            budget_s,
            optim,
            eval_every=eval_every,
            max_steps=max_steps,
            measure=self.measure,
            log=self.lines.append,
            clock=lambda: self.clock,
            compiling=compile_s is not None,
        )

    def measure(self):
        """As the real measurement: a step's passes and an evaluation, each run twice; the step
        without the optimizer's update, so a little cheaper than a real one."""
        cost = self.step_cost(self.clock)
        self.clock += 2 * (0.8 * cost + self.eval_s) + (self.compile_s or 0.0)  # --compile: in the first pass
        return 0.8 * cost, self.eval_s

    def train(self, from_step=0, stop_after=None) -> int:
        """Steps until the budget ends the run (or until ``stop_after``); returns the last step."""
        self.budget.start(from_step)
        step = from_step
        while True:
            step += 1
            self.rates[step] = self.budget.learning_rate(step)
            self.clock += self.step_cost(self.clock)
            last = self.budget.ends_at(step)
            if step % self.eval_every == 0 or last:
                self.clock += self.eval_s
            if last or step == stop_after:
                return step


def decay_is_smooth(rates: dict, warmup: int) -> bool:
    """After the warmup the rate never rises, and never falls by more than a few steps' share of the peak at once."""
    after = [rates[s] for s in sorted(rates) if s > warmup]
    return all(b <= a + 1e-15 and a - b <= 0.05 * PEAK for a, b in zip(after, after[1:]))


def test_durations_read_as_people_write_them():
    assert [parse_duration(t) for t in ("60", "90s", "5m", "2.5min", "1h", " 45 S ", "off")] == [
        60.0,
        90.0,
        300.0,
        150.0,
        3600.0,
        45.0,
        None,
    ]
    for bad in ("5 parsecs", "-5", "", "1e3", "m", "5m30"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_a_budget_ends_training_and_its_final_evaluation_inside_it_on_a_simulated_clock():
    run = SimulatedRun(60, lambda t: 0.1)
    last = run.train()
    plan = run.budget.plan
    assert run.clock <= 60, "training and its final evaluation end inside the budget"
    assert run.clock > 60 - 0.1 - 0.5 - 0.2, "and use it: at most the step kept in hand and one more are left"
    assert plan.ended and plan.last_step == last
    planned = int(run.lines[0].split("~")[1].split()[0])  # "time budget 60 s: ~685 steps at ..."
    assert plan.warmup == min(200, planned // 10) and run.rates[1] == PEAK / plan.warmup
    decay_line = next(line for line in run.lines if line.startswith("time budget: decay from step"))
    started = int(decay_line.split("decay from step ")[1].split()[0]) - 1
    assert 0.25 <= (last - started) / last <= 0.35, "the decay is --decay-fraction of the steps"
    assert run.rates[last] < 0.01 * PEAK, "the last step trains at the foot of the decay"
    assert decay_is_smooth(run.rates, plan.warmup)
    assert run.lines[0].startswith("time budget 60 s: ~")


def test_a_compile_is_paid_out_of_the_budget_and_the_plan_says_so():
    """``--compile`` compiles in the measurement's first pass, after the clock started: the steps
    planned are those that fit in what the compile left, and the run still ends inside."""
    eager, compiled = SimulatedRun(60, lambda t: 0.1), SimulatedRun(60, lambda t: 0.1, compile_s=20.0)
    eager.train(), compiled.train()
    planned = [int(run.lines[0].split("~")[1].split()[0]) for run in (eager, compiled)]
    assert compiled.clock <= 60 and planned[1] < planned[0] - 190, planned  # 20 s: ~250 steps of 0.08 s fewer
    assert compiled.lines[0].endswith("an evaluation; 21.2 s measuring them, the compile included)"), compiled.lines[0]
    assert eager.lines[0].endswith("an evaluation)")


def test_one_slow_early_step_does_not_end_the_run():
    """A process's second step may take seconds that are not a step's cost (found on a --compile
    run: a thread trial compiled its other thread count, ~9 s). Taken alone as the step's price it
    left room for one more step, and the run ended at step 3 with an untrained model."""
    run = SimulatedRun(60, lambda t: 0.1, compile_s=26.0)  # as that run: 26 s of its 60 compiling
    calls = []

    def step_cost(t):
        calls.append(t)
        return 9.0 if len(calls) == 3 else 0.1  # the measurement's call, step 1, then step 2

    run.step_cost = step_cost
    last = run.train()
    assert run.rates[3] > 0  # step 2 was trained, and the run went on
    assert run.clock <= 60 and last > 150, (last, run.lines)


@pytest.mark.parametrize("slows_at", [30.0, 50.0], ids=["before-the-decay", "during-the-decay"])
def test_a_machine_that_slows_down_still_ends_on_time_with_a_decayed_model(slows_at):
    run = SimulatedRun(60, lambda t: 0.1 if t < slows_at else 0.25)
    last = run.train()
    assert run.clock <= 60
    assert run.rates[last] < 0.05 * PEAK, "the decay still reaches its foot"
    assert decay_is_smooth(run.rates, run.budget.plan.warmup), "the line is drawn again from where the rate is"
    assert any("~0.25 s" in line for line in run.lines[1:]), "the log says when the plan changed, and why"
    fixed = SimulatedRun(60, lambda t: 0.1)
    assert last < fixed.train(), "fewer steps fit"


def test_a_machine_that_speeds_up_uses_the_time_it_gains():
    run = SimulatedRun(60, lambda t: 0.2 if t < 52 else 0.1)
    run.train()
    assert 60 - 0.1 - 0.5 - 0.3 < run.clock <= 60
    assert decay_is_smooth(run.rates, run.budget.plan.warmup)


def test_a_continued_run_keeps_the_budget_it_had_left():
    whole = SimulatedRun(60, lambda t: 0.1)
    last = whole.train()

    first = SimulatedRun(60, lambda t: 0.1)
    stopped_at = first.train(stop_after=200)
    first.clock += first.eval_s  # the checkpoint's save at the stop
    state = json.loads(json.dumps(first.budget.state_dict()))  # what the checkpoint holds
    assert round(state["spent_s"], 9) == round(first.clock, 9)

    second = SimulatedRun(60, lambda t: 0.1)
    second.clock = 1000.0  # another process, another clock
    second.budget.load_state_dict(state)
    second.measure = None  # a continued run plans from what it measured before
    resumed_last = second.train(from_step=stopped_at)
    assert second.clock - 1000.0 <= 60 - state["spent_s"], "the rest of the run fits in what was left"
    assert last - 6 <= resumed_last <= last + 6, "about the steps of the run never stopped (the save cost some)"
    assert "left at step 200" in second.lines[0]


def test_a_rollback_keeps_the_live_plan_and_its_clock():
    run = SimulatedRun(60, lambda t: 0.1)
    run.train(stop_after=100)
    early = run.budget.state_dict()
    run.clock += 5
    run.budget.load_state_dict({**early, "spent_s": 0.0, "warmup": 1})  # the checkpointer restores every component
    assert run.budget.plan.warmup != 1 and round(run.budget.left(), 9) == round(60 - run.clock, 9)


def test_steps_cap_the_plan_and_the_decay_then_ends_on_them():
    run = SimulatedRun(600, lambda t: 0.1, max_steps=300)
    last = run.train()
    assert last == 300 and run.budget.plan.decay_from == 300 - 90
    assert run.rates[300] < 0.02 * PEAK


def test_the_rate_is_a_function_of_the_step_and_the_plan():
    o = SimpleNamespace(lr=1.0, min_lr=0.1)
    plan = BudgetPlan(60, warmup=4, decay_from=10, decay_share=0.5, last_step=20)
    assert [budget_learning_rate(s, o, plan) for s in (1, 4, 5, 10)] == [0.25, 1.0, 1.0, 1.0]
    assert round(budget_learning_rate(11, o, plan), 12) == round(0.1 + 0.9 * 0.5, 12)
    assert budget_learning_rate(21, o, plan) == 0.1
    assert budget_learning_rate(12, o, BudgetPlan(60, warmup=4)) == 1.0, "no decay until the clock starts it"


# ---------------------------------------------------------------- a real run


def test_a_budgeted_run_ends_inside_its_budget_and_a_rerun_has_nothing_to_do(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--data", "data/toy.txt", "--out-dir", out, *TINY_TRAIN, "--time-budget", "2s"]
    args += ["--threads", "1", "--sample-tokens", "0", "--progress", "lines", "--eval-windows", "32"]
    r = run_main(*args)
    assert r.returncode == 0, r.stderr
    assert "time budget 2 s: ~" in r.stdout and "time budget: decay from step" in r.stdout
    assert "a time-budgeted run is judged by no band" in r.stdout
    final = json.loads((out / "final.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert final["time_budget_s"] == 2.0 and final["step"] == rows[-1]["step"] and "val_loss" in rows[-1]
    assert rows[0]["time_budget_s"] == 2.0 and rows[0]["warmup_steps"] >= 1
    used = float(r.stdout.split("time budget: ")[-1].split(" s of 2 s used")[0])
    assert rows[-1]["elapsed_s"] < used, "the budget's clock counts the measurement and the final evaluation too"
    # (that it ends inside the budget is the simulated clock's to show: here the machine's load decides)
    assert rows[-1]["lr"] < rows[0]["peak_lr"], "decaying at the end (how far: the simulated clock's tests)"
    from nanolm.checkpoint import load_state

    saved = load_state(sorted((out / "checkpoints").iterdir())[-1])["budget"]  # the last step's checkpoint
    assert saved["ended"] and saved["budget_s"] == 2.0 and 0 < saved["spent_s"] <= used and saved["warmup"] >= 1
    again = run_main(*args)
    assert again.returncode == 0 and "where its time budget of 2 s ended; nothing to do" in again.stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--time-budget", "0"], "--time-budget must be a positive duration"),
        (["--time-budget", "-5"], "invalid duration"),
        (["--time-budget", "5 parsecs"], "invalid duration"),
        (["--time-budget", "60", "--schedule", "cosine"], "--time-budget plans a warmup-stable-decay schedule"),
        (["--time-budget", "0.001"], "is too short for one step and one evaluation"),
    ],
)
def test_a_bad_time_budget_is_one_line(tmp_path, flags, message):
    out = tmp_path / "run"
    r = run_main("train", "--data", "data/toy.txt", "--out-dir", out, *TINY_TRAIN, "--threads", "1", *flags)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and message in err[-1] and "Traceback" not in r.stderr, r.stderr
    assert not list(out.glob("checkpoints/*")), "nothing trained, nothing saved"


@pytest.mark.parametrize(
    "field, value",
    [
        ("spent_s", "12"),
        ("spent_s", float("nan")),
        ("warmup", True),
        ("decay_share", 2.0),
        ("last_step", -1),
        ("ended", 1),
    ],
)
def test_a_checkpoints_plan_out_of_its_types_is_refused_before_a_step_reads_it(field, value):
    """A crafted or damaged state.pt: the checkpointer turns the ValueError into one line naming the
    budget state malformed; without the check a string would first fail as a TypeError mid-run."""
    good = json.loads(json.dumps(TimeBudget(60).state_dict()))
    fresh = TimeBudget(60, SimpleNamespace(lr=PEAK, min_lr=0.0))
    fresh.load_state_dict(good)  # the state as written loads
    with pytest.raises(ValueError, match="time budget's plan"):
        TimeBudget(60).load_state_dict({**good, field: value})
