"""One run directory, one writer: a second process on a live run is refused in one line,
and nothing of the first is lost.

The processes here are real (``python -m nanolm train`` in a subprocess, stopped with
SIGSTOP at the moment under test, so that no test depends on how fast a machine is) and
each test compares the first run's weights and metrics, bit for bit, with the same
command run alone.
"""

import contextlib
import errno
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import nanolm.base.lock
import nanolm.checkpoint as ckpt
import nanolm.run.final as final
from nanolm.base.lock import LOCK_FILE, NO_LOCK, DirectoryBusy, RunLock
from nanolm.errors import NanolmError
from nanolm.instruments.cli import main
from nanolm.run.final import load_run, read_final
from nanolm.watch.sinks import read_metrics

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
    "4",
    "--eval-batches",
    "2",
    "--sample-tokens",
    "0",
    "--tokenizer",
    "char",
    "--log-every",
    "1",
    "--steps",
    "100",
    "--eval-every",
    "25",
    "--ckpt-every",
    "10",
    "--threads",
    "1",
]
SAME = ("step", "loss", "lr", "grad_norm", "val_loss")  # what two runs of one command share, bit for bit


def _command(data, *extra):
    return ["train", "--data", str(data), *TINY, *map(str, extra)]


def _start(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "nanolm", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _when(proc: subprocess.Popen, condition, timeout=120) -> None:
    """Wait until ``condition()`` holds while ``proc`` runs."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exit {proc.returncode}: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _holds_lock(proc, run_dir):
    def check():
        try:
            return (run_dir / LOCK_FILE).read_text().startswith(f"{proc.pid}@")
        except FileNotFoundError:
            return False

    return check


@contextlib.contextmanager
def _stopped_after_its_first_checkpoint(data, out):
    """A `nanolm train` on ``out``, stopped (SIGSTOP) once its first checkpoint is committed,
    holding the lock; on leaving, continued: it must then end as it would have alone."""
    first = _start(*_command(data, "--out-dir", out))
    try:
        _when(first, lambda: (out / "checkpoints" / "latest").exists() and _holds_lock(first, out)())
        first.send_signal(signal.SIGSTOP)
        yield first
    finally:
        first.send_signal(signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr


def _same_run(a, b) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    rows = [[{k: r.get(k) for k in SAME} for r in read_metrics(d / "metrics.jsonl")] for d in (a, b)]
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa) and rows[0] == rows[1]


def _files(run_dir):
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def alone(tmp_path_factory, stories_file):
    """The command, run alone."""
    out = tmp_path_factory.mktemp("alone") / "run"
    assert main(_command(stories_file, "--out-dir", out)) == 0
    return out


# ------------------------------------------------------------------ the lock itself
def test_a_directory_has_one_writer_and_a_second_is_refused_naming_the_holder(tmp_path):
    with RunLock() as first:
        first.take(tmp_path / "run")
        with pytest.raises(DirectoryBusy) as refused:
            RunLock().take(tmp_path / "run")  # another open file: refused even in the same process
        assert (
            f"is being written by process {os.getpid()} on {socket.gethostname()}; wait for it to end, "
            f"or choose another --out-dir" in str(refused.value)
        )
    with RunLock() as second:  # let go: the next writer takes it
        second.take(tmp_path / "run")


def test_the_lock_leaves_no_trace_when_it_is_let_go(tmp_path):
    """A command refused after taking the lock (its data too short...) wrote nothing: the
    directories the lock made are removed again when nothing was written into them."""
    with RunLock() as lock:
        lock.take(tmp_path / "runs" / "new")
        assert (tmp_path / "runs" / "new" / LOCK_FILE).is_file()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    with RunLock() as lock:
        lock.take(tmp_path / "mine")
    assert (tmp_path / "mine").is_dir() and list((tmp_path / "mine").iterdir()) == []


def test_the_lock_dies_with_its_holder(tmp_path):
    """``kill -9``: no handler runs, and the lock is free at once. Its file stays behind, naming
    a dead process, and means nothing: the flock decides."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from nanolm.base.lock import RunLock; "
            "RunLock().take(sys.argv[1]); print('held', flush=True); time.sleep(600)",
            str(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(DirectoryBusy, match=f"process {holder.pid} on"):
        RunLock().take(tmp_path / "run")
    holder.kill()
    holder.wait()
    assert (tmp_path / "run" / LOCK_FILE).read_text().startswith(f"{holder.pid}@")
    with RunLock() as lock:
        lock.take(tmp_path / "run")


def test_a_file_system_without_locks_is_refused_unless_told_otherwise(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(nanolm.base.lock.fcntl, "flock", no_locks)
    with pytest.raises(NanolmError, match=f"without working locks .*set {NO_LOCK}=1"):
        RunLock().take(tmp_path / "run")
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv(NO_LOCK, "1")
    said = []
    with RunLock() as lock:
        lock.take(tmp_path / "run", log=said.append)
    assert "written without a lock" in said[0]


# ------------------------------------------------------------------ two processes, one run
def test_a_second_train_on_a_live_run_is_refused_and_the_first_ends_as_if_alone(tmp_path, stories_file, alone, capsys):
    """The issue's case: the second command (a changed --lr, which a resume allows) starts
    while the first runs. It is refused in one line naming the first, writes nothing, and
    the first ends bit-identical to the command run alone. Readers keep working meanwhile."""
    out = tmp_path / "run"
    first = _start(*_command(stories_file, "--out-dir", out))
    try:
        _when(first, lambda: (out / "checkpoints" / "latest").exists() and _holds_lock(first, out)())
        first.send_signal(signal.SIGSTOP)  # mid-run, holding the lock
        before = _files(out)
        assert main(_command(stories_file, "--out-dir", out, "--lr", "1e-2")) == 2
        line = _one_error_line(capsys)
        assert f"{out} is being written by process {first.pid} on {socket.gethostname()}; wait" in line
        assert "--out-dir" in line and _files(out) == before
        load_run(out)  # readers (sample, eval, export) read the newest checkpoint meanwhile
        assert main(["diagnose", str(out)]) in (0, 1)
    finally:
        first.send_signal(signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    assert _same_run(out, alone) and not (out / LOCK_FILE).exists()


def test_a_second_train_without_out_dir_skips_a_live_different_run_and_refuses_its_own(
    tmp_path, stories_file, capsys, monkeypatch
):
    """Without --out-dir a command picks ``runs/<name>`` or the next numbered directory: a
    directory another process is writing is skipped when it holds a different run (as it
    would be if that process were not running) and refused when it holds this very run."""
    monkeypatch.chdir(tmp_path)
    name = stories_file.stem
    assert main(_command(stories_file, "--steps", 2, "--n-embd", 64)) == 0
    with RunLock() as live:
        live.take(tmp_path / "runs" / name)  # as if that run were training now
        capsys.readouterr()
        assert main(_command(stories_file, "--steps", 2)) == 0
        assert (
            f"holds a different run (n_embd: 64 -> 32); this one is {os.path.join('runs', name + '-2')}"
            in capsys.readouterr().out
        )
        assert main(_command(stories_file, "--steps", 2, "--n-embd", 64)) == 2
        assert f"runs/{name} is being written by process {os.getpid()}" in _one_error_line(capsys)


def test_killed_with_9_the_holder_lets_go_and_the_same_command_resumes_bit_identical(
    tmp_path, stories_file, alone, capsys
):
    out = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-m", "nanolm", *_command(stories_file, "--out-dir", out, "--debug-kill-after-checkpoint", 50)]
    )
    assert killed.returncode == -signal.SIGKILL
    assert (out / LOCK_FILE).is_file()  # left behind by the dead process: it must not block the rerun
    assert main(_command(stories_file, "--out-dir", out)) == 0
    assert f"resumed from {out / 'checkpoints' / 'step_000050'}" in capsys.readouterr().out
    assert _same_run(out, alone) and not (out / LOCK_FILE).exists()


def test_a_reader_during_a_save_loads_a_whole_checkpoint(tmp_path, stories_file, monkeypatch):
    """``--keep 1``: each save discards the checkpoint before it, possibly while ``nanolm
    sample`` reads it. Here the reader has checked the newest checkpoint and is about to load
    its weights when the live run saves the next one and discards it: the reader loads the
    newest one instead of failing."""
    out = tmp_path / "run"
    run = _start(
        *_command(stories_file, "--out-dir", out, "--steps", 200, "--ckpt-every", 1, "--keep", 1, "--eval-every", 1000)
    )
    try:
        _when(run, lambda: (out / "checkpoints" / "latest").exists())
        run.send_signal(signal.SIGSTOP)
        read, real = [], ckpt.load_weights

        def save_meanwhile(model, path):
            if not read:  # the first checkpoint read: let the run save the next ones, discarding it
                run.send_signal(signal.SIGCONT)
                deadline = time.monotonic() + 60
                while path.exists() and time.monotonic() < deadline:
                    time.sleep(0.001)
                run.send_signal(signal.SIGSTOP)
            read.append(path.parent.name)
            return real(model, path)

        monkeypatch.setattr(final, "load_weights", save_meanwhile)  # where load_run looks it up
        model, _, _ = load_run(out)
        assert len(read) == 2 and read[0] != read[1] and ckpt.weights_are_finite(model)
        rows = read_metrics(out / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(len(rows)))  # never half a line
    finally:
        run.send_signal(signal.SIGCONT)
        run.kill()
        run.communicate()


# ------------------------------------------------------------------ other writers
def test_prepare_into_a_directory_being_written_is_refused(tmp_path, stories_file, capsys):
    with RunLock() as live:
        live.take(tmp_path / "shards")
        assert (
            main(["prepare", "--data", str(stories_file), "--out", str(tmp_path / "shards"), "--tokenizer", "char"])
            == 2
        )
        line = _one_error_line(capsys)
        assert f"is being written by process {os.getpid()}" in line and line.endswith("choose another --out")
        assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [LOCK_FILE]
    assert main(["prepare", "--data", str(stories_file), "--out", str(tmp_path / "shards"), "--tokenizer", "char"]) == 0


def test_a_prepare_refused_by_a_live_prepare_leaves_its_scratch_directory_alone(tmp_path, stories_file, capsys):
    """A prepare cleans up the scratch directories that killed prepares into its --out left
    behind, but only once it holds --out's lock: before, a live prepare's scratch directory
    would look abandoned wherever a directory cannot be locked (a network file system; Windows,
    where no directory is), and be deleted under it. A second prepare into a directory a live
    prepare writes is refused before it touches anything."""
    out = tmp_path / "shards"
    scratch = tmp_path / ".shards.prepare-abcd1234"  # the live prepare's, its own flock not held
    scratch.mkdir()
    (scratch / "train.bin").write_bytes(b"half of a shard")
    with RunLock() as live:
        live.take(out, flag="--out")  # the lock a live prepare holds while it writes
        assert main(["prepare", "--data", str(stories_file), "--out", str(out), "--tokenizer", "char"]) == 2
        assert f"is being written by process {os.getpid()}" in _one_error_line(capsys)
        assert (scratch / "train.bin").read_bytes() == b"half of a shard"
        assert sorted(p.name for p in tmp_path.iterdir()) == [scratch.name, "shards"]
    assert main(["prepare", "--data", str(stories_file), "--out", str(out), "--tokenizer", "char"]) == 0
    assert not scratch.exists()  # no one holds the lock now: the scratch is abandoned, and removed


def test_a_sweep_takes_its_directory_and_each_rate_s_run(tmp_path, stories_file, capsys, monkeypatch):
    """A sweep on a directory another sweep writes is refused before it writes anything; and
    each rate's run is locked while it trains, since the sweep trains it with ``train()``."""
    out = tmp_path / "sweep"
    sweep = ["sweep", "--lrs", "1e-3", "--out", str(out), "--data", str(stories_file), *TINY, "--no-report"]
    with RunLock() as live:
        live.take(out)
        assert main(sweep) == 2
        assert f"{out} is being written by process {os.getpid()}" in _one_error_line(capsys)
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    held = []
    real = ckpt.save_checkpoint

    def check_the_lock(run_dir, step, *a, **k):
        with pytest.raises(DirectoryBusy):
            RunLock().take(run_dir)
        held.append(step)
        return real(run_dir, step, *a, **k)

    monkeypatch.setattr(ckpt, "save_checkpoint", check_the_lock)
    assert main(sweep) == 0
    assert held and not (out / "lr_0.001" / LOCK_FILE).exists() and not (out / LOCK_FILE).exists()


# ------------------------------------------------------------------ --steps below where the run is
def test_resuming_with_steps_below_the_checkpoint_says_so_in_one_line(tmp_path, stories_file, capsys):
    out = tmp_path / "run"
    assert main(_command(stories_file, "--out-dir", out, "--steps", 10)) == 0
    capsys.readouterr()
    assert main(_command(stories_file, "--out-dir", out, "--steps", 5)) == 0  # finished at 10
    said = f"{out} is at step 10, past --steps 5: nothing to train; its final weights are from step 10"
    assert said in capsys.readouterr().out
    (out / "final.json").unlink()  # killed after its last checkpoint: the final weights are still to write
    (out / "model.safetensors").unlink()
    assert main(_command(stories_file, "--out-dir", out, "--steps", 5)) == 0
    assert said in capsys.readouterr().out and read_final(out)["step"] == 10


# ------------------------------------------------------------------ odd lock files, side doors (issue 34)
@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
@pytest.mark.parametrize("command", ["train", "prepare"])
def test_a_lock_file_that_is_not_a_plain_file_is_refused_in_one_line_and_left_alone(
    kind, command, tmp_path, stories_file, capsys
):
    """A ``.lock`` that is a symbolic link (which could point anywhere), a FIFO (which would
    block or refuse the holder's line) or a directory is not nanolm's: one line names it and
    the fix, exit 2, nothing written; the thing itself is untouched."""
    out = tmp_path / "run"
    out.mkdir()
    target = tmp_path / "elsewhere.txt"
    target.write_text("not yours\n")
    {"symlink": lambda p: p.symlink_to(target), "fifo": os.mkfifo, "directory": os.mkdir}[kind](out / LOCK_FILE)
    argv = (
        _command(stories_file, "--out-dir", out)
        if command == "train"
        else ["prepare", "--data", str(stories_file), "--out", str(out), "--tokenizer", "char"]
    )
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert f"{out / LOCK_FILE} is a" in line and "not the lock file nanolm writes there; remove it" in line, line
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE] and target.read_text() == "not yours\n"
    (out / LOCK_FILE).rmdir() if kind == "directory" else (out / LOCK_FILE).unlink()
    assert main(argv) == 0  # the cause removed, the same command runs


def test_deleting_the_lock_file_of_a_live_run_lets_no_second_writer_in(tmp_path, stories_file, alone, capsys):
    """The lock is held on the run directory itself: deleting ``.lock`` (a leftover-looking
    file) only loses the holder's name. The second command is still refused, and the first
    ends bit-identical to the command run alone."""
    out = tmp_path / "run"
    with _stopped_after_its_first_checkpoint(stories_file, out):
        (out / LOCK_FILE).unlink()
        before = _files(out)
        assert main(_command(stories_file, "--out-dir", out, "--lr", "1e-2")) == 2
        assert (
            f"{out} is in use by another process (being written, or read by a run training on it); wait"
            in _one_error_line(capsys)
        )
        assert _files(out) == before
    assert _same_run(out, alone)


def test_prepare_into_a_live_runs_data_directory_is_refused(tmp_path, stories_file, alone, capsys):
    """``nanolm prepare --out RUN/data`` while RUN trains would rewrite the shards under it: the
    run would end having trained on other data than it recorded. Refused, naming the run."""
    out = tmp_path / "run"
    with _stopped_after_its_first_checkpoint(stories_file, out) as first:
        before = _files(out)
        other = tmp_path / "other.txt"
        other.write_text("Another text altogether, with other letters: zqxj.\n" * 50)
        assert main(["prepare", "--data", str(other), "--out", str(out / "data"), "--tokenizer", "char"]) == 2
        line = _one_error_line(capsys)
        assert f"{out / 'data'} is inside {out}, which is being written by process {first.pid}" in line, line
        assert _files(out) == before
    assert _same_run(out, alone)


def test_a_process_the_holder_started_may_write_inside_its_directory(tmp_path, stories_file):
    """``nanolm lab`` holds its --out and trains the resume variant's first part in a child
    process inside it: the holder's own work, not a second writer (a process the holder did not
    start is refused: the test above)."""
    out = tmp_path / "lab"
    with RunLock() as lock:
        lock.take(out, flag="--out")
        child = subprocess.run(
            [
                sys.executable,
                "-m",
                "nanolm",
                "prepare",
                "--data",
                str(stories_file),
                "--out",
                str(out / "data"),
                "--tokenizer",
                "char",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert child.returncode == 0, child.stderr
    assert (out / "data" / "meta.json").is_file()


def test_the_locks_cleanup_never_hides_the_error_that_stopped_the_run(tmp_path, monkeypatch):
    """A run directory that turns read-only mid-run: the lock file cannot be removed either,
    and that failure must not replace the error that stopped the run (a failed save)."""

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    with pytest.raises(NanolmError, match="could not save the checkpoint of step 20"):
        with RunLock() as lock:
            lock.take(tmp_path / "run")
            monkeypatch.setattr(type(tmp_path), "unlink", read_only)
            raise NanolmError("could not save the checkpoint of step 20: the file system is read-only")
    monkeypatch.undo()
    with RunLock() as lock:  # the lock died with its descriptor
        lock.take(tmp_path / "run")


def test_resuming_from_a_live_runs_checkpoint_survives_its_pruning(tmp_path, stories_file, capsys, monkeypatch):
    """``--resume RUN`` while RUN trains: RUN keeps ``--keep`` checkpoints and may prune the
    chosen one at any moment, which used to end in "config file .../config.toml does not
    exist". The command continues from a copy: the checkpoint removed right after it was chosen
    changes nothing, and the result is bit-identical to resuming from a quiet copy of it."""
    import shutil

    import nanolm.run.directory

    out = tmp_path / "run"
    first = _start(*_command(stories_file, "--out-dir", out))
    try:
        _when(first, lambda: (out / "checkpoints" / "latest").exists() and _holds_lock(first, out)())
        first.send_signal(signal.SIGSTOP)
        newest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
        quiet = tmp_path / "quiet" / newest.name
        shutil.copytree(newest, quiet)
        real = nanolm.run.directory.resume_checkpoint_at

        def chosen_then_pruned(path, log):
            chosen = real(path, log)
            shutil.rmtree(newest)  # what the live run's pruning does at its next save
            return chosen

        monkeypatch.setattr(nanolm.run.directory, "resume_checkpoint_at", chosen_then_pruned)
        assert main(_command(stories_file, "--out-dir", tmp_path / "continued", "--resume", out)) == 0
        assert f"continuing from a copy of {newest.name}" in capsys.readouterr().out
    finally:
        first.kill()
        first.communicate()
    monkeypatch.undo()
    assert main(_command(stories_file, "--out-dir", tmp_path / "from_quiet", "--resume", quiet)) == 0
    assert _same_run(tmp_path / "continued", tmp_path / "from_quiet")


@pytest.mark.skipif(os.name == "nt", reason="flock")
def test_a_lock_file_held_by_another_process_is_a_one_line_refusal_and_stays_theirs(tmp_path):
    """The directory's flock free, ``DIR/.lock`` locked by another process (an older nanolm
    locked only the file): the refusal was replaced by a traceback from the cleanup, which
    reached for the lock file's path before the directory was recorded (and would have removed
    the other process's lock file)."""
    import fcntl

    directory = tmp_path / "run"
    directory.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                f"fd = os.open({str(directory / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "os.write(fd, f'{os.getpid()}@elsewhere\\n'.encode())\n"
                "print('held', flush=True)\n"
                "time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryBusy, match=f"process {holder.pid}"):
            with RunLock() as lock:
                lock.take(directory)
        assert (directory / LOCK_FILE).read_text().startswith(f"{holder.pid}@")  # still theirs
        fd = os.open(directory, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the directory's lock was let go
        finally:
            os.close(fd)
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------ each rule at its edge, in one process


@pytest.mark.parametrize(
    "holder, who",
    [
        ("123@node7", "process 123 on node7"),
        ("", "another process"),
        ("x1@node7", "another process"),
        ("123@", "another process"),
        ("123", "another process"),
    ],
)
def test_a_refusal_names_the_holder_only_when_its_line_names_a_process_and_a_host(holder, who, tmp_path):
    busy = nanolm.base.lock.busy_refusal(tmp_path / "run", holder, "--out")
    assert isinstance(busy, DirectoryBusy)
    use = (
        f"is being written by {who}"
        if who != "another process"
        else "is in use by another process (being written, or read by a run training on it)"
    )
    assert str(busy) == f"{tmp_path / 'run'} {use}; wait for it to end, or choose another --out"
    inside = nanolm.base.lock.busy_refusal(tmp_path / "run" / "data", holder, "--out", inside=tmp_path / "run")
    assert str(inside) == (
        f"{tmp_path / 'run' / 'data'} is inside {tmp_path / 'run'}, which is being written by "
        f"{who}: writing there would change that run under it; wait for it to end, or choose "
        f"another --out"
    )


def test_each_way_taking_a_lock_fails_has_its_own_line(tmp_path):
    refusal = nanolm.base.lock._refusal
    held = refusal(OSError(errno.EWOULDBLOCK, "busy"), tmp_path, "5@h", "--out-dir")
    assert isinstance(held, DirectoryBusy) and "process 5 on h" in str(held)
    none = refusal(OSError(errno.ENOSYS, "Function not implemented"), tmp_path, "", "--out-dir")
    assert str(none) == (
        f"{tmp_path} is on a file system without working locks (Function not implemented), so "
        f"nanolm cannot make sure it is the only process writing there; use a local disk or a mount "
        f"with locks, or set {NO_LOCK}=1 to write without one"
    ) and not isinstance(none, DirectoryBusy)
    other = refusal(OSError(errno.EIO, "Input/output error"), tmp_path, "", "--out-dir")
    assert str(other) == f"cannot lock {tmp_path / LOCK_FILE}: Input/output error"


def test_a_file_where_the_directory_should_be_is_named_with_the_flag_that_chose_it(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NanolmError) as e:
        RunLock().take(tmp_path / "f", flag="--out")
    assert str(e.value) == f"--out {tmp_path / 'f'} is a file, not a directory; choose another --out"
    assert (tmp_path / "f").read_text() == "x"


def test_a_directory_inside_a_live_run_is_refused_unless_the_run_itself_writes_there(tmp_path):
    with RunLock() as run:
        run.take(tmp_path / "run")
        with RunLock() as mine:  # the holder writing into its own directory (its data, its checkpoints)
            mine.take(tmp_path / "run" / "data")
        (tmp_path / "run" / LOCK_FILE).write_text("4242@elsewhere\n")  # as another process's line reads
        with pytest.raises(DirectoryBusy) as e:
            RunLock().take(tmp_path / "run" / "data" / "deeper", flag="--out")
        assert str(e.value) == (
            f"{tmp_path / 'run' / 'data' / 'deeper'} is inside {tmp_path / 'run'}, which is being "
            f"written by process 4242 on elsewhere: writing there would change that run under it; "
            f"wait for it to end, or choose another --out"
        )
        assert not (tmp_path / "run" / "data").exists()  # refused before anything was made


def test_a_lock_taken_again_lets_go_of_the_first_and_keeps_what_was_written(tmp_path):
    lock = RunLock()
    lock.take(tmp_path / "a" / "b")
    (tmp_path / "a" / "b" / "metrics.jsonl").write_text("{}\n")
    lock.take(tmp_path / "c")  # the first directory is let go: its lock file goes, what was written stays
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["metrics.jsonl"]
    assert lock.directory == tmp_path / "c" and nanolm.base.lock.held_by_another(tmp_path / "a" / "b") is None
    RunLock().take(tmp_path / "a" / "b")  # free
    lock.release()
    lock.release()  # twice is harmless
    assert lock.directory is None and not (tmp_path / "c").exists()


def test_who_holds_a_directory_is_read_from_its_lock_file_while_the_lock_is_held(tmp_path):
    held_by_another = nanolm.base.lock.held_by_another
    assert held_by_another(tmp_path / "nothing") is None and held_by_another(tmp_path) is None
    with RunLock() as lock:
        lock.take(tmp_path / "run")
        assert held_by_another(tmp_path / "run") is None  # this process's own lock is not another's
        (tmp_path / "run" / LOCK_FILE).write_text("  7@h\n" + "x" * 1000)
        assert held_by_another(tmp_path / "run") == "7@h\n" + "x" * (nanolm.base.lock.HOLDER_BYTES - 6)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_FILE).write_text("9@dead\n")  # left by a process killed with -9: means nothing
    assert held_by_another(tmp_path / "run") is None


def test_without_locks_allowed_a_directory_is_written_with_a_warning_and_no_lock_file(tmp_path, monkeypatch):
    monkeypatch.setenv(NO_LOCK, "1")
    said = []
    with RunLock() as lock:
        lock.take(tmp_path / "run", log=said.append)
        assert lock.directory == tmp_path / "run" and not (tmp_path / "run" / LOCK_FILE).exists()
    assert said == [
        f"warning: {tmp_path / 'run'} is written without a lock ({NO_LOCK}=1): make sure no other process writes there"
    ]
    monkeypatch.setenv(NO_LOCK, "0")  # only "1" turns the lock off
    with RunLock() as lock:
        lock.take(tmp_path / "run", log=said.append)
        assert (tmp_path / "run" / LOCK_FILE).is_file() and len(said) == 1


def test_a_directory_that_cannot_be_locked_is_locked_through_its_lock_file(tmp_path, monkeypatch):
    """NFS locks only files opened for writing: flock on the directory fails with EBADF, and the
    lock file carries the lock instead, refusing a second writer the same way."""
    real = nanolm.base.lock.fcntl.flock

    def files_only(fd, operation):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, operation)

    monkeypatch.setattr(nanolm.base.lock.fcntl, "flock", files_only)
    with RunLock() as first:
        first.take(tmp_path / "run")
        assert first._dir_fd is None and first._fd is not None
        with pytest.raises(DirectoryBusy, match=f"process {os.getpid()} on"):
            RunLock().take(tmp_path / "run")
        assert (tmp_path / "run" / LOCK_FILE).read_text().startswith(f"{os.getpid()}@")
    assert not (tmp_path / "run").exists()


def test_a_lock_file_is_readable_by_all_and_written_by_its_owner_only(tmp_path):
    with RunLock() as lock:
        lock.take(tmp_path / "run")
        mode = stat.S_IMODE((tmp_path / "run" / LOCK_FILE).stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o644 & ~umask


def test_a_system_without_o_nofollow_or_o_nonblock_still_takes_the_lock(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "O_NOFOLLOW", raising=False)  # as on Windows
    monkeypatch.delattr(os, "O_NONBLOCK", raising=False)
    with RunLock() as lock:
        lock.take(tmp_path / "run")
        assert (tmp_path / "run" / LOCK_FILE).is_file()


def test_what_stands_where_the_lock_file_should_be_is_named_by_its_kind(tmp_path):
    import socket as sockets

    not_a_lock_file = nanolm.base.lock._not_a_lock_file
    (tmp_path / "target").write_text("x")
    os.symlink(tmp_path / "target", tmp_path / "link")
    os.mkdir(tmp_path / "dir")
    made = {"link": "a symbolic link", "dir": "a directory"}
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        made["fifo"] = "a FIFO"
    if hasattr(sockets, "AF_UNIX") and len(str(tmp_path / "sock")) < 100:  # a socket's path has a short limit
        server = sockets.socket(sockets.AF_UNIX)
        server.bind(str(tmp_path / "sock"))
        made["sock"] = "not a plain file"
    for name, kind in made.items():
        assert str(not_a_lock_file(tmp_path / name)) == (
            f"{tmp_path / name} is {kind}, not the lock file nanolm writes "
            f"there; remove it, then run the same command again"
        )


def test_a_lock_file_removed_after_it_was_opened_is_not_the_one_there_now(tmp_path):
    path = tmp_path / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        assert nanolm.base.lock._same_file(fd, path)
        path.unlink()
        assert not nanolm.base.lock._same_file(fd, path)
        path.write_text("")  # another writer's new file under the same name
        assert not nanolm.base.lock._same_file(fd, path)
    finally:
        os.close(fd)


def test_the_holder_is_read_from_a_plain_lock_file_only_and_never_waits(tmp_path, monkeypatch):
    import threading

    holder = nanolm.base.lock._holder
    (tmp_path / "elsewhere").write_text("123@not-a-lock\n")
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    assert holder(tmp_path / "link") == ""  # a link is not followed: it could point anywhere
    assert holder(tmp_path / "absent") == ""
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        read = []
        reader = threading.Thread(target=lambda: read.append(holder(tmp_path / "fifo")), daemon=True)
        reader.start()
        reader.join(10)
        assert read == [""]  # opened without waiting for a writer, and refused by its kind
    (tmp_path / "plain").write_text("  42@node\n")
    monkeypatch.delattr(os, "O_NOFOLLOW", raising=False)  # as on Windows
    monkeypatch.delattr(os, "O_NONBLOCK", raising=False)
    assert holder(tmp_path / "plain") == "42@node"


def _removed_once(monkeypatch, name, gone):
    """``nanolm.base.lock.<name>`` finding ``gone`` missing the first time it is asked for it (removed by
    a writer that let go at that very moment), as usual after; returns the calls for ``gone``. (Only that
    path: the parents' probe calls it too, on any parent holding a ``.lock``, as pytest's own temporary
    directories do.)"""
    real, calls = getattr(nanolm.base.lock, name), []

    def removed_once(path):
        if Path(path) != gone:
            return real(path)
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        return real(path)

    monkeypatch.setattr(nanolm.base.lock, name, removed_once)
    return calls


def test_a_directory_removed_while_it_is_locked_is_made_again_and_locked(tmp_path, monkeypatch):
    """A refused writer removes the empty directory it had made; a writer locking it at that very
    moment makes it again and goes on, and one whose lock file is replaced every time gives up in
    one line."""
    calls = _removed_once(monkeypatch, "_open_directory", tmp_path / "run")
    with RunLock() as lock:
        lock.take(tmp_path / "run")
        assert len(calls) == 2 and (tmp_path / "run" / LOCK_FILE).is_file()
    monkeypatch.setattr(nanolm.base.lock, "_open_directory", lambda d: None)  # the lock file holds the lock
    monkeypatch.setattr(nanolm.base.lock, "_same_file", lambda fd, path: False)  # replaced each time
    with pytest.raises(NanolmError, match=r"cannot lock .*\.lock: it keeps being replaced; is another program"):
        RunLock().take(tmp_path / "again")


def test_an_older_nanolm_holding_only_the_lock_file_is_refused_by_name(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    run = tmp_path / "run"
    run.mkdir()
    fd = os.open(run / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"77@oldhost\n")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as nanolm did before it locked the directory
        with pytest.raises(DirectoryBusy) as e:
            RunLock().take(run, flag="--out")
        assert (
            str(e.value)
            == f"{run} is being written by process 77 on oldhost; wait for it to end, or choose another --out"
        )
        assert (run / LOCK_FILE).read_text() == "77@oldhost\n"  # its line, left as it was
    finally:
        os.close(fd)


def _lock_file_only(monkeypatch, flock=None):
    """As where directories cannot be opened (Windows) or locked: the lock file carries the lock."""
    monkeypatch.setattr(nanolm.base.lock, "_open_directory", lambda directory: None)
    if flock is not None:
        monkeypatch.setattr(nanolm.base.lock.fcntl, "flock", flock)


def test_where_only_the_lock_file_can_be_locked_a_second_writer_is_refused_by_name(tmp_path, monkeypatch):
    _lock_file_only(monkeypatch)
    with RunLock() as first:
        first.take(tmp_path / "run")
        assert first._dir_fd is None and first._fd is not None
        with pytest.raises(DirectoryBusy) as e:
            RunLock().take(tmp_path / "run", flag="--out")
        assert str(e.value) == (
            f"{tmp_path / 'run'} is being written by process {os.getpid()} on "
            f"{socket.gethostname()}; wait for it to end, or choose another --out"
        )
    assert not (tmp_path / "run").exists()


def test_where_only_the_lock_file_could_lock_and_locks_fail_nothing_is_left_behind(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    _lock_file_only(monkeypatch, no_locks)
    with pytest.raises(NanolmError) as e:
        RunLock().take(tmp_path / "run")
    assert "is on a file system without working locks (No locks available)" in str(e.value)
    assert not (tmp_path / "run").exists()  # the lock file this call made, and the directory, removed
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / LOCK_FILE).write_text("5@other\n")  # a holder's line: not this call's file
    with pytest.raises(NanolmError):
        RunLock().take(tmp_path / "held")
    assert (tmp_path / "held" / LOCK_FILE).read_text() == "5@other\n"
    removed = tmp_path / "removed" / LOCK_FILE

    def removed_then_no_locks(fd, operation):  # the file this call made, removed by another program meanwhile
        removed.unlink()
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(nanolm.base.lock.fcntl, "flock", removed_then_no_locks)
    with pytest.raises(NanolmError, match="is on a file system without working locks"):
        RunLock().take(tmp_path / "removed")


def test_where_only_the_lock_file_can_lock_a_directory_removed_meanwhile_is_made_again(tmp_path, monkeypatch):
    _lock_file_only(monkeypatch)
    calls = _removed_once(monkeypatch, "_open_lock_file", tmp_path / "run" / LOCK_FILE)
    with RunLock() as lock:
        lock.take(tmp_path / "run")
        assert len(calls) == 2 and (tmp_path / "run" / LOCK_FILE).read_text().startswith(f"{os.getpid()}@")


def test_a_lock_that_fails_after_writing_its_file_leaves_nothing_and_forgets_its_directory(tmp_path, monkeypatch):
    def disk_full(fd, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nanolm.base.lock, "_write_holder", disk_full)
    lock = RunLock()
    with pytest.raises(OSError):
        lock.take(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()  # its lock file and the directories it made, removed
    monkeypatch.undo()
    lock.take(tmp_path / "kept")
    (tmp_path / "kept" / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert (lock.directory, lock._made) == (None, []) and sorted(os.listdir(tmp_path / "kept")) == ["metrics.jsonl"]


def test_a_holder_line_that_is_not_utf8_is_read_without_a_traceback(tmp_path):
    (tmp_path / LOCK_FILE).write_bytes(b"\xff\xfe@host\n")
    assert nanolm.base.lock._holder(tmp_path / LOCK_FILE) == "\ufffd\ufffd@host"
    assert "another process" in str(nanolm.base.lock.busy_refusal(tmp_path, "\ufffd\ufffd@host", "--out-dir"))


def test_a_prepare_over_the_data_a_live_run_trains_on_is_refused_and_the_run_ends_as_alone(
    tmp_path, stories_file, capsys
):
    """A run on prepared data reads it for as long as it trains, and its checkpoints record the
    data's digest: a prepare into that directory meanwhile (accepted before 2026-12-06) left a
    run that could no longer be continued. The run shares the directory's lock; prepare's is
    exclusive, so it is refused in one line, and the data and the run stay whole."""
    shards = tmp_path / "shards"
    assert main(["prepare", "--data", str(stories_file), "--out", str(shards), "--tokenizer", "char"]) == 0
    alone = tmp_path / "alone"
    assert main(_command(shards, "--out-dir", alone)) == 0
    capsys.readouterr()
    before = _files(shards)
    out = tmp_path / "run"
    with _stopped_after_its_first_checkpoint(shards, out):
        other = tmp_path / "other.txt"
        other.write_text("Another text altogether, with other letters: zqxj.\n" * 50)
        assert main(["prepare", "--data", str(other), "--out", str(shards), "--tokenizer", "char"]) == 2
        line = _one_error_line(capsys)
        assert f"{shards} is in use by another process" in line and "read by a run training on it" in line, line
        assert _files(shards) == before
    assert _same_run(out, alone)


def test_a_run_on_prepared_data_being_written_is_refused_naming_the_writer(tmp_path, stories_file, capsys):
    shards = tmp_path / "shards"
    assert main(["prepare", "--data", str(stories_file), "--out", str(shards), "--tokenizer", "char"]) == 0
    with RunLock() as writing:  # as a prepare into it holds it
        writing.take(shards, "--out")
        assert main(_command(shards, "--out-dir", tmp_path / "run")) == 2
        line = _one_error_line(capsys)
        assert f"{shards} is being written by process {os.getpid()}" in line and line.endswith("another --data")
        assert not (tmp_path / "run").exists()
    assert main(_command(shards, "--out-dir", tmp_path / "run")) == 0


def test_runs_on_the_same_prepared_data_share_it(tmp_path, stories_file):
    from nanolm.base.lock import ReadLock

    shards = tmp_path / "shards"
    assert main(["prepare", "--data", str(stories_file), "--out", str(shards), "--tokenizer", "char"]) == 0
    with ReadLock() as first, ReadLock() as second:
        first.take(shards)
        second.take(shards)  # no refusal
        with pytest.raises(DirectoryBusy):
            RunLock().take(shards, "--out")
    with RunLock() as writer:
        writer.take(shards, "--out")  # free again once the readers let go


def test_resume_of_one_checkpoint_of_a_live_run_continues_from_a_copy(tmp_path, alone, monkeypatch):
    """``--resume RUN/checkpoints/step_N`` while RUN trains: the run may prune that checkpoint at
    its next save, so the command continues from a copy of it, as ``--resume RUN`` does."""
    import shutil

    import nanolm.run.directory as directory

    run = tmp_path / "run"
    shutil.copytree(alone, run)
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    monkeypatch.setattr(directory, "held_by_another", lambda d: "4242@host" if d == run else None)
    said = []
    found = directory.resume_checkpoint_at(checkpoint, said.append)
    assert run not in found.parents and found.name == checkpoint.name and (found / "model.safetensors").is_file()
    assert said == [
        f"resume: {run} is training now; continuing from a copy of {checkpoint.name} (it may be pruned there)"
    ]


def test_resume_of_a_live_run_whose_newest_checkpoint_is_pruned_while_copied_continues_from_the_next(
    tmp_path, alone, monkeypatch
):
    """``--resume RUN`` while RUN trains: the newest checkpoint pruned while it is being copied is
    not an error; the command looks again and copies the one the run still keeps."""
    import shutil

    import nanolm.run.directory as directory

    run = tmp_path / "run"
    shutil.copytree(alone, run)
    newest, *older = sorted((run / "checkpoints").glob("step_*"), reverse=True)
    assert older
    monkeypatch.setattr(directory, "held_by_another", lambda d: "4242@host" if d == run else None)
    copy = directory._private_copy

    def pruned_while_copied(source):
        if source == newest:
            shutil.rmtree(source)
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(source / "model.safetensors"))
        return copy(source)

    monkeypatch.setattr(directory, "_private_copy", pruned_while_copied)
    said = []
    found = directory.resume_checkpoint_at(run, said.append)
    assert found.name == older[0].name and run not in found.parents
    assert (
        said[-1] == f"resume: {run} is training now; continuing from a copy of {older[0].name} (it may be pruned there)"
    )


def test_resume_of_a_live_run_pruning_faster_than_copies_are_made_gives_up_after_five_tries(tmp_path, monkeypatch):
    """Each newest checkpoint pruned while it is copied: the command looks again, five times in
    all, then says so in one line rather than trying for ever."""
    import nanolm.run.directory as directory

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    monkeypatch.setattr(directory, "held_by_another", lambda d: "4242@host" if d == run else None)
    chosen = []

    def newest(path, log):  # a checkpoint the run has already pruned by the time it is copied
        chosen.append(run / "checkpoints" / f"step_{len(chosen):06d}")
        return chosen[-1]

    monkeypatch.setattr(directory, "valid_resume_checkpoint", newest)
    with pytest.raises(NanolmError) as refused:
        directory.resume_checkpoint_at(run, print)
    assert str(refused.value) == (
        f"--resume {run}: its checkpoints were pruned faster than they could be copied; try again"
    )
    assert len(chosen) == 5


def test_resume_of_one_checkpoint_of_a_live_run_pruned_while_copied_says_to_pass_the_run(tmp_path, alone, monkeypatch):
    import shutil

    import nanolm.run.directory as directory

    run = tmp_path / "run"
    shutil.copytree(alone, run)
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    monkeypatch.setattr(directory, "held_by_another", lambda d: "4242@host" if d == run else None)

    def pruned_while_copied(source):
        shutil.rmtree(source)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(source / "model.safetensors"))

    monkeypatch.setattr(directory, "_private_copy", pruned_while_copied)
    with pytest.raises(NanolmError) as refused:
        directory.resume_checkpoint_at(checkpoint, print)
    assert str(refused.value) == (
        f"--resume {checkpoint}: its run removed that checkpoint while it was read (a live "
        f"run keeps --keep of them); pass the run directory to continue from its newest"
    )


def test_resume_of_a_run_whose_newest_checkpoint_is_damaged_says_so_and_takes_the_next(tmp_path, alone):
    import shutil

    import nanolm.run.directory as directory

    run = tmp_path / "run"
    shutil.copytree(alone, run)
    newest, older = sorted((run / "checkpoints").glob("step_*"), reverse=True)[:2]
    (newest / "model.safetensors").write_bytes(b"damaged")
    said = []
    assert directory.resume_checkpoint_at(run, said.append) == older
    assert len(said) == 1 and said[0].startswith("warning: ") and newest.name in said[0], said


def test_resume_of_one_checkpoint_whose_training_state_lacks_a_part_names_it(tmp_path, alone):
    """A checkpoint that verifies but whose state.pt lacks what a resume restores (written by
    another version): refused before anything is restored, naming the checkpoint."""
    import json
    import shutil

    import nanolm.run.directory as directory
    from nanolm.base.files import sha256_file

    source = sorted((alone / "checkpoints").glob("step_*"))[-1]
    checkpoint = tmp_path / source.name
    shutil.copytree(source, checkpoint)
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    del state["scaler"]
    torch.save(state, checkpoint / "state.pt")
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"]["state.pt"] = sha256_file(checkpoint / "state.pt")
    (checkpoint / "meta.json").write_text(json.dumps(ckpt.sealed(meta)))
    with pytest.raises(NanolmError) as refused:
        directory.resume_checkpoint_at(checkpoint, print)
    assert str(refused.value) == f"checkpoint {checkpoint}: state.pt has no valid 'scaler'"


def test_a_runs_damaged_data_is_prepared_again_saying_so_where_the_run_logs(tmp_path, alone):
    """A resume whose copy of the data is damaged prepares it again from its source: every line of
    that (the warning, the source it reads) goes to the run's log, as the rest of the run's lines."""
    import shutil

    import nanolm.run.directory as directory
    from nanolm.run.config import load_run_config

    run = tmp_path / "run"
    shutil.copytree(alone, run)
    (run / "data" / "meta.json").write_text("{damaged")
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    said = []
    data = directory.open_run_data(
        run / "data", checkpoint, load_run_config(checkpoint / "config.toml"), tmp_path / "scratch", said.append
    )
    assert data.digest == ckpt.read_checkpoint_meta(checkpoint)["data_digest"]
    assert data.meta["compressor_bpb"] is None  # a run skips the compressors: xz would compete with its step
    assert said[0].startswith("warning: ") and said[0].endswith("; preparing the run's data again from its source")
    assert any(line.startswith("data: ") for line in said[1:]), said


def test_a_second_rank_reads_the_data_rank_0_wrote_and_prepares_nothing(tmp_path, alone, monkeypatch):
    """Under torchrun every rank sets the run up after rank 0 (``main_first``): the others read the
    data rank 0 has just written or verified, and neither prepare nor write anything."""
    import contextlib
    import shutil

    import nanolm.run.directory as directory
    from nanolm.run.config import load_run_config
    from nanolm.run.directory import RunPlan

    run = tmp_path / "run"
    shutil.copytree(alone, run)
    cfg = load_run_config(run / "config.toml")

    class SecondRank:
        is_main, world_size, mode, device = False, 2, "ddp", torch.device("cpu")

        def main_first(self):
            return contextlib.nullcontext()

    def never(*args, **kwargs):
        raise AssertionError("a second rank prepared the data itself")

    monkeypatch.setattr(directory, "load_training_data", never)
    monkeypatch.setattr(directory, "open_run_data", never)
    before = sorted(p.name for p in run.iterdir())
    data = directory.set_up_run_directory(cfg, SecondRank(), RunPlan(run), "fp32", log=never)
    assert data.dir == run / "data" and sorted(p.name for p in run.iterdir()) == before


def test_a_run_prepares_its_data_without_the_compressors_bounds(alone):
    """``nanolm prepare`` measures zlib and xz on the text (bounds a model must beat); a run
    preparing its own data does not: xz would compete with the training steps for the cores."""
    import json

    assert json.loads((alone / "data" / "meta.json").read_text())["compressor_bpb"] is None


def test_a_resume_whose_data_copy_is_damaged_says_so_where_the_run_logs(tmp_path, alone):
    import shutil

    import nanolm.run.directory as directory
    from nanolm.distributed import Distributed
    from nanolm.run.config import load_run_config
    from nanolm.run.directory import RunPlan

    run = tmp_path / "run"
    shutil.copytree(alone, run)
    (run / "data" / "meta.json").write_text("{damaged")
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    cfg = load_run_config(checkpoint / "config.toml")
    said = []
    data = directory.set_up_run_directory(cfg, Distributed(), RunPlan(run, checkpoint=checkpoint), "fp32", said.append)
    assert data.dir == run / "data" and (run / "data" / "meta.json").read_text() != "{damaged"
    assert said[0].endswith("; preparing the run's data again from its source") and len(said) > 1, said


def test_a_resume_in_another_world_size_is_judged_by_the_global_batch_of_this_world(tmp_path, alone):
    """Set up on two processes (rank 0 of torchrun's two), a run checkpointed on one would train
    on twice the global batch: refused, naming the world size, before anything is written."""
    import contextlib
    import shutil

    import nanolm.run.directory as directory
    from nanolm.distributed import Distributed
    from nanolm.run.config import load_run_config
    from nanolm.run.directory import RunPlan

    class RankZeroOfTwo(Distributed):
        def main_first(self):  # no process group here: rank 0's part alone
            return contextlib.nullcontext()

    run = tmp_path / "run"
    shutil.copytree(alone, run)
    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    cfg = load_run_config(checkpoint / "config.toml")
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    with pytest.raises(NanolmError, match=r"world size: 1 -> 2 \(global batch"):
        directory.set_up_run_directory(
            cfg,
            RankZeroOfTwo(mode="ddp", world_size=2),
            RunPlan(run, checkpoint=checkpoint),
            "fp32",
            log=lambda *_: None,
        )
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


@pytest.mark.parametrize("where", ["directory", "lock file only"])
def test_every_disk_step_of_taking_a_lock_names_the_lock_file_it_writes(where, tmp_path, monkeypatch):
    """The crash-point enumeration and the full-disk message read each step's path: a holder's line
    written under another name would send both to the wrong file."""
    from nanolm.base import disk

    if where == "lock file only":
        _lock_file_only(monkeypatch)
    with disk.faults(disk.FaultPlan()) as plan, RunLock() as lock:
        lock.take(tmp_path / "run")
    writes = [path for kind, path in plan.steps if kind == "write"]
    assert writes == [str(tmp_path / "run" / LOCK_FILE)] * 2  # emptied, then the holder's line


@pytest.mark.parametrize("where", ["directory", "lock file only"])
def test_the_lock_file_is_removed_while_the_lock_is_still_held(where, tmp_path, monkeypatch):
    """Removed after the lock was let go, the file could be locked at that moment by a second
    writer, who would then believe it holds a directory whose lock file is gone."""
    from nanolm.base import disk

    fcntl = pytest.importorskip("fcntl")
    path = tmp_path / "run" / LOCK_FILE
    held_when_removed = []

    class Probe(disk.FaultPlan):
        def before(self, kind, target):
            if kind == "remove" and target == path:
                fd = os.open(path, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held_when_removed.append(False)
                except BlockingIOError:
                    held_when_removed.append(True)
                finally:
                    os.close(fd)
            super().before(kind, target)

    if where == "lock file only":
        _lock_file_only(monkeypatch)
    lock = RunLock()
    lock.take(tmp_path / "run")
    with disk.faults(Probe()):
        lock.release()
    assert held_when_removed == [True] and not path.exists()


def test_where_an_open_file_cannot_be_removed_the_lock_file_is_closed_then_removed(tmp_path, monkeypatch):
    """Windows (no fcntl, no directory to lock) removes no open file: the release closes the
    lock file first, then removes it, and leaves no descriptor open. Played here by taking the lock
    through its file and letting go with ``fcntl`` gone."""
    _lock_file_only(monkeypatch)
    lock = RunLock()
    lock.take(tmp_path / "run")
    fd = lock._fd
    monkeypatch.setattr(nanolm.base.lock, "fcntl", None)
    lock.release()
    assert not (tmp_path / "run").exists()  # the lock file, then the directory the lock made
    with pytest.raises(OSError) as closed:
        os.fstat(fd)
    assert closed.value.errno == errno.EBADF
