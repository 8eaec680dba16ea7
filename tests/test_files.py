"""Writing files whole and reading them back checked (nanolm/base/files.py), rule by rule at its
edges: what a failed write leaves, a directory moved across file systems or swapped when the
system cannot swap, a manifest's every refusal, a seal, names that are not UTF-8, and what each
OS error says. test_full_disk.py and test_untrusted_files.py test the same code through whole
runs; these tests pin each rule where it changes its answer, in milliseconds."""

import errno
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import nanolm.base.files as files
from nanolm.base import disk
from nanolm.errors import NanolmError


def test_a_name_that_is_not_utf8_is_refused_with_its_bytes_and_why():
    files.require_utf8("--out-dir", "runs/café", "the run records it")  # UTF-8: nothing happens
    with pytest.raises(NanolmError) as e:
        files.require_utf8("--out-dir", "runs/caf\udce9", "the run records it in config.toml")
    assert str(e.value) == (
        "--out-dir b'runs/caf\\xe9' is not valid UTF-8 text, and the run records it in "
        "config.toml; rename it (or link to it) with a UTF-8 name"
    )


def test_a_prompt_typed_in_utf8_under_any_locale_is_read_as_utf8_and_other_bytes_are_one_line():
    assert files.text_argument("--prompt", "café") == "café"
    assert files.text_argument("--prompt", "caf\udcc3\udca9") == "café"  # UTF-8 bytes kept as surrogates by Python
    with pytest.raises(NanolmError) as e:
        files.text_argument("--prompt", "caf\udce9!")  # Latin-1
    assert str(e.value) == (
        "--prompt b'caf\\xe9!' is not UTF-8 text (byte 3); type it in UTF-8 or set your terminal to UTF-8"
    )


@pytest.mark.parametrize(
    "code, hint",
    [
        (errno.ENOSPC, " (free some space)"),
        (errno.EDQUOT, " (free some space (disk quota))"),
        (errno.EROFS, " (the file system is read-only; choose another --export-dir)"),
        (errno.EACCES, " (you may not write there; choose another --export-dir)"),
        (errno.EPERM, " (you may not write there; choose another --export-dir)"),
        (errno.EFBIG, " (the file is larger than this system allows)"),
        (errno.EIO, ""),
    ],
)
def test_an_os_error_is_one_line_naming_the_file_its_cause_and_what_to_do(code, hint):
    e = OSError(code, os.strerror(code), "/runs/a/model.safetensors")
    assert files.describe_os_error(e, "--export-dir") == (
        f"cannot write /runs/a/model.safetensors: {os.strerror(code)}{hint}"
    )
    assert files.describe_os_error(OSError(code, os.strerror(code))).startswith("cannot write a file: ")
    assert "choose another --out-dir" in files.describe_os_error(OSError(errno.EROFS, "ro"))


def test_an_error_in_words_from_a_rust_writer_becomes_the_os_error_naming_the_file():
    with pytest.raises(OSError) as e, files.naming_the_file("/runs/a/w.bin"):
        raise RuntimeError("I/O error: No space left on device (os error 28)")
    assert (e.value.errno, e.value.strerror, e.value.filename) == (28, os.strerror(28), "/runs/a/w.bin")
    with pytest.raises(OSError) as e, files.naming_the_file("/runs/a/w.bin"):
        raise OSError(errno.EIO, "I/O error", "/elsewhere")
    assert e.value.filename == "/elsewhere"  # a name it already has is kept
    with pytest.raises(ValueError, match="no os error here"), files.naming_the_file("/runs/a/w.bin"):
        raise ValueError("no os error here")


class _Trickle:
    """A raw file that takes one byte per write, then refuses with ENOSPC after ``room`` bytes."""

    def __init__(self, room=10**9):
        self.written, self.room = bytearray(), room

    def write(self, view):
        if len(self.written) >= self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += bytes(view[:1])
        return 1


def test_every_byte_reaches_the_file_through_short_writes_and_a_refusal_is_kept():
    raw = _Trickle()
    whole = files.WholeWrites(raw)
    assert whole.writable() and whole.write(b"hello") == 5 and whole.write(memoryview(b"ab")) == 2
    assert bytes(raw.written) == b"helloab" and whole.error is None
    full = files.WholeWrites(_Trickle(room=3))
    with pytest.raises(OSError):
        full.write(b"hello")
    assert full.error is not None and full.error.errno == errno.ENOSPC


def test_a_replacement_waits_for_a_windows_reader_and_nowhere_else(tmp_path, monkeypatch):
    (tmp_path / "new").write_text("new")
    refusals = []

    def held_open(source, target, real=os.replace):
        if len(refusals) < 3:
            refusals.append(target)
            raise PermissionError(errno.EACCES, "in use", str(target))
        real(source, target)

    monkeypatch.setattr(files.os, "replace", held_open)
    with pytest.raises(PermissionError):  # on Linux and macOS a refusal is not a reader: at once
        files.replace(tmp_path / "new", tmp_path / "old")
    assert len(refusals) == 1
    monkeypatch.setattr(files, "WINDOWS", True)
    files.replace(tmp_path / "new", tmp_path / "old")
    assert (tmp_path / "old").read_text() == "new" and len(refusals) == 3
    refusals.clear()
    (tmp_path / "new").write_text("newer")
    monkeypatch.setattr(files, "REPLACE_WAIT_S", -1.0)  # a reader that never lets go: named, not waited for
    with pytest.raises(PermissionError):
        files.replace(tmp_path / "new", tmp_path / "old")
    assert len(refusals) == 1


def _tree(root, contents):
    for name, text in contents.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _read_tree(root):
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _across_file_systems(monkeypatch):
    real = os.replace

    def no_rename_across(source, target):
        if str(source).endswith("source"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real(source, target)

    monkeypatch.setattr(files.os, "replace", no_rename_across)


def test_a_directory_moved_across_file_systems_arrives_whole_or_not_at_all(tmp_path, monkeypatch):
    contents = {"a.txt": "a", "sub/b.txt": "b", "sub/deeper/c.txt": "c"}
    _tree(tmp_path / "source", contents)
    _across_file_systems(monkeypatch)
    files.move_directory(tmp_path / "source", tmp_path / "target")
    assert _read_tree(tmp_path / "target") == contents and not (tmp_path / "source").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no staging copy left beside it

    _tree(tmp_path / "source", contents)
    real_copy = shutil.copy2

    def disk_fills(src, dst):
        if src.name == "b.txt":
            raise OSError(errno.ENOSPC, "No space left on device", str(src))
        return real_copy(src, dst)

    monkeypatch.setattr(shutil, "copy2", disk_fills)
    with pytest.raises(OSError) as e:
        files.move_directory(tmp_path / "source", tmp_path / "elsewhere")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "elsewhere" / "sub" / "b.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source", "target"]  # the source kept, no partial copy
    assert _read_tree(tmp_path / "source") == contents
    monkeypatch.setattr(files.os, "replace", lambda s, t: (_ for _ in ()).throw(OSError(errno.EACCES, "no", str(t))))
    with pytest.raises(OSError) as e:  # any other refusal is not a cross-device move: raised as it is
        files.move_directory(tmp_path / "source", tmp_path / "third")
    assert e.value.errno == errno.EACCES and not (tmp_path / "third").exists()


def test_a_directory_is_replaced_whole_with_or_without_an_atomic_swap(tmp_path, monkeypatch):
    old, new = (
        {"meta.json": "old meta", "a.bin": "old a", "gone.bin": "old"},
        {"meta.json": "new meta", "a.bin": "new a"},
    )
    _tree(tmp_path / "staging", new)
    files.replace_directory(tmp_path / "staging", tmp_path / "data")  # absent: a rename
    assert _read_tree(tmp_path / "data") == new and not (tmp_path / "staging").exists()

    if sys.platform.startswith("linux"):
        _tree(tmp_path / "swap", old)
        _tree(tmp_path / "staging", new)
        files.replace_directory(tmp_path / "staging", tmp_path / "swap", last="meta.json")
        assert _read_tree(tmp_path / "swap") == new and not (tmp_path / "staging").exists()

    monkeypatch.setattr(files, "_exchange", lambda a, b: False)  # Windows, macOS, NFS
    _tree(tmp_path / "moved", {**old, ".lock": ""})
    _tree(tmp_path / "staging", new)
    with disk.faults(disk.FaultPlan()) as seen:
        files.replace_directory(tmp_path / "staging", tmp_path / "moved", last="meta.json")
    order = [
        ("-" if kind == "remove" else "") + os.path.basename(path)
        for kind, path in seen.steps
        if kind in ("remove", "rename") and os.path.dirname(path) == str(tmp_path / "moved")
    ]
    assert order == ["-meta.json", "a.bin", "meta.json"]  # what vouches for the rest: out first, back last
    assert _read_tree(tmp_path / "moved") == {**new, "gone.bin": "old", ".lock": ""}  # other entries (the lock) stay
    assert not (tmp_path / "staging").exists()


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "meta.json"
    files.atomic_write_text(path, "old ✓")
    assert path.read_text(encoding="utf-8") == "old ✓" and os.listdir(tmp_path) == ["meta.json"]
    monkeypatch.setattr(files.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError) as e:
        files.atomic_write_text(path, "new")
    assert e.value.filename == str(path)
    assert path.read_text(encoding="utf-8") == "old ✓" and os.listdir(tmp_path) == ["meta.json"]


def test_a_files_digest_is_its_sha256_read_in_blocks_each_shown_once(tmp_path):
    data = os.urandom((1 << 20) + 5)
    (tmp_path / "f").write_bytes(data)
    blocks = []
    assert files.sha256_file(tmp_path / "f", blocks.append) == hashlib.sha256(data).hexdigest()
    assert [len(b) for b in blocks] == [1 << 20, 5]
    assert files.manifest(tmp_path) == {"f": hashlib.sha256(data).hexdigest()}


def test_a_manifest_is_refused_unless_it_lists_exactly_the_files_each_intact(tmp_path):
    d = _tree(tmp_path / "d", {"a.bin": "a", "sub/b.bin": "b", "meta.json": "{}"})
    listed = files.manifest(d, skip=("meta.json",))
    assert sorted(listed) == ["a.bin", "sub/b.bin"]
    assert files.manifest(d, names=["a.bin"]) == {"a.bin": listed["a.bin"]}
    seen = []
    files.check_manifest(
        d, listed, "data", skip=("meta.json",), on_block=lambda name, block: seen.append((name, block))
    )
    assert seen == [("a.bin", b"a"), ("sub/b.bin", b"b")]

    def refusal(manifest, skip=("meta.json",)):
        with pytest.raises(NanolmError) as e:
            files.check_manifest(d, manifest, "data", skip=skip)
        return str(e.value)

    malformed = "data: its manifest of files and checksums is missing or malformed"
    for bad in (
        None,
        {},
        [],
        {"a.bin": "A" * 64},
        {"a.bin": listed["a.bin"][:63]},
        {1: listed["a.bin"]},
        {**listed, "c": "g" * 64},
    ):
        assert refusal(bad) == malformed, bad
    assert refusal({**listed, "c.bin": "0" * 64}) == "data: c.bin is missing"
    assert refusal(listed, skip=()) == "data: meta.json is not in its manifest (a file nanolm did not write)"
    assert refusal({**listed, "a.bin": "0" * 64}) == "data: a.bin is corrupt (its checksum does not match)"
    assert files.is_sha256("0123456789abcdef" * 4) and not files.is_sha256(b"0" * 64)


def test_a_link_or_anything_not_a_regular_file_in_a_directory_nanolm_wrote_is_refused(tmp_path):
    d = _tree(tmp_path / "d", {"a.bin": "a"})
    assert files.files_under(d) == {"a.bin": d / "a.bin"} and files.files_under(d, skip=("a.bin",)) == {}
    (tmp_path / "outside").write_text("not ours")
    os.symlink(tmp_path / "outside", d / "link.bin")
    with pytest.raises(NanolmError) as e:
        files.files_under(d)
    assert str(e.value) == f"{d / 'link.bin'} is a symbolic link; nanolm's directories hold none"
    (d / "link.bin").unlink()
    os.symlink(tmp_path, d / "dirlink")
    with pytest.raises(NanolmError, match="dirlink is a symbolic link"):
        files.files_under(d)
    (d / "dirlink").unlink()
    if hasattr(os, "mkfifo"):
        os.mkfifo(d / "pipe")
        with pytest.raises(NanolmError) as e:
            files.files_under(d)
        assert str(e.value) == f"{d / 'pipe'} is not a regular file"


def test_a_seal_vouches_for_every_field_of_a_metadata_file():
    meta = files.sealed({"step": 3, "val_loss": float("nan"), "files": {"a": "0" * 64}})
    files.check_seal(meta, "meta.json")
    assert files.sealed(meta) == meta  # sealing again seals the same content
    for damaged in (
        {**meta, "step": 4},
        {**meta, "seal": meta["seal"][:-1] + "0"},
        {**meta, "seal": None},
        {k: v for k, v in meta.items() if k != "seal"},
        {**meta, "extra": 1},
    ):
        with pytest.raises(NanolmError) as e:
            files.check_seal(damaged, "meta.json")
        assert str(e.value) == "meta.json is damaged (its seal does not match its content)"


def test_a_run_directory_that_cannot_be_written_is_refused_before_anything_is(tmp_path):
    files.probe_writable(tmp_path / "new" / "deeper")  # absent: its nearest existing ancestor is tried
    assert os.listdir(tmp_path) == []  # the probe leaves nothing
    (tmp_path / "f").write_text("x")
    with pytest.raises(NanolmError) as e:
        files.probe_writable(tmp_path / "f")
    assert str(e.value) == f"--out-dir {tmp_path / 'f'} is a file, not a directory; choose another --out-dir"
    with pytest.raises(NanolmError) as e:
        files.probe_writable(tmp_path / "f" / "run")
    assert str(e.value) == (
        f"--out-dir {tmp_path / 'f' / 'run'}: {tmp_path / 'f'} is a file, not a directory; choose another --out-dir"
    )
    if os.name == "posix" and os.geteuid() != 0:
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(NanolmError, match=r"cannot write in .*ro \(Permission denied\); choose a directory"):
            files.probe_writable(tmp_path / "ro" / "run")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2's exchange is Linux's")
def test_two_directories_are_swapped_in_one_step_and_a_failure_names_its_cause(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths: resolved against the working directory (AT_FDCWD)
    _tree(tmp_path / "a", {"x": "from a"})
    _tree(tmp_path / "b", {"y": "from b"})
    if not files._exchange(files.Path("a"), files.Path("b")):
        pytest.skip("this file system or C library cannot exchange two paths")
    assert _read_tree(tmp_path / "a") == {"y": "from b"} and _read_tree(tmp_path / "b") == {"x": "from a"}
    with pytest.raises(OSError) as e:
        files._exchange(files.Path("missing"), files.Path("b"))
    assert (e.value.errno, e.value.strerror, e.value.filename) == (errno.ENOENT, os.strerror(errno.ENOENT), "b")


def test_a_system_that_cannot_exchange_says_so_and_any_other_failure_is_raised(tmp_path, monkeypatch):
    import ctypes

    class Libc:
        def __init__(self, code):
            self.code = code

        def renameat2(self, *args):
            ctypes.set_errno(self.code)
            return -1

    for code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        monkeypatch.setattr(ctypes, "CDLL", lambda name, use_errno=False, code=code: Libc(code))
        assert files._exchange(tmp_path / "a", tmp_path / "b") is False or not sys.platform.startswith("linux")
    monkeypatch.setattr(ctypes, "CDLL", lambda name, use_errno=False: Libc(errno.EIO))
    if sys.platform.startswith("linux"):
        with pytest.raises(OSError) as e:
            files._exchange(tmp_path / "a", tmp_path / "b")
        assert e.value.errno == errno.EIO and e.value.filename == str(tmp_path / "b")
    monkeypatch.setattr(ctypes, "CDLL", lambda name, use_errno=False: object())  # a C library without renameat2
    assert files._exchange(tmp_path / "a", tmp_path / "b") is False

    def no_c_library(name, use_errno=False):
        raise OSError("no C library to load")

    monkeypatch.setattr(ctypes, "CDLL", no_c_library)
    assert files._exchange(tmp_path / "a", tmp_path / "b") is False
    monkeypatch.setattr(files.sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", lambda name, use_errno=False: Libc(0))
    assert files._exchange(tmp_path / "a", tmp_path / "b") is False  # not Linux: never tried


def test_a_seal_does_not_depend_on_the_order_of_a_files_keys():
    meta = files.sealed({"b": 1, "a": {"y": 2, "x": 3}})
    reordered = {"seal": meta["seal"], "a": {"x": 3, "y": 2}, "b": 1}  # the same content, read back in another order
    files.check_seal(reordered, "meta.json")
    assert files.is_sha256("0" * 64) and not files.is_sha256("X" * 64) and not files.is_sha256("0" * 63 + "g")


def test_a_write_whose_last_step_fails_raises_that_failure_and_leaves_no_file_of_its_own(tmp_path, monkeypatch):
    path = tmp_path / "meta.json"
    seen = []
    real_fsync = os.fsync

    def watched(fd):
        seen.append(sorted(os.listdir(tmp_path)))
        return real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", watched)
    files.atomic_write_text(path, "{}")
    assert len(seen[0]) == 1 and seen[0][0].startswith(".meta.json.")  # hidden while written, named after its file

    def directory_sync_fails(directory):
        raise OSError(errno.EIO, "I/O error", str(directory))

    monkeypatch.setattr(files, "fsync_dir", directory_sync_fails)  # after the rename: the temporary name is gone
    with pytest.raises(OSError) as e:
        files.atomic_write_text(path, "new")
    assert e.value.errno == errno.EIO and os.listdir(tmp_path) == ["meta.json"]


def test_cleaning_up_never_raises_whatever_fails_in_it(tmp_path, monkeypatch):
    _tree(tmp_path / "source", {"a.txt": "a"})
    _across_file_systems(monkeypatch)
    with disk.faults(disk.FaultPlan()) as counted:
        files.move_directory(tmp_path / "source", tmp_path / "counted")
    first_removal = 1 + [kind for kind, _ in counted.steps].index("remove")  # of the source, once copied
    _tree(tmp_path / "source", {"a.txt": "a"})
    with disk.faults(disk.FaultPlan(at=first_removal, fault=errno.EACCES)):  # a leftover someone else owns
        files.move_directory(tmp_path / "source", tmp_path / "moved")
    assert _read_tree(tmp_path / "moved") == {"a.txt": "a"}
    _tree(tmp_path / "source", {"a.txt": "a"})
    beside = []

    def disk_full(src, dst):
        beside.extend(sorted(p.name for p in tmp_path.iterdir()))
        raise OSError(errno.ENOSPC, "No space left on device", str(src))

    monkeypatch.setattr(shutil, "copy2", disk_full)
    with pytest.raises(OSError) as e:  # the disk's refusal, not the cleanup's
        files.move_directory(tmp_path / "source", tmp_path / "elsewhere")
    assert e.value.errno == errno.ENOSPC
    assert [n for n in beside if n not in ("moved", "source", "counted")][0].startswith(
        ".elsewhere."
    )  # the copy, hidden
    for exchange in (True, False):
        _tree(tmp_path / "target", {"meta.json": "old"})
        _tree(tmp_path / "staging", {"meta.json": "new"})
        if not exchange:
            monkeypatch.setattr(files, "_exchange", lambda a, b: False)
        files.replace_directory(tmp_path / "staging", tmp_path / "target", last="meta.json")
        assert _read_tree(tmp_path / "target") == {"meta.json": "new"}


def test_a_directory_replaced_one_file_at_a_time_may_lack_the_file_that_vouches_for_it(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    _tree(tmp_path / "target", {"a.bin": "old"})  # an earlier interruption left it without its meta.json
    _tree(tmp_path / "staging", {"a.bin": "new", "meta.json": "new meta"})
    files.replace_directory(tmp_path / "staging", tmp_path / "target", last="meta.json")
    assert _read_tree(tmp_path / "target") == {"a.bin": "new", "meta.json": "new meta"}
    _tree(tmp_path / "staging", {"a.bin": "newer", "b.bin": "b"})
    files.replace_directory(tmp_path / "staging", tmp_path / "target")  # nothing vouches: every file alike
    assert _read_tree(tmp_path / "target") == {"a.bin": "newer", "b.bin": "b", "meta.json": "new meta"}


def test_the_write_probe_tries_the_directory_itself_and_hides_its_file(tmp_path, monkeypatch):
    real = tempfile.mkstemp
    tried = []

    def read_only_here(dir=None, prefix=None, **kw):
        tried.append((dir, prefix))
        if dir == tmp_path:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(dir=dir, prefix=prefix, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", read_only_here)
    with pytest.raises(NanolmError) as e:
        files.probe_writable(tmp_path / "run")
    assert str(e.value) == (
        f"--out-dir {tmp_path / 'run'}: cannot write in {tmp_path} (Permission denied); choose a "
        f"directory you can write"
    )
    assert tried == [(tmp_path, ".nanolm-write-probe-")]


def test_a_long_prompt_that_is_not_utf8_is_quoted_in_brief():
    with pytest.raises(NanolmError) as e:
        files.text_argument("--prompt", "\udce9" * 100)
    quoted = str(e.value).removeprefix("--prompt ").split(" is not UTF-8 text")[0]
    assert quoted.startswith("b'\\xe9\\xe9") and quoted.endswith("... (403 characters)") and len(quoted) == 60


def test_a_file_is_written_as_utf8_whatever_the_locale(tmp_path):
    import subprocess

    files.atomic_write_text(tmp_path / "here.toml", 'out_dir = "runs/café"\n')
    assert (tmp_path / "here.toml").read_bytes() == 'out_dir = "runs/café"\n'.encode()
    code = (
        "import sys; from nanolm.base.files import atomic_write_text; "
        "atomic_write_text(sys.argv[1], 'out_dir = \"runs/caf\\u00e9\"\\n')"
    )
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c.toml")], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "c.toml").read_bytes() == 'out_dir = "runs/café"\n'.encode()


def test_a_listed_file_removed_before_it_is_hashed_is_named_missing(tmp_path, monkeypatch):
    d = _tree(tmp_path / "d", {"a.bin": "a"})
    listed = files.manifest(d)

    def vanished(path, on_block=None):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))

    monkeypatch.setattr(files, "sha256_file", vanished)
    with pytest.raises(NanolmError) as e:
        files.check_manifest(d, listed, "data")
    assert str(e.value) == "data: a.bin is missing"


def test_an_output_under_a_dangling_link_is_refused_in_one_line_naming_the_link(tmp_path, capsys):
    from nanolm.instruments.cli import main

    source = tmp_path / "text.txt"
    source.write_text("a story about a cat. " * 200)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    for argv in (
        ["prepare", "--data", str(source), "--out", str(tmp_path / "link" / "data"), "--tokenizer", "char"],
        ["train", "--data", str(source), "--out-dir", str(tmp_path / "link" / "run"), "--steps", "1"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"error: {tmp_path / 'link'} is a symbolic link to {tmp_path / 'nowhere'}, which does not "
            f"exist; create what it points to, or choose a path without it"
        ], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "text.txt"]


def test_an_output_that_is_a_mount_point_is_refused_before_anything_is_built(tmp_path, capsys, monkeypatch):
    from nanolm.instruments.cli import main

    source = tmp_path / "text.txt"
    source.write_text("a story about a cat. " * 200)
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(files.os.path, "ismount", lambda p: Path(p) == mounted or real(p))
    assert main(["prepare", "--data", str(source), "--out", str(mounted), "--tokenizer", "char"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --out {mounted} is a mount point, which nanolm cannot replace in "
        f"one step; choose a directory inside it (--out {mounted / 'out'})"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mounted", "text.txt"] and not any(mounted.iterdir())


def test_a_command_writing_one_directory_per_item_refuses_an_out_holding_any_of_them(tmp_path):
    """The lab's variants and the sweep's rates: a second command on the same --out starts none,
    naming the first directory already there."""
    files.refuse_taken_outputs(tmp_path / "new", ["a", "b"])  # an --out not made yet
    (tmp_path / "out" / "b").mkdir(parents=True)
    files.refuse_taken_outputs(tmp_path / "out", ["a", "c"])
    with pytest.raises(files.NanolmError) as refused:
        files.refuse_taken_outputs(tmp_path / "out", ["a", "b"], flag="--out-dir")
    assert str(refused.value) == f"{tmp_path / 'out' / 'b'} already exists; choose another --out-dir"
