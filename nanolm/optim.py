"""The optimizers (AdamW, or Muon for the hidden matrices beside AdamW for the rest) and the
parameters each one updates. The learning rate each step sets is ``nanolm.step``'s schedule."""

from __future__ import annotations

import torch
import torch.nn as nn

from .muon import GroupedMuon


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
    return torch.optim.AdamW(
        get_param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=_fused_adamw(model) or None
    )


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
    return [p for p in dict.fromkeys(model.parameters())  # a tied matrix once
            if p.requires_grad and p.dim() == 2 and id(p) not in excluded]


class MuonWithAdamW:
    """Muon on the hidden matrices, AdamW on embeddings, head, norms and biases: one optimizer
    to the training loop (``step``, ``zero_grad``, ``param_groups``, ``state_dict``).

    Learning rates. Muon's update is an orthogonal matrix, whose size does not depend on the
    gradient's; PyTorch's ``adjust_lr_fn="match_rms_adamw"`` scales it (0.2·sqrt(max(rows,
    cols))) so that its RMS matches a typical AdamW update at the same rate. So ``muon_lr``
    means what ``lr`` means for AdamW, and by default it *is* ``lr``: one rate to sweep. The
    schedule (warmup, then the cosine or WSD) multiplies both alike; ``lr_ratio`` in each group is that
    group's peak over the AdamW peak (:func:`set_learning_rate`).

    Weight decay is decoupled in both (``w -= lr·wd·w``), on Muon's matrices and AdamW's
    decayed group (no decay on norms, biases, embeddings, as :func:`get_param_groups`).
    """

    def __init__(self, model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 muon_lr: float | None = None, momentum: float = 0.95):
        matrices = split_for_muon(model)
        self.lr_ratio = (muon_lr if muon_lr is not None else lr) / lr
        self.muon = GroupedMuon([{"params": matrices, "lr_ratio": self.lr_ratio}], lr=lr * self.lr_ratio,
                                weight_decay=weight_decay, momentum=momentum, adjust_lr_fn="match_rms_adamw")
        in_muon = {id(p) for p in matrices}
        rest = [{**group, "params": [p for p in group["params"] if id(p) not in in_muon]}  # decayed as for AdamW
                for group in get_param_groups(model, weight_decay)]
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, eps=eps, fused=_fused_adamw(model) or None)

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
        return (f"optimizer: Muon on {len(muon)} hidden matrices ({', '.join(kinds)}; {count(muon):,} parameters), "
                f"AdamW on {len(adamw)} others (embeddings, head, norms, biases; {count(adamw):,} parameters)")


def _fused_adamw(model: nn.Module) -> bool:
    device_types = {p.device.type for p in model.parameters()}
    return len(device_types) == 1 and device_types <= set(FUSED_ADAMW_DEVICES)


def optimizer_for(model: nn.Module, o) -> torch.optim.Optimizer | MuonWithAdamW:
    """The optimizer ``--optimizer`` names, built from the run's optimizer options ``o``."""
    betas = (o.beta1, o.beta2)
    if o.optimizer == "muon":
        return MuonWithAdamW(model, o.lr, o.weight_decay, betas, muon_lr=o.muon_lr, momentum=o.muon_momentum)
    return build_optimizer(model, o.lr, o.weight_decay, betas=betas)
