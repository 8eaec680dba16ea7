"""The optimizers (AdamW, or Muon for the hidden matrices beside AdamW for the rest; under
``--precision bf16-pure``, :class:`BF16AdamW`) and the parameters each one updates.
The learning rate each step sets is ``nanolm.step``'s schedule.

The last part of this file, :class:`GroupedMuon`, is only how Muon is made fast:
``torch.optim.Muon``'s update with the matrices of one shape orthogonalised together. PyTorch's
Muon runs its Newton-Schulz iteration one matrix at a time, and a small model's matrices are too
small for each product to use a CPU's matrix units well. The numbers are PyTorch's
(``tests/test_optim.py`` compares them step by step); the speed is measured by
``benchmarks/muon_step.py`` (docs/benchmarks.md)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .precision import rounding_seed, stochastic_round_to_bf16


def get_param_groups(model: nn.Module, weight_decay: float):
    """Split parameters into a decayed group and a non-decayed one.

    Weight decay pulls weights toward zero. That is a useful pressure on the matrices
    that mix features (attention and MLP projections, an untied output head), but not on:

    * norm gains: they are scale factors whose natural value is 1, not 0;
    * biases: they shift activations and hold little capacity to overfit;
    * embedding tables: a row only receives gradient when its token occurs, yet decay
      shrinks every row at every step, so rare tokens would be eroded toward zero.
      With tied embeddings the same matrix is also the output head; we still treat it as
      an embedding (as OLMo and many recent recipes do) and do not decay it.

    Rule: a parameter is decayed iff it has >= 2 dimensions and is not the weight of an
    ``nn.Embedding``. A tied parameter is listed once.
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() >= 2 and id(p) not in embedding_params:
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def _unguarded(method):
    """``method`` without the wrapper PyTorch puts around it to keep torch.compile from tracing it
    (or the method itself, where a PyTorch version has none)."""
    return getattr(method, "__wrapped__", method)


class WithoutCompileGuards:
    """An optimizer whose methods run without PyTorch's guards against ``torch.compile``.

    PyTorch wraps an optimizer's ``step``, ``zero_grad``, ``add_param_group``, ``state_dict`` and
    ``load_state_dict`` so that a compiled program does not trace into them, and each wrapper imports
    ``torch._dynamo`` on its first call: a large share of every run's start-up (docs/benchmarks.md,
    "Process tuning"), spent for a compiler nanolm never runs on its optimizers (``--compile``
    compiles the model). The
    methods here call the same functions unwrapped: the same arithmetic, the same state, under the
    gradient mode PyTorch's ``step`` sets (off, unless the optimizer is ``differentiable``). Put first
    among a class's bases; a class with its own ``step`` keeps it.
    """

    def add_param_group(self, param_group: dict) -> None:
        _unguarded(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _unguarded(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self) -> dict:
        return _unguarded(torch.optim.Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict: dict) -> None:
        _unguarded(torch.optim.Optimizer.load_state_dict)(self, state_dict)

    def step(self, closure=None):
        step = super().step  # the optimizer's own (AdamW's)
        with torch.set_grad_enabled(self.defaults.get("differentiable", False)):
            return _unguarded(step.__func__)(self, closure)


class AdamW(WithoutCompileGuards, torch.optim.AdamW):
    """``torch.optim.AdamW`` without its compile guards (:class:`WithoutCompileGuards`)."""


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95), eps=1e-8):
    """AdamW over :func:`get_param_groups`, with the fused kernel on CUDA and on CPU.

    PyTorch's default AdamW on CPU updates one tensor at a time with ~10 separate
    operations each (lerp, mul, addcmul, sqrt, div, ...): 300 small operations per step for
    a 4-layer model, a few percent of a small model's step. The fused kernel does the whole
    update of a tensor in one pass (one launch per step on CUDA). Same algorithm, same
    state; the floating-point rounding differs in the last bits.

    β2 = 0.95 rather than PyTorch's 0.999: the second-moment estimate then forgets in
    ~20 steps instead of ~1000, so a sudden jump in gradient size is absorbed quickly
    instead of producing an oversized update (standard for LM pretraining since GPT-3).
    """
    return AdamW(get_param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=_fused_adamw(model) or None)


OPTIMIZERS = ("adamw", "muon")


def muon_available() -> bool:
    """``torch.optim.Muon`` ships with PyTorch 2.9, nanolm's floor (``pyproject.toml``); the check
    stays so that an older PyTorch installed by hand is refused in one line, not a traceback."""
    return hasattr(torch.optim, "Muon")


def split_for_muon(model: nn.Module) -> list[nn.Parameter]:
    """The matrices Muon updates; AdamW updates every other parameter.

    Muon replaces a matrix's update by the nearest orthogonal matrix (Newton-Schulz), which
    makes sense for a matrix that maps one hidden space to another: every direction of the
    update then gets the same step. It does not for the rest:

    * the embedding table is a lookup, not a map: a row moves only when its token occurs,
      and orthogonalising the update would spread that token's step over every row;
    * the output head (tied to the embedding by default) maps to the vocabulary, whose
      directions are the tokens' frequencies, not a basis to equalise;
    * norm gains and biases are vectors: there is nothing to orthogonalise.

    Rule: Muon takes a parameter iff it has exactly 2 dimensions and is neither an
    ``nn.Embedding``'s weight nor the ``lm_head``'s (tied or not).
    """
    excluded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    if head is not None:
        excluded.add(id(head.weight))
    return [
        p
        for p in dict.fromkeys(model.parameters())  # a tied matrix once
        if p.requires_grad and p.dim() == 2 and id(p) not in excluded
    ]


class MuonWithAdamW:
    """Muon on the hidden matrices, AdamW on embeddings, head, norms and biases: one optimizer
    to the training loop (``step``, ``zero_grad``, ``param_groups``, ``state_dict``).

    Learning rates. Muon's update is an orthogonal matrix, whose size does not depend on the
    gradient's; PyTorch's ``adjust_lr_fn="match_rms_adamw"`` scales it (0.2·sqrt(max(rows,
    cols))) so that its RMS matches a typical AdamW update at the same rate. So ``muon_lr``
    means what ``lr`` means for AdamW, and by default it *is* ``lr``: one rate to sweep. The
    schedule (warmup, then the cosine or WSD) multiplies both alike; ``lr_ratio`` in each group is that
    group's peak over the AdamW peak (:func:`~nanolm.step.set_learning_rate`).

    Weight decay is decoupled in both (``w -= lr·wd·w``), on Muon's matrices and AdamW's
    decayed group (no decay on norms, biases, embeddings, as :func:`get_param_groups`).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        weight_decay: float,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        muon_lr: float | None = None,
        momentum: float = 0.95,
    ):
        matrices = split_for_muon(model)
        self.lr_ratio = (muon_lr if muon_lr is not None else lr) / lr
        self.muon = GroupedMuon(
            [{"params": matrices, "lr_ratio": self.lr_ratio}],
            lr=lr * self.lr_ratio,
            weight_decay=weight_decay,
            momentum=momentum,
            adjust_lr_fn="match_rms_adamw",
        )
        in_muon = {id(p) for p in matrices}
        rest = [
            {**group, "params": [p for p in group["params"] if id(p) not in in_muon]}  # decayed as for AdamW
            for group in get_param_groups(model, weight_decay)
        ]
        self.adamw = AdamW(rest, lr=lr, betas=betas, eps=eps, fused=_fused_adamw(model) or None)

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ValueError("not the state of a Muon + AdamW optimizer (was the run trained with --optimizer adamw?)")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
        for group in self.muon.param_groups:  # the ratio is this run's --muon-lr, which may change on resume
            group["lr_ratio"] = self.lr_ratio

    def describe(self, model: nn.Module) -> str:
        """The parameter split, shown at start: which tensors each optimizer updates."""
        names = {id(p): n for n, p in model.named_parameters()}
        muon = [p for g in self.muon.param_groups for p in g["params"]]
        adamw = [p for g in self.adamw.param_groups for p in g["params"]]
        kinds = sorted({names[id(p)].split(".")[-2] if "." in names[id(p)] else names[id(p)] for p in muon})
        count = lambda ps: sum(p.numel() for p in ps)  # noqa: E731
        return (
            f"optimizer: Muon on {len(muon)} hidden matrices ({', '.join(kinds)}; {count(muon):,} parameters), "
            f"AdamW on {len(adamw)} others (embeddings, head, norms, biases; {count(adamw):,} parameters)"
        )


def _fused_adamw(model: nn.Module) -> bool:
    device_types = {p.device.type for p in model.parameters()}
    return len(device_types) == 1 and device_types <= set(FUSED_ADAMW_DEVICES)


def optimizer_for(model: nn.Module, cfg, precision) -> torch.optim.Optimizer:
    """The optimizer of a run (``cfg``, its resolved :class:`~nanolm.run.config.RunConfig`), in its
    number format ``precision``: AdamW over :func:`get_param_groups`, or Muon beside AdamW
    (``--optimizer muon``). Under ``--precision bf16-pure`` the weights themselves are bf16, and
    their AdamW keeps fp32 master copies or rounds stochastically (:class:`BF16AdamW`)."""
    o = cfg.optim
    betas = (o.beta1, o.beta2)
    if precision.pure_bf16:
        return BF16AdamW(
            get_param_groups(model, o.weight_decay),
            lr=o.lr,
            betas=betas,
            master_weights=cfg.train.fp32_master,
            seed=cfg.train.seed,
        )
    if o.optimizer == "muon":
        return MuonWithAdamW(model, o.lr, o.weight_decay, betas, muon_lr=o.muon_lr, momentum=o.muon_momentum)
    return build_optimizer(model, o.lr, o.weight_decay, betas=betas)


# --------------------------------------------------------------------------- AdamW for bf16 weights
class BF16AdamW(WithoutCompileGuards, torch.optim.Optimizer):
    """AdamW for weights stored in bf16: fp32 arithmetic, fp32 moments, careful write-back.

    The update is the same as ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected
    moments), computed in fp32 from the bf16 weight and gradient. How the new fp32 weight
    gets back into the bf16 parameter is the point:

    * default: :func:`stochastic_round_to_bf16`. No fp32 copy of the weights is kept (12
      bytes per parameter: bf16 weight and gradient, fp32 moments), and updates far smaller
      than a bf16 gap still move the weight *on average*. The rounding noise at step t is
      drawn from a generator seeded by :func:`rounding_seed` (``seed``, t, index of the
      first parameter of its bucket), so a run is repeatable and a resumed one needs nothing
      but the optimizer state.
    * ``master_weights=True``: an fp32 master copy lives in the optimizer state (16 bytes per
      parameter, as with autocast); AdamW updates it, and the bf16 weight is its
      round-to-nearest copy. Nothing is ever lost; the forward pass sees the master rounded.

    Parameters that are not bf16 are updated in place in their own dtype (for fp32, this is
    exactly AdamW), which is also how the arithmetic is tested against PyTorch's.
    """

    bucket_elements = 1 << 24
    """The most elements one bucket updates at once on a GPU: its fp32 temporaries (the flat
    weights and gradients of bf16 parameters, the denominators, the rounding noise) stay under
    ~300 MB."""
    cpu_bucket_elements = 1 << 16
    """On a CPU, where a ``_foreach_*`` call is a loop over its tensors anyway, a bucket small
    enough to stay in cache through its ~17 operations: one bucket for a whole model sweeps
    every parameter through memory once per operation, slower than updating one tensor at a
    time (measured in docs/benchmarks.md)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        master_weights: bool = False,
        seed: int = 0,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_weights = master_weights
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore exactly, keeping the fp32 moments and master copy in fp32.

        ``torch.optim.Optimizer.load_state_dict`` casts floating-point state to each
        parameter's dtype, which would round the fp32 moments of a bf16 weight to bf16 and
        make a resumed run drift from an uninterrupted one.
        """
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if torch.is_tensor(value) and key != "step":
                    self.state[param][key] = value.to(param.device).clone()

    def _generator(self, device, seed: int) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device].manual_seed(seed)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter with a gradient, a bucket of them at a time.

        Parameters that share a group, device, dtype, way of writing back and step count
        form a bucket of at most :attr:`bucket_elements` elements (:attr:`cpu_bucket_elements`
        on a CPU; one larger tensor is a bucket of its own); each bucket is updated with
        ``torch._foreach_*`` calls, so a GPU step is a few kernel launches per bucket rather
        than ~10 per parameter tensor. The arithmetic per element is the loop's of
        ``torch.optim.AdamW``, operation for operation. bf16 weights and gradients are cast to
        fp32 in one flat buffer per bucket, and the stochastic rounding draws one noise tensor
        for the whole bucket, from a generator seeded by :func:`rounding_seed` (``seed``,
        step, index of the bucket's first parameter).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        buckets: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        index = -1
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if self.master_weights and p.dtype != torch.float32:
                        state["master"] = p.detach().float()
                state["step"] += 1
                write_back = (
                    "in place"
                    if p.dtype == torch.float32
                    else "from master"
                    if "master" in state
                    else "stochastic"
                    if p.dtype == torch.bfloat16
                    else "nearest"
                )
                buckets.setdefault((g, p.device, p.dtype, write_back, state["step"]), []).append((index, p))
        for (g, device, _, write_back, t), members in buckets.items():
            limit = self.cpu_bucket_elements if device.type == "cpu" else self.bucket_elements
            for bucket in _bounded(members, limit):
                self._update(self.param_groups[g], bucket, write_back, t, device)
        return loss

    def _update(self, group: dict, bucket: list[tuple[int, torch.Tensor]], write_back: str, t: int, device) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        params = [p for _, p in bucket]
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        if any(g.dtype != torch.float32 for g in grads):
            grads = _flat_fp32(grads)[1]
        if write_back == "in place":
            weights = params
        elif write_back == "from master":
            weights = [s["master"] for s in states]
        else:
            flat, weights = _flat_fp32(params)
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        torch._foreach_mul_(weights, 1 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, math.sqrt(1 - beta2**t))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(weights, exp_avgs, denom, value=-lr / (1 - beta1**t))
        if write_back == "stochastic":
            rounded = stochastic_round_to_bf16(flat, self._generator(device, rounding_seed(self.seed, t, bucket[0][0])))
            torch._foreach_copy_(params, _views(rounded, params))
        elif write_back != "in place":
            torch._foreach_copy_(params, weights)  # round to nearest


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into views shaped like ``like``, one after another."""
    return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in like]), like)]


def _flat_fp32(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fp32 copies of ``tensors``: one flat buffer (one cast for all of them) and its views."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].detach().reshape(-1)
    flat = flat.float() if flat.dtype != torch.float32 else flat.clone()
    return flat, _views(flat, tensors)


def _bounded(members: list, limit: int) -> list[list]:
    """``members`` (index, tensor) cut into consecutive runs of at most ``limit`` elements each
    (a larger tensor alone)."""
    runs, run, size = [], [], 0
    for member in members:
        n = member[1].numel()
        if run and size + n > limit:
            runs.append(run)
            run, size = [], 0
        run.append(member)
        size += n
    return runs + ([run] if run else [])


# --------------------------------------------------------------------------- Muon, made fast
def newton_schulz_batched(
    updates: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The nearest orthogonal matrix to each of ``updates`` (n, rows, cols), all at once.

    The same quintic Newton-Schulz iteration as ``torch.optim.Muon`` (each matrix scaled to
    Frobenius norm 1 first, a wide matrix's Gram matrix rather than a tall one's, in bf16 by
    default), with every product a batched one over the n matrices. The iteration's matrices
    are small (128 × 384 or 128 × 352 for a 128-wide model): one at a time, each product is too
    short to keep a CPU's matrix units busy, and the per-call cost dominates.
    """
    a, b, c = coefficients
    x = updates.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def muon_lr_factor(adjust_lr_fn: str | None, shape) -> float:
    """``torch.optim.Muon``'s scaling of the rate for a matrix of ``shape`` (its options)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


# torch.optim.Muon ships with PyTorch 2.9; on an older one the class below is never built
# (--optimizer muon is refused, muon_available), but the module must still import
_MUON = getattr(torch.optim, "Muon", torch.optim.Optimizer)


class GroupedMuon(WithoutCompileGuards, _MUON):
    """``torch.optim.Muon``, with the matrices of one shape orthogonalised together.

    PyTorch's Muon updates one matrix at a time: ~15 small matrix products per matrix per
    step, 225 for a 3-layer model, each too small to use a CPU's matrix units well (what the
    optimizer step then costs beside AdamW's: docs/benchmarks.md, ``benchmarks/muon_step.py``). Here the momentum is updated for all matrices
    at once and the Newton-Schulz iteration runs once per shape (a transformer block has four:
    qkv, proj, the MLP's gate and up, its down), batched. Same algorithm, same state
    (``momentum_buffer``, so checkpoints load either way), same options: the same numbers as
    PyTorch's (``test_grouped_muon_takes_the_steps_of_torch_muon``; to the bit on the
    development CPU, ``benchmarks/muon_step.py``).

    A batch holds at most ``BATCH_ELEMENTS`` (16M) elements, a few 4096 × 1024 matrices: the
    iteration's stacked copies of a whole shape at once would otherwise cost a large model
    gigabytes that PyTorch's one-at-a-time loop never holds.

    One difference, on a CPU without native bf16 (no AVX512-BF16 or AMX): there bf16 matrix
    products are emulated, orders of magnitude slower than fp32, and the iteration would take
    seconds per step (docs/speedrun.md, "Muon"), so it runs in fp32, which is also the more exact.
    """

    BATCH_ELEMENTS = 2**24

    def newton_schulz_dtype(self, device: torch.device) -> torch.dtype:
        from .precision import cpu_has_native_bf16  # looked up now: tests play both kinds of CPU by patching it

        return torch.float32 if device.type == "cpu" and not cpu_has_native_bf16() else torch.bfloat16

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            buffers = [self.state[p]["momentum_buffer"] for p in params]
            momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            if decay:
                torch._foreach_mul_(params, 1 - lr * decay)
            by_shape: dict[tuple, list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault((tuple(p.shape), p.device), []).append(i)
            for (shape, device), members in by_shape.items():
                per_batch = max(1, self.BATCH_ELEMENTS // math.prod(shape))
                for start in range(0, len(members), per_batch):
                    batch = members[start : start + per_batch]
                    orthogonal = newton_schulz_batched(
                        torch.stack([updates[i] for i in batch]),
                        group["ns_coefficients"],
                        group["ns_steps"],
                        group["eps"],
                        self.newton_schulz_dtype(device),
                    )
                    torch._foreach_add_(
                        [params[i] for i in batch],
                        list(orthogonal.unbind(0)),
                        alpha=-lr * muon_lr_factor(group["adjust_lr_fn"], shape),
                    )
        return loss
