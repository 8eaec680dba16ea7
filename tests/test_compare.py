"""``nanolm compare``: the course's accumulation exercise as a verdict.

Batch 8 and batch 2 with ``--grad-accum 4`` train the same thing (the same windows each step,
every token's loss divided by the step's token count): compare says so, exit 0. The same pair
with the accumulation bug (each micro-batch's loss not divided by the accumulation count) is
named as different at step 1, exit 1. Different seeds agree within seed noise; different
setups are named; a directory that is not a run is one line, exit 2, as with ``diff``.
"""

import pytest
from conftest import run_cli, tiny_run_config

from nanolm.instruments.compare import compare_runs, find_parting
from nanolm.instruments.faults import components
from nanolm.train import train
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
