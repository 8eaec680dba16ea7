"""What each GPU can do, from the vendors' data sheets: one table for MFU and for ``nanolm plan``.

MFU is only comparable when the peak matches the arithmetic in use: bf16 work against the
bf16 tensor-core peak, fp16 against fp16's, fp32 against the TF32 peak when TF32 products
are on and against plain fp32 otherwise. Every figure is dense (no 2:4 sparsity), per GPU,
in FLOP/s; None means the GPU has no such units (a T4 or V100 has fp16 tensor cores but no
bf16 or TF32 ones, so a "bf16" run there is emulated and slow).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


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
