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
    status = {"m1": "killed", "m2": "timeout", "m3": "survived", "m4": "survived", "m5": "no tests",
              "m6": "caught by type check"}
    tally = _tool().tally_mutants(status, {"m4": "does the same"})
    assert tally == {"mutants": 6, "killed": 3, "equivalent": 1, "timeouts": 1, "survived": ["m3"], "untested": ["m5"],
                     "score": 60.0}
    assert _tool().tally_mutants({}, {})["score"] is None


def test_a_recheck_keeps_the_earlier_verdicts_and_counts_a_survivor_listed_since_as_equivalent():
    earlier = {"mutants": 11, "killed": 6, "equivalent": 1, "timeouts": 1, "survived": ["a", "b", "c"],
               "untested": ["d"]}
    rerun = {"a": "killed", "c": "survived", "d": "no tests", "zz": "not checked"}  # zz: a mutant not run again
    tally = _tool().tally_mutants(rerun, {"b": "found equivalent since"}, earlier, names=["a", "c", "d"])
    assert tally == {"mutants": 11, "killed": 7, "equivalent": 2, "timeouts": 1, "survived": ["c"], "untested": ["d"],
                     "score": 77.8}  # 7 of 9


def test_a_recheck_needs_the_very_source_it_rechecks(tmp_path):
    tool = _tool()
    earlier = {"module": "nanolm/base/lock.py", "source_sha256": "0" * 16, "survived": [], "untested": [], "killed": 1,
               "equivalent": 0, "timeouts": 0}
    with pytest.raises(SystemExit, match="changed since the run being rechecked"):
        tool.score("nanolm/base/lock.py", ("tests/test_run_lock.py",), 1, False, 15.0, earlier)
    assert tool.source_digest("nanolm/base/lock.py") != "0" * 16 and len(tool.source_digest("nanolm/base/lock.py")) == 16
