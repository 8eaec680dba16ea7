"""`nanolm replay`: a past step, again, exactly as the run took it, and nothing written."""

import pytest
from conftest import tiny_run_config

from nanolm.errors import NanolmError
from nanolm.instruments.cli import main
from nanolm.instruments.faults import factories
from nanolm.instruments.replay import format_replay, replay
from nanolm.train import train


def _files(run_dir):
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory, stories_file):
    out = tmp_path_factory.mktemp("replay") / "run"
    cfg = tiny_run_config(stories_file, out, steps=8, eval_every=8, ckpt_every=4, keep=0, log_every=1, stats_every=0)
    cfg.model.dropout = 0.1  # the replay must continue the random streams too
    train(cfg, log=lambda *_: None)
    return out


def test_a_replayed_step_is_the_step_the_run_took_and_nothing_is_written(run):
    before = _files(run)
    report = replay(run, 7, log=lambda *_: None)
    assert report["from_checkpoint"] == "step_000004" and report["replayed_steps"] == 2
    assert report["matches_the_log"] and report["loss"] == report["logged_loss"]
    assert {"grad_norm/0", "update_ratio/0", "attn_logit_max/0"} <= report["layers"].keys()
    assert report["first_window"] and "the replay is that step" in format_replay(report)
    assert _files(run) == before


def test_a_replay_reproduces_a_nan_and_names_where_it_was_born(tmp_path, stories_file):
    out = tmp_path / "run"
    cfg = tiny_run_config(stories_file, out, steps=8, eval_every=8, ckpt_every=4, keep=0, log_every=1, stats_every=0)
    cfg.debug.inject_nan_at = 6  # the lab's one-off bad batch: part of the run's config, replayed with it
    train(cfg, log=lambda *_: None, factories=factories(cfg))
    report = replay(out, 6, log=lambda *_: None)
    assert report["loss"] != report["loss"]  # NaN
    assert "origin" in report and "rolled back from step 6 to 4" in report["note"]


def test_replay_refuses_what_it_cannot_replay_in_one_line(run, capsys):
    assert main(["replay", str(run), "--step", "3"]) == 2  # no checkpoint before step 3
    assert "no valid checkpoint before step 3" in capsys.readouterr().err
    assert main(["replay", str(run), "--step", "99"]) == 2
    assert "no step 99" in capsys.readouterr().err
    with pytest.raises(NanolmError, match="at least 1"):
        replay(run, 0)
