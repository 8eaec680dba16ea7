"""The list of known silent bugs that ``tools/silent_bugs.py`` plants follows the code.

Planting all of them runs the tests once per bug, too long for every run of the suite; these
checks find every bug's code (by its tokens, also after reformatting) and plant one end to end,
so the list is updated with the code instead of silently planting nothing.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("silent_bugs", ROOT / "tools" / "silent_bugs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_every_planted_bug_breaks_code_that_exists_exactly_once():
    tool = _tool()
    assert len({b.name for b in tool.BUGS}) == len(tool.BUGS) >= 30
    for bug in tool.BUGS:
        text = (ROOT / bug.file).read_text()
        assert len(tool.locate(text, bug.correct, bug.file.endswith(".py"))) == 1, bug.name
        assert tool.planted(text, bug) != text, bug.name
        if bug.file.endswith(".py") and bug.correct in text:  # the layout the bug was written against
            assert _tree(tool.planted(text, bug)) == _tree(text.replace(bug.correct, bug.broken)), bug.name
        elif bug.file.endswith(".py"):  # the file reformatted since: found by its tokens, it still plants a program
            compile(tool.planted(text, bug), bug.file, "exec")


def _tree(source: str) -> str:
    """The program ``source`` spells, as text: what a formatter must not change. (Black trims
    the spaces of docstrings' lines, which are strings of the program; their words count.)"""
    import ast

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
            node.value = " ".join(node.value.split())
    return ast.dump(tree)


@pytest.mark.exhaustive
@pytest.mark.parametrize("columns", [88, 100])
def test_a_planted_bug_survives_reformatting_of_its_file(columns):
    """Each bug is found by its tokens: reformatted by black (88 or 100 columns, its own quotes,
    line breaks, parentheses and trailing commas), every file still holds each of its bugs exactly
    once, and planting it there gives the program planting it before reformatting gives."""
    black = pytest.importorskip("black")
    tool, formatted = _tool(), {}
    for bug in tool.BUGS:
        if not bug.file.endswith(".py"):
            continue
        text = (ROOT / bug.file).read_text()
        if bug.correct not in text:  # the file itself was reformatted since: the test above plants it there
            continue
        if bug.file not in formatted:
            formatted[bug.file] = black.format_str(text, mode=black.Mode(line_length=columns))
        expected = text.replace(bug.correct, bug.broken)
        assert _tree(tool.planted(formatted[bug.file], bug)) == _tree(expected), bug.name


def test_a_bug_is_found_by_its_tokens_whatever_the_layout():
    tool = _tool()
    bug = tool.Bug("probe", "", "probe.py", "total = max(a, b) + c", "total = max(a, b)")
    for layout in (
        "total = max(a, b) + c\n",
        "total = (\n    max(\n        a,\n        b,\n    )\n    + c  # note\n)\n",
        "total=max(a,b)+c\n",
    ):
        assert _tree(tool.planted(layout, bug)) == _tree("total = max(a, b)\n"), layout
    assert tool.locate("total = max(a, b) - c\n", bug.correct) == []  # another program is not a match
    quoted = tool.Bug("quotes", "", "probe.py", "x = 'a'", "x = 'b'")
    assert _tree(tool.planted('x = "a"\n', quoted)) == _tree("x = 'b'\n")


def test_every_test_file_the_tool_runs_exists():
    """A renamed test file would make the tool refuse to start (it checks), so every planted bug
    would go unplanted until someone runs it: the list follows the files here, in milliseconds."""
    missing = [t for t in _tool().FAST_TESTS if not (ROOT / "tests" / f"{t}.py").is_file()]
    assert not missing, f"tools/silent_bugs.py's FAST_TESTS names test files that do not exist: {missing}"


def test_every_planted_bug_meets_its_own_and_its_concerns_tests_first_and_then_all_the_others():
    tool = _tool()
    for bug in tool.BUGS:
        order = tool.tests_for(bug, list(tool.FAST_TESTS))
        assert sorted(order) == sorted(tool.FAST_TESTS), bug.name  # nothing left out, nothing twice
        assert set(bug.tests) <= set(tool.FAST_TESTS), f"{bug.name}: tests {bug.tests} the tool never runs"
        assert order[: len(bug.tests)] == list(bug.tests), bug.name
        assert any(bug.file.startswith(prefix) for prefix in tool.CONCERN_TESTS), f"{bug.name}: no concern"
    concern_files = {t for tests in tool.CONCERN_TESTS.values() for t in tests}
    assert concern_files <= set(tool.FAST_TESTS), concern_files - set(tool.FAST_TESTS)
    batches = next(b for b in tool.BUGS if b.file == "nanolm/batches.py")
    assert tool.tests_for(batches, list(tool.FAST_TESTS))[0] == "test_data"
    pinned = next(b for b in tool.BUGS if b.name == "device_batch_pinned")  # a GPU's symptom, in batches.py
    assert tool.tests_for(pinned, list(tool.FAST_TESTS))[:3] == ["test_devices", "test_data", "test_model"]


@pytest.mark.exhaustive
def test_a_bug_planted_in_a_reformatted_package_is_still_caught():
    """End to end: the tool reformats its copy of the package with black, plants a bug there by
    its tokens, and the bug's own test still catches it (and no formatting broke a test first)."""
    import subprocess

    import pytest

    pytest.importorskip("black")
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "silent_bugs.py"),
            "--only",
            "targets_not_shifted",
            "--tests",
            "test_data",
            "--reformat",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "caught by tests/test_data.py::test_eos_opens_the_next_document_by_default" in result.stdout
