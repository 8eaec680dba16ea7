"""Every command that writes meets a hostile output the same way: one line naming the problem and
the fix, exit status 2, no traceback, and nothing that was already there lost.

The outputs: a path under a symbolic link to nothing, under a regular file, in a read-only
directory, onto a directory that cannot be renamed over (a mount point: the system answers EBUSY),
and a disk that fills. ``nanolm report`` and ``nanolm data stories`` under a dangling link, and
``nanolm export`` onto an empty bind mount, used to end in tracebacks while ``train`` and
``prepare`` said one line: the matrix below holds every command to the same answer.

Root writes through a read-only mode and only root can mount, so three cases are simulated: the
read-only directory and the full disk at the disk's ground floor (:mod:`nanolm.base.disk`,
whose steps every write goes through, so a command that wrote around it would not meet the fault
and fails here), the mount point by ``os``'s renames and removals refusing that one directory,
as a bind mount on the same file system (which ``os.path.ismount`` does not see) refuses them.
tests/test_full_disk.py fills a real disk.
"""

import errno
import hashlib
import os
import re
from pathlib import Path

import pytest

import nanolm.data.download as dl
from nanolm.base import disk, files
from nanolm.base.lock import LOCK_FILE
from nanolm.instruments.cli import build_parser, main

TINY = [
    *("--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--batch-size", "4"),
    *("--eval-windows", "8", "--sample-tokens", "0", "--tokenizer", "char", "--steps", "2"),
    *("--eval-every", "2", "--threads", "1"),
]

WRITING = {
    # command: (the option naming its output, whether that output is a file)
    "train": ("--out-dir", False),
    "prepare": ("--out", False),
    "export": ("--out", False),
    "report": ("--out", False),
    "data stories": ("--out", True),
    "data download": ("--dir", False),
    "lab": ("--out", False),
    "sweep": ("--out", False),
}
"""Every command that writes where its user says
(:func:`test_every_command_with_an_output_option_is_in_the_matrix` keeps the list whole)."""

WRITES_NOTHING_THERE = {
    "doctor": "its checks prepare the data in a temporary directory; --out-dir is train's option, unused",
}

FULL_DISK_AT = {
    "train": "model.safetensors",
    "prepare": "train.bin",
    "export": "model.safetensors",
    "report": "loss.png",
    "data stories": "s.txt.entropy.json",
    "data download": "corpus.txt.partial",
    "lab": "lab.md",
    "sweep": "sweep.md",
}
"""The file each command is writing when the disk fills, once it has made or written others."""


@pytest.fixture(scope="module")
def run(tmp_path_factory, stories_file):
    out = tmp_path_factory.mktemp("run") / "run"
    assert main(["train", "--data", str(stories_file), "--out-dir", str(out), *TINY]) == 0
    return out


@pytest.fixture
def upstream(tmp_path_factory, monkeypatch):
    """A corpus to download, from a local file (never the network)."""
    source = tmp_path_factory.mktemp("upstream") / "upstream.txt"
    source.write_text("To be, or not to be, that is the question.\n" * 50)
    payload = source.read_bytes()
    entry = dl.RemoteCorpus(source.as_uri(), "corpus.txt", len(payload), hashlib.sha256(payload).hexdigest(), "test")
    monkeypatch.setitem(dl.CORPORA, "testcorpus", entry)


def _argv(command: str, out: Path, run: Path, stories: Path) -> list[str]:
    argv = {
        "train": ["train", "--data", stories, "--out-dir", out, *TINY],
        "prepare": ["prepare", "--data", stories, "--out", out, "--tokenizer", "char"],
        "export": ["export", run, "--out", out],
        "report": ["report", run, "--out", out],
        "data stories": ["data", "stories", "--docs", "3", "--out", out],
        "data download": ["data", "download", "testcorpus", "--dir", out],
        "lab": ["lab", "--out", out, "--quick", "--only", "healthy", "--steps", "20", "--no-report"],
        "sweep": ["sweep", "--lrs", "1e-3", "--out", out, "--data", stories, *TINY, "--no-report"],
    }[command]
    return [str(a) for a in argv]


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (a directory: None), but the lock file a command leaves."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
        if p.name != LOCK_FILE and not (p.is_symlink() and not p.exists())
    }


_SCRATCH = re.compile(r"^\..*(\.[a-z0-9_]{8}|\.(prepare|export)-[a-z0-9_]{8}|\.nanolm-write-probe-.*)$")


def _left_behind(root: Path) -> list[str]:
    """Temporary files and scratch directories a failed command left."""
    return [str(p.relative_to(root)) for p in root.rglob("*") if _SCRATCH.match(p.name)]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


class FailFirst(disk.FaultPlan):
    """The first disk step that ``matches(kind, path)`` fails with ``code``; every step is counted,
    none stopped. ``failed``: the step that failed, None if the command never took one."""

    def __init__(self, matches, code: int):
        super().__init__()
        self.matches, self.code, self.failed = matches, code, None

    def before(self, kind: str, path) -> None:
        super().before(kind, path)
        if self.failed is None and self.matches(kind, Path(path)):
            self.failed = (kind, str(path))
            raise OSError(self.code, os.strerror(self.code), str(path))


def _cases(slow=()):
    """Every command; those that take seconds to get where the case needs them (the lab's
    training, or a report's every panel), named in ``slow``, run in CI's exhaustive pass."""
    return [
        pytest.param(c, marks=[pytest.mark.exhaustive] if c in slow else [], id=c.replace(" ", "-")) for c in WRITING
    ]


def _output(command: str, where: Path) -> Path:
    return where / ("s.txt" if WRITING[command][1] else "out")


# ------------------------------------------------------------------ refused before anything is written
@pytest.mark.parametrize("command", _cases())
@pytest.mark.parametrize("case", ["under a dangling link", "under a file"])
def test_an_output_no_mkdir_can_make_is_one_line_and_nothing_is_written(
    command, case, run, stories_file, tmp_path, capsys, upstream
):
    where = tmp_path / "where"
    if case == "under a dangling link":
        where.symlink_to(tmp_path / "nowhere")
    else:
        where.write_text("a file of the user's")
    before = _tree(tmp_path)
    assert main(_argv(command, _output(command, where), run, stories_file)) == 2
    line = _one_line(capsys)
    if case == "under a dangling link":
        assert f"{where} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist" in line, line
    else:
        assert f"{where} is a file, not a directory; choose another {WRITING[command][0]}" in line, line
    assert _tree(tmp_path) == before and where.is_symlink() == (case == "under a dangling link")


@pytest.mark.parametrize("command", _cases())
def test_a_read_only_directory_is_one_line_naming_it_and_nothing_is_written(
    command, run, stories_file, tmp_path, capsys, upstream
):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    before = _tree(tmp_path)
    plan = FailFirst(lambda kind, path: kind in ("mkdir", "create") and read_only in path.parents, errno.EROFS)
    with disk.faults(plan):
        assert main(_argv(command, _output(command, read_only), run, stories_file)) == 2
    assert plan.failed is not None, "the command wrote around nanolm.base.disk"
    line = _one_line(capsys)
    assert str(read_only) in line and "Read-only file system" in line and "choose" in line, line
    assert _tree(tmp_path) == before


# ------------------------------------------------------------------ a mount point: written into, never renamed onto
def _mounted(monkeypatch, mount: Path) -> None:
    """``mount`` behaves as a bind mount: it cannot be renamed over, renamed away or removed."""

    def refusing(real, *paths_at):
        def call(*args, **kwargs):
            if any(Path(args[i]) == mount for i in paths_at if i < len(args)):
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(mount))
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(os, "replace", refusing(os.replace, 0, 1))
    monkeypatch.setattr(os, "rename", refusing(os.rename, 0, 1))
    monkeypatch.setattr(os, "rmdir", refusing(os.rmdir, 0))
    monkeypatch.setattr(files, "_exchange", refusing(files._exchange, 0, 1))


@pytest.mark.parametrize("command", _cases(slow=["lab", "report"]))
def test_an_output_that_is_a_mount_point_is_written_into_or_refused_in_one_line(
    command, run, stories_file, tmp_path, capsys, monkeypatch, upstream
):
    """A command that builds its output beside it and renames it into place (prepare, export,
    data stories' file) cannot do so onto a mount point: one line, the mount point as it was, no
    scratch left. One that writes inside its output directory (train, report, lab, sweep,
    download) writes inside the mount point as into any directory."""
    mount = tmp_path / "mount"
    if WRITING[command][1]:
        mount.write_text("the user's own file, bind-mounted here")
    else:
        mount.mkdir()
    before = _tree(tmp_path)
    _mounted(monkeypatch, mount)
    code = main(_argv(command, mount, run, stories_file))
    if command in ("prepare", "export", "data stories"):
        assert code == 2
        line = _one_line(capsys)
        assert f"cannot write {mount}: Device or resource busy (a mount point" in line, line
        assert "choose a path inside it or another --out" in line, line
        assert _tree(tmp_path) == before
    else:
        assert code in (0, 1), capsys.readouterr().err  # the lab's exit status is its verdict
        assert mount.is_dir() and any(mount.iterdir())
    assert _left_behind(tmp_path) == []


def test_a_bind_mount_that_os_path_ismount_misses_is_refused_before_anything_is_built(
    run, tmp_path, capsys, monkeypatch, stories_file
):
    """/proc/self/mountinfo lists it (a space in its name written as \\040): prepare and export
    refuse it before they tokenize or load anything, not at their last rename."""
    mount = tmp_path / "a mount"
    mount.mkdir()
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw\n"
        f"98 22 0:21 /src {str(mount).replace(' ', chr(92) + '040')} rw,relatime - ext4 /dev/sda1 rw\n"
    )
    monkeypatch.setattr(files, "MOUNTINFO", str(info))
    assert str(mount) in files.mount_points()
    for command in ("prepare", "export"):
        assert main(_argv(command, mount, run, stories_file)) == 2
        assert f"--out {mount} is a mount point, which nanolm cannot replace in one step" in _one_line(capsys)
        assert list(mount.iterdir()) == []
    monkeypatch.setattr(files, "MOUNTINFO", str(tmp_path / "absent"))
    assert files.mount_points() == set()  # not Linux: os.path.ismount alone


# ------------------------------------------------------------------ a full disk
def _previous_output(command: str, out: Path, stories: Path) -> None:
    """What an earlier run of the command left in ``out``: the full disk must not lose it."""
    if command == "prepare":
        assert main(["prepare", "--data", str(stories), "--out", str(out), "--tokenizer", "char"]) == 0
    elif command == "report":
        (out / "panels").mkdir(parents=True)
        (out / "panels" / "loss.png").write_bytes(b"yesterday's loss curve")
        (out / "report.html").write_text("<html>the report of yesterday</html>")
    elif command == "data stories":
        out.parent.mkdir()
        out.write_text("yesterday's stories")
        out.with_name(out.name + ".entropy.json").write_text('{"nats": 1.0}')
    elif command in ("lab", "sweep"):
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("the user's notes")


@pytest.mark.parametrize("command", _cases(slow=["lab"]))
def test_a_full_disk_is_one_line_naming_the_file_and_what_was_there_stays(
    command, run, stories_file, tmp_path, capsys, upstream
):
    out = _output(command, tmp_path / "disk")
    _previous_output(command, out, stories_file)
    capsys.readouterr()
    before = _tree(tmp_path)
    name = FULL_DISK_AT[command]
    plan = FailFirst(
        lambda kind, path: kind == "write" and re.fullmatch(rf"\.?{re.escape(name)}(\..{{8}})?", path.name),
        errno.ENOSPC,
    )
    with disk.faults(plan):
        assert main(_argv(command, out, run, stories_file)) == 2
    assert plan.failed is not None, f"the command wrote {name} around nanolm.base.disk"
    line = _one_line(capsys)
    assert "No space left on device (free some space)" in line and name in line, line
    after = _tree(tmp_path)
    assert {p: after.get(p) for p in before} == before  # nothing that was there lost or changed
    assert _left_behind(tmp_path) == []
    if command in ("prepare", "export", "report", "data stories", "data download"):  # nothing new either
        assert after == before


# ------------------------------------------------------------------ the matrix holds every command
def _commands(parser, prefix=""):
    """(command, its options) for every command of ``parser``, subcommands of subcommands too."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{prefix} {name}".strip())
            return
    yield prefix, {o for a in parser._actions for o in a.option_strings}


def test_every_command_with_an_output_option_is_in_the_matrix():
    """A new command that writes somewhere its user names meets every case above: it joins
    WRITING, or says in WRITES_NOTHING_THERE why it writes nothing there."""
    outputs = {"--out", "--out-dir", "--dir"}
    with_output = {name for name, options in _commands(build_parser()) if options & outputs}
    assert with_output == set(WRITING) | set(WRITES_NOTHING_THERE), with_output ^ (
        set(WRITING) | set(WRITES_NOTHING_THERE)
    )
