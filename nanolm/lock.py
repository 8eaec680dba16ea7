"""One writer per directory: a second process on a live run is refused, never mixed in.

Two ``nanolm train`` on one run directory (a job requeued while it still ran, Enter pressed
in two terminals) would each plan from what the other is writing: both would train, both
would exit 0, and the directory would hold the metrics, checkpoints and final weights of
whichever wrote last, interleaved. So a process that writes a directory first takes its
lock, ``DIR/.lock``, and holds it until it ends; a second one is refused, before it writes
anything, in one line naming the holder. Readers (sample, eval, export, diagnose, report,
replay) take no lock: a run replaces each file atomically and appends whole lines, so they
never see half of one.

**Why flock.** The lock is an advisory ``flock`` held on an open file, not a file whose
existence means "taken". The kernel lets go of it when the process ends, however it ends
(``kill -9``, a crash, out of memory), so "run the same command again" works at once, with
no stale lock to clear: a marker file would survive the ``kill -9`` and then block the very
command that resumes the run. The process id and host written into the file only name the
holder in the message; the flock decides.

**On a network file system.** Linux NFS clients turn a flock into a lock on the server
(NFSv4, or NFSv3 with lockd), so two machines see each other's lock; a machine that is lost
while it holds one keeps it until its lease runs out (NFSv4: 90 s by default) or, under
NFSv3, until it comes back. Mounted with ``nolock`` or ``local_lock=flock``, a lock is seen
only by the machine that took it. Where the file system has no locks at all (flock fails
with ENOLCK, EOPNOTSUPP or ENOSYS: NFS without lockd, Lustre without ``-o flock``, some FUSE
mounts), nanolm refuses to write there rather than silently drop the promise: one line says
so, and ``NANOLM_NO_LOCK=1`` writes without a lock, for whoever makes sure of one writer.

**On Windows** there is no flock: the lock is ``msvcrt.locking`` on one byte of the same file,
far past the holder's line (Windows locks are mandatory, and a lock on the line itself would
stop a refused writer from reading who holds it). Windows, too, lets go of it when its holder
ends however it ends. A file that is open cannot be removed there, so the lock file is closed
before it is removed; another writer that locked it in between keeps it.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

from .errors import NanolmError

LOCK_FILE = ".lock"
NO_LOCK = "NANOLM_NO_LOCK"
NO_LOCKS_HERE = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
"""What flock fails with on a file system that has no working locks."""
HELD = {errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES, getattr(errno, "EDEADLOCK", errno.EDEADLK)}
"""What taking a lock that another process holds fails with (flock; Windows' locking)."""
HOLDER_BYTES = 256
"""The holder's line is read from the file's first bytes; on Windows the byte locked lies past them."""


def _lock(fd: int) -> None:
    """Take the lock held on ``fd``, without waiting: OSError if another process holds it."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    else:
        os.lseek(fd, HOLDER_BYTES, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)


def _read_holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, HOLDER_BYTES).decode("utf-8", "replace").strip()


class DirectoryBusy(NanolmError):
    """Another process holds the directory's lock: it is writing there now."""


class RunLock:
    """The lock of one directory, held from :meth:`take` to :meth:`release` (or the end of a
    ``with`` block). The same process holds a directory once: a second ``take`` of it, even
    in-process, is refused like any other writer."""

    def __init__(self):
        self.directory: Path | None = None
        self._fd: int | None = None
        self._made: list[Path] = []

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
        self._made = [p for p in (directory, *directory.parents) if not p.exists()][::-1]
        if os.environ.get(NO_LOCK) == "1":
            log(f"warning: {directory} is written without a lock ({NO_LOCK}=1): make sure no other process writes there")
            self.directory = directory
            return
        path = directory / LOCK_FILE
        for _ in range(100):  # each turn is lost to a writer that let go at that very moment
            try:
                directory.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except FileNotFoundError:  # a refused writer removed the empty directory it had made
                continue
            try:
                _lock(fd)
            except OSError as e:
                holder = _read_holder(fd)
                if not holder and e.errno in NO_LOCKS_HERE:  # the file this very call made
                    path.unlink(missing_ok=True)
                os.close(fd)
                self.release()
                raise _refusal(e, directory, holder, flag) from None
            if _same_file(fd, path):
                break
            os.close(fd)  # its holder removed that file as it let go: lock the one there now
        else:
            raise NanolmError(f"cannot lock {path}: it keeps being replaced; is another program removing it?")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode())
        self._fd, self.directory = fd, directory

    def release(self) -> None:
        """Let go: the lock file is removed while still held (so that no one can lock it
        after us and believe they hold the directory), then the directories :meth:`take`
        made, if nothing was written into them."""
        if self._fd is not None and fcntl is not None:
            (self.directory / LOCK_FILE).unlink(missing_ok=True)
            os.close(self._fd)
        elif self._fd is not None:  # Windows: an open file cannot be removed
            os.close(self._fd)
            try:
                (self.directory / LOCK_FILE).unlink(missing_ok=True)
            except PermissionError:  # another writer opened it at that moment: now it is theirs
                pass
        self._fd = None
        for made in reversed(self._made):
            try:
                made.rmdir()
            except OSError:
                break
        self._made, self.directory = [], None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _refusal(error: OSError, directory: Path, holder: str, flag: str) -> NanolmError:
    if error.errno in HELD:
        pid, _, host = holder.partition("@")
        who = f"process {pid} on {host}" if pid.isdigit() and host else "another process"
        return DirectoryBusy(f"{directory} is being written by {who}; wait for it to end, or choose another {flag}")
    if error.errno in NO_LOCKS_HERE:
        return NanolmError(f"{directory} is on a file system without working locks ({error.strerror}), so nanolm "
                           f"cannot make sure it is the only process writing there; use a local disk or a mount with "
                           f"locks, or set {NO_LOCK}=1 to write without one")
    return NanolmError(f"cannot lock {directory / LOCK_FILE}: {error.strerror or error}")
