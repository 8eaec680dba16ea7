"""One writer per directory: a second process on a live run is refused, never mixed in.

Two ``nanolm train`` on one run directory (a job requeued while it still ran, Enter pressed
in two terminals) would each plan from what the other is writing: both would train, both
would exit 0, and the directory would hold the metrics, checkpoints and final weights of
whichever wrote last, interleaved. So a process that writes a directory first takes its
lock and holds it until it ends; a second one is refused, before it writes anything, in one
line naming the holder. Readers (sample, eval, export, diagnose, report, replay) take no lock:
a run replaces each file atomically and appends whole lines, so they never see half of one.
A directory inside a live run (``nanolm prepare --out RUN/data`` while RUN trains) is refused
too: writing there would change the run's data under it. A run that trains on prepared data
(``--data DIR`` made by ``nanolm prepare``) reads DIR for as long as it lives, and a checkpoint
records DIR's digest: a prepare into DIR meanwhile would leave a run that can no longer be
continued. So the run holds a *shared* lock on DIR (:class:`ReadLock`; any number of runs may
share it) and a prepare, whose lock is exclusive, is refused while one trains, as a run is
refused on data a prepare is writing.

**Why flock, and on the directory.** The lock is an advisory ``flock``, not a file whose
existence means "taken". The kernel lets go of it when the process ends, however it ends
(``kill -9``, a crash, out of memory), so "run the same command again" works at once, with
no stale lock to clear: a marker file would survive the ``kill -9`` and then block the very
command that resumes the run. It is held on the directory itself, which cannot be deleted
while the run lives in it: held on a file, someone deleting that file would let a second
writer in beside the first. ``DIR/.lock`` only names the holder (process id and host) for the
refusal's message; deleting it changes nothing but that name.

**On a network file system.** Linux NFS clients turn a flock into a lock on the server
(NFSv4, or NFSv3 with lockd), so two machines see each other's lock; a machine that is lost
while it holds one keeps it until its lease runs out (NFSv4: 90 s by default) or, under
NFSv3, until it comes back. Mounted with ``nolock`` or ``local_lock=flock``, a lock is seen
only by the machine that took it. A file system that cannot lock a directory (NFS locks only
files opened for writing) gets the lock on ``DIR/.lock`` instead. Where the file
system has no locks at all (flock fails with ENOLCK, EOPNOTSUPP or ENOSYS: NFS without lockd,
Lustre without ``-o flock``, some FUSE mounts), nanolm refuses to write there rather than
silently drop the promise: one line says so, and ``NANOLM_NO_LOCK=1`` writes without a lock,
for whoever makes sure of one writer.

**On Windows** there is no flock, and a directory cannot be opened: the lock is
``msvcrt.locking`` on one byte of ``DIR/.lock``, far past the holder's line (Windows locks are
mandatory, and a lock on the line itself would stop a refused writer from reading who holds
it). Windows, too, lets go of it when its holder ends however it ends, and an open file cannot
be deleted there, so the lock file cannot be deleted from under a live run either. The file is
closed before it is removed; another writer that locked it in between keeps it.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
from pathlib import Path

from ..errors import NanolmError
from . import disk

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

LOCK_FILE = ".lock"
NO_LOCK = "NANOLM_NO_LOCK"
NO_LOCKS_HERE = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
"""What flock fails with on a file system that has no working locks."""
HELD = {errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, getattr(errno, "EDEADLOCK", errno.EDEADLK)}
"""What taking a lock that another process holds fails with (flock; Windows' locking)."""
HOLDER_BYTES = 256
"""The holder's line is read from the file's first bytes; on Windows the byte locked lies past them."""


class DirectoryBusy(NanolmError):
    """Another process holds the directory's lock: it is writing there now."""


def _lock(fd: int) -> None:
    """Take the lock held on ``fd``, without waiting: OSError if another process holds it."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        os.lseek(fd, HOLDER_BYTES, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)


def _open_directory(directory: Path) -> int | None:
    """The directory opened for its lock; None where directories cannot be opened (Windows)."""
    if fcntl is None:
        return None
    return os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _open_lock_file(path: Path) -> int:
    """``DIR/.lock`` opened for writing, or a one-line error when it is not a plain file (a
    symbolic link could point anywhere, a FIFO would block or refuse the holder's line)."""
    try:
        fd = disk.open_fd(
            path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0), 0o644
        )
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK) or path.is_symlink():
            raise _not_a_lock_file(path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_lock_file(path)
    return fd


def _not_a_lock_file(path: Path) -> NanolmError:
    kind = (
        "a symbolic link"
        if path.is_symlink()
        else "a directory"
        if path.is_dir()
        else "a FIFO"
        if stat.S_ISFIFO(path.lstat().st_mode)
        else "not a plain file"
    )
    return NanolmError(
        f"{path} is {kind}, not the lock file nanolm writes there; remove it, then run the same command again"
    )


def _holder(path: Path) -> str:
    """The line a holder wrote into ``path`` (its process and host), or "" if none can be read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, HOLDER_BYTES).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


def _this_process() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


def _this_process_or_its_parent() -> tuple[str, str]:
    """This process's holder line and its parent's: a process the holder started to write inside
    the holder's directory (the lab's resume variant trains its first part in a child process
    inside the lab's locked --out) works for the holder, not against it."""
    host = socket.gethostname()
    return f"{os.getpid()}@{host}", f"{os.getppid()}@{host}"


def _write_holder(fd: int, path: Path) -> None:
    disk.truncate_fd(fd, 0, path)
    os.lseek(fd, 0, os.SEEK_SET)
    disk.write_fd(fd, f"{_this_process()}\n".encode(), path)


def held_by_another(directory: Path) -> str | None:
    """The holder's line (possibly "") when another process holds ``directory``'s lock now, else
    None. Takes the lock for a moment to find out, and lets go at once. A lock this very process
    holds is not another's (a flock conflicts with every other open file, its owner's included):
    ``--resume RUN/checkpoints/step_N --out-dir RUN`` goes back to the run's own checkpoint."""
    directory = Path(directory)
    if not (directory / LOCK_FILE).exists() and not (directory / LOCK_FILE).is_symlink():
        return None  # every holder writes its line there first
    try:
        fd = _open_directory(directory)
        if fd is None:
            fd = os.open(directory / LOCK_FILE, os.O_RDWR)
    except OSError:
        return None
    try:
        _lock(fd)
    except OSError as e:
        holder = _holder(directory / LOCK_FILE) if e.errno in HELD else None
        return None if holder == _this_process() else holder
    finally:
        os.close(fd)  # and with it the lock, if it was taken
    return None


class RunLock:
    """The lock of one directory, held from :meth:`take` to :meth:`release` (or the end of a
    ``with`` block). The same process holds a directory once: a second ``take`` of it, even
    in-process, is refused like any other writer."""

    def __init__(self):
        self.directory: Path | None = None
        self._fd: int | None = None  # the lock file: the holder's line (and on Windows, the lock)
        self._dir_fd: int | None = None  # the directory, where it holds the lock
        self._made: list[Path] = []
        self._taking: Path | None = None  # the directory being locked, until it is (then ``directory``)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def take(self, directory, flag: str = "--out-dir", log=print) -> None:
        """Lock ``directory`` (created if missing) or raise :class:`DirectoryBusy` naming its
        holder; a directory held before is let go first."""
        self.release()
        directory = Path(directory)
        if directory.exists() and not directory.is_dir():
            raise NanolmError(f"{flag} {directory} is a file, not a directory; choose another {flag}")
        for parent in directory.absolute().parents:
            holder = held_by_another(parent)
            if (
                holder is not None and holder not in _this_process_or_its_parent()
            ):  # a run (or its child) writing into its own directory
                raise busy_refusal(directory, holder, flag, inside=parent)
        self._made = [p for p in (directory, *directory.parents) if not p.exists()][::-1]
        if os.environ.get(NO_LOCK) == "1":
            log(
                f"warning: {directory} is written without a lock ({NO_LOCK}=1): make sure no other process writes there"
            )
            self.directory = directory
            return
        self._taking = directory
        try:
            self._take(directory, flag)
        except BaseException:
            self.release()
            raise
        self.directory, self._taking = directory, None

    def _take(self, directory: Path, flag: str) -> None:
        path = directory / LOCK_FILE
        for _ in range(100):  # each turn is lost to a writer that let go at that very moment
            try:
                disk.make_dir(directory, parents=True, exist_ok=True)
                dir_fd = _open_directory(directory)
            except FileNotFoundError:  # a refused writer removed the empty directory it had made
                continue
            if dir_fd is not None:
                try:
                    _lock(dir_fd)
                except OSError as e:
                    os.close(dir_fd)
                    if e.errno in HELD or e.errno in NO_LOCKS_HERE:
                        raise _refusal(e, directory, _holder(path), flag) from None
                    dir_fd = None  # this file system cannot lock a directory: the lock file holds it
                self._dir_fd = dir_fd
            if self._dir_fd is not None:
                fd = _open_lock_file(path)
                try:  # the file too, as nanolm did before the directory: an older nanolm on this run is refused
                    _lock(fd)
                except OSError as e:
                    if e.errno in HELD:  # the file, and the holder's line in it, are the other process's
                        os.close(fd)
                        raise _refusal(e, directory, _holder(path), flag) from None
                self._fd = fd
                _write_holder(self._fd, path)
                return
            try:
                fd = _open_lock_file(path)
            except FileNotFoundError:
                continue
            try:
                _lock(fd)
            except OSError as e:
                holder = _holder(path)
                if not holder and e.errno in NO_LOCKS_HERE:  # the file this very call made
                    disk.remove(path, missing_ok=True)
                os.close(fd)
                raise _refusal(e, directory, holder, flag) from None
            if _same_file(fd, path):
                self._fd = fd
                _write_holder(fd, path)
                return
            os.close(fd)  # its holder removed that file as it let go: lock the one there now
        raise NanolmError(f"cannot lock {path}: it keeps being replaced; is another program removing it?")

    def release(self) -> None:
        """Let go: the lock file is removed while the lock is still held (so that no one can lock
        it after us and believe they hold the directory), then the directories :meth:`take`
        made, if nothing was written into them. Nothing here raises: a run directory that
        turned read-only must not have its lock's cleanup hide the error that stopped the run
        (the lock dies with the descriptor in any case)."""
        where = self.directory or self._taking
        path = where / LOCK_FILE if where is not None else None
        fd, dir_fd, made = self._fd, self._dir_fd, self._made
        self._fd = self._dir_fd = None
        self._made, self.directory, self._taking = [], None, None
        try:  # the descriptors are closed whatever happens on the way, as the kernel closes a dead process's
            if fd is not None and (fcntl is not None or dir_fd is not None):
                _quietly(lambda: disk.remove(path, missing_ok=True))
            elif fd is not None:  # Windows: an open file cannot be removed
                _quietly(lambda: os.close(fd))
                fd = None
                _quietly(
                    lambda: disk.remove(path, missing_ok=True)
                )  # fails if another writer opened it meanwhile: theirs
        finally:
            for descriptor in (fd, dir_fd):
                if descriptor is not None:
                    _quietly(lambda: os.close(descriptor))
        for directory in reversed(made):
            try:
                disk.remove_dir(directory)
            except OSError:
                break


class ReadLock:
    """A shared lock on a directory a run reads for its whole life (prepared data): any number
    of runs hold it together, and no writer (``nanolm prepare``, whose lock is exclusive) takes
    the directory while one does. Where the system or the file system has no flock, a reader
    goes on without it, as a reader takes no lock at all elsewhere."""

    def __init__(self):
        self._fd: int | None = None

    def __enter__(self) -> ReadLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def take(self, directory, flag: str = "--data") -> None:
        """Share ``directory``'s lock, or raise :class:`DirectoryBusy` naming the process writing it."""
        self.release()
        directory = Path(directory)
        if fcntl is None or os.environ.get(NO_LOCK) == "1":
            return
        try:
            fd = _open_directory(directory)
        except OSError:
            return  # what then reads it says what is wrong with it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in HELD:
                raise busy_refusal(directory, _holder(directory / LOCK_FILE), flag) from None
            return
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            _quietly(lambda: os.close(fd))


def _quietly(action) -> None:
    try:
        action()
    except OSError:
        pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def busy_refusal(directory: Path, holder: str, flag: str, inside: Path | None = None) -> DirectoryBusy:
    """The one line refusing ``directory`` (or a path ``inside`` a directory) another process writes."""
    pid, _, host = holder.partition("@")
    who = f"process {pid} on {host}" if pid.isdigit() and host else "another process"
    if inside is not None:
        return DirectoryBusy(
            f"{directory} is inside {inside}, which is being written by {who}: writing there would "
            f"change that run under it; wait for it to end, or choose another {flag}"
        )
    if who == "another process":  # no holder's line: a writer whose line is gone, or runs training on it
        return DirectoryBusy(
            f"{directory} is in use by another process (being written, or read by a run training "
            f"on it); wait for it to end, or choose another {flag}"
        )
    return DirectoryBusy(f"{directory} is being written by {who}; wait for it to end, or choose another {flag}")


def _refusal(error: OSError, directory: Path, holder: str, flag: str) -> NanolmError:
    if error.errno in HELD:
        return busy_refusal(directory, holder, flag)
    if error.errno in NO_LOCKS_HERE:
        return NanolmError(
            f"{directory} is on a file system without working locks ({error.strerror}), so nanolm "
            f"cannot make sure it is the only process writing there; use a local disk or a mount with "
            f"locks, or set {NO_LOCK}=1 to write without one"
        )
    return NanolmError(f"cannot lock {directory / LOCK_FILE}: {error.strerror or error}")


# --------------------------------------------------------------------------- scratch directories
_SCRATCH_TOKEN = re.compile(r"[a-z0-9_]{8}")
"""What ``tempfile.mkdtemp`` appends to a prefix: eight of these characters."""


class ScratchDirectory:
    """A directory beside ``target`` where a command builds its output before one rename puts it
    in place (prepare, export), held by its maker for as long as it lives.

    A process killed half-way (``kill -9`` runs no cleanup) leaves its scratch directory
    behind; the next command into the same ``target`` removes it (:func:`remove_abandoned_scratch`).
    Two rules keep that from touching anyone else's work. Its name is exactly
    ``.TARGET.PURPOSE-`` and eight random characters, so the scratch of another output whose name
    merely starts the same way (``data`` and ``data.prepare-v2``) never matches. And its maker
    holds an ``flock`` on it until done: a scratch directory whose lock is held belongs to a live
    command (a second export into the same ``--out``), and is left alone."""

    def __init__(self, target, purpose: str, adopt: Path | None = None):
        """``adopt``: an abandoned scratch directory of the same target and purpose, taken over to
        continue its work (an interrupted prepare), instead of a new one."""
        target = Path(target)
        self.path = (
            Path(adopt) if adopt is not None else disk.make_scratch_dir(target.parent, f".{target.name}.{purpose}-")
        )
        self._fd: int | None = None
        try:
            fd = _open_directory(self.path)
        except OSError:
            return
        if fd is not None:
            try:
                _lock(fd)
            except OSError:
                os.close(fd)
                return
            self._fd = fd

    def let_go(self) -> None:
        if self._fd is not None:
            _quietly(lambda: os.close(self._fd))
            self._fd = None


def abandoned_scratch(target, purpose: str) -> list[Path]:
    """The scratch directories of ``purpose`` beside ``target`` that no live process holds."""
    target = Path(target)
    prefix = f".{target.name}.{purpose}-"
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return []
    found = []
    for entry in entries:
        if not (entry.name.startswith(prefix) and _SCRATCH_TOKEN.fullmatch(entry.name[len(prefix) :])):
            continue
        path = Path(entry.path)
        if entry.is_symlink() or not entry.is_dir() or _held(path):
            continue
        found.append(path)
    return sorted(found)


def remove_abandoned_scratch(target, purpose: str) -> None:
    """Delete what killed commands left beside ``target`` (see :class:`ScratchDirectory`)."""
    for path in abandoned_scratch(target, purpose):
        disk.remove_tree(path, ignore_errors=True)


def _held(directory: Path) -> bool:
    try:
        fd = _open_directory(directory)
    except OSError:
        return True  # cannot tell: leave it
    if fd is None:
        return False  # Windows: no lock on a directory; the caller's own lock keeps other writers out
    try:
        _lock(fd)
    except OSError as e:
        return e.errno in HELD
    finally:
        os.close(fd)
    return False
