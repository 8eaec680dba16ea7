"""Signal points, enumerated: a training run asked to stop (SIGINT, SIGTERM, SIGHUP) at every
point of its life, alone and in pairs, and judged on what it leaves.

The points are the run's phases without a disk step (start-up, the model being built, the
first evaluation, a step, an evaluation, the sample, the exit) and every disk step it takes
(``nanolm.base.disk``: its lock, its data's preparation, its metadata, each checkpoint's save,
its final weights, the lock's release), counted on an uninterrupted run. A *pair* is a second
signal arriving at the next disk step after the first, while the first is being handled (a
launcher forwarding to its workers the Ctrl-C the terminal already gave them, a scheduler's
SIGTERM followed by the closing terminal's SIGHUP).

Each case runs in a child forked from a process that imported nanolm and PyTorch but ran no
operation (a child forked after PyTorch started its thread pool can hang in its first matrix
product), so a tiny run costs no interpreter start-up of its own. Each is judged on the
promises of docs/checkpoints.md:

* the exit status is 128 + the first signal's number (the status a shell gives a process
  that signal ended), or 0 when the signal arrived after the run had finished;
* no traceback, and the last line names the signal;
* no step begins once a signal arrived, and at most one checkpoint save does (the one that
  makes the stop resumable);
* the same command run again finishes the run, with final weights bit-identical to a run
  never interrupted, and leaves exactly the files that run left (and ``events.jsonl``, where
  the stop is recorded): no scratch directory, no temporary file, nothing in ``$TMPDIR``.

``python tests/signal_points.py --every`` runs the whole matrix (every point, every signal,
every ordered pair); ``tests/test_signal_points.py`` a fixed selection of it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: mutation testing puts its mutated copy there

SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
PHASES = ("start-up", "model build", "first evaluation", "step", "evaluation", "sample", "exit")
"""The points that take no disk step, in the order a run reaches them."""
STEPS, SIGNAL_STEP, EVAL_EVERY = 6, 2, 3
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
    "20",
    "--threads",
    "1",
    "--log-every",
    "1",
    "--steps",
    str(STEPS),
    "--eval-every",
    str(EVAL_EVERY),
    "--ckpt-every",
    str(EVAL_EVERY),
]


@dataclass(frozen=True)
class Case:
    """Where the first signal arrives (a phase's name, or the number of a disk step), and the
    signals, in the order they arrive (one or two)."""

    point: str | int
    signals: tuple[str, ...]
    gap: float = 0.0
    """Seconds between the two signals; 0: the second at the next disk step after the first."""

    def __str__(self) -> str:
        where = f"disk step {self.point}" if isinstance(self.point, int) else self.point
        later = f" {self.gap:g} s later" if self.gap else ""
        return f"{' then '.join(self.signals)}{later} at {where}"


# --------------------------------------------------------------------------- in the child
class _Events:
    """What the child did, appended to a file line by line as it happens (a child that a
    signal's default action kills still leaves what it wrote)."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(self, event: str) -> None:
        os.write(self.fd, (event + "\n").encode())


def _signal_plan(case: Case, events: _Events):
    """A ``disk.FaultPlan`` that changes nothing on disk: it counts the steps, and sends the
    case's signals (the first at its disk step, a second at the next disk step after the first)."""
    from nanolm.base import disk

    class SignalPlan(disk.FaultPlan):
        def __init__(self):
            super().__init__()
            self.pending = list(case.signals)
            self.sent_at: int | None = None

        def send(self) -> None:
            if self.pending:
                sig = self.pending.pop(0)
                self.sent_at = len(self.steps)
                events.note(f"signal {sig} {len(self.steps)}")
                os.kill(os.getpid(), getattr(signal, sig))
                if case.gap and self.pending:  # the second signal, that long after the first, at this very point
                    time.sleep(case.gap)
                    self.send()

        def before(self, kind, path) -> None:
            self.steps.append((kind, str(path)))
            if kind == "mkdir" and "/checkpoints/.tmp-step_" in str(path):
                events.note("save")
            if len(self.steps) == case.point or (self.sent_at is not None and self.pending):
                self.send()

    return SignalPlan()


def _install_phase_hooks(case: Case, plan, events: _Events) -> None:
    """Wrap the functions of the phases without a disk step, so that the first signal is sent
    where the case says; every step begun is noted (none may begin after a stop signal)."""
    import nanolm.train as train_module
    from nanolm.watch.validator import Validator

    phase = case.point

    def train_step(setup, step, batches):
        events.note("step")
        if phase == "step" and step == SIGNAL_STEP:
            plan.send()
        return original_step(setup, step, batches)

    def evaluate(self, step):
        if (phase == "first evaluation" and step == 0) or (phase == "evaluation" and step == EVAL_EVERY):
            plan.send()
        return original_evaluate(self, step)

    def build_model(*args, **kwargs):
        if phase == "model build":
            plan.send()
        return original_build(*args, **kwargs)

    def sample_text(*args, **kwargs):
        if phase == "sample":
            plan.send()
        return original_sample(*args, **kwargs)

    def train(*args, **kwargs):
        if phase == "start-up":
            plan.send()
        result = original_train(*args, **kwargs)
        if phase == "exit":
            plan.send()
        return result

    original_step, original_evaluate = train_module.train_step, Validator.evaluate
    original_build, original_sample, original_train = (
        train_module.build_model,
        train_module.sample_text,
        train_module.train,
    )
    train_module.train_step, Validator.evaluate, train_module.build_model = train_step, evaluate, build_model
    train_module.sample_text, train_module.train = sample_text, train


def _run_child(argv: list[str], case: Case | None, work: Path, name: str) -> int:
    """Fork a child that runs ``nanolm ARGV`` (under ``case``'s signals, or none), its output
    in ``work/NAME.log`` and its events in ``work/NAME.events``; returns its exit status as a
    shell reports it (128 + N for a process that signal N ended)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            log = os.open(work / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.environ["TMPDIR"] = str(work / "tmp")
            # as in a terminal: a shell's background job (`cmd &`, nohup) starts with SIGINT or SIGHUP ignored
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            import tempfile

            tempfile.tempdir = None
            from nanolm.base import disk
            from nanolm.instruments.cli import entry

            events = _Events(work / f"{name}.events")
            plan = _signal_plan(case or Case(0, ()), events)
            _install_phase_hooks(case or Case("", ()), plan, events)
            try:
                with disk.faults(plan):
                    entry(argv)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            finally:
                steps = json.dumps([list(s) for s in plan.steps])
                (work / f"{name}.steps").write_text(steps)
        except BaseException:  # noqa: BLE001 - the child reports it in its log and exits
            import traceback

            traceback.print_exc()
            code = 71
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


# --------------------------------------------------------------------------- in the parent
def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")} if directory.exists() else set()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


def _argv(data: Path, out: Path) -> list[str]:
    return ["train", "--data", str(data), "--out-dir", str(out), *TINY]


@dataclass
class Reference:
    steps: list[list[str]]
    weights: str
    files: set[str]


def reference(data: Path, work: Path) -> Reference:
    """The run never interrupted: its disk steps, its final weights and the files it leaves."""
    case_dir = work / "reference"
    (case_dir / "tmp").mkdir(parents=True)
    code = _run_child(_argv(data, case_dir / "run"), None, case_dir, "run")
    if code != 0:
        raise AssertionError(f"the uninterrupted run failed ({code}): {(case_dir / 'run.log').read_text()[-3000:]}")
    steps = json.loads((case_dir / "run.steps").read_text())
    return Reference(steps, _digest(case_dir / "run" / "model.safetensors"), _files(case_dir / "run"))


def judge(case: Case, data: Path, work: Path, ref: Reference) -> list[str]:
    """Run ``case`` and the same command again; the promises it broke (none: [])."""
    case_dir = work / ("case-" + hashlib.sha256(str(case).encode()).hexdigest()[:10])
    shutil.rmtree(case_dir, ignore_errors=True)
    (case_dir / "tmp").mkdir(parents=True)
    out, argv = case_dir / "run", _argv(data, case_dir / "run")
    code = _run_child(argv, case, case_dir, "stopped")
    log = (case_dir / "stopped.log").read_text(errors="replace")
    events = (case_dir / "stopped.events").read_text().splitlines() if (case_dir / "stopped.events").exists() else []
    sent = [e.split()[1] for e in events if e.startswith("signal ")]
    broken = []
    if not sent:
        return [f"no signal was sent (the run never reached {case.point})"]
    first = getattr(signal, sent[0])
    last = log.strip().splitlines()[-1] if log.strip() else ""
    if "done in " in log:  # the signal came after the run had finished: 0, or the signal's status
        if code not in (0, 128 + first):
            broken.append(f"exit status {code} after the run had finished, not 0 or {128 + first}")
    elif code != 128 + first:
        broken.append(f"exit status {code}, not {128 + first} ({sent[0]}'s)")
    elif log.strip() and sent[0] not in last and last != "interrupted":  # "SIGINT after SIGTERM: stopped at once..."
        broken.append(f"its last line does not name {sent[0]}: {last!r}")
    if "Traceback" in log:
        broken.append("a traceback:\n" + log[log.index("Traceback") :][-1500:])
    after = events[events.index(next(e for e in events if e.startswith("signal "))) + 1 :]
    if "step" in after:
        broken.append(f"{after.count('step')} step(s) began after the signal")
    if after.count("save") > 1:
        broken.append(f"{after.count('save')} checkpoint saves began after the signal")
    saved_at = log.split(" at step ")[1].split(":")[0] if "checkpoint saved to" in log else None
    if saved_at is not None and (out / "checkpoints" / "latest").read_text().strip() != f"step_{int(saved_at):06d}":
        broken.append(
            f"it said it saved step {saved_at}, but checkpoints/latest is "
            f"{(out / 'checkpoints' / 'latest').read_text().strip()}"
        )
    again = _run_child(argv, None, case_dir, "again")
    if again != 0:
        broken.append(f"the same command again failed ({again}): {(case_dir / 'again.log').read_text()[-1500:]}")
        return broken
    if _digest(out / "model.safetensors") != ref.weights:
        broken.append("the final weights differ from the uninterrupted run's")
    extra = {f for f in _files(out) - ref.files if not f.startswith("checkpoints/step_") and f != "events.jsonl"}
    missing = {f for f in ref.files - _files(out) if not f.startswith("checkpoints/step_")}
    if extra or missing:
        broken.append(f"files left: {sorted(extra)}, missing: {sorted(missing)}")
    leftover_tmp = sorted(p.name for p in (case_dir / "tmp").iterdir())
    if leftover_tmp:
        broken.append(f"left in $TMPDIR: {leftover_tmp}")
    return broken


def all_cases(steps: list) -> list[Case]:
    """Every point, every signal alone and every ordered pair; and a second Ctrl-C long after
    the first (the way to stop at once) during a step and during a checkpoint's save."""
    points = [*PHASES, *range(1, len(steps) + 1)]
    return (
        [Case(p, (s,)) for p in points for s in SIGNALS]
        + [Case(p, (a, b)) for p in points for a in SIGNALS for b in SIGNALS]
        + _stopped_at_once(steps)
    )


def _stopped_at_once(steps: list) -> list[Case]:
    in_a_save = next(i for i, (kind, path) in enumerate(steps, 1) if kind == "write" and "/.tmp-step_" in path)
    late = 1.5  # past runtime.SAME_REQUEST_SECONDS
    return [Case("step", ("SIGTERM", "SIGINT"), late), Case(in_a_save, ("SIGINT", "SIGINT"), late)]


SUITE_STRIDE, EXHAUSTIVE_STRIDE = 10, 3
"""Every how many disk steps a selection stops the run: the default suite's share, and CI's
exhaustive run (``-m exhaustive``). The steps between are the same operations' other steps (the
lock, the data, the metadata, each save), so the suite's stride still meets every operation."""


def selected_cases(steps: list, stride: int = SUITE_STRIDE, every_signal: bool = False) -> list[Case]:
    """A selection: every phase with a signal alone (each signal in turn; with ``every_signal``,
    and always during a step, each of the three), every ordered pair at a step, three pairs
    during the first evaluation and the sample (a stop raised inside another phase), every
    ``stride``-th disk step with one signal alone and one pair (signals rotating), and the two
    second Ctrl-Cs that stop at once."""
    cases = [
        Case(p, (s,))
        for i, p in enumerate(PHASES)
        for s in SIGNALS
        if every_signal or p == "step" or s == SIGNALS[i % len(SIGNALS)]
    ]
    cases += [Case("step", (a, b)) for a in SIGNALS for b in SIGNALS]
    pairs = [(a, b) for a in SIGNALS for b in SIGNALS]
    rotating = [("SIGINT", "SIGTERM"), ("SIGTERM", "SIGHUP"), ("SIGHUP", "SIGINT")]
    cases += [Case(phase, pair) for phase in ("first evaluation", "sample") for pair in rotating]
    n = len(steps)
    for i, k in enumerate(range(1, n + 1, stride)):
        cases.append(Case(k, (SIGNALS[i % 3],)))
        cases.append(Case(k + 2 if k + 2 <= n else k, pairs[i % len(pairs)]))
    return cases + _stopped_at_once(steps)


def import_for_children() -> None:
    """Import once, in the parent, what every child would otherwise import again (PyTorch's
    modules among it), without running any PyTorch operation."""
    import safetensors.torch  # noqa: F401
    import tokenizers  # noqa: F401

    import nanolm.instruments.cli  # noqa: F401
    import nanolm.train  # noqa: F401


def default_corpus(work: Path) -> Path:
    """300 generated stories (the suite's ``stories_file``), for a harness run by hand."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import write_stories

    path = work / "stories.txt"
    write_stories(path, 300, seed=3)
    return path


def run(cases_of, data: Path, work: Path, log=print) -> dict:
    """Judge every case ``cases_of(the uninterrupted run's disk steps)`` names; returns the tally
    and the failures."""
    import_for_children()
    start = time.perf_counter()
    ref = reference(data, work)
    cases = cases_of(ref.steps)
    failures = {}
    for case in cases:
        broken = judge(case, data, work, ref)
        if broken:
            failures[str(case)] = broken
            log(f"FAIL {case}: " + "; ".join(broken))
    return {
        "disk_steps": len(ref.steps),
        "cases": len(cases),
        "failures": failures,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", action="store_true", help="the whole matrix, not the suite's selection")
    p.add_argument("--data", type=Path, default=None, help="a text corpus (default: 300 generated stories)")
    p.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    p.add_argument(
        "--stride",
        type=int,
        default=SUITE_STRIDE,
        help=f"stop at every Nth disk step (default {SUITE_STRIDE}, the suite's; CI's exhaustive run {EXHAUSTIVE_STRIDE})",
    )
    p.add_argument(
        "--every-signal", action="store_true", help="each phase with each of the three signals (the suite: one in turn)"
    )
    p.add_argument("--only", default=None, help="one case, as the failures name it, e.g. 'SIGTERM at disk step 7'")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args()
    if args.stride < 1:
        p.error(f"--stride {args.stride}: stop at every Nth disk step, N at least 1")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="nanolm-signals-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = args.data or default_corpus(work)
        chooser = all_cases if args.every else lambda steps: selected_cases(steps, args.stride, args.every_signal)
        if args.only:
            chooser = lambda steps: [c for c in all_cases(steps) if str(c) == args.only]  # noqa: E731
        result = run(chooser, data.resolve(), work.resolve())
    return report(
        result, f"{result['cases']} cases over {result['disk_steps']} disk steps and {len(PHASES)} phases", args.json
    )


def report(result: dict, what: str, json_path: Path | None) -> int:
    """A harness's last line, its result as JSON where asked, and its exit status (1: a promise broken)."""
    print(f"{what}: {len(result['failures'])} broke a promise ({result['seconds']} s)")
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
