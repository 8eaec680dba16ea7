"""Every change nanolm makes to a disk, one step at a time, and the one place a test can stop it.

A file operation of several steps (a checkpoint's save, prepare's scratch directory and swap,
the removal of an abandoned attempt, the lock's acquire and release) is safe only if the
process can die between *any* two of its steps and leave something the next command can use:
the old result or the new one, whole, and nothing that blocks the rerun. Picking a few
moments to test that finds the bugs someone already thought of. So every step that changes
the disk (create a file, write it, sync it, rename, remove, make a directory...) is a call
here, and a test can install a :class:`FaultPlan` that counts the steps of an operation and
then stops the process, or fails the step with ``ENOSPC`` or ``EIO``, at its k-th step, for
every k (SQLite tests its I/O this way; ALICE and CrashMonkey check every state a crash can
leave). ``tests/crash_points.py`` runs these enumerations; outside a test no plan is
installed and a step costs one ``is None`` check.

A stop is modelled as the death of the process (``kill -9``): the step does not happen, and
no later step does either, whatever cleanup the code attempts on the way out (every later
step raises :class:`Stopped` again). It is not a power cut: what was written before the
stop is on disk, synced or not.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..errors import NanolmError


class Stopped(BaseException):
    """The process stopped at this step (a simulated ``kill -9``): raised by every step from
    then on, so that no cleanup reaches the disk. A BaseException, like the signal it stands
    for, so that no ``except Exception`` treats it as an error to recover from."""


class FaultPlan:
    """What a test wants the disk to do: count every step (``steps``: (kind, path) in order),
    and at step ``at`` (1-based) stop the process (``fault="stop"``) or fail with an errno
    (``fault=errno.ENOSPC``). ``at=None`` only counts."""

    def __init__(self, at: int | None = None, fault: str | int = "stop"):
        self.at, self.fault = at, fault
        self.steps: list[tuple[str, str]] = []
        self.stopped = False
        self.inside = 0  # > 0 while a step's real system call runs (tests/crash_points.py audits the others)

    def before(self, kind: str, path) -> None:
        if self.stopped:
            raise Stopped(f"the process stopped before this {kind} of {path}")
        self.steps.append((kind, str(path)))
        if len(self.steps) != self.at:
            return
        if self.fault == "stop":
            self.stopped = True
            raise Stopped(f"the process stopped before step {self.at}: {kind} {path}")
        raise OSError(self.fault, os.strerror(self.fault), str(path))


_plan: FaultPlan | None = None


@contextmanager
def faults(plan: FaultPlan):
    """Run the block with ``plan`` deciding what each disk step does (tests only)."""
    global _plan
    previous, _plan = _plan, plan
    try:
        yield plan
    finally:
        _plan = previous


@contextmanager
def _step(kind: str, path):
    plan = _plan
    if plan is None:
        yield
        return
    plan.before(kind, path)
    plan.inside += 1
    try:
        yield
    finally:
        plan.inside -= 1


# --------------------------------------------------------------------------- the steps
def make_dir(path, parents: bool = False, exist_ok: bool = False, made: list | None = None) -> list[Path]:
    """``mkdir``, one step per directory made; returns the directories made, outermost first
    (appended to ``made`` as they are made, so that a caller stopped half-way knows them)."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()][::-1] if parents else [path]
    made = [] if made is None else made
    for directory in missing:
        refuse_dangling_link(directory)
        with _step("mkdir", directory):
            try:
                directory.mkdir()
            except FileExistsError:
                if not (exist_ok or directory != path) or not directory.is_dir():
                    raise
                continue
        made.append(directory)
    return made


def refuse_dangling_link(path) -> None:
    """A path that is a symbolic link to nothing cannot be made (``mkdir`` answers "File
    exists", which names neither the link nor the fix): refused in one line."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise NanolmError(
            f"{path} is a symbolic link to {os.readlink(path)}, which does not exist; create "
            f"what it points to, or choose a path without it"
        )


def make_scratch_dir(parent, prefix: str) -> Path:
    """A new directory with a name no other process has (``tempfile.mkdtemp``)."""
    with _step("mkdir", Path(parent) / f"{prefix}*"):
        return Path(tempfile.mkdtemp(dir=parent, prefix=prefix))


def make_scratch_file(parent, prefix: str) -> tuple[int, Path]:
    """A new file, open for writing, with a name no other process has (``tempfile.mkstemp``)."""
    with _step("create", Path(parent) / f"{prefix}*"):
        fd, name = tempfile.mkstemp(dir=parent, prefix=prefix)
    return fd, Path(name)


def create(path, mode: str = "wb", **kwargs):
    """``open(path, mode)`` for writing ("w", "a", "x" modes; binary or text)."""
    with _step("create", path):
        return open(path, mode, **kwargs)


def open_fd(path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` with flags that may create the file."""
    with _step("create", path):
        return os.open(path, flags, mode)


def write(file, data, path=None):
    """One write to an open file (``path``: its name, for the plan's record)."""
    with _step("write", path if path is not None else getattr(file, "name", "a file")):
        return file.write(data)


def write_fd(fd: int, data: bytes, path) -> int:
    with _step("write", path):
        return os.write(fd, data)


def truncate_fd(fd: int, length: int, path) -> None:
    with _step("write", path):
        os.ftruncate(fd, length)


@contextmanager
def written_by_library(path):
    """A file written whole by a library's own writer (``torch.save``, safetensors, ``np.save``):
    one step, the write."""
    with _step("write", path):
        yield


def sync(file_or_fd, path=None) -> None:
    """``fsync``: the bytes written so far reach the disk before the next step."""
    fd = file_or_fd if isinstance(file_or_fd, int) else file_or_fd.fileno()
    with _step("sync", path if path is not None else getattr(file_or_fd, "name", "a file")):
        os.fsync(fd)


def sync_dir(path) -> None:
    """``fsync`` a directory, so the renames and creations in it survive a power cut. On
    Windows a directory cannot be opened for that (NTFS journals the rename itself)."""
    if os.name == "nt":
        return
    with _step("sync", path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def rename(source, target) -> None:
    """``os.replace``: ``target`` becomes ``source`` in one atomic step."""
    with _step("rename", target):
        os.replace(source, target)


@contextmanager
def exchanging(a, b):
    """The swap of two paths in one atomic step (the caller's ``renameat2``)."""
    with _step("exchange", b):
        yield


def remove(path, missing_ok: bool = False) -> None:
    with _step("remove", path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            if not missing_ok:
                raise


def remove_dir(path) -> None:
    """``rmdir``: an empty directory."""
    with _step("rmdir", path):
        os.rmdir(path)


def remove_tree(path, ignore_errors: bool = False) -> None:
    """Delete ``path`` and everything below it, one step per entry, deepest first (as
    ``shutil.rmtree`` does, but each removal a step of its own: a process killed half-way
    leaves part of the tree, and the tests check that the next command copes). Symbolic links
    are removed, never followed."""
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_dir():
            remove(path)
            return
        for root, dirs, names in os.walk(path, topdown=False, followlinks=False):
            for name in names:
                remove(Path(root) / name, missing_ok=True)
            for name in dirs:
                entry = Path(root) / name
                if entry.is_symlink():
                    remove(entry, missing_ok=True)
                else:
                    remove_dir(entry)
        remove_dir(path)
    except OSError:
        if not ignore_errors:
            raise


def chmod(path, mode: int) -> None:
    with _step("chmod", path):
        os.chmod(path, mode)


def copy_file(source, target) -> None:
    """``shutil.copy2``: the bytes and the times of ``source``."""
    import shutil

    with _step("write", target):
        shutil.copy2(source, target)
