"""Files nanolm writes and reads back: never half-written, never trusted unchecked.

A training run outlives many processes: it is killed, the disk fills, a file is copied
badly, someone hands you a checkpoint. Two rules make that safe.

**Writes are atomic.** A file is written under a temporary name in the same directory,
flushed to disk (``fsync``) and renamed over the old one; the rename is atomic, so a reader
(or the next process after a crash) sees the old file or the new one, never half of each.
The directory is fsynced too, or the rename itself could be lost in a power cut. On Windows a
directory cannot be opened to fsync it (NTFS journals the rename itself), and a file that another
process holds open (a reader's memory map of the weights) refuses to be replaced for as long as
it is open: :func:`replace` waits for the reader, a few seconds at most, then names the file.

**Reads are checked.** Every JSON and TOML file is parsed under guard (``nanolm.base.documents``),
with errors that name it; a directory
that nanolm wrote carries a *manifest*, the SHA-256 of each of its files, and is accepted
only when the files on disk are exactly the listed ones with exactly those checksums. A
flipped bit, a truncated copy or a swapped file is then named, never silently trained on.
Nothing read here is ever unpickled: JSON, TOML, safetensors and raw token arrays are data
formats that cannot carry code. A name these files must record (a path, an option) is refused
unless it is UTF-8 text (:func:`require_utf8`), before anything is written.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import NanolmError, brief
from . import disk

ENVIRONMENT_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.EFBIG,
    errno.EIO,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENAMETOOLONG,
    errno.EBUSY,
}
"""OS errors that are the machine's state (a full disk, a read-only or foreign directory, a
mount point that cannot be renamed over), not a bug: the command line reports them in one line
naming the path."""


def cache_dir() -> Path:
    """Where nanolm keeps what outlives a run (downloads, prepared data, a CPU's measured peak):
    ``$NANOLM_CACHE``, by default ``~/.cache/nanolm``."""
    return Path(os.environ.get("NANOLM_CACHE", Path.home() / ".cache" / "nanolm"))


def require_utf8(flag: str, value: str, why: str) -> None:
    """Refuse a value that is not UTF-8 text (a file name with a byte such as 0xE9, which Python
    keeps as a lone surrogate) before anything is written: the files that record it cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raw = value.encode("utf-8", "surrogateescape")
        raise NanolmError(
            f"{flag} {raw!r} is not valid UTF-8 text, and {why}; rename it (or link to it) with a UTF-8 name"
        ) from None


def text_argument(flag: str, value: str) -> str:
    """Text given on the command line (a prompt), as the UTF-8 the user typed.

    Python decodes the command line with the locale's encoding, keeping each byte it cannot
    decode as a lone surrogate: under ``LC_ALL=C`` a prompt typed as UTF-8 ("café") arrives
    as ``caf\\udcc3\\udca9``, and a prompt in Latin-1 arrives that way under any locale. The
    bytes are recovered and read as UTF-8; bytes that are not UTF-8 are one line, not a
    tokenizer's ``TypeError``."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        raw = os.fsencode(value)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NanolmError(
            f"{flag} {brief(repr(raw), 80)} is not UTF-8 text (byte {e.start}); type it in UTF-8 or "
            f"set your terminal to UTF-8"
        ) from None


def describe_os_error(e: OSError, flag: str = "--out-dir") -> str:
    """``OSError`` as one line: the path, then the cause, then what a user can do (``flag``: the
    option that chose where the command writes)."""
    where = e.filename if e.filename is not None else "a file"
    hint = {
        errno.ENOSPC: "free some space",
        errno.EDQUOT: "free some space (disk quota)",
        errno.EROFS: f"the file system is read-only; choose another {flag}",
        errno.EACCES: f"you may not write there; choose another {flag}",
        errno.EPERM: f"you may not write there; choose another {flag}",
        errno.EFBIG: "the file is larger than this system allows",
        errno.EBUSY: f"a mount point, or in use: it cannot be replaced in one step; choose a path inside it or another {flag}",
    }.get(e.errno, "")
    return f"cannot write {where}: {e.strerror or e}" + (f" ({hint})" if hint else "")


_OS_ERROR_IN_WORDS = re.compile(r"\(os error (\d+)\)")


@contextmanager
def naming_the_file(path):
    """Let an error raised while writing ``path`` reach the user as the one-line OSError it is.

    Two kinds of writer hide it: Python's own file methods raise ``OSError`` without the file's
    name ("cannot write a file: No space left on device" helps nobody find what filled up), and
    libraries written in Rust (safetensors) raise their own exception type with the OS error
    in words ("... No space left on device (os error 28)"), which a handler waiting for
    ``OSError`` never sees: a full disk became a traceback. Both become ``OSError(errno, ...,
    path)``; anything else passes unchanged."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise
    except Exception as e:
        found = _OS_ERROR_IN_WORDS.search(str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e


class WholeWrites(io.RawIOBase):
    """A file for ``torch.save`` that writes every byte it is given or keeps the reason why not.

    ``torch.save`` checks the file's position after each record, and on a full disk all the
    user sees is ``RuntimeError: ... unexpected pos`` (a short write, or the disk's refusal
    swallowed on the way through PyTorch's C++ writer). Through this object a short write is
    retried, and the disk's refusal is kept in ``error``, for :func:`save_torch` to raise as
    the ``OSError`` it is."""

    def __init__(self, raw):
        super().__init__()
        self.raw = raw
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        try:
            while view:
                view = view[self.raw.write(view) :]
        except OSError as e:
            self.error = e
            raise
        return size


def save_torch(obj, path) -> None:
    """``torch.save(obj)`` to ``path``, synced to disk; a full disk is an ``OSError`` naming it."""
    import torch

    with naming_the_file(path), disk.create(path, "wb", buffering=0) as f:
        writer = WholeWrites(f)
        try:
            with disk.written_by_library(path):
                torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        disk.sync(f, path)


WINDOWS = os.name == "nt"
REPLACE_WAIT_S = 5.0
"""How long a replacement on Windows waits for a reader to close the file it replaces."""


def replace(source, target) -> None:
    """``os.replace``: atomic, and on Windows patient with a reader that has ``target`` open."""
    deadline = time.monotonic() + REPLACE_WAIT_S
    while True:
        try:
            disk.rename(source, target)
            return
        except PermissionError:
            if not WINDOWS or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def move_directory(source, target) -> None:
    """Move the directory ``source`` to ``target`` (absent), across file systems too, so that
    ``target`` is whole or absent: another file system gets a copy under a temporary name beside
    ``target``, renamed into place once complete. A full disk on the way is an ``OSError``
    naming the file, and leaves no partial copy (``shutil.move`` would raise its own error
    type, listing every file it failed, and leave half a directory)."""
    source, target = Path(source), Path(target)
    try:
        disk.rename(source, target)
        return
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    staging = disk.make_scratch_dir(target.parent, f".{target.name}.")
    try:
        for path in sorted(source.rglob("*")):
            relative = path.relative_to(source)
            if path.is_dir():
                disk.make_dir(staging / relative)
                continue
            try:
                disk.copy_file(path, staging / relative)
            except OSError as e:  # named after the source by shutil: the file that did not fit is the target
                raise OSError(e.errno, e.strerror, str(target / relative)) from e
        replace(staging, target)
    except BaseException:
        disk.remove_tree(staging, ignore_errors=True)
        raise
    disk.remove_tree(source, ignore_errors=True)


RENAME_EXCHANGE = 2  # renameat2's flag: swap two paths in one atomic step (Linux >= 3.15)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` in one atomic step; False where the system cannot
    (not Linux, an old C library, a file system without it: NFS, some FUSE mounts)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    with disk.exchanging(a, b):
        done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) == 0
    if done:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(b))


def replace_directory(staging, target, last: str | None = None) -> None:
    """Make ``target`` hold exactly what ``staging`` (a complete directory beside it) holds, so
    that a reader, or the next process after a crash, finds the old directory or the new one,
    never a mix: an absent ``target`` is a rename; an existing one is swapped with ``staging``
    in one step (``renameat2``'s exchange) and the old content then deleted.

    Where no such swap exists (Windows, macOS, NFS) the files are moved in one at a time:
    ``last`` (the file that vouches for the others, such as meta.json) is removed first and put
    back last, so an interruption leaves a directory that says it is incomplete, not a mix that
    claims to be whole. ``target``'s other entries (its lock file) stay."""
    staging, target = Path(staging), Path(target)
    if not target.exists():
        replace(staging, target)
    elif _exchange(staging, target):
        disk.remove_tree(staging, ignore_errors=True)  # what target held before
    else:
        if last is not None:
            disk.remove(target / last, missing_ok=True)
        names = sorted(p.name for p in staging.iterdir() if p.name != last) + ([last] if last else [])
        for name in names:
            if (staging / name).exists():
                replace(staging / name, target / name)
        disk.remove_tree(staging, ignore_errors=True)
    fsync_dir(target.parent)


def fsync_dir(path) -> None:
    disk.sync_dir(path)


def atomic_write_text(path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half."""
    atomic_write_all({path: text})


def atomic_write_bytes(path, data: bytes) -> None:
    """:func:`atomic_write_text` for bytes (an image)."""
    atomic_write_all({path: data})


def atomic_write_all(contents: dict) -> None:
    """Write several files (path -> text or bytes) so that none is replaced before all are
    written: each goes to a temporary file beside it, synced, and only then are they renamed into
    place. A full disk (met while writing, the step that needs room) leaves every old file as it
    was: never a new corpus beside the old one's entropy file."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, content in contents.items():
            path = Path(path)
            fd, tmp = disk.make_scratch_file(path.parent, f".{path.name}.")
            staged.append((tmp, path))
            binary = isinstance(content, bytes)
            with (
                naming_the_file(path),
                os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f,
            ):
                disk.write(f, content, tmp)
                f.flush()
                disk.sync(f, tmp)
        while staged:
            tmp, path = staged[0]
            replace(tmp, path)
            staged.pop(0)
        for parent in dict.fromkeys(Path(path).parent for path in contents):
            fsync_dir(parent)
    except BaseException:
        for tmp, _ in staged:
            disk.remove(tmp, missing_ok=True)
        raise


@contextmanager
def parents_made(path):
    """Make the directories missing above ``path`` for the block that writes it; if the block
    fails, remove the ones made (each while still empty), so that a write refused or stopped by a
    full disk leaves no trace."""
    made: list[Path] = []
    try:
        disk.make_dir(Path(path).parent, parents=True, exist_ok=True, made=made)
        yield made
    except BaseException:
        for directory in reversed(made):
            try:
                disk.remove_dir(directory)
            except OSError:
                break
        raise


_TEMPORARY_TOKEN = re.compile(r"[a-z0-9_]{8}")
"""What ``tempfile.mkstemp`` appends to :func:`atomic_write_text`'s prefix."""


def remove_abandoned_writes(directory, names) -> None:
    """Delete the temporary files that writes of ``names`` killed half-way left in ``directory``
    (``.NAME.`` and eight random characters: a ``kill -9`` between the temporary file's creation
    and its rename runs no cleanup). Only for a caller that holds the directory's lock: no other
    process writes there then."""
    directory = Path(directory)
    prefixes = tuple(f".{name}." for name in names)
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        for prefix in prefixes:
            if (
                entry.name.startswith(prefix)
                and _TEMPORARY_TOKEN.fullmatch(entry.name[len(prefix) :])
                and entry.is_file(follow_symlinks=False)
            ):
                try:
                    disk.remove(entry.path, missing_ok=True)
                except OSError:
                    pass


def sha256_file(path, on_block=None) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks (``on_block(bytes)`` sees each one)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            if on_block is not None:
                on_block(block)
    return h.hexdigest()


def files_under(directory, skip: tuple[str, ...] = ()) -> dict[str, Path]:
    """Every file below ``directory`` by its relative POSIX name (``skip``: names left out).

    A symbolic link or anything that is not a regular file is refused: a manifest vouches
    for the bytes nanolm wrote, and a link points at bytes it did not write.
    """
    directory = Path(directory)
    found: dict[str, Path] = {}
    for root, dirs, names in os.walk(directory, followlinks=False):
        for name in dirs + names:
            path = Path(root) / name
            rel = path.relative_to(directory).as_posix()
            if path.is_symlink():
                raise NanolmError(f"{path} is a symbolic link; nanolm's directories hold none")
            if name in names:
                if not path.is_file():
                    raise NanolmError(f"{path} is not a regular file")
                if rel not in skip:
                    found[rel] = path
    return found


def is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def check_manifest(directory, files, what: str, skip: tuple[str, ...] = (), on_block=None) -> None:
    """Refuse ``directory`` unless its files are exactly ``files`` (name -> SHA-256), each intact.

    ``skip`` names files not covered (the file holding the manifest itself). ``on_block(name,
    bytes)`` sees every block read, so a caller can check contents in the same pass.
    """
    if (
        not isinstance(files, dict)
        or not files
        or not all(isinstance(k, str) and is_sha256(v) for k, v in files.items())
    ):
        raise NanolmError(f"{what}: its manifest of files and checksums is missing or malformed")
    on_disk = files_under(directory, skip)
    missing = sorted(set(files) - set(on_disk))
    if missing:
        raise NanolmError(f"{what}: {missing[0]} is missing")
    unlisted = sorted(set(on_disk) - set(files))
    if unlisted:
        raise NanolmError(f"{what}: {unlisted[0]} is not in its manifest (a file nanolm did not write)")
    for name in sorted(files):
        callback = None if on_block is None else (lambda block, name=name: on_block(name, block))
        try:
            digest = sha256_file(on_disk[name], callback)
        except FileNotFoundError:  # removed since it was listed
            raise NanolmError(f"{what}: {name} is missing") from None
        if digest != files[name]:
            raise NanolmError(f"{what}: {name} is corrupt (its checksum does not match)")


def manifest(directory, names=None, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """name -> SHA-256 of ``names`` (default: every file below ``directory`` but ``skip``)."""
    directory = Path(directory)
    paths = files_under(directory, skip) if names is None else {n: directory / n for n in names}
    return {name: sha256_file(paths[name]) for name in sorted(paths)}


SEAL = "seal"


def _digest_of(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=True).encode()).hexdigest()


def sealed(meta: dict) -> dict:
    """``meta`` with a ``seal``: the SHA-256 of the rest of it. A manifest vouches for the
    other files; the seal vouches for the manifest itself, so that a flipped bit anywhere in
    a metadata file (a step, a validation loss, a checksum) is detected, not believed."""
    return {**meta, SEAL: _digest_of(meta)}


def check_seal(meta: dict, what: str) -> None:
    if not isinstance(meta.get(SEAL), str) or meta[SEAL] != _digest_of(meta):
        raise NanolmError(f"{what} is damaged (its seal does not match its content)")


def refuse_taken_outputs(out: Path, names, flag: str = "--out") -> None:
    """A command that writes one directory per item under ``out`` (the lab's variants, the sweep's
    learning rates) starts none when any of them is already there: a second command on the same
    ``out`` never mixes its runs with the first one's, or continues them by accident."""
    taken = [name for name in names if (Path(out) / name).exists()]
    if taken:
        raise NanolmError(f"{Path(out) / taken[0]} already exists; choose another {flag}")


MOUNTINFO = "/proc/self/mountinfo"


def mount_points() -> set[str]:
    """The mount points Linux lists for this process (none elsewhere). ``os.path.ismount``
    compares a directory's device with its parent's, so it misses a bind mount of a directory of
    the same file system (``mount --bind``, a container's volume), which refuses a rename all the
    same (EBUSY)."""
    try:
        with open(MOUNTINFO, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    found = set()
    for line in lines:
        fields = line.split(b" ")
        if len(fields) > 4:  # the fifth field, with a space or a newline written as \040, \012
            found.add(os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])))
    return found


def refuse_mount_point(path, flag: str) -> None:
    """Refuse an output that is a mount point: a command that replaces its whole output in one
    rename (prepare, export) cannot rename onto a mount point (the system answers EBUSY or
    EXDEV, and what was built beside it would be lost); a directory inside it is fine. A bind
    mount counts (:func:`mount_points`): it is refused here, before the work, not at its end."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink() and (os.path.ismount(path) or os.path.realpath(path) in mount_points()):
        raise NanolmError(
            f"{flag} {path} is a mount point, which nanolm cannot replace in one step; choose a "
            f"directory inside it ({flag} {path / 'out'})"
        )


def refuse_unmakeable(path, flag: str, file: bool = False) -> Path:
    """Refuse, before anything is written, an output that no ``mkdir`` or ``open`` could make:
    one under a symbolic link to nothing or under a regular file, a file where a directory is
    wanted or a directory where a file is (``file``). Every command that writes checks its output
    so (the command line's ``check_output``), so each of these is the same one line whichever
    command met it, not a traceback from its first ``mkdir``. Returns the nearest existing
    directory at or above ``path`` (above it for a file), the one a write would start in."""
    path = Path(path)
    disk.refuse_dangling_link(path)
    if file and path.is_dir():
        raise NanolmError(f"{flag} {path} is a directory; give the name of a file (inside it, or elsewhere)")
    if not file and path.exists() and not path.is_dir():
        raise NanolmError(f"{flag} {path} is a file, not a directory; choose another {flag}")
    existing = path.parent if file else path
    while not existing.exists():
        disk.refuse_dangling_link(existing)
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise NanolmError(f"{flag} {path}: {existing} is a file, not a directory; choose another {flag}")
    return existing


def probe_writable(path, flag: str = "--out-dir") -> None:
    """Refuse, before anything is written, a run directory that cannot be created or written.

    Past :func:`refuse_unmakeable`, creates (then removes) a file in the nearest existing
    directory: the only test that also holds for root, read-only mounts and network file
    systems. A training run does, as its first write comes only after its data is prepared;
    the other commands write within moments of starting, and their first write's refusal is the
    same one line.
    """
    existing = refuse_unmakeable(path, flag)
    try:
        fd, probe = disk.make_scratch_file(existing, ".nanolm-write-probe-")
        os.close(fd)
        disk.remove(probe)
    except OSError as e:
        raise NanolmError(
            f"{flag} {path}: cannot write in {existing} ({e.strerror or e}); choose a directory you can write"
        ) from None
