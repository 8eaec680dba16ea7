"""The benchmark scripts run, and print the figures that docs/benchmarks.md and gpu_check.sh read.

Tests never assert times. One round of one step is enough to catch a script broken by a change
in the code it drives: ``benchmarks/gpu_check.sh`` runs ``throughput.py`` on a GPU that a
session may never have, so the CPU suite is where its breakage has to show.

The scripts are the developers' instruments, not the library: their tests are marked
``exhaustive`` (CI runs them once, ``python -m pytest -m exhaustive``), all but the shipped
configs' few steps, which a user's README run keeps.
"""

import argparse
import json
import math
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import nanolm.model
from nanolm.data.prepare import prepare
from nanolm.instruments.cli import main
from nanolm.optim import muon_available

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_json(monkeypatch, capsys, script: str, *args: str) -> dict:
    """Run ``benchmarks/<script>`` as its command line would, and return the JSON it prints.
    Scripts that take ``--threads`` change PyTorch's thread count; it is put back for the next test."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", [script, *args])
    try:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    return json.loads(capsys.readouterr().out)


@pytest.mark.exhaustive
@pytest.mark.kernels
def test_throughput_benchmark_reports_every_variant_and_puts_back_what_its_ablations_patch(monkeypatch, capsys):
    originals = (
        nanolm.model.apply_rope,
        nanolm.model.attention,
        nanolm.model.Attention.queries_keys_values,
        nanolm.model.RMSNorm.forward,
    )
    result = benchmark_json(
        monkeypatch,
        capsys,
        "throughput.py",
        "--shapes",
        "nanogpt",
        "--rounds",
        "1",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--ablations",
        "--breakdown",
        "--threads",
        "1",
    )
    shape = result["shapes"]["nanogpt"]
    for name in (
        "nanolm",
        "nanolm_mask_off",
        "reference",
        "nanolm_twin",
        "nanolm_again",
        "before_fused_adamw",
        "before_rope_roll",
        "before_qkv_split",
        "before_all",
        "nanolm_model_in_plain_loop",
        "without_rope",
        "layer_norm_for_rms_norm",
    ):
        row = shape[name]  # the figures hang together: a step's tokens, and the model's FLOPs per token
        assert row["tokens_per_sec"] * row["ms_per_step"] / 1e3 == pytest.approx(
            shape["shape"]["batch_size"] * shape["shape"]["seq_len"], rel=2e-3
        )
        assert row["gflops_per_sec"] == pytest.approx(
            shape["flops_per_token"] * row["tokens_per_sec"] / 1e9, rel=0.02, abs=0.1
        )
    assert "speedup nanolm over reference" in shape["time_ratios"]["wall"]
    assert 0 < shape["loader_share_of_step"] < 1 and result["peak_rss_mb"] > 0
    # 4 layers x (qkv, proj, gate, up, down) + the head, each forward once and backward twice
    assert shape["matmuls_alone"]["count_per_step"] == 3 * (4 * 5 + 1) and shape["matmuls_alone"]["ms_per_step"] > 0
    assert shape["parameters"] == 810_368  # nanoGPT's CPU shape with the char vocabulary of the stories
    assert (
        nanolm.model.apply_rope,
        nanolm.model.attention,
        nanolm.model.Attention.queries_keys_values,
        nanolm.model.RMSNorm.forward,
    ) == originals


@pytest.mark.exhaustive
def test_a_toggled_variant_runs_on_nanolms_own_runner_and_leaves_it_as_it_found_it():
    """``--ablations`` times a code-only variant on nanolm's own runner, switched on for its rounds.
    Its patch must be undone after each round, the RoPE table's sign included, or every later
    nanolm round would time (and train) the variant."""
    import contextlib

    import numpy as np

    bench = runpy.run_path(str(BENCHMARKS / "throughput.py"))
    shape = dict(n_layer=1, n_head=2, n_embd=32, seq_len=16, batch_size=2)
    tokens = np.random.default_rng(0).integers(1, 50, 5000)
    nanolm_runner = bench["nanolm_runner"]("nanolm", shape, 50, tokens, 0, torch.device("cpu"), contextlib.nullcontext)
    variant = bench["before_rope"](bench["toggled"](nanolm_runner, "before_rope_roll"))
    table, rope = nanolm_runner.model.rope_sin.clone(), nanolm.model.apply_rope
    assert variant.model is nanolm_runner.model and variant.step is nanolm_runner.step
    with variant.patch():
        assert nanolm.model.apply_rope is bench["rope_cat"] and not torch.equal(nanolm_runner.model.rope_sin, table)
    assert nanolm.model.apply_rope is rope and torch.equal(nanolm_runner.model.rope_sin, table)
    for _ in range(2):  # a round of each, as --ablations alternates them
        variant.timed(1)
        assert nanolm.model.apply_rope is rope and torch.equal(nanolm_runner.model.rope_sin, table)
        nanolm_runner.timed(1)


@pytest.mark.slow
def test_sharded_checkpoint_benchmark_compares_both_formats_and_checks_every_load(request):
    """The figures behind the choice of DCP's safetensors storage (docs/checkpoints.md). Seven
    torchrun launches (~50 s on 2 cores): out of the default run, since what it loads is
    checked on every run by tests/test_distributed.py (FSDP's shards written, loaded and resumed
    bit-identical) and the figures by ``python benchmarks/sharded_checkpoint.py``."""
    import subprocess

    if "slow" not in request.config.getoption("markexpr", ""):
        pytest.skip("slow (~50 s on 2 cores): run with -m slow")

    r = subprocess.run(
        [sys.executable, str(BENCHMARKS / "sharded_checkpoint.py"), "--small", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert ".metadata" in result["pickle"]["files"]
    assert all(name.endswith(".safetensors") for name in result["safetensors"]["files"])
    assert result["safetensors_over_pickle"]["save"] > 0 and result["safetensors"]["plain_process_load_s"] > 0


CONFIGS = sorted((BENCHMARKS.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_trains_a_few_steps(config, tmp_path, stories_file):
    """The speedrun tracks' configs (and the others) never rot: each trains three steps as
    written, on a local corpus instead of its download."""
    if "muon" in config.read_text() and not muon_available():
        pytest.skip("the config uses Muon (PyTorch >= 2.9)")
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--config",
                str(config),
                "--data",
                str(stories_file),
                "--out-dir",
                str(out),
                "--steps",
                "3",
                "--eval-every",
                "3",
                "--eval-batches",
                "1",
                "--warmup",
                "1",
                "--sample-tokens",
                "0",
                "--target-val-bpb",
                "0",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert (out / "final.json").is_file()


@pytest.mark.exhaustive
@pytest.mark.kernels
@pytest.mark.parametrize("text, chars_per_byte", [("abcdefghij" * 10, 1.0), ("abcdefghij" * 9 + "é" * 10, 0.5)])
def test_the_nanogpt_reference_runs_the_recipe_and_reads_its_curve(tmp_path, monkeypatch, capsys, text, chars_per_byte):
    """Against a stand-in checkout (nanoGPT itself is never shipped): the data step writes the
    format nanoGPT reads, the recipe's flags reach train.py, and the curve is parsed in bits per
    byte of the validation split (its nats per character, scaled when a character is 2 bytes)."""
    repo = tmp_path / "nanogpt"
    (repo / "config").mkdir(parents=True)
    (repo / "config" / "train_shakespeare_char.py").write_text("")
    (repo / "train.py").write_text(
        "import sys, numpy as np\n"
        "ids = np.fromfile('data/shakespeare_char/train.bin', dtype=np.uint16)\n"
        "assert '--max_iters=20' in sys.argv and '--n_embd=128' in sys.argv\n"
        "print(f'step 0: train loss 4.0000, val loss 4.1000')\n"
        "print(f'step 20: train loss 1.8000, val loss {1.8 if len(ids) == 90 else 9:.4f}')\n"
    )
    path = tmp_path / "input.txt"
    path.write_text(text, encoding="utf-8")
    result = benchmark_json(
        monkeypatch,
        capsys,
        "nanogpt_reference.py",
        "--nanogpt",
        str(repo),
        "--data",
        str(path),
        "--max-iters",
        "20",
        "--target",
        str(round(1.8 / math.log(2) * chars_per_byte, 4)),
    )
    assert [c["iter"] for c in result["curve"]] == [0, 20]
    assert result["final_val_bpb"] == pytest.approx(1.8 / math.log(2) * chars_per_byte, abs=1e-4)
    assert result["target_seen_at_s"] is not None


@pytest.mark.exhaustive
@pytest.mark.kernels
def test_head_and_loss_benchmark_times_whole_and_fused_with_the_same_gradients(monkeypatch, capsys):
    """The figures behind the fused head and loss (docs/benchmarks.md): the fused one must
    compute what the whole one does, or its timing means nothing."""
    results = benchmark_json(
        monkeypatch,
        capsys,
        "head_and_loss.py",
        "--vocab",
        "300,600",
        "--tokens",
        "96",
        "--width",
        "16",
        "--rows",
        "32",
        "--rounds",
        "2",
    )["results"]
    assert [r["vocab"] for r in results] == [300, 600]
    assert all(r["same_gradients"] for r in results)
    for r in results:  # each speedup is of the two figures printed beside it, rounded to two decimals
        assert r["speedup_fused"] == pytest.approx(r["whole_ms"] / r["fused_ms"], abs=0.006)
        assert r["step_speedup_fused"] == pytest.approx(r["step_whole_ms"] / r["step_fused_ms"], abs=0.006)
        assert r["step_whole_ms"] > 0 and r["step_fused_ms"] > 0


@pytest.mark.exhaustive
@pytest.mark.kernels
def test_allocator_benchmark_times_kept_and_given_back_buffers_in_fresh_processes(monkeypatch, capsys):
    """The figures behind keeping freed buffers (docs/benchmarks.md): each configuration in its
    own process, and the kept one really kept (on glibc)."""
    results = benchmark_json(
        monkeypatch,
        capsys,
        "allocator.py",
        "--threads",
        "1",
        "--rounds",
        "1",
        "--steps",
        "1",
        "--precision",
        "fp32",
        "--vocab",
        "300",
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--layers",
        "1",
        "--width",
        "16",
    )["results"]
    assert [r["qk_norm"] for r in results] == ["off", "on"]
    for r in results:  # each figure is the median of its own processes, and the ratio is of those two
        assert len(r["kept_ms_each"]) == len(r["given_back_ms_each"]) == 1
        assert r["kept_ms"] == statistics.median(r["kept_ms_each"]) > 0
        assert r["given_back_ms"] == statistics.median(r["given_back_ms_each"]) > 0
        assert r["speedup_kept"] == pytest.approx(r["given_back_ms"] / r["kept_ms"], abs=0.006)
    import platform

    if platform.libc_ver()[0] == "glibc":
        assert all(r["applied"] for r in results)


@pytest.mark.exhaustive
@pytest.mark.kernels
def test_prepare_benchmark_times_preparation_with_and_without_the_compressor_bounds(
    monkeypatch, capsys, stories_file, tmp_path
):
    """The figures behind a training run skipping the compressors (docs/data.md): both ways, the
    bounds reported only by the way that computes them."""
    out = benchmark_json(
        monkeypatch,
        capsys,
        "prepare_throughput.py",
        "--data",
        str(stories_file),
        "--tokenizers",
        "char",
        "--rounds",
        "1",
    )
    char = out["char"]
    assert out["mb"] == round(stories_file.stat().st_size / 1e6, 2)
    for seconds, rate in (
        ("seconds", "mb_per_s"),
        ("seconds_as_a_training_run_prepares", "mb_per_s_as_a_training_run_prepares"),
    ):
        rounding = char[rate] * (0.005 / char[seconds] + 0.005 / out["mb"]) + 0.005  # each figure to 2 decimals
        assert char[rate] == pytest.approx(out["mb"] / char[seconds], abs=rounding)
    prepared = prepare(stories_file, tmp_path / "shards", "char", 4096, progress=False, log=lambda *_: None)
    assert char["tokens"] == len(prepared.train) + len(prepared.val)  # the tokens of this very file
    assert 0 < char["compressor_bpb"]["xz"] < 8


@pytest.mark.exhaustive
@pytest.mark.kernels
def test_garbage_collector_benchmark_times_the_command_with_and_without_the_exemption(
    monkeypatch, capsys, stories_file
):
    """The figures behind the quick exit (docs/benchmarks.md): a real ``python -m nanolm`` in fresh
    processes, exempting objects from collection by default and not under --process-tuning off."""
    out = benchmark_json(
        monkeypatch,
        capsys,
        "garbage_collector.py",
        "--rounds",
        "1",
        "--",
        "train",
        "--data",
        str(stories_file),
        "--steps",
        "1",
        "--tokenizer",
        "char",
        "--n-layer",
        "1",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
    )
    assert out["exempted"]["frozen_objects"] > 10_000 and out["collector_alone"]["frozen_objects"] == 0
    for name in ("exempted", "collector_alone"):
        assert out[name]["exit_s"] > 0 and out[name]["gc_s"] >= 0 and out[name]["wall_s"] > out[name]["exit_s"]
        for key in ("gc_s", "exit_s", "wall_s"):  # one round: the median is that round's own figure
            assert out[name][key] == out[name]["each"][0][key]
    for key in ("gc_s", "exit_s", "wall_s"):  # what is saved is the collector's figure less the exempted one's
        assert out["saved_s"][key] == pytest.approx(out["collector_alone"][key] - out["exempted"][key], abs=2e-3)


@pytest.mark.exhaustive
@pytest.mark.kernels
@pytest.mark.skipif(not muon_available(), reason="torch.optim.Muon needs PyTorch >= 2.9")
@pytest.mark.parametrize("native_bf16", [True, False], ids=["bf16_units", "bf16_emulated"])
def test_muon_step_benchmark_times_both_muons_on_the_same_gradients(native_bf16, monkeypatch, capsys):
    """The figures behind GroupedMuon (docs/benchmarks.md): both Muons and AdamW timed on the
    same gradients, and the grouped one leaving PyTorch's weights up to what the two are allowed
    to differ by. Both kinds of CPU are played here, whichever this one is: with bf16 units both
    orthogonalise in bf16 (only the order of sums differs); without them GroupedMuon runs fp32
    against PyTorch's bf16, and the bound follows from bf16's rounding, not from one machine."""
    monkeypatch.setattr("nanolm.precision.cpu_has_native_bf16", lambda: native_bf16)
    result = benchmark_json(
        monkeypatch,
        capsys,
        "muon_step.py",
        "--layers",
        "2",
        "--width",
        "32",
        "--vocab",
        "64",
        "--threads",
        "1",
        "--steps",
        "2",
    )
    assert result["matrices"] == 10 and len(result["shapes"]) == 3  # qkv and the MLP's gate, up are all 96 x 32
    ms = result["step_ms"]
    assert set(ms) == {"torch_muon", "grouped_muon", "adamw"} and all(v > 0 for v in ms.values())
    assert result["grouped_over_torch"] == pytest.approx(ms["torch_muon"] / ms["grouped_muon"], abs=0.006)
    assert result["grouped_over_adamw"] == pytest.approx(ms["grouped_muon"] / ms["adamw"], abs=0.006)
    formats = result["orthogonalisation_format"]
    assert formats == {"torch_muon": "bfloat16", "grouped_muon": "bfloat16" if native_bf16 else "float32"}
    # in two formats: (1 + 3 x 5 iterations) x (bf16's 2^-8 + fp32's 2^-24); in one, test_optim's bound
    assert result["rounding_bound"] == pytest.approx(16 * (2**-8 + 2**-24) if not native_bf16 else 1e-3)
    # a Newton-Schulz iteration one step short, or 2 % off in one coefficient, is 12-38 % apart
    assert result["relative_weight_difference"] <= result["rounding_bound"]


@pytest.mark.exhaustive
@pytest.mark.kernels
def test_loss_per_step_benchmark_trains_each_loop_from_one_start_and_scores_every_model_alike(
    monkeypatch, capsys, tmp_path
):
    """The three models are judged by one evaluation: untrained, each predicts about uniformly
    (ln V nats per token); nanolm's model in the plain loop and in nanolm's step start from the
    same weights (the same seed), so their step-0 figures are equal; on ASCII text a character
    is a byte, so bits per byte are nats per token / ln 2; and at full rate from step 1 every
    loop lowers its loss."""
    text = (Path(__file__).resolve().parents[1] / "data" / "toy.txt").read_text(encoding="utf-8")[:40_000]
    path = tmp_path / "text.txt"
    path.write_text(text.replace("<|endoftext|>\n", ""), encoding="utf-8")  # one document: no EOS in it
    result = benchmark_json(
        monkeypatch,
        capsys,
        "loss_per_step.py",
        "--data",
        str(path),
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--seeds",
        "1",
        "--warmup",
        "1",
        "--lr",
        "3e-3",
        "--val-windows",
        "8",
        "--threads",
        "1",
        "--models",
        "reference,nanolm_model,nanolm,nanolm_model_gelu",
    )
    runs = result["seeds"]["1"]
    vocab = result["vocab_size"]
    assert len(set(path.read_text(encoding="utf-8"))) <= vocab <= 260
    for name in ("reference", "nanolm_model", "nanolm", "nanolm_model_gelu"):
        curve = runs[name]["curve"]
        assert [c["step"] for c in curve] == [0, 3, 6]
        assert curve[0]["loss"] == pytest.approx(math.log(vocab), abs=0.3)
        assert all(c["bpb"] == pytest.approx(c["loss"] / math.log(2), abs=2e-4) for c in curve)
        assert curve[-1]["loss"] < curve[0]["loss"] - 0.1
        assert runs[name]["ms_per_step"] > 0
    assert runs["nanolm_model"]["curve"][0] == runs["nanolm"]["curve"][0]
    assert runs["nanolm_model_gelu"]["curve"][0] != runs["nanolm_model"]["curve"][0]  # another MLP, another model
    assert set(result["summary"]) == {"reference", "nanolm_model", "nanolm", "nanolm_model_gelu"}


@pytest.mark.exhaustive
@pytest.mark.kernels
def test_every_loop_of_the_loss_per_step_benchmark_runs_the_same_recipe():
    """What makes the comparison fair: at every step each loop runs at the rate the training loop
    would use (no step off by one between ``train_step`` and the plain loop), with the same AdamW
    constants; the two plain loops draw the same windows; and the reference is nanoGPT's model as
    its train.py trains it: no biases, the residual projections initialised smaller."""
    from nanolm.run.config import OptimOptions
    from nanolm.step import learning_rate

    script = runpy.run_path(str(BENCHMARKS / "loss_per_step.py"))
    args = argparse.Namespace(lr=1e-3, warmup=3, steps=8, beta2=0.99, weight_decay=0.1)
    tokens = np.random.default_rng(0).integers(1, 40, 4000)
    loops = {name: script["Trainee"](name, args, 40, tokens, 0, 1) for name in ("reference", "nanolm_model", "nanolm")}
    optimizers = {name: loop.parts.optimizer if name == "nanolm" else loop.optimizer for name, loop in loops.items()}
    schedule = OptimOptions(lr=1e-3, warmup=3, min_lr=1e-4)
    for step in range(1, 9):
        for loop in loops.values():
            loop.step(step)
        expected = learning_rate(step, schedule, 8)
        for name, optimizer in optimizers.items():
            assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([expected] * len(optimizer.param_groups))
    for optimizer in optimizers.values():
        assert {g["betas"] for g in optimizer.param_groups} == {(0.9, 0.99)}
        assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, 0.1}
    assert torch.equal(loops["reference"].generator.get_state(), loops["nanolm_model"].generator.get_state())
    reference = loops["reference"].model
    assert not [n for n, _ in reference.named_parameters() if n.endswith("bias")]
    weights = dict(reference.named_parameters())
    assert weights["blocks.0.c_proj.weight"].std() < 0.5 * weights["blocks.0.c_attn.weight"].std()
    assert weights["blocks.0.mlp_proj.weight"].std() < 0.5 * weights["blocks.0.c_fc.weight"].std()


@pytest.mark.exhaustive
@pytest.mark.kernels
def test_the_speedrun_counts_training_time_from_the_first_step_to_the_target_evaluation(
    monkeypatch, capsys, stories_file
):
    """A row's time is training time (docs/speedrun.md): the process's start and data preparation
    are reported beside it, and the three parts add up to the process from launch to exit."""
    out = benchmark_json(
        monkeypatch,
        capsys,
        "speedrun.py",
        "--data",
        str(stories_file),
        "--config",
        "configs/shakespeare_char.toml",
        "--target",
        "100",
        "--threads",
        "1",
        "--",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--sample-tokens",
        "0",
        "--warmup",
        "1",
        "--no-eval-at-start",
    )
    run = out["runs"][0]
    assert out["reached"] == "1/1" and run["reached_target"]
    assert run["curve"][0]["step"] == 2  # the target (any loss) is met by the first evaluation
    parts = run["before_training_s"] + run["training_time_to_target_s"] + run["after_target_s"]
    assert parts == pytest.approx(run["launch_to_exit_s"], abs=0.02)
    assert 0 < run["training_time_to_target_s"] < run["launch_to_exit_s"] - run["before_training_s"] + 0.01
    assert run["before_training_s"] > 0.5  # Python and PyTorch start, at least, are not training
    assert out["median_training_time_to_target_s"] == run["training_time_to_target_s"]


@pytest.mark.exhaustive
def test_every_regression_the_sensitivity_benchmark_plants_breaks_a_line_that_exists_once():
    """``benchmarks/band_sensitivity.py`` plants regressions by replacing a line of nanolm; a line
    that moved would make the benchmark measure healthy code and call it a regression."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("band_sensitivity", BENCHMARKS / "band_sensitivity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, (plant, flags) in module.REGRESSIONS.items():
        if plant is None:
            assert flags and flags[0].startswith("--debug-"), name  # a fault the setup does not count
            continue
        file, correct, broken = plant
        assert correct != broken and (BENCHMARKS.parent / file).read_text().count(correct) == 1, name


@pytest.mark.exhaustive
@pytest.mark.parametrize(
    "script, args, says",
    [
        ("benchmarks/band_sensitivity.py", ["--rerun-seeds", "1,2,3"], "--rerun-seeds needs at least 6 seeds"),
        ("benchmarks/band_sensitivity.py", ["--regressions", "lr_x0.9,lr_x7"], "unknown regression 'lr_x7'"),
        ("benchmarks/band_sensitivity.py", ["--held-out", "100-1x9"], "'100-1x9' is not a seed or a range of seeds"),
        ("benchmarks/other_cpus.py", ["--paths", "native,avx3"], "unknown kernel path 'avx3'"),
        ("benchmarks/other_cpus.py", ["--threads", "1,two"], "--threads '1,two': write thread counts as 1,2"),
        ("benchmarks/other_cpus.py", ["--new-seeds", "1-3"], "--new-seeds must be seeds the reference never trained"),
        ("benchmarks/other_cpus.py", ["--jobs", "0"], "--jobs needs at least 1"),
        ("tools/reference_bands.py", ["--widen", "quick-fp32=0.5"], "--widen 'quick-fp32=0.5': write NAME=FACTOR"),
        ("tools/reference_bands.py", ["--widen", "default-fp32=1.2"], "default-fp32 is widened already"),
        (
            "tools/reference_bands.py",
            ["--recipes", "quick", "--curve-seeds", "1-20", "--reruns", "1,2"],
            "--reruns needs at least 5 of the --curve-seeds",
        ),
        (
            "tools/reference_bands.py",
            ["--recipes", "quick", "--curve-seeds", "1-20", "--reruns", "1-5,99"],
            "--reruns SEEDS must be among the --curve-seeds",
        ),
    ],
)
def test_the_reference_tools_refuse_bad_seeds_in_one_line_before_training_anything(tmp_path, script, args, says):
    """These tools train for an hour or more before they judge: a mistyped option must stop them at
    once, with one line, not after the trainings with a traceback."""
    import subprocess

    work = tmp_path / "work"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS.parent / script), *args, "--work", str(work)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=BENCHMARKS.parent,
    )
    assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not work.exists()


@pytest.mark.exhaustive
def test_the_calibration_benchmark_reports_both_thresholds_for_each_test_and_number_of_runs():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "curve_calibration.py"), "--trials", "20", "--samples", "200"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    assert [(r["test"], r["runs"]) for r in rows] == [(t, n) for t in ("among seeds", "own seed") for n in (5, 10, 20)]
    assert all(0 <= r["now"] <= 1 and 0 <= r["before"] <= 1 for r in rows)


@pytest.mark.exhaustive
def test_the_time_budget_track_reports_training_time_by_the_runs_clock_and_its_passes_over_the_data(
    monkeypatch, capsys, stories_file, tmp_path
):
    out = benchmark_json(
        monkeypatch,
        capsys,
        "speedrun.py",
        "--data",
        str(stories_file),
        "--config",
        "configs/shakespeare_char.toml",
        "--budget",
        "600",
        "--threads",
        "1",
        "--holdout-shift",
        "5",
        "--keep-runs",
        str(tmp_path / "kept"),
        "--",
        "--steps",
        "4",
        "--eval-every",
        "4",
        "--eval-windows",  # as the per-minute configs size their evaluations, not --eval-batches
        "8",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--sample-tokens",
        "0",
        "--warmup",
        "1",
        "--no-eval-at-start",
    )
    run = out["runs"][0]
    assert run["steps"] == 4 and run["tokens_trained"] == 4 * 4 * 32 and out["fits_budget"] and run["fits_budget"]
    assert run["passes"] == round(run["tokens_trained"] / run["train_split_tokens"], 2) == out["passes"]
    assert 0 < run["training_time_s"] < run["launch_to_exit_s"] - run["before_training_s"]
    assert out["median_full_val_bpb"] == run["full_val_bpb"] > 0 and out["holdout_shift"] == 5
    assert "target_val_bpb" not in out and ".shift5" in out["data"]
    # 8 windows of 32 tokens cover 256 of the split's tokens: the run's own evaluations saw part of it
    assert run["val_tokens"] > 8 * 32 and run["decided_on_the_full_val_split"] is False
    # the run's directory is kept (a record's stories come from its weights), and never mixed into another's
    assert (
        run["kept_in"] == str(tmp_path / "kept" / "run0")
        and (tmp_path / "kept" / "run0" / "model.safetensors").is_file()
    )
    monkeypatch.setattr(sys, "argv", ["speedrun.py", "--budget", "60", "--keep-runs", str(tmp_path / "kept")])
    with pytest.raises(SystemExit, match="--keep-runs .* is not empty: name a new directory"):
        runpy.run_path(str(BENCHMARKS / "speedrun.py"), run_name="__main__")
    a_file = tmp_path / "kept" / "run0" / "model.safetensors"  # a file where a directory is named: the same line
    monkeypatch.setattr(sys, "argv", ["speedrun.py", "--budget", "60", "--keep-runs", str(a_file)])
    with pytest.raises(SystemExit, match="--keep-runs .* is not empty: name a new directory"):
        runpy.run_path(str(BENCHMARKS / "speedrun.py"), run_name="__main__")


@pytest.mark.exhaustive
def test_a_shifted_holdout_holds_out_other_documents_and_keeps_every_one():
    import importlib.util
    import tempfile

    from nanolm.data.sources import split_documents
    from nanolm.tokenizer import EOS

    spec = importlib.util.spec_from_file_location("speedrun", BENCHMARKS / "speedrun.py")
    speedrun = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speedrun)
    docs = [f"story {i}\nits second line" for i in range(40)]
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "s.txt"
        source.write_text(f"\n{EOS}\n".join(docs))
        shifted = Path(speedrun.shifted_holdout(str(source), 5, EOS, Path(tmp))).read_text().split(f"\n{EOS}\n")
        with pytest.raises(SystemExit, match="--holdout-shift must be between 1 and 39"):
            speedrun.shifted_holdout(str(source), 40, EOS, Path(tmp))
        with pytest.raises(SystemExit, match=f"--data {tmp} is not one"):  # prepared shards: no documents to move
            speedrun.shifted_holdout(tmp, 5, EOS, Path(tmp))
    assert sorted(shifted) == sorted(docs) and shifted[0] == docs[5]
    held = {text for split, text in split_documents(iter(docs), 0.1) if split == "val"}
    held_after = {text for split, text in split_documents(iter(shifted), 0.1) if split == "val"}
    assert len(held) == len(held_after) == 4 and not held & held_after


@pytest.mark.exhaustive
def test_step_profile_times_nanolm_beside_the_plain_loop_and_groups_the_profile(monkeypatch, capsys):
    """The figures of dev/measurements.md, "The 60 s step, op by op": every loop timed on the same
    batches, the ratio the printed times give, and a profile whose groups are the whole step."""
    result = benchmark_json(
        monkeypatch, capsys, "step_profile.py", "--threads", "1", "--steps", "2", "--formats", "fp32", "--profile"
    )
    fp32 = result["formats"]["fp32"]
    loops = fp32["loops"]
    assert set(loops) == {"nanolm (Muon)", "nanolm (AdamW)", "plain loop (AdamW)"}
    assert all(v["ms_per_step"] > 0 and 0 < v["mfu"] for v in loops.values())
    ms = {k: v["ms_per_step"] for k, v in loops.items()}
    assert fp32["plain_over_nanolm_adamw"] == round(ms["plain loop (AdamW)"] / ms["nanolm (AdamW)"], 3)
    groups = fp32["profile"]["groups_share"]
    assert {"matmul", "attention", "other"} <= set(groups) and 0.99 <= sum(groups.values()) <= 1.01
