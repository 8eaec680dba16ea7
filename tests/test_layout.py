"""The week's path stays short: one training step runs code from the files a student reads.

A step that starts calling into the distributed, precision or optimizer modules on one process
is still correct, and a reader following it now opens twice the files: nothing else would
notice. These tests trace which of nanolm's files run during one quiet step.
"""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from conftest import REPO, tiny_run_config

import nanolm
import nanolm.train as train_module

PACKAGE = Path(nanolm.__file__).parent

# The loop, the step, the model with its reference loss, the loss fused with the head, the
# batches: the files a reader opens.
WEEKS_FILES = {"train.py", "step.py", "model.py", "fused_loss.py", "batches.py"}
# The components the step consults, one call each, by their public entry (what they do inside is
# theirs: a helper renamed or split changes nothing here): the guard's decision (take, skip, roll
# back, stop), the observer's choice of what to read of the gradients (which asks the validator's
# schedule: every evaluation step is logged), and the thread tuner the loop calls by name before
# the step (--threads auto, the default on a CPU: whether a trial of thread counts is due, and the
# trial when it is). And the optimizer's update and zero_grad: PyTorch's own, reached through
# nanolm.optim's class that skips their compile guards.
COMPONENTS = {
    "optim.py": {"step", "zero_grad"},
    "watch/guards.py": {"decide"},
    "watch/observer.py": {"gradient_watch"},
    "watch/validator.py": {"due"},
    "machine/threads.py": {"before_step"},
}


def _files_one_step_runs(tmp_path, monkeypatch, stories_file, **train) -> tuple[set[str], Counter]:
    """The files of nanolm's code run by one optimizer step of a default run (the batches drawn,
    the thread tuner asked, then ``train_step``: the loop's first two parts), on a step that logs
    nothing, and how often each function of a component was entered from another file.
    ``--threads auto``, the default, unless ``train`` says otherwise."""
    ran, entered = set(), Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            name = Path(frame.f_code.co_filename).relative_to(PACKAGE).as_posix()
            ran.add(name)
            if name in COMPONENTS and (
                frame.f_back is None or frame.f_back.f_code.co_filename != frame.f_code.co_filename
            ):
                entered[name, frame.f_code.co_name] += 1

    def one_quiet_step(run, log=print):
        for step in (1, 2, 3, 4, 5):  # a (re)start logs its first steps; step 5 is quiet
            quiet = step == 5
            assert not quiet or not run.observer.logs(step)
            sys.setprofile(profile if quiet else None)
            try:
                batches = run.batches.next(step)
                run.threads.before_step(batches)
                train_module.train_step(run.step_setup, step, batches)
            finally:
                sys.setprofile(None)
        return {}

    monkeypatch.setattr(train_module, "run_loop", one_quiet_step)
    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=50, log_every=10, **train)
    train_module.train(cfg, log=lambda *a: None)
    return ran, entered


def test_a_quiet_step_runs_only_the_weeks_files_and_one_call_of_each_component(tmp_path, monkeypatch, stories_file):
    """On the default path (``--threads auto`` on a CPU of several cores) and with a fixed count."""
    for threads in ({}, {"threads": 1}):
        ran, entered = _files_one_step_runs(tmp_path / str(len(threads)), monkeypatch, stories_file, **threads)
        outside = sorted(ran - WEEKS_FILES - set(COMPONENTS))
        assert not outside, f"one step on one process runs code outside the week's files: {outside}"
        calls = {(file, function) for file, allowed in COMPONENTS.items() for function in allowed}
        assert set(entered) <= calls, f"the step enters its components elsewhere: {sorted(set(entered) - calls)}"
        assert all(n == 1 for n in entered.values()), f"a component entered more than once: {entered}"
        assert {"step.py", "model.py", "batches.py"} <= ran  # the trace saw the step
        assert ("watch/guards.py", "decide") in entered and ("watch/observer.py", "gradient_watch") in entered
        if not threads and (os.cpu_count() or 1) > 1:
            assert ("machine/threads.py", "before_step") in entered  # the tuner is asked, by name


def test_a_quiet_step_without_a_reading_guard_never_enters_the_guard(tmp_path, monkeypatch, stories_file):
    cfg_guard = {"on_nan": "stop", "on_spike": "off"}

    def guard_options(cfg):
        for k, v in cfg_guard.items():
            setattr(cfg.guard, k, v)
        return cfg

    real = train_module.train
    monkeypatch.setattr(train_module, "train", lambda cfg, log=print: real(guard_options(cfg), log=log))
    ran, _ = _files_one_step_runs(tmp_path, monkeypatch, stories_file)
    assert "watch/guards.py" not in ran


def _nanolm_modules_a_train_imports(tmp_path, stories_file, *flags) -> set[str]:
    """The nanolm modules loaded by the `nanolm train` command on a two-step run, in a fresh process."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('MODULES', *sorted(m for m in sys.modules if m.startswith('nanolm') "
        "or m == 'torch._dynamo'), "
        "file=sys.stderr))\n"
        "from nanolm.instruments.cli import entry\n"
        "entry(sys.argv[1:])\n"
    )
    argv = [
        "train",
        "--data",
        str(stories_file),
        "--tokenizer",
        "char",
        "--steps",
        "2",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--threads",
        "1",
        "--out-dir",
        str(tmp_path / "_".join(["run", *flags])),
        *flags,
    ]
    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return set(next(line for line in result.stderr.splitlines() if line.startswith("MODULES")).split()[1:])


def test_a_plain_train_imports_none_of_the_labs_faults_and_no_compiler(tmp_path, stories_file):
    """The lab breaks runs by swapping components for broken ones (``nanolm.instruments.faults``);
    a plain run must not carry them, not even as an import: what it loads is what it runs. Nor does
    a run without --compile load the compiler (``torch._dynamo``, ~1 s of every start-up), which
    PyTorch's optimizers import on their first call (``nanolm.optim.WithoutCompileGuards``)."""
    plain = _nanolm_modules_a_train_imports(tmp_path, stories_file)
    assert "nanolm.train" in plain and "nanolm.instruments.faults" not in plain
    assert "torch._dynamo" not in plain, "a run that compiles nothing imported torch._dynamo"
    plain.discard("torch._dynamo")
    assert {m for m in plain if m.startswith("nanolm.instruments")} == {  # the command, and the lab's list for --help
        "nanolm.instruments",
        "nanolm.instruments.cli",
        "nanolm.instruments.process",
        "nanolm.instruments.lab",
    }
    broken = _nanolm_modules_a_train_imports(tmp_path, stories_file, "--debug-non-causal")
    assert "nanolm.instruments.faults" in broken  # the check sees an import when there is one


def _readme_tree() -> dict[str, str]:
    """The README's tree of the files: {path as the tree places it: its line}."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("## The files", 1)[1].split("```", 2)[1]
    entries, parents = {}, []
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        parents = parents[:depth] + [name.rstrip("/")]
        entries["/".join(parents) + ("/" if name.endswith("/") else "")] = line
    return entries


# The floors of the house, lowest first (docs/usage.md, "The layout, and why"): a module imports
# only from its own floor or the floors below it. A package lives on one floor.
FLOORS = (
    ("nanolm.errors", "nanolm.base"),  # the ground floor: what every room writes and reads through
    ("nanolm.precision",),  # the number formats, in which the machine's peaks are stated
    ("nanolm.machine",),  # the device, its peaks, threads and the process's settings
    (
        "nanolm.tokenizer",
        "nanolm.batches",
        "nanolm.fused_loss",
        "nanolm.model",
        "nanolm.optim",
        "nanolm.distributed",
        "nanolm.step",
        "nanolm.checkpoint",
        "nanolm.evaluate",
        "nanolm.sample",
    ),  # the course, up to one step
    ("nanolm.watch",),
    ("nanolm.data",),
    ("nanolm.run",),
    ("nanolm.train",),  # the loop
    ("nanolm.instruments", "nanolm.__main__"),  # what is run around training, and the command
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(path: Path, modules: set[str], name: str | None = None) -> set[str]:
    """The nanolm modules ``path`` imports, at its top, inside a function or in its ``if __name__
    == "__main__":`` block, but not under ``if TYPE_CHECKING:`` (names for annotations only)."""
    import ast

    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in modules and m != name}


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports_of(path, set(paths)) for name, path in paths.items()}


def _floor(module: str) -> int | None:
    if module == "nanolm":
        return 0  # the package's own __init__: the version and the one exception
    return next(
        (i for i, floor in enumerate(FLOORS) for room in floor if module == room or module.startswith(room + ".")), None
    )


def test_every_import_runs_down_the_house_or_along_its_floor():
    graph = _import_graph()
    unplaced = sorted(m for m in graph if _floor(m) is None)
    assert not unplaced, (
        f"modules on no floor of tests/test_layout.py's FLOORS (place them, and say why in docs/usage.md): {unplaced}"
    )
    upward = sorted(
        f"{m} (floor {_floor(m)}) imports {t} (floor {_floor(t)})"
        for m, targets in graph.items()
        for t in targets
        if _floor(t) > _floor(m)
    )
    assert not upward, "imports that run back up the house:\n" + "\n".join(upward)


def test_no_module_imports_itself_through_a_circle():
    graph, state, path = _import_graph(), {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                raise AssertionError("an import circle: " + " -> ".join(path[path.index(target) :] + [target]))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_house_check_sees_an_import_inside_a_function_or_the_script_block(tmp_path):
    """What the two tests above read: a function's own import counts (it runs as surely as one
    at the top, only later), and so does one in a ``__main__`` block (``python -m nanolm.train``
    runs it); only names for annotations (``if TYPE_CHECKING:``) do not."""
    module = tmp_path / "probe.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n\ndef late():\n    from nanolm.run.final import load_run\n\n"
        "if TYPE_CHECKING:\n    from nanolm.train import Run\n\n"
        "if __name__ == '__main__':\n    from nanolm.instruments.cli import entry\n",
        encoding="utf-8",
    )
    assert _imports_of(module, set(_import_graph()), name="nanolm.probe") == {
        "nanolm.run.final",
        "nanolm.instruments.cli",
    }


def test_python_m_of_a_course_module_runs_the_command_without_importing_the_command_line():
    """``python -m nanolm.train`` and ``python -m nanolm.sample`` go through nanolm/__main__.py (the
    top floor), so neither module imports the command line that imports it."""
    for module, command in (("nanolm.train", "train"), ("nanolm.sample", "sample")):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 0 and done.stdout.startswith(f"usage: nanolm {command} "), done.stderr


def test_the_readmes_tree_names_every_file_of_the_package_and_nothing_else():
    """The tree is the map a newcomer reads first: a module it leaves out is a room nobody finds,
    and a line for a file that moved sends them to a door that is not there."""
    tree = _readme_tree()
    package = {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    package |= {
        p.relative_to(REPO).as_posix() + "/" for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"
    }
    listed = {path for path in tree if path.startswith("nanolm/") and path != "nanolm/"}
    assert sorted(package - listed) == [], "files of nanolm/ the README's tree does not show"
    assert sorted(listed - package) == [], "lines of the README's tree for files that do not exist"
    others = [path for path in tree if not path.startswith("nanolm")]
    missing = [path for path in others if not (REPO / path.rstrip("/")).exists()]
    assert not missing, f"the README's tree names what does not exist: {missing}"
    tools = {p.name for p in (REPO / "tools").iterdir() if p.suffix in (".py", ".sh")}
    assert tools == {path.split("/", 1)[1] for path in others if path.startswith("tools/") and path != "tools/"}


def test_the_course_names_import_from_nanolm_train_as_the_week_writes_them():
    """The week reads "inside nanolm/train.py are get_batch, estimate_loss, and train with
    cosine_lr and AdamW(get_param_groups(...))": each name imports from there, and is the
    function the training code itself uses (a re-export of where it lives, not a copy)."""
    from nanolm.batches import get_batch
    from nanolm.evaluate import estimate_loss
    from nanolm.optim import get_param_groups
    from nanolm.step import cosine_lr

    for name, real in (
        ("get_batch", get_batch),
        ("estimate_loss", estimate_loss),
        ("cosine_lr", cosine_lr),
        ("get_param_groups", get_param_groups),
    ):
        assert getattr(train_module, name) is real, name
    assert callable(train_module.train)


def _logical_lines(text: str) -> int:
    """The statements a file spells, however they are laid out: a call over ten lines is one, a
    comment or a blank line none (Python's NEWLINE tokens). A formatter moves no size."""
    import io
    import tokenize

    return sum(t.type == tokenize.NEWLINE for t in tokenize.generate_tokens(io.StringIO(text).readline))


def test_no_module_outside_the_instruments_is_over_350_statements_and_no_function_over_70():
    """A reader finds their way in files of a few hundred lines and functions of a screen or
    two; the model, with its reference loss and sampling, may run to 400 statements. Sizes are
    counted in statements, not lines: a reformat that wraps a call over five lines changes none."""
    import ast

    long_modules, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(PACKAGE).as_posix()
        limit = 400 if name == "model.py" else 350
        if not name.startswith("instruments/") and _logical_lines(text) > limit:
            long_modules.append(f"{name} ({_logical_lines(text)} statements)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                statements = sum(isinstance(n, ast.stmt) for n in ast.walk(node)) - 1  # its own def left out
                if statements > 70:
                    long_functions.append(f"{name}:{node.name} ({statements} statements)")
    assert not long_modules and not long_functions, (long_modules, long_functions)


def test_a_size_in_statements_is_the_same_however_the_code_is_laid_out():
    compact = "x = f(1, 2)  # one\ny = [a for a in x]\n"
    spread = "x = f(\n    1,\n    2,\n)\n\n# one\ny = [\n    a\n    for a in x\n]\n"
    assert _logical_lines(compact) == _logical_lines(spread) == 2
