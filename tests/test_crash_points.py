"""Every multi-step file operation, stopped or failed at each of its disk steps (tests/crash_points.py):
after each, the old result or the new one is there, whole; the same command run again finishes it;
nothing left behind blocks that rerun or survives it; nothing of another output is touched."""

import json
import shutil
from pathlib import Path

import crash_points
import pytest
from conftest import tiny_model
from crash_points import every_crash_point, tree

from nanolm.base import disk
from nanolm.base.files import ENVIRONMENT_ERRNOS, atomic_write_text, remove_abandoned_writes
from nanolm.base.lock import LOCK_FILE, RunLock, held_by_another
from nanolm.checkpoint import (
    CHECKPOINTS,
    latest_valid_checkpoint,
    list_checkpoints,
    load_state,
    read_latest,
    save_checkpoint,
    step_of,
    verify_checkpoint,
)
from nanolm.data.shards import PreparedData
from nanolm.errors import NanolmError
from nanolm.instruments.cli import main
from nanolm.run.final import read_final, write_final
from nanolm.tokenizer import train_char


@pytest.fixture(
    autouse=True,
    params=[
        pytest.param(False, id="stop-and-one-failure-a-step"),
        pytest.param(True, id="every-fault-at-every-step", marks=pytest.mark.exhaustive),
    ],
)
def every_fault(request, monkeypatch):
    """The default suite stops each operation at every step and fails it at every step (ENOSPC and
    EIO in turn); CI's exhaustive run tries every fault at every step (crash_points.EVERY_FAULT)."""
    monkeypatch.setattr(crash_points, "EVERY_FAULT", request.param)
    return request.param


def _quiet(*_):
    pass


class ExitStatus(Exception):
    """A command that ended with a status other than 0 (it printed its one line)."""


def _command(argv):
    """Run a nanolm command in this process; a status other than 0 is raised as :class:`ExitStatus`."""
    code = main([str(a) for a in argv])
    if code:
        raise ExitStatus(code)


def _one_line_or_stopped(trial) -> None:
    """What a fault may make an operation raise: the stop itself, or one line for the user (a
    NanolmError, the OSError of the machine's state the command line prints in one line, or
    that command's status 2)."""
    e = trial.raised
    if e is None or isinstance(e, disk.Stopped):
        return
    assert not trial.stopped
    if isinstance(e, ExitStatus):
        assert e.args == (2,), repr(e)
        return
    assert isinstance(e, NanolmError) or (isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS), repr(e)


def _reset(path: Path, template: Path | None) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if template is not None:
        shutil.copytree(template, path, symlinks=True)


# ------------------------------------------------------------------ a checkpoint's save
def _checkpoint_state(step):
    return {"step": step, "sampler": {"epoch": 0, "cursor": step, "seed": 0}, "counters": {"tokens_seen": step}}


def test_a_checkpoint_save_stopped_at_any_step_leaves_the_previous_checkpoint_or_the_new_one(tmp_path):
    model, tokenizer = tiny_model(), train_char(["ab"])

    def save(run, step):
        save_checkpoint(run, step, model, _checkpoint_state(step), "[train]\n", tokenizer, keep=2)

    template = tmp_path / "template"
    for step in (1, 2):
        save(template, step)
    (template / "notes.txt").write_text("the user's own file")
    run = tmp_path / "work" / "run"

    def judge(trial):
        _one_line_or_stopped(trial)
        for _, path in list_checkpoints(run):  # every committed checkpoint is whole
            verify_checkpoint(path)
        found = latest_valid_checkpoint(run, log=_quiet)
        assert found is not None and step_of(found) in (2, 3), found
        assert load_state(found)["step"] == step_of(found)
        if trial.raised is None:
            assert step_of(found) == 3, "a save that reported success is not the newest checkpoint"
        save(run, 3)  # the same save again (the run resumed from `found` reaches step 3 again)
        assert [s for s, _ in list_checkpoints(run)] == [2, 3] and step_of(read_latest(run)) == 3
        leftovers = [p.name for p in (run / CHECKPOINTS).iterdir() if p.name.startswith(".")]
        assert not leftovers, f"left behind after the rerun: {leftovers}"
        assert (run / "notes.txt").read_text() == "the user's own file"

    tried = every_crash_point(
        "a checkpoint's save (and pruning)",
        lambda: _reset(run, template),
        lambda: save(run, 3),
        judge,
        tmp_path / "work",
    )
    assert tried["stop"] >= 15, tried  # files, syncs, renames, the pointer, the pruning


# ------------------------------------------------------------------ prepare's scratch directory and swap
def _corpus(path: Path, word: str) -> Path:
    path.write_text("\n<|endoftext|>\n".join(f"{word} story {i}: the cat sat on the mat." for i in range(40)))
    return path


def _prepare(source: Path, out: Path) -> None:
    _command(
        [
            "prepare",
            "--data",
            str(source),
            "--out",
            str(out),
            "--tokenizer",
            "char",
            "--progress",
            "lines",
            "--val-fraction",
            "0.2",
            "--seq-len",
            "16",
        ]
    )


def _prepared(out: Path, source: Path) -> bool:
    """``out`` is a whole preparation of ``source``."""
    data = PreparedData(out)  # checks every file against the sealed manifest
    return Path(data.meta["source"]).name == source.name


def test_a_prepare_stopped_at_any_step_leaves_the_old_data_or_the_new_and_its_rerun_cleans_up(tmp_path, capsys):
    old_source, new_source = _corpus(tmp_path / "old.txt", "old"), _corpus(tmp_path / "new.txt", "new")
    template = tmp_path / "template"
    _prepare(old_source, template / "data")
    # another output whose name starts like this one's scratch, and its own scratch directory
    (template / "data.prepare-v2").mkdir()
    (template / "data.prepare-v2" / "kept.txt").write_text("another output")
    (template / ".data.prepare-v2.prepare-abcd1234").mkdir()
    (template / ".data.prepare-v2.prepare-abcd1234" / "kept.txt").write_text("another output's live scratch")
    old_tree = tree(template / "data", skip=(LOCK_FILE,))
    work = tmp_path / "work"
    out = work / "data"

    def judge(trial):
        _one_line_or_stopped(trial)
        now = tree(out, skip=(LOCK_FILE,))
        assert now == old_tree or _prepared(out, new_source), "neither the old data nor the new, whole"
        if now == old_tree:
            assert _prepared(out, old_source)  # and usable as it is: what a killed prepare left does not block a run
        if trial.raised is None:
            assert _prepared(out, new_source)
        assert held_by_another(out) is None
        _prepare(new_source, out)  # the same command again
        assert _prepared(out, new_source)
        beside = sorted(p.name for p in work.iterdir())
        assert beside == [".data.prepare-v2.prepare-abcd1234", "data", "data.prepare-v2"], beside
        assert tree(work / ".data.prepare-v2.prepare-abcd1234") == {"kept.txt": b"another output's live scratch"}
        capsys.readouterr()

    tried = every_crash_point(
        "prepare over existing data", lambda: _reset(work, template), lambda: _prepare(new_source, out), judge, work
    )
    assert tried["stop"] >= 20, tried


def test_a_prepare_into_a_new_directory_stopped_at_any_step_leaves_nothing_or_the_whole_data(tmp_path, capsys):
    source = _corpus(tmp_path / "new.txt", "new")
    work = tmp_path / "work"
    out = work / "deeper" / "data"

    def judge(trial):
        _one_line_or_stopped(trial)
        if out.exists() and (out / "meta.json").exists():
            assert _prepared(out, source)
        elif out.exists():
            assert set(p.name for p in out.iterdir()) <= {LOCK_FILE}, "a half-prepared --out"
        _prepare(source, out)
        assert _prepared(out, source)
        assert [p.name for p in work.iterdir()] == ["deeper"] and sorted(p.name for p in out.parent.iterdir()) == [
            "data"
        ]
        capsys.readouterr()

    every_crash_point(
        "prepare into a new directory",
        lambda: _reset(work, None),
        lambda: _prepare(source, out),
        judge,
        tmp_path / "work",
    )


# ------------------------------------------------------------------ export's scratch directory and rename
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    source = _corpus(root / "stories.txt", "a")
    run = root / "run"
    assert (
        main(
            [
                "train",
                "--data",
                str(source),
                "--out-dir",
                str(run),
                "--tokenizer",
                "char",
                "--n-layer",
                "1",
                "--n-head",
                "2",
                "--n-embd",
                "16",
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--steps",
                "2",
                "--eval-batches",
                "1",
                "--sample-tokens",
                "0",
                "--threads",
                "1",
                "--progress",
                "lines",
            ]
        )
        == 0
    )
    return run


EXPORTED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _exported(out: Path) -> bool:
    from safetensors.torch import load_file

    if sorted(p.name for p in out.iterdir()) != EXPORTED:
        return False
    json.loads((out / "config.json").read_text())
    return bool(load_file(out / "model.safetensors"))


def test_an_export_stopped_at_any_step_leaves_no_model_or_a_whole_one_and_its_rerun_cleans_up(
    tmp_path, capsys, finished_run
):
    work = tmp_path / "work"
    template = tmp_path / "template"
    template.mkdir()
    (template / "hf.export-old").mkdir()  # another output whose name starts like this one's scratch
    out = work / "hf"

    def export():
        _command(["export", finished_run, "--out", out])

    def judge(trial):
        _one_line_or_stopped(trial)
        assert not out.exists() or _exported(out), "a half-exported model"
        if trial.raised is None:
            assert _exported(out)
        live = _live_scratch(out)  # a second export into the same --out, under way
        if out.exists():
            shutil.rmtree(out)  # the user removes it to export again (an export never overwrites)
        export()
        assert _exported(out)
        beside = sorted(p.name for p in work.iterdir())
        assert beside == sorted(["hf", "hf.export-old", live.path.name]), beside
        live.let_go()
        capsys.readouterr()

    every_crash_point("export", lambda: _reset(work, template), export, judge, work)


def _live_scratch(out):
    from nanolm.base.lock import ScratchDirectory

    return ScratchDirectory(out, "export")


# ------------------------------------------------------------------ the final weights
def test_final_weights_stopped_at_any_step_are_never_claimed_unless_whole(tmp_path):
    model = tiny_model()
    template = tmp_path / "template"
    template.mkdir()
    (template / "config.toml").write_text("[train]\n")
    train_char(["ab"]).save(template / "tokenizer.json")
    write_final(template, tiny_model(seed=1), 1)  # an earlier finish, before the run was continued
    run = tmp_path / "work" / "run"

    def judge(trial):
        _one_line_or_stopped(trial)
        meta = read_final(run)  # None (unfinished) or a true claim: it checks the weights it names
        assert meta is None or meta["step"] in (1, 2)
        if trial.raised is None:
            assert meta is not None and meta["step"] == 2
        write_final(run, model, 2)
        assert read_final(run)["step"] == 2
        assert sorted(p.name for p in run.iterdir()) == [
            "config.toml",
            "final.json",
            "model.safetensors",
            "tokenizer.json",
        ]

    every_crash_point(
        "the final weights", lambda: _reset(run, template), lambda: write_final(run, model, 2), judge, tmp_path / "work"
    )


# ------------------------------------------------------------------ config.toml and metadata
def test_a_metadata_write_stopped_at_any_step_leaves_the_old_file_or_the_new(tmp_path):
    path = tmp_path / "work" / "config.toml"

    def setup():
        _reset(path.parent, None)
        path.parent.mkdir(parents=True)
        path.write_text("old")

    def judge(trial):
        _one_line_or_stopped(trial)
        assert path.read_text() in ("old", "new")
        if trial.raised is None:
            assert path.read_text() == "new"
        atomic_write_text(path, "new")
        assert path.read_text() == "new"

    every_crash_point(
        "a metadata file (config.toml)", setup, lambda: atomic_write_text(path, "new"), judge, tmp_path / "work"
    )


# ------------------------------------------------------------------ the lock's acquire and release
def test_a_lock_stopped_at_any_step_of_its_taking_or_release_never_blocks_the_next_writer(tmp_path):
    directory = tmp_path / "work" / "new" / "run"

    def take_write_release():
        with RunLock() as lock:
            lock.take(directory, log=_quiet)
            remove_abandoned_writes(directory, ["config.toml"])  # as a run does, once it holds the lock
            atomic_write_text(directory / "config.toml", "mine")

    def judge(trial):
        _one_line_or_stopped(trial)
        assert not directory.exists() or held_by_another(directory) is None
        take_write_release()  # the same command again
        assert sorted(p.name for p in directory.iterdir()) == ["config.toml"] and held_by_another(directory) is None

    every_crash_point(
        "the lock: take, write, release",
        lambda: _reset(tmp_path / "work", None),
        take_write_release,
        judge,
        tmp_path / "work",
    )
