"""The numbers to watch while a model trains: per step, and per layer every few steps.

A loss curve tells you something went wrong after it went wrong. The numbers here tend to
move first: a gradient norm that is clipped on most steps, an update that is large next to
the weight it changes, attention logits that keep growing until the softmax saturates, MLP
units that stopped firing for good. ``docs/observability.md`` shows what each looks like
when it is healthy and when it is not.

Two rhythms, two costs:

* **Every logged step** (:class:`StepMeter`): loss, learning rate, gradient norm, whether
  the step was clipped, throughput, MFU, elapsed time and ETA, memory. The loss and the
  gradient norm live on the accelerator; reading them waits for it to finish its queued
  work (a host sync). The meter reads everything it needs in *one* transfer, on logged
  steps only; between logs it only adds to a counter that stays on the device.
* **Every K steps** (:class:`LayerStats`, ``--stats-every K``): per-layer weight norm,
  gradient norm and update-to-weight ratio, and a probe forward pass (no gradients, eval
  mode, one micro-batch) that records the largest attention logit, the fraction of dead
  MLP units and the RMS of the residual stream after each block. This costs roughly a
  third of a step once every K steps; ``benchmarks/observe_overhead.py`` measures it.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
import time
from functools import lru_cache

import torch
import torch.nn as nn

from .hardware import find_gpu
from .model import document_causal_mask
from .precision import cpu_has_native_bf16

def gpu_peak_flops(name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Peak FLOP/s of the GPU called ``name`` for matmuls in ``dtype``; None if unknown
    (``nanolm.hardware`` says which peak goes with which arithmetic)."""
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
    another process held a core reads low, so :class:`StepMeter` raises it to any throughput
    the run itself achieves above it (an MFU never reads above 100 %).
    """
    # 512 x 512 reaches a CPU's peak; a CPU that emulates bf16 (~1 GFLOP/s) gets 128 x 128, which
    # measures its (slow) rate as well in 1/64 of the time. Native bf16 timed on 128 x 128 read
    # ~6x below its peak, and MFU figures above 70 % for a tiny model.
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


def peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, declared: float = 0.0) -> tuple[float | None, str]:
    """The peak FLOP/s that MFU is measured against, and where the figure comes from.

    Order: a declared value (``--peak-flops``) wins; a CUDA GPU is looked up in
    :data:`nanolm.hardware.GPUS`; a CPU is measured (:func:`measure_matmul_flops`). Anything else
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
        return measure_matmul_flops("cpu", dtype), f"measured {str(dtype).removeprefix('torch.')} matmul on this CPU"
    return None, f"no peak known for {device.type}: declare --peak-flops for MFU"


def process_rss_mb() -> float:
    """Resident memory of this process in MiB (current on Linux; the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


class StepMeter:
    """The figures of every logged step, read from the device in one transfer.

    ``count_clipped`` runs every step and stays on the device; ``row`` runs on logged
    steps: one ``tolist()`` brings back the loss, the gradient norm and the number of clipped
    steps together. Throughput is measured over the window since the previous :meth:`lap`,
    which the loop calls after logging (and evaluating), so evaluation time is not counted
    as training time. Elapsed time and ETA include everything.
    """

    def __init__(self, total_steps: int, tokens_per_step: int, flops_per_token: int, peak: float | None,
                 clip: float, device: torch.device, start_step: int = 0, clipped_steps: int = 0,
                 elapsed_s: float = 0.0, host_values: bool = False):
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.flops_per_token, self.peak, self.clip = flops_per_token, peak, clip
        self.device = torch.device(device)
        # With a guard that reads every step's loss and norm (``host_values``), the count lives
        # on the host; otherwise on the device, so that counting needs no read.
        self.host_values = host_values
        self.set_clipped_steps(clipped_steps)
        self.started = time.perf_counter()
        self.elapsed_before = elapsed_s  # time spent by the processes this run resumed from
        self.start_step = start_step
        self.last_time, self.last_step = self.started, start_step
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def set_clipped_steps(self, count: int) -> None:
        """Start counting from ``count`` clipped steps (a resume, or a rollback to a checkpoint)."""
        self.clipped_steps = float(count) if self.host_values else torch.tensor(float(count), device=self.device)

    def count_clipped(self, grad_norm: torch.Tensor) -> None:
        """Add this step to the count of clipped steps (no host sync)."""
        if self.clip > 0 and self.host_values:
            self.clipped_steps += float(grad_norm > self.clip)
        elif self.clip > 0:
            self.clipped_steps += (grad_norm > self.clip).to(self.clipped_steps.dtype)

    def row(self, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor) -> dict:
        if self.host_values:
            loss_v, norm_v, clipped_v = float(loss), float(grad_norm), self.clipped_steps
        else:
            loss_v, norm_v, clipped_v = torch.stack(
                [loss.detach().float(), grad_norm.detach().float().to(loss.device), self.clipped_steps.to(loss.device)]
            ).tolist()
        now = time.perf_counter()
        tokens_per_sec = (step - self.last_step) * self.tokens_per_step / max(now - self.last_time, 1e-9)
        this_process = now - self.started
        row = {
            "step": step,
            "loss": loss_v,
            "lr": lr,
            "grad_norm": norm_v,
            "clipped": self.clip > 0 and norm_v > self.clip,
            "clipped_steps": int(clipped_v),
            "clipped_frac": clipped_v / max(step, 1),
            "tokens_per_sec": tokens_per_sec,
        }
        if self.peak:
            achieved = tokens_per_sec * self.flops_per_token
            if achieved > self.peak:  # the peak was measured low (a busy CPU at start-up): it is the
                self.peak = achieved  # most this machine has been seen to do, so it rises to this
                row["peak_flops"] = achieved
            row["mfu"] = achieved / self.peak
        row["elapsed_s"] = self.elapsed_before + this_process
        row["eta_s"] = this_process / max(step - self.start_step, 1) * (self.total_steps - step)
        row["rss_mb"] = process_rss_mb()
        if self.device.type == "cuda":
            row["cuda_max_alloc_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return row

    def elapsed(self) -> float:
        """Seconds of training so far, over every process of a resumed run."""
        return self.elapsed_before + time.perf_counter() - self.started

    def lap(self, step: int) -> None:
        """Start the next throughput window here."""
        self.last_time, self.last_step = time.perf_counter(), step

    def constants(self) -> dict:
        """The run's fixed figures, recorded once in the step-0 row."""
        return {"tokens_per_step": self.tokens_per_step, "flops_per_token": self.flops_per_token,
                "peak_flops": self.peak}


def is_stats_step(step: int, every: int) -> bool:
    """Per-layer statistics after step 1 (the first update is telling) and every ``every``."""
    return every > 0 and (step == 1 or step % every == 0)


def layer_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Parameters grouped the way one reads a transformer: embedding, block 0…n-1, the rest.

    Names: ``embed`` (the input embedding, and the output head too when tied), ``0``,
    ``1``… (everything inside ``blocks[i]``: attention, MLP and both norms), ``head`` (an
    untied output head) and ``final_norm``. Every parameter is in exactly one group, so
    the group norms combine in quadrature to the global norm.
    """
    groups: dict[str, list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        key = parts[1] if parts[0] == "blocks" else {"lm_head": "head", "norm": "final_norm"}.get(parts[0], parts[0])
        groups.setdefault(key, []).append(p)
    return groups


def _group_norms(tensors: list[torch.Tensor], group_of: torch.Tensor, n_groups: int) -> torch.Tensor:
    """L2 norm per group of a list of tensors, computed in fp32, kept on the device."""
    squares = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square()
    return torch.zeros(n_groups, device=squares.device).index_add_(0, group_of, squares).sqrt()


class LayerStats:
    """Per-layer statistics of one optimizer step: :meth:`capture` before clipping, read after the update.

    :meth:`capture`, called after the last backward pass (and after unscaling the gradients,
    with a loss scaler) but *before* clipping, records each group's weight norm ‖w‖ and
    gradient norm ‖g‖ (the gradient as computed, like the logged global ``grad_norm``), keeps
    a copy of the weights, and runs :func:`probe` on ``probe_batch``. :meth:`after_update`
    then measures how far the optimizer moved each group, ‖Δw‖ / ‖w‖, and returns every
    figure as ``name/group`` keys for the metrics row, read from the device in one transfer.

    The ratio ‖Δw‖/‖w‖ is the learning rate as the weights feel it: with AdamW, 1e-3 to a
    few 1e-2 per step; a layer far above its neighbours is being rewritten every few steps,
    one near zero has stopped learning. The weight copy costs one model's worth of memory, on
    statistics steps only.
    """

    def __init__(self, model: nn.Module, probe_batch=None, autocast=contextlib.nullcontext):
        self.model, self.probe_batch, self.autocast = model, probe_batch, autocast

    def capture(self) -> "LayerStats":
        model, probe_batch, autocast = self.model, self.probe_batch, self.autocast
        groups = layer_groups(model)
        self.names = list(groups)
        self.params = [p for ps in groups.values() for p in ps]
        device = self.params[0].device
        self.group_of = torch.tensor([i for i, ps in enumerate(groups.values()) for _ in ps], device=device)
        n = len(self.names)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        with torch.no_grad():
            self.weight_norm = _group_norms(self.params, self.group_of, n)
            self.grad_norm = _group_norms(grads, self.group_of, n)
            self.before = [p.detach().to(torch.float32, copy=True) for p in self.params]
        with autocast():  # the probe sees the model as training does (bf16 weights need it)
            self.probed = probe(model, probe_batch) if probe_batch is not None else {}
        return self

    @torch.no_grad()
    def after_update(self) -> dict:
        torch._foreach_sub_(self.before, [p.detach().float() for p in self.params])
        update = _group_norms(self.before, self.group_of, len(self.names))
        self.before = []
        ratio = update / self.weight_norm.clamp_min(1e-12)
        figures = {"weight_norm": self.weight_norm, "grad_norm": self.grad_norm, "update_ratio": ratio}
        names = {k: self.names for k in figures}
        for key, values in self.probed.items():
            figures[key] = values
            names[key] = [str(i) for i in range(len(values))]
        keys = list(figures)
        flat = torch.cat([figures[k].float().to(ratio.device) for k in keys]).tolist()
        row, i = {}, 0
        for key in keys:
            for name in names[key]:
                row[f"{key}/{name}"] = flat[i]
                i += 1
        return row


def max_attention_logit(attn, x: torch.Tensor, cos, sin, mask: torch.Tensor | None = None,
                        max_scores: int = 2**24) -> torch.Tensor:
    """The largest logit ``q·k / sqrt(head_dim)`` that attention ``attn`` lets through for input ``x``.

    Recomputed from the layer's own :meth:`~nanolm.model.Attention.queries_keys_values`
    (QK-norm and RoPE included) and taken over the allowed (query, key) pairs only: causal,
    and within one document when ``mask`` is given. These logits are what the softmax
    exponentiates; when their maximum keeps growing, attention collapses onto single keys
    and the softmax's gradient vanishes, the instability QK-norm was invented to prevent.
    A few sequences at a time, so the score matrices never hold more than ``max_scores``
    numbers (64 MiB in fp32 by default), however long the context.
    """
    q, k, _ = attn.queries_keys_values(x, cos, sin)
    B, H, T, D = q.shape
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    best = torch.full((), -math.inf, device=x.device)
    rows = max(1, max_scores // (H * T * T))
    for b in range(0, B, rows):
        scores = (q[b : b + rows].float() @ k[b : b + rows].float().transpose(-2, -1)) / math.sqrt(D)
        allowed = causal if mask is None else mask[b : b + rows] & causal
        best = torch.maximum(best, scores.masked_fill(~allowed, -math.inf).max())
    return best


def _unit_pre_activations(mlp) -> nn.Linear:
    """The linear layer whose output decides whether an MLP unit is open: SwiGLU's gate, GELU's input."""
    return mlp.gate if mlp.kind == "swiglu" else mlp.up


@torch.no_grad()
def probe(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """One forward pass over ``batch`` (eval mode, no gradients) with eyes on every block.

    Returns, per block, on the device:

    * ``attn_logit_max``: :func:`max_attention_logit` of its attention;
    * ``mlp_dead_frac``: the fraction of MLP hidden units that are never *open* on any
      token of the batch. A unit is open on a token when its pre-activation (SwiGLU's gate,
      GELU's input) is positive, the half of the nonlinearity that passes signal. A unit shut
      on every one of B×T tokens contributes almost nothing and, with a near-zero gradient,
      rarely recovers: capacity the model paid for and lost;
    * ``act_rms``: the root-mean-square of the residual stream leaving the block. Pre-norm
      blocks add to the stream without rescaling it, so it grows with depth; a block whose
      RMS explodes relative to its neighbours is where a divergence starts.

    Eval mode makes the probe consume no random numbers (no dropout), so watching a run
    does not change it.
    """
    blocks = list(model.blocks)
    logit_max, act_rms, open_units = {}, {}, {}
    hooks = []

    def watch(i, block):
        def on_attention(module, args, output):
            x, cos, sin = args[:3]
            logit_max[i] = max_attention_logit(module, x, cos, sin, allowed)

        def on_pre_activation(module, args, output):
            open_units[i] = (output > 0).flatten(0, -2).any(dim=0)

        def on_block(module, args, output):
            act_rms[i] = output.float().square().mean().sqrt()

        hooks.append(block.attn.register_forward_hook(on_attention))
        hooks.append(_unit_pre_activations(block.mlp).register_forward_hook(on_pre_activation))
        hooks.append(block.register_forward_hook(on_block))

    device = next(model.parameters()).device
    batch = batch.to(device)
    # The layers may receive the document mask as a FlexAttention BlockMask (a description of
    # tiles, not a tensor); the logits are taken over the same pairs, as a boolean tensor.
    allowed = document_causal_mask(batch.doc_ids) if batch.doc_ids is not None else None
    for i, block in enumerate(blocks):
        watch(i, block)
    was_training = model.training
    model.eval()
    try:
        model(batch.idx, doc_ids=batch.doc_ids, positions=batch.positions)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    n = range(len(blocks))
    return {
        "attn_logit_max": torch.stack([logit_max[i] for i in n]),
        "mlp_dead_frac": torch.stack([1 - open_units[i].float().mean() for i in n]),
        "act_rms": torch.stack([act_rms[i] for i in n]),
    }
