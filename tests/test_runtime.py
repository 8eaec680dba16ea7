"""The process a run lives in: the switches it sets (determinism, TF32, threads), the seeds it
draws from, and how it names what stopped it (nanolm/machine/runtime.py). Each switch is
checked where it lands, inside ``settings_restored`` so that the test leaves the process as
it found it."""

import os
import random
import signal

import numpy as np
import pytest
import torch

from nanolm.errors import NanolmError
from nanolm.machine import runtime
from nanolm.machine.runtime import (
    configure_determinism,
    configure_tf32,
    configure_threads,
    restore_rng,
    seed_everything,
    settings_restored,
    stop_reason,
)


def test_determinism_switches_the_kernels_cublas_workspace_and_cudnn_autotuning_and_back():
    """On CUDA, deterministic matrix products need cuBLAS's fixed workspace (an environment
    variable read when cuBLAS starts), and cuDNN's autotuner picks kernels by timing."""
    with settings_restored():
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        torch.backends.cudnn.benchmark = True
        configure_determinism(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.backends.cudnn.benchmark is False
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"  # the user's own choice is kept
        configure_determinism(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        configure_determinism(False)
        assert not torch.are_deterministic_algorithms_enabled()


def test_tf32_is_switched_on_only_for_fp32_products_where_allowed(monkeypatch):
    monkeypatch.setattr(runtime, "tf32_capable", lambda device: True)  # an Ampere GPU, as the device says
    cuda = torch.device("cuda")
    with settings_restored():
        torch.backends.cudnn.allow_tf32 = False
        assert configure_tf32(cuda, "bf16", True) is None and configure_tf32(cuda, "fp32", False) is None
        assert torch.get_float32_matmul_precision() == "highest" and torch.backends.cudnn.allow_tf32 is False
        said = configure_tf32(cuda, "fp32", True)
        assert said == "fp32 matrix products on TF32 tensor cores (--no-tf32 for full fp32 products)"
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32 is True


@pytest.fixture
def machine(monkeypatch):
    """A CPU of ``cores`` cores whose 1-minute load average is ``busy`` (the 5- and 15-minute
    ones far off, so that reading the wrong one shows)."""

    def make(cores, busy):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        monkeypatch.setattr(os, "getloadavg", lambda: (busy, 50.0, 50.0))

    return make


def _hint(used: int, auto: bool = False) -> list[str]:
    """What ``configure_threads`` says of ``--threads`` left at PyTorch's ``used`` threads."""
    lines = []
    with settings_restored():
        torch.set_num_threads(used)
        configure_threads(0, torch.device("cpu"), log=lines.append, auto=auto)
    return lines


def test_a_fixed_thread_count_on_a_busy_cpu_is_told_how_many_threads_to_try(machine):
    machine(4, 1.1)
    [line] = _hint(4)
    assert line.startswith("cpu: 4 threads on 4 cores while the load average says other processes keep ~1.1 busy")
    assert line.endswith("If this run crawls, try --threads 3.")
    machine(4, 0.75)
    assert _hint(4) == []  # busy + threads exactly cores + 0.75: not yet
    machine(None, 0.0)  # a system that cannot count its cores: one
    assert len(_hint(2)) == 1


def test_threads_auto_leaves_a_busy_cpu_to_the_tuner_and_a_number_is_set(machine):
    machine(4, 3.0)
    assert _hint(4, auto=True) == []
    lines = []
    with settings_restored():
        torch.set_num_threads(4)
        configure_threads(0, torch.device("cpu"), log=lines.append)  # by default the tuner measures
        assert lines == []
        configure_threads(3, torch.device("cpu"), log=lines.append)
        assert torch.get_num_threads() == 3


def test_seed_everything_seeds_pythons_numpys_and_torchs_generators():
    with settings_restored():
        seed_everything(7)
        drawn = (random.random(), float(np.random.random_sample()), torch.rand(1).item())
    assert drawn == (
        random.Random(7).random(),
        float(np.random.RandomState(7).random_sample()),
        torch.rand(1, generator=torch.Generator().manual_seed(7)).item(),
    )


def test_a_malformed_random_state_is_one_line_naming_it():
    malformed = r"^the checkpoint's random state is malformed \(KeyError"
    with settings_restored(), pytest.raises(NanolmError, match=malformed):
        restore_rng({}, torch.device("cpu"))


def test_what_stopped_a_run_is_named_as_its_last_line_says_it():
    assert stop_reason(signal.SIGTERM) == "SIGTERM" and stop_reason(signal.SIGINT) == "SIGINT"
    if hasattr(signal, "SIGHUP"):  # POSIX only
        assert stop_reason(signal.SIGHUP) == "SIGHUP"
    assert stop_reason(runtime.OUTPUT_CLOSED) == "output closed (SIGPIPE)"
    assert stop_reason(12345) == "signal 12345"


@pytest.fixture
def accelerators(monkeypatch):
    """torch.cuda's and torch.mps's random-state calls, recorded (no GPU needed): what was read
    from or written to which device."""
    calls = []
    monkeypatch.setattr(
        torch.cuda,
        "get_rng_state",
        lambda device=None: calls.append(("get", device)) or torch.full((4,), 7, dtype=torch.uint8),
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device=None: calls.append(("set", device, state.tolist()))
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(
        torch.mps, "get_rng_state", lambda: calls.append(("mps get",)) or torch.ones(2, dtype=torch.uint8)
    )
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state: calls.append(("mps set", state.tolist())))
    return calls


def test_the_run_devices_random_state_is_read_and_put_back_on_that_device_only(accelerators):
    gpu = torch.device("cuda:1")
    with settings_restored():
        state = runtime.capture_rng(gpu)
        assert accelerators == [("get", gpu)] and state["cuda"].tolist() == [7] * 4 and "mps" not in state
        runtime.restore_rng(state, gpu)
        assert accelerators[-1] == ("set", gpu, [7] * 4)
        mps = runtime.capture_rng(torch.device("mps"))
        assert mps["mps"].tolist() == [1, 1] and "cuda" not in mps
        runtime.restore_rng(mps, torch.device("mps"))
        assert accelerators[-1] == ("mps set", [1, 1])
        calls = len(accelerators)
        runtime.restore_rng({**state, **mps}, torch.device("cpu"))  # a CPU run touches neither
        runtime.restore_rng(mps, gpu)  # no state of that kind saved: left alone
        runtime.restore_rng(state, torch.device("mps"))
        assert len(accelerators) == calls


@pytest.mark.parametrize("device, picked", [("cuda:1", [1]), ("cuda", [1]), ("cuda:2", [0]), ("cuda:5", [0])])
def test_a_state_per_visible_gpu_is_read_for_the_runs_own_gpu(accelerators, device, picked):
    """Checkpoints before 2026-12 kept one state per visible GPU: the run's own is used (the current
    device when the run names none), the first when the run's GPU was not among them."""
    per_gpu = [torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8)]
    with settings_restored():
        state = {**runtime.capture_rng(torch.device("cpu")), "cuda": per_gpu}
        runtime.restore_rng(state, torch.device(device))
    assert accelerators == [("set", torch.device(device), per_gpu[picked[0]].tolist())]


def test_a_captured_random_state_continues_every_generator_where_it_was(accelerators):
    with settings_restored():
        seed_everything(3)
        state = runtime.capture_rng(torch.device("cpu"))
        first = (random.random(), random.gauss(0, 1), float(np.random.standard_normal()), torch.rand(2).tolist())
        seed_everything(4)
        runtime.restore_rng(state, torch.device("cpu"))
        again = (random.random(), random.gauss(0, 1), float(np.random.standard_normal()), torch.rand(2).tolist())
    assert first == again


def test_a_derived_seed_is_a_32_bit_number_of_its_parts_only_and_differs_for_every_combination():
    """What seeds each rank's random streams (and a resume on another number of processes):
    equal parts give equal seeds in any process, and no two (seed, step, rank) share one."""
    seeds = {
        (seed, step, rank): runtime.derived_seed(seed, step, rank)
        for seed in (0, 1, 1337)
        for step in (0, 1, 400)
        for rank in range(4)
    }
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= s < 2**32 for s in seeds.values()) and max(seeds.values()) > 2**31  # all 32 bits in use
    # pinned: a resume on another number of processes re-derives its random streams with it
    assert runtime.derived_seed(1337, 400, 3) == seeds[(1337, 400, 3)] == 2647420254
    assert runtime.derived_seed(1337, 3) != runtime.derived_seed(3, 1337)
