"""The mutation score's arithmetic (tools/mutation_score.py): what counts as killed, what is left
out as equivalent, and a recheck that runs an earlier run's survivors again without losing the
verdicts on the rest. Running mutmut itself takes minutes to hours and is not part of the suite."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("mutation_score", ROOT / "tools" / "mutation_score.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_score_is_the_killed_share_of_the_mutants_not_listed_as_equivalent():
    status = {
        "m1": "killed",
        "m2": "timeout",
        "m3": "survived",
        "m4": "survived",
        "m5": "no tests",
        "m6": "caught by type check",
    }
    tally = _tool().tally_mutants(status, {"m4": "does the same"})
    assert tally == {
        "mutants": 6,
        "killed": 3,
        "equivalent": 1,
        "timeouts": 1,
        "survived": ["m3"],
        "untested": ["m5"],
        "score": 60.0,
    }
    assert _tool().tally_mutants({}, {})["score"] is None


def test_a_recheck_keeps_the_earlier_verdicts_and_counts_a_survivor_listed_since_as_equivalent():
    earlier = {
        "mutants": 11,
        "killed": 6,
        "equivalent": 1,
        "timeouts": 1,
        "survived": ["a", "b", "c"],
        "untested": ["d"],
    }
    rerun = {"a": "killed", "c": "survived", "d": "no tests", "zz": "not checked"}  # zz: a mutant not run again
    tally = _tool().tally_mutants(rerun, {"b": "found equivalent since"}, earlier, names=["a", "c", "d"])
    assert tally == {
        "mutants": 11,
        "killed": 7,
        "equivalent": 2,
        "timeouts": 1,
        "survived": ["c"],
        "untested": ["d"],
        "score": 77.8,
    }  # 7 of 9


def test_a_recheck_needs_the_very_source_it_rechecks(tmp_path):
    tool = _tool()
    earlier = {
        "module": "nanolm/base/lock.py",
        "program_sha256": "0" * 16,
        "survived": [],
        "untested": [],
        "killed": 1,
        "equivalent": 0,
        "timeouts": 0,
    }
    with pytest.raises(SystemExit, match="changed since the run being rechecked"):
        tool.score("nanolm/base/lock.py", ("tests/test_run_lock.py",), 1, False, 15.0, earlier)
    assert (
        tool.source_digest("nanolm/base/lock.py") != "0" * 16 and len(tool.source_digest("nanolm/base/lock.py")) == 16
    )


def test_a_recheck_outlives_a_reformat_but_not_an_edit_of_the_code(tmp_path, monkeypatch):
    """mutmut names a function's mutants in the order of its code: a reformatted file or an edited
    comment keeps every name, so an earlier run's survivors may be run again; an edited line may not."""
    tool = _tool()
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    module = tmp_path / "m.py"
    module.write_text("def f(a, b):\n    return a + b  # the sum\n")
    earlier = {"program_sha256": tool.source_digest("m.py")}
    module.write_text("def f(a,b):\n    # the sum\n    return (a\n            + b)\n")
    assert tool._same_program(earlier, "m.py")
    module.write_text("def f(a, b):\n    return a - b\n")
    assert not tool._same_program(earlier, "m.py")
    module.write_text("def f(a, b):\n    return a + b, 'xy'\n")  # one string, or two joined: two for mutmut
    joined = {"program_sha256": tool.source_digest("m.py")}
    module.write_text("def f(a, b):\n    return a + b, ('x'\n                   \"y\")\n")
    assert not tool._same_program(joined, "m.py")
    assert not tool._same_program({"source_sha256": "0" * 16}, "m.py")  # a result of the file's bytes


def test_every_listed_equivalent_still_describes_the_code_it_was_read_in():
    """A key names its function and the code the mutant changes: an edit that removes that code
    fails here, in a moment, instead of hiding a new mutant under an old reason."""
    tool = _tool()
    from nanolm.base.documents import read_toml

    pins = read_toml(tool.EQUIVALENT)
    assert pins and all(module in tool.MODULES for module in pins)
    stale = [
        (module, pin) for module, table in pins.items() for pin in table if not tool.pin_describes_code(module, pin)
    ]
    assert stale == []
    assert not tool.pin_describes_code("nanolm/base/lock.py", "RunLock.release: `no such code` -> `x`")
    assert not tool.pin_describes_code("nanolm/base/lock.py", "RunLock.unheard_of: `and` -> `or`")
    assert not tool.pin_describes_code("nanolm/base/lock.py", "nanolm.base.lock.x_busy_refusal__mutmut_3")


def _edited_elsewhere(source: str, function: str) -> list[str]:
    """Edits that keep every mutant of ``function``: a function added above it, a statement added
    at its top (which shifts mutmut's numbers of every mutant below), the file reformatted."""
    import black

    added_above = source.replace(
        f"\ndef {function}(", f"\ndef _unrelated(x):\n    return x + 1\n\n\ndef {function}(", 1
    )
    body = source.index(":\n", source.index(f"\ndef {function}(")) + 2
    docstring_end = source.index('"""', source.index('"""', body) + 3) + 3
    statement_at_top = source[:docstring_end] + "\n    _unused = 3 * 2" + source[docstring_end:]
    return [added_above, statement_at_top, black.format_str(source, mode=black.Mode(line_length=100))]


def test_a_mutant_keeps_its_name_through_an_edit_elsewhere_while_mutmuts_number_moves():
    tool = _tool()
    module, function = "nanolm/run/resume.py", "data_moved_to"
    source = (ROOT / module).read_text()
    before = tool.mutant_changes(module, source, functions={function})
    names = {keys[0] for keys in before.values()}
    assert len(names) == len(before) > 20  # one name per mutant
    edits = _edited_elsewhere(source, function)
    for edited in edits:
        after = tool.mutant_changes(module, edited, functions={function, "_unrelated"})
        assert names <= {k for keys in after.values() for k in keys}
    statement_at_top = tool.mutant_changes(module, edits[1], functions={function})
    moved = [n for n in before if n in statement_at_top and statement_at_top[n][0] != before[n][0]]
    assert len(moved) > 20  # the numbers the old keys used now name other mutants


def test_a_listed_change_names_its_mutant_and_one_gone_is_reported():
    tool = _tool()
    changes = {
        "m.x_f__mutmut_1": ["f: `and` -> `or`", "f: `a and b` -> `a or b`"],
        "m.x_f__mutmut_2": ["f: `1` -> `2`"],
    }
    named, stale = tool.equivalent_mutants(changes, {"f: `a and b` -> `a or b`": "why", "f: `3` -> `4`": "gone"})
    assert named == {"m.x_f__mutmut_1": "why"} and stale == ["f: `3` -> `4`"]
    assert tool._function_name("nanolm.base.lock.xǁRunLockǁrelease__mutmut_12") == "RunLock.release"
    assert tool._function_name("nanolm.run.directory.x__plan_for__mutmut_3") == "_plan_for"
    assert tool._mangled("RunLock.release") == "xǁRunLockǁrelease" and tool._mangled("_plan_for") == "x__plan_for"


def test_a_function_the_module_does_not_have_is_refused_in_one_line():
    with pytest.raises(SystemExit, match=r"^error: nanolm/base/lock.py has no function RunLock.relase"):
        _tool().score("nanolm/base/lock.py", ("tests/test_run_lock.py",), 1, False, 15.0, functions=("RunLock.relase",))


def test_every_test_is_given_to_the_functions_reached_only_in_started_processes():
    """cli.py's entry and exit paths run in the `python -m nanolm` processes its tests start, where
    mutmut cannot see them: their mutants meet every test of the concern. Its prepare and export run
    in the tests' own process too: their mutants meet the tests mutmut saw reach them."""
    mutation_score = _tool()
    assert mutation_score.every_test_only("nanolm/instruments/cli.py") == ",".join(
        f"nanolm.instruments.cli.x_{name}" for name in ("entry", "_flushed", "_interrupted")
    )
    assert mutation_score.every_test_only("nanolm/run/resume.py") == ""  # every function's mutants
    for module, functions in mutation_score.EVERY_TEST.items():
        assert functions == "all" or set(functions) <= set(mutation_score.FUNCTIONS.get(module, functions)), module
