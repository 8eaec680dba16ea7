"""The device a run trains on: which one, what it can do, and what it cannot.

``--device auto`` picks a CUDA GPU, then an Apple GPU (MPS), then the CPU. What a device cannot
honour (deterministic kernels on MPS, ``--compile`` without its toolchain, FlexAttention off
CUDA) is refused here in one line, before anything is written, rather than met as an error
deep inside the first step. ``nanolm doctor`` prints what a run would pick and why
(``nanolm/instruments/doctor.py``).
"""

from __future__ import annotations

import os
import shutil

import torch

from ..errors import NanolmError


def resolve_device(name: str) -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; an explicit device must exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NanolmError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NanolmError(f"device {name!r} requested but no CUDA GPU is available; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise NanolmError(f"device {name!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise NanolmError("device 'mps' requested but MPS is not available; use --device cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise NanolmError(f"unsupported device {name!r}; use auto, cpu, cuda, cuda:N or mps")
    return device


def has_triton() -> bool:
    """Whether Triton is importable: torch.compile and FlexAttention need it on a CUDA GPU."""
    try:
        from torch.utils._triton import has_triton as triton_present
    except ImportError:  # pragma: no cover - older PyTorch
        return False
    return triton_present()


def has_cpp_compiler() -> bool:
    """Whether a C++ compiler is on the PATH: torch.compile's CPU code generator needs one."""
    return any(shutil.which(name) for name in (os.environ.get("CXX", "c++"), "g++", "clang++"))


def tf32_capable(device: torch.device) -> bool:
    """A CUDA GPU of the Ampere generation or later (compute capability 8.0+) has TF32 tensor cores."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def refuse_what_the_device_cannot_do(device: torch.device, deterministic: bool, compile: bool, attention: str) -> None:
    """One line naming the fix for a request this device cannot honour, before anything is written.

    PyTorch's own failures come later and less plainly: MPS has no deterministic version of
    several kernels (an error deep inside the first backward pass), torch.compile without
    its code generator's toolchain fails after a minute of tracing, and FlexAttention on a
    GPU is a Triton kernel.
    """
    if device.type == "mps" and deterministic:
        raise NanolmError(
            "--deterministic: PyTorch has no deterministic kernels for every operation on MPS; "
            "drop --deterministic, or use --device cpu for a bit-exact run"
        )
    if compile and device.type == "cuda" and not has_triton():
        raise NanolmError(
            "--compile on a CUDA GPU needs Triton, which this PyTorch lacks: pip install triton, or drop --compile"
        )
    if compile and device.type == "cpu" and not has_cpp_compiler():
        raise NanolmError(
            "--compile on the CPU needs a C++ compiler (g++ or clang++) on the PATH: install one, or drop --compile"
        )
    if attention == "flex" and device.type != "cuda":
        raise NanolmError("FlexAttention has no backward pass on CPU or MPS; use --attention sdpa (or auto)")
    if attention == "flex" and not has_triton():
        raise NanolmError(
            "--attention flex on a CUDA GPU needs Triton, which this PyTorch lacks: "
            "pip install triton, or use --attention sdpa (or auto)"
        )


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA raises ``torch.OutOfMemoryError``; MPS a plain RuntimeError ("MPS backend out of memory")."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
    )
