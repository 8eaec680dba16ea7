"""``nanolm compare``: the course's accumulation exercise as a verdict.

Batch 8 and batch 2 with ``--grad-accum 4`` train the same thing (the same windows each step,
every token's loss divided by the step's token count): compare says so, exit 0. The same pair
with the accumulation bug (each micro-batch's loss not divided by the accumulation count) is
named as different at step 1, exit 1. Different seeds agree within seed noise; different
setups are named; a directory that is not a run is one line, exit 2, as with ``diff``.
"""

from pathlib import Path
from unittest import mock

import pytest
from conftest import run_cli, tiny_run_config
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolm.errors import NanolmError
from nanolm.instruments.compare import RunRecord, compare_records, compare_runs, find_parting
from nanolm.instruments.faults import components
from nanolm.train import train
from nanolm.watch.reference import setup_of, shipped_references
from nanolm.watch.sinks import read_metrics


def run(data, out, batch_size=8, grad_accum=1, seed=1, steps=30, eval_windows=16, **debug):
    cfg = tiny_run_config(data, out, steps=steps, eval_every=10, seed=seed, batch_size=batch_size,
                          grad_accum=grad_accum, eval_batches=None, eval_windows=eval_windows, threads=1)
    for k, v in debug.items():
        setattr(cfg.debug, k, v)
    train(cfg, log=lambda *_: None, components=components(cfg))
    return out


@pytest.fixture(scope="module")
def big_batch(tmp_path_factory, stories_file):
    return run(stories_file, tmp_path_factory.mktemp("compare") / "batch8")


def test_batch_times_four_equals_batch_with_grad_accum_four(big_batch, stories_file, tmp_path):
    accum = run(stories_file, tmp_path / "batch2x4", batch_size=2, grad_accum=4)
    result = compare_runs(big_batch, accum)
    assert result.kind == "same_training" and result.agree, result.lines
    assert "the batch is split differently" in result.lines[0]
    proc = run_cli("compare", big_batch, accum)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("verdict: they agree (exit 0)"), proc.stdout


def test_a_batch_split_differently_scores_the_same_validation_set_and_compares_it(stories_file, tmp_path):
    """The validation set is a number of windows, not of batches: batch 8 and batch 2 x
    grad_accum 4 score the same windows with the options left at their defaults, so the course's
    exercise compares validation curves too (it used to say "the validation sets differ")."""
    whole = run(stories_file, tmp_path / "b8", eval_windows=None)
    split = run(stories_file, tmp_path / "b2x4", batch_size=2, grad_accum=4, eval_windows=None)
    result = compare_runs(whole, split)
    assert result.agree and not any("not compared" in line for line in result.lines), result.lines
    val = [[r["val_loss"] for r in read_metrics(d / "metrics.jsonl") if "val_loss" in r] for d in (whole, split)]
    assert len(val[0]) == 4 and val[0] == pytest.approx(val[1], rel=1e-4)


def test_the_accumulation_bug_parts_the_curves_at_its_first_step(big_batch, stories_file, tmp_path):
    broken = run(stories_file, tmp_path / "batch2x4_bug", batch_size=2, grad_accum=4, loss_not_averaged=True)
    result = compare_runs(big_batch, broken)
    assert not result.agree and result.parted_at == 1, result.lines
    assert "they part at step 1: grad_norm" in result.lines[-1]
    proc = run_cli("compare", big_batch, broken)
    assert proc.returncode == 1 and "they part at step 1" in proc.stdout


def test_different_seeds_agree_within_the_noise_the_runs_show(big_batch, stories_file, tmp_path):
    other = run(stories_file, tmp_path / "seed2", seed=2)
    result = compare_runs(big_batch, other)
    assert result.kind == "seeds" and result.agree, result.lines
    assert "estimated from the runs" in result.lines[1]


def test_a_run_far_from_the_other_seed_differs(big_batch, stories_file, tmp_path):
    broken = run(stories_file, tmp_path / "unshifted", seed=2, unshifted_targets=True)
    result = compare_runs(big_batch, broken)
    assert result.kind == "seeds" and not result.agree, result.lines


def test_different_setups_are_named(big_batch, stories_file, tmp_path):
    cfg = tiny_run_config(stories_file, tmp_path / "lr", steps=30, eval_every=10, seed=1, batch_size=8,
                          eval_batches=2, threads=1)
    cfg.optim.lr = 1e-2
    train(cfg, log=lambda *_: None)
    result = compare_runs(big_batch, tmp_path / "lr")
    assert result.kind == "different_setups" and not result.agree
    assert "optim.lr (0.003 vs 0.01)" in result.lines[0]


def test_bad_input_is_one_line_and_exit_2(big_batch, tmp_path):
    proc = run_cli("compare", big_batch, tmp_path / "nothing")
    assert proc.returncode == 2 and "is not a run directory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def rows(values):
    return [{"step": 10 * i, "loss": v} for i, v in enumerate(values, 1)]


def test_rounding_that_grows_step_by_step_is_not_a_parting_and_a_jump_is():
    same = rows([2.0, 1.5, 1.2, 1.0, 0.9])
    drifting = rows([2.0, 1.5 * (1 + 3e-7), 1.2 * (1 + 4e-6), 1.0 * (1 + 2e-4), 0.9 * (1 + 3e-3)])
    assert find_parting(same, drifting, ["loss"]) == (None, 40)  # 1e-7, 4e-6, then past 1e-4: amplified rounding
    jumping = rows([2.0, 1.5, 1.2 * 1.01, 1.0, 0.9])
    parting, drift = find_parting(same, jumping, ["loss"])
    assert parting[:2] == (30, "loss") and drift is None
    assert find_parting(same, same, ["loss"]) == (None, None)


_FACTORS = st.sampled_from([0.0, 1e-7, -1e-7, 3e-6, -3e-6, 2e-4, -2e-4, 0.01, -0.01, 0.3, -0.3])
_SPLITS = [(8, 1), (4, 2), (2, 4)]


@st.composite
def run_pairs(draw):
    """Two runs' records as compare reads them: the same logged steps (some missing or twice in one),
    the second run's numbers the first's times 1 + a factor per number, from rounding to a jump;
    the same or another seed, batch split, validation set size or learning rate."""
    n = draw(st.integers(4, 30))
    curve = draw(st.lists(st.floats(0.2, 6.0), min_size=n, max_size=n))
    first = [{"step": 10 * i, "loss": v, "grad_norm": 1.0 + v / 10, "lr": 1e-3,
              **({"val_loss": v * 1.05} if i % 3 == 0 else {})} for i, v in enumerate(curve, 1)]
    second = []
    for row in first:
        if draw(st.integers(0, 9)) == 0:
            continue  # a step the second run did not log
        second.append({k: (v if k == "step" else v * (1 + draw(_FACTORS))) for k, v in row.items()})
    if second and draw(st.booleans()):  # a step logged twice (a merged or hand-edited log): its last row counts
        twice = draw(st.sampled_from(second))
        second.insert(second.index(twice), {**twice, "loss": twice["loss"] * draw(st.sampled_from([0.7, 0.99, 1.01, 1.3]))})
    records = []
    for rows in (first, second):
        batch, accum = draw(st.sampled_from(_SPLITS))
        cfg = tiny_run_config("d.txt", "run", seed=draw(st.sampled_from([1, 2])), batch_size=batch, grad_accum=accum,
                              eval_batches=None, eval_windows=draw(st.sampled_from([16, 16, 32])))
        cfg.optim.lr = draw(st.sampled_from([1e-3, 1e-3, 1e-3, 2e-3]))
        cfg = cfg.resolved()
        records.append(RunRecord(Path("run"), cfg, rows, setup_of(cfg, "digest", "fp32", "cpu", 1)))
    return records


def _verdict(a, b):
    try:
        result = compare_records(a, b)
    except NanolmError as e:
        return ("refused", str(e))
    tolerance = [line for line in result.lines if line.startswith("tolerance:")]
    return (result.kind, result.agree, result.parted_at, tolerance)


@settings(max_examples=300, deadline=None)
@given(pair=run_pairs(), banded=st.booleans())
def test_compare_gives_the_same_verdict_and_tolerance_whichever_run_is_named_first(pair, banded):
    """``nanolm compare A B`` and ``nanolm compare B A``: the same kind of comparison, verdict,
    step where they part and tolerance, with and without a reference band to judge seeds by."""
    a, b = pair
    band = shipped_references()[0] if banded else None
    with mock.patch("nanolm.instruments.compare.find_reference", return_value=band):
        assert _verdict(a, b) == _verdict(b, a)
