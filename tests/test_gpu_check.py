"""benchmarks/gpu_check.sh, the one command that proves a GPU, proven itself on a CPU.

A GPU is lent rarely and for minutes: a check that breaks in its own code (a renamed option, a
figure it no longer finds, a verdict that says PASS when a part failed) would waste that time
or, worse, vouch for a GPU it never tested. So the driver runs here with ``--device cpu --tiny``:
every part at toy sizes, the same code that runs on the GPU, leaving out only what a CPU cannot
do (FlexAttention's backward pass). Faults are planted through the driver's own ``--append``
(the lab's hidden ``--debug-*`` options), to show that a part FAILs when what it checks breaks.
These tests prove the harness, never a GPU; tests/test_gpu.py and the script itself do that.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "benchmarks" / "gpu_check.py"
FAST_PARTS = [
    "train",
    "bf16_vs_fp32",
    "fp16_overflow",
    "bf16_pure",
    "muon",
    "nan_rollback",
    "flex",
    "flex_cost",
    "throughput",
]
SLOW_PARTS = ["kill9", "compile", "gpu_tests", "head_and_loss"]  # kill9 fails on purpose below; compile takes ~50 s


def gpu_check(*args, cwd=None, env=None, command=None):
    command = command or [sys.executable, str(DRIVER), "--device", "cpu", "--tiny", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def verdicts(stdout: str) -> dict[str, str]:
    """``{part: "PASS"|"FAIL"|"SKIP"}`` from the lines the driver prints."""
    found = {}
    for line in stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("PASS", "FAIL", "SKIP"):
            found[rest.split(" ")[0]] = status
    return found


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_gpu_check_ends_in_one_line_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    for command in (["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], [sys.executable, str(DRIVER)]):
        r = gpu_check("--out", out, command=command, env={"PYTHON": sys.executable})
        lines = (r.stdout + r.stderr).splitlines()
        assert r.returncode == 2 and len(lines) == 1, (command, r.stdout, r.stderr)
        assert lines[0].startswith("gpu_check: no CUDA GPU is visible") and lines[0].endswith("nothing was run")
        assert not out.exists()


@pytest.mark.exhaustive
def test_every_part_passes_at_toy_sizes_and_writes_its_figures_under_the_directory_named(tmp_path):
    """The whole harness, part by part, on a CPU: a PASS line with a figure and the part's wall
    time each, one JSON per part and a summary under ``--out`` (given relative to the current
    directory: it resolves to an absolute one), the verdict last, exit status 0."""
    r = gpu_check("--out", "results/cpu", "--parts", ",".join(FAST_PARTS), "--jobs", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert verdicts(r.stdout) == {name: "PASS" for name in FAST_PARTS}, r.stdout
    out = tmp_path / "results" / "cpu"
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"gpu_check: {len(FAST_PARTS)}/{len(FAST_PARTS)} parts passed in ")
    assert last.endswith(f"figures in {out}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] == len(FAST_PARTS) and summary["failed"] == [] and summary["machine"]["device"] == "cpu"
    for name in FAST_PARTS:
        result = json.loads((out / f"{name}.json").read_text())
        assert result["status"] == "PASS" and result["figure"] and result["seconds"] > 0 and result["figures"], name
        assert (out / "logs" / f"{name}.log").stat().st_size > 0
    figures = {name: json.loads((out / f"{name}.json").read_text())["figures"] for name in FAST_PARTS}
    assert figures["fp16_overflow"]["history"][2]["updated"] is False  # the planted overflow was skipped
    assert {"config.json", "model.safetensors"} <= set(figures["train"]["exported"])
    assert figures["flex"]["relative_max_errors"]["float32 out vs sdpa"] < 1e-5
    assert figures["bf16_pure"]["saved_dtypes"] == ["torch.bfloat16"]
    assert "nanolm_mask_off" in figures["throughput"]["variants"]
    assert set(figures["flex_cost"]["ms"]) == {
        "flex_document",
        "flex_causal",
        "sdpa_causal",
        "sdpa_boolean_document",
        "block_mask_build",
    }


@pytest.mark.exhaustive
def test_a_part_whose_check_breaks_fails_and_the_run_exits_1(tmp_path):
    """Faults planted with the lab's own options: a NaN that is skipped instead of rolled back,
    and a resume that forgets the optimizer state (a rerun that is not bit-identical). Each part
    must FAIL with the reason, the others still run, the verdict names them, exit status 1.
    Two parts at a time (``--jobs 2``), as on a GPU."""
    out = tmp_path / "out"
    r = gpu_check(
        "--out",
        out,
        "--parts",
        "kill9,nan_rollback,fp16_overflow",
        "--jobs",
        "2",
        "--append",
        "nan_rollback=--on-nan skip",
        "--append",
        "kill9=--debug-drop-optimizer-state",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert verdicts(r.stdout) == {"kill9": "FAIL", "nan_rollback": "FAIL", "fp16_overflow": "PASS"}, r.stdout
    reasons = {name: json.loads((out / f"{name}.json").read_text())["figure"] for name in ("kill9", "nan_rollback")}
    assert "differ from the uninterrupted run's" in reasons["kill9"]
    assert "'skip'" in reasons["nan_rollback"] and "rolled back" in reasons["nan_rollback"]
    assert "gpu_check: 1/3 parts passed, FAILED: " in r.stdout.splitlines()[-1]
    assert sorted(json.loads((out / "summary.json").read_text())["failed"]) == ["kill9", "nan_rollback"]


@pytest.mark.exhaustive
def test_a_part_past_its_time_limit_is_stopped_and_one_past_the_budget_is_not_started(tmp_path):
    """A part past its limit is killed with what it started (the `nanolm train` it waits for):
    nothing of it runs on, nothing finishes behind the verdict's back, and its log keeps what it
    had said (written as it came); a part that cannot start before the budget ends is not
    started, and says so. The estimates of the parts chosen are printed first."""
    out, work = tmp_path / "out", tmp_path / "work"
    r = gpu_check(
        "--out",
        out,
        "--work",
        work,
        "--parts",
        "train,muon",
        "--timeout",
        "train=8",
        "--budget",
        "12",
        "--append",
        "train=--steps 100000",
    )  # a run that cannot end within its limit
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith(
        "gpu_check: estimated seconds on a cold H200: train 100, muon 60; 160 s one after "
        "another, ~160 s 1 at a time: more than the 12 s budget"
    ), lines[1]
    assert any(
        line.startswith("FAIL train (") and "timed out after 8 s (the part's time limit)" in line for line in lines
    ), r.stdout
    assert any(line.startswith("FAIL muon (0.0 s): not run: the 12 s budget was spent") for line in lines), r.stdout
    partial = (out / "logs" / "train.log").read_text()
    assert partial.startswith("== train on cpu (toy sizes)") and "$ python -m nanolm train" in partial, partial
    assert json.loads((out / "train.json").read_text())["status"] == "FAIL"
    assert json.loads((out / "summary.json").read_text())["passed"] == 0
    still_running = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(work).encode() in cmdline.read_bytes():
                still_running.append(cmdline.parent.name)
        except OSError:
            pass  # a process that ended while we looked
    assert not still_running and not (work / "train" / "run" / "final.json").exists()


def test_the_first_contact_proves_what_matters_first_and_fits_six_minutes_by_its_estimates():
    """The default: the training loop end to end, kill -9 and resume, FlexAttention against
    SDPA, bf16 against fp32, whose estimates on a cold H200 add up to the default budget of 6
    minutes; the rest are opt-in groups; every part belongs to exactly one group, and the parts
    that time the device come last."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check as driver
    finally:
        sys.path.pop(0)
    first = driver.chosen_parts(driver.build_parser().parse_args([]).parts)
    assert first == ["train", "kill9", "flex", "bf16_vs_fp32"]
    assert sum(driver.BY_NAME[n].estimate_s for n in first) <= driver.BUDGET_S == 360
    groups = [driver.chosen_parts(g) for g in driver.GROUPS]
    assert sorted(n for g in groups for n in g) == sorted(driver.BY_NAME) == sorted(driver.chosen_parts("all"))
    assert all(p.alone == (p.group == "timing") for p in driver.PARTS)
    assert all(p.estimate_s < p.limit_s for p in driver.PARTS)
    assert driver.chosen_parts("first,kill9,flex_cost") == first + ["flex_cost"]


@pytest.mark.slow
def test_the_other_parts_pass_at_toy_sizes(tmp_path, request):
    """kill -9 after the first checkpoint and a bit-identical rerun; --compile against eager
    (~50 s of compiling on 2 cores); the GPU-marked tests (all skipped here); the head and loss."""
    if "slow" not in request.config.getoption("markexpr", ""):
        pytest.skip("slow (~80 s on 2 cores): run with -m slow")
    r = gpu_check("--out", tmp_path / "out", "--parts", ",".join(SLOW_PARTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert verdicts(r.stdout) == {name: "PASS" for name in SLOW_PARTS}, r.stdout
    kill9 = json.loads((tmp_path / "out" / "kill9.json").read_text())["figures"]
    assert kill9["identical_weights"] and kill9["killed_after_step"] > kill9["resumed_at_step"]
