"""What the hardware can do: each GPU's data sheet (one table for MFU and for ``nanolm plan``),
and a CPU's matmul rate, measured; MFU is a run's throughput against this peak.

MFU is only comparable when the peak matches the arithmetic in use: bf16 work against the
bf16 tensor-core peak, fp16 against fp16's, fp32 against the TF32 peak when TF32 products
are on and against plain fp32 otherwise. Every figure is dense (no 2:4 sparsity), per GPU,
in FLOP/s; None means the GPU has no such units (a T4 or V100 has fp16 tensor cores but no
bf16 or TF32 ones, so a "bf16" run there is emulated and slow).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..precision import cpu_has_native_bf16


@dataclass(frozen=True)
class GPU:
    key: str  # the name ``nanolm plan --gpu`` takes
    name: str
    match: tuple[str, ...]  # every token must appear in torch.cuda.get_device_name()
    bf16: float | None
    fp16: float
    tf32: float | None
    fp32: float
    memory_gb: float

    @property
    def half_flops(self) -> float:
        """The fastest 16-bit peak: bf16 where the GPU has it, else fp16."""
        return self.bf16 or self.fp16

    def peak(self, dtype_name: str, tf32: bool = False) -> float | None:
        """Peak FLOP/s for matrix products in ``dtype_name`` (bf16, fp16 or fp32)."""
        if dtype_name == "bf16":
            return self.bf16
        if dtype_name == "fp16":
            return self.fp16
        return self.tf32 if tf32 else self.fp32


# More specific names first: "H100 NVL" before "H100", "A10G" is its own token and never an "A10".
GPUS: list[GPU] = [
    GPU("h100-pcie", "H100 PCIe 80GB", ("H100", "PCIe"), 756e12, 756e12, 378e12, 51.2e12, 80),
    GPU("h100-nvl", "H100 NVL 94GB", ("H100", "NVL"), 835.5e12, 835.5e12, 417.5e12, 60e12, 94),
    GPU("h200-nvl", "H200 NVL 141GB", ("H200", "NVL"), 835.5e12, 835.5e12, 417.5e12, 60e12, 141),
    GPU("gh200", "GH200 96GB", ("GH200",), 989.4e12, 989.4e12, 494.7e12, 67e12, 96),
    GPU("h200", "H200 SXM 141GB", ("H200",), 989.4e12, 989.4e12, 494.7e12, 66.9e12, 141),
    GPU("h100", "H100 SXM 80GB", ("H100",), 989.4e12, 989.4e12, 494.7e12, 66.9e12, 80),
    GPU("b200", "B200 180GB", ("B200",), 2250e12, 2250e12, 1100e12, 75e12, 180),
    GPU("a100-40gb", "A100 40GB", ("A100", "40GB"), 312e12, 312e12, 156e12, 19.5e12, 40),
    GPU("a100", "A100 80GB", ("A100",), 312e12, 312e12, 156e12, 19.5e12, 80),
    GPU("l40s", "L40S 48GB", ("L40S",), 362.05e12, 362.05e12, 183e12, 91.6e12, 48),
    GPU("l4", "L4 24GB", ("L4",), 121e12, 121e12, 60e12, 30.3e12, 24),
    GPU("a10g", "A10G 24GB", ("A10G",), 70e12, 70e12, 35e12, 31.2e12, 24),
    GPU("a10", "A10 24GB", ("A10",), 125e12, 125e12, 62.5e12, 31.2e12, 24),
    GPU("rtx4090", "RTX 4090 24GB", ("RTX", "4090"), 165.2e12, 165.2e12, 82.6e12, 82.6e12, 24),
    GPU("rtx3090", "RTX 3090 24GB", ("RTX", "3090"), 71e12, 71e12, 35.6e12, 35.6e12, 24),
    GPU("v100-pcie", "V100 PCIe 32GB", ("V100", "PCIE"), None, 112e12, None, 14e12, 32),
    GPU("v100", "V100 SXM2 32GB", ("V100",), None, 125e12, None, 15.7e12, 32),
    GPU("t4", "T4 16GB", ("T4",), None, 65e12, None, 8.1e12, 16),
    GPU("mi300x", "MI300X 192GB", ("MI300X",), 1307.4e12, 1307.4e12, 653.7e12, 163.4e12, 192),
]
BY_KEY = {gpu.key: gpu for gpu in GPUS}


def find_gpu(device_name: str) -> GPU | None:
    """The table's entry for a device called ``device_name`` (as CUDA reports it), or None."""
    tokens = set(re.findall(r"[A-Za-z0-9]+", device_name.upper()))
    return next((gpu for gpu in GPUS if all(k.upper() in tokens for k in gpu.match)), None)


def gpu_peak_flops(name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Peak FLOP/s of the GPU called ``name`` for matmuls in ``dtype``; None if unknown
    (``nanolm.machine.hardware`` says which peak goes with which arithmetic)."""
    gpu = find_gpu(name)
    if gpu is None:
        return None
    return gpu.peak({torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"), tf32)


@lru_cache(maxsize=None)
def measure_matmul_flops(device_type: str = "cpu", dtype: torch.dtype = torch.float32, seconds: float = 0.1) -> float:
    """FLOP/s of a square matmul on this machine: the best of repeated tries for ``seconds``.

    A CPU has no data-sheet figure we can look up, so MFU on CPU is measured against what a
    large matrix multiply achieves here, the most a transformer's matmuls could hope for.
    Measured once per process, keeping the fastest of many tries. On a machine shared with
    other jobs both this figure and the training throughput fluctuate: a peak measured while
    another process held a core reads low, so :class:`~nanolm.watch.meter.StepMeter` raises it to any throughput
    the run itself achieves above it (an MFU never reads above 100 %).
    """
    # 512 x 512 reaches a CPU's peak; a CPU that emulates bf16 (~1 GFLOP/s) gets 128 x 128, which
    # measures its (slow) rate as well in 1/64 of the time. Native bf16 timed on 128 x 128 reads far
    # below its peak (docs/benchmarks.md, "MFU's CPU peak"), and MFU too high.
    n = 512 if dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16()) else 128
    g = torch.Generator(device=device_type).manual_seed(0)  # never touch the run's random stream
    a = torch.randn(n, n, dtype=dtype, device=device_type, generator=g)
    b = torch.randn(n, n, dtype=dtype, device=device_type, generator=g)
    a @ b
    best = math.inf
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            return 2 * n**3 / max(best, 1e-9)


PEAKS_FILE = "cpu_peaks.json"
KEPT_MEASUREMENT_SECONDS = 0.3  # a kept figure is measured longer than a passing one: it serves every later run


def cpu_model() -> str:
    """The CPU's name as the system gives it (Linux's /proc/cpuinfo), or the platform's."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def kept_matmul_flops(dtype: torch.dtype, log=None) -> tuple[float, bool]:
    """This CPU's matmul rate in ``dtype`` at the current thread count and kernel path: measured once
    per machine (over 0.3 s) and kept in the cache (``$NANOLM_CACHE/cpu_peaks.json``), so that a
    run neither spends the measurement again nor reads its MFU against a figure taken in a busy
    moment of its own start-up. Returns (FLOP/s, whether it was read from the cache). A cache
    that cannot be read or written is measured around, as if there were none."""
    from ..base.documents import read_json
    from ..base.files import atomic_write_text, cache_dir
    from ..errors import NanolmError

    kernels, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    key = f"{cpu_model()} | {kernels} | {threads} threads | {dtype} | torch {torch.__version__}"
    path = cache_dir() / PEAKS_FILE
    try:
        peaks = read_json(path) if path.is_file() else {}
    except (NanolmError, OSError):
        peaks = {}
    peaks = peaks if isinstance(peaks, dict) else {}
    kept = peaks.get(key)
    if isinstance(kept, float) and math.isfinite(kept) and kept > 0:
        return kept, True
    measured = measure_matmul_flops("cpu", dtype, KEPT_MEASUREMENT_SECONDS)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({**peaks, key: measured}, indent=1))
    except (NanolmError, OSError):
        pass  # not kept: the next run measures again
    return measured, False


def peak_flops(
    device: torch.device, dtype: torch.dtype = torch.float32, declared: float = 0.0
) -> tuple[float | None, str]:
    """The peak FLOP/s that MFU is measured against, and where the figure comes from.

    Order: a declared value (``--peak-flops``) wins; a CUDA GPU is looked up in
    :data:`GPUS`; a CPU is measured once and kept (:func:`kept_matmul_flops`). Anything else
    (an unknown GPU, MPS) has no peak, and rows carry no ``mfu``.
    """
    if declared > 0:
        return declared, "declared (--peak-flops)"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
        peak = gpu_peak_flops(name, dtype, tf32)
        return peak, (f"data sheet of {name}" if peak else f"unknown GPU {name!r}: declare --peak-flops for MFU")
    if device.type == "cpu":
        flops, kept = kept_matmul_flops(dtype)
        how = "as measured on this CPU before" if kept else "measured on this CPU, kept for later runs"
        return flops, f"{str(dtype).removeprefix('torch.')} matmul {how}"
    return None, f"no peak known for {device.type}: declare --peak-flops for MFU"
