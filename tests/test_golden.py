"""Invariant 16: a refactor changes no number.

``tools/golden.py`` runs a pinned short recipe and compares every logged number, and a digest of
the final weights, with ``tests/fixtures/golden.json``: bit for bit on the machine that recorded
it, within a relative tolerance elsewhere. The update command, after a change meant to move
numbers, is ``python tools/golden.py --update``.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("golden", ROOT / "tools" / "golden.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["golden"] = module
    spec.loader.exec_module(module)
    return module


def test_a_refactor_changes_no_number(tmp_path):
    """The pinned recipe computes, on this machine, what the record says: to the bit where the
    record was made here, within the tolerance elsewhere (the message says which)."""
    tool = _tool()
    moved, how = tool.check("short", tmp_path)
    assert moved is None, f"{moved} ({how}); if the change is meant to move numbers: python tools/golden.py --update"


def _record() -> dict:
    tool = _tool()
    records = tool.json.loads(tool.GOLDEN.read_text(encoding="utf-8"))["short"]
    return copy.deepcopy(next(iter(records.values())))


def test_one_bit_of_one_loss_is_a_moved_number_on_the_recording_machine():
    tool, recorded = _tool(), _record()
    assert tool.compare(recorded, copy.deepcopy(recorded), exact=True) is None
    moved = copy.deepcopy(recorded)
    moved["loss"][7] = math.nextafter(moved["loss"][7], math.inf)
    assert "loss at value 8" in tool.compare(recorded, moved, exact=True)
    assert tool.compare(recorded, moved, exact=False) is None  # another machine rounds differently


def test_the_final_weights_alone_can_show_a_moved_number():
    tool, recorded = _tool(), _record()
    moved = copy.deepcopy(recorded)
    moved["weights_sha256"] = "0" * 64
    assert "final weights changed" in tool.compare(recorded, moved, exact=True)
    assert tool.compare(recorded, moved, exact=False) is None  # bits of weights are not compared elsewhere


def test_elsewhere_a_number_must_agree_within_the_tolerance_and_no_more():
    tool, recorded = _tool(), _record()
    for key, index in (("loss", 3), ("grad_norm", 19)):
        inside, outside = copy.deepcopy(recorded), copy.deepcopy(recorded)
        inside[key][index] *= 1 + tool.ELSEWHERE / 2
        outside[key][index] *= 1 + tool.ELSEWHERE * 2
        assert tool.compare(recorded, inside, exact=False) is None
        assert key in tool.compare(recorded, outside, exact=False)
    outside = copy.deepcopy(recorded)
    outside["val_loss"][-1][1] *= 1 + tool.ELSEWHERE * 2
    assert "val_loss at step 20" in tool.compare(recorded, outside, exact=False)


def test_the_tokenizer_and_the_data_are_compared_exactly_everywhere():
    tool, recorded = _tool(), _record()
    for key in tool.EXACT_EVERYWHERE:
        moved = copy.deepcopy(recorded)
        moved[key] = "f" * len(moved[key])
        assert key in tool.compare(recorded, moved, exact=False)


def test_a_missing_or_moved_evaluation_is_a_moved_number():
    tool, recorded = _tool(), _record()
    fewer = copy.deepcopy(recorded)
    fewer["loss"].pop()
    assert "20 values recorded, 19 now" in tool.compare(recorded, fewer, exact=False)
    later = copy.deepcopy(recorded)
    later["val_loss"][1][0] = 11
    assert "evaluated at step 11" in tool.compare(recorded, later, exact=False)


def test_a_machine_names_the_pytorch_and_the_cpu_its_bits_depend_on():
    import torch

    here = _tool().machine()
    assert here.startswith(f"torch {torch.__version__} | ") and here.endswith(torch.backends.cpu.get_cpu_capability())
