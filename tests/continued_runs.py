"""What a continued run reads again, at its edges: a run stopped at step 2, then one thing it
reads or is told changed (its data absent, moved, changed, emptied, unreadable, a symbolic
link; the copy of its data and validation set it keeps; the options it checks), then the same
command again.

Each edge is judged on one promise: the continued run is either **the same run** (it exits 0
and its final weights are bit-identical to a run never stopped; an option that may change,
such as ``--threads``, says so in a ``resume:`` line) or **refused in one line** (exit 2, one
``error:`` line, no traceback, not a byte of the run changed), after which undoing the edge and
running the command again still ends bit-identical. What is never allowed: a run that
continues on something else and calls itself the same run.

The runs are forked children, as in ``tests/signal_points.py`` (whose machinery this reuses).
``python tests/continued_runs.py`` runs every edge; ``tests/test_continued_runs.py`` runs it in
the suite.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from signal_points import TINY, Case, _digest, _files, _run_child, default_corpus, import_for_children, report  # noqa: E402

STOP = Case("step", ("SIGTERM",))
"""How each run is stopped before its edge: SIGTERM during step 2, so it saves step 2."""


@dataclass(frozen=True)
class Edge:
    """One change between the stop and the continuation: ``change(case_dir)`` does it to the
    files and returns the ``--data`` path the continuing command names (None: the same);
    ``undo(case_dir)`` puts things back so that the run can continue unchanged. ``start`` and
    ``then`` are options added to the first command and to the continuing one."""

    name: str
    change: Callable[[Path], Path | None] = lambda d: None
    undo: Callable[[Path], None] = lambda d: None
    start: tuple[str, ...] = ()
    then: tuple[str, ...] = ()
    prepared: bool = False
    """The run trains on a directory ``nanolm prepare`` made (``case_dir/prepared``), not a text file."""
    may_change_numbers: bool = False
    """An option a continued run may change (logged in a ``resume:`` line) and whose change may
    change the numbers: the weights are not compared, the ``resume:`` line is required."""
    names: str = ""
    """What a refusal's line must name, when the edge is refused (the thing that changed, not a
    consequence of it)."""
    skip_as_root: bool = field(default=False, compare=False)


def _corpus(d: Path) -> Path:
    return d / "corpus.txt"


def _keep(d: Path) -> Path:
    return d / "corpus.kept"


def _restore_corpus(d: Path) -> None:
    path = _corpus(d)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    shutil.copyfile(_keep(d), path)


def _rewrite(d: Path, text: str) -> None:
    _corpus(d).unlink()
    _corpus(d).write_text(text)


def _other_text(d: Path) -> str:
    return _keep(d).read_text()[::-1]  # the same characters (the same tokenizer), other stories


def _flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))


def _symlink(d: Path, target: Path) -> None:
    _corpus(d).unlink()
    _corpus(d).symlink_to(target)


def _copied(d: Path, text: str | None = None) -> Path:
    copy = d / "elsewhere" / "corpus.txt"
    copy.parent.mkdir(exist_ok=True)
    copy.write_text(text if text is not None else _keep(d).read_text())
    return copy


def _run_data(d: Path) -> Path:
    return d / "run" / "data"


def _restore_run_data(d: Path) -> None:
    saved = d / "run-data.kept"
    target = _run_data(d)
    if target.is_symlink():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    shutil.copytree(saved, target, symlinks=True)


def _prepared(d: Path) -> Path:
    return d / "prepared"


def _prepare(source: Path, out: Path, work: Path) -> None:
    code = _run_child(
        ["prepare", "--data", str(source), "--out", str(out), "--tokenizer", "char"], None, work, "prepare"
    )
    if code != 0:
        raise AssertionError(f"prepare failed ({code}): {_tell(work, 'prepare')[-1500:]}")


def _restore_prepared(d: Path) -> None:
    target = _prepared(d)
    if target.is_symlink():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    shutil.copytree(d / "prepared.kept", target, symlinks=True)


def _prepared_from_other_stories(d: Path) -> None:
    other = d / "other.txt"
    other.write_text(_other_text(d))
    shutil.rmtree(_prepared(d))
    _prepare(other, _prepared(d), d)


def _unreadable(path: Path) -> None:
    path.chmod(0)


EDGES = [
    # the source named by --data: nanolm keeps a tokenized copy in the run, and checks the source against it
    Edge("data absent", lambda d: _corpus(d).unlink(), _restore_corpus),
    Edge(
        "data moved to another path",
        lambda d: (_corpus(d).rename(d / "moved.txt"), d / "moved.txt")[1],
        _restore_corpus,
    ),
    Edge("data changed by one byte", lambda d: _flip_byte(_corpus(d)), _restore_corpus),
    Edge("data replaced by other stories", lambda d: _rewrite(d, _other_text(d)), _restore_corpus),
    Edge("data emptied", lambda d: _rewrite(d, ""), _restore_corpus),
    Edge("data a directory", lambda d: (_corpus(d).unlink(), _corpus(d).mkdir()), _restore_corpus),
    Edge("data a named pipe", lambda d: (_corpus(d).unlink(), os.mkfifo(_corpus(d))), _restore_corpus),
    Edge("data unreadable", lambda d: _unreadable(_corpus(d)), _restore_corpus, skip_as_root=True),
    Edge("data a symbolic link to a copy", lambda d: _symlink(d, _copied(d)), _restore_corpus),
    Edge("data a symbolic link to other stories", lambda d: _symlink(d, _copied(d, _other_text(d))), _restore_corpus),
    Edge("data a dangling symbolic link", lambda d: _symlink(d, d / "nowhere.txt"), _restore_corpus),
    Edge("--data a symbolic link to the data", lambda d: (os.symlink(_corpus(d), d / "link.txt"), d / "link.txt")[1]),
    # the run's own tokenized copy of it: its training shard, its validation set, their manifest
    Edge("the run's data absent", lambda d: shutil.rmtree(_run_data(d)), _restore_run_data),
    Edge("the run's training shard changed", lambda d: _flip_byte(_run_data(d) / "train.bin"), _restore_run_data),
    Edge("the run's validation shard changed", lambda d: _flip_byte(_run_data(d) / "val.bin"), _restore_run_data),
    Edge("the run's validation shard absent", lambda d: (_run_data(d) / "val.bin").unlink(), _restore_run_data),
    Edge(
        "the run's data a symbolic link to a copy",
        lambda d: (shutil.move(_run_data(d), d / "data-copy"), _run_data(d).symlink_to(d / "data-copy")),
        _restore_run_data,
    ),
    Edge(
        "the run's data and its source both changed",
        lambda d: (_flip_byte(_run_data(d) / "train.bin"), _rewrite(d, _other_text(d))),
        lambda d: (_restore_run_data(d), _restore_corpus(d)),
    ),
    # a directory made by `nanolm prepare`: the run reads it where it is, and checks it against the checkpoint
    Edge(
        "prepared data absent",
        lambda d: shutil.rmtree(_prepared(d)),
        _restore_prepared,
        prepared=True,
        names="does not exist",
    ),
    Edge(
        "prepared data moved to another path",
        lambda d: (shutil.move(_prepared(d), d / "moved"), d / "moved")[1],
        _restore_prepared,
        prepared=True,
    ),
    Edge(
        "prepared training shard changed",
        lambda d: _flip_byte(_prepared(d) / "train.bin"),
        _restore_prepared,
        prepared=True,
        names="train.bin",
    ),
    Edge(
        "prepared validation shard changed",
        lambda d: _flip_byte(_prepared(d) / "val.bin"),
        _restore_prepared,
        prepared=True,
        names="val.bin",
    ),
    Edge(
        "prepared validation shard absent",
        lambda d: (_prepared(d) / "val.bin").unlink(),
        _restore_prepared,
        prepared=True,
        names="val.bin",
    ),
    Edge(
        "prepared data prepared again from other stories",
        _prepared_from_other_stories,
        _restore_prepared,
        prepared=True,
    ),
    Edge(
        "prepared data a symbolic link to a copy",
        lambda d: (shutil.move(_prepared(d), d / "copy"), _prepared(d).symlink_to(d / "copy")),
        _restore_prepared,
        prepared=True,
    ),
    Edge(
        "prepared data's meta.json emptied",
        lambda d: (_prepared(d) / "meta.json").write_text("{}"),
        _restore_prepared,
        prepared=True,
        names="meta.json",
    ),
    # the options it checks against the run
    Edge("--precision given, then left out", start=("--precision", "fp32")),
    Edge("--precision changed", then=("--precision", "bf16"), names="precision"),
    Edge("--deterministic given, then left out", start=("--deterministic",), may_change_numbers=True),
    Edge("--deterministic added", then=("--deterministic",), may_change_numbers=True),
    Edge("--threads changed", then=("--threads", "2"), may_change_numbers=True),
    Edge("--seed changed", then=("--seed", "7"), names="seed"),
    Edge("--eval-windows changed", then=("--eval-windows", "4"), may_change_numbers=True),
    Edge("--val-fraction changed", then=("--val-fraction", "0.2"), names="val_fraction"),
]


def _argv(data: Path, out: Path, extra=()) -> list[str]:
    return ["train", "--data", str(data), "--out-dir", str(out), *TINY, *extra]


def _snapshot(directory: Path) -> dict[str, str]:
    return {
        name: (_digest(directory / name) if (directory / name).is_file() else "dir")
        for name in sorted(_files(directory))
    }


def _tell(case_dir: Path, name: str) -> str:
    return (case_dir / f"{name}.log").read_text(errors="replace")


def _case_dir(work: Path, edge: Edge) -> Path:
    """Named by a hash of the edge: a name that spells the edge (``meta.json``) would put the word a
    refusal must say into every path it prints."""
    return work / ("edge-" + hashlib.sha256(edge.name.encode()).hexdigest()[:10])


def judge(edge: Edge, corpus: Path, work: Path, references: dict) -> list[str]:
    """Stop a run, apply ``edge``, continue; the promises broken (none: [])."""
    case_dir = _case_dir(work, edge)
    shutil.rmtree(case_dir, ignore_errors=True)
    (case_dir / "tmp").mkdir(parents=True)
    shutil.copyfile(corpus, _corpus(case_dir))
    shutil.copyfile(corpus, _keep(case_dir))
    out, key = case_dir / "run", (edge.start, edge.prepared)
    data = _prepared(case_dir) if edge.prepared else _corpus(case_dir)
    if edge.prepared:
        _prepare(_corpus(case_dir), data, case_dir)
        shutil.copytree(data, case_dir / "prepared.kept")
    if key not in references:
        ref_dir = work / f"reference-{len(references)}"
        shutil.rmtree(ref_dir, ignore_errors=True)
        (ref_dir / "tmp").mkdir(parents=True)
        shutil.copyfile(corpus, _corpus(ref_dir))
        ref_data = _corpus(ref_dir)
        if edge.prepared:
            ref_data = _prepared(ref_dir)
            _prepare(_corpus(ref_dir), ref_data, ref_dir)
        if _run_child(_argv(ref_data, ref_dir / "run", edge.start), None, ref_dir, "run") != 0:
            return [f"the uninterrupted run failed: {_tell(ref_dir, 'run')[-1500:]}"]
        references[key] = _digest(ref_dir / "run" / "model.safetensors")
    reference = references[key]
    start = _argv(data, out, edge.start)
    code = _run_child(start, STOP, case_dir, "stopped")
    if code != 143 or not (out / "checkpoints" / "latest").exists():
        return [f"the run did not stop with a checkpoint ({code}): {_tell(case_dir, 'stopped')[-1500:]}"]
    if (out / "data").is_dir():
        shutil.copytree(out / "data", case_dir / "run-data.kept", symlinks=True)
    moved = edge.change(case_dir)
    moved = moved if isinstance(moved, Path) else None  # a change made of several steps returns their tuple
    before = _snapshot(out)
    argv = _argv(moved or data, out, (*edge.start, *edge.then))
    code = _run_child(argv, None, case_dir, "continued")
    said = _tell(case_dir, "continued")
    broken = []
    if "Traceback" in said:
        broken.append("a traceback:\n" + said[said.index("Traceback") :][-1500:])
    if code == 0:
        same = _digest(out / "model.safetensors") == reference
        if edge.may_change_numbers:
            if not same and not any(line.startswith("resume: ") and "(allowed" in line for line in said.splitlines()):
                broken.append("it continued with other numbers and no `resume:` line saying an option changed")
        elif not same:
            resumed = [line for line in said.splitlines() if line.startswith(("resume", "warning"))]
            broken.append(
                f"it continued (exit 0) and ended with other weights than the run never stopped; it said: {resumed}"
            )
        return broken
    errors = [line for line in said.strip().splitlines() if line.strip()]
    last = errors[-1] if errors else ""
    if code != 2 or not last.startswith("error: "):
        broken.append(f"refused with status {code} and last line {last!r}, not 2 and one `error:` line")
    elif edge.names and edge.names not in last:
        broken.append(f"the refusal does not name {edge.names!r}: {last!r}")
    if _snapshot(out) != before:
        changed = sorted(set(_snapshot(out).items()) ^ set(before.items()))[:6]
        broken.append(f"refused, but the run changed: {changed}")
    edge.undo(case_dir)
    again = _run_child(_argv(data, out, edge.start), None, case_dir, "undone")
    if again != 0 or _digest(out / "model.safetensors") != reference:
        broken.append(
            f"with the edge undone the same command did not end bit-identical ({again}): "
            f"{_tell(case_dir, 'undone')[-800:]}"
        )
    return broken


def run(corpus: Path, work: Path, edges=EDGES, log=print) -> dict:
    """Judge every edge; returns the tally, what each continued run said, and the failures."""
    import_for_children()
    start, references, failures, outcomes, skipped = time.perf_counter(), {}, {}, {}, []
    for edge in edges:
        if edge.skip_as_root and hasattr(os, "geteuid") and os.geteuid() == 0:
            skipped.append(edge.name)  # root reads a file whatever its mode
            continue
        broken = judge(edge, corpus, work, references)
        said = _tell(_case_dir(work, edge), "continued") if not broken or "continued" in " ".join(broken) else ""
        outcomes[edge.name] = next(
            (
                line
                for line in reversed(said.strip().splitlines())
                if line.startswith(("error:", "resume:", "warning:"))
            ),
            "continued",
        )
        if broken:
            failures[edge.name] = broken
            log(f"FAIL {edge.name}: " + "; ".join(broken))
    return {
        "edges": len(edges) - len(skipped),
        "skipped": skipped,
        "failures": failures,
        "outcomes": outcomes,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=None, help="a text corpus (default: 300 generated stories)")
    p.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    p.add_argument("--only", default=None, help="one edge, by its name")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    p.add_argument("--show", action="store_true", help="print what the continued run said at each edge")
    args = p.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="nanolm-continued-") as tmp:
        work = (args.work or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        corpus = args.data or default_corpus(work)
        edges = [e for e in EDGES if args.only in (None, e.name)]
        result = run(corpus.resolve(), work, edges)
    if args.show:
        for name, said in result["outcomes"].items():
            print(f"{name:45s} {said[:150]}")
    skipped = f" (skipped as root: {', '.join(result['skipped'])})" if result["skipped"] else ""
    return report(result, f"{result['edges']} edges of a continued run{skipped}", args.json)


if __name__ == "__main__":
    sys.exit(main())
