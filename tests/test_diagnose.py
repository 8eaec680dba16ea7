"""Diagnosis rules: each fires on its pattern and stays silent on healthy runs.

The traces in ``tests/fixtures/traces`` are real runs of nanolm's training loop (recorded by
``tests/fixtures/record_traces.py``), healthy ones from several seeds and logging rhythms,
and broken ones made the way ``nanolm lab`` breaks them. The diagnosis sees only their
metrics and events, as it would a user's run. A few patterns that a short CPU run cannot
produce honestly (fp16 overflow, a loss that climbs back, dead units) are synthetic.
"""

import gzip
import json
import math
import re
import statistics
from pathlib import Path

import pytest
from conftest import run_cli, run_main

from nanolm.instruments import diagnose as dg
from nanolm.instruments.diagnose import diagnose, diagnose_trace

TRACES = Path(__file__).parent / "fixtures" / "traces"
HEALTHY = [
    "healthy_s1",
    "healthy_s2",
    "healthy_s3",
    "healthy_sparse_logging",
    "healthy_grad_accum",
    "healthy_resumed",
    "healthy_fp16_scaled",
    "healthy_quick",
]
BROKEN = {  # trace: the finding it must raise
    "high_lr_no_warmup": "loss_spike",
    "fp16_no_loss_scaling": "fp16_underflow",
    "targets_not_shifted": "leak",
    "non_causal": "leak",
    "loss_not_averaged": "clipped_most_steps",
    "resume_without_optimizer_state": "resume_jump",
    "corrupt_data": "data_spikes",
    "bad_batch_nan": "non_finite",
    "spike_rollback": "guard_actions",
    "labels_random": "loss_stuck",
    "memorising": "memorising",
    "no_clipping_high_lr": "no_clipping",
    "beta2_0999_short_warmup": "slow_second_moment",
    "constant_lr": "no_lr_decay",
    "decay_on_everything": "decay_on_norms",
}


def load(name: str) -> dict:
    with gzip.open(TRACES / f"{name}.json.gz", "rt", encoding="utf-8") as f:
        return json.load(f)


def as_run_dir(name: str, tmp_path) -> Path:
    """A run directory holding only the trace's metrics.jsonl and events.jsonl."""
    trace = load(name)
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trace["metrics"]))
    if trace["events"]:
        (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in trace["events"]))
    return run


def names(name: str) -> list[str]:
    trace = load(name)
    return [f.name for f in diagnose_trace(trace["metrics"], trace["events"])]


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_runs_get_no_findings(name):
    assert names(name) == []


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_rule_fires_on_its_recorded_pattern(name):
    assert BROKEN[name] in names(name)


def test_every_rule_is_exercised_by_a_recorded_or_synthetic_trace():
    covered = set(BROKEN.values()) | {
        "fp16_overflow",
        "train_loss_rising",
        "dead_units",
        "attention_logits",
        "val_worse_than_start",
        "left_reference_band",
    }  # tests/test_reference.py, against a band it measures
    assert {rule.__name__.removeprefix("rule_") for rule in dg.RULES} <= covered  # a new rule needs its test


def test_a_leak_is_named_as_such_and_not_as_memorising():
    found = names("targets_not_shifted")
    assert "leak" in found and "val_worse_than_start" in found and "memorising" not in found
    assert "memorising" not in names("non_causal")
    assert "leak" not in names("memorising")  # a training loss under the floor after 60 epochs is memory


def test_high_lr_without_warmup_shows_a_spike_after_a_gradient_spike_and_runaway_attention():
    trace = load("high_lr_no_warmup")
    found = {f.name: f for f in diagnose_trace(trace["metrics"], trace["events"])}
    spike = found["loss_spike"]
    assert spike.evidence["grad_norm_peak_step"] < spike.evidence["step"]  # the gradient came first
    assert "no warmup" in spike.message
    assert found["attention_logits"].evidence["max_logit"] > dg.ATTENTION_LOGIT_MAX


def test_data_spikes_are_not_mistaken_for_an_lr_instability():
    assert "loss_spike" not in names("corrupt_data")
    assert "data_spikes" not in names("high_lr_no_warmup")


def test_a_clean_resume_is_not_a_jolt():
    trace = load("healthy_resumed")
    assert any(e["kind"] == "resume" for e in trace["events"])  # the rule had something to look at
    assert names("healthy_resumed") == []


def test_evidence_points_at_the_right_steps():
    trace = load("bad_batch_nan")
    [nan_event] = [e for e in trace["events"] if e["kind"] == "nan"]
    finding = next(f for f in diagnose_trace(trace["metrics"], trace["events"]) if f.name == "non_finite")
    assert finding.evidence["events"][0]["step"] == nan_event["step"] == 300
    assert f"step {nan_event['step']}" in finding.message and "rolled back to step" in finding.message
    jump = next(f for f in diagnose_trace(**_kw("resume_without_optimizer_state")) if f.name == "resume_jump")
    assert jump.evidence["resume_step"] == 60 and 60 < jump.evidence["grad_norm_after_step"] <= 63


def _kw(name):
    t = load(name)
    return {"rows": t["metrics"], "events": t["events"]}


# --------------------------------------------------------------------------- synthetic patterns
def _rows(losses, lr=3e-3, grad_norm=0.5, start=1, every=1, **extra):
    return [
        {
            "step": start + i * every,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "clipped": False,
            "clipped_steps": 0,
            **extra,
        }
        for i, loss in enumerate(losses)
    ]


def _falling(n, seed=0):
    import random

    rng = random.Random(seed)
    return [0.5 + 5 * math.exp(-i / 30) + rng.gauss(0, 0.02) for i in range(n)]


def test_a_spike_at_the_end_of_warmup_is_placed_there_and_an_unwarned_one_is_not_an_lr_spike():
    def trace(warned: bool):
        rows = _rows(_falling(200), grad_norm=0.5)
        for r in rows:
            r["lr"] = 3e-3 * min(1.0, r["step"] / 50)  # linear warmup to the peak at step 50
            if warned and r["step"] == 52:
                r["grad_norm"] = 2.0  # the gradient norm goes first ...
            if r["step"] in (54, 55):
                r["loss"] += 1.5  # ... and the loss follows two steps later
        return diagnose_trace(rows)

    spike = {f.name: f for f in trace(warned=True)}["loss_spike"]
    assert spike.evidence["step"] == 54 and spike.evidence["grad_norm_peak_step"] == 52
    assert spike.evidence["warmup_end_step"] == 50 and spike.evidence["lr"] == spike.evidence["peak_lr"]
    assert "near the end of warmup" in spike.message
    assert "loss_spike" not in [f.name for f in trace(warned=False)]


def test_fp16_overflow_fires_on_repeated_skips_and_a_collapsing_scale():
    rows = _falling(200)
    skipping = [
        {**r, "loss_scale": 2.0 ** max(0, 16 - i // 10), "skipped_steps": i // 10} for i, r in enumerate(_rows(rows))
    ]
    assert "fp16_overflow" in [f.name for f in diagnose_trace(skipping)]
    calm = [{**r, "loss_scale": 65536.0, "skipped_steps": 1 if r["step"] > 150 else 0} for r in _rows(rows)]
    assert "fp16_overflow" not in [f.name for f in diagnose_trace(calm)]


def test_train_loss_rising_fires_when_the_loss_climbs_back_and_not_on_a_plateau():
    losses = _falling(150) + [0.5 + 0.02 * i for i in range(60)]
    assert "train_loss_rising" in [f.name for f in diagnose_trace(_rows(losses))]
    assert "train_loss_rising" not in [f.name for f in diagnose_trace(_rows(_falling(210)))]


def test_dead_units_fire_when_a_block_stays_shut_and_not_on_an_early_burst():
    rows = _rows(_falling(200))
    for r in rows:
        if r["step"] % 10 == 0:
            r.update({"mlp_dead_frac/0": 0.0, "mlp_dead_frac/1": 0.3 if r["step"] > 50 else 0.0})
    assert "dead_units" in [f.name for f in diagnose_trace(rows)]
    for r in rows:
        if "mlp_dead_frac/1" in r:
            r["mlp_dead_frac/1"] = 0.4 if r["step"] <= 100 else 0.0  # dead early, recovered (high-LR runs do that)
    assert "dead_units" not in [f.name for f in diagnose_trace(rows)]


def test_resume_jump_needs_a_real_jolt_not_the_usual_wobble():
    def resumed(bump):
        rows = _rows(_falling(200), grad_norm=0.5)
        for r in rows:
            if r["step"] == 102:
                r["grad_norm"] = 0.5 * bump
        return [f.name for f in diagnose_trace(rows, [{"step": 100, "kind": "resume"}])]

    assert "resume_jump" in resumed(4.0)
    assert "resume_jump" not in resumed(1.8)  # a healthy run's norm wobbles that much
    assert "resume_jump" not in [f.name for f in diagnose_trace(_rows(_falling(200)), [])]  # no resume, no jolt


def test_attention_logit_rule_has_a_threshold_a_healthy_run_stays_under():
    rows = _rows(_falling(200))
    for r in rows:
        if r["step"] % 10 == 0:
            r["attn_logit_max/0"] = min(25.0, r["step"] / 4)
    assert "attention_logits" not in [f.name for f in diagnose_trace(rows)]
    rows[-1]["attn_logit_max/0"] = 2 * dg.ATTENTION_LOGIT_MAX
    assert "attention_logits" in [f.name for f in diagnose_trace(rows)]


def test_a_trace_orders_its_rows_and_derives_what_the_rules_share():
    rows = [
        {"step": 3, "loss": 2.0, "lr": 0.99, "floor_loss": 0.5},
        {"loss": 9.0},
        {"step": 0, "val_loss": 5.0, "floor_loss": 0.7, "loss": 9.0},
        {"step": 1, "loss": 3.0, "lr": 0.5},
        {"step": 2, "loss": float("nan"), "lr": 2.0},
        {"step": 4, "loss": 1.5, "lr": 1.0, "val_loss": 1.6, "floor_loss": float("nan")},
    ]
    t = dg.Trace(rows, [{"step": 9, "kind": "b"}, {"kind": "no step"}, {"step": 1, "kind": "a"}])
    assert [r["step"] for r in t.rows] == [0, 1, 2, 3, 4] and [e["kind"] for e in t.events] == ["a", "b"]
    assert [r["step"] for r in t.train] == [1, 3, 4]  # no step 0, no non-finite loss
    assert [r["step"] for r in t.evals] == [0, 4] and t.floor == 0.5 and t.last_step == 4
    assert t.peak_lr == 1.0 and t.warmup_end == 3  # 0.99 of the peak: warmup is over (step 2's rate is not a loss's)
    assert (dg.Trace([]).last_step, dg.Trace([]).floor, dg.Trace([]).peak_lr, dg.Trace([]).warmup_end) == (
        0,
        None,
        None,
        0,
    )
    assert dg.Trace([{"step": 1, "loss": 1.0, "lr": _below(0.99)}, {"step": 2, "loss": 1.0, "lr": 1.0}]).warmup_end == 2
    assert t.events_of("a") == [{"step": 1, "kind": "a"}]


def test_a_finding_becomes_the_json_that_diagnose_json_prints():
    found = dg.Finding("leak", "a title", "a message", {"step": 3}, "a-runbook")
    assert found.to_dict() == {
        "name": "leak",
        "title": "a title",
        "message": "a message",
        "evidence": {"step": 3},
        "runbook": "a-runbook",
    }


def test_only_the_rules_asked_for_are_run():
    trace = load("non_causal")
    assert [f.name for f in diagnose_trace(trace["metrics"], trace["events"], rules=[dg.rule_leak])] == ["leak"]
    assert diagnose_trace(trace["metrics"], trace["events"], rules=[dg.rule_loss_stuck]) == []


def test_short_or_empty_traces_get_no_findings():
    assert diagnose_trace([]) == []
    assert diagnose_trace([{"step": 0, "val_loss": 6.2}]) == []
    assert diagnose_trace(_rows([6.2, 6.2, 6.1, 6.2])) == []  # four steps say nothing about a run


# --------------------------------------------------------------------------- the command
def test_diagnose_reads_a_run_directory_of_two_files(tmp_path):
    run = as_run_dir("non_causal", tmp_path)
    assert [f.name for f in diagnose(run)] == names("non_causal")
    rescued = as_run_dir("spike_rollback", tmp_path)  # its finding rests on its events alone
    assert [f.name for f in diagnose(rescued)] == names("spike_rollback") == ["guard_actions"]


def test_cli_prints_findings_with_evidence_and_strict_sets_the_exit_status(tmp_path):
    broken, healthy = as_run_dir("targets_not_shifted", tmp_path), as_run_dir("healthy_s1", tmp_path)
    r = run_cli("diagnose", broken, healthy)
    assert r.returncode == 0, r.stderr
    assert "[leak]" in r.stdout and "evidence:" in r.stdout and f"{healthy}: no findings" in r.stdout
    assert run_main("diagnose", "--strict", broken).returncode == 1
    assert run_main("diagnose", "--strict", healthy).returncode == 0
    parsed = json.loads(run_main("diagnose", "--json", broken).stdout)
    assert parsed[0]["findings"][0].keys() == {"name", "title", "message", "evidence", "runbook"}
    assert "what to do, step by step: docs/runbooks.md#" in r.stdout or parsed[0]["findings"][0]["runbook"] is None


@pytest.mark.parametrize("make", ["missing", "no_metrics", "empty"])
def test_cli_user_errors_are_one_line(tmp_path, make):
    run = tmp_path / "run"
    if make != "missing":
        run.mkdir()
    if make == "empty":
        (run / "metrics.jsonl").write_text("")
    r = run_main("diagnose", run)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1


def test_every_runbook_a_finding_points_to_is_a_section_of_the_runbooks():
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "runbooks.md").read_text(encoding="utf-8")
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-") for h in re.findall(r"^## (.+)$", text, re.M)
    }
    assert set(dg.RUNBOOKS.values()) <= anchors, sorted(set(dg.RUNBOOKS.values()) - anchors)


def test_a_wsd_run_still_at_its_peak_before_its_decay_is_not_a_missing_decay():
    """Warmup-stable-decay holds the peak rate until the last part of the run on purpose; a run
    looked at before its decay, or early in a long one, has not forgotten to decay. Once the
    line should have brought the rate well down and it is still at its peak, it has."""
    trace = load("constant_lr")
    last = max(r["step"] for r in trace["metrics"])

    def with_decay(start, end):
        rows = [
            dict(r, schedule="wsd", decay_start_step=start, decay_end_step=end, min_lr=r["peak_lr"] / 10)
            if r["step"] == 0 and "peak_lr" in r
            else r
            for r in trace["metrics"]
        ]  # logged: the peak throughout
        return {f.name for f in diagnose_trace(rows, trace["events"])}

    assert "no_lr_decay" not in with_decay(last + 1, last + 100)  # the decay is still to come
    assert "no_lr_decay" not in with_decay(last - 60, last + 10_000)  # 60 steps into a 10,000-step line: ~99 %
    assert "no_lr_decay" in with_decay(last - dg.MIN_STEPS, last + 1)  # the line ends here: it should be low


def test_the_recipe_gated_rules_stay_silent_on_healthy_runs_that_record_their_recipe():
    """The healthy traces carry the step-0 recipe (clip 1.0, beta2 0.95, the real param groups)."""
    for name in HEALTHY:
        rows = load(name)["metrics"]
        assert any("peak_lr" in r for r in rows if r["step"] == 0), name
        found = {f.name for f in diagnose_trace(rows, load(name)["events"])}
        assert not found & {"no_clipping", "slow_second_moment", "no_lr_decay", "decay_on_norms"}, (name, found)


# --------------------------------------------------------------------------- each threshold at its edge
# A rule's threshold is a number someone chose (docs/diagnose.md says why); these tests put the
# measured quantity exactly on it, where the rule fires, and one float short of it, where it does
# not, so that a threshold moved or a >= turned into > is a failing test, not a silent change.


def _fires(name, rows, events=None):
    return name in [f.name for f in diagnose_trace(rows, events)]


def _below(x):
    return math.nextafter(x, -math.inf)


def _above(x):
    return math.nextafter(x, math.inf)


def test_attention_logits_fire_from_their_threshold_on():
    def with_logit(value):
        rows = _rows(_falling(60))
        for r in rows[::10]:
            r["attn_logit_max/0"], r["attn_logit_max/1"] = 10.0, 12.0
        rows[30]["attn_logit_max/1"] = value
        return rows

    assert _fires("attention_logits", with_logit(dg.ATTENTION_LOGIT_MAX))
    assert not _fires("attention_logits", with_logit(_below(dg.ATTENTION_LOGIT_MAX)))
    finding = {f.name: f for f in diagnose_trace(with_logit(150.0))}["attention_logits"]
    assert (
        finding.evidence["block"] == "1" and finding.evidence["step"] == 31 and finding.evidence["max_logit"] == 150.0
    )
    assert "reached 150 in block 1 at step 31 (last: 12.0 at step 51)" in finding.message


def test_dead_units_fire_when_the_median_of_the_last_third_reaches_the_threshold():
    def with_dead(share, n=9):
        rows = _rows(_falling(90))
        for k, r in enumerate(rows[::10][:n]):
            r["mlp_dead_frac/0"] = 0.0
            r["mlp_dead_frac/1"] = share if k >= n - n // 3 else 0.9  # dead early (recovered) does not count
        return rows

    assert _fires("dead_units", with_dead(dg.DEAD_FRACTION))
    assert not _fires("dead_units", with_dead(_below(dg.DEAD_FRACTION)))
    assert not _fires("dead_units", with_dead(0.5, n=2))  # two statistics steps say nothing yet
    found = {f.name: f for f in diagnose_trace(with_dead(0.25))}["dead_units"]
    assert found.evidence["block"] == "1" and found.evidence["steps"] == [61, 81]
    assert found.evidence["per_block"] == {"0": 0.0, "1": 0.25}


def test_fp16_overflow_fires_on_two_percent_of_steps_skipped_and_five_at_least_or_a_scale_fallen_256_fold():
    def skipping(n_steps, skipped, low_scale=1024.0):
        rows = _rows(_falling(n_steps))
        for r in rows:
            r["loss_scale"], r["skipped_steps"] = 65536.0, 0
        rows[-1]["skipped_steps"], rows[-1]["loss_scale"] = skipped, low_scale
        return rows

    assert _fires("fp16_overflow", skipping(250, 5))  # 5 = 2 % of 250
    assert not _fires("fp16_overflow", skipping(250, 4))  # under 2 %, and under 5
    assert not _fires("fp16_overflow", skipping(300, 5))  # five, but under 2 % of 300
    assert _fires("fp16_overflow", skipping(100, 5))  # 5 % of 100
    assert not _fires("fp16_overflow", skipping(100, 4))  # 4 % of 100, but fewer than five
    assert _fires("fp16_overflow", skipping(300, 0, low_scale=65536.0 * dg.SCALE_COLLAPSE))
    assert not _fires("fp16_overflow", skipping(300, 0, low_scale=2 * 65536.0 * dg.SCALE_COLLAPSE))
    found = {f.name: f for f in diagnose_trace(skipping(250, 7))}["fp16_overflow"]
    assert found.evidence["logged_steps_with_new_skips"] == [250] and found.evidence["min_loss_scale"] == 1024.0


def test_fp16_underflow_fires_on_a_median_share_at_its_threshold_over_five_logged_steps():
    def subnormal(share, n=5):
        rows = _rows(_falling(60))
        for r in rows[-n:]:
            r["grad_subnormal_frac"] = share
        return rows

    assert _fires("fp16_underflow", subnormal(dg.UNDERFLOW_SHARE))
    assert not _fires("fp16_underflow", subnormal(_below(dg.UNDERFLOW_SHARE)))
    assert not _fires("fp16_underflow", subnormal(0.9, n=4))  # four logged steps: too few, and no older sign either


def test_zero_gradients_rising_fire_past_their_floor_and_growth():
    def zeros(early, late):
        rows = _rows(_falling(60))
        for k, r in enumerate(rows[::6]):
            r["grad_zero_frac"] = early if k < 5 else late
        return rows

    assert _fires("fp16_underflow", zeros(1e-4, dg.UNDERFLOW_LATE))  # 5 x its early share, at the floor
    assert not _fires("fp16_underflow", zeros(1e-4, _below(dg.UNDERFLOW_LATE)))
    assert _fires("fp16_underflow", zeros(2e-3, 6e-3))  # exactly 3 x
    assert not _fires("fp16_underflow", zeros(2e-3, _below(6e-3)))


def test_a_resume_jolt_fires_at_two_and_a_half_times_the_norm_before():
    def resumed(ratio):
        rows = _rows(_falling(200), grad_norm=0.5)
        rows[101]["grad_norm"] = 0.5 * ratio  # step 102
        return rows

    assert _fires("resume_jump", resumed(dg.RESUME_GRAD_RATIO), [{"step": 100, "kind": "resume"}])
    assert not _fires("resume_jump", resumed(_below(dg.RESUME_GRAD_RATIO)), [{"step": 100, "kind": "resume"}])
    rows = resumed(4.0)
    rows[103]["grad_norm"] = 0.5 * 4.0  # step 104: past the three steps after the resume
    found = {f.name: f for f in diagnose_trace(resumed(4.0), [{"step": 100, "kind": "resume"}])}["resume_jump"]
    assert found.evidence["grad_norm_after_step"] == 102 and found.evidence["grad_norm_median_before"] == 0.5
    late = _rows(_falling(200), grad_norm=0.5)
    late[103]["grad_norm"] = 2.0
    assert not _fires("resume_jump", late, [{"step": 100, "kind": "resume"}])


def test_the_training_loss_rising_fires_at_its_factor_plus_its_margin():
    def climbing(end):
        losses = [2.0 - 0.01 * i for i in range(100)]  # down to 1.01
        return _rows(losses + [end] * 12)

    best = statistics.median([2.0 - 0.01 * i for i in range(91, 100)])  # the smoothed best: a 9-row median
    threshold = dg.RISING_FACTOR * best + dg.RISING_MIN
    assert _fires("train_loss_rising", climbing(threshold))
    assert not _fires("train_loss_rising", climbing(_below(threshold)))


def test_clipping_counts_after_warmup_and_fires_from_half_the_steps():
    def clipped(every):
        rows = _rows([3.0 - 0.01 * i for i in range(120)])
        for r in rows:
            r["lr"] = 3e-3 * min(1.0, r["step"] / 20)
            r["clipped"] = r["step"] > 20 and r["step"] % every == 0
        total = 0
        for r in rows:
            total += r["clipped"]
            r["clipped_steps"] = total
        return rows

    assert _fires("clipped_most_steps", clipped(2))  # 50 of the 100 steps after warmup
    assert not _fires("clipped_most_steps", clipped(3))
    found = {f.name: f for f in diagnose_trace(clipped(2))}["clipped_most_steps"]
    assert found.evidence["warmup_end_step"] == 20 and found.evidence["clipped_fraction_after_warmup"] == 0.5


def test_a_stuck_loss_is_one_that_stays_above_nine_tenths_of_where_it_started():
    def flat(late_share, steps=60):
        return _rows([6.0] * 5 + [6.0 * late_share] * (steps - 5))

    assert _fires("loss_stuck", flat(dg.STUCK_FRACTION))
    assert not _fires("loss_stuck", flat(_below(dg.STUCK_FRACTION)))
    assert not _fires("loss_stuck", flat(1.0, steps=dg.MIN_STEPS - 1))  # too short to say
    assert _fires("loss_stuck", flat(1.0, steps=dg.MIN_STEPS))


def test_memorising_fires_from_a_rise_of_five_percent_and_two_hundredths_of_a_nat():
    def evals(last):
        rows = _rows([3.0 - 0.01 * i for i in range(200)])
        for step, v in ((50, 2.0), (100, 1.0), (150, last - 0.001), (200, last)):
            rows[step - 1]["val_loss"] = v
        return rows

    assert _fires("memorising", evals(1.0 + dg.MEMORISE_RISE * 1.0))
    assert not _fires("memorising", evals(_below(1.0 + dg.MEMORISE_RISE * 1.0)))


def test_no_clipping_fires_from_a_norm_ten_times_its_median_and_only_with_clipping_off():
    def unclipped(ratio, clip=0):
        rows = [{"step": 0, "clip": clip, "peak_lr": 3e-3}] + _rows(_falling(60), grad_norm=0.5)
        rows[30]["grad_norm"] = 0.5 * ratio
        return rows

    assert _fires("no_clipping", unclipped(dg.UNCLIPPED_SPIKE))
    assert not _fires("no_clipping", unclipped(_below(dg.UNCLIPPED_SPIKE)))
    assert not _fires("no_clipping", unclipped(50.0, clip=1.0))
    found = {f.name: f for f in diagnose_trace(unclipped(20.0))}["no_clipping"]
    assert found.evidence == {
        "clip": 0,
        "grad_norm_max": 10.0,
        "grad_norm_max_step": 30,
        "grad_norm_median": 0.5,
        "ratio": 20.0,
    }
    early = unclipped(1.0)
    early[10]["grad_norm"] = 10.0
    assert _fires("no_clipping", early[:21]) and not _fires("no_clipping", early[:20])  # twenty norms at least
    evaluated_first = [{"step": 0, "val_loss": 5.0}] + unclipped(20.0)  # the recipe: the step-0 row that has it
    assert _fires("no_clipping", evaluated_first)


def test_a_slow_second_moment_needs_beta2_of_099_a_warmup_under_a_tenth_of_its_memory_and_an_early_burst():
    def recipe(beta2=0.999, warmup=50, burst=dg.EARLY_INSTABILITY):
        rows = [{"step": 0, "beta2": beta2, "warmup_steps": warmup, "peak_lr": 3e-3}] + _rows(
            _falling(400), grad_norm=0.5
        )
        rows[10]["grad_norm"] = 0.5 * burst  # step 10: early
        return rows

    assert _fires("slow_second_moment", recipe())  # memory 1000 steps, warmup 50 < 100
    assert not _fires("slow_second_moment", recipe(burst=_below(dg.EARLY_INSTABILITY)))
    assert not _fires("slow_second_moment", recipe(warmup=100))  # exactly a tenth of the memory is enough
    assert _fires("slow_second_moment", recipe(beta2=dg.SLOW_BETA2, warmup=9))  # memory 100: 9 < 10
    assert not _fires("slow_second_moment", recipe(beta2=_below(dg.SLOW_BETA2), warmup=0))


def test_no_lr_decay_fires_on_a_last_rate_at_nine_tenths_of_the_peak():
    def schedule(last_share, steps=200):
        rows = _rows(_falling(steps))
        rows[-1]["lr"] = 3e-3 * last_share
        return rows

    assert _fires("no_lr_decay", schedule(dg.NO_DECAY_SHARE))
    assert not _fires("no_lr_decay", schedule(_below(dg.NO_DECAY_SHARE)))
    assert not _fires("no_lr_decay", schedule(1.0, steps=2 * dg.MIN_STEPS))  # 100 steps after a warmup ending at 1
    assert _fires("no_lr_decay", schedule(1.0, steps=2 * dg.MIN_STEPS + 1))


def test_a_wsd_run_is_missing_its_decay_only_when_its_rate_is_above_the_line_it_should_be_on():
    def wsd(decay_end, last_lr=1.0):
        rows = [{"step": 0, "decay_start_step": 100, "decay_end_step": decay_end, "min_lr": 0.0, "peak_lr": 1.0}]
        rows += _rows(_falling(200), lr=1.0)
        rows[-1]["lr"] = last_lr
        return rows

    assert not _fires("no_lr_decay", wsd(1100))  # at step 200 its line is at exactly 0.9 x the peak: on schedule
    assert _fires("no_lr_decay", wsd(1099))  # a line a little lower: a rate still at the peak is missing its decay
    assert not _fires("no_lr_decay", wsd(300, last_lr=0.5))  # on its line, half the peak

    def line(start, end, min_lr=0.1):
        rows = [{"step": 0, "decay_start_step": start, "decay_end_step": end, "min_lr": min_lr, "peak_lr": 1.0}]
        return _fires("no_lr_decay", rows + _rows(_falling(200), lr=1.0))  # still at the peak at step 200

    assert not line(190, 290) and line(180, 280)  # a tenth of the way down a line to 0.1: 0.91, then 0.82
    assert line(199, 200, min_lr=0.85)  # the line ended one step after it began: at 0.85 by step 200
    assert not line(100, 150, min_lr=0.92)  # past its end the line stays at its minimum, here 0.92 of the peak
    assert _fires(
        "no_lr_decay",
        [{"step": 0, "decay_start_step": 150, "min_lr": 0.1, "peak_lr": 1.0}] + _rows(_falling(200), lr=1.0),
    )  # a start without an end: no line to judge by


def test_a_leak_is_a_validation_loss_under_085_of_the_floor_or_a_training_median_of_five_under_it():
    def evals(val):
        rows = _rows(_falling(60))
        rows[0]["floor_loss"] = 1.0
        rows[49]["val_loss"] = val
        return rows

    limit = dg.LEAK_FRACTION * 1.0
    assert _fires("leak", evals(_below(limit))) and not _fires("leak", evals(limit))

    def train(below):
        losses = [3.0] * 20
        for i in range(below):
            losses[8 + 2 * i] = 0.5  # every other row: a median of five is below once three of them are
        rows = _rows(losses)
        rows[0]["floor_loss"] = 1.0
        return rows

    assert _fires("leak", train(3)) and not _fires("leak", train(2))
    found = {f.name: f for f in diagnose_trace(train(3))}["leak"]
    assert found.evidence == {"floor_loss": 1.0, "train_below_floor_from_step": 11, "train_loss": 0.5}  # the middle
    honest = train(3) + [{"step": 0, "val_loss": 3.0}, {"step": 21, "val_loss": _below(0.7 * 3.0)}]
    assert not _fires("leak", honest)  # validation learned too: memorising, not a leak
    assert _fires("leak", train(3) + [{"step": 0, "val_loss": 3.0}, {"step": 21, "val_loss": 0.7 * 3.0}])


def test_reading_a_run_names_what_is_missing_in_one_line_and_warns_of_a_damaged_row(tmp_path, capsys):
    """The command's user errors, read in-process: not a directory, no metrics.jsonl, no rows yet;
    a damaged line is left out with a warning on stderr (stdout may be --json)."""
    from nanolm.errors import NanolmError

    with pytest.raises(NanolmError, match=r"^\S+missing is not a directory \(expected a run directory"):
        dg.read_run(tmp_path / "missing")
    with pytest.raises(NanolmError, match=r"has no metrics\.jsonl; is it a run directory written by `nanolm train`"):
        dg.read_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(NanolmError, match=r"metrics\.jsonl holds no rows yet$"):
        dg.read_run(tmp_path)
    rows = load("non_causal")["metrics"]
    (tmp_path / "metrics.jsonl").write_text('{"step": 99\n' + "".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "events.jsonl").write_text("[5]\n" + json.dumps({"step": 5, "kind": "resume"}) + "\n")
    trace = dg.read_run(tmp_path)
    assert [r["step"] for r in trace.rows] == sorted(r["step"] for r in rows)
    assert trace.events == [{"step": 5, "kind": "resume"}]
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("warning: ") and "metrics.jsonl: 1 damaged line(s) left out" in err
    assert "events.jsonl: 1 damaged line(s) left out" in err
    assert [f.name for f in dg.diagnose(tmp_path)] == names("non_causal")


def test_evidence_rounds_to_four_figures_and_spells_out_what_json_cannot_hold():
    assert dg._r(0.000123456) == 0.0001235 and dg._r(123456.7) == 123500.0 and dg._r(3) == 3
    assert dg._r(float("nan")) == "nan" and dg._r(-math.inf) == "-inf" and dg._r(None) is None
    assert dg._r(True) is True and dg._r("x") == "x"


def test_the_smoothed_loss_is_the_median_of_nine_rows_around_each_even_at_the_edges():
    values = [10.0, 10.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert dg._smoothed(values) == [10.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert dg._smoothed([4.0, 1.0, 2.0], k=1) == [2.5, 2.0, 1.5]


def _zero_fraction_rows(values, last_step=200):
    """fp16 rows without the subnormal share, their zero-gradient share ``values``, spread to ``last_step``."""
    every = last_step // len(values)
    rows = _rows(_falling(len(values)), every=every, start=last_step - every * (len(values) - 1))
    return [{**r, "grad_zero_frac": v} for r, v in zip(rows, values)]


def test_zero_gradients_rising_needs_eight_logged_rows_and_compares_the_first_and_last_fifths():
    rising = [1e-4] * 4 + [1e-3] * 4
    assert _fires("fp16_underflow", _zero_fraction_rows(rising))
    assert not _fires("fp16_underflow", _zero_fraction_rows(rising[1:]))  # seven rows say too little
    assert _fires("fp16_underflow", _zero_fraction_rows(rising, last_step=dg.MIN_STEPS))
    assert not _fires("fp16_underflow", _zero_fraction_rows(rising, last_step=dg.MIN_STEPS - 8))
    # ten rows: a fifth is two of them (at least two): the median of [1e-3, 0] is 5e-4, just enough
    ten = [1e-4, 1e-4, 1e-1, 0.0, 0.0, 0.0, 0.0, 0.0, 1e-3, 0.0]
    assert _fires("fp16_underflow", _zero_fraction_rows(ten))
    # fifteen rows: a fifth is three
    fifteen = [3e-4] * 3 + [0.0] * 9 + [1e-3, 1e-3, 0.0]
    assert _fires("fp16_underflow", _zero_fraction_rows(fifteen))
    assert not _fires("fp16_underflow", _zero_fraction_rows(fifteen[:12] + [1e-3, 0.0, 0.0]))


def _spikes(losses, norms=None, every=1):
    norms = norms or [0.5] * len(losses)
    return dg._loss_spikes(
        [
            {"step": 1 + i * every, "loss": loss, "grad_norm": norm, "lr": 1e-3}
            for i, (loss, norm) in enumerate(zip(losses, norms))
        ]
    )


@pytest.mark.kernels
def test_in_the_first_rows_a_spike_is_a_loss_back_above_where_it_started_after_a_fall():
    """Before the fifth row the local median is lopsided; the one sure sign there is a loss that
    fell by more than 5 % and then climbed above its start, the first row to do so."""
    tail = [4.0 - 0.05 * j for j in range(15)]
    assert _spikes([5.0, 4.5, 5.3] + tail) == [
        {
            "index": 2,
            "step": 3,
            "loss": 5.3,
            "baseline": 4.75,
            "jump": pytest.approx(0.55),
            "lr": 1e-3,
            "above_start": True,
            "grad_norm": 0.5,
            "grad_norm_peak": 0.5,
            "grad_norm_peak_step": 1,
            "grad_norm_reference": 0.5,
            "precursor": False,
            "isolated": True,
        }
    ]  # the jump: from the rows before it
    assert _spikes([5.0, 0.95 * 5.0, 5.3] + tail) == []  # it fell by 5 % exactly: not yet a fall
    assert _spikes([5.0, 5.3] + tail) == []  # above the start before any fall: the first steps' noise
    assert [(s["index"], s["jump"]) for s in _spikes([5.0, 4.5, 5.0, 5.3] + tail)] == [(3, pytest.approx(0.3))]
    assert _spikes([5.0, 5.2, 4.5, 5.3] + tail) == []  # it had been above its start before: not the first time
    unlogged = _spikes([5.0, 4.5, 5.3] + tail, norms=[None] * 18)
    assert unlogged[0]["grad_norm_reference"] is None and unlogged[0]["precursor"] is False
    warned = _spikes([5.0, 4.5, 5.3] + tail, norms=[3.0] + [0.5] * 17)  # the norm's median from after, at the start
    assert (warned[0]["grad_norm_peak_step"], warned[0]["precursor"]) == (1, True)


def test_later_a_spike_is_a_residual_above_six_robust_sigmas_and_at_least_005_nats_and_5_percent():
    twelve = [0.5] * 8 + [1.5] + [0.5] * 3
    assert [s["index"] for s in _spikes(twelve)] == [8] and _spikes(twelve[:11]) == []  # twelve rows at least
    flat = [0.5] * 30
    assert _spikes(flat[:20] + [0.54] + flat[21:]) == []  # 0.04 nats: under the 0.05 floor
    level = 1.015625  # a level where 5 % of it and the residual are the same float
    on_edge = [level] * 30
    on_edge[20] = level + 0.05 * level
    assert on_edge[20] - level == 0.05 * level and _spikes(on_edge) == []  # on the threshold: not above it
    on_edge[20] = math.nextafter(on_edge[20], math.inf)
    assert [s["index"] for s in _spikes(on_edge)] == [20]


def test_a_spike_is_warned_by_a_gradient_norm_twice_its_median_in_the_three_rows_before():
    spiked = [0.5] * 20 + [1.5] + [0.5] * 9

    def warning(norm_at, norm=1.0, every=1):
        norms = [0.5] * 30
        norms[norm_at] = norm
        (s,) = _spikes(spiked, norms, every)
        return s["precursor"], s["grad_norm_peak_step"]

    assert warning(18) == (True, 19)  # exactly twice the median of 0.5
    assert warning(18, norm=_below(1.0)) == (False, 19)
    assert warning(16, norm=3.0) == (False, 18)  # four rows before: too early to be the cause
    assert warning(20, norm=3.0) == (False, 18)  # in the spike's own row, with every step logged: a bad batch
    assert warning(20, norm=3.0, every=2) == (True, 41)  # ... with steps unlogged between rows, it may be first
    assert warning(21, norm=3.0, every=2) == (False, 35)  # the row after never counts
    last, second_last = [0.5] * 29 + [1.5], [0.5] * 28 + [1.5, 0.5]
    assert [s["isolated"] for s in _spikes(last)] == [False]  # nothing after it: not known to fall back
    assert [s["isolated"] for s in _spikes(second_last)] == [True]


def test_a_stuck_loss_starts_from_the_untrained_validation_loss_when_it_is_higher():
    def stuck(losses, every=4, val0=None, later_val=None):
        rows = _rows(losses, every=every)
        if val0 is not None:
            rows.insert(0, {"step": 0, "val_loss": val0})
        if later_val is not None:
            rows[-1]["val_loss"] = later_val
        return _fires("loss_stuck", rows)

    assert stuck([4.0] + [4.2] * 20)  # from 4.0, still 4.2: stuck
    assert not stuck([4.0] + [4.2] * 20, val0=5.0)  # the untrained model scored 5.0: it learned 0.8 nats
    assert not stuck([4.0] + [4.2] * 20, val0=5.0, later_val=4.1)  # a later evaluation is not the start
    assert stuck([5.0] * 5, every=20) and not stuck([5.0] * 4, every=25)  # five logged steps are enough
    assert stuck([5.0, 4.0, 4.0, 4.6, 4.6], every=20)  # where it ends: the last fifth, three rows at least (4.6)
    # the last rows low, the smoothed curve not: it moved (either sign of moving is enough)
    assert not stuck([5.0] * 12 + [4.0, 4.0, 5.0])
    # a dip that came back up: it moved, and then something else went wrong (train_loss_rising's concern)
    assert not stuck([5.0] * 5 + [3.0] * 20 + [4.8] * 5)


def test_a_leak_counts_evaluations_after_step_0_and_needs_a_positive_floor():
    def leak(val_step, floor=1.0):
        rows = _rows([3.0] * 60)
        rows.insert(0, {"step": 0, "val_loss": 3.0, "floor_loss": floor})
        rows.insert(1, {"step": val_step, "val_loss": 0.5}) if val_step else rows[0].update(val_loss=0.5)
        return _fires("leak", rows)

    assert leak(1) and not leak(0)  # the untrained model's score is no leak, whatever it is
    assert not leak(1, floor=0.0) and not leak(1, floor=-1.0)


def test_a_spike_is_placed_in_warmup_near_its_end_up_to_twice_its_length_and_ten_steps_and_at_the_peak_from_half():
    def when(spike_at, warmup=20):
        (spike,) = [f for f in diagnose_trace(_spike_rows(warmup=warmup, spike_at=spike_at)) if f.name == "loss_spike"]
        place = next(p for p in ("during warmup", "near the end of warmup", "well after warmup") if p in spike.message)
        return place, "(the peak)" in spike.message

    assert when(50) == ("near the end of warmup", True) and when(51) == ("well after warmup", True)  # 2 x 20 + 10
    assert when(20) == ("near the end of warmup", True) and when(19) == ("during warmup", True)
    assert when(100, warmup=200) == ("during warmup", True)  # exactly half the peak rate
    assert when(99, warmup=200) == ("during warmup", False)


def test_data_spikes_count_jumps_from_015_nats_on():
    def spiky(jump):
        level = 0.1  # a level at which level + 0.15 - level is 0.15 exactly
        losses = [level] * 60
        for i in (15, 30, 45):
            losses[i] = level + jump
        return _fires("data_spikes", _rows(losses))

    assert (0.1 + 0.15) - 0.1 == 0.15
    assert spiky(0.15) and not spiky(_below(0.15))


def test_a_training_leak_is_a_median_of_five_rows_under_085_of_the_floor_anywhere_in_the_run():
    def leak(losses, floor=1.0):
        rows = _rows(losses)
        rows[0]["floor_loss"] = floor
        found = {f.name: f for f in diagnose_trace(rows)}.get("leak")
        return found.evidence.get("train_below_floor_from_step") if found else None

    assert leak([0.4] * 3 + [3.0] * 57) == 3  # the first five rows: the middle one's step
    assert leak([3.0] * 57 + [0.4] * 3) == 58  # the last five rows
    assert leak([3.0] * 58 + [0.4] * 2) is None  # two rows are no median of five
    assert leak([0.4] * 4) is None  # nor are four rows in all
    assert leak([0.85] * 10) is None and leak([_below(0.85)] * 10) == 3  # under 0.85 x the floor, not on it

    honest = _rows([3.0] * 5 + [0.4] * 20)
    honest[0]["floor_loss"] = 1.0
    honest.insert(0, {"step": 0, "val_loss": 3.0})
    honest[1]["val_loss"] = 2.0  # step 1: validation improved by a third
    assert not _fires("leak", honest)  # it learned honest text too: memorising, not a leak


def test_clipping_is_judged_on_five_logged_steps_and_fifty_steps_after_warmup_from_the_running_count():
    def clipped(steps, counts=True, clipped_rows=None, warm_count=True):
        rows = [
            {
                "step": s,
                "loss": 1.0,
                "lr": 1e-3,
                "grad_norm": 2.0,
                "clipped": clipped_rows is None or i in clipped_rows,
                "clipped_steps": s,
            }
            for i, s in enumerate(steps)
        ]
        for i, r in enumerate(rows):
            if not counts or (i == 0 and not warm_count):
                del r["clipped_steps"]
        return _fires("clipped_most_steps", rows)

    assert clipped([1, 13, 25, 37, 49, 61])  # five rows after warmup (step 1), 60 steps
    assert not clipped([1, 13, 25, 37, 61])  # four rows
    assert clipped([1, 11, 21, 31, 41, 51]) and not clipped([1, 11, 21, 31, 41, 50])  # 50 steps after warmup: enough
    # the running count says every step was clipped, though no logged step happened to be
    assert clipped(list(range(1, 101, 10)), clipped_rows=set())
    # without a count at warmup's end, or at all: the share of logged steps that were clipped
    assert not clipped(list(range(1, 101, 10)), clipped_rows=set(), warm_count=False)
    assert not clipped(list(range(1, 101, 10)), counts=False, clipped_rows={1, 2, 3, 4})  # 4 of 9 after warmup
    assert clipped(list(range(1, 101, 10)), counts=False, clipped_rows={1, 2, 3, 4, 5})


def test_data_spikes_need_three_isolated_jumps_making_60_percent_of_the_spikes():
    def spiky(isolated, runs=0, end_pair=False):
        losses = [0.5] * 200
        for i in range(isolated):
            losses[20 + 30 * i] = 1.0
        for i in range(runs):  # three rows in a row: the first two did not fall straight back
            losses[25 + 30 * i : 28 + 30 * i] = [1.0] * 3
        if end_pair:  # nothing after the last: not known to fall back
            losses[-2:] = [1.0, 1.0]
        return _fires("data_spikes", _rows(losses))

    assert spiky(3) and not spiky(2)
    assert spiky(3, end_pair=True)  # 3 isolated of 5 spikes: 60 %, enough
    assert spiky(2, runs=1) and not spiky(2, runs=2)  # 3 of 5 (the last row of a run falls back); 4 of 8


def test_memorising_needs_a_real_minimum_a_rise_of_five_percent_and_an_end_below_the_untrained_model():
    def memorising(values):
        rows = _rows([3.0 - 0.01 * i for i in range(200)])
        rows.insert(0, {"step": 0, "val_loss": values[0]})
        for step, v in zip((50, 100, 150, 200), values[1:]):
            rows[step]["val_loss"] = v
        return _fires("memorising", rows)

    assert memorising([5.0, 4.0, 3.0, 3.5, 3.9])
    assert not memorising([5.0, 4.8, 4.6, 4.9, 4.95])  # its best is 92 % of the start: it hardly learned
    assert memorising([5.0, 4.8, 0.9 * 5.0, 4.8, 4.9])  # 90 % of it: it learned enough to have a best
    assert not memorising([5.0, 4.0, 3.0, 4.0, 5.0])  # back where it started: worse than memorising
    best = 0.46875  # a loss at which 5 % of it, added and taken away again, is exact
    assert (best + 0.05 * best) - best == 0.05 * best
    assert memorising([5.0, 2.0, best, best + 0.01, best + 0.05 * best])  # risen by 5 % exactly: enough
    assert not memorising([5.0, 2.0, best, best + 0.01, _below(best + 0.05 * best)])
    assert not memorising([5.0, 3.0, 3.0, 3.5, 3.9])  # back at its best once since: not a steady rise

    def with_training(losses, every=1, start=1, extra=()):
        rows = _rows(losses, every=every, start=start) + list(extra)
        rows.insert(0, {"step": 0, "val_loss": 5.0})
        for step, v in zip((50, 100, 150, 200), (4.0, 3.0, 3.5, 3.9)):
            rows.append({"step": step, "val_loss": v})
        return _fires("memorising", sorted(rows, key=lambda r: r["step"]))

    assert with_training([3.0 - 0.01 * i for i in range(200)])
    assert not with_training([3.0] * 200)  # the training loss did not fall either
    assert not with_training([3.0 - 0.01 * i for i in range(5)], every=50, start=25)  # none near step 100
    sparse = _rows([3.0 - 0.01 * i for i in range(5)], every=50, start=25) + _rows([2.0], start=198)
    assert not with_training([], extra=sparse)  # rows near the last evaluation, none near the best

    # the training loss near an evaluation: the median of the rows within 10 steps (here, of step 100)
    around = [2.0] * 200
    for step in range(91, 110):
        around[step - 1] = 2.0 if step % 2 else 2.2  # ten at 2.0, nine at 2.2
    around[89] = around[109] = 2.2  # steps 90 and 110, ten steps away: counted, the median is 2.2
    around[88] = around[110] = 2.0  # steps 89 and 111: not counted
    for step in range(190, 201):
        around[step - 1] = 2.1  # near the last evaluation: lower than 2.2, higher than 2.0
    assert with_training(around)

    # in a run of 240 steps, "near" is a twentieth of it: 12 steps (of step 120, here the best)
    longer = [2.0] * 240
    for step in range(109, 132):
        longer[step - 1] = 2.0 if step % 2 else 2.2  # twelve at 2.0, eleven at 2.2
    longer[107] = longer[131] = 2.2  # steps 108 and 132, twelve steps away: counted, the median is 2.2
    for step in range(228, 241):
        longer[step - 1] = 2.1
    rows = _rows(longer)
    rows.insert(0, {"step": 0, "val_loss": 5.0})
    for step, v in zip((60, 120, 180, 240), (4.0, 3.0, 3.5, 3.9)):
        rows[step]["val_loss"] = v
    assert _fires("memorising", rows)


def test_validation_worse_than_the_start_needs_its_last_two_evaluations_above_it_and_training_that_learned():
    def worse(evaluations, losses=None, every=1):
        rows = _rows(losses or _falling(100), every=every)
        rows.insert(0, {"step": 0, "val_loss": 5.0})
        for row, v in zip(rows[-len(evaluations) :], evaluations):
            row["val_loss"] = v
        return _fires("val_worse_than_start", rows)

    assert worse([5.2, 5.4]) and not worse([5.4])  # three evaluations with step 0's
    assert worse([5.2, 5.4], every=1, losses=_falling(50)) and not worse([5.2, 5.4], losses=_falling(49))
    assert not worse([4.0, 5.0, 5.4])  # the one before the last is no worse than the start
    assert not worse([4.0, 5.0 + dg.MEMORISE_MIN_RISE, 5.4]) and worse([4.0, _above(5.0 + dg.MEMORISE_MIN_RISE), 5.4])
    tail_of_four = [5.0] * 16 + [4.0, 4.0, 4.6, 4.6]  # twenty rows: the last three's median, 4.6, is 0.92 x 5.0
    assert not worse([5.2, 5.4], losses=tail_of_four, every=5)  # the training loss did not learn either
    assert not worse([5.2, 5.4], losses=[5.0] * 60)
    assert not worse([5.2, 5.4], losses=[0.9 * 5.0] * 60) and worse([5.2, 5.4], losses=[_below(0.9 * 5.0)] * 60)
    assert not _fires(
        "val_worse_than_start", [{"step": s, "val_loss": v} for s, v in ((0, 5.0), (50, 5.2), (100, 5.4))]
    )
    early = _rows(_falling(100))
    early.insert(0, {"step": 0, "val_loss": 5.0})
    early[1]["val_loss"], early[100]["val_loss"] = 5.1, 5.3  # evaluated at step 1 and step 100
    found = {f.name: f for f in diagnose_trace(early)}["val_worse_than_start"]
    assert found.evidence["best_val_loss"] == 5.1 and found.evidence["last_eval_step"] == 100
    twice = [{"step": 0, "val_loss": 5.0}] + early  # two runs' step-0 rows in one log: one evaluation after them
    twice[2]["val_loss"] = 4.0
    assert not _fires("val_worse_than_start", twice)


def test_a_rising_training_loss_is_judged_on_twenty_logged_steps_over_fifty_steps():
    def rising(n, every=3):
        losses = [3.0 - 0.1 * i for i in range(n // 2)] + [2.1 + 0.2 * i for i in range(n - n // 2)]
        return _fires("train_loss_rising", _rows(losses, every=every))

    assert rising(20) and not rising(19)
    assert rising(50, every=1) and not rising(49, every=1)  # the last logged step: 50, then 49


def test_a_resume_jolt_is_measured_against_the_hundred_steps_before_it():
    steps = list(range(10, 201, 10)) + list(range(201, 261))  # logged every 10 steps, then every step
    rows = [{"step": s, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5} for s in steps]
    for r in rows:
        if r["step"] <= 200:  # the hundred steps before the resume: 0.5 and 1.0 alike (median 0.75); earlier: 1.0
            r["grad_norm"] = 1.0 if r["step"] <= 100 or r["step"] % 20 else 0.5
    rows[20]["grad_norm"] = 2.0  # step 201: 2.67 x 0.75, where step 100 counted too it would be 2 x 1.0
    assert _fires("resume_jump", rows, [{"step": 200, "kind": "resume"}])


def test_each_resume_is_judged_on_its_own_from_three_steps_before_and_the_worst_loss_two_to_five_steps_after():
    def resumed(after_losses, resumes=(100,), before_norm=0.5, jolt_at=102):
        rows = _rows([1.0] * 110, grad_norm=before_norm)
        for r in rows:
            if r["step"] > 100:
                r["grad_norm"] = 0.5
        rows[jolt_at - 1]["grad_norm"] = 2.0
        for offset, loss in after_losses.items():
            rows[100 + offset - 1]["loss"] = loss
        found = {f.name: f for f in diagnose_trace(rows, [{"step": s, "kind": "resume"} for s in resumes])}
        return found["resume_jump"].evidence if "resume_jump" in found else None

    worst = resumed({0: 9.0, 1: 8.0, 2: 3.5, 5: 3.0, 6: 7.0})
    assert (worst["loss_first_after"], worst["loss_worst_after"]) == (8.0, 3.5)  # steps 102..105 after step 101's
    assert resumed({5: 3.0, 6: 7.0})["loss_worst_after"] == 3.0
    assert resumed({}, resumes=(40, 100))["resumes_with_a_jolt"] == [100]  # a calm resume, then a jolted one
    assert resumed({}, resumes=(2, 100))["resumes_with_a_jolt"] == [100]  # too few steps before the first to judge
    assert resumed({}, resumes=(100,), before_norm=0.0, jolt_at=45) is None  # a zero norm before: no yardstick
    assert resumed({}, resumes=(3,), jolt_at=4)["resume_step"] == 3  # three steps before it: enough
    assert resumed({}, resumes=(2,), jolt_at=3) is None


def test_dead_units_take_the_median_of_the_last_third_of_three_samples_or_more_per_block():
    def dead(samples, steps=None):
        rows = _rows(_falling(200))
        for step, values in zip(steps or range(40, 201, 40), samples):
            rows[step - 1].update({f"mlp_dead_frac/{b}": v for b, v in values.items()})
        found = {f.name: f for f in diagnose_trace(rows)}.get("dead_units")
        return (found.evidence["block"], found.evidence["dead_fraction"]) if found else None

    assert dead([{"0": 0.3}] * 3) == ("0", 0.3) and dead([{"0": 0.3}] * 2) is None  # three samples at least
    assert dead([{"0": 0.0}] * 3 + [{"0": 0.0}, {"0": 0.3}]) == ("0", 0.15)  # a third of five: the last two
    assert dead([{"0": 0.3, "1": 0.0}] * 5) == ("0", 0.3)  # the worst block, whatever its name
    assert dead([{"0": 0.0}] * 4 + [{"0": 0.0, "1": 0.3}]) == ("1", 0.15)  # a block unmeasured counts 0 there


def test_a_slow_second_moment_compares_the_steps_up_to_warmup_or_a_fifth_of_the_run_with_the_rest():
    def slow(n=400, warmup=50, beta2=0.999, burst_at=10, logit=None, every=1):
        rows = [{"step": 0, "beta2": beta2, "warmup_steps": warmup, "peak_lr": 3e-3}]
        rows += _rows(_falling(n), grad_norm=0.5, every=every)
        if burst_at is not None:
            next(r for r in rows if r["step"] == burst_at)["grad_norm"] = 0.5 * dg.EARLY_INSTABILITY
        if logit is not None:
            rows[-1]["attn_logit_max/0"] = logit
        return _fires("slow_second_moment", rows)

    assert slow(n=20, every=5, burst_at=11) and not slow(n=19, every=5, burst_at=11)  # twenty logged steps at least
    assert not slow(warmup=None)
    memory = 1 / (1 - 0.999)
    assert not slow(warmup=dg.SLOW_WARMUP_SHARE * memory) and slow(warmup=_below(dg.SLOW_WARMUP_SHARE * memory))
    # the early part: up to step max(warmup + 1, last step // 5)
    assert slow(n=100, warmup=30, burst_at=31) and not slow(n=100, warmup=30, burst_at=32)
    assert slow(burst_at=80) and not slow(burst_at=81)  # 400 // 5
    assert not slow(burst_at=300)  # a burst late in the run is not this
    assert not slow(n=300, beta2=0.9999, warmup=500)  # no step after the early part: nothing to compare with
    # no early burst, but the logits ran away: above 100 only
    assert slow(burst_at=None, logit=_above(dg.ATTENTION_LOGIT_MAX))
    assert not slow(burst_at=None, logit=dg.ATTENTION_LOGIT_MAX)
    at_the_limit = [{"step": 0, "beta2": 0.999, "warmup_steps": 50, "peak_lr": 3e-3}] + _rows(_falling(400))
    at_the_limit[10]["grad_norm"], at_the_limit[-1]["attn_logit_max/0"] = 10.0, dg.ATTENTION_LOGIT_MAX
    (found,) = [f for f in diagnose_trace(at_the_limit) if f.name == "slow_second_moment"]
    assert "attention logits grew" not in found.message  # 100 is the limit, not past it
    # the step at the cut is early only: the later median (0.5) leaves it out
    steps = [{"step": 0, "beta2": 0.999, "warmup_steps": 50, "peak_lr": 3e-3}] + _rows(_falling(20), every=5)
    for i, r in enumerate(steps[12:]):  # steps 56..96: 0.5 and 1.0, median 0.5
        r["grad_norm"] = 1.0 if i % 2 else 0.5
    steps[11]["grad_norm"] = 0.5 * dg.EARLY_INSTABILITY  # step 51 = warmup + 1: the cut
    assert steps[11]["step"] == 51 and _fires("slow_second_moment", steps)
    rows = [{"step": 0, "beta2": 0.9993, "warmup_steps": 50, "peak_lr": 3e-3}] + _rows(_falling(400), grad_norm=0.5)
    rows[10]["grad_norm"] = 10.0
    found = {f.name: f for f in diagnose_trace(rows)}["slow_second_moment"]
    assert found.evidence["second_moment_memory_steps"] == 1430.0  # 1 / (1 - 0.9993), to three figures


def test_data_spikes_say_the_batches_are_harder_than_validation_above_12_times_its_loss():
    def gap(val):
        losses = [0.6] * 200
        for i in (29, 59, 149):
            losses[i] = 1.6
        rows = _rows(losses)
        rows[99]["val_loss"] = val  # step 100
        (found,) = [f for f in diagnose_trace(rows) if f.name == "data_spikes"]
        return "well above the validation loss" in found.message

    assert 1.2 * 0.5 == 0.6 and not gap(0.5) and gap(_below(0.5))


def test_a_stuck_loss_names_the_vocabulary_it_guesses_among_up_to_50_nats():
    def said(level):
        (found,) = [f for f in diagnose_trace(_rows([level] * 60)) if f.name == "loss_stuck"]
        return found.message

    assert f"e^50.00 ≈ {math.exp(50):.0f}:" in said(50.0)
    assert f"e^50.50 > {math.exp(50):.1e}:" in said(50.5)  # beyond any vocabulary: a bound, not a count


# --------------------------------------------------------------------------- every finding as its reader gets it
# A finding is read by a person: its title, its message (the numbers it quotes, the branch of its
# wording that fits the run) and its evidence. The threshold tests above say *whether* a rule
# fires; this one says *what it then says*, for every rule and every branch of its wording, as
# recorded in tests/fixtures/diagnose_findings.txt. A number quoted from the wrong step, a
# wording branch turned around or an evidence key renamed is a failing test, not a silent
# change. After a change meant to alter what diagnose says, record again and read the diff:
#
#     python tests/test_diagnose.py --update

FINDINGS = Path(__file__).parent / "fixtures" / "diagnose_findings.txt"


def _spike_rows(warmup, spike_at, every=1, warned=True):
    """A falling loss with a linear warmup to ``warmup`` and a loss spike at step ``spike_at``
    (the gradient norm rising two logged rows before it when ``warned``)."""
    rows = _rows(_falling(200 // every, seed=3), grad_norm=0.5, every=every)
    for r in rows:
        r["lr"] = 3e-3 * min(1.0, r["step"] / warmup)
        if warned and r["step"] == spike_at - 2 * every:
            r["grad_norm"] = 2.5
        if r["step"] == spike_at:
            r["loss"] += 1.5
            r["grad_norm"] = 2.5 if every > 1 else r["grad_norm"]
    return rows


def _reference_cases():
    """A synthetic reference (six seeds' bands, their curve and two seeds' reruns), a run of one of
    its seeds that is 10 % worse at every evaluation, a run of a new seed 10 % worse, and a run
    whose learning rate is not the recipe's."""
    from nanolm.watch.curve import Curve, SeedCurves
    from nanolm.watch.reference import Reference, bands_from_runs, setup_digest

    setup = {"run": {"data_digest": "synthetic"}}
    evals = (0, 100, 200, 300)

    def run(seed, worse=1.0, lr=3e-3, off=1.0):
        rows = [{"step": 0, "seed": seed, "setup_digest": setup_digest(setup), "val_loss": 5.0}]
        for step in range(10, 301, 10):
            level = 1.0 + 4.0 * math.exp(-step / 60) + 0.01 * ((seed * 7 + step) % 5 - 2)
            rows.append(
                {
                    "step": step,
                    "loss": level * off,
                    "lr": lr,
                    "grad_norm": 0.5 * off,
                    **{f"update_ratio/{b}": 0.01 * off**b for b in range(5)},
                }
            )
            if step in evals:
                rows[-1]["val_loss"] = level * (1.0 + 0.005 * (seed % 3)) * worse
        return rows

    seeds = [1, 2, 3, 4, 5, 6]
    steps = [s for s in evals if s > 0]
    logs = {s: [math.log(r["val_loss"]) for r in run(s) if r["step"] in steps] for s in seeds}
    mean = [statistics.mean(logs[s][i] for s in seeds) for i in range(len(steps))]
    curve = Curve(
        "val_loss", steps, mean, [[1e-4 if i == j else 5e-5 for j in range(3)] for i in range(3)], len(seeds), 3.0, 0.01
    )
    own = SeedCurves(
        "val_loss",
        steps,
        {str(s): logs[s] for s in seeds},
        [[9e-6 if i == j else 4e-6 for j in range(3)] for i in range(3)],
        5,
        3.5,
        0.01,
    )
    ref = Reference(
        "synthetic-fp32",
        "the synthetic recipe",
        "nanolm train --synthetic",
        "fp32",
        seeds,
        "a test",
        "2026-12-05",
        "2.13.0",
        setup,
        bands_from_runs([run(s) for s in seeds]),
        curve=curve,
        curve_seeds=seeds,
        seed_curves=own,
    )
    import dataclasses

    without_curve = dataclasses.replace(ref, curve=None, name="synthetic-no-curve")
    digest_late = run(2, worse=1.10)[1:]
    digest_late[0]["setup_digest"] = setup_digest(setup)  # only a step-0 row says which setup a run is
    return {
        "reference_own_seed_10pct_worse": (run(2, worse=1.10), None, [ref]),
        "reference_own_seed_3pct_worse": (run(2, worse=1.03), None, [ref]),
        "reference_own_seed_without_the_seeds_curve": (run(2, worse=1.10), None, [without_curve]),
        "reference_new_seed_10pct_worse": (run(99, worse=1.10), None, [ref]),
        "reference_lr_not_the_recipes": (run(99, lr=2e-3), None, [ref]),
        "reference_left_by_every_number": (run(99, worse=1.5, lr=2e-3, off=1.5), None, [ref]),
        "reference_left_by_two_numbers": (run(99, worse=1.10, lr=2e-3), None, [ref]),
        "reference_digest_outside_the_step_0_row": (digest_late, None, [ref]),
    }


def finding_cases() -> dict:
    """name -> (rows, events, references): every recorded broken trace, and a synthetic trace for
    each rule or wording branch no recorded trace reaches."""
    cases = {name: (load(name)["metrics"], load(name)["events"], None) for name in sorted(BROKEN)}
    cases["loss_spike_near_the_end_of_warmup"] = (_spike_rows(warmup=50, spike_at=54), None, None)
    cases["loss_spike_well_after_warmup"] = (_spike_rows(warmup=20, spike_at=150), None, None)
    cases["loss_spike_in_one_sparse_row"] = (_spike_rows(warmup=20, spike_at=121, every=10, warned=False), None, None)

    losses = _falling(200)
    cases["fp16_overflow"] = (
        [
            {**r, "loss_scale": 2.0 ** max(0, 16 - i // 10), "skipped_steps": i // 10}
            for i, r in enumerate(_rows(losses))
        ],
        None,
        None,
    )
    cases["fp16_underflow_with_a_loss_scale"] = (
        [{**r, "grad_subnormal_frac": 0.25, "loss_scale": 2.0 ** (i % 5)} for i, r in enumerate(_rows(losses))],
        None,
        None,
    )
    cases["fp16_overflow_seen_in_the_scale_alone"] = (  # no skip count logged; the scale climbs back at the end
        [
            {**r, "loss_scale": 2.0 ** max(6, 16 - i // 10) * (2 if i == 259 else 1)}
            for i, r in enumerate(_rows(_falling(260)))
        ],
        None,
        None,
    )
    cases["fp16_overflow_counted_from_a_later_step"] = (  # the first rows without a skip count: none yet
        [
            {**r, "loss_scale": 65536.0, **({"skipped_steps": i // 10 - 9} if i >= 100 else {})}
            for i, r in enumerate(_rows(_falling(260)))
        ],
        None,
        None,
    )
    cases["fp16_overflow_skipping_often"] = (
        [{**r, "loss_scale": 65536.0, "skipped_steps": i // 10} for i, r in enumerate(_rows(_falling(260)))],
        None,
        None,
    )
    cases["fp16_zero_gradients_rising"] = (
        [{**r, "grad_zero_frac": 1e-4 if r["step"] < 100 else 2e-3} for r in _rows(losses)],
        None,
        None,
    )
    cases["train_loss_rising"] = (_rows(_falling(150) + [0.5 + 0.02 * i for i in range(60)]), None, None)

    dead = _rows(losses)
    for r in dead[9::10]:
        r.update({"mlp_dead_frac/0": 0.0, "mlp_dead_frac/1": 0.3 if r["step"] > 50 else 0.0})
    cases["dead_units"] = (dead, None, None)
    logits = _rows(losses)
    for r in logits[9::10]:
        r["attn_logit_max/0"], r["attn_logit_max/1"] = 12.0, min(180.0, r["step"] * 1.0)
    cases["attention_logits"] = (logits, None, None)

    jolted = _rows(losses)
    jolted[101]["grad_norm"] = 2.0
    cases["resume_jump"] = (jolted, [{"step": 100, "kind": "resume"}], None)
    jolted_late = [dict(r) for r in jolted[:101]]
    jolted_late[100]["grad_norm"] = 2.0  # step 101, the last: no loss after it to compare
    cases["resume_jump_in_the_last_logged_step"] = (jolted_late, [{"step": 100, "kind": "resume"}], None)

    clipped = [
        {**r, "clipped": True, "clipped_steps": r["step"], "grad_norm": 2.0 + 0.01 * (r["step"] % 7)}
        for r in _rows(losses)
    ]
    cases["clipped_on_every_step"] = (clipped, None, None)

    def leaking(val_before, val_after):
        rows = _rows([3.0] * 5 + [0.4] * 55)
        rows.insert(0, {"step": 0, "val_loss": val_before, "floor_loss": 1.0})
        rows[-1]["val_loss"] = val_after
        return rows

    cases["leak_in_training_only_validation_far_above"] = (leaking(3.0, 2.5), None, None)
    cases["leak_in_training_only_validation_near_the_floor"] = (
        leaking(2.5, 2.0),
        None,
        None,
    )  # floor + 1 nat: not yet far

    worse = _rows(_falling(100))
    worse.insert(0, {"step": 0, "val_loss": 5.0})
    worse[50]["val_loss"], worse[80]["val_loss"], worse[100]["val_loss"] = 4.0, 5.2, 5.4
    cases["validation_worse_than_the_untrained_model"] = (worse, None, None)

    nan_rows = _rows(losses[:80])
    for r in nan_rows[38::2]:  # 21 rows: the message lists ten of them, the evidence twenty
        r["loss"] = float("nan")
    nan_rows[78]["loss"] = float("inf")
    nan_events = [
        {
            "step": 30,
            "kind": "nan",
            "action": "rollback",
            "to_step": 20,
            "loss": float("inf"),
            "grad_norm": None,
            "origin": "block 2 attention",
            "bad_ids": 3,
        },
        {"step": 35, "kind": "nan", "action": "skip", "loss": 2.5, "grad_norm": float("inf")},
        {"step": 37, "kind": "nan", "action": "warn", "loss": 2.5, "grad_norm": float("inf")},
        {"step": 38, "kind": "nan", "loss": 2.5, "grad_norm": float("inf")},
        {"step": 41, "kind": "nan", "action": "stop", "loss": float("nan"), "grad_norm": 1e9},
    ]
    cases["non_finite_rows_and_events"] = (nan_rows, nan_events, None)

    slow = _rows(losses)
    slow.insert(0, {"step": 0, "peak_lr": 3e-3, "beta2": 0.999, "warmup_steps": 5, "clip": 1.0})
    slow[3]["grad_norm"] = 40.0
    slow[150]["attn_logit_max/0"] = 150.0
    cases["slow_second_moment_and_runaway_logits"] = (slow, None, None)
    burst_only = [dict(r) for r in slow]
    del burst_only[150]["attn_logit_max/0"]
    cases["slow_second_moment_in_the_gradient_norm_alone"] = (burst_only, None, None)
    rescued = [
        {
            "step": 10 * i,
            "kind": "spike",
            "action": action,
            "on": ["loss"] if i % 2 else ["loss", "grad_norm"],
            "loss": 3.0 + i,
            "grad_norm": 2.0,
            "lr": 1e-3,
            "z_loss": 7.5,
            "z_grad_norm": 6.25,
        }
        for i, action in enumerate(["skip", "rollback", "stop"] * 4 + ["warn"], start=1)
    ]
    cases["guard_actions_of_every_kind"] = (_rows(losses[:60]), rescued, None)
    cases["guard_action_on_an_unnamed_spike"] = (
        _rows(losses[:60]),
        [{"step": 20, "kind": "spike", "action": "skip"}],
        None,
    )
    cases["loss_stuck_far_above_any_vocabulary"] = (
        [r for r in _rows([800.0] * 60, every=2) if r.pop("lr")],
        None,
        None,
    )
    unlogged_rate = _spike_rows(warmup=20, spike_at=150)
    for r in unlogged_rate:
        del r["lr"]
    cases["loss_spike_without_a_logged_learning_rate"] = (unlogged_rate, None, None)
    cases["loss_spike_at_a_low_learning_rate"] = (_spike_rows(warmup=200, spike_at=60), None, None)
    many = _rows(_falling(600, seed=5), grad_norm=0.5)
    for r in many[40::25]:  # 23 spikes, each after its gradient norm: the message lists ten, the evidence twenty
        r["loss"] += 1.0
    for r in many[38::25]:
        r["grad_norm"] = 2.5
    cases["loss_spikes_many"] = (many, None, None)

    def data_spikes_with_evaluations(evals):
        losses = [0.54 if i % 2 else 0.5 for i in range(200)]
        for i in (29, 59, 149):
            losses[i] = 1.5
        rows = _rows(losses)  # steps 1..200; the last evaluation at step 100
        for step, loss in ((89, 0.5), (111, 0.5), (90, 0.54), (110, 0.54)):  # 10 steps away counts, 11 does not
            rows[step - 1]["loss"] = loss
        rows.insert(0, {"step": 0, "val_loss": 5.0})
        for step, val in evals:
            rows[step]["val_loss"] = val
        return rows

    cases["data_spikes_on_batches_harder_than_validation"] = (data_spikes_with_evaluations([(100, 0.3)]), None, None)
    cases["data_spikes_without_evaluations_after_step_0"] = (data_spikes_with_evaluations([]), None, None)
    cases["data_spikes_evaluated_at_step_1"] = (data_spikes_with_evaluations([(1, 0.3)]), None, None)
    long_losses = [0.5] * 240  # 240 steps: "near" an evaluation is a twentieth of the run, 12 steps
    for i in (29, 59, 199):
        long_losses[i] = 1.5
    for step in range(109, 132):
        long_losses[step - 1] = 0.5 if step % 2 else 0.54  # twelve at 0.5, eleven at 0.54 around step 120
    long_losses[107] = long_losses[131] = 0.54  # steps 108 and 132, twelve away: counted, the median is 0.54
    longer = _rows(long_losses)
    longer.insert(0, {"step": 0, "val_loss": 5.0})
    longer[120]["val_loss"] = 0.3
    cases["data_spikes_in_a_longer_run"] = (longer, None, None)
    unmeasured = data_spikes_with_evaluations([])
    for r in unmeasured:
        if r.get("loss") == 1.5:
            del r["grad_norm"]  # the spikes' own gradient norms were not logged
    cases["data_spikes_without_their_gradient_norms"] = (unmeasured, None, None)

    def counted_clipping(after_rows, per_step=1, norms=None, flags=None):
        steps = [1] + [10 * (i + 1) for i in range(after_rows)]
        norms = norms or [0.5 + 0.04 * (i % 10) for i in range(len(steps))]
        flags = flags or [False] * len(steps)
        return [
            {"step": s, "loss": 1.0, "lr": 1e-3, "grad_norm": n, "clipped": f, "clipped_steps": per_step * s}
            for s, n, f in zip(steps, norms, flags)
        ]

    cases["clipped_by_the_count_though_no_logged_step_was"] = (counted_clipping(10), None, None)
    cases["clipped_by_the_count_with_nine_logged_steps"] = (counted_clipping(9), None, None)
    cases["clipped_counted_twice_a_step"] = (counted_clipping(9, per_step=2), None, None)
    unmeasured_clips = counted_clipping(9)
    for r in unmeasured_clips:
        del r["grad_norm"]
    cases["clipped_without_gradient_norms"] = (unmeasured_clips, None, None)
    count_lost = counted_clipping(9)
    count_lost.insert(1, {**count_lost[0], "step": 2, "clipped_steps": 2})  # a count one step after warmup's end ...
    for r in count_lost[2:]:
        del r["clipped_steps"]  # ... and none after it
    cases["clipped_counted_one_step_after_warmup_only"] = (count_lost, None, None)
    cases["clipped_and_unclipped_at_one_norm"] = (
        counted_clipping(9, norms=[0.8] * 4 + [1.0] * 6, flags=[False] * 4 + [False, True] + [True] * 4),
        None,
        None,
    )
    shrinking = [{"step": 0, "decayed_norms_biases_embeddings": 5, "weight_decay": 0.1, "peak_lr": 3e-3}] + _rows(
        losses
    )
    for i, r in enumerate(shrinking[10::50]):  # the final norm's gains shrink; one sample has only block 0's
        r.update({"weight_norm/0": 30.0} if i == 1 else {"weight_norm/0": 30.0, "weight_norm/final_norm": 8.0 - i})
    cases["decay_on_norms_with_the_final_norm_shrinking"] = (shrinking, None, None)
    two_samples = [dict(r) for r in shrinking]
    del two_samples[110]["weight_norm/final_norm"]
    cases["decay_on_norms_with_two_samples_of_the_final_norm"] = (two_samples, None, None)
    cases["no_lr_decay_on_a_flat_loss"] = (_rows([2.0] * 200), None, None)
    gap = _rows(_falling(150))
    gap[-1]["step"] = 300  # nothing logged between step 149 and 300: no last-fifth comparison to make
    cases["no_lr_decay_with_a_gap_in_the_log"] = (gap, None, None)
    cases.update(_reference_cases())
    return cases


def findings_text(cases: dict) -> str:
    """Every case's findings as `nanolm diagnose` prints them, each under a ``#### NAME`` line."""
    return "".join(
        f"#### {name}\n{dg.format_findings(name, diagnose_trace(rows, events, references=refs))}\n\n"
        for name, (rows, events, refs) in cases.items()
    )


def recorded_findings() -> dict[str, str]:
    parts = re.split(r"^#### (\S+)\n", FINDINGS.read_text(encoding="utf-8"), flags=re.M)
    return {name: text.rstrip("\n") for name, text in zip(parts[1::2], parts[2::2])}


def test_every_finding_says_what_it_said_when_recorded():
    import difflib

    recorded = recorded_findings()
    now = {
        name: text.rstrip("\n")
        for name, text in zip(*[iter(re.split(r"^#### (\S+)\n", findings_text(finding_cases()), flags=re.M)[1:])] * 2)
    }
    assert now.keys() == recorded.keys(), "cases added or removed: run `python tests/test_diagnose.py --update`"
    for name in now:
        diff = "\n".join(
            difflib.unified_diff(
                recorded[name].splitlines(), now[name].splitlines(), "recorded", "now", lineterm="", n=0
            )
        )
        assert now[name] == recorded[name], (
            f"what diagnose says of {name} changed (if meant: python "
            f"tests/test_diagnose.py --update, and read the diff):\n{diff}"
        )


def test_every_rule_and_wording_branch_appears_in_the_recorded_findings():
    """The recorded cases reach every rule, so the test above guards every message."""
    text = FINDINGS.read_text(encoding="utf-8")
    fired = set(re.findall(r"^\d+\. \[(\w+)\]", text, flags=re.M))
    assert fired == {rule.__name__.removeprefix("rule_") for rule in dg.RULES}, fired
    for branch in (
        "with no warmup",
        "near the end of warmup",
        "well after warmup",
        "One caution",
        "far above it",
        "never improved much",
        "every logged step was clipped",
        "the clip threshold lies between",
        "A loss scale is logged",
        "exactly zero",
        "its seed's reference run",
        "the seeds' mean",
        "and the attention logits grew",
    ):
        assert branch in text, branch


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--update"]:
        raise SystemExit(f"usage: python {sys.argv[0]} --update   (record what diagnose says now)")
    FINDINGS.write_text(findings_text(finding_cases()), encoding="utf-8")
    print(f"wrote {FINDINGS}")
