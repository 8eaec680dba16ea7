"""`nanolm lab`: the real training code, broken on purpose, and the diagnosis names the break.

The default lab (500 steps per variant, half a minute each) is what docs/health.md reports;
the test runs ``--quick`` (a tiny model, 200 steps): every variant whose symptom shows at that
size must match, and the others must be listed with the reason they need the full length.
The mechanics of the resume variant are tested on their own.
"""

import json

import pytest
from conftest import run_main

from nanolm.checkpoint import load_state, read_latest
from nanolm.instruments.lab import BY_NAME, VARIANTS, format_table, run_lab, run_variant
from nanolm.run.config import load_run_config
from nanolm.watch.guards import read_events
from nanolm.watch.sinks import read_metrics

QUICK = [
    "healthy",
    "fp16_no_loss_scaling",
    "targets_not_shifted",
    "loss_not_averaged",
    "no_doc_mask",
    "corrupt_data",
    "bad_batch_nan",
    "constant_lr",
    "decay_on_everything",
    "random_targets",
]


@pytest.fixture(scope="module")
def quick_lab(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab") / "lab"
    return out, run_lab(out, quick=True, report=False, log=lambda *_: None)


@pytest.mark.exhaustive  # the quick lab trains each broken variant: CI runs it once
def test_quick_lab_diagnosis_names_each_break(quick_lab):
    out, results = quick_lab
    assert [r.name for r in results] == QUICK
    assert all(r.matched for r in results), format_table(results)
    by_name = {r.name: r for r in results}
    assert by_name["healthy"].found == [] and by_name["no_doc_mask"].found == []  # silent, and the invisible control
    assert "memorising" not in by_name["targets_not_shifted"].found  # a leak is not mistaken for memorising
    table = (out / "lab.md").read_text()
    assert f"{len(QUICK)} of {len(QUICK)} variants matched" in table
    assert [r["name"] for r in json.loads((out / "lab.json").read_text())] == QUICK
    for r in results:
        assert (out / r.name / "diagnosis.txt").read_text().startswith(str(out / r.name))
        assert (out / r.name / "train.log").is_file()


@pytest.mark.exhaustive  # the quick lab trains each broken variant: CI runs it once
def test_quick_lab_says_which_variants_need_the_full_length_and_why(quick_lab):
    out, results = quick_lab
    table = (out / "lab.md").read_text()
    left_out = [v for v in VARIANTS if v.name not in QUICK]
    assert len(VARIANTS) >= 16 and all(v.needs_full_length for v in left_out)
    assert f"Not run with --quick ({len(left_out)})" in table
    for v in left_out:
        assert f"- {v.name}: {v.needs_full_length}" in table


@pytest.mark.exhaustive  # the quick lab trains each broken variant: CI runs it once
def test_lab_breaks_the_real_run_with_its_switches_and_only_there(quick_lab):
    out, _ = quick_lab
    assert (
        load_run_config(out / "healthy" / "config.toml").debug
        == load_run_config(out / "healthy" / "config.toml").debug.__class__()
    )
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


@pytest.mark.exhaustive  # the quick lab trains each broken variant: CI runs it once
def test_lab_dashboard_overlays_the_healthy_run(quick_lab, tmp_path):
    pytest.importorskip("matplotlib")
    out, _ = quick_lab
    from nanolm.instruments.lab import _dashboard

    dashboard = _dashboard(out / "corrupt_data", out / "healthy", log=lambda *_: None)
    assert dashboard and (out / "corrupt_data" / "report" / "report.html").read_text().count("healthy") >= 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--only", "nope"], "unknown lab variant 'nope'"),
        (["--steps", "5"], "--steps must be at least 20"),
    ],
)
def test_lab_user_errors_are_one_line(tmp_path, args, message):
    r = run_main("lab", "--quick", "--out", tmp_path / "lab", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "lab").exists()


def test_a_lab_into_an_out_that_holds_one_of_its_variants_trains_none(tmp_path):
    """A second lab on the same --out would mix its runs with the first one's: it starts none."""
    (tmp_path / "lab" / "healthy").mkdir(parents=True)
    r = run_main("lab", "--quick", "--out", tmp_path / "lab", "--only", "healthy,high_lr_no_warmup")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: {tmp_path / 'lab' / 'healthy'} already exists; choose another --out"
    assert sorted(p.name for p in (tmp_path / "lab").iterdir()) == ["healthy"]
