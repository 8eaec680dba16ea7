"""The numbers to watch per layer, every few steps: where a model goes wrong before its loss shows it.

A loss curve tells you something went wrong after it went wrong. The numbers here tend to
move first: a gradient norm that is clipped on most steps, an update that is large next to
the weight it changes, attention logits that keep growing until the softmax saturates, MLP
units that stopped firing for good. ``docs/observability.md`` shows what each looks like
when it is healthy and when it is not.

Every logged step has its figures from ``nanolm.watch.meter``; this file is the other rhythm:

* **Every K steps** (:class:`LayerStats`, ``--stats-every K``): per-layer weight norm,
  gradient norm and update-to-weight ratio, and a probe forward pass (no gradients, eval
  mode, one micro-batch) that records the largest attention logit, the fraction of dead
  MLP units and the RMS of the residual stream after each block. Its cost, once every K
  steps, is measured by ``benchmarks/observe_overhead.py`` (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from ..model import document_causal_mask


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


def max_attention_logit(
    attn, x: torch.Tensor, cos, sin, mask: torch.Tensor | None = None, max_scores: int = 2**24
) -> torch.Tensor:
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
