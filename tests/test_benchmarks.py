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


def test_sharded_checkpoint_benchmark_compares_both_formats_and_checks_every_load():
    """The figures behind the choice of DCP's safetensors storage (docs/checkpoints.md)."""
    import subprocess

    r = subprocess.run([sys.executable, str(BENCHMARKS / "sharded_checkpoint.py"), "--small", "--repeats", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert ".metadata" in result["pickle"]["files"]
    assert all(name.endswith(".safetensors") for name in result["safetensors"]["files"])
    assert result["safetensors_over_pickle"]["save"] > 0 and result["safetensors"]["plain_process_load_s"] > 0
