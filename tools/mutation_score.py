"""Mutation testing of the verdict and safety code: which small changes to a module do its tests miss?

A test suite that passes proves little about code it only runs through the middle. ``mutmut``
changes one operator, constant or condition of a module at a time (a *mutant*: ``<`` for
``<=``, ``1`` for ``0``, a removed ``not``...), runs the module's own test files on each, and
counts the mutants some test kills. A mutant no test kills is a change nobody would notice: either
a test is missing (write it) or the mutant does exactly what the original does (an *equivalent*
mutant: list it in ``tools/mutation_equivalent.toml`` with the reason, under the name this script
prints for it: what it changes, not mutmut's number, which any edit of the function moves). The
score is killed / (mutants - equivalent).

    python tools/mutation_score.py nanolm/base/lock.py            # one module, against its concern's tests
    python tools/mutation_score.py --all                         # every module listed below
    python tools/mutation_score.py nanolm/base/lock.py --show     # and the diff of every survivor
    python tools/mutation_score.py nanolm/base/lock.py --json lock.json   # keep the result, then after new tests:
    python tools/mutation_score.py nanolm/base/lock.py --recheck lock.json --json lock.json   # its survivors only
    python tools/mutation_score.py nanolm/base/lock.py --functions RunLock.release   # one function's mutants

Each run works in a copy of the tree (mutmut writes a ``mutants/`` directory there), so the
working tree is never touched; ``--jobs`` mutants run at once. Not part of the test suite: a
module's mutants take minutes to hours. Exit status 1 if a module scores under ``--min``.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT = ROOT / "tools" / "mutation_equivalent.toml"

# the module, and the test files of its concern: its unit and edge tests, and the end-to-end files that run in
# seconds; test_untrusted_files and test_checkpoint are left out (every surviving mutant would run them for
# minutes), and what they guard is held by planted bugs (tools/silent_bugs.py)
MODULES = {
    "nanolm/watch/reference.py": ("tests/test_reference.py", "tests/test_compare.py"),
    "nanolm/watch/curve.py": ("tests/test_curve.py", "tests/test_reference.py"),
    "nanolm/instruments/compare.py": ("tests/test_compare.py",),
    "nanolm/instruments/diagnose.py": ("tests/test_diagnose.py",),
    "nanolm/watch/guards.py": ("tests/test_guards.py",),
    "nanolm/base/lock.py": ("tests/test_run_lock.py",),
    "nanolm/base/files.py": ("tests/test_files.py", "tests/test_full_disk.py"),
    "nanolm/base/documents.py": ("tests/test_documents.py", "tests/test_hostile_files.py"),
    "nanolm/data/sources.py": ("tests/test_sources.py", "tests/test_data.py", "tests/test_hostile_files.py"),
    "nanolm/evaluate.py": ("tests/test_evaluate.py", "tests/test_train.py", "tests/test_data.py"),
    "nanolm/instruments/trained.py": ("tests/test_evaluate.py", "tests/test_cli.py"),
    "nanolm/watch/stats.py": ("tests/test_stats.py", "tests/test_devices.py"),
    "nanolm/base/disk.py": ("tests/test_files.py", "tests/test_crash_points.py"),
    "nanolm/instruments/export.py": ("tests/test_export.py", "tests/test_crash_points.py"),
    "nanolm/machine/runtime.py": (
        "tests/test_runtime.py",
        "tests/test_devices.py",
        "tests/test_threads.py",
        "tests/test_train.py",
        "tests/test_checkpoint.py",
        "tests/test_terminal.py",
        "tests/test_signal_points.py",
    ),
    "nanolm/run/resume.py": ("tests/test_run_directory.py", "tests/test_continued_runs.py"),
    "nanolm/run/directory.py": (
        "tests/test_run_plan.py",
        "tests/test_run_directory.py",
        "tests/test_continued_runs.py",
        "tests/test_run_lock.py",
    ),
    "nanolm/data/prepare.py": (
        "tests/test_data.py",
        "tests/test_sources.py",
        "tests/test_crash_points.py",
        "tests/test_corpus.py",
    ),
    "nanolm/watch/validator.py": (
        "tests/test_evaluate.py",
        "tests/test_train.py",
        "tests/test_devices.py",
        "tests/test_distributed.py",
    ),
    "nanolm/watch/observer.py": (
        "tests/test_observer.py",
        "tests/test_train.py",
        "tests/test_sinks.py",
        "tests/test_stats.py",
    ),
    "nanolm/instruments/cli.py": (
        "tests/test_cli.py",
        "tests/test_export.py",
        "tests/test_terminal.py",
        "tests/test_signal_points.py",
    ),
    "nanolm/train.py": (
        "tests/test_train.py",
        "tests/test_run_directory.py",
        "tests/test_threads.py",
        "tests/test_signal_points.py",
    ),
}
EVERY_TEST = {
    "nanolm/machine/runtime.py": "all",
    "nanolm/run/resume.py": "all",
    "nanolm/run/directory.py": "all",
    "nanolm/instruments/cli.py": ("entry", "_flushed", "_interrupted"),
}
"""Modules whose promises are tested in processes the tests start (signals, continued runs, the command
line): each mutant of theirs (or of the functions named: those reached only there) meets every test of its
concern, not only those mutmut saw reach it. The command line's other paths (prepare, export, a command's
run) are called in the tests' own process too, where mutmut sees which tests reach them: their mutants
meet those tests alone, each survivor costing seconds instead of the whole concern's two and a half minutes."""
IN_STARTED_PROCESSES = """
import os
if os.environ.get("MUTANT_UNDER_TEST") == "stats":
    # a process a test started while mutmut records which tests reach which function: mutmut's recorder
    # lives in the test's own process, so this one runs the code as it is and records nothing
    os.environ["MUTANT_UNDER_TEST"] = ""
"""
"""``sitecustomize.py`` of the mutated copy: what every Python process started from it runs first."""
FUNCTIONS = {
    "nanolm/instruments/cli.py": (
        "_prepare",
        "_export",
        "_refuse_inside_a_run",
        "main",
        "_interrupted",
        "_run",
        "entry",
        "_flushed",
    ),
    "nanolm/train.py": ("build_run", "build_model", "build_batches", "build_components"),
}
"""Modules measured in part: only the mutants of these functions (the prepare and export paths and the
exit of the command line; the part of train.py that builds a run)."""
ALSO_COPY = ("data", "configs", "tools", "benchmarks", "docs", "README.md")  # what the tests read beside the package


FASTEST_TESTS_FIRST = """
import runpy, sys
try:  # mutmut 3.8's fork server runs a mutant's tests in the order of a set; its fork runner sorts them
    import mutmut.workers.isolation as isolation
    from mutmut.state import state

    submit = isolation.ForkServerRunner.submit

    def fastest_first(self, mutant_name, tests, cpu_time_limit, estimated_time):
        durations = state().duration_by_test
        return submit(self, mutant_name, sorted(tests, key=lambda t: durations.get(t, 0.0)), cpu_time_limit,
                      estimated_time)

    isolation.ForkServerRunner.submit = fastest_first
except (ImportError, AttributeError):  # another mutmut: its own order, the same verdicts
    pass
import os
if os.environ.get("NANOLM_MUTATION_EVERY_TEST") == "1":
    only = {name for name in os.environ.get("NANOLM_MUTATION_EVERY_TEST_ONLY", "").split(",") if name}
    # mutmut runs a mutant against the tests it saw reach the function, seen in the test's own process; a
    # module whose promises are tested through `python -m nanolm` processes (signals, continued runs) is
    # reached there unseen: each of its mutants meets every test of its concern instead (fastest first)
    # (hooked where mutmut saves what its stats collection found: mutmut.stats is one module for all,
    # while the mutmut.__main__ that runpy runs below is a fresh copy that patches would not reach)
    import mutmut.stats
    from mutmut.state import state

    save_stats = mutmut.stats.save_stats

    class EveryTest(dict):  # the tests mutmut saw reach a function, or every test where it cannot see them
        def get(self, key, default=None):
            return dict.get(self, key, default) if only and key not in only else set(state().duration_by_test)

        def __getitem__(self, key):
            return dict.__getitem__(self, key) if only and key not in only else set(state().duration_by_test)

    def with_every_test():
        save_stats()
        if not isinstance(state().tests_by_mangled_function_name, EveryTest):
            state().tests_by_mangled_function_name = EveryTest(state().tests_by_mangled_function_name)

    mutmut.stats.save_stats = with_every_test
sys.argv = ["mutmut", *sys.argv[1:]]
runpy.run_module("mutmut", run_name="__main__", alter_sys=True)
"""
"""How mutmut is started: as ``python -m mutmut``, with each mutant's tests run fastest first.
With pytest's ``-x`` a mutant ends at its first failing test, so a fast unit test that kills it
spares the slow ones that train a run; the verdict (killed or not) is the same in any order."""


def _tree_copy(target: Path) -> None:
    """The files git tracks and the untracked ones it does not ignore, as the working tree has them."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


WIDER_NAMES = 12
"""How much more of the code around a change than its shortest name a pin may hold (in tokens)."""


def _function_name(mutant: str) -> str:
    """``Class.method`` or ``function`` of a mutant's name as mutmut writes it
    (``...x_name__mutmut_3``, ``...xǁClassǁmethod__mutmut_3``)."""
    mangled = mutant.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0]
    return ".".join(part for part in mangled.split("ǁ")[1:] if part) if "ǁ" in mangled else mangled[2:]


def _canonical_tokens(code: str) -> tuple[list[tuple[str, int, int]], str]:
    """A function's code as a formatter cannot change it: the tokens of its AST written back
    (quotes, parentheses, line breaks, trailing commas and comments all made one way), each with
    its span in that text. The function is renamed ``f``: mutmut names each copy its own way."""
    function = ast.parse(textwrap.dedent(code)).body[0]
    function.name = "f"
    text = ast.unparse(function)
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    skipped = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT, tokenize.ENDMARKER}
    return [
        (t.string, starts[t.start[0] - 1] + t.start[1], starts[t.end[0] - 1] + t.end[1])
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type not in skipped
    ], text


def _fragment(tokens, text: str, start: int, end: int) -> str:
    """The source of tokens ``start:end``, its whitespace run together."""
    return " ".join(text[tokens[start][1] : tokens[end - 1][2]].split()) if end > start else ""


def _only(source: str, functions: set[str]) -> str:
    """``source`` with only the named functions and methods (``Class.method``) at its top level:
    mutmut mutates each function by itself, so their mutants and names are those of the whole
    module, at a fraction of the cost."""
    tree, kept = ast.parse(source), []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in functions:
            kept.append(ast.get_source_segment(source, node))
        elif isinstance(node, ast.ClassDef):
            methods = [
                m
                for m in node.body
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and f"{node.name}.{m.name}" in functions
            ]
            if methods:
                kept.append(
                    f"class {node.name}:\n" + "\n".join(ast.get_source_segment(source, m, padded=True) for m in methods)
                )
    return "\n\n\n".join(kept) + "\n"


def mutant_changes(module: str, source: str | None = None, functions: set[str] | None = None) -> dict[str, list[str]]:
    """Every mutant of ``module`` (its current source, or ``source``) named by what it changes:
    ``function: `before` -> `after```, with just enough of the code around the change to tell it
    from the function's other mutants (with ``functions``, only the mutants of those). Unlike
    mutmut's numbers, which count a function's mutants in order, such a name survives an edit
    elsewhere (a line added above, a helper renamed, the file reformatted), so
    tools/mutation_equivalent.toml keys its mutants by it. Each mutant's names run from the shortest
    to ones with more of the code around the change (a pin written when more was needed to tell it
    apart still names it)."""
    import mutmut.mutation.pragma_handling as pragmas
    from mutmut.mutation.file_mutation import mutate_file_contents

    pragmas.config = lambda: argparse.Namespace(do_not_mutate_patterns=[])  # mutmut's config: only this is read
    source = (ROOT / module).read_text() if source is None else source
    if functions is not None:
        source = _only(source, functions)
    dotted = module.removesuffix(".py").replace("/", ".")
    mutated = mutate_file_contents(module, source)
    lines = mutated.code.splitlines(keepends=True)

    def generated(name: str) -> str:  # a function mutmut wrote, as it stands in the mutated file
        span = mutated.line_span_by_function_name[name]
        return "".join(lines[span.start - 1 : span.end])

    originals = {}
    spans = {}  # per mutant: the function, the tokens before and after, and how many agree at each end
    for short in mutated.mutant_names:
        name, function = f"{dotted}.{short}", _function_name(short)
        if function not in originals:
            originals[function] = _canonical_tokens(generated(short.rsplit("__mutmut_", 1)[0] + "__mutmut_orig"))
        before, before_text = originals[function]
        after, after_text = _canonical_tokens(generated(short))
        a, b = [t[0] for t in before], [t[0] for t in after]
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        suffix = next(
            (i for i, (x, y) in enumerate(zip(reversed(a[prefix:]), reversed(b[prefix:]))) if x != y),
            min(len(a), len(b)) - prefix,
        )
        spans[name] = (function, before, before_text, after, after_text, prefix, suffix)

    @functools.cache
    def key(name: str, context: int) -> str:
        function, before, before_text, after, after_text, prefix, suffix = spans[name]
        start = max(0, prefix - context)
        return (
            f"{function}: `{_fragment(before, before_text, start, min(len(before), len(before) - suffix + context))}`"
            f" -> `{_fragment(after, after_text, start, min(len(after), len(after) - suffix + context))}`"
        )

    siblings = {}
    for name, span in spans.items():
        siblings.setdefault(span[0], []).append(name)
    changes = {}
    for name, (function, before, _, after, _, prefix, suffix) in spans.items():
        widest = max(len(before), len(after))  # past it, the name is the whole function
        least = 1 if prefix + suffix in (len(before), len(after)) else 0  # a token added or removed: with a neighbour
        context = next(
            (
                c
                for c in range(least, widest + 1)
                if all(key(other, c) != key(name, c) for other in siblings[function] if other != name)
            ),
            widest,
        )
        changes[name] = [key(name, c) for c in range(context, min(widest, context + WIDER_NAMES) + 1)]
    return changes


def equivalent_mutants(changes: dict[str, list[str]], pins: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The mutants ``pins`` (change -> reason) name, each with its reason, and the pins that name no
    mutant of the module any more (the code they described has changed: read them again)."""
    named = {}
    for name, keys in changes.items():
        reason = next((pins[k] for k in keys if k in pins), None)
        if reason is not None:
            named[name] = reason
    matched = {k for keys in changes.values() for k in keys}
    return named, [pin for pin in pins if pin not in matched]


def _pins(module: str) -> dict[str, str]:
    """tools/mutation_equivalent.toml's table for ``module``: each equivalent mutant, named by what
    it changes (:func:`mutant_changes`), with the reason it changes nothing a caller can see."""
    if not EQUIVALENT.is_file():
        return {}
    sys.path.insert(0, str(ROOT))
    from nanolm.base.documents import read_toml

    return dict(read_toml(EQUIVALENT).get(module, {}))


def _pinned_function(pin: str) -> str:
    return pin.split(": ", 1)[0]


def _equivalents(module: str) -> dict[str, str]:
    """The mutants of ``module`` listed as equivalent, by mutmut's name, each with its reason.
    A listed change that no mutant makes any more (its code was edited) stops the run: its reason
    may no longer hold, so it is read again rather than trusted."""
    pins = _pins(module)
    if not pins:
        return {}
    named, stale = equivalent_mutants(mutant_changes(module, functions={_pinned_function(p) for p in pins}), pins)
    if stale:
        raise SystemExit(
            f"error: tools/mutation_equivalent.toml lists changes to {module} that no mutant makes any "
            f"more (the code changed): " + "; ".join(stale) + ". Run the module without them and read "
            "its survivors again"
        )
    return named


def pin_describes_code(module: str, pin: str) -> bool:
    """Whether a listed change still describes the module's code: its function exists and holds
    the code the change starts from. What the test suite checks in a moment; whether mutmut still
    makes that very mutant, the run checks (:func:`_equivalents`)."""
    function, _, change = pin.partition(": ")
    match = re.fullmatch(r"`(.*)` -> `(.*)`", change, flags=re.S)
    only = ast.parse(_only((ROOT / module).read_text(), {function}))
    if match is None or match[1] == match[2] or not only.body:
        return False
    found = only.body[0].body[0] if isinstance(only.body[0], ast.ClassDef) else only.body[0]
    _, text = _canonical_tokens(ast.unparse(found))
    return match[1] in " ".join(text.split())


def source_digest(module: str) -> str:
    """The module's program as mutated: a recheck is valid only against the very same program (mutmut
    numbers a module's mutants in order, so an edit of the code renames them; a reformat or an edited
    comment does not). Its strings count as written: ``"a" "b"`` is one string to Python but two for
    mutmut to change, so a formatter that joins them renumbers the mutants after them."""
    text = (ROOT / module).read_text()
    strings = [
        _literal(t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.STRING
    ]
    return hashlib.sha256((ast.dump(ast.parse(text)) + repr(strings)).encode()).hexdigest()[:16]


def _literal(token: str):
    try:
        return ast.literal_eval(token)
    except (ValueError, SyntaxError):  # an f-string: as written
        return token


def _same_program(previous: dict, module: str) -> bool:
    """Whether ``previous`` (an earlier result) was measured on the module's program as it is now;
    results written before the digest was of the program hold the digest of the file's bytes."""
    if "program_sha256" in previous:
        return previous["program_sha256"] == source_digest(module)
    return previous.get("source_sha256") == hashlib.sha256((ROOT / module).read_bytes()).hexdigest()[:16]


def tally_mutants(
    status: dict[str, str], equivalents: dict[str, str], previous: dict | None = None, names: list[str] | None = None
) -> dict:
    """The counts of a run from mutmut's status per mutant. A recheck (``previous``, an earlier
    tally of the same source, and ``names``, its survivors run again) keeps the earlier verdicts on
    the rest: its killed stay killed, its equivalents equivalent, and a survivor listed as
    equivalent since counts as one."""
    if previous is not None:
        status = {n: status.get(n, "not checked") for n in names}
        status.update({n: "equivalent" for n in previous["survived"] + previous["untested"] if n not in names})
        status.update({f"killed earlier {i}": "killed" for i in range(previous["killed"])})
        status.update({f"equivalent earlier {i}": "equivalent" for i in range(previous["equivalent"])})
    equivalent = {n for n in status if n in equivalents or status[n] == "equivalent"}
    killed = sum(s in ("killed", "timeout", "caught by type check") for s in status.values())
    counted = len(status) - len(equivalent)
    return {
        "mutants": len(status),
        "killed": killed,
        "equivalent": len(equivalent),
        "timeouts": sum(s == "timeout" for s in status.values()) + (previous["timeouts"] if previous else 0),
        "survived": sorted(n for n, s in status.items() if s == "survived" and n not in equivalent),
        "untested": sorted(n for n, s in status.items() if s in ("no tests", "not checked") and n not in equivalent),
        "score": round(100 * killed / counted, 1) if counted else None,
    }


def every_test_only(module: str) -> str:
    """mutmut's names of the functions whose mutants meet every test (``EVERY_TEST``), comma-separated;
    "" where all of the module's do, or none."""
    functions = EVERY_TEST.get(module, "all")
    dotted = module.removesuffix(".py").replace("/", ".")
    return "" if functions == "all" else ",".join(f"{dotted}.{_mangled(f)}" for f in functions)


def _mangled(function: str) -> str:
    """mutmut's name for a function's mutants: ``x_name`` or ``xǁClassǁmethod``."""
    return "xǁ" + "ǁ".join(function.split(".")) if "." in function else f"x_{function}"


def score(
    module: str,
    tests: tuple[str, ...],
    jobs: int,
    show: bool,
    margin: float,
    previous: dict | None = None,
    functions: tuple[str, ...] = (),
) -> dict:
    """The module's mutation score (of ``functions`` only, or ``FUNCTIONS``' for the module, when
    given). With ``previous`` (an earlier result for the same source), only its survivors run again,
    against today's tests and equivalents: what it killed stays killed."""
    functions = functions or FUNCTIONS.get(module, ())
    missing = [f for f in functions if not _only((ROOT / module).read_text(), {f}).strip()]
    if missing:  # a misspelt name would measure no mutant at all
        raise SystemExit(f"error: {module} has no function {missing[0]} (a method is Class.method)")
    if previous is not None and not _same_program(previous, module):
        raise SystemExit(f"error: {module} changed since the run being rechecked; run it whole again")
    equivalents = _equivalents(module)  # before the hour a run may take: a listed change gone stops it here
    names = None
    if previous is not None:
        names = [n for n in previous["survived"] + previous["untested"] if n not in equivalents]
    with tempfile.TemporaryDirectory(prefix="nanolm-mutation-") as tmp:
        copy = Path(tmp)
        _tree_copy(copy)
        quoted = lambda items: "[" + ", ".join(json.dumps(i) for i in items) + "]"  # noqa: E731
        with open(copy / "pyproject.toml", "a", encoding="utf-8") as f:
            f.write(
                f'\n[tool.mutmut]\nsource_paths = ["nanolm"]\nonly_mutate = {quoted([module])}\n'
                f"pytest_add_cli_args_test_selection = {quoted(tests)}\n"
                f'pytest_add_cli_args = ["-p", "no:cacheprovider", "-x", "-q"]\n'
                # mutmut limits each mutant's time to (its tests' measured time + margin) x 2; the
                # measured time leaves out the module fixtures they share (a tiny reference trained
                # over eight seeds): without a margin, a mutant whose tests merely set up would "time
                # out" and count as killed, with mutmut's x15 an endless loop holds a core for minutes
                f"timeout_constant = {margin}\ntimeout_multiplier = 2.0\n"
                # each mutant in a child of a fresh server process: a child forked from the process
                # that ran the tests has PyTorch's thread pool started, and hangs in its first matmul
                f'process_isolation = "forkserver"\n'
                f"also_copy = {quoted(ALSO_COPY)}\n"
            )
        # the tests' own `python -m nanolm ...` processes import the mutated copy too (they inherit the
        # mutant's name from mutmut's environment), whatever directory they run in
        # (made now: an entry of sys.path that does not exist at start-up is never looked in again)
        (copy / "mutants").mkdir()
        (copy / "started").mkdir()  # beside it: mutmut fills mutants/ afresh
        (copy / "started" / "sitecustomize.py").write_text(IN_STARTED_PROCESSES)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(copy / "mutants"), str(copy / "started")]),
            "NANOLM_MUTATION_EVERY_TEST": "1" if module in EVERY_TEST else "0",
            "NANOLM_MUTATION_EVERY_TEST_ONLY": every_test_only(module),
        }
        # mutants side by side share the cores: each PyTorch (and tokenizer) thread pool sized to its share, not
        # to the whole machine, or threads that wait for each other's cores spin (the verdicts are the same)
        share = str(max(1, (os.cpu_count() or 1) // jobs))
        env.setdefault("OMP_NUM_THREADS", share)
        env.setdefault("RAYON_NUM_THREADS", share)
        start = time.perf_counter()
        listed = ""  # a recheck of a run that left no survivor has nothing to run
        dotted = module.removesuffix(".py").replace("/", ".")
        patterns = [f"{dotted}.{_mangled(f)}__mutmut_*" for f in functions]
        if names is None or names:
            ran = subprocess.run(
                [sys.executable, "-c", FASTEST_TESTS_FIRST, "run", "--max-children", str(jobs), *(names or patterns)],
                cwd=copy,
                env=env,
                capture_output=True,
                text=True,
            )
            if ran.returncode != 0:  # without mutmut's progress lines, which would fill what is shown
                said = [
                    line
                    for line in (ran.stdout + "\n" + ran.stderr).splitlines()
                    if line.strip()
                    and not re.search(r"(Running stats|Generating mutants|Running clean tests)\s*$", line)
                ]
                raise SystemExit(f"error: mutmut failed on {module}:\n" + "\n".join(said)[-6000:])
            listed = subprocess.run(
                [sys.executable, "-m", "mutmut", "results", "--all", "true"],
                cwd=copy,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        status = dict(re.findall(r"^\s*(\S+): (.+)$", listed, flags=re.M))
        if patterns:  # the functions measured, not the module's other mutants (never run)
            status = {n: v for n, v in status.items() if any(fnmatch.fnmatch(n, p) for p in patterns)}
        tally = tally_mutants(status, equivalents, previous, names)
        survived, untested = tally["survived"], tally["untested"]
        diffs = {}
        if show:
            for name in survived + untested:
                diffs[name] = subprocess.run(
                    [sys.executable, "-m", "mutmut", "show", name], cwd=copy, env=env, capture_output=True, text=True
                ).stdout
    # each survivor named by what it changes: the key to list it under in tools/mutation_equivalent.toml
    left = survived + untested
    changes = mutant_changes(module, functions={_function_name(n) for n in left}) if left else {}
    result = {
        "module": module,
        "program_sha256": source_digest(module),
        "tests": list(tests),
        "functions": list(functions) or "all",
        **tally,
        "changes": {n: changes[n][0] for n in left},
        "minutes": round((time.perf_counter() - start) / 60, 1),
    }
    killed, counted, timeouts = tally["killed"], tally["mutants"] - tally["equivalent"], tally["timeouts"]
    print(
        f"{module}: {killed} of {counted} mutants killed ({result['score']} %; {timeouts} by a timeout), "
        f"{result['equivalent']} listed as "
        f"equivalent, {len(survived)} survived, {len(untested)} no test ran; {result['minutes']} min",
        flush=True,
    )
    for name in survived + untested:
        print(f"  {'survived' if name in survived else 'no tests'}: {name}\n    {json.dumps(changes[name][0])}")
        if name in diffs:
            print("    " + diffs[name].replace("\n", "\n    "))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="*", help=f"modules to mutate, of: {', '.join(MODULES)}")
    p.add_argument("--all", action="store_true", help="every module listed")
    p.add_argument("--jobs", type=int, default=2, help="mutants tested at once")
    p.add_argument("--show", action="store_true", help="print the diff of every surviving mutant")
    p.add_argument(
        "--timeout-margin",
        type=float,
        default=15.0,
        help="CPU seconds a mutant's tests may take beyond their measured time before it counts as "
        "killed by a timeout (an endless loop); more where the tests share slow fixtures",
    )
    p.add_argument("--min", type=float, default=90.0, help="the least score a module must reach (per cent)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--recheck",
        type=Path,
        default=None,
        help="an earlier --json of these modules: run only its "
        "survivors again (after new tests or equivalents); the module's source must be unchanged",
    )
    p.add_argument(
        "--functions",
        nargs="+",
        default=[],
        metavar="NAME",
        help="only the mutants of these functions (Class.method for a method), e.g. the ones edited "
        "since the module's last run",
    )
    args = p.parse_args()
    modules = list(MODULES) if args.all else args.modules
    unknown = [m for m in modules if m not in MODULES]
    if unknown or not modules:
        raise SystemExit(f"error: give modules of {', '.join(MODULES)} (or --all); unknown: {unknown}")
    earlier = {r["module"]: r for r in json.loads(args.recheck.read_text())} if args.recheck else {}
    if args.recheck and set(modules) - set(earlier):
        raise SystemExit(f"error: {args.recheck} holds no result for {sorted(set(modules) - set(earlier))[0]}")
    results = [
        score(m, MODULES[m], args.jobs, args.show, args.timeout_margin, earlier.get(m), tuple(args.functions))
        for m in modules
    ]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if any(r["score"] is None or r["score"] < args.min for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
