"""What a CUDA GPU and an Apple GPU run, exercised on the CPU as far as a CPU allows.

Three means (docs/gpu.md says what each covers and what only a GPU proves):

* FlexAttention's forward runs on the CPU: every function that can receive the document
  mask as a ``BlockMask`` receives one here (its backward has no CPU kernel);
* :mod:`simulated_device`: tensors that claim ``cuda:0`` or ``mps:0`` while their numbers
  live on the CPU, so that a step, an evaluation, the statistics, the NaN explanation and a
  checkpoint run with the model "on the GPU" and a stray CPU tensor raises as it would there;
  for MPS it refuses float64 and pinned memory, as MPS does;
* CPU autocast, whose rules for elementwise products are the GPU's: the dtypes attention sees.
"""

import contextlib

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_run_config
from simulated_device import SimulatedDevice

import nanolm.checkpoint as ckpt
import nanolm.machine.runtime as runtime
from nanolm.batches import Batch, pack_windows
from nanolm.errors import NanolmError
from nanolm.evaluate import estimate_loss
from nanolm.machine.device import refuse_what_the_device_cannot_do
from nanolm.machine.runtime import configure_tf32, settings_restored
from nanolm.optim import build_optimizer
from nanolm.precision import resolve_precision
from nanolm.step import StepSetup, train_step
from nanolm.watch.guards import nan_origin
from nanolm.watch.stats import LayerStats, probe

V = 64


def packed_batch(seed=0, rows=2, seq_len=32) -> Batch:
    """Windows packed with several short documents (EOS = 0 opens each), so the mask matters."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, V, size=rows * (seq_len + 1) * 2).astype(np.uint16)
    tokens[rng.choice(len(tokens), size=len(tokens) // 8, replace=False)] = 0
    starts = np.arange(rows) * (seq_len + 1)
    return pack_windows(tokens, starts, seq_len, eos_id=0, doc_mask=True)


def token_bytes():
    return torch.ones(V, dtype=torch.int64)


# ----------------------------------------------------------------------------- FlexAttention's forward on the CPU
@pytest.mark.kernels
def test_flex_block_mask_gives_the_same_evaluation_as_the_boolean_mask():
    flex, sdpa = tiny_model(attention="flex"), tiny_model(attention="sdpa")
    batches = [packed_batch(0), packed_batch(1)]
    a = estimate_loss(flex, batches, token_bytes())
    b = estimate_loss(sdpa, batches, token_bytes())
    assert a["tokens"] == b["tokens"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.kernels
def test_layer_statistics_take_their_attention_logits_under_a_flex_block_mask():
    flex, sdpa = tiny_model(attention="flex"), tiny_model(attention="sdpa")
    batch = packed_batch(2)
    assert flex.uses_flex_attention("cpu")  # the layers really receive a BlockMask
    with_flex, with_mask = probe(flex, batch), probe(sdpa, batch)
    for key in with_mask:
        torch.testing.assert_close(with_flex[key], with_mask[key], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- autocast: one dtype into attention
def test_rotary_step_hands_attention_q_k_and_v_in_one_dtype_under_autocast():
    model = tiny_model()
    x = torch.randn(2, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = model.blocks[0].attn.queries_keys_values(x, *model.rope(32, None))
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16  # FlexAttention refuses a mix


# ----------------------------------------------------------------------------- the model on a simulated GPU
def step_setup(model, **kw):
    return StepSetup(model, build_optimizer(model, 1e-3, 0.1), schedule=lambda step: 1e-3, **kw)


@pytest.mark.parametrize("device", ["cuda:0", "mps:0"])
def test_a_training_step_keeps_every_tensor_on_the_model_device(device):
    model = tiny_model()
    batches = [packed_batch(4), packed_batch(5)]  # on the host, as the loop holds them
    with SimulatedDevice(device) as gpu:
        gpu.move(model)
        result = train_step(step_setup(model), 1, batches)
        assert result.updated and result.loss.device == torch.device(device)
        assert all(gpu.holds(p) and p.grad is None for p in model.parameters())  # updated on the device, zeroed


@pytest.mark.parametrize("device", ["cuda:0", "mps:0"])
def test_evaluation_runs_on_the_device_without_float64(device):
    model = tiny_model()
    batches = [packed_batch(6), packed_batch(7)]
    expected = estimate_loss(model, batches, token_bytes())
    with SimulatedDevice(device) as gpu:  # an MPS simulation refuses float64
        gpu.move(model)
        result = estimate_loss(model, batches, token_bytes(), device=device)
    assert result == expected  # the sums are the same numbers, added in float64 on the host


def test_layer_statistics_run_on_the_device():
    model = tiny_model()
    batch = packed_batch(8)
    with SimulatedDevice("cuda:0") as gpu:
        gpu.move(model)
        stats = LayerStats(model, batch)
        train_step(step_setup(model, watch=lambda step, micro_batches: _Watch(stats)), 1, [batch])
        row = stats.after_update()
    assert row["attn_logit_max/0"] > 0 and 0 <= row["mlp_dead_frac/1"] <= 1


class _Watch:
    def __init__(self, stats):
        self.stats = stats

    def capture(self):
        self.stats.capture()


def test_the_nan_explanation_moves_the_host_batch_to_the_model():
    model = tiny_model()
    with torch.no_grad():
        model.blocks[1].attn.qkv.weight[0, 0] = float("inf")
    with SimulatedDevice("cuda:0") as gpu:
        gpu.move(model)
        report = nan_origin(model, packed_batch(9), contextlib.nullcontext, V)
    assert report["origin"].startswith("the output of blocks.1")


def test_a_checkpoint_saves_and_restores_a_model_on_the_device(tmp_path, monkeypatch):
    cuda_state = torch.arange(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: cuda_state.clone())
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: restored.append(state))
    model, copy = tiny_model(seed=1), tiny_model(seed=2)
    from nanolm.distributed import Distributed
    from nanolm.tokenizer import train_char

    tokenizer = train_char(["abcdef"])
    with SimulatedDevice("cuda:0") as gpu:
        gpu.move(model), gpu.move(copy)
        dist = Distributed("none", torch.device("cuda:0"))
        optimizer = build_optimizer(model, 1e-3, 0.1)
        path = ckpt.save_run_checkpoint(dist, tmp_path, 1, model, optimizer, {"step": 1}, "", tokenizer)
        state = ckpt.load_state(path)
        ckpt.load_run_checkpoint(dist, path, state, copy, build_optimizer(copy, 1e-3, 0.1))
        assert all(gpu.holds(p) for p in copy.parameters())
    for a, b in zip(model.parameters(), copy.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(state["rng"]["cuda"], cuda_state) and torch.equal(restored[0], cuda_state)


# ----------------------------------------------------------------------------- the real loop on a simulated GPU
def simulated_machine(kind: str, monkeypatch) -> str:
    """Make this CPU-only PyTorch say it has one GPU of ``kind`` (its queries answered, its
    generators on the host); returns the device to train on."""
    real_generator = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device=None: real_generator())  # sampling's seeded generator
    if kind == "mps":
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
        monkeypatch.setattr(torch.mps, "get_rng_state", lambda: torch.zeros(16, dtype=torch.uint8))
        monkeypatch.setattr(torch.mps, "set_rng_state", lambda state: None)
        return "mps:0"
    for name, answer in (
        ("is_available", lambda: True),
        ("device_count", lambda: 1),
        ("get_device_capability", lambda device=None: (7, 0)),
        ("get_device_name", lambda device=None: "Tesla V100-SXM2-16GB"),
        ("reset_peak_memory_stats", lambda device=None: None),
        ("max_memory_allocated", lambda device=None: 0),
        ("mem_get_info", lambda device=None: (16 << 30, 16 << 30)),
        ("get_rng_state", lambda device=None: torch.zeros(16, dtype=torch.uint8)),
        ("set_rng_state", lambda state, device=None: None),
        # the optimizers' check for a CUDA graph being captured (on a CUDA build of torch)
        ("is_current_stream_capturing", lambda: False),
    ):
        monkeypatch.setattr(torch.cuda, name, answer)
    return "cuda:0"


@pytest.mark.kernels
@pytest.mark.parametrize("kind", ["cuda", "mps"])
def test_the_training_loop_runs_on_a_gpu_with_the_numbers_of_the_cpu(kind, tmp_path, stories_file, monkeypatch):
    """The real ``train()``: evaluation, per-layer statistics, checkpoints, a NaN rolled back, a
    resume, the sample at the end, then ``nanolm replay`` of a step: every tensor on the device
    (no float64 on MPS), and, the arithmetic being the CPU's, the CPU run's numbers exactly."""
    from nanolm.instruments.faults import factories as fault_factories
    from nanolm.instruments.replay import replay
    from nanolm.train import train
    from nanolm.watch.sinks import read_metrics

    def run(device, out, steps):
        cfg = tiny_run_config(
            stories_file,
            out,
            steps=steps,
            device=device,
            precision="fp32",
            eval_every=2,
            stats_every=3,
            threads=1,
            deterministic=kind == "cuda",
            sample_tokens=8,
        )
        cfg.debug.inject_nan_at = 3  # rolled back to the checkpoint of step 2
        return train(cfg, log=lambda *_: None, factories=fault_factories(cfg))

    run("cpu", tmp_path / "cpu", 8)
    reference = run("cpu", tmp_path / "cpu", 10)  # two more steps: a resume
    device = simulated_machine(kind, monkeypatch)
    with SimulatedDevice(device):
        run(device, tmp_path / "gpu", 8)
        result = run(device, tmp_path / "gpu", 10)
        replayed = replay(tmp_path / "gpu", 7, device=device, log=lambda *_: None)

    def losses(run):
        return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(tmp_path / run / "metrics.jsonl")]

    if kind == "cuda":
        assert losses("gpu") == losses("cpu") and result["sample"] == reference["sample"]
    else:  # MPS: AdamW without its fused kernel (CUDA and CPU only), which rounds the last bits differently
        flat = lambda rows: [v for row in rows for v in row if v is not None]  # noqa: E731
        assert flat(losses("gpu")) == pytest.approx(flat(losses("cpu")), rel=1e-5)
    assert replayed["matches_the_log"]
    events = (tmp_path / "gpu" / "events.jsonl").read_text()
    assert '"action": "rollback"' in events and '"kind": "resume"' in events


# ----------------------------------------------------------------------------- random state: the run's device only
def test_a_cpu_run_saves_no_cuda_random_state_and_never_touches_cuda(monkeypatch):
    def no_cuda(*a, **k):
        raise AssertionError("a CPU run touched CUDA (and would start a context on a GPU machine)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    for name in ("get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all", "device_count"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    state = runtime.capture_rng(torch.device("cpu"))
    assert "cuda" not in state
    runtime.restore_rng(state, torch.device("cpu"))


def test_a_checkpoint_from_a_machine_with_more_gpus_resumes_on_one(monkeypatch):
    """A state per visible GPU (as checkpoints kept before) is read for the run's own GPU only."""
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: set_to.append((state, device)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    state = runtime.capture_rng(torch.device("cpu"))
    per_gpu = [torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8)]
    runtime.restore_rng({**state, "cuda": per_gpu}, torch.device("cuda:0"))
    assert torch.equal(set_to[0][0], per_gpu[0])


# ----------------------------------------------------------------------------- what a device picks and refuses
def test_auto_precision_is_fp16_with_loss_scaling_on_a_gpu_without_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_precision("auto", torch.device("cuda:0")).name == "fp16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision("auto", torch.device("cuda:0")).name == "bf16"
    assert resolve_precision("auto", torch.device("mps")).name == "fp32"


def test_what_a_device_cannot_do_is_refused_in_one_line(monkeypatch):
    with pytest.raises(NanolmError, match="--deterministic.*MPS"):
        refuse_what_the_device_cannot_do(torch.device("mps"), deterministic=True, compile=False, attention="auto")
    monkeypatch.setattr("nanolm.machine.device.has_triton", lambda: False)
    with pytest.raises(NanolmError, match="--compile.*Triton"):
        refuse_what_the_device_cannot_do(torch.device("cuda:0"), deterministic=False, compile=True, attention="auto")
    with pytest.raises(NanolmError, match="flex.*Triton"):
        refuse_what_the_device_cannot_do(torch.device("cuda:0"), deterministic=False, compile=False, attention="flex")
    monkeypatch.setattr("nanolm.machine.device.has_cpp_compiler", lambda: False)
    with pytest.raises(NanolmError, match="C\\+\\+ compiler"):
        refuse_what_the_device_cannot_do(torch.device("cpu"), deterministic=False, compile=True, attention="auto")


def test_deterministic_on_mps_is_refused_before_anything_is_written(tmp_path, monkeypatch, stories_file):
    from nanolm.train import train

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    cfg = tiny_run_config(stories_file, tmp_path / "run", device="mps", deterministic=True, steps=2)
    with pytest.raises(NanolmError, match="--deterministic"):
        train(cfg, log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_tf32_is_used_for_fp32_products_on_ampere_and_put_back_after_the_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    before = torch.get_float32_matmul_precision()
    with settings_restored():
        assert configure_tf32(torch.device("cuda:0"), "fp32", allowed=True)
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before
    assert configure_tf32(torch.device("cuda:0"), "fp32", allowed=False) is None  # --no-tf32
    assert configure_tf32(torch.device("cuda:0"), "bf16", allowed=True) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert configure_tf32(torch.device("cuda:0"), "fp32", allowed=True) is None


def test_a_run_called_from_python_leaves_determinism_threads_and_random_generators_as_it_found_them(
    tmp_path, stories_file
):
    """A notebook's own random draws after ``train()`` continue as if the run had not seeded and
    drawn from the generators."""
    import random

    import numpy as np

    from nanolm.train import train

    def draws():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    threads = torch.get_num_threads()
    assert not torch.are_deterministic_algorithms_enabled()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    expected = draws()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    train(
        tiny_run_config(stories_file, tmp_path / "run", steps=2, deterministic=True, threads=1, eval_every=2),
        log=lambda *_: None,
    )
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == threads
    assert draws() == expected


def test_batches_are_pinned_for_cuda_only():
    """Host batches go to CUDA through pinned memory; a batch already on the GPU (a benchmark's,
    or a user's who calls ``train_step`` with device batches) moves without pinning, which CUDA
    refuses for a device tensor."""
    batch = packed_batch(10)  # idx, targets, loss_mask, doc_ids (no positions)
    with SimulatedDevice("cuda:0") as gpu:
        moved = batch.to("cuda:0")
        assert gpu.pinned == 4 and gpu.holds(moved.idx) and gpu.holds(moved.doc_ids)
        again = moved.to("cuda:0")
        assert gpu.pinned == 4 and gpu.holds(again.idx) and torch.equal(again.targets.cpu(), batch.targets)
    with SimulatedDevice("mps:0") as mac:  # refuses pin_memory: Apple GPUs share memory with the CPU
        moved = batch.to("mps:0")
        assert mac.pinned == 0 and mac.holds(moved.idx)


def test_out_of_memory_on_mps_is_one_line_not_a_traceback(tmp_path, stories_file):
    from nanolm.step import summed_token_loss
    from nanolm.train import Factories, train

    def runs_out_of_memory(model, batch):
        raise RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.2 GB)")

    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=2, eval_at_start=False)
    with pytest.raises(NanolmError, match="out of memory on cpu.*lower --batch-size"):
        train(cfg, log=lambda *_: None, factories=Factories(loss_fn=runs_out_of_memory))
    assert summed_token_loss  # the real one is untouched


def test_a_failing_rank_leaves_the_process_group_without_waiting_at_a_barrier(monkeypatch):
    import torch.distributed as dist

    from nanolm import distributed

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    monkeypatch.setattr(distributed, "setup", lambda mode, device: distributed.Distributed("ddp", device, 1, 2, 1))
    with pytest.raises(NanolmError):
        with distributed.launch("ddp", torch.device("cpu")):
            raise NanolmError("out of memory on cuda:1")
    assert calls == ["destroy"]  # the other ranks sit in a collective: a barrier here would never return
    calls.clear()
    with distributed.launch("ddp", torch.device("cpu")):
        pass
    assert calls == ["barrier", "destroy"]


def test_under_torchrun_a_named_gpu_other_than_local_rank_is_refused(monkeypatch):
    from nanolm import distributed

    monkeypatch.setenv("RANK", "0"), monkeypatch.setenv("WORLD_SIZE", "1"), monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("joined with the wrong GPU")
    )
    with pytest.raises(NanolmError, match="LOCAL_RANK"):
        distributed.setup("ddp", torch.device("cuda:1"))


def test_the_cpu_bf16_peak_behind_mfu_is_timed_on_products_large_enough_to_reach_it(monkeypatch):
    """Native bf16 timed on 128 x 128 products reads ~6x below its peak (docs/benchmarks.md), and a
    tiny model then logs an MFU of 70-94 %. A CPU that emulates bf16 may keep small products."""
    from nanolm.machine.hardware import measure_matmul_flops

    shapes, real_randn = [], torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, **kw: shapes.append(shape) or real_randn(*shape, **kw))
    monkeypatch.setattr("nanolm.machine.hardware.cpu_has_native_bf16", lambda: True)
    measure_matmul_flops.cache_clear()
    try:
        measure_matmul_flops("cpu", torch.bfloat16, seconds=0.01)
    finally:
        measure_matmul_flops.cache_clear()
    assert min(shapes[0]) >= 512


def test_a_cpus_matmul_peak_is_measured_once_per_machine_thread_count_and_format_and_kept(monkeypatch, tmp_path):
    """The peak behind MFU is measured once and read back by every later run (no 0.3 s at each
    start, and no MFU read against a peak taken in a busy moment); another thread count or number
    format is another peak; a damaged or unwritable cache is measured around, never an error."""
    from nanolm.machine import hardware

    measured = []
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda device, dtype, seconds: measured.append(dtype) or 1e11)
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    try:
        assert hardware.peak_flops(torch.device("cpu"), torch.float32)[0] == 1e11 and len(measured) == 1
        flops, source = hardware.peak_flops(torch.device("cpu"), torch.float32)
        assert (flops, len(measured)) == (1e11, 1) and "as measured on this CPU before" in source
        hardware.peak_flops(torch.device("cpu"), torch.bfloat16)
        torch.set_num_threads(threads + 1)
        hardware.peak_flops(torch.device("cpu"), torch.float32)
        assert len(measured) == 3, "one measurement per format and per thread count"
    finally:
        torch.set_num_threads(threads)
    (tmp_path / "cache" / hardware.PEAKS_FILE).write_text("{not json")
    assert hardware.peak_flops(torch.device("cpu"), torch.float32)[0] == 1e11 and len(measured) == 4
    assert hardware.peak_flops(torch.device("cpu"), torch.float32)[1].endswith("as measured on this CPU before")
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache" / hardware.PEAKS_FILE / "below-a-file"))
    assert hardware.peak_flops(torch.device("cpu"), torch.float32)[0] == 1e11 and len(measured) == 5


def test_doctor_says_what_this_machine_would_pick_and_refuses_what_it_cannot_do(monkeypatch):
    from nanolm.instruments.doctor import device_choices

    lines = device_choices("cpu", "auto", "auto", tf32=True, deterministic=False, compile=False)
    assert [line.split()[0] for line in lines] == ["device", "precision", "attention", "batches"]
    assert "auto:" in lines[1] and "SDPA" in lines[2]
    for name, answer in (
        ("is_available", lambda: True),
        ("device_count", lambda: 1),
        ("get_device_capability", lambda device=None: (8, 0)),
        ("get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB"),
        ("is_bf16_supported", lambda including_emulation=True: True),
    ):
        monkeypatch.setattr(torch.cuda, name, answer)
    monkeypatch.setattr("nanolm.machine.device.has_triton", lambda: True)
    lines = device_choices("cuda:0", "fp32", "auto", tf32=True, deterministic=False, compile=False)
    assert "A100" in lines[0] and "FlexAttention" in lines[2] and lines[3].startswith("tf32       on")
    assert "pinned" in lines[4]
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with pytest.raises(NanolmError, match="--deterministic"):
        device_choices("mps", "auto", "auto", tf32=True, deterministic=True, compile=False)
