"""A terminal's signals, closed pipes and locales end a command quietly, and a run keeps its work.

Students train from a terminal, often over SSH: the session ends (SIGHUP), they press Ctrl-C
twice, they pipe the log into ``head``, their shell runs under ``LC_ALL=C``. Each must end in
one line (or none, for a closed pipe, as Unix pipelines expect) with no traceback, and a run
must leave a checkpoint from which the same command continues.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import run_cli, run_main

from nanolm.checkpoint import read_latest

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX signals and pipes")

TINY = [
    "--tokenizer",
    "char",
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
    "--threads",
    "1",
    "--log-every",
    "1",
]


def _start_training(stories_file, out, *extra):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nanolm",
            "train",
            "--data",
            str(stories_file),
            "--out-dir",
            str(out),
            *TINY,
            "--steps",
            "100000",
            "--eval-every",
            "1000",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_step(proc, step: int) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"training ended before step {step}: {proc.communicate()[1][-2000:]}")
        if line.startswith("step") and f" {step}/" in line:
            return
    raise AssertionError(f"no step {step} within two minutes")


def _resumes(stories_file, out, stopped_at: int):
    """The same command finishes the run: in this process, since what is tested is what the stopped
    process left, not the resume's own process."""
    r = run_main(
        "train", "--data", stories_file, "--out-dir", out, *TINY, "--steps", stopped_at + 2, "--eval-every", 1000
    )
    assert r.returncode == 0, r.stderr
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped_at:06d}'}" in r.stdout


def test_sighup_saves_a_checkpoint_at_the_step_it_arrived_and_the_run_resumes(tmp_path, stories_file):
    """Closing the terminal (or losing the SSH session) sends SIGHUP, whose default ends a
    process on the spot, losing everything since the last checkpoint."""
    out = tmp_path / "run"
    proc = _start_training(stories_file, out)
    _wait_for_step(proc, 5)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("SIGHUP at step ")
    stopped_at = int(err.split("SIGHUP at step ")[1].split(":")[0])
    assert stopped_at >= 5 and read_latest(out).name == f"step_{stopped_at:06d}"
    _resumes(stories_file, out, stopped_at)


def test_further_ctrl_c_while_a_stopped_run_saves_and_exits_print_no_traceback(tmp_path, stories_file):
    """The first Ctrl-C asks the run to save and stop; impatient users press it again and
    again. Once the checkpoint is saved, those must change nothing: no traceback from the
    interpreter's exit, the checkpoint's line and status kept."""
    out = tmp_path / "run"
    proc = _start_training(stories_file, out)
    _wait_for_step(proc, 5)
    proc.send_signal(signal.SIGINT)
    saved = ""
    while "checkpoint saved" not in saved:
        saved = proc.stderr.readline()
        assert saved, "the run ended without saying it saved"
    deadline = time.time() + 60
    while proc.poll() is None and time.time() < deadline:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.002)
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert proc.returncode == 128 + signal.SIGINT
    stopped_at = int(saved.split("SIGINT at step ")[1].split(":")[0])
    _resumes(stories_file, out, stopped_at)


def test_training_into_a_pipe_that_closes_saves_and_the_same_command_resumes(tmp_path, stories_file):
    """``nanolm train ... | head`` : once the reader is gone, the run stops after its step and
    saves, as on SIGTERM, and exits with SIGPIPE's status, quietly."""
    out = tmp_path / "run"
    proc = _start_training(stories_file, out)
    _wait_for_step(proc, 5)
    proc.stdout.close()  # what head does after its lines
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == 128 + 13, err
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    stopped_at = int(err.split("at step ")[1].split(":")[0])
    assert read_latest(out).name == f"step_{stopped_at:06d}"
    _resumes(stories_file, out, stopped_at)


class _DeadStream:
    """A standard output whose reader is gone: every write and flush fails with ``error``."""

    def __init__(self, error: int):
        self.error = error

    def write(self, text):
        raise OSError(self.error, os.strerror(self.error))

    def flush(self):
        raise OSError(self.error, os.strerror(self.error))


@pytest.mark.parametrize("error", [errno.EPIPE, errno.EIO], ids=["EPIPE", "EIO"])
def test_a_terminal_that_hung_up_is_a_reader_gone_like_a_closed_pipe(error):
    """When the SSH session drops, SIGHUP asks the run to stop and save, and the run's next line
    meets a terminal that is gone: its write fails with EIO, not EPIPE. Taken for an error, that
    line would end the run on the spot, before the checkpoint SIGHUP asked for; it is a reader
    gone, exactly as a closed pipe is."""
    from nanolm.instruments.cli import ClosableOutput, OutputClosed
    from nanolm.machine.runtime import OUTPUT_CLOSED, StopOnSignal

    with StopOnSignal() as stop:
        stop.request(signal.SIGHUP)  # the session ended
        out = ClosableOutput(_DeadStream(error))
        print("step 5 | loss 2.1", file=out)  # the run's next line: nothing escapes
        print("step 6 | loss 2.0", file=out)
        out.flush()
        assert out.gone and stop.requested == signal.SIGHUP  # the run stops after its step and saves
    with StopOnSignal() as stop:  # no SIGHUP first: the dead terminal alone asks the run to save
        out = ClosableOutput(_DeadStream(error))
        print("step 5 | loss 2.1", file=out)
        assert out.gone and stop.requested == OUTPUT_CLOSED
    out = ClosableOutput(_DeadStream(error))
    with pytest.raises(OutputClosed):  # a command with no run to save ends quietly (the entry's status 141)
        print("a line", file=out)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, stories_file):
    out = tmp_path_factory.mktemp("terminal") / "run"
    r = run_cli(
        "train",
        "--data",
        stories_file,
        "--out-dir",
        out,
        *TINY,
        "--steps",
        4,
        "--eval-every",
        2,
        "--tokenizer",
        "bpe",
        "--vocab-size",
        300,
    )  # byte-level: any prompt encodes
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize(
    "argv",
    [
        ["diagnose", "{run}"],
        ["diagnose", "--json", "{run}"],
        ["compare", "{run}", "{run}"],
        ["sample", "--run", "{run}", "--max-new-tokens", "400"],
        ["plan", "--preset", "124m"],
        ["--help"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_a_reader_whose_output_closes_ends_quietly(finished_run, argv):
    argv = [a.format(run=finished_run) for a in argv]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "nanolm", *argv], stdout=write, stderr=subprocess.PIPE, text=True, timeout=300
        )
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 128 + 13), proc.stderr


def _c_locale() -> dict:
    """A shell's environment under LC_ALL=C, with Python's own remedies for it switched off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "PYTHONIO"))}
    return {**env, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}


def test_a_sample_prints_under_an_ascii_locale_with_replacement_characters(finished_run):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanolm",
            "sample",
            "--run",
            str(finished_run),
            "--prompt",
            "Once upon a time, caf\u00e9",
            "--max-new-tokens",
            "20",
        ],
        capture_output=True,
        env=_c_locale(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr
    assert proc.stdout.startswith(b"Once upon a time, caf?")


def test_a_prompt_that_is_not_utf8_is_one_line(finished_run):
    proc = subprocess.run(
        [sys.executable, "-m", "nanolm", "sample", "--run", str(finished_run), "--prompt", os.fsdecode(b"caf\xe9")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: --prompt")


def _entry_reports(body: str) -> subprocess.CompletedProcess:
    """``nanolm``'s entry running ``body`` as its command, its output into a pipe, in a user's
    environment (ordinary buffering: the suite drops PYTHONUNBUFFERED, tests/conftest.py)."""
    script = (
        "import sys\nfrom nanolm.instruments import cli\n"
        f"def command(argv, process_tuning=None):\n{body}\n"
        "cli.main = command\ncli.entry([])\n"
    )
    assert "PYTHONUNBUFFERED" not in os.environ
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_a_command_writes_its_output_a_line_at_a_time_into_a_pipe():
    """``nanolm train | tee log`` shows each step when it ends, and a benchmark that times a run's
    lines (benchmarks/speedrun.py) reads the time they were printed, not when a buffer filled."""
    done = _entry_reports("    print(sys.stdout.line_buffering, sys.stdout.isatty())\n    return 0")
    assert done.returncode == 0 and done.stdout == "True False\n", done


def test_text_still_buffered_at_exit_into_a_closed_pipe_ends_quietly():
    """What a command leaves without a line end waits in the buffer until exit; a reader gone by
    then meets the entry's flush, not the interpreter's (which could only print "Exception ignored"
    and exit 120)."""
    body = (
        "    import os\n    read, write = os.pipe()\n    os.close(read)\n"
        "    os.dup2(write, sys.stdout.fileno())\n    sys.stdout.write('no line end')\n    return 0"
    )
    done = _entry_reports(body)
    assert done.returncode == 128 + 13 and done.stderr == "", done


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a file whose every write is ENOSPC")
@pytest.mark.parametrize("argv", [["plan", "--preset", "124m"], ["--help"]], ids=lambda argv: argv[0])
def test_output_onto_a_full_disk_is_one_line_and_a_failed_status(argv):
    """``nanolm ... > log`` with the disk full: the output is lost, and the user is told so in one
    line, not with a traceback from the interpreter's exit."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "nanolm", *argv], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120
        )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "No space left on device" in proc.stderr, proc.stderr


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_while_a_run_prepares_its_data_stops_it_at_once_and_leaves_nothing(tmp_path, stories_file, sig):
    """Before its first step a run has nothing to save, but SIGTERM's and SIGHUP's default would
    kill it on the spot, leaving a half-tokenized corpus in the system's temporary directory that
    nothing removes. Each stop signal ends the set-up at once, through its cleanup. Only a finished
    piece of the encoding is kept, in the cache, for the same command to continue from (whether the
    signal lands before the first piece is recorded is up to the scheduler)."""
    import random

    words = ["".join(random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=3 + i % 7)) for i in range(3000)]
    rng = random.Random(0)
    corpus = tmp_path / "large.txt"
    corpus.write_text("\n<|endoftext|>\n".join(" ".join(rng.choices(words, k=200)) for _ in range(4000)))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "nanolm",
        "train",
        "--data",
        str(corpus),
        "--out-dir",
        str(out),
        *TINY,
        "--tokenizer",
        "bpe",
        "--steps",
        "2",
    ]
    cache = tmp_path / "cache"  # this run's own: another test's kept pieces must not look like its start
    env = {**os.environ, "TMPDIR": str(scratch), "NANOLM_CACHE": str(cache)}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    preparing = cache / "preparing"  # where a run's preparation works
    while not list(preparing.glob("*/.*.prepare-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)  # until the run's own preparation has begun
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + getattr(signal, sig), err
    assert err.strip().splitlines() == [
        f"{sig} while the run was being set up, before its first step: run the same command again to go on"
    ], err
    assert list(scratch.iterdir()) == [] and not out.exists()  # no half-prepared corpus, no run directory
    for kept in preparing.glob("*/.*.prepare-*"):  # kept only with a finished piece to continue from
        assert json.loads((kept / "progress.json").read_text())["documents_read"] > 0, list(kept.iterdir())


def test_a_signal_while_a_run_finishes_stops_it_at_once_and_the_rerun_finds_it_finished_or_finishes_it(
    tmp_path, stories_file
):
    """After the last checkpoint, the final weights and a long sample: a SIGTERM there has nothing
    left to save; it ends the command at once, with its status and one line."""
    from nanolm.run.final import read_final

    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "nanolm",
        "train",
        "--data",
        str(stories_file),
        "--out-dir",
        str(out),
        *TINY,
        "--steps",
        "3",
        "--eval-every",
        "1000",
        "--sample-tokens",
        "200000",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(proc, 3)
    deadline = time.time() + 60
    while not (out / "final.json").exists() and time.time() < deadline:
        time.sleep(0.01)  # the final weights written: sampling now
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines() == [
        "SIGTERM while the run was finishing (its final weights, its sample): the last "
        "checkpoint is saved; run the same command again to finish"
    ], err
    assert read_final(out)["step"] == 3
    r = run_cli("train", "--data", stories_file, "--out-dir", out, *TINY, "--steps", 3, "--eval-every", 1000)
    assert r.returncode == 0 and "finished" in r.stdout, r.stdout + r.stderr


def test_only_standard_output_is_made_line_buffered_and_forgiving_and_both_are_guarded():
    """The entry lets standard output replace what it cannot encode (a sample under LC_ALL=C) and
    go out a line at a time; standard error keeps Python's own (backslashes for what it cannot
    encode, as a traceback needs). Each is guarded against a reader that left, and with no
    standard output at all (pythonw, a service), standard error still is."""
    done = _entry_reports("    print(sys.stdout.errors, sys.stderr.errors, type(sys.stderr).__name__)\n    return 0")
    assert done.returncode == 0 and done.stdout == "replace backslashreplace ClosableOutput\n", done
    script = (
        "import sys\nfrom nanolm.instruments import cli\n"
        "def command(argv, process_tuning=None):\n    print(type(sys.stderr).__name__, file=sys.stderr)\n    return 0\n"
        "cli.main = command\nsys.stdout = None\ncli.entry([])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "ClosableOutput\n", done


@pytest.mark.parametrize(
    "body, status, err",
    [
        ("    print(type(process_tuning).__name__)\n    return 0", 0, ""),  # the command may tune its process
        ("    raise KeyboardInterrupt", 130, "interrupted\n"),  # Ctrl-C before main() had its own handler
        ("    raise cli.OutputClosed()", 128 + 13, ""),  # the reader left: the status of a closed pipe
        ("    raise SystemExit(2)", 2, ""),  # argparse's usage error keeps its status
        ("    raise SystemExit(None)", 0, ""),
        ("    raise SystemExit('a message')", 1, "a message\n"),
    ],
)
def test_the_entry_ends_each_way_with_its_own_status_and_line(body, status, err):
    done = _entry_reports(body)
    assert (done.returncode, done.stderr) == (status, err), done
    assert done.stdout == ("ProcessTuning\n" if "process_tuning" in body else "")


def test_a_signal_while_the_process_exits_changes_nothing():
    """Once the command has returned, the entry ignores Ctrl-C, a kill and a closed terminal: one
    arriving while the interpreter shuts down (a second Ctrl-C after the run saved) would otherwise
    print a traceback from the exit, or end a finished command with a signal's status."""
    body = (
        "    import atexit, os, signal\n"
        # as in a user's terminal, whatever this test's parent ignores (a job started with `nohup`
        # or `&` starts with SIGHUP or SIGINT ignored, and so would every process it starts)
        "    signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "    signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
        "    def late():\n"
        "        for name in ('SIGINT', 'SIGTERM', 'SIGHUP'):\n"
        "            os.kill(os.getpid(), getattr(signal, name))\n"
        "        sys.stderr.write('')\n"  # the interpreter runs a Python handler at its next instruction
        "    atexit.register(late)\n"
        "    return 0"
    )
    done = _entry_reports(body)
    assert (done.returncode, done.stderr) == (0, ""), done
