"""--threads auto: trials leave no trace, a switch needs a clear gain, and a changed machine is measured again."""

import os
from functools import partial

import pytest
import torch
from conftest import tiny_model

from nanolm.batches import Batch
from nanolm.machine.threads import FIRST_WAIT_S, ThreadTuner, candidate_counts
from nanolm.optim import build_optimizer
from nanolm.step import StepSetup, discarded_pass, train_step


@pytest.fixture(autouse=True)
def keep_thread_count():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 64, (4, 32), generator=g)
    return Batch(idx, torch.roll(idx, -1, 1), torch.ones(4, 32, dtype=torch.bool))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _tuner(times_by_count, load=lambda: 0.0, cores=2):
    """A tuner whose forward/backward pass takes ``times_by_count[threads]`` seconds."""
    clock = FakeClock()
    lines = []
    tuner = ThreadTuner(lambda batch: None, lines.append, cores=cores, clock=clock, load=load)
    tuner._time_pass = lambda batch: times_by_count[torch.get_num_threads()]
    return tuner, clock, lines


def test_candidate_counts_are_all_cores_half_and_one():
    assert candidate_counts(2) == [2, 1]
    assert candidate_counts(16) == [16, 8, 1]
    assert candidate_counts(1) == [1]


def test_a_trial_leaves_weights_gradients_and_random_state_as_they_were():
    model = tiny_model(dropout=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    tuner = ThreadTuner(partial(discarded_pass, model), cores=2, load=lambda: 0.0)
    tuner.trial(_batch())
    assert torch.equal(torch.get_rng_state(), rng)  # the next step draws the dropout masks it would have drawn
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert set(tuner.trials[0]["ms"]) == {2, 1}


def test_the_tuner_switches_only_for_a_clear_gain():
    torch.set_num_threads(2)
    busy, _, lines = _tuner({2: 0.30, 1: 0.10})  # a neighbour holds a core: 2 threads wait on it
    assert busy.trial(_batch()) == 1 and torch.get_num_threads() == 1
    assert lines == ["threads: 2 -> 1 (a forward and backward pass at 2: 300 ms, 1: 100 ms; --threads N fixes it)"]
    torch.set_num_threads(2)
    idle, _, lines = _tuner({2: 0.100, 1: 0.095})  # 5 % is noise, not a reason to change the run's arithmetic
    assert idle.trial(_batch()) == 2 and torch.get_num_threads() == 2 and lines == []


def test_it_measures_again_when_the_steps_slow_down_the_load_moves_or_the_wait_is_over():
    torch.set_num_threads(2)
    load = [0.0]
    tuner, clock, _ = _tuner({2: 0.1, 1: 0.19}, load=lambda: load[0])
    trials = lambda: len(tuner.trials)  # noqa: E731

    def steps(n, seconds):
        for _ in range(n):
            tuner.before_step([_batch()])
            clock.now += seconds

    steps(1, 0.1)
    assert trials() == 0  # the first step allocates: not representative
    steps(1, 0.1)
    assert trials() == 1  # the second step measures
    steps(20, 0.1)
    assert trials() == 1  # a steady machine is left alone
    steps(6, 0.2)
    assert trials() == 2  # steps twice as slow: measure again
    steps(10, 0.2)
    assert trials() == 2
    load[0] = 1.5
    steps(1, 0.2)
    assert trials() == 3  # the load average moved by more than a core
    assert tuner.wait_s == 2 * FIRST_WAIT_S  # each trial that confirms the choice doubles the wait
    steps(int(tuner.wait_s / 0.2) + 1, 0.2)
    assert trials() == 4 and tuner.wait_s == 4 * FIRST_WAIT_S  # the wait is over: measured again


def test_a_fixed_tuner_never_measures():
    tuner = ThreadTuner.fixed()
    for _ in range(5):
        tuner.before_step([_batch()])
    assert tuner.trials == []


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 CPU threads")
def test_environment_a_step_gives_the_same_bits_at_one_and_two_threads():
    """An environment check, not an invariant: PyTorch promises no bits across thread counts. Where
    this CPU's kernels give them (the development CPUs so far: forward, backward, clip, fused
    AdamW), --threads auto switching mid-run leaves the run's numbers as they were; where they
    do not, a switch changes the last bits, and this says so instead of failing."""
    weights = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        model = tiny_model(n_embd=128, n_head=4, seq_len=128, vocab_size=512)
        setup = StepSetup(model, build_optimizer(model, 1e-2, 0.1), schedule=lambda step: 1e-2)
        for step in range(1, 4):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 512, (8, 128), generator=g)
            train_step(setup, step, [Batch(idx, torch.roll(idx, -1, 1), torch.ones(8, 128, dtype=torch.bool))])
        weights[threads] = torch.cat([p.detach().flatten() for p in model.parameters()])
    if not torch.equal(weights[1], weights[2]):
        pytest.skip(
            "environment: this CPU's kernels give other bits at 1 and 2 threads, so a --threads auto "
            "switch changes a run's last bits here (docs/checkpoints.md)"
        )


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: there is no other thread count to switch to")
def test_deterministic_runs_keep_their_numbers_and_thread_count_on_a_busy_machine(tmp_path, stories_file, monkeypatch):
    """``--deterministic`` promises the same numbers on a busy machine as on an idle one; the
    tuner of ``--threads auto`` chooses a count from what the machine does now, and PyTorch
    does not promise the same bits at every count. A busy machine is simulated as the tuner
    sees it (a pass at one thread clearly faster); the same run without --deterministic
    switches there, so the simulation is one the tuner acts on."""
    import json

    from conftest import tiny_run_config

    from nanolm.machine import threads as threads_module
    from nanolm.train import train

    def losses(out):
        return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    def run(name, deterministic):
        # the process starts at every core, as where OMP_NUM_THREADS is unset: with OMP_NUM_THREADS=1 (clusters,
        # the mutation runs) the simulated busy machine would ask the tuner for the count it already has
        lines, started_with = [], torch.get_num_threads()
        torch.set_num_threads(os.cpu_count())
        try:
            train(
                tiny_run_config(stories_file, tmp_path / name, steps=4, eval_every=4, deterministic=deterministic),
                log=lines.append,
            )
        finally:
            torch.set_num_threads(started_with)
        return [line for line in lines if line.startswith("threads: ")], losses(tmp_path / name)

    switched_idle, idle = run("idle", True)
    busy_pass = lambda self, batch: 0.01 if torch.get_num_threads() == 1 else 0.05  # noqa: E731
    monkeypatch.setattr(threads_module.ThreadTuner, "_time_pass", busy_pass)
    switched, busy = run("busy", True)
    assert switched == switched_idle == [] and busy == idle
    switched_free, _ = run("free", False)
    assert switched_free and "-> 1" in switched_free[0], switched_free  # the simulated machine is one that switches


def test_a_compiled_run_keeps_its_thread_count_on_a_busy_machine(tmp_path, stories_file, monkeypatch):
    """``--compile`` specialises its code to the thread count it ran at: a trial of another count
    compiles the blocks again (measured on a 60 s budget: 9 s of it at the second step, and the
    plan then ended the run at step 3). So a compiled run keeps its count, and says so; the
    simulated busy machine is the one the test above shows the tuner switching on."""
    from conftest import tiny_run_config

    import nanolm.train as train_module
    from nanolm.machine import threads as threads_module
    from nanolm.model import compile_blocks

    monkeypatch.setattr(train_module, "compile_blocks", lambda model: compile_blocks(model, backend="eager"))
    monkeypatch.setattr(
        threads_module.ThreadTuner, "_time_pass", lambda self, batch: 0.01 if torch.get_num_threads() == 1 else 0.05
    )
    lines, started_with = [], torch.get_num_threads()
    torch.set_num_threads(os.cpu_count())
    try:
        cfg = tiny_run_config(stories_file, tmp_path / "run", steps=3, eval_every=3)
        cfg.train.compile = True
        train_module.train(cfg, log=lines.append)
    finally:
        torch.set_num_threads(started_with)
        torch._dynamo.reset()
    said = [line for line in lines if line.startswith("threads: ")]
    assert said == [f"threads: {os.cpu_count()}, kept (--compile: each thread count tried would be compiled again)"]
