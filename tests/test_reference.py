"""Reference bands: a run of a measured recipe is recognised and judged against its seeds' band,
a run of any other setup is told so once and judged by nothing, a broken run leaves the band
(the evaluation line, ``nanolm diagnose`` and ``nanolm report`` say so), and every shipped band
still describes the recipe it names.

The recipe measured here is a tiny one (five seeds in seconds); the shipped bands are checked
for their shape and against the configs and data they name, not retrained.
"""

import dataclasses
import json
import math
import os
import random
import shlex
from pathlib import Path

import pytest
from conftest import tiny_run_config
from hypothesis import example, given, settings
from hypothesis import strategies as st

import nanolm.watch.reference as reference
from nanolm.instruments.diagnose import diagnose_trace
from nanolm.run.config import RunConfig, add_run_arguments, config_from_args
from nanolm.train import train
from nanolm.watch.curve import curve_from_seeds, seed_curves_from_runs
from nanolm.watch.reference import (
    Band,
    BandWatch,
    Reference,
    band_from_seeds,
    bands_from_runs,
    curve_departure,
    departures,
    format_band,
    setup_digest,
    setup_of,
    shipped_references,
)
from nanolm.watch.sinks import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (1, 2, 3, 4, 5)  # the band's
CURVE_SEEDS = (1, 2, 3, 4, 5, 11, 12, 13)  # the curve test's (seed 6 stays new to both)


def tiny_recipe(data, out, seed, **debug):
    """fp32 whatever --precision auto picks on this CPU: the tiny band is measured in fp32."""
    cfg = tiny_run_config(data, out, steps=24, eval_every=8, seed=seed, stats_every=8, threads=1, precision="fp32")
    for k, v in debug.items():
        setattr(cfg.debug, k, v)
    return cfg


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory, stories_file):
    """Five seeds of the tiny recipe, made into a reference file in a directory of its own."""
    root = tmp_path_factory.mktemp("bands")
    runs, setups = {}, []
    for seed in CURVE_SEEDS:
        out = root / f"seed-{seed}"
        train(tiny_recipe(stories_file, out, seed), log=lambda *_: None)
        rows = read_metrics(out / "metrics.jsonl")
        runs[seed] = rows
        setups.append(rows[0]["setup_digest"])
    assert len(set(setups)) == 1, "the seed must not count in a run's setup"
    cfg = RunConfig.resolved(tiny_recipe(stories_file, root / "x", 1))
    from nanolm.data.shards import PreparedData

    setup = setup_of(cfg, PreparedData(root / "seed-1" / "data", verify=False).digest, "fp32", "cpu", 1)
    assert setup_digest(setup) == setups[0]

    def val(rows):
        return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}

    curve = curve_from_seeds("val_loss", [val(runs[seed]) for seed in CURVE_SEEDS])
    reruns = {}
    for seed in SEEDS:  # each once more with its sums in another order
        out = root / f"seed-{seed}-rerun"
        cfg = tiny_recipe(stories_file, out, seed)
        cfg.train.threads = 2
        train(cfg, log=lambda *_: None)
        reruns[seed] = val(read_metrics(out / "metrics.jsonl"))
    own = seed_curves_from_runs("val_loss", {seed: val(runs[seed]) for seed in CURVE_SEEDS}, reruns)
    ref = Reference(
        name="tiny-fp32",
        title="the tiny recipe",
        command="(test)",
        precision="fp32",
        seeds=list(SEEDS),
        machine="test",
        date="today",
        torch="any",
        setup=setup,
        bands=bands_from_runs([runs[seed] for seed in SEEDS]),
        curve=curve,
        curve_seeds=list(CURVE_SEEDS),
        seed_curves=own,
    )
    refs = root / "references"
    refs.mkdir()
    (refs / "tiny-fp32.json").write_text(json.dumps(ref.to_json()))
    return refs


@pytest.fixture
def using(tiny_reference, monkeypatch):
    monkeypatch.setattr(reference, "REFERENCE_DIR", tiny_reference)
    return shipped_references()[0]


@pytest.mark.kernels
def test_a_band_is_the_seeds_extremes_widened_by_three_times_their_spread():
    band = band_from_seeds("val_loss", [{10: 1.0}, {10: 1.1}, {10: 1.2}, {10: 1.05}, {10: 1.15}])
    assert band.steps == [10] and band.at(10) == pytest.approx((0.4, 1.8))  # 1.0..1.2, widened by 3 x 0.2
    assert band.side(10, 1.79) == 0 and band.side(10, 1.81) == 1 and band.side(10, 0.39) == -1
    assert band.side(11, 5.0) is None  # no band where the seeds logged nothing
    lr = band_from_seeds("lr", [{1: 1e-3}] * 5)  # seeds agree exactly: only the floor is left
    assert lr.side(1, 1e-3 * (1 + 1e-7)) == 0 and lr.side(1, 1e-3 * 1.001) == 1


def test_the_seed_and_how_a_run_is_watched_do_not_count_in_its_setup(stories_file, tmp_path):
    base = RunConfig.resolved(tiny_recipe(stories_file, tmp_path / "a", 1))
    other = dataclasses.replace(
        base,
        train=dataclasses.replace(
            base.train, seed=9, out_dir="elsewhere", threads=2, log_every=3, eval_every=5, progress="bar"
        ),
    )
    assert setup_of(base, "d", "fp32", "cpu", 1) == setup_of(other, "d", "fp32", "cpu", 1)
    for changed in (
        dataclasses.replace(base, optim=dataclasses.replace(base.optim, lr=1e-2)),
        dataclasses.replace(base, model=dataclasses.replace(base.model, n_embd=64)),
    ):
        assert setup_of(changed, "d", "fp32", "cpu", 1) != setup_of(base, "d", "fp32", "cpu", 1)
    assert setup_of(base, "d", "bf16", "cpu", 1) != setup_of(base, "d", "fp32", "cpu", 1)
    assert setup_of(base, "other data", "fp32", "cpu", 1) != setup_of(base, "d", "fp32", "cpu", 1)


def test_a_healthy_seed_not_in_the_band_is_recognised_and_stays_inside(using, stories_file, tmp_path):
    lines = []
    train(tiny_recipe(stories_file, tmp_path / "seed-6", 6), log=lines.append)
    assert any(
        line.startswith("reference: this is the tiny recipe (fp32, band over 5 seeds, its curve over 8")
        for line in lines
    )
    evals = [line for line in lines if line.startswith("eval step")]
    assert evals and all(" inside | " in line and line.endswith(" vs seeds") for line in evals[1:]), evals
    rows = read_metrics(tmp_path / "seed-6" / "metrics.jsonl")
    assert rows[0]["reference"] == "tiny-fp32"
    assert departures(using, rows) == [] and curve_departure(using, rows) is None
    assert [r["val_curve_side"] for r in rows if "val_curve_side" in r] == [0, 0, 0]
    assert "left_reference_band" not in [f.name for f in diagnose_trace(rows)]


def test_a_broken_run_of_the_recipe_leaves_its_band_and_diagnose_names_the_step(using, stories_file, tmp_path):
    from nanolm.instruments.faults import factories

    cfg = tiny_recipe(stories_file, tmp_path / "broken", 6, unshifted_targets=True)  # a bug, not a setting
    lines = []
    train(cfg, log=lines.append, factories=factories(cfg))
    assert any(line.startswith("reference: this is the tiny recipe") for line in lines)
    evals = [line for line in lines if line.startswith("eval step")]
    assert "above since step 8" in evals[-1], evals  # copying the input teaches nothing the validation set asks
    assert "above the seeds' mean since step 8, a healthy run 1 in " in evals[-1], evals
    rows = read_metrics(tmp_path / "broken" / "metrics.jsonl")
    found = {f.name: f for f in diagnose_trace(rows)}
    finding = found["left_reference_band"]
    assert finding.evidence["reference"] == "tiny-fp32" and finding.evidence["step"] <= 8
    lo, hi = finding.evidence["band"]
    assert not lo <= finding.evidence["value"] <= hi
    assert finding.evidence["curve"]["since"] == 8 and finding.evidence["curve"]["excess_percent"] > 10


@pytest.mark.kernels
def test_a_curve_above_the_seeds_at_every_evaluation_is_flagged_though_inside_the_band(using, stories_file, tmp_path):
    """The per-point band is wide (a seed lands anywhere in it); a curve that sits above the
    seeds' mean at every evaluation, each point inside the band, is caught by the curve test, in
    the rows' keys, the evaluation line and diagnose."""

    out = tmp_path / "seed-6"
    train(tiny_recipe(stories_file, out, 6), log=lambda *_: None)
    rows = read_metrics(out / "metrics.jsonl")
    curve, band = using.curve, using.bands["val_loss"]
    mean = dict(zip(curve.steps, (math.exp(x) for x in curve.mean_log)))
    sd = math.sqrt(sum(map(sum, curve.cov_log))) / len(curve.steps)
    shift = math.exp(1.3 * curve.threshold * sd * math.sqrt(1 + 1 / curve.seeds)) - 1
    for r in rows:
        if r["step"] in mean:
            r["val_loss"] = mean[r["step"]] * (1 + shift)
    assert all(band.side(r["step"], r["val_loss"]) == 0 for r in rows if r["step"] in mean), shift
    assert departures(using, rows) == []
    look = curve_departure(using, rows)
    assert look is not None and look.since == 8 and look.percent == pytest.approx(100 * shift)
    finding = {f.name: f for f in diagnose_trace(rows)}["left_reference_band"]
    assert "its validation curve is val_loss +" in finding.message and "key" not in finding.evidence
    watch = BandWatch(using)
    watch.resume(rows)  # as after a resume: the state rebuilt from the rows
    last = {**rows[-1], **watch.update(rows[-1]["step"], rows[-1]["val_loss"])}
    assert last["val_curve_side"] == 1 and "above the seeds' mean since step 8" in format_band(last)


def test_a_run_on_a_setup_without_reference_says_so_once_and_nothing_more(using, stories_file, tmp_path):
    cfg = tiny_recipe(stories_file, tmp_path / "other", 1)
    cfg.optim.lr = 1e-2
    lines = []
    train(cfg, log=lines.append)
    said = [line for line in lines if "reference" in line or "band" in line]
    assert len(said) == 1 and said[0].startswith("reference: none for this setup"), said
    assert "the closest, the tiny recipe (fp32), differs in optim.lr" in said[0]
    rows = read_metrics(tmp_path / "other" / "metrics.jsonl")
    assert "reference" not in rows[0] and not any("val_band_side" in r for r in rows)
    assert "left_reference_band" not in [f.name for f in diagnose_trace(rows)]


def test_a_resumed_run_remembers_since_when_it_is_outside(using, stories_file, tmp_path):
    from nanolm.instruments.faults import factories

    out = tmp_path / "broken"
    cfg = tiny_recipe(stories_file, out, 6, unshifted_targets=True)
    cfg.train.steps = 16
    train(cfg, log=lambda *_: None, factories=factories(cfg))
    cfg.train.steps = 24  # run on: the band's verdict continues from the rows already written
    lines = []
    train(cfg, log=lines.append, factories=factories(cfg))
    line = [line for line in lines if line.startswith("eval step 24")][0]
    assert "above since step 8" in line and "above the seeds' mean since step 8" in line


def test_the_report_shades_the_band_behind_a_recognised_run(using, stories_file, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nanolm.instruments.report import draw_bpb, draw_loss, load_run

    out = tmp_path / "seed-6"
    train(tiny_recipe(stories_file, out, 6), log=lambda *_: None)
    run = load_run(out)
    assert run.reference is not None
    fig, (ax1, ax2) = plt.subplots(1, 2)
    draw_loss(ax1, [run], "step", ["C0"])
    draw_bpb(ax2, [run], "step", ["C0"])
    labels = [c.get_label() for c in ax1.collections]
    assert "reference band (5 seeds)" in labels and len(ax2.collections) == 1
    plt.close(fig)


# ---------------------------------------------------------------- the shipped references


def _config_of(command: str) -> RunConfig:
    import argparse

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = shlex.split(command)[2:]  # after "nanolm train"
    return config_from_args(parser.parse_args(args))


def test_every_shipped_band_still_describes_the_recipe_it_names(monkeypatch):
    refs = shipped_references()
    assert refs, "nanolm ships reference bands (python tools/reference_bands.py)"
    monkeypatch.chdir(ROOT)  # the commands name configs/ and data/ relative to the repository
    for ref in refs:
        assert len(ref.seeds) >= 5, ref.name
        for key in ("loss", "lr", "grad_norm", "val_loss", "val_bpb"):
            assert key in ref.bands, (ref.name, key)
        for band in ref.bands.values():
            assert len(band.steps) == len(band.lo) == len(band.hi) and all(
                lo <= mid <= hi for lo, mid, hi in zip(band.lo, band.mid, band.hi)
            )
        run = ref.setup["run"]
        now = setup_of(
            _config_of(ref.command), run["data_digest"], run["precision"], run["device_type"], run["world_size"]
        )
        assert now == ref.setup, (
            f"{ref.name}: the recipe changed since its band was measured "
            f"({reference.differences(ref.setup, now)}); run tools/reference_bands.py again"
        )


def test_the_quick_runs_data_is_still_what_its_band_was_measured_on(tmp_path):
    from nanolm.data.prepare import prepare
    from nanolm.data.shards import PreparedData

    ref = next((r for r in shipped_references() if r.name == "quick-fp32"), None)
    assert ref is not None, "the quick run has a shipped band"
    prepare(ROOT / "data" / "toy.txt", tmp_path / "data", "bpe", 400, seq_len=128, progress=False, log=lambda *_: None)
    assert PreparedData(tmp_path / "data").digest == ref.setup["run"]["data_digest"], (
        "data preparation changed: the shipped bands no longer match any run; run tools/reference_bands.py again"
    )


def test_a_band_survives_its_file():
    band = Band([1, 2], [0.5, 0.4], [1.0, 0.9], [1.5, 1.4])
    ref = Reference("r", "t", "c", "fp32", [1, 2, 3, 4, 5], "m", "d", "v", {"run": {}}, {"loss": band})
    again = Reference.from_json(json.loads(json.dumps(ref.to_json())))
    assert again == ref and again.digest == ref.digest


def test_docs_list_every_shipped_reference():
    text = (ROOT / "docs" / "health.md").read_text(encoding="utf-8")
    for ref in shipped_references():
        assert f"`{ref.name}`" in text, (
            f"docs/health.md does not list {ref.name} (python tools/reference_bands.py --table)"
        )


@pytest.mark.kernels
def test_a_rerun_of_a_seed_the_reference_trained_is_judged_against_its_own_curve(using, stories_file, tmp_path):
    """The recipe's default seed is one the reference trained: its run is compared with its own
    reference run, which a rerun matches to a fraction of a per cent, so a regression of 2 %,
    lost among the seeds' spread, stands out."""
    out = tmp_path / "seed-1"
    cfg = tiny_recipe(stories_file, out, 1)
    cfg.train.threads = 3  # a third order of sums: a rerun, not a copy of a run the reference holds
    lines = []
    train(cfg, log=lines.append)
    evals = [line for line in lines if line.startswith("eval step")]
    assert all(line.endswith(" vs its seed") for line in evals[1:]), evals
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[0]["seed"] == 1 and curve_departure(using, rows) is None
    for r in rows:
        if r["step"] > 0 and "val_loss" in r:
            r["val_loss"] *= 1.02
    look = curve_departure(using, rows)
    assert look is not None and look.own_seed and look.percent == pytest.approx(2.0, abs=0.5), look
    finding = {f.name: f for f in diagnose_trace(rows)}["left_reference_band"]
    assert "above its seed's reference run since step 8" in finding.message and "among all the seeds" in finding.message


_SEED_VALUES = st.lists(st.floats(-1e9, 1e9, allow_nan=False), min_size=2, max_size=8)
_BANDED_KEYS = st.sampled_from(["loss", "lr", "grad_norm", "clipped_frac", "val_loss", "val_bpb", "update_ratio/embed"])


@settings(max_examples=400, deadline=None)
@given(key=_BANDED_KEYS, values=_SEED_VALUES, extra=st.floats(-1e9, 1e9, allow_nan=False), order=st.randoms())
@example(key="clipped_frac", values=[100000000.25, 100000000.25], extra=0.0, order=random.Random(0))  # rounding > floor
@example(key="loss", values=[806286676.0, 806286925.0], extra=804943114.0, order=random.Random(0))  # median moves down
def test_every_seed_a_band_is_built_from_lies_inside_it_whatever_their_values_and_order(key, values, extra, order):
    """The band's edges hold its own seeds (rounded to nine figures, never past a seed), do not
    depend on the order the seeds come in, and only widen when a seed is added."""
    band = band_from_seeds(key, [{100: v} for v in values])
    assert all(band.side(100, v) == 0 for v in values), (band.lo, band.hi)
    shuffled = list(values)
    order.shuffle(shuffled)
    assert band_from_seeds(key, [{100: v} for v in shuffled]) == band
    wider = band_from_seeds(key, [{100: v} for v in values + [extra]])
    assert wider.lo[0] <= band.lo[0] and wider.hi[0] >= band.hi[0]
    below, above = math.nextafter(band.lo[0], -math.inf), math.nextafter(band.hi[0], math.inf)
    assert band.side(100, below) == -1 and band.side(100, above) == 1  # one float past an edge is outside


@pytest.mark.skipif(bool(os.environ.get("NANOLM_EXPLORE")), reason="NANOLM_EXPLORE draws fresh examples on purpose")
def test_the_property_tests_draw_the_same_examples_on_every_run():
    """The test above once turned CI red on a case it drew by chance and passed the run before: in
    the default run every property test draws the same examples (tests/conftest.py), so the verdict
    on a tree is the same on every machine and every run; NANOLM_EXPLORE=1 searches afresh."""

    def drawn():
        seen = []

        @settings(max_examples=20)  # the suite's profile decides the rest, as for every property test
        @given(st.floats(-1e9, 1e9, allow_nan=False))
        def draw(x):
            seen.append(x)

        draw()
        return seen

    assert drawn() == drawn()


# ------------------------------------------------------------------ the band's rules at their edges


@pytest.mark.kernels
def test_a_bands_middle_is_the_seeds_median_and_its_width_at_least_the_numbers_floor():
    even = band_from_seeds("val_loss", [{5: 1.0}, {5: 1.2}, {5: 1.4}, {5: 2.0}])
    assert even.mid == [1.3]  # the mean of the middle two
    assert band_from_seeds("val_loss", [{5: 1.0}, {5: 1.4}, {5: 2.0}]).mid == [1.4]
    same = [{5: 2.0}] * 3  # no spread: the floor alone sets the width
    assert band_from_seeds("loss", same).at(5) == pytest.approx((2.0 - 0.01, 2.0 + 0.01))  # 0.5 % of the value
    assert band_from_seeds("update_ratio/embed", same).at(5) == pytest.approx((2.0 - 0.04, 2.0 + 0.04))  # 2 %
    assert band_from_seeds("clipped_frac", [{5: 0.5}] * 3).at(5) == pytest.approx((0.4, 0.6))  # 0.1 absolute
    assert band_from_seeds("tokens", same).at(5) == (2.0, 2.0)  # no floor for a number without one
    assert band_from_seeds("loss", [{5: -2.0}] * 3).at(5) == pytest.approx((-2.01, -1.99))  # of |value|
    # of the largest in size, not the median (1000.0): 0.5 % of 1000.1 on each side of the extremes
    close = [{5: 1000.0}, {5: 1000.0}, {5: 1000.1}]
    assert band_from_seeds("loss", close).at(5) == pytest.approx((1000.0 - 5.0005, 1000.1 + 5.0005), abs=1e-9)


def test_a_band_has_the_steps_every_seed_logged_finitely_and_needs_two_seeds():
    band = band_from_seeds("loss", [{1: 2.0, 2: 1.5, 3: 1.0}, {1: 2.1, 2: math.nan, 3: 1.1}, {1: 2.2, 3: 1.2, 4: 9.0}])
    assert band.steps == [1, 3]
    assert band_from_seeds("loss", [{1: 2.0}]) is None and band_from_seeds("loss", []) is None
    assert band_from_seeds("loss", [{1: 2.0}, {2: 2.0}]) is None  # no step in common


def test_a_value_on_a_bands_edge_is_inside_and_a_non_finite_one_above():
    band = Band([10], [1.0], [1.5], [2.0])
    assert [band.side(10, v) for v in (1.0, 2.0, math.nan, math.inf, -math.inf)] == [0, 0, 1, 1, 1]
    assert band.side(10, None) is None and band.side(20, 1.5) is None and band.at(20) is None


def test_only_banded_numbers_get_bands_and_a_number_logged_as_a_string_is_not_one():
    runs = [
        [{"step": 1, "loss": 2.0 + s, "tokens": 5, "update_ratio/embed": 0.01, "val_loss": "n/a"}] for s in (0, 0.1)
    ]
    assert sorted(bands_from_runs(runs)) == ["loss", "update_ratio/embed"]


def _banded(**bands):
    return Reference(
        "r",
        "a tiny recipe",
        "nanolm train",
        "fp32",
        [1, 2, 3, 4, 5],
        "a CPU",
        "2026-12-05",
        "2.13",
        {"run": {}},
        {k: Band(steps, lo, [(a + b) / 2 for a, b in zip(lo, hi)], hi) for k, (steps, lo, hi) in bands.items()},
    )


def test_a_training_number_must_stay_out_two_logged_steps_running_and_an_evaluation_once():
    ref = _banded(
        loss=([1, 2, 3, 4, 5], [0.0] * 5, [1.0] * 5),
        val_loss=([2, 4], [0.0] * 2, [1.0] * 2),
        lr=([1, 2, 3], [0.0] * 3, [1.0] * 3),
    )
    one_batch = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 1.5}, {"step": 3, "loss": 0.5}]
    assert departures(ref, one_batch) == []  # one noisy batch is not a departure
    flipping = [{"step": 1, "loss": 1.5}, {"step": 2, "loss": -0.5}, {"step": 3, "loss": 0.5}]
    assert departures(ref, flipping) == []  # above then below: two departures of one step each
    lasting = [
        {"step": 1, "loss": 0.5},
        {"step": 2, "loss": 1.5},
        {"step": 3, "loss": 1.6},
        {"step": 4, "loss": 1.7},
        {"step": 5, "loss": 0.5},
    ]
    (d,) = departures(ref, lasting)
    assert (d.key, d.step, d.value, d.lo, d.hi, d.side, d.until) == ("loss", 2, 1.5, 0.0, 1.0, 1, 4)
    assert d.describe() == "loss above its band from step 2 (1.5 against 0..1)"
    evals = [{"step": 2, "val_loss": -0.1}, {"step": 3, "lr": 2.0}, {"step": 4, "val_loss": 0.5}]
    found = departures(ref, evals)
    assert [(d.key, d.step, d.side, d.until) for d in found] == [("val_loss", 2, -1, 2), ("lr", 3, 1, 3)]
    assert found[0].describe().startswith("val_loss below its band from step 2")
    skipped = [{"step": 2, "loss": True}, {"step": 3, "loss": None}, {"step": 3, "loss": "x"}]
    assert departures(ref, skipped) == []


def test_departures_come_earliest_first_an_evaluation_before_a_training_number_at_one_step():
    ref = _banded(
        loss=([1, 2, 3], [0.0] * 3, [1.0] * 3),
        grad_norm=([1, 2, 3], [0.0] * 3, [1.0] * 3),
        val_loss=([2], [0.0], [1.0]),
        val_bpb=([2], [0.0], [1.0]),
    )
    rows = [
        {"step": 1, "loss": 0.5, "grad_norm": 2.0},
        {"step": 2, "loss": 2.0, "grad_norm": 2.0, "val_loss": 2.0, "val_bpb": 2.0},
        {"step": 3, "loss": 2.0, "grad_norm": 0.5},
    ]
    assert [(d.key, d.step) for d in departures(ref, rows)] == [
        ("grad_norm", 1),
        ("val_bpb", 2),
        ("val_loss", 2),
        ("loss", 2),
    ]


def test_the_closest_reference_differs_in_at_most_three_options_on_the_same_data_and_format():
    def setup(**train):
        return {"run": {"data_digest": "d", "precision": "fp32"}, "train": {"lr": 1, "steps": 10, **train}}

    def ref(name, s):
        return dataclasses.replace(_banded(), name=name, title=f"recipe {name}", setup=s)

    refs = [
        ref("b", setup(lr=2)),
        ref("a", setup(lr=3)),
        ref("c", setup(lr=2, steps=20, x=1, y=2)),
        ref("other", {**setup(), "run": {"data_digest": "e", "precision": "fp32"}}),
    ]
    found = reference.closest_reference(setup(), refs)
    assert found[0].name == "a" and found[1] == ["train.lr"]  # one option each: the first by name
    assert reference.closest_reference(setup(), refs[2:3]) is None  # four options apart
    assert reference.closest_reference(setup(lr=2, steps=20, x=1), refs[2:3])[1] == ["train.y"]
    assert reference.closest_reference(setup(), refs[3:]) is None  # other data: not close, whatever the options
    assert reference.no_reference_line(setup(), refs).endswith("; the closest, recipe a (fp32), differs in train.lr")
    assert reference.no_reference_line(setup(), []).endswith("no band is checked")
    assert reference.differences({"a": {"x": 1}}, {"a": {"x": 1, "y": 2}, "b": {"z": 3}}) == ["a.y", "b.z"]
    assert reference.differences({"a": {"x": 1}, "c": {"w": 1}}, {"a": {"x": 2}}) == ["a.x", "c.w"]
    assert reference.closest_reference(setup(x=1), refs[2:3])[1] == ["train.lr", "train.steps", "train.y"]  # three
    assert reference.closest_reference(setup(), [refs[3], *refs[:2]])[0].name == "a"  # past one on other data
    assert reference.no_reference_line(setup(x=1), refs[2:3]).endswith("differs in train.lr, train.steps, train.y")


def test_a_reference_of_another_format_is_refused_and_one_without_a_curve_says_so():
    data = _banded(loss=([1], [0.0], [1.0])).to_json()
    assert Reference.from_json(data).describe() == (
        "a tiny recipe (fp32, band over 5 seeds, measured 2026-12-05 on a CPU)"
    )
    with pytest.raises(ValueError, match="reference format 2, expected 1"):
        Reference.from_json({**data, "format": 2})
    with pytest.raises(ValueError, match="reference format None"):
        Reference.from_json({k: v for k, v in data.items() if k != "format"})


def test_the_band_watch_says_since_when_it_is_outside_and_forgets_it_back_inside():
    watch = BandWatch(_banded(val_loss=([1, 2, 3, 4], [0.0] * 4, [1.0] * 4)))
    assert watch.update(1, 0.5) == {"val_band_lo": 0.0, "val_band_hi": 1.0, "val_band_side": 0}
    assert watch.update(2, 1.5)["val_band_since"] == 2
    assert watch.update(3, 1.7)["val_band_since"] == 2  # still above: since its first step outside
    below = watch.update(4, -1.0)
    assert below["val_band_side"] == -1 and below["val_band_since"] == 4
    assert watch.update(9, 0.5) == {}  # no band at this step
    first_above = BandWatch(watch.reference)
    assert first_above.update(1, 1.5)["val_band_since"] == 1  # outside from its first evaluation
    first_above.resume([{"step": 1, "val_loss": 1.5}])
    assert (first_above.side, first_above.since) == (1, 1)
    watch.resume([{"step": 1, "val_loss": 0.5}, {"step": 2, "val_loss": 1.5}, {"step": 3, "loss": 9.0}])
    assert (watch.side, watch.since) == (1, 2) and watch.update(3, 0.5) == {
        "val_band_lo": 0.0,
        "val_band_hi": 1.0,
        "val_band_side": 0,
    }
    assert format_band({"val_band_lo": 0.25, "val_band_hi": 0.5, "val_band_side": 0}) == " | band 0.2500..0.5000 inside"
    assert (
        format_band({"val_band_lo": 0.25, "val_band_hi": 0.5, "val_band_side": -1, "val_band_since": 4})
        == " | band 0.2500..0.5000 below since step 4"
    )
    assert (
        format_band({"val_band_lo": 0.25, "val_band_hi": 0.5, "val_band_side": 1, "val_band_since": 2})
        == " | band 0.2500..0.5000 above since step 2"
    )
    assert format_band({}) == ""


def _curve_row(excess, side, own_seed, t=5.0, tail=1e-4):
    return {
        "step": 300,
        "val_curve_since": 100,
        "val_curve_excess": excess,
        "val_curve_t": t,
        "val_curve_tail": tail,
        "val_curve_side": side,
        "val_curve_own_seed": own_seed,
    }


def test_the_evaluation_line_gives_the_curves_departure_in_words():
    assert (
        format_band(_curve_row(math.log(1.062), 1, 0))
        == " | +6.2 % above the seeds' mean since step 100, a healthy run 1 in 10,000"
    )
    assert (
        format_band(_curve_row(math.log(0.95), -1, 1, t=-5.0))
        == " | -5.0 % below its seed's reference run since step 100, a rerun 1 in 10,000"
    )
    assert format_band(_curve_row(math.log(1.001), 0, 0, t=0.3, tail=0.4)) == " | +0.1 % vs seeds"
    assert format_band(_curve_row(math.log(1.001), 0, 1, t=0.3, tail=0.4)) == " | +0.1 % vs its seed"
    both = {
        **_curve_row(math.log(1.001), 0, 1, t=0.3, tail=0.4),
        "val_band_lo": 0.25,
        "val_band_hi": 0.5,
        "val_band_side": 0,
    }
    assert format_band(both) == " | band 0.2500..0.5000 inside | +0.1 % vs its seed"


@pytest.mark.kernels
def test_a_run_is_judged_against_its_own_seed_when_the_reference_trained_it_else_against_the_seeds():
    rng = random.Random(3)
    steps = (100, 200, 300)
    firsts = {s: {t: 2.0 / (1 + t / 100) * (1 + rng.gauss(0, 0.02)) for t in steps} for s in range(1, 9)}
    reruns = {s: {t: v * (1 + rng.gauss(0, 0.001)) for t, v in c.items()} for s, c in firsts.items()}
    ref = dataclasses.replace(
        _banded(),
        curve=curve_from_seeds("val_loss", list(firsts.values())),
        curve_seeds=list(firsts),
        seed_curves=seed_curves_from_runs("val_loss", firsts, reruns),
    )
    rows = [{"step": 0, "seed": 3, "val_loss": 9.0}] + [{"step": t, "val_loss": v * 1.03} for t, v in firsts[3].items()]
    own = reference.curve_looks(ref, rows)
    assert [look.step for look in own] == [100, 200, 300] and all(look.own_seed for look in own)
    assert (
        reference.curve_departure(ref, rows) == own[-1] and own[-1].departs
    )  # 3 % against its own run: the latest look
    among = reference.curve_looks(ref, rows[1:])  # no step-0 row: the seed is unknown
    assert not any(look.own_seed for look in among) and reference.population_look(ref, rows) == among[-1]
    assert not reference.curve_looks(ref, rows, seed=42)[-1].own_seed  # a seed the reference never trained
    assert reference.curve_looks(ref, rows, seed=5)[-1].own_seed  # the seed given wins over the row's
    assert reference.curve_departure(ref, [{"step": t, "val_loss": v} for t, v in firsts[3].items()]) is None
    own_only = dataclasses.replace(ref, curve=None)  # its seeds' own curves without the test among seeds
    assert [look.own_seed for look in reference.curve_looks(own_only, rows)] == [True] * 3
    bpb = dataclasses.replace(ref, curve=curve_from_seeds("val_bpb", list(firsts.values())), seed_curves=None)
    bpb_rows = [{"step": t, "val_bpb": v * 1.03} for t, v in firsts[3].items()]
    assert len(reference.curve_looks(bpb, bpb_rows)) == 3  # the curve's own number, whatever it is
    bare = dataclasses.replace(ref, curve=None, seed_curves=None)
    assert reference.curve_looks(bare, rows) == [] and reference.population_look(bare, rows) is None
    assert reference.curve_departure(bare, rows) is None
    watch = BandWatch(ref, seed=3)
    keys = [watch.update(t, v * 1.03) for t, v in firsts[3].items()][-1]
    assert keys["val_curve_own_seed"] == 1 and keys["val_curve_since"] == 100 and keys["val_curve_side"] == 1
    assert keys["val_curve_excess"] == pytest.approx(math.log(1.03), abs=0.002) and keys["val_curve_tail"] < 0.01
    assert BandWatch(ref).update(150, 1.0) == {}  # not an evaluation of the curve
    assert ref.describe() == "a tiny recipe (fp32, band over 5 seeds, its curve over 8, measured 2026-12-05 on a CPU)"
    assert (
        reference.reference_for_digest(ref.digest, [ref]) is ref and reference.find_reference(ref.setup, [ref]) is ref
    )
    assert reference.reference_for_digest(None, [ref]) is None and reference.reference_for_digest("", [ref]) is None
    assert reference.reference_for_digest("0" * 16, [ref]) is None
    assert Reference.from_json(json.loads(json.dumps(ref.to_json()))) == ref  # the curve and the seeds' own curves too


def _changed(value):
    """Another value of the same kind, for any option's value."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return 7
    return [*value, 1] if isinstance(value, (list, tuple)) else {"other": 1}


def test_every_option_counts_in_a_runs_setup_except_those_named_not_to():
    """Option by option: changing one the reference does not count (the seed, where a run writes,
    what it logs, how fast it runs...) leaves the setup as it was; changing any other one makes a
    different setup, so a band is never applied to a run it was not measured on."""
    base = RunConfig.resolved(tiny_recipe("d.txt", "out", 1))
    before = setup_of(base, "d", "fp32", "cpu", 1)
    for section, options in base.to_dict().items():
        for option, value in options.items():
            part = dataclasses.replace(getattr(base, section), **{option: _changed(value)})
            after = setup_of(dataclasses.replace(base, **{section: part}), "d", "fp32", "cpu", 1)
            ignored = section in reference.SECTIONS_NOT_COUNTED or option in reference.NOT_COUNTED.get(section, set())
            ignored &= (section, option) != ("train", "eval_windows")  # counted as run.val_windows, its size
            assert (after == before) == ignored, f"{section}.{option}"
    assert setup_of(base, "d", "fp32", "cpu", 2) != before and setup_of(base, "d", "fp32", "cuda", 1) != before
    assert before["run"]["val_windows"] == (base.train.eval_windows or reference.DEFAULT_EVAL_WINDOWS)
    unset = dataclasses.replace(base, train=dataclasses.replace(base.train, eval_windows=None))
    assert setup_of(unset, "d", "fp32", "cpu", 1)["run"]["val_windows"] == reference.DEFAULT_EVAL_WINDOWS
    assert reference.setup_digest(before) == reference.setup_digest(setup_of(base, "d", "fp32", "cpu", 1))
    reordered = {section: dict(reversed(list(options.items()))) for section, options in reversed(list(before.items()))}
    assert reference.setup_digest(reordered) == reference.setup_digest(before)  # a setup read back from a file
    assert len(reference.setup_digest(before)) == 16 and reference.setup_digest(before) != reference.setup_digest(
        setup_of(base, "e", "fp32", "cpu", 1)
    )


def test_a_bands_middle_is_the_median_of_any_number_of_seeds_rounded_to_nine_figures():
    five = band_from_seeds("val_loss", [{5: v} for v in (1.0, 1.1, 1.7, 1.2, 1.5)])
    assert five.mid == [1.2]
    odd_digits = band_from_seeds("val_loss", [{5: v} for v in (1.00000000041, 1.00000000042, 1.00000000043)])
    assert odd_digits.mid == [1.0]  # the middle is rounded to nine figures, not pushed outward like an edge
    assert reference._round(math.inf, +1) == math.inf and reference._round(-math.inf, -1) == -math.inf
    assert reference._round(1.0000000004, +1) == 1.00000001 and reference._round(1.0000000004, -1) == 1.0
    assert reference._round(-2.0000000004, -1) == -2.00000001 and reference._round(123.4567891, 0) == 123.456789


def test_a_departure_is_found_after_rows_without_the_number_and_across_a_flip_of_sides():
    ref = _banded(loss=([1, 2, 3, 4], [0.0] * 4, [1.0] * 4), val_loss=([2, 4], [0.0] * 2, [1.0] * 2))
    sparse = [
        {"step": 1, "loss": 0.5},
        {"step": 2, "loss": 0.5},
        {"step": 3, "loss": 0.5},
        {"step": 4, "val_loss": 3.0},
    ]
    assert [(d.key, d.step) for d in departures(ref, sparse)] == [("val_loss", 4)]
    later_band = _banded(loss=([2, 3, 4], [0.0] * 3, [1.0] * 3))  # no band at step 1
    unbanded_first = [{"step": 1, "loss": 9.0}, {"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.6}]
    assert [(d.key, d.step) for d in departures(later_band, unbanded_first)] == [("loss", 2)]
    flip = [{"step": 1, "loss": 1.5}, {"step": 2, "loss": -0.5}, {"step": 3, "loss": -0.6}]
    (d,) = departures(ref, flip)
    assert (d.step, d.side, d.until) == (2, -1, 3) and d.describe().startswith("loss below its band from step 2")


def test_a_reference_without_a_curve_writes_none():
    data = _banded(loss=([1], [0.0], [1.0])).to_json()
    assert "curve" not in data and "seed_curves" not in data and set(data["bands"]) == {"loss"}
    assert set(data["bands"]["loss"]) == {"steps", "lo", "mid", "hi"}


def test_a_bf16_run_is_judged_among_seeds_not_against_its_own_seeds_curve():
    """bf16 products are rounded by other units on another CPU (AMX, AVX512-BF16, emulation), and a
    seed's run there differs from its reference run by more than a rerun does (docs/benchmarks.md,
    the shipped references on other CPUs): no bf16 reference holds an own-seed test."""
    from nanolm.watch.reference import shipped_references

    bf16 = [ref for ref in shipped_references() if ref.precision == "bf16"]
    assert bf16 and all(ref.seed_curves is None for ref in bf16)
