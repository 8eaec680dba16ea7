"""Kill a training run with SIGKILL at many moments; rerunning the same command must end
bit-identical to a run that was never interrupted.

This is the promise of ``nanolm.run.directory`` tested the hard way: a real process, a real
``kill -9`` (no handler runs, nothing is flushed), at random times and at the moments that
are hardest to survive: during the first checkpoint's save (the directory holds a run and no
checkpoint), during a later save, after the last checkpoint, and while the final weights are
written. Each trial then runs the *same command* until it exits 0 and compares every weight
with the uninterrupted reference, bit for bit.

Then the terminal: each of ``--signals`` trials ends the run at a random step the way a terminal
does (SIGHUP when the window or SSH session closes, SIGTERM, Ctrl-C pressed again and again,
the reader of its output gone as with ``| head``). Each must exit with the status the docs give
(128 + the signal; 141 for a closed output), no traceback, a checkpoint of the step it stopped
at, and a rerun bit-identical to the reference.

Then ``nanolm prepare``: each of ``--prepares`` trials replaces a prepared directory from
another source (or prepares into a new one) and is killed (SIGKILL or Ctrl-C) at a random
moment. ``--out`` must then be byte-identical to what it was, or to a prepare never
interrupted, never a mix; a new one is absent or whole.

Then the disk fills up: each of ``--full-disks`` trials runs in a small RAM file system (tmpfs;
mounting needs root, else these trials are skipped and say so) with a filler file leaving a
random share of the room the run needs, so the disk fills at a different write each time
(metrics, a checkpoint's weights or state, the final weights...). The command must stop with
one line naming the file, exit 2; the filler deleted, the same command must finish
bit-identical to the reference.

Last, with ``--crash-points``, only the enumeration of ``tests/test_crash_points.py``: every
multi-step file operation stopped, or failed with ENOSPC or EIO, at each of its disk steps, with
random second faults during the recovery (``NANOLM_EXPLORE=1``); it prints the steps counted per
operation. With ``--signal-points``, only the matrix of ``tests/signal_points.py``: SIGINT, SIGTERM
and SIGHUP, alone and in every ordered pair, at every phase of a run and before every one of its
disk steps, each judged on its status, its line and a bit-identical rerun.

    python tools/crash_test.py                 # 20 kills, 8 signals, 8 prepares, 5 full disks (~6 min on 2 cores)
    python tools/crash_test.py --crash-points  # every disk step of every file operation, and random second faults
    python tools/crash_test.py --signal-points # every signal and pair at every phase and disk step of a run
    python tools/crash_test.py --kills 50 --signals 20 --prepares 20 --full-disks 10 --seed 1

Exit status 1 if any trial ends different from the reference or cannot be resumed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 60
COMMAND = [
    "--tokenizer",
    "char",
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "64",
    "--seq-len",
    "64",
    "--batch-size",
    "8",
    "--steps",
    str(STEPS),
    "--eval-every",
    "10",
    "--ckpt-every",
    "5",
    "--eval-batches",
    "4",
    "--sample-tokens",
    "50",
    "--threads",
    "1",
    "--progress",
    "lines",
    "--dropout",
    "0.1",
    "--log-every",
    "1",
]


def _start(corpus: Path, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "nanolm", "train", "--data", str(corpus), *COMMAND],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_dir(cwd: Path, corpus: Path) -> Path:
    return cwd / "runs" / corpus.stem


def _saves_in_progress(run: Path) -> list[str]:
    root = run / "checkpoints"
    try:
        return [e.name for e in os.scandir(root) if e.name.startswith(".tmp-step_")]
    except FileNotFoundError:
        return []


def _committed(run: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(run / "checkpoints") if e.name.startswith("step_"))
    except FileNotFoundError:
        return []


def _kill_when(proc: subprocess.Popen, run: Path, moment: dict) -> str:
    """Kill ``proc`` at ``moment``; returns what the run directory showed at the kill."""
    kind = moment["kind"]
    deadline = time.perf_counter() + 300
    seen_saves: set[str] = set()
    while proc.poll() is None and time.perf_counter() < deadline:
        if kind == "time" and time.perf_counter() - moment["t0"] >= moment["seconds"]:
            break
        if kind == "save":
            for name in _saves_in_progress(run):
                seen_saves.add(name)
            if len(seen_saves) >= moment["nth"]:
                break
        if kind == "after_last_checkpoint" and f"step_{STEPS:06d}" in _committed(run):
            break  # renamed into place; ``latest`` may not name it yet
        if kind == "after_last_pointer" and _latest(run) == f"step_{STEPS:06d}":
            break
        if kind == "step" and _rows(run) >= moment["step"]:
            time.sleep(moment["delay"])
            break
        if kind == "final_weights" and (
            any(run.glob(".model.safetensors.*"))
            or ((run / "model.safetensors").exists() and not (run / "final.json").exists())
        ):
            break  # the weights being written, or written without the final.json that vouches for them
        time.sleep(0.0005 if kind != "time" else 0.002)
    if proc.poll() is not None:
        proc.communicate()
        return "finished before the kill"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    state = _committed(run)
    mid_save = _saves_in_progress(run)
    return (f"mid-save ({mid_save[0]}); " if mid_save else "") + (
        f"newest {state[-1]}" if state else "no checkpoint committed"
    )


def _latest(run: Path) -> str:
    try:
        return (run / "checkpoints" / "latest").read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return ""


def _rows(run: Path) -> int:
    """Rows in metrics.jsonl: with --log-every 1, the steps done so far (plus the step-0 row)."""
    try:
        with open(run / "metrics.jsonl", "rb") as f:
            return max(0, f.read().count(b"\n") - 1)
    except FileNotFoundError:
        return 0


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "model.safetensors"))


def _moments(kills: int, rng: random.Random, startup: float) -> list[dict]:
    """The hard moments first, then random ones: a quarter during start-up (before any step),
    the rest at a random step, a random few milliseconds after it was logged."""
    fixed = [
        {"kind": "save", "nth": 1},
        {"kind": "save", "nth": 1},
        {"kind": "save", "nth": 3},
        {"kind": "save", "nth": 7},
        {"kind": "after_last_checkpoint"},
        {"kind": "after_last_pointer"},
        {"kind": "final_weights"},
    ]
    chosen = fixed[:kills]
    while len(chosen) < kills:
        if rng.random() < 0.25:
            chosen.append({"kind": "time", "seconds": round(rng.uniform(0.2, startup), 2)})
        else:
            chosen.append({"kind": "step", "step": rng.randint(1, STEPS), "delay": round(rng.uniform(0, 0.02), 4)})
    return chosen


SIGNALS = ("SIGHUP", "SIGTERM", "SIGINT again and again", "output closed")


def _signal_trial(cwd: Path, corpus: Path, how: str, step: int, reference: dict) -> dict:
    """Stop a run at ``step`` the way ``how`` says; check its exit and its checkpoint, then rerun."""
    cwd.mkdir()
    run = _run_dir(cwd, corpus)
    proc = _start(corpus, cwd)
    while proc.poll() is None and _rows(run) < step:
        time.sleep(0.001)
    if how == "output closed":
        proc.stdout.close()
    else:
        proc.send_signal(getattr(signal, how.split()[0]))
    err = ""
    if how.startswith("SIGINT"):
        while "checkpoint saved" not in err and proc.poll() is None:
            err += proc.stderr.readline()
        while proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.002)
    err += proc.stderr.read()
    if how != "output closed":
        proc.stdout.read()
    proc.wait()
    expected = 128 + (13 if how == "output closed" else getattr(signal, how.split()[0]))
    stopped = err.split(" at step ")[1].split(":")[0] if " at step " in err else ""
    problems = []
    if proc.returncode != expected:
        problems.append(f"exit {proc.returncode}, not {expected}")
    if "Traceback" in err or "Exception ignored" in err:
        problems.append("traceback")
    if not stopped or _latest(run) != f"step_{int(stopped):06d}":
        problems.append(f"no checkpoint of the step it stopped at ({stopped or '?'}; latest {_latest(run) or 'none'})")
    rerun = _start(corpus, cwd)
    rerun.communicate()
    identical = (
        rerun.returncode == 0
        and _weights(run).keys() == reference.keys()
        and all(bool((_weights(run)[k] == reference[k]).all()) for k in reference)
    )
    if not identical:
        problems.append("rerun DIFFERENT")
    return {"how": how, "step": step, "stopped_at": stopped, "exit": proc.returncode, "problems": problems}


def _tree(directory: Path) -> dict[str, bytes]:
    """Every file and its bytes, but the lock file: it only names the process writing there, and
    a ``kill -9`` leaves it behind for the next command to take over."""
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _data_files(tree: dict) -> dict:
    """A prepared directory's data: the files its manifest lists, not meta.json (it records times)."""
    return {k: v for k, v in tree.items() if k != "meta.json"}


def _prepare(source: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nanolm",
            "prepare",
            "--data",
            str(source),
            "--out",
            str(out),
            "--vocab-size",
            "400",
            "--progress",
            "lines",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _prepare_trials(tmp: Path, trials: int, rng: random.Random) -> list[dict]:
    """Kill ``nanolm prepare`` at random moments: ``--out`` is the old directory or the new one."""
    from nanolm.data.corpus import write_stories

    old_source, new_source = tmp / "prep_old.txt", tmp / "prep_new.txt"
    write_stories(old_source, 2000, seed=11)
    write_stories(new_source, 4000, seed=12)
    clean = tmp / "prep_clean"
    start = time.perf_counter()
    _prepare(new_source, clean).communicate()
    duration = time.perf_counter() - start
    results = []
    for i in range(trials):
        out = tmp / f"prep{i:02d}" / "out"
        fresh = i % 4 == 3  # one trial in four prepares into a new directory
        if not fresh:
            _prepare(old_source, out).communicate()
        before = _tree(out) if out.exists() else None
        proc = _prepare(new_source, out)
        delay = rng.uniform(0.05, duration)
        how = rng.choice(["SIGKILL", "SIGINT"])
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(getattr(signal, how))
        _, err = proc.communicate()
        after = _tree(out) if out.exists() else None
        if not after:  # a kill -9 may leave the lock file in the directory it made; nothing else
            state = "absent" if fresh else "GONE"
        elif before is not None and after == before:
            state = "as it was"
        elif _data_files(after) == _data_files(_tree(clean)):
            state = "the new data, whole"
        else:
            state = "A MIX"
        leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(".")] if out.parent.exists() else []
        ok = state in ("absent", "as it was", "the new data, whole") and "Traceback" not in err
        results.append(
            {
                "trial": i,
                "into": "a new directory" if fresh else "prepared data",
                "killed": how,
                "after_s": round(delay, 2),
                "found": state,
                "scratch_left": leftovers,
                "ok": ok,
            }
        )
        print(
            f"{i:2d}  prepare into {'a new directory' if fresh else 'prepared data':15s} {how} after "
            f"{delay:4.2f}s of {duration:.2f}: {state}"
            + (f" (scratch left: {leftovers[0]})" if leftovers else "")
            + ("" if ok else "  <- BROKEN"),
            flush=True,
        )
    return results


PAGE = 4096


def _footprint(run: Path) -> int:
    """Bytes the run's files take on a tmpfs, which counts whole pages."""
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in run.rglob("*") if p.is_file())


def _full_disk_trial(cwd: Path, corpus: Path, room: int) -> tuple[str, int, str, dict]:
    """Train in ``cwd`` (a fresh tmpfs) with ``room`` bytes free: (what the failing command said,
    the exit status of the rerun once the filler is gone, what the rerun said, its final
    weights). Raises PermissionError where no tmpfs can be mounted."""
    cwd.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "nanolm-crash", str(cwd)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        raise PermissionError(mounted.stderr.strip() or "mount refused")
    try:
        filler = cwd / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (64 * 2**20 - room))
        full = _start(corpus, cwd)
        _, err = full.communicate()
        lines = err.strip().splitlines()
        if full.returncode == 0:
            said = "(enough room: finished)"
        elif full.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err:
            said = lines[0]
        else:
            said = f"NOT ONE LINE (exit {full.returncode}): {err.strip()[-300:]}"
        filler.unlink()
        code, reran = None, ""
        for _ in range(3):
            rerun = _start(corpus, cwd)
            out, rerr = rerun.communicate()
            code = rerun.returncode
            reran = next((line for line in out.splitlines() if line.startswith("resumed from")), "") or rerr[-200:]
            if code == 0:
                break
        weights = _weights(_run_dir(cwd, corpus)) if code == 0 else {}
        return said, code, reran or "(started again)", weights
    finally:
        subprocess.run(["umount", "-l", str(cwd)], capture_output=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20, help="trials, each killed once at its own moment")
    p.add_argument("--signals", type=int, default=8, help="trials stopped by a terminal's signal or a closed output")
    p.add_argument("--prepares", type=int, default=8, help="prepares killed at a random moment")
    p.add_argument("--full-disks", type=int, default=5, help="trials whose disk fills up at a random write")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill times")
    p.add_argument(
        "--crash-points",
        action="store_true",
        help="only enumerate every disk step of every file operation (tests/test_crash_points.py), with "
        "random second faults, and print the steps counted per operation",
    )
    p.add_argument(
        "--signal-points",
        action="store_true",
        help="only send every stop signal, alone and in pairs, at every phase and disk step of a run "
        "(tests/signal_points.py --every)",
    )
    args = p.parse_args()
    if args.crash_points:
        return crash_points()
    if args.signal_points:
        return subprocess.run(
            [sys.executable, str(ROOT / "tests" / "signal_points.py"), "--every"],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        ).returncode
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="nanolm-crash-") as tmp:
        tmp = Path(tmp)
        sys.path.insert(0, str(ROOT))
        from nanolm.data.corpus import write_stories

        corpus = tmp / "stories.txt"
        write_stories(corpus, 400, seed=5)
        (tmp / "reference").mkdir()
        start = time.perf_counter()
        ref = _start(corpus, tmp / "reference")
        while ref.poll() is None and _rows(_run_dir(tmp / "reference", corpus)) < 1:
            time.sleep(0.001)
        startup = time.perf_counter() - start
        out, err = ref.communicate()
        duration = time.perf_counter() - start
        if ref.returncode != 0:
            print(err, file=sys.stderr)
            return 1
        reference = _weights(_run_dir(tmp / "reference", corpus))
        print(
            f"reference: {STEPS} steps in {duration:.1f}s from launch to exit ({startup:.1f}s to the first step)",
            flush=True,
        )
        for i, moment in enumerate(_moments(args.kills, rng, startup)):
            cwd = tmp / f"trial{i:02d}"
            cwd.mkdir()
            run = _run_dir(cwd, corpus)
            proc = _start(corpus, cwd)
            moment["t0"] = time.perf_counter()
            seen = _kill_when(proc, run, moment)
            reruns, code, said = 0, None, ""
            while code != 0 and reruns < 3:
                rerun = _start(corpus, cwd)
                out, err = rerun.communicate()
                code, reruns = rerun.returncode, reruns + 1
                said = (
                    next(
                        (
                            line
                            for line in out.splitlines()
                            if line.startswith(("resumed from", "runs/"))
                            or "starting it again" in line
                            or "nothing to do" in line
                        ),
                        "",
                    )
                    or err.strip()[-200:]
                    or "(a new run: nothing had been written)"
                )
            identical = (
                code == 0
                and _weights(run).keys() == reference.keys()
                and all(bool((_weights(run)[k] == reference[k]).all()) for k in reference)
            )
            label = {
                "time": f"at {moment.get('seconds')}s (start-up)",
                "save": f"during save #{moment.get('nth')}",
                "step": f"after step {moment.get('step')} (+{1000 * moment.get('delay', 0):.0f} ms)",
                "after_last_checkpoint": "last checkpoint renamed, not pointed",
                "after_last_pointer": "after the last checkpoint",
                "final_weights": "while writing the final weights",
            }[moment["kind"]]
            results.append(
                {
                    "trial": i,
                    "killed": label,
                    "found": seen,
                    "rerun_exit": code,
                    "rerun_said": said,
                    "identical": identical,
                }
            )
            print(
                f"{i:2d}  killed {label:32s} found: {seen:45s} rerun: {said[:70]:70s} "
                f"{'identical' if identical else 'DIFFERENT'}",
                flush=True,
            )
        signals = []
        for k in range(args.signals):
            how, step = SIGNALS[k % len(SIGNALS)], rng.randint(2, STEPS - 2)
            trial = _signal_trial(tmp / f"signal{k:02d}", corpus, how, step, reference)
            signals.append(trial)
            print(
                f"{k:2d}  {how:24s} at step {step:2d}: exit {trial['exit']}, stopped at {trial['stopped_at'] or '?':>2s} "
                f"{'; '.join(trial['problems']) or 'checkpoint there, rerun identical'}",
                flush=True,
            )
        prepares = _prepare_trials(tmp, args.prepares, rng)
        need = _footprint(_run_dir(tmp / "reference", corpus))
        disks, skipped = [], ""
        for j in range(args.full_disks):
            cwd = tmp / f"disk{j:02d}"
            room = int(need * rng.uniform(0.05, 1.0)) // PAGE * PAGE
            try:
                said, code, reran, weights = _full_disk_trial(cwd, corpus, room)
            except PermissionError as e:
                skipped = f"full-disk trials skipped: cannot mount a small file system here ({e})"
                print(skipped, flush=True)
                break
            one_line = not said.startswith("NOT ONE LINE")
            identical = (
                code == 0
                and one_line
                and weights.keys() == reference.keys()
                and all(bool((weights[k] == reference[k]).all()) for k in reference)
            )
            disks.append({"trial": j, "room_bytes": room, "said": said, "rerun_exit": code, "identical": identical})
            print(
                f"{j:2d}  disk full with {room / 2**10:6.0f} KiB free of {need / 2**10:.0f}: {said[:150]}  "
                f"rerun: {reran[:60]}  {'identical' if identical else 'DIFFERENT'}",
                flush=True,
            )
    failed = [r["trial"] for r in results if not r["identical"]]
    failed_disks = [r["trial"] for r in disks if not r["identical"]]
    summary = {
        "kills": len(results),
        "identical": len(results) - len(failed),
        "failed": failed,
        "killed_mid_save": sum("mid-save" in r["found"] for r in results),
        "killed_before_any_checkpoint": sum("no checkpoint" in r["found"] for r in results),
        "signals": len(signals),
        "signals_failed": [t["how"] for t in signals if t["problems"]],
        "prepares": len(prepares),
        "prepares_failed": [t["trial"] for t in prepares if not t["ok"]],
        "full_disks": len(disks),
        "full_disks_one_line_and_identical": len(disks) - len(failed_disks),
        "full_disks_failed": failed_disks,
        **({"skipped": skipped} if skipped else {}),
    }
    print(json.dumps(summary))
    return 1 if failed or failed_disks or summary["signals_failed"] or summary["prepares_failed"] else 0


def crash_points() -> int:
    """tests/test_crash_points.py with ``NANOLM_EXPLORE=1``, and its counts as a table."""
    with tempfile.TemporaryDirectory(prefix="nanolm-crash-points-") as tmp:
        log = Path(tmp) / "counts.jsonl"
        env = {**os.environ, "NANOLM_EXPLORE": "1", "NANOLM_CRASH_POINTS_LOG": str(log)}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-m",
                "exhaustive",  # every fault at every step, not the default suite's share
                str(ROOT / "tests" / "test_crash_points.py"),
            ],
            cwd=ROOT,
            env=env,
        )
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    print(f"{'operation':40s} {'steps':>5s}  {'trials':>6s}  steps by kind")
    for r in rows:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["kinds"].items(), key=lambda kn: -kn[1]))
        print(f"{r['operation']:40s} {r['steps']:5d}  {r['trials']:6d}  {kinds}")
    print(
        json.dumps(
            {
                "operations": len(rows),
                "steps": sum(r["steps"] for r in rows),
                "trials": sum(r["trials"] for r in rows),
                "passed": done.returncode == 0,
            }
        )
    )
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
