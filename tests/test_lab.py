"""`nanolm lab`: the real training code, broken on purpose, and the diagnosis names the break.

The default lab (500 steps per variant, a minute each) is what docs/health.md reports; the
test runs ``--quick`` (a tiny model, 200 steps) on the variants whose symptom already shows
at that size, plus the mechanics of the resume variant.
"""

import json

import pytest

from nanolm.checkpoint import load_state, read_latest
from nanolm.config import load_run_config
from nanolm.guards import read_events
from nanolm.instruments.lab import BY_NAME, format_table, run_lab, run_variant
from nanolm.monitor import read_metrics

from conftest import run_cli

QUICK_SUBSET = ["healthy", "targets_not_shifted", "loss_not_averaged", "corrupt_data", "bad_batch_nan", "no_doc_mask"]


@pytest.fixture(scope="module")
def quick_lab(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab") / "lab"
    return out, run_lab(out, QUICK_SUBSET, quick=True, report=False, log=lambda *_: None)


def test_quick_lab_diagnosis_names_each_break(quick_lab):
    out, results = quick_lab
    assert [r.name for r in results] == QUICK_SUBSET
    assert all(r.matched for r in results), format_table(results)
    assert results[0].found == [] and results[-1].found == []  # the healthy run and the invisible control
    assert "memorising" not in results[1].found  # a leak is not mistaken for memorising
    table = (out / "lab.md").read_text()
    assert f"{len(QUICK_SUBSET)} of {len(QUICK_SUBSET)} variants matched" in table
    assert [r["name"] for r in json.loads((out / "lab.json").read_text())] == QUICK_SUBSET
    for r in results:
        assert (out / r.name / "diagnosis.txt").read_text().startswith(str(out / r.name))
        assert (out / r.name / "train.log").is_file()


def test_lab_breaks_the_real_run_with_its_switches_and_only_there(quick_lab):
    out, _ = quick_lab
    assert load_run_config(out / "healthy" / "config.toml").debug == load_run_config(out / "healthy" / "config.toml").debug.__class__()
    assert load_run_config(out / "targets_not_shifted" / "config.toml").debug.unshifted_targets
    broken = load_run_config(out / "loss_not_averaged" / "config.toml")
    assert broken.debug.loss_not_averaged and broken.train.grad_accum == 4
    assert not load_run_config(out / "no_doc_mask" / "config.toml").data.doc_mask


def test_resume_variant_is_killed_after_a_checkpoint_and_resumed_without_optimizer_state(tmp_path):
    run_dir, error = run_variant(BY_NAME["resume_without_optimizer_state"], tmp_path, quick=True)
    assert error is None
    [resume] = [e for e in read_events(run_dir) if e["kind"] == "resume"]
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 200 and resume["step"] in steps
    assert "killed after the checkpoint of step" in (run_dir / "train.log").read_text()
    # a fresh AdamW after the resume: it counted only the steps since, not all 200
    adam_step = next(iter(load_state(read_latest(run_dir))["optimizer"]["state"].values()))["step"]
    assert int(adam_step) == 200 - resume["step"]


def test_lab_dashboard_overlays_the_healthy_run(quick_lab, tmp_path):
    pytest.importorskip("matplotlib")
    out, _ = quick_lab
    from nanolm.instruments.lab import _dashboard

    dashboard = _dashboard(out / "corrupt_data", out / "healthy", log=lambda *_: None)
    assert dashboard and (out / "corrupt_data" / "report" / "report.html").read_text().count("healthy") >= 1


@pytest.mark.parametrize("args, message", [
    (["--only", "nope"], "unknown lab variant 'nope'"),
    (["--steps", "5"], "--steps must be at least 20"),
])
def test_lab_user_errors_are_one_line(tmp_path, args, message):
    r = run_cli("lab", "--quick", "--out", tmp_path / "lab", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "lab").exists()
