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
import statistics
from pathlib import Path

import pytest
from conftest import run_cli

from nanolm.instruments import diagnose as dg
from nanolm.instruments.diagnose import diagnose, diagnose_trace

TRACES = Path(__file__).parent / "fixtures" / "traces"
HEALTHY = ["healthy_s1", "healthy_s2", "healthy_s3", "healthy_sparse_logging", "healthy_grad_accum",
           "healthy_resumed", "healthy_fp16_scaled", "healthy_quick"]
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
    covered = set(BROKEN.values()) | {"fp16_overflow", "train_loss_rising", "dead_units", "attention_logits",
                                      "val_worse_than_start",
                                      "left_reference_band"}  # tests/test_reference.py, against a band it measures
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
    return [{"step": start + i * every, "loss": l, "lr": lr, "grad_norm": grad_norm, "clipped": False,
             "clipped_steps": 0, **extra} for i, l in enumerate(losses)]


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
    skipping = [{**r, "loss_scale": 2.0 ** max(0, 16 - i // 10), "skipped_steps": i // 10}
                for i, r in enumerate(_rows(rows))]
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


def test_short_or_empty_traces_get_no_findings():
    assert diagnose_trace([]) == []
    assert diagnose_trace([{"step": 0, "val_loss": 6.2}]) == []
    assert diagnose_trace(_rows([6.2, 6.2, 6.1, 6.2])) == []  # four steps say nothing about a run


# --------------------------------------------------------------------------- the command
def test_diagnose_reads_a_run_directory_of_two_files(tmp_path):
    run = as_run_dir("non_causal", tmp_path)
    assert [f.name for f in diagnose(run)] == names("non_causal")


def test_cli_prints_findings_with_evidence_and_strict_sets_the_exit_status(tmp_path):
    broken, healthy = as_run_dir("targets_not_shifted", tmp_path), as_run_dir("healthy_s1", tmp_path)
    r = run_cli("diagnose", broken, healthy)
    assert r.returncode == 0, r.stderr
    assert "[leak]" in r.stdout and "evidence:" in r.stdout and f"{healthy}: no findings" in r.stdout
    assert run_cli("diagnose", "--strict", broken).returncode == 1
    assert run_cli("diagnose", "--strict", healthy).returncode == 0
    parsed = json.loads(run_cli("diagnose", "--json", broken).stdout)
    assert parsed[0]["findings"][0].keys() == {"name", "title", "message", "evidence", "runbook"}
    assert "what to do, step by step: docs/runbooks.md#" in r.stdout or parsed[0]["findings"][0]["runbook"] is None


@pytest.mark.parametrize("make", ["missing", "no_metrics", "empty"])
def test_cli_user_errors_are_one_line(tmp_path, make):
    run = tmp_path / "run"
    if make != "missing":
        run.mkdir()
    if make == "empty":
        (run / "metrics.jsonl").write_text("")
    r = run_cli("diagnose", run)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1


def test_every_runbook_a_finding_points_to_is_a_section_of_the_runbooks():
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "runbooks.md").read_text(encoding="utf-8")
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
               for h in re.findall(r"^## (.+)$", text, re.M)}
    assert set(dg.RUNBOOKS.values()) <= anchors, sorted(set(dg.RUNBOOKS.values()) - anchors)


def test_a_wsd_run_still_at_its_peak_before_its_decay_is_not_a_missing_decay():
    """Warmup-stable-decay holds the peak rate until the last part of the run on purpose; a run
    looked at before its decay, or early in a long one, has not forgotten to decay. Once the
    line should have brought the rate well down and it is still at its peak, it has."""
    trace = load("constant_lr")
    last = max(r["step"] for r in trace["metrics"])

    def with_decay(start, end):
        rows = [dict(r, schedule="wsd", decay_start_step=start, decay_end_step=end, min_lr=r["peak_lr"] / 10)
                if r["step"] == 0 and "peak_lr" in r else r for r in trace["metrics"]]  # logged: the peak throughout
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
    assert finding.evidence["block"] == "1" and finding.evidence["step"] == 31 and finding.evidence["max_logit"] == 150.0
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
    assert found.evidence == {"clip": 0, "grad_norm_max": 10.0, "grad_norm_max_step": 30, "grad_norm_median": 0.5,
                              "ratio": 20.0}


def test_a_slow_second_moment_needs_beta2_of_099_a_warmup_under_a_tenth_of_its_memory_and_an_early_burst():
    def recipe(beta2=0.999, warmup=50, burst=dg.EARLY_INSTABILITY):
        rows = [{"step": 0, "beta2": beta2, "warmup_steps": warmup, "peak_lr": 3e-3}] + _rows(_falling(400), grad_norm=0.5)
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
