"""Guards: the spike detector, and what --on-nan / --on-spike do to a real run.

A guard earns its keep only if (1) it notices the bad step, (2) the bad batch is then not
trained on, (3) the run ends where a clean run would, and (4) the event is written down
with its evidence. The runs here are real (tiny) trainings with a fault injected by the
hidden ``--debug-inject-nan-at`` / ``--debug-inject-spike-at`` switches.
"""

import contextlib
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_run_config
from safetensors.torch import load_file

from nanolm.batches import Batch, WindowSampler
from nanolm.checkpoint import list_checkpoints, load_state, read_latest
from nanolm.data.shards import PreparedData
from nanolm.errors import NanolmError
from nanolm.instruments.faults import factories
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


@pytest.mark.parametrize("on_spike", ["skip", "rollback"])
def test_a_spike_the_guard_acted_on_stays_out_of_the_history_it_judges_spikes_by(tmp_path, on_spike):
    """A skipped or rolled-back spike never happened to the model: were it added to the
    detector's history, a stretch of bad batches would fill the window until the median
    itself sat at the spikes, and the rest of the stretch would be trained on unseen."""
    g = Guard(out_dir=tmp_path, on_nan="skip", on_spike=on_spike, window=30, threshold=6.0, log=lambda *_: None)
    for step in range(1, 26):
        assert g.check(step, 2.0 + 0.01 * (step % 3), 1.0 + 0.01 * (step % 2), 1e-3) == ("take", None)
    for step in range(26, 56):  # thirty bad batches in a row: more than the window holds
        action, event = g.check(step, 10.0, 50.0, 1e-3)
        assert (action, event["on"]) == (on_spike, ["loss", "grad_norm"]), step
    assert len(g.loss.values) == len(g.grad.values) == 25 and max(g.loss.values) < 3


# --------------------------------------------------------------------------- real runs
def _run(stories_file, out, **debug_and_guard):
    cfg = tiny_run_config(
        stories_file,
        out,
        steps=STEPS,
        eval_every=STEPS,
        ckpt_every=CKPT_EVERY,
        batch_size=BATCH,
        log_every=5,
        stats_every=0,
    )
    for key, value in debug_and_guard.items():
        section = "debug" if key.startswith("inject") else "guard"
        setattr(getattr(cfg, section), key, value)
    lines = []
    try:
        result = train(cfg, log=lines.append, factories=factories(cfg))
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


@pytest.mark.kernels
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


@pytest.mark.kernels
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


@pytest.mark.kernels
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
        lambda module, grad_in, grad_out: tuple(None if g is None else g * float("nan") for g in grad_in)
    )
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
    cfg = tiny_run_config(
        stories_file,
        tmp_path / "run",
        steps=8,
        eval_every=8,
        ckpt_every=4,
        batch_size=BATCH,
        log_every=1,
        stats_every=0,
    )
    cfg.debug.inject_nan_at = 6
    train(cfg, log=lambda *_: None, factories=factories(cfg))
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

    cfg = tiny_run_config(
        stories_file,
        tmp_path / "run",
        steps=8,
        eval_every=8,
        ckpt_every=4,
        batch_size=BATCH,
        log_every=1,
        stats_every=0,
    )
    cfg.debug.inject_nan_at, cfg.guard.rollback_lr_scale = 6, 0.5
    train(cfg, log=lambda *_: None, factories=factories(cfg))
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


# --------------------------------------------------------------------------- the edges
@pytest.mark.kernels
def test_a_flat_history_flags_any_rise_and_judges_its_floor_relative_to_the_median():
    """A history of one repeated value has no spread: its scale is a floor of 1e-3 of the
    median (plus a hair, so a history of zeros still has a direction)."""
    zeros = SpikeDetector(window=50, threshold=6.0, min_history=20)
    hundreds = SpikeDetector(window=50, threshold=6.0, min_history=20)
    for _ in range(20):
        zeros.add(0.0), hundreds.add(100.0)
    assert zeros.is_spike(1e-9)[0] and not zeros.is_spike(-1.0)[0]
    assert hundreds.zscore(100.5) == pytest.approx(0.5 / (0.1 + 1e-12))


@pytest.mark.kernels
def test_the_robust_zscore_is_taken_from_the_median_and_the_median_absolute_deviation():
    rng = random.Random(0)
    for _ in range(50):
        d = SpikeDetector(window=50, threshold=6.0, min_history=5)
        values = [rng.uniform(1, 10) for _ in range(rng.randrange(5, 40))]
        for v in values:
            d.add(v)
        history = sorted(values)
        median = history[len(history) // 2]
        mad = sorted(abs(v - median) for v in history)[len(history) // 2]
        assert d.zscore(20.0) == pytest.approx((20.0 - median) / (1.4826 * mad + 1e-3 * median + 1e-12))


def test_a_zscore_exactly_at_the_threshold_is_not_a_spike():
    d = SpikeDetector(threshold=6.0)
    d.zscore = lambda value: 6.0
    assert d.is_spike(1.0) == (False, 6.0)
    d.zscore = lambda value: math.nextafter(6.0, math.inf)
    assert d.is_spike(1.0)[0]


def _guard(tmp_path, **kw):
    lines = []
    guard = Guard(out_dir=tmp_path, log=lines.append, **kw)
    return guard, lines


def test_the_guards_rollback_count_and_learning_rate_scale_survive_a_checkpoint(tmp_path):
    """A resume must not hand a guard fresh rollbacks: --max-rollbacks bounds the run, not each restart."""
    guard, _ = _guard(tmp_path, rollback_lr_scale=0.5)
    guard.rolled_back({"step": 25, "kind": "nan", "loss": "nan", "grad_norm": "nan", "lr": 1e-3}, to_step=20)
    guard.rolled_back({"step": 27, "kind": "nan", "loss": "nan", "grad_norm": "nan", "lr": 1e-3}, to_step=20)
    assert (guard.rollbacks, guard.lr_scale) == (2, 0.25)  # each rollback multiplies the scale
    state = json.loads(json.dumps(guard.state_dict()))  # as the checkpoint's meta stores it
    resumed, _ = _guard(tmp_path)
    resumed.load_state_dict(state)
    assert (resumed.rollbacks, resumed.lr_scale) == (2, 0.25)
    assert isinstance(resumed.rollbacks, int) and isinstance(resumed.lr_scale, float)


def test_a_rollback_with_nowhere_to_go_is_a_skip_and_a_healthy_step_asks_for_no_checkpoint(tmp_path):
    asked = []
    guard, _ = _guard(tmp_path, rollback_to=lambda: asked.append(1))
    assert guard.decide(1, 2.0, 1.0, 3e-4) == ("take", None, None) and not asked
    action, event, checkpoint = guard.decide(2, math.nan, 1.0, 3e-4)
    assert asked and (action, checkpoint) == ("skip", None)
    assert event["note"] == "no checkpoint yet: skipped instead of rolled back" and event["lr"] == 3e-4
    no_source, _ = _guard(tmp_path)  # no rollback_to at all (a replay): the same fallback
    assert no_source.decide(2, math.nan, 1.0, 3e-4)[0] == "skip"


def test_a_spike_with_on_spike_off_is_taken_without_an_event(tmp_path):
    guard, _ = _guard(tmp_path, on_spike="off", window=50, threshold=6.0)
    for step in range(30):
        guard.check(step, 2.0 + 0.01 * (step % 3), 1.0, 1e-3)
    assert guard.check(30, 1e6, 1e6, 1e-3) == ("take", None)
    warned, _ = _guard(tmp_path, on_spike="warn")
    for step in range(30):
        warned.check(step, 2.0 + 0.01 * (step % 3), 1.0, 1e-3)
    action, event = warned.check(30, 1e6, 1e6, 2e-3)
    assert action == "take" and event["on"] == ["loss", "grad_norm"] and event["lr"] == 2e-3


class _Result:
    def __init__(self, step, action, event):
        self.step, self.action, self.event = step, action, event


def test_each_event_is_recorded_in_one_line_naming_what_happened(tmp_path):
    explained = []
    guard, lines = _guard(tmp_path, explain_nan=lambda batch: explained.append(batch) or {"origin": "blocks.0.attn"})
    spike = {"step": 7, "kind": "spike", "on": ["loss", "grad_norm"], "loss": 9.0, "grad_norm": 50.0, "lr": 1e-3}
    guard.settle(_Result(7, "take", dict(spike)), ["batch"])
    assert not explained  # only a non-finite step is re-run to find where it was born
    assert lines[-1] == "guard: loss/grad_norm spike at step 7 (loss 9.0, grad norm 50.0): warn"
    nan = {"step": 8, "kind": "nan", "loss": "nan", "grad_norm": "nan", "lr": 1e-3}
    guard.settle(_Result(8, "skip", dict(nan)), ["batch"])
    assert explained == ["batch"]
    assert lines[-1] == (
        "guard: non-finite loss or gradient at step 8 (loss nan, grad norm nan; first non-finite: blocks.0.attn): skip"
    )
    plain, plain_lines = _guard(tmp_path)
    plain.record(dict(nan), "skip")
    assert plain_lines[-1] == "guard: non-finite loss or gradient at step 8 (loss nan, grad norm nan): skip"


@pytest.mark.parametrize(
    "extra,cause",
    [
        ({"origin": "blocks.1.mlp"}, "blocks.1.mlp"),
        ({"note": "already rolled back 3 times"}, "already rolled back 3 times"),
        ({}, "see events.jsonl"),
    ],
)
def test_a_stop_names_its_step_and_its_cause(tmp_path, extra, cause):
    guard, _ = _guard(tmp_path)
    event = {"step": 9, "kind": "spike", "on": ["loss"], "loss": 9.0, "grad_norm": 1.0, "lr": 1e-3, **extra}
    with pytest.raises(NanolmError) as e:
        guard.settle(_Result(9, "stop", event), ["batch"])
    assert str(e.value) == (f"training stopped at step 9 on a spike event ({cause}); run `nanolm diagnose {tmp_path}`")


def test_noted_events_are_read_back_and_damaged_ones_counted(tmp_path):
    guard, _ = _guard(tmp_path)
    guard.note("resume", 5, from_step=3)
    warnings = []
    assert read_events(tmp_path, warn=warnings.append) == [{"step": 5, "kind": "resume", "from_step": 3}]
    assert warnings == []  # nothing damaged: nothing said
    with open(tmp_path / "events.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 6, "kind": "resume"}\n{"broken\n{"step": 7}\n{"step": 8, "kind": "nan", "loss": "abc"}\n')
    assert [e["step"] for e in read_events(tmp_path, warn=warnings.append)] == [5, 6]
    assert warnings == [f"warning: {tmp_path / 'events.jsonl'}: 3 damaged line(s) left out"]
    assert [e["step"] for e in read_events(tmp_path)] == [5, 6]  # no one to warn: read all the same


@pytest.mark.parametrize(
    "event",
    [
        ["step", "kind"],
        {"step": 1},
        {"kind": "nan"},
        {"step": 1, "kind": "nan", "loss": True},
        {"step": 1, "kind": "nan", "loss": "1.5"},
        {"step": 1, "kind": "nan", "extra": {"a": 1}},
        {"step": 1, "kind": "nan", "extra": [1]},
        {"step": -1, "kind": "nan"},
        {"step": 1, "kind": "nan", "on": "loss"},
    ],
)
def test_an_event_of_the_wrong_shape_is_damage(tmp_path, event):
    (tmp_path / "events.jsonl").write_text(json.dumps(event) + "\n", encoding="utf-8")
    assert read_events(tmp_path) == []


def test_an_event_with_every_field_of_its_kind_is_kept(tmp_path):
    event = {
        "step": 3,
        "kind": "nan",
        "action": "rollback",
        "origin": "blocks.0.attn",
        "note": "n",
        "on": ["loss"],
        "recent": [{"step": 2}],
        "to_step": 2,
        "bad_ids": 1,
        "loss": "inf",
        "grad_norm": 2.5,
        "lr": None,
        "z_loss": 7.0,
        "extra": "text",
    }
    (tmp_path / "events.jsonl").write_text(json.dumps(event) + "\n", encoding="utf-8")
    assert read_events(tmp_path) == [event]


def test_a_guard_left_at_its_defaults_is_the_command_lines_guard():
    """Guard() called from Python (a replay, a notebook) behaves as `nanolm train` with no guard flags."""
    from nanolm.run.config import GuardOptions

    options, guard = GuardOptions(), Guard(out_dir=None)
    assert (guard.on_nan, guard.on_spike, guard.max_rollbacks, guard.rollback_lr_scale) == (
        options.on_nan,
        options.on_spike,
        options.max_rollbacks,
        options.rollback_lr_scale,
    )
    for detector in (guard.loss, guard.grad):
        assert (detector.threshold, detector.values.maxlen) == (options.spike_threshold, options.spike_window)
    assert guard.history.maxlen == options.spike_window


def test_a_guard_built_from_its_section_takes_every_option_of_it(tmp_path):
    """The run and a replay build their guard from the ``[guard]`` section: each option reaches it."""
    from nanolm.run.config import GuardOptions

    options = GuardOptions(
        on_nan="skip",
        on_spike="rollback",
        spike_window=17,
        spike_threshold=3.5,
        max_rollbacks=7,
        rollback_lr_scale=0.25,
    )
    guard = Guard.from_options(options, out_dir=tmp_path, log=print, rollback_to=list, explain_nan=len)
    assert (guard.on_nan, guard.on_spike, guard.max_rollbacks, guard.rollback_lr_scale) == ("skip", "rollback", 7, 0.25)
    for detector in (guard.loss, guard.grad):
        assert (detector.threshold, detector.values.maxlen) == (3.5, 17)
    assert guard.out_dir == tmp_path and guard.rollback_to is list and guard.explain_nan is len


def test_a_guard_remembers_a_window_of_steps_and_judges_gradients_as_ratios(tmp_path):
    guard, _ = _guard(tmp_path, window=30, threshold=4.0)
    assert (guard.loss.threshold, guard.grad.threshold) == (4.0, 4.0)
    assert not guard.loss.log_scale and guard.grad.log_scale is True
    for step in range(100):
        guard.check(step, 2.0, 1.0 + 0.1 * (step % 2), 1e-3)
    assert len(guard.history) == len(guard.loss.values) == len(guard.grad.values) == 30
    assert guard.out_dir == tmp_path and guard.events_path == tmp_path / "events.jsonl"


def test_a_guard_without_a_run_directory_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    guard = Guard(out_dir=None, log=lambda line: None)
    guard.note("resume", 1)
    guard.record({"step": 2, "kind": "nan", "loss": "nan", "grad_norm": "nan", "lr": 1e-3}, "skip")
    assert guard.events_path is None and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad_row", [0, 63])  # the first and the last id of a vocabulary of 64
def test_nan_origin_finds_a_fault_that_only_one_sequence_of_the_batch_meets(bad_row):
    """Sequence 0 is clean; sequence 1 holds the one token whose embedding is broken, at the
    vocabulary's edge: ids clamped into range must still reach that row, and a module's whole
    output (not its first sequence) is what is checked."""
    model = tiny_model()
    with torch.no_grad():
        model.embed.weight[bad_row] = float("nan")
    clean = [i for i in range(1, 63)][:32]
    report = nan_origin(model, _batch([clean, clean[:5] + [bad_row] + clean[6:]]), contextlib.nullcontext, 64)
    assert report["origin"] == "the output of embed"
    assert all(p.grad is None for p in model.parameters())  # it leaves no gradient behind


def test_nan_origin_names_the_loss_when_the_logits_are_finite_and_the_cross_entropy_is_not():
    """Logits of +-2e38 are finite in fp32, but the cross-entropy of a target at -2e38 is 4e38: inf."""
    model = tiny_model()
    handle = model.lm_head.register_forward_hook(lambda module, args, output: output.sign() * 2e38)
    try:
        report = nan_origin(model, _batch([[1, 2, 3, 4] * 8]), contextlib.nullcontext, vocab_size=64)
    finally:
        handle.remove()
    assert report == {"origin": "the loss (finite logits, non-finite cross-entropy)"}


def test_nan_origin_survives_ids_and_targets_on_both_sides_of_the_vocabulary():
    model = tiny_model()
    batch = _batch([[1, 2, 3, 4] * 8])
    batch.idx[0, 3], batch.idx[0, 9] = -7, 70
    batch.targets[0, 4], batch.targets[0, 10] = -3, 99
    report = nan_origin(model, batch, contextlib.nullcontext, vocab_size=64)
    assert report["bad_ids"] == 2 and report["origin"].startswith("none on a re-run")
    assert all(p.grad is None for p in model.parameters())


def test_nan_origin_re_runs_the_batch_at_its_own_positions():
    """Two documents of 16 tokens sit at positions 0-15 each: a fault in the rotary table at
    position 20 is not met by this batch, and the re-run must not meet it either (positions
    counted 0-31 along the row would)."""
    model = tiny_model()
    with torch.no_grad():
        model.rope_cos[20] = float("nan")
    ids = [list(range(1, 33))]
    batch = Batch(
        torch.tensor(ids),
        torch.roll(torch.tensor(ids), -1, dims=1),
        torch.ones(1, 32, dtype=torch.bool),
        doc_ids=torch.tensor([[0] * 16 + [1] * 16]),
        positions=torch.tensor([list(range(16)) * 2]),
    )
    assert nan_origin(model, batch, contextlib.nullcontext, vocab_size=64)["origin"].startswith("none on a re-run")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full (a file every write to fails)")
def test_an_event_that_cannot_be_written_names_the_events_file(tmp_path):
    guard, _ = _guard(tmp_path)
    guard.events_path = Path("/dev/full")
    with pytest.raises(OSError) as e:
        guard.note("resume", 1)
    assert e.value.filename == "/dev/full"
