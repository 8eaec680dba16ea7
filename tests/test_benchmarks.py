"""The benchmark scripts run, and print the figures that docs/benchmarks.md and gpu_check.sh read.

Tests never assert times. One round of one step is enough to catch a script broken by a change
in the code it drives: ``benchmarks/gpu_check.sh`` runs ``throughput.py`` on a GPU that a
session may never have, so the CPU suite is where its breakage has to show.
"""

import json
import runpy
import sys
from pathlib import Path

import torch

import nanolm.model

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_throughput_benchmark_reports_every_variant_and_puts_back_what_its_ablations_patch(monkeypatch, capsys):
    originals = nanolm.model.apply_rope, nanolm.model.attention, nanolm.model.Attention.queries_keys_values
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--shapes", "nanogpt", "--rounds", "1", "--steps", "1",
                                      "--warmup", "1", "--ablations", "--threads", "1"])
    try:
        runpy.run_path(str(BENCHMARKS / "throughput.py"), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out)
    shape = result["shapes"]["nanogpt"]
    for name in ("nanolm", "nanolm_mask_off", "reference", "nanolm_twin", "before_fused_adamw", "before_rope_roll",
                 "before_joint_qk_rope", "before_all"):
        assert shape[name]["tokens_per_sec"] > 0 and shape[name]["gflops_per_sec"] > 0
    assert "speedup nanolm over reference" in shape["time_ratios"]["wall"]
    assert 0 < shape["loader_share_of_step"] < 1 and result["peak_rss_mb"] > 0
    assert shape["parameters"] == 810_368  # nanoGPT's CPU shape with the char vocabulary of the stories
    assert (nanolm.model.apply_rope, nanolm.model.attention, nanolm.model.Attention.queries_keys_values) == originals
