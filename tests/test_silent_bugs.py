"""The list of known silent bugs that ``tools/silent_bugs.py`` plants follows the code.

Planting all of them runs the tests once per bug, too long for every run of the suite; this
check takes milliseconds and fails as soon as a line the list breaks on purpose is edited,
so the list is updated with the code instead of silently planting nothing.
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("silent_bugs", ROOT / "tools" / "silent_bugs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_every_planted_bug_breaks_a_line_that_exists_exactly_once():
    bugs = _tool().BUGS
    assert len({b.name for b in bugs}) == len(bugs) >= 30
    for bug in bugs:
        text = (ROOT / bug.file).read_text()
        assert text.count(bug.correct) == 1, bug.name
        assert bug.broken != bug.correct and bug.broken not in text, bug.name


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
        assert order[:len(bug.tests)] == list(bug.tests), bug.name
        assert any(bug.file.startswith(prefix) for prefix in tool.CONCERN_TESTS), f"{bug.name}: no concern"
    concern_files = {t for tests in tool.CONCERN_TESTS.values() for t in tests}
    assert concern_files <= set(tool.FAST_TESTS), concern_files - set(tool.FAST_TESTS)
    batches = next(b for b in tool.BUGS if b.file == "nanolm/batches.py")
    assert tool.tests_for(batches, list(tool.FAST_TESTS))[0] == "test_data"
    pinned = next(b for b in tool.BUGS if b.name == "device_batch_pinned")  # a GPU's symptom, in batches.py
    assert tool.tests_for(pinned, list(tool.FAST_TESTS))[:3] == ["test_devices", "test_data", "test_model"]
