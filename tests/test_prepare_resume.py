"""A prepare killed and run again continues from its last finished piece and ends byte for byte
where an uninterrupted prepare ends; a source or a setting that changed meanwhile starts it over,
said in one line; a training run on raw text continues its preparation the same way."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import crash_points
import pytest
from conftest import run_main
from crash_points import every_crash_point, run_under

import nanolm.data.prepare as prepare_mod
from nanolm.base import disk
from nanolm.data.pieces import PROGRESS_FILE, Progress
from nanolm.data.prepare import prepare, unfinished_work_dir
from nanolm.data.shards import PreparedData
from nanolm.tokenizer import EOS, Tokenizer

PIECE = 2_000  # characters a piece: the corpus below is a dozen pieces
DOCS = [f"Story {i}: a {'red' if i % 2 else 'blue'} fox ran {i % 9} laps.\nIt slept." for i in range(400)]


def _corpus(path, docs=DOCS):
    path.write_text(f"\n{EOS}\n".join(docs), encoding="utf-8")
    return path


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(prepare_mod, "PIECE_CHARS", PIECE)


@pytest.fixture
def encoded(monkeypatch):
    """Every document the tokenizer encodes, counted."""
    count = []
    real = Tokenizer.encode_batch

    def counting(self, texts):
        count.append(len(texts))
        return real(self, texts)

    monkeypatch.setattr(Tokenizer, "encode_batch", counting)
    return count


def _prepare(source, out, **kw):
    return prepare(source, out, "char", progress=False, log=kw.pop("log", lambda *_: None), **kw)


def _record_steps(source, out) -> list[int]:
    """The disk steps (1-based) at which a prepare into ``out`` writes its progress record."""
    plan = disk.FaultPlan()
    with disk.faults(plan):
        _prepare(source, out)
    shutil.rmtree(out)
    return [k for k, (kind, path) in enumerate(plan.steps, 1) if kind == "rename" and path.endswith(PROGRESS_FILE)]


@pytest.mark.parametrize("share", [0.1, 0.5, 0.9])
def test_a_prepare_killed_part_way_continues_and_ends_byte_identical_redoing_at_most_one_piece(
    tmp_path, small_pieces, encoded, share
):
    source = _corpus(tmp_path / "corpus.txt")
    whole = _prepare(source, tmp_path / "whole")
    records = _record_steps(source, tmp_path / "out")
    assert len(records) >= 9, records  # the tokenizer's record, then one per piece but the last
    stop_at = records[round(share * (len(records) - 1))] + 3  # inside the next piece's writes
    encoded.clear()
    with disk.faults(disk.FaultPlan(at=stop_at)), pytest.raises(disk.Stopped):  # kill -9 there
        _prepare(source, tmp_path / "out")
    before_kill = sum(encoded)
    kept = Progress.load(next(tmp_path.glob(".out.prepare-*")))
    assert kept is not None and 0 < kept.documents_read < len(DOCS) if share > 0.1 else kept is not None
    lines = []
    data = _prepare(source, tmp_path / "out", log=lines.append)
    assert any("continuing the interrupted prepare" in line for line in lines), lines
    assert data.digest == whole.digest  # every file, byte for byte
    assert PreparedData(tmp_path / "out").meta["splits"] == whole.meta["splits"]
    redone = sum(encoded) - len(DOCS)
    assert 0 <= redone <= before_kill - kept.documents_read <= PIECE // 40 + 2, (redone, before_kill, kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out", "whole"]


def test_a_source_that_changed_since_the_kill_is_named_and_the_prepare_starts_over(tmp_path, small_pieces):
    source = _corpus(tmp_path / "corpus.txt")
    stop_at = _record_steps(source, tmp_path / "out")[5] + 3
    with disk.faults(disk.FaultPlan(at=stop_at)), pytest.raises(disk.Stopped):
        _prepare(source, tmp_path / "out")
    _corpus(source, DOCS[::-1])  # edited: other bytes, whatever the size
    lines = []
    data = _prepare(source, tmp_path / "out", log=lines.append)
    assert any("corpus.txt changed (its size or modification time); starting over" in line for line in lines), lines
    assert not any(line.startswith("prepare: continuing") for line in lines)
    assert data.digest == _prepare(source, tmp_path / "fresh").digest  # the new text only, never a mix


def test_a_shard_removed_or_a_setting_changed_since_the_kill_starts_over_and_says_why(tmp_path, small_pieces):
    shards = tmp_path / "shards"
    shards.mkdir()
    _corpus(shards / "a.txt", DOCS[:200])
    _corpus(shards / "b.txt", DOCS[200:])
    stop_at = _record_steps(shards, tmp_path / "out")[3] + 3
    for change, said in (
        (lambda: (shards / "b.txt").unlink(), "its shard b.txt is gone"),
        (None, "it was asked with another val_fraction"),
    ):
        with disk.faults(disk.FaultPlan(at=stop_at)), pytest.raises(disk.Stopped):
            _prepare(shards, tmp_path / "out")
        lines = []
        if change:
            change()
            _prepare(shards, tmp_path / "out", log=lines.append)
        else:
            _prepare(shards, tmp_path / "out", log=lines.append, val_fraction=0.2)
        assert any(said in line and "starting over" in line for line in lines), lines
        _corpus(shards / "b.txt", DOCS[200:])


KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import nanolm.data.prepare as prepare_mod
    from nanolm.data.pieces import Progress
    prepare_mod.PIECE_CHARS = {piece}
    saves = []
    real_save = Progress.save
    def save_then_die(self, directory):
        real_save(self, directory)
        saves.append(1)
        if len(saves) == {kill_after}:
            os.kill(os.getpid(), signal.SIGKILL)
    Progress.save = save_then_die
    prepare_mod.prepare(sys.argv[1], sys.argv[2], "char", progress=False)
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL is a POSIX signal")
def test_a_prepare_killed_with_sigkill_continues_to_the_same_bytes(tmp_path, small_pieces):
    """A real ``kill -9`` (no cleanup, no finally) half-way, then the same prepare in another process."""
    source = _corpus(tmp_path / "corpus.txt")
    script = KILLER.replace("{piece}", str(PIECE)).replace("{kill_after}", "7")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script, str(source), str(tmp_path / "out")], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "out").exists()
    lines = []
    data = _prepare(source, tmp_path / "out", log=lines.append)
    assert any("continuing" in line for line in lines), lines
    assert data.digest == _prepare(source, tmp_path / "whole").digest


def test_a_training_run_killed_while_it_prepares_continues_the_preparation(tmp_path, small_pieces, monkeypatch):
    """``nanolm train --data RAW`` prepares where a second run finds the work: Ctrl-C during the
    encoding, then the same command continues it, and trains on the same tokens."""
    source = _corpus(tmp_path / "corpus.txt", DOCS * 2)
    saves = []
    real_save = Progress.save

    def save_then_interrupt(self, directory):
        real_save(self, directory)
        saves.append(1)
        if len(saves) == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(Progress, "save", save_then_interrupt)
    argv = ["train", "--data", source, "--tokenizer", "char", "--n-layer", "1", "--n-embd", "16", "--n-head", "2"]
    argv += ["--seq-len", "16", "--batch-size", "2", "--steps", "1", "--eval-windows", "2", "--sample-tokens", "0"]
    argv += ["--out-dir", tmp_path / "run", "--time-budget", "off"]
    first = run_main(*argv)
    assert first.returncode != 0
    assert list(unfinished_work_dir(source).glob(".data.prepare-*")), "no work kept for the next run"
    monkeypatch.setattr(Progress, "save", real_save)
    second = run_main(*argv)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "continuing the interrupted prepare" in second.stdout + second.stderr
    assert not list(unfinished_work_dir(source).iterdir())
    fresh = prepare(source, tmp_path / "fresh", "char", progress=False, seq_len=16, compressor_sample_bytes=0)
    assert PreparedData(tmp_path / "run" / "data").digest == fresh.digest


@pytest.mark.exhaustive
def test_a_prepare_of_several_pieces_stopped_or_failed_at_any_step_continues_to_the_same_bytes(tmp_path, small_pieces):
    """The crash-point enumeration of the pieces' steps: at every step of a prepare of a few
    pieces, a kill, a full disk or a failing disk; then the same prepare, which must end byte for
    byte where an uninterrupted one does, leaving nothing beside ``--out``."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(crash_points, "EVERY_FAULT", False)
    source = _corpus(tmp_path / "corpus.txt", DOCS[:120])
    whole = _prepare(source, tmp_path / "whole").digest
    work = tmp_path / "work"

    def judge(trial):
        assert trial.raised is None or isinstance(trial.raised, (disk.Stopped, OSError)), repr(trial.raised)
        assert run_under(disk.FaultPlan(), work, lambda: _prepare(source, work / "out")) is None
        assert PreparedData(work / "out").digest == whole
        assert [p.name for p in work.iterdir()] == ["out"]

    tried = every_crash_point(
        "prepare of several pieces",
        lambda: (shutil.rmtree(work, ignore_errors=True), work.mkdir()),
        lambda: _prepare(source, work / "out"),
        judge,
        work,
    )
    monkeypatch.undo()
    assert tried["stop"] >= 40, tried


@pytest.mark.parametrize(
    "damage",
    [
        lambda r: r.update(source="not a list"),
        lambda r: r.update(documents_read="many"),
        lambda r: r["splits"]["val"].update(tokens=-1),  # a count below zero, not a shorter file
        lambda r: r["splits"]["train"].update(tokens=10**12),  # more than its shard holds
    ],
)
def test_a_damaged_progress_record_starts_the_work_over_and_never_fails_it(tmp_path, small_pieces, damage):
    source = _corpus(tmp_path / "corpus.txt")
    stop_at = _record_steps(source, tmp_path / "out")[4] + 3
    with disk.faults(disk.FaultPlan(at=stop_at)), pytest.raises(disk.Stopped):
        _prepare(source, tmp_path / "out")
    record = next(tmp_path.glob(".out.prepare-*")) / PROGRESS_FILE
    raw = json.loads(record.read_text())
    damage(raw)
    record.write_text(json.dumps(raw))
    lines = []
    data = _prepare(source, tmp_path / "out", log=lines.append)
    assert not any(line.startswith("prepare: continuing") for line in lines), lines
    assert data.digest == _prepare(source, tmp_path / "whole").digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out", "whole"]
