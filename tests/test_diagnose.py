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

