"""A continued run reads again its data, its own copy of it, its validation set and the options
it checks against the run: at each edge (absent, moved, changed, emptied, a symbolic link...)
it is the same run, bit-identical, or refused in one line naming what changed, with the run
untouched (tests/continued_runs.py)."""

import os
from pathlib import Path

import pytest
from conftest import run_harness

pytestmark = pytest.mark.skipif(os.name == "nt" or not hasattr(os, "fork"), reason="POSIX fork")


def test_a_continued_run_is_the_same_run_or_refused_in_one_line_at_every_edge_of_what_it_reads(tmp_path, stories_file):
    outcome = run_harness(Path(__file__).with_name("continued_runs.py"), stories_file, tmp_path)
    assert outcome["edges"] >= 30, outcome  # the edges really ran
