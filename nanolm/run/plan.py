"""Plan a run before launching it: parameters, FLOPs, memory per GPU, time to train.

Every figure is a formula over the model's shape, written out below and in
docs/distributed.md, so that a 7B run can be sized on the back of an envelope, and the
envelope checked by a program. The formulas count what nanolm's own GPT does (tests hold
them against a real ``GPT``: its parameter count, its ``flops_per_token()`` and the bytes
autograd actually saves in a forward pass).

Notation: L layers, d = n_embd, h = MLP hidden width, H heads, V vocabulary, T sequence
length, b sequences per GPU micro-batch, N parameters, G GPUs.

* **Parameters**: V·d (embedding) [+ V·d untied head] + L·(4d² + k·d·h + 2d) + d, with
  k = 3 for SwiGLU (gate, up, down) and 2 for GELU; QK-norm adds 2·d/H per layer.
* **Training FLOPs per token**: 6 per weight of every matrix multiply (forward 2, backward
  4), the output head included, the embedding lookup not; plus attention's own two matmuls,
  12·L·T·d (counted whole although causal attention could skip half, as PaLM, nanoGPT and
  torchtitan do, so that MFU compares across projects).
* **Model state per GPU**, in bytes: weights and gradients 4·N each (fp32 master weights
  under fp32, bf16 and fp16 autocast) or 2·N (bf16-pure); AdamW's two moments 8·N (fp32),
  plus 4·N for an fp32 master copy under ``bf16-pure --fp32-master``. FSDP divides all three
  by G; DDP keeps all of it on every GPU. Under bf16/fp16 autocast every matmul also keeps
  its 16-bit copy of the weight from the forward to the backward pass: 2·N, *not* divided
  by G (each FSDP block casts its gathered weights). FSDP also holds some weights whole:
  those of two blocks (the one computing and the one prefetched), of the root (embedding,
  head, final norm: gathered for the whole step) and one such unit's full gradient.
* **Activations**, bytes per token per layer (e = 2 under 16-bit autocast and bf16-pure,
  4 under fp32; the RMSNorms save fp32 whatever the precision):
  16d + 8 (two RMSNorms: input and normalised copy, plus 1/rms) + 7e·d + 4H (attention:
  the qkv input, q and k after RoPE, the qkv output, the attention output, the softmax
  statistics) + c·e·d + 4e·h (SwiGLU: c copies of its input, gate, up, silu(gate) and the
  product; GELU: 2e·h), where c = 2 under autocast (each matmul casts its own copy) and 1
  otherwise. Plus, once per token, the output: 8d + 4 + 4d + 8 (the final norm; the fp32
  gradient of the head's input, which the fused head and loss compute in the forward pass;
  the token ids). The logits are never held whole, so instead, once per micro-batch: the
  head's own fp32 gradient, 4·V·d, kept from the forward pass to the backward pass, and one
  chunk's buffers, r·(2e + 4)·V for r positions a chunk (its logits, their fp32 log-softmax
  and their gradient; r as ``loss_chunk_positions`` picks it on a GPU, or ``loss_chunk``).
  With activation checkpointing only each block's input (the residual stream, 4·d bytes,
  2·d under bf16-pure) is kept and one block at a time is recomputed during the backward
  pass: L·4d + (one layer) + (output).
* **Time**: FLOPs per token × tokens ÷ (G × peak bf16 FLOP/s × MFU).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import NanolmError
from ..fused_loss import loss_chunk_positions
from ..machine.hardware import BY_KEY as GPUS
from ..model import GPTConfig

# Shapes in nanolm's architecture (RoPE, RMSNorm, no biases). The GPT-2/3 sizes use GELU and
# a tied head; "7b"/"13b" follow Llama 2 (SwiGLU, untied), with nanolm's SwiGLU width rule
# (8d/3 rounded up to 32: 10944 for d = 4096 where Llama uses 11008), so 6.71B parameters
# where Llama 2 7B has 6.74B.
PRESETS = {
    "nanolm": dict(n_layer=4, n_head=4, n_embd=128, mlp="swiglu", vocab_size=512, seq_len=128, tie_embeddings=True),
    "124m": dict(n_layer=12, n_head=12, n_embd=768, mlp="gelu", vocab_size=50304, seq_len=1024, tie_embeddings=True),
    "350m": dict(n_layer=24, n_head=16, n_embd=1024, mlp="gelu", vocab_size=50304, seq_len=1024, tie_embeddings=True),
    "1.3b": dict(n_layer=24, n_head=16, n_embd=2048, mlp="gelu", vocab_size=50304, seq_len=2048, tie_embeddings=True),
    "7b": dict(n_layer=32, n_head=32, n_embd=4096, mlp="swiglu", vocab_size=32000, seq_len=4096, tie_embeddings=False),
    "13b": dict(n_layer=40, n_head=40, n_embd=5120, mlp="swiglu", vocab_size=32000, seq_len=4096, tie_embeddings=False),
}

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure")
AUTOCAST = ("bf16", "fp16")


def layer_parameters(c: GPTConfig) -> int:
    """Weights of one transformer block."""
    mlp = (3 if c.mlp == "swiglu" else 2) * c.n_embd * c.mlp_hidden
    qk_norm = 2 * c.head_dim if c.qk_norm else 0
    return 4 * c.n_embd**2 + mlp + 2 * c.n_embd + qk_norm


def count_parameters(c: GPTConfig) -> int:
    """N: embedding, blocks, final norm and (untied) output head; a tied matrix counts once."""
    head = 0 if c.tie_embeddings else c.vocab_size * c.n_embd
    return c.vocab_size * c.n_embd + c.n_layer * layer_parameters(c) + c.n_embd + head


def hidden_matrix_parameters(c: GPTConfig) -> int:
    """Weights of every block's matrices (qkv, proj and the MLP's): what ``--optimizer muon``
    gives to Muon (``nanolm.optim.split_for_muon``); the embedding, head and vectors stay with AdamW."""
    return c.n_layer * (4 * c.n_embd**2 + (3 if c.mlp == "swiglu" else 2) * c.n_embd * c.mlp_hidden)


def matmul_parameters(c: GPTConfig) -> int:
    """Weights that take part in a matrix multiply: every block's matrices and the head."""
    return hidden_matrix_parameters(c) + c.vocab_size * c.n_embd


def flops_per_token(c: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token: 6 × matmul weights + 12·L·T·d (attention scores and mix)."""
    return 6 * matmul_parameters(c) + 12 * c.n_layer * (seq_len or c.seq_len) * c.n_embd


def activation_bytes_per_token(c: GPTConfig, precision: str) -> tuple[int, int, int]:
    """(per layer, output head, per layer with activation checkpointing), bytes per token."""
    e = 4 if precision == "fp32" else 2
    d, h, H = c.n_embd, c.mlp_hidden, c.n_head
    casts = (2 if c.mlp == "swiglu" else 1) if precision in AUTOCAST else 1
    norms = 2 * (8 * d + 4)
    attention = 7 * e * d + 4 * H
    mlp = casts * e * d + (4 if c.mlp == "swiglu" else 2) * e * h
    qk_norm = (18 * d + 8 * H if e == 2 else 12 * d + 8 * H) if c.qk_norm else 0
    layer = norms + attention + mlp + qk_norm
    head = 8 * d + 4 + 4 * d + 8
    residual = (2 if precision == "bf16-pure" else 4) * d
    return layer, head, residual


def fused_head_bytes(c: GPTConfig, precision: str, tokens: int) -> int:
    """What the fused head and loss hold once per micro-batch of ``tokens`` positions: the
    head's fp32 gradient (from the forward pass to the backward pass) and one chunk's buffers."""
    e = 4 if precision == "fp32" else 2
    rows = min(tokens, c.loss_chunk or loss_chunk_positions(c.vocab_size, "cuda"))
    return 4 * c.vocab_size * c.n_embd + rows * (2 * e + 4) * c.vocab_size


def memory_per_gpu(
    c: GPTConfig,
    precision: str = "bf16",
    dist: str = "ddp",
    gpus: int = 1,
    micro_batch: int = 1,
    seq_len: int | None = None,
    fp32_master: bool = False,
    optimizer: str = "adamw",
) -> dict:
    """Bytes per GPU, by what holds them; activations with and without checkpointing.

    Optimizer state: AdamW keeps two fp32 moments (8 bytes a parameter); under ``muon`` the
    hidden matrices keep one fp32 momentum instead (4 bytes) and the rest AdamW's two."""
    if precision not in PRECISIONS:
        raise NanolmError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if dist not in ("none", "ddp", "fsdp"):
        raise NanolmError(f"dist must be none, ddp or fsdp, got {dist!r}")
    if fp32_master and precision != "bf16-pure":
        raise NanolmError("--fp32-master only applies to --precision bf16-pure")
    T = seq_len or c.seq_len
    n = count_parameters(c)
    shards = gpus if dist == "fsdp" else 1
    weight_bytes = 2 if precision == "bf16-pure" else 4
    optimizer_bytes = 8 + (4 if fp32_master else 0)
    muon = hidden_matrix_parameters(c) if optimizer == "muon" else 0
    layer, head, residual = activation_bytes_per_token(c, precision)
    tokens = micro_batch * T
    block, root = layer_parameters(c), n - c.n_layer * layer_parameters(c)
    rows = {
        "weights": weight_bytes * n / shards,
        "gradients": weight_bytes * n / shards,
        "optimizer": (optimizer_bytes * (n - muon) + (optimizer_bytes - 4) * muon) / shards,
        "autocast_weights": 2 * matmul_parameters(c) if precision in AUTOCAST else 0,
        "fsdp_gathered": (weight_bytes * (2 * block + root + max(block, root)) if dist == "fsdp" and gpus > 1 else 0),
        "activations": tokens * (c.n_layer * layer + head) + fused_head_bytes(c, precision, tokens),
        "activations_checkpointed": tokens * (c.n_layer * residual + layer + head)
        + fused_head_bytes(c, precision, tokens),
    }
    state = sum(v for k, v in rows.items() if not k.startswith("activations"))
    rows["total"] = state + rows["activations"]
    rows["total_checkpointed"] = state + rows["activations_checkpointed"]
    return rows


BATCH_BYTES_PER_TOKEN = 8 + 8 + 1 + 4 + 8
"""A batch held on the host (the fixed validation set, a step's micro-batches): ids and targets
(int64), the loss mask (bool), document ids (int32) and positions (int64)."""


def available_memory(device) -> tuple[float | None, str]:
    """Bytes this process may still allocate on ``device`` (None when unknown), and from where.

    CPU: the kernel's estimate of what can be allocated without swapping (``MemAvailable``),
    lowered by a container's memory limit (cgroup v2 or v1) when there is one. CUDA: the
    free memory the driver reports.
    """
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free on {device}"
    if device.type != "cpu":
        return None, ""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((float(line.split()[1]) * 1024, "available RAM"))
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                found.append((float(int(limit) - int(usage)), "left under the container's memory limit"))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else (None, "")


def check_memory(
    c: GPTConfig,
    precision: str,
    dist,
    batch_size: int,
    eval_windows: int,
    optimizer: str = "adamw",
    grad_accum: int = 1,
) -> None:
    """Refuse, before anything is written, a run whose step cannot fit in memory.

    The estimate is :func:`memory_per_gpu` (weights, gradients, optimizer state,
    activations) plus the fixed validation batches and the step's micro-batches, all
    ``grad_accum`` of them cut on the host before the step runs. It leaves out the allocator's slack and
    attention's score matrices on paths that materialise them, so it is a lower bound: what
    it refuses would certainly have failed, on a CPU by being killed (no error, no
    checkpoint) rather than by an exception.
    """
    import os

    device = dist.device
    available, source = available_memory(device)
    if available is None:
        return
    processes_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    rows = memory_per_gpu(
        c,
        precision,
        dist.mode if dist.mode != "none" else "none",
        dist.world_size,
        batch_size,
        c.seq_len,
        optimizer=optimizer,
    )
    step_batches = grad_accum * batch_size * c.seq_len * BATCH_BYTES_PER_TOKEN
    need = (rows["total"] + eval_windows * c.seq_len * BATCH_BYTES_PER_TOKEN + step_batches) * processes_here
    if step_batches > available:
        raise NanolmError(
            f"one step of --grad-accum {grad_accum} micro-batches of --batch-size {batch_size} × "
            f"--seq-len {c.seq_len} holds {_gb_text(step_batches)} of batches, but {device} has "
            f"{_gb_text(available)} {source}; lower --grad-accum"
        )
    if need > available:
        raise NanolmError(
            f"this run needs at least {_gb_text(need)} of memory (--batch-size {batch_size} × --seq-len "
            f"{c.seq_len}: activations {_gb_text(rows['activations'])}, validation batches "
            f"{_gb_text(eval_windows * c.seq_len * BATCH_BYTES_PER_TOKEN)}) but {device} has {_gb_text(available)} "
            f"{source}; lower --batch-size (raise --grad-accum for the same tokens per step) "
            f"or --eval-windows"
        )


def parse_count(text: str) -> float:
    """``2e9``, ``300M``, ``20B``, ``1.5T`` (tokens) as a number."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    s = str(text).strip().lower().replace("_", "")
    try:
        if s and s[-1] in scale:
            return float(s[:-1]) * scale[s[-1]]
        return float(s)
    except ValueError:
        raise NanolmError(f"not a count: {text!r} (use e.g. 2e9, 300M, 20B)") from None


def make_plan(
    c: GPTConfig,
    precision: str = "bf16",
    dist: str = "ddp",
    gpus: int = 1,
    gpu: str = "h100",
    micro_batch: int = 1,
    grad_accum: int = 1,
    seq_len: int | None = None,
    tokens: float = 0,
    mfu: float = 0.4,
    fp32_master: bool = False,
    optimizer: str = "adamw",
) -> dict:
    """Every figure of ``nanolm plan`` in one dict (bytes, FLOPs, seconds)."""
    if gpu not in GPUS:
        raise NanolmError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    if gpus < 1 or micro_batch < 1 or grad_accum < 1:
        raise NanolmError("--gpus, --batch-size and --grad-accum must be positive")
    if dist == "none" and gpus > 1:
        raise NanolmError("--dist none trains on one GPU; use --dist ddp or fsdp with --gpus > 1")
    if not 0 < mfu <= 1:
        raise NanolmError(f"--mfu is a fraction in (0, 1], got {mfu}")
    T = seq_len or c.seq_len
    spec = GPUS[gpu]
    fpt = flops_per_token(c, T)
    tokens_per_step = micro_batch * grad_accum * T * gpus
    peak = spec.peak({"bf16-pure": "bf16"}.get(precision, precision), tf32=True)  # fp32 on TF32 where it exists
    if peak is None:
        raise NanolmError(
            f"the {spec.name} has no {precision} tensor cores (it emulates bf16, slowly); "
            f"plan with --precision fp16 (or fp32)"
        )
    seconds = fpt * tokens / (gpus * peak * mfu) if tokens else 0.0
    return {
        "parameters": count_parameters(c),
        "parameters_non_embedding": count_parameters(c) - c.vocab_size * c.n_embd,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "attention_flops_per_token": 12 * c.n_layer * T * c.n_embd,
        "memory": memory_per_gpu(c, precision, dist, gpus, micro_batch, T, fp32_master, optimizer),
        "gpu": spec,
        "gpus": gpus,
        "tokens_per_step": tokens_per_step,
        "tokens": tokens,
        "steps": math.ceil(tokens / tokens_per_step) if tokens else 0,
        "seconds": seconds,
        "mfu": mfu,
        "setup": dict(
            precision=precision,
            dist=dist,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            seq_len=T,
            optimizer=optimizer,
        ),
    }


def _size(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _gb_text(n: float) -> str:
    return _gb(n).strip()


def _gb(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:8.2f} {unit}"
    return f"{n:8.0f} B "


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} seconds"
    if s < 3600:
        return f"{s / 60:.1f} minutes"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} hours"
    return f"{s / 86400:.1f} days"


def format_plan(p: dict, c: GPTConfig, name: str = "") -> str:
    s, m, spec = p["setup"], p["memory"], p["gpu"]
    lines = [
        f"model      {name + ': ' if name else ''}{c.n_layer} layers, {c.n_head} heads, n_embd {c.n_embd}, "
        f"{c.mlp} {c.mlp_hidden}, vocab {c.vocab_size}, {'tied' if c.tie_embeddings else 'untied'} head"
        f"{', qk-norm' if c.qk_norm else ''}, seq_len {s['seq_len']}",
        f"parameters {_size(p['parameters'])} ({p['parameters']:,}; {_size(p['parameters_non_embedding'])} "
        f"without the embedding)",
        f"FLOPs      {p['flops_per_token']:.3e} per token trained (6 × {_size(matmul_parameters(c))} matmul weights "
        f"+ attention {p['attention_flops_per_token']:.2e})",
        f"setup      {p['gpus']} × {spec.name}, --dist {s['dist']}, --precision {s['precision']}; per GPU "
        f"{s['micro_batch']} × {s['seq_len']} tokens per micro-batch, accumulation {s['grad_accum']}: "
        f"{p['tokens_per_step']:,} tokens per step",
        "",
        f"memory per GPU                        {'without AC':>11}   {'with AC':>11}",
    ]
    shard = f" ÷ {p['gpus']} GPUs" if s["dist"] == "fsdp" and p["gpus"] > 1 else ""
    wb = "bf16" if s["precision"] == "bf16-pure" else "fp32"
    rows = [
        (f"weights ({wb}{shard})", m["weights"], m["weights"]),
        (f"gradients ({wb}{shard})", m["gradients"], m["gradients"]),
        (
            f"{'Muon + AdamW' if s.get('optimizer') == 'muon' else 'AdamW'} state (fp32{shard})",
            m["optimizer"],
            m["optimizer"],
        ),
        ("16-bit weight copies (autocast)", m["autocast_weights"], m["autocast_weights"]),
        ("gathered blocks (FSDP)", m["fsdp_gathered"], m["fsdp_gathered"]),
        ("activations", m["activations"], m["activations_checkpointed"]),
    ]
    for label, a, b in rows:
        if a or b:
            lines.append(f"  {label:<34}{_gb(a)}   {_gb(b)}")
    lines.append(f"  {'total':<34}{_gb(m['total'])}   {_gb(m['total_checkpointed'])}")
    capacity = spec.memory_gb * 1e9
    verdict = (
        "fits"
        if m["total"] <= 0.9 * capacity
        else (
            "fits only with activation checkpointing" if m["total_checkpointed"] <= 0.9 * capacity else "does not fit"
        )
    )
    lines.append(f"  on a {spec.memory_gb:g} GB GPU (keeping 10% for the allocator and buffers): {verdict}")
    lines.append("  (activation checkpointing is a planning figure: nanolm train does not checkpoint activations yet)")
    if p["tokens"]:
        lines += [
            "",
            f"time       {_size(p['tokens'])} tokens in {p['steps']:,} steps at {p['mfu']:.0%} MFU: "
            f"{p['flops_per_token']:.3e} × {p['tokens']:.3g} / ({p['gpus']} × {p['peak_flops']:.3g} × "
            f"{p['mfu']:g}) = {p['seconds']:.3g} s = {_duration(p['seconds'])} "
            f"({p['seconds'] * p['gpus'] / 3600:,.0f} GPU-hours)",
        ]
    return "\n".join(lines)
