"""Guards: the spike detector, and what --on-nan / --on-spike do to a real run.

A guard earns its keep only if (1) it notices the bad step, (2) the bad batch is then not
trained on, (3) the run ends where a clean run would, and (4) the event is written down
with its evidence. The runs here are real (tiny) trainings with a fault injected by the
hidden ``--debug-inject-nan-at`` / ``--debug-inject-spike-at`` switches.
"""

import contextlib
import math
import random

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_run_config
from safetensors.torch import load_file

from nanolm.batches import Batch, WindowSampler
from nanolm.checkpoint import list_checkpoints, load_state, read_latest
from nanolm.data.shards import PreparedData
from nanolm.errors import NanolmError
from nanolm.instruments.faults import components
from nanolm.train import train
from nanolm.watch.guards import Guard, SpikeDetector, nan_origin, read_events
from nanolm.watch.sinks import read_metrics

STEPS, CKPT_EVERY, BATCH = 30, 10, 4
FAULT_AT = 25  # the last checkpoint before it is step 20


# --------------------------------------------------------------------------- the detector
def test_spike_detector_waits_for_enough_history_before_judging():
    d = SpikeDetector(window=50, threshold=6.0, min_history=20)
    for i in range(19):
        d.add(1.0 + 0.01 * (i % 3))
    assert d.zscore(1e6) is None and d.is_spike(1e6) == (False, None)
    d.add(1.0)
    assert d.is_spike(1e6)[0]


def test_spike_detector_flags_a_far_outlier_but_never_the_noise_it_was_fed():
    rng = random.Random(0)
    d = SpikeDetector(window=50, threshold=6.0)
    for _ in range(50):
        d.add(2.0 + rng.gauss(0, 0.05))
    assert not any(d.is_spike(2.0 + rng.gauss(0, 0.05))[0] for _ in range(500))
    spike, z = d.is_spike(2.5)  # ten standard deviations
    assert spike and z > 6
    assert not d.is_spike(0.5)[0]  # one-sided: a sudden improvement is not a spike


def test_spike_detector_is_not_blinded_by_the_spikes_in_its_own_history():
    rng = random.Random(1)
    d = SpikeDetector(window=50, threshold=6.0)
    for i in range(50):
        d.add(50.0 if i % 10 == 0 else 1.0 + rng.gauss(0, 0.02))  # five huge values among fifty
    assert d.is_spike(2.0)[0]  # a mean and a standard deviation would be dragged up and miss it


def test_spike_detector_on_log_scale_judges_ratios_not_differences():
    rng = random.Random(2)
    small, large = SpikeDetector(log_scale=True), SpikeDetector(log_scale=True)
    for _ in range(50):
        noise = math.exp(rng.gauss(0, 0.05))
        small.add(0.01 * noise)
        large.add(100.0 * noise)
    assert small.is_spike(0.05)[0] and large.is_spike(500.0)[0]  # 5x is a spike at any scale
    assert not small.is_spike(0.011)[0] and not large.is_spike(110.0)[0]


def test_spike_detector_on_log_scale_measures_deviations_in_factors():
    """Gradient norms wander by factors: 10x a history that varies by ~1.6x is unusual, not
    extraordinary (4.6 robust deviations of the log); 100x is. On a linear scale 10x would
    already be eighteen deviations."""
    rng = random.Random(3)
    d = SpikeDetector(window=200, threshold=6.0, log_scale=True)
    for _ in range(200):
        d.add(math.exp(rng.gauss(0, 0.5)))
    assert not d.is_spike(10.0)[0] and d.is_spike(100.0)[0]


def test_spike_detector_flat_history_has_a_floor_and_skips_non_finite_values():
    d = SpikeDetector()
    for _ in range(30):
        d.add(1.0)
    d.add(float("nan"))
    d.add(float("inf"))
    assert len(d.values) == 30
    assert not d.is_spike(1.0001)[0]  # a flat history is not infinitely sure of itself
    assert d.is_spike(1.1)[0]


def test_guard_decides_per_step_and_keeps_warned_spikes_in_its_history(tmp_path):
    g = Guard(out_dir=tmp_path, on_nan="skip", on_spike="warn", window=30, threshold=6.0, log=lambda *_: None)
    for step in range(1, 26):
        assert g.check(step, 2.0 + 0.01 * (step % 3), 1.0 + 0.01 * (step % 2), 1e-3) == ("take", None)
    action, event = g.check(26, float("nan"), 1.0, 1e-3)
    assert action == "skip" and event["kind"] == "nan" and event["loss"] == "nan"
    assert [r["step"] for r in event["recent"]][-3:] == [23, 24, 25]  # the evidence: what came before
    action, event = g.check(27, 2.0, 50.0, 1e-3)
    assert action == "take" and event["kind"] == "spike" and event["on"] == ["grad_norm"] and event["z_grad_norm"] > 6
    assert len(g.grad.values) == 26  # warned: it happened, so it is part of the history


# --------------------------------------------------------------------------- real runs
def _run(stories_file, out, **debug_and_guard):
    cfg = tiny_run_config(stories_file, out, steps=STEPS, eval_every=STEPS, ckpt_every=CKPT_EVERY, batch_size=BATCH,
                          log_every=5, stats_every=0)
    for key, value in debug_and_guard.items():
        section = "debug" if key.startswith("inject") else "guard"
        setattr(getattr(cfg, section), key, value)
    lines = []
    try:
        result = train(cfg, log=lines.append, components=components(cfg))
    except NanolmError as e:
        result = {"error": str(e)}
    return result, lines


def _windows_drawn(run_dir) -> int:
    """Windows the sampler handed out over the whole run, read from its last checkpoint."""
    state = load_state(read_latest(run_dir))
    data = PreparedData(run_dir / "data")
    n_windows = WindowSampler(len(data.train), 32, BATCH).n_windows
    return state["sampler"]["epoch"] * n_windows + state["sampler"]["cursor"]


def _adam_steps(run_dir) -> int:
    state = load_state(read_latest(run_dir))["optimizer"]["state"]
    return int(next(iter(state.values()))["step"])


def _final_val(run_dir) -> float:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r][-1]["val_loss"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, stories_file):
    out = tmp_path_factory.mktemp("clean") / "run"
    _run(stories_file, out)
    return out


def test_nan_rollback_skips_the_bad_batch_and_ends_where_a_clean_run_ends(tmp_path, stories_file, clean_run):
    out = tmp_path / "run"
    result, lines = _run(stories_file, out, inject_nan_at=FAULT_AT, on_nan="rollback")
    assert "error" not in result
    [event] = read_events(out)
    assert event["kind"] == "nan" and event["step"] == FAULT_AT and event["action"] == "rollback"
    assert event["to_step"] == 20 and event["grad_norm"] == "nan" and "origin" in event
    assert [r["step"] for r in event["recent"]] == list(range(1, FAULT_AT))  # its evidence: every step before
    assert all({"loss", "grad_norm", "lr"} <= r.keys() for r in event["recent"])
    assert any("guard: non-finite" in line and "rollback" in line for line in lines)
    # steps 21..25 were trained, discarded, and their batches are not drawn again: the
    # sampler is 5 batches ahead of the clean run, and the optimizer counted 40 steps
    assert _windows_drawn(out) - _windows_drawn(clean_run) == (FAULT_AT - 20) * BATCH
    assert _adam_steps(out) == _adam_steps(clean_run) == STEPS
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # the discarded trajectory left no rows
    assert _final_val(out) == pytest.approx(_final_val(clean_run), rel=0.03)


def test_nan_skip_drops_that_one_update(tmp_path, stories_file, clean_run):
    out = tmp_path / "run"
    result, _ = _run(stories_file, out, inject_nan_at=FAULT_AT, on_nan="skip")
    assert "error" not in result
    [event] = read_events(out)
    assert (event["kind"], event["step"], event["action"]) == ("nan", FAULT_AT, "skip")
    assert _adam_steps(out) == STEPS - 1  # the optimizer never saw the bad gradient
    assert _windows_drawn(out) == _windows_drawn(clean_run)  # and nothing was replayed
    assert _final_val(out) == pytest.approx(_final_val(clean_run), rel=0.03)


def test_nan_stop_stops_with_the_step_and_leaves_only_finite_checkpoints(tmp_path, stories_file):
    out = tmp_path / "run"
    result, _ = _run(stories_file, out, inject_nan_at=FAULT_AT, on_nan="stop")
    assert f"stopped at step {FAULT_AT}" in result["error"] and "nanolm diagnose" in result["error"]
    [event] = read_events(out)
    assert (event["kind"], event["action"]) == ("nan", "stop")
    assert [s for s, _ in list_checkpoints(out)] == [10, 20]
    assert not (out / "model.safetensors").exists()


def test_nothing_non_finite_is_checkpointed_even_with_the_guard_off(tmp_path, stories_file):
    """With the guard off a NaN gradient reaches the weights; the checkpoint of that step is refused."""
    out = tmp_path / "run"
    result, _ = _run(stories_file, out, inject_nan_at=20, on_nan="stop", on_spike="off")
    assert "error" in result and ("refusing to checkpoint" in result["error"] or "loss became nan" in result["error"])
    assert [s for s, _ in list_checkpoints(out)] == [10]
    for _, path in list_checkpoints(out):
        weights = load_file(str(path / "model.safetensors"))
        assert all(torch.isfinite(w).all() for w in weights.values())
        state = load_state(path)["optimizer"]["state"]
        assert all(torch.isfinite(v).all() for s in state.values() for v in s.values() if torch.is_tensor(v))


@pytest.mark.parametrize("action", ["skip", "rollback"])
def test_an_injected_spike_is_caught_and_not_trained_on(tmp_path, stories_file, clean_run, action):
    out = tmp_path / "run"
    result, _ = _run(stories_file, out, inject_spike_at=FAULT_AT, on_spike=action, spike_window=20)
    assert "error" not in result
    spikes = [e for e in read_events(out) if e["kind"] == "spike"]
    assert [(e["step"], e["action"]) for e in spikes] == [(FAULT_AT, action)]
    assert set(spikes[0]["on"]) == {"loss", "grad_norm"} and spikes[0]["z_loss"] > 6
    if action == "skip":
        assert _adam_steps(out) == STEPS - 1 and _windows_drawn(out) == _windows_drawn(clean_run)
    else:
        assert spikes[0]["to_step"] == 20 and _adam_steps(out) == STEPS
        assert _windows_drawn(out) - _windows_drawn(clean_run) == (FAULT_AT - 20) * BATCH
    assert _final_val(out) == pytest.approx(_final_val(clean_run), rel=0.03)


def test_a_warned_spike_is_recorded_and_taken(tmp_path, stories_file):
    out = tmp_path / "run"
    _run(stories_file, out, inject_spike_at=FAULT_AT, on_spike="warn", spike_window=20)
    [event] = [e for e in read_events(out) if e["kind"] == "spike" and e["step"] == FAULT_AT]
    assert event["action"] == "warn" and _adam_steps(out) == STEPS
    row = next(r for r in read_metrics(out / "metrics.jsonl") if r["step"] == FAULT_AT)
    assert row["loss"] > 50  # the logged loss shows the spike the guard let through


# --------------------------------------------------------------------------- NaN origin
def _batch(ids):
    idx = torch.tensor(ids)
    return Batch(idx, torch.roll(idx, -1, dims=1), torch.ones_like(idx, dtype=torch.bool))


def test_nan_origin_names_the_module_whose_output_first_went_non_finite():
    model = tiny_model()
    with torch.no_grad():
        model.blocks[1].mlp.down.weight[0, 0] = float("inf")
    report = nan_origin(model, _batch([[1, 2, 3, 4] * 8]), contextlib.nullcontext, vocab_size=64)
    assert report["origin"] == "the output of blocks.1.mlp.down"
    assert "bad_ids" not in report


def test_nan_origin_reports_token_ids_outside_the_vocabulary():
    model = tiny_model()
    ids = np.arange(32).reshape(1, 32) % 64
    ids[0, [3, 17]] = [64, 1000]
    report = nan_origin(model, _batch(ids.tolist()), contextlib.nullcontext, vocab_size=64)
    assert report["bad_ids"] == 2
    assert report["origin"].startswith("none on a re-run")  # the forward pass itself is fine once clamped


def test_nan_origin_names_the_parameter_nearest_the_output_when_only_the_backward_pass_goes_non_finite():
    """A NaN born in the backward pass at block 1's MLP input spreads to every parameter
    upstream; the one to name is where it entered, the last in forward order."""
    model = tiny_model()
    handle = model.blocks[1].mlp.register_full_backward_hook(
        lambda module, grad_in, grad_out: tuple(None if g is None else g * float("nan") for g in grad_in))
    try:
        report = nan_origin(model, _batch([[5, 6, 7, 8] * 8]), contextlib.nullcontext, vocab_size=64)
    finally:
        handle.remove()
    assert report["origin"] == "the gradient of blocks.1.mlp_norm.weight"


def test_a_rollback_does_not_replay_the_batches_since_its_checkpoint(tmp_path, stories_file, monkeypatch):
    """The fast check of the rollback's data position: no window is drawn twice in an epoch."""
    drawn = []
    real = WindowSampler.next_starts

    def record(self):
        starts = real(self)
        drawn.append((self.epoch, *map(int, starts)))
        return starts

    monkeypatch.setattr(WindowSampler, "next_starts", record)
    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=8, eval_every=8, ckpt_every=4, batch_size=BATCH,
                          log_every=1, stats_every=0)
    cfg.debug.inject_nan_at = 6
    train(cfg, log=lambda *_: None, components=components(cfg))
    [event] = read_events(tmp_path / "run")
    assert (event["action"], event["to_step"]) == ("rollback", 4)
    assert len(drawn) == 8 + 2  # steps 5 and 6 were drawn, discarded, and not drawn again
    windows = [(epoch, start) for epoch, *starts in drawn for start in starts]
    assert len(windows) == len(set(windows))


def test_after_a_rollback_the_learning_rate_is_the_schedules_times_the_guards_scale(tmp_path, stories_file):
    """``--rollback-lr-scale 0.5``: the steps after a rollback run at half the schedule's rate
    (the step multiplies the schedule's rate by the guard's scale where it sets it), the steps
    before it at the schedule's own."""
    from nanolm.step import learning_rate

    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=8, eval_every=8, ckpt_every=4, batch_size=BATCH,
                          log_every=1, stats_every=0)
    cfg.debug.inject_nan_at, cfg.guard.rollback_lr_scale = 6, 0.5
    train(cfg, log=lambda *_: None, components=components(cfg))
    [event] = read_events(tmp_path / "run")
    assert (event["action"], event["to_step"], event["lr_scale"]) == ("rollback", 4, 0.5)
    optim = cfg.resolved().optim
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "lr" in r}
    assert sorted(lrs) == list(range(1, 9))
    assert all(lrs[s] == learning_rate(s, optim, 8) for s in range(1, 5))
    assert all(lrs[s] == learning_rate(s, optim, 8) * 0.5 for s in range(5, 9))


def test_a_run_cannot_roll_back_more_than_max_rollbacks_whatever_restores_it(tmp_path, stories_file, monkeypatch):
    """A fault that comes back at the same step after every rollback, and restores that bring
    the checkpoint's count of rollbacks back (a bug): the count is the guard's own, so the run
    stops after --max-rollbacks instead of looping forever."""
    import nanolm.checkpoint as checkpoint_mod

    real_load, real_check = checkpoint_mod.load_state, Guard.check

    def amnesic(path):
        state = real_load(path)
        state["guard"]["rollbacks"] = 0
        return state

    def always_bad_at_fault(self, step, loss, grad_norm, lr):
        return real_check(self, step, math.nan if step == FAULT_AT else loss, grad_norm, lr)

    monkeypatch.setattr(checkpoint_mod, "load_state", amnesic)
    monkeypatch.setattr(Guard, "check", always_bad_at_fault)
    result, _ = _run(stories_file, tmp_path / "run", on_nan="rollback", max_rollbacks=2)
    assert f"stopped at step {FAULT_AT}" in result["error"]
    events = [e for e in read_events(tmp_path / "run") if e["kind"] == "nan"]
    assert [e["action"] for e in events] == ["rollback", "rollback", "stop"]
    assert "already rolled back 2 times" in events[-1]["note"]
