"""`nanolm sweep`: one short run per learning rate, and the largest stable one recommended."""

import pytest
from conftest import run_cli, run_main

from nanolm.errors import NanolmError
from nanolm.instruments.sweep import parse_lrs, recommend
from nanolm.optim import muon_available
from nanolm.run.config import load_toml

TINY = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--tokenizer",
    "char",
    "--eval-every",
    "30",
    "--eval-batches",
    "2",
    "--steps",
    "60",
]


def test_lrs_are_parsed_sorted_and_checked():
    assert parse_lrs("3e-3, 1e-3,1e-2") == [1e-3, 3e-3, 1e-2]
    for bad in ["1e-3,abc", "1e-3,-1", "0", "1e-3,1e-3", ",", "nan"]:
        with pytest.raises(NanolmError, match="--lrs"):
            parse_lrs(bad)


def _row(lr, loss, *unstable):
    return {"lr": lr, "final_loss": loss, "unstable_because": list(unstable)}


def test_recommendation_is_the_largest_stable_rate_within_tolerance_of_the_best():
    rows = [_row(1e-3, 2.0), _row(3e-3, 1.5), _row(1e-2, 1.6), _row(3e-2, 1.2, "loss_spike")]
    assert recommend(rows, 0.1) == 1e-2  # 3e-2 is best but spiked; 1e-2 is within 10 % of 1.5
    assert recommend(rows, 0.05) == 3e-3  # 1.6 is more than 5 % above 1.5
    assert recommend([_row(1e-1, None, "non_finite")], 0.1) is None


def test_sweep_trains_each_rate_and_names_the_largest_stable(tmp_path, stories_file):
    out = tmp_path / "sweep"
    r = run_cli("sweep", "--lrs", "1e-3,1e-2,3", "--out", out, "--data", stories_file, *TINY, "--no-report")
    assert r.returncode == 0, r.stderr
    for lr in ("0.001", "0.01", "3"):
        assert (out / f"lr_{lr}" / "metrics.jsonl").is_file()
    table = (out / "sweep.md").read_text()
    assert "| 3 | " in table and "unstable" in table.split("| 3 | ")[1].splitlines()[0]
    assert "Recommended: --lr 0.01" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lrs", "1e-3,x"], "--lrs: 'x' is not a number"),
        (["--lrs", "1e-3", "--lr", "1e-2"], "do not pass --lr"),
        (["--lrs", "1e-3", "--out-dir", "elsewhere"], "do not pass --out-dir"),
    ],
)
def test_sweep_user_errors_are_one_line_and_write_nothing(tmp_path, args, message):
    r = run_main("sweep", "--out", tmp_path / "sweep", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "sweep").exists()


@pytest.mark.skipif(not muon_available(), reason="torch.optim.Muon needs PyTorch >= 2.9")
def test_a_muon_sweep_moves_both_rates_together(tmp_path, stories_file):
    """Without --muon-lr, Muon's rate follows --lr (the same rate is a step of the same size),
    so one sweep tunes both optimizers of a Muon run."""
    out = tmp_path / "sweep"
    r = run_cli(
        "sweep",
        "--lrs",
        "1e-3,1e-2",
        "--out",
        out,
        "--data",
        stories_file,
        *TINY,
        "--steps",
        "10",
        "--optimizer",
        "muon",
        "--no-report",
    )
    assert r.returncode == 0, r.stderr
    for lr in ("0.001", "0.01"):
        optim = load_toml(out / f"lr_{lr}" / "config.toml")["optim"]
        assert optim["optimizer"] == "muon" and optim["lr"] == optim["muon_lr"] == float(lr)


def test_a_sweep_into_an_out_that_holds_one_of_its_rates_trains_none(tmp_path, stories_file):
    """A second sweep on the same --out would mix its runs with the first one's: it starts none."""
    (tmp_path / "sweep" / "lr_0.01").mkdir(parents=True)
    r = run_cli("sweep", "--lrs", "1e-3,1e-2", "--out", tmp_path / "sweep", "--data", stories_file, *TINY)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: {tmp_path / 'sweep' / 'lr_0.01'} already exists; choose another --out"
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["lr_0.01"]
