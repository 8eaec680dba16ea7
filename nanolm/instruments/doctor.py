"""``nanolm doctor``: prove the setup is sound before spending hours on it.

A model with a bug in its data or its loss usually still trains, just worse, and nothing
says so. Each check here is an invariant a correct setup satisfies exactly, and each
failure comes with what it usually means. Most take a fraction of a second; memorising one
batch takes a few seconds.

``nanolm doctor --model package.module:ClassName`` runs the model invariants on your own
class (constructed with a ``GPTConfig``; ``forward(idx, ...)`` returning the logits of every
position, alone or first in a tuple: doctor never passes targets), so a transformer written
from an empty file can be checked the same way.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..batches import Batch, WindowSampler, pack_windows
from ..errors import NanolmError
from ..machine.device import (
    has_cpp_compiler,
    has_triton,
    refuse_what_the_device_cannot_do,
    resolve_device,
    tf32_capable,
)
from ..model import GPT, GPTConfig, flex_attention_chosen
from ..optim import get_param_groups
from ..precision import resolve_precision
from ..run.budget import DEFAULT_MAX_WARMUP, BudgetPlan, budget_learning_rate
from ..run.config import RunConfig
from ..step import learning_rate, wsd_decay_start


@dataclass
class Check:
    name: str
    passed: bool  # False only for a check that ran and failed
    detail: str
    meaning: str = ""  # what a failure usually means
    skipped: bool = False  # the check could not run: shown as SKIP, never as a PASS

    @property
    def status(self) -> str:
        return "SKIP" if self.skipped else "PASS" if self.passed else "FAIL"

    def line(self) -> str:
        text = f"{self.status}  {self.name:<24} {self.detail}"
        if not self.passed and self.meaning:
            text += f"\n      -> {self.meaning}"
        return text


def _logits(model, idx, **kw):
    """The logits of every position, (B, T, V). A model that returns something else (such as
    nanoGPT's inference shortcut, the last position only) cannot be checked position by position."""
    out = model(idx, **kw)
    logits = out[0] if isinstance(out, tuple) else out
    if not torch.is_tensor(logits) or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(idx.shape):
        shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        raise ModelContractError(
            f"forward(idx) returned logits of shape {shape} for idx of shape {tuple(idx.shape)}; doctor needs logits for "
            f"every position, (batch, seq_len, vocab) (a model that returns only the last position when no targets "
            f"are given, as nanoGPT's does, must return all of them)"
        )
    return logits


class ModelContractError(NanolmError):
    """A user's model does not offer what doctor needs to check it."""


def _accepts(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------- model checks
def check_initial_loss(model, batch: Batch, vocab_size: int, tolerance: float = 0.1) -> Check:
    """A fresh model should be uniformly unsure: loss ≈ ln V."""
    with torch.no_grad():
        logits = _logits(model.eval(), batch.idx)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), batch.targets.reshape(-1)
        ).item()
    model.train()
    expected = math.log(vocab_size)
    ok = math.isfinite(loss) and abs(loss - expected) <= tolerance * expected
    return Check(
        "initial loss",
        ok,
        f"{loss:.3f} vs ln V = {expected:.3f} (within {tolerance:.0%} expected)",
        "the initialisation is too large (the model is confidently wrong before it has seen any "
        "data) or the logits are scaled/biased; initialise with a small std (0.02) and no "
        "output bias"
        if loss > expected
        else "the loss is below chance before training: the targets leak into the inputs (not shifted?) "
        "or the loss is not a mean over tokens",
    )


def check_memorises_one_batch(model, batch: Batch, steps: int = 300, lr: float = 3e-3, target: float = 0.1) -> Check:
    """Any correct model with enough capacity drives the loss on one fixed batch to ~0."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    first = loss = None
    for step in range(steps):
        logits = _logits(model, batch.idx)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), batch.targets.reshape(-1)
        )
        if first is None:
            first = loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 20 == 19 and loss.item() < target:
            break
    final = loss.item()
    ok = math.isfinite(final) and final < target
    return Check(
        "memorise one batch",
        ok,
        f"loss {first:.3f} -> {final:.4f} in {step + 1} steps (< {target} expected)",
        "gradients do not reach the weights (a detach, no_grad, or parameters missing from the "
        "optimizer), the output ignores the input, or the model is far too small",
    )


def check_causality(model, vocab_size: int, seq_len: int) -> Check:
    """Logits at position t must not change when tokens after t change."""
    g = torch.Generator().manual_seed(0)
    T = min(seq_len, 32)
    idx = torch.randint(vocab_size, (2, T), generator=g)
    changed = idx.clone()
    cut = T // 2
    changed[:, cut:] = torch.randint(vocab_size, (2, T - cut), generator=g)
    with torch.no_grad():
        a, b = _logits(model.eval(), idx), _logits(model.eval(), changed)
    model.train()
    worst = (a[:, :cut] - b[:, :cut]).abs().max().item()
    ok = worst <= 1e-5
    return Check(
        "causality",
        ok,
        f"max change of past logits when the future changes: {worst:.2e}",
        "the model reads the future: the attention mask is missing or turned around "
        "(is_causal, tril vs triu). Training loss will look great and generation will be garbage",
    )


def check_document_isolation(model, vocab_size: int, seq_len: int) -> Check:
    """With ``doc_ids``, changing document A must leave every logit of document B unchanged."""
    if not _accepts(model, "doc_ids"):
        return Check("no cross-document leak", True, "not run: forward() takes no doc_ids", skipped=True)
    g = torch.Generator().manual_seed(1)
    T = min(seq_len, 32)
    split = T // 3
    idx = torch.randint(vocab_size, (1, T), generator=g)
    doc_ids = torch.cat([torch.zeros(split, dtype=torch.int32), torch.ones(T - split, dtype=torch.int32)])[None]
    changed = idx.clone()
    changed[0, : split - 1] = torch.randint(vocab_size, (split - 1,), generator=g)
    with torch.no_grad():
        a = _logits(model.eval(), idx, doc_ids=doc_ids)
        b = _logits(model.eval(), changed, doc_ids=doc_ids)
    model.train()
    worst = (a[:, split:] - b[:, split:]).abs().max().item()
    ok = worst <= 1e-6
    return Check(
        "no cross-document leak",
        ok,
        f"max change of document B's logits when A changes: {worst:.2e}",
        "doc_ids are accepted but not used to mask attention: every packed window lets a "
        "document read the one before it",
    )


def check_grad_accum_matches_big_batch(model, batch: Batch, k: int = 4) -> Check:
    """The step's gradient over k micro-batches equals one big batch's, with uneven counts."""
    from ..step import accumulate_gradients, counted_tokens

    uneven = Batch(batch.idx, batch.targets, batch.loss_mask.clone())
    uneven.loss_mask[0, : batch.idx.shape[1] // 2] = False  # micro-batches count different token numbers
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(micro):
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, micro, counted_tokens(micro))
        return torch.cat([p.grad.flatten() for p in params if p.grad is not None])

    B = batch.idx.shape[0]
    size = max(1, B // k)
    micro = [
        Batch(uneven.idx[i : i + size], uneven.targets[i : i + size], uneven.loss_mask[i : i + size])
        for i in range(0, B, size)
    ]
    big, acc = grads([uneven]), grads(micro)
    model.zero_grad(set_to_none=True)
    rel = ((big - acc).abs().max() / big.abs().max().clamp(min=1e-30)).item()
    ok = rel <= 1e-5
    return Check(
        f"batch x{len(micro)} == grad_accum={len(micro)}",
        ok,
        f"max relative gradient difference {rel:.1e}",
        "micro-batch losses are averaged per micro-batch (or not divided by the accumulation "
        "count): tokens in short micro-batches weigh more, and the effective learning rate "
        "changes with --grad-accum",
    )


def check_param_groups(model, weight_decay: float) -> Check:
    decay_group, no_decay_group = get_param_groups(model, weight_decay)
    decayed = {id(p) for p in decay_group["params"]} if decay_group["weight_decay"] > 0 else set()
    wrong = [n for n, p in model.named_parameters() if id(p) in decayed and p.dim() < 2]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    wrong += [n for n, p in model.named_parameters() if id(p) in decayed and id(p) in embeddings]
    ok = not wrong
    detail = (
        f"{len(decay_group['params'])} decayed matrices, {len(no_decay_group['params'])} without decay"
        if ok
        else f"decayed but should not be: {', '.join(wrong[:5])}"
    )
    return Check(
        "weight decay groups",
        ok,
        detail,
        "norm gains and biases are decayed toward 0: norms lose their scale, and rare tokens' "
        "embedding rows are eroded",
    )


# --------------------------------------------------------------------------- setup checks
def check_lr_schedule(cfg: RunConfig) -> Check:
    """Warmup first, then a decay that ends on the floor and never goes under it."""
    o, t = cfg.optim, cfg.train
    if t.time_budget is not None:
        return check_budget_schedule(cfg)
    lrs = [learning_rate(s, o, t.steps) for s in range(1, t.steps + 2)]  # every step, and one after the last
    after_warmup = lrs[o.warmup :]
    problems, meanings = [], []
    if o.warmup <= 0 or lrs[0] >= o.lr:
        problems.append("no warmup: the first step runs at the peak rate")
        meanings.append(
            "Adam's first updates are full size while its variance estimate is still noise; a fresh "
            "model can be thrown into a bad region (a loss spike at the start). Use --warmup"
        )
    if min(after_warmup) < o.min_lr * (1 - 1e-9) or min(lrs) < 0 or abs(lrs[-1] - o.min_lr) > 1e-12 + 1e-9 * o.lr:
        problems.append(
            f"the decay does not end on the floor {o.min_lr:.2e} (ends at {lrs[-1]:.2e}, min {min(after_warmup):.2e})"
        )
        meanings.append("the schedule function is broken")
    if max(lrs) > o.lr * (1 + 1e-9):
        problems.append("the rate exceeds --lr")
        meanings.append("the schedule function is broken")
    ok = not problems
    if o.schedule == "cosine":
        decay = "cosine"
    elif wsd_decay_start(o.warmup, t.steps, o.decay_fraction) <= o.warmup:  # no stable phase left
        decay = "a straight line"
    else:
        decay = f"flat, then a straight line over the last {o.decay_fraction:.0%} of the steps"
    detail = (
        f"warmup {o.warmup} steps to {o.lr:.1e}, {decay} to the floor {o.min_lr:.1e} at step {t.steps}"
        if ok
        else "; ".join(problems)
    )
    return Check("LR schedule", ok, detail, "; ".join(meanings))


def check_budget_schedule(cfg: RunConfig, nominal_steps: int = 1000) -> Check:
    """A time budget's schedule is drawn by the clock during the run: checked here on a plan of
    ``nominal_steps`` (warmup, the peak, the decay over its last ``--decay-fraction``), the same
    function of the step and the plan that trains (``nanolm.run.budget``)."""
    o, t = cfg.optim, cfg.train
    steps = min(nominal_steps, t.steps)
    warmup = o.warmup if o.warmup is not None else min(DEFAULT_MAX_WARMUP, steps // 10)
    plan = BudgetPlan(
        t.time_budget, warmup=warmup, last_step=steps, decay_from=wsd_decay_start(warmup, steps, o.decay_fraction)
    )
    lrs = [budget_learning_rate(s, o, plan) for s in range(1, steps + 2)]
    problems = []
    if warmup <= 0 or lrs[0] >= o.lr:
        problems.append("no warmup: the first step runs at the peak rate")
    if max(lrs) > o.lr * (1 + 1e-9) or min(lrs) < o.min_lr * (1 - 1e-9) or lrs[-1] != o.min_lr:
        problems.append(f"the plan's rates leave [--min-lr, --lr] or end off the floor (last {lrs[-1]:.2e})")
    if any(later > earlier for earlier, later in zip(lrs[warmup:], lrs[warmup + 1 :])):
        problems.append("the rate rises after the warmup")
    detail = (
        f"time budget {t.time_budget:g} s: warmup {'of ' + str(o.warmup) if o.warmup is not None else 'a tenth of the steps that fit (at most 200)'} "
        f"to {o.lr:.1e}, the peak, then a straight line to the floor {o.min_lr:.1e} over the last "
        f"{o.decay_fraction:.0%} of the steps, started by the clock"
        if not problems
        else "; ".join(problems)
    )
    return Check("LR schedule", not problems, detail, "the schedule function is broken" if problems else "")


def check_sample_window(tokens: np.ndarray, tokenizer, seq_len: int) -> Check:
    """The first window, decoded, should read as text: printable, few broken bytes, and
    documents longer than a couple of tokens."""
    window = np.asarray(tokens[: min(len(tokens), max(seq_len, 256) + 1)]).astype(np.int64)
    text = tokenizer.decode(window)
    readable = sum(ch.isprintable() or ch in "\n\t" for ch in text) / max(1, len(text))
    broken = text.count("\ufffd")
    eos_share = float(np.mean(window == tokenizer.eos_id)) if len(window) else 1.0
    ok = readable >= 0.95 and broken <= 1 and eos_share <= 0.25
    preview = text[:120].replace("\n", "\\n")
    detail = f'"{preview}"' + ("" if ok else f" ({readable:.0%} printable, {broken} broken bytes, {eos_share:.0%} EOS)")
    return Check(
        "a training window decodes to text",
        ok,
        detail,
        "the token stream is not what the tokenizer wrote (shards read with the wrong dtype or "
        "offset, or made with another tokenizer), or the documents are split in the wrong place "
        "(a separator that matches nearly every line)",
    )


def check_token_ids(data, vocab_size: int) -> Check:
    worst = max(int(np.max(s.tokens)) if len(s.tokens) else -1 for s in data.splits.values())
    ok = 0 <= worst < vocab_size
    return Check(
        "token ids within the vocabulary",
        ok,
        f"largest id {worst}, vocabulary {vocab_size}",
        "ids beyond the embedding table: on GPU an out-of-bounds gather (a crash or silent "
        "garbage); the shards were made with another tokenizer",
    )


def check_loss_floor(data) -> Check:
    floor = data.meta.get("floor")
    if floor:
        detail = (
            f"the data's entropy: {floor['bpb']:.4f} bits/byte = {floor['nats_per_token']:.4f} nats/token "
            f"(no model can go below; a validation loss under it is a leak)"
        )
    else:
        bounds = data.meta.get("compressor_bpb") or {}
        detail = (
            (
                "entropy unknown; a compressor needs "
                + ", ".join(f"{k} {v:.3f}" for k, v in bounds.items())
                + " bits/byte on the validation text (a trained model should beat xz)"
            )
            if bounds
            else "entropy unknown and no validation text to bound it"
        )
    return Check("expected loss floor", True, detail)


# --------------------------------------------------------------------------- running
def load_model_class(spec: str):
    """``package.module:ClassName`` -> the class (the current directory is importable)."""
    if ":" not in spec:
        raise NanolmError(f"--model {spec!r}: expected package.module:ClassName")
    module_name, class_name = spec.split(":", 1)
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise NanolmError(f"--model {spec}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise NanolmError(f"--model {spec}: {module_name} has no {class_name}")
    return cls


def build_model(cls, config: GPTConfig, seed: int):
    torch.manual_seed(seed)
    try:
        return cls(config)
    except Exception as e:
        raise NanolmError(f"cannot build {cls.__name__}(GPTConfig(...)): {type(e).__name__}: {e}") from None


def model_checks(make_model, vocab_size: int, seq_len: int, batch: Batch, run_accum: bool, weight_decay: float):
    yield check_initial_loss(make_model(), batch, vocab_size)
    yield check_causality(make_model(), vocab_size, seq_len)
    yield check_document_isolation(make_model(), vocab_size, seq_len)
    yield check_memorises_one_batch(make_model(), Batch(batch.idx[:2], batch.targets[:2], batch.loss_mask[:2]))
    if run_accum:
        yield check_grad_accum_matches_big_batch(make_model(), batch)
        yield check_param_groups(make_model(), weight_decay)


def run_doctor(cfg: RunConfig, model_spec: str | None = None, log=print) -> list[Check]:
    """Run every check for this configuration; prints each result as it comes."""
    from ..data.prepare import load_training_data

    cfg = cfg.resolved()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nanolm-doctor-") as scratch:
        data = load_training_data(cfg, Path(scratch), log=lambda *_: None)
        tokenizer = data.tokenizer
        seq_len = min(cfg.model.seq_len, 64)
        gpt_config = cfg.model.gpt_config(tokenizer.vocab_size)
        cls = load_model_class(model_spec) if model_spec else GPT

        def make_model():
            return build_model(cls, gpt_config, cfg.train.seed)

        name = cls.__name__ if model_spec else "nanolm GPT"
        n_params = sum(p.numel() for p in make_model().parameters())
        log(
            f"nanolm doctor: {name}, {n_params / 1e6:.2f}M parameters, {tokenizer.kind} vocabulary of "
            f"{tokenizer.vocab_size}, data {cfg.data.data or 'built-in stories'}"
        )
        t = cfg.train
        for line in device_choices(t.device, t.precision, cfg.model.attention, t.tf32, t.deterministic, t.compile):
            log("  " + line)
        sampler = WindowSampler(len(data.train), seq_len, 8, seed=cfg.train.seed)
        batch = pack_windows(data.train.tokens, sampler.next_starts(), seq_len, tokenizer.eos_id, doc_mask=False)
        results = []
        checks = model_checks(
            make_model, tokenizer.vocab_size, seq_len, batch, model_spec is None, cfg.optim.weight_decay
        )
        while True:
            try:
                check = next(checks)
            except StopIteration:
                break
            except ModelContractError as e:
                raise NanolmError(f"--model {model_spec or 'GPT'}: {e}") from None
            except Exception as e:
                if model_spec is None:
                    raise
                raise NanolmError(
                    f"--model {model_spec}: the model raised {type(e).__name__} during the checks "
                    f"({str(e).strip().splitlines()[0] if str(e).strip() else 'no message'})"
                ) from None
            log(check.line())
            results.append(check)
        if model_spec is None:
            for check in (
                check_lr_schedule(cfg),
                check_sample_window(data.train.tokens, tokenizer, seq_len),
                check_token_ids(data, tokenizer.vocab_size),
                check_loss_floor(data),
            ):
                log(check.line())
                results.append(check)
    failed = sum(not c.passed for c in results)
    skipped = sum(c.skipped for c in results)
    log(
        f"{len(results) - failed - skipped} passed, {skipped} skipped, {failed} failed in "
        f"{time.perf_counter() - started:.1f}s"
    )
    return results


def device_choices(
    device_name: str, precision_name: str, attention: str, tf32: bool, deterministic: bool, compile: bool
) -> list[str]:
    """What a run with these options would pick on this machine, and why, one line each
    (``nanolm doctor`` prints them). Raises the run's own one-line error for what the
    device cannot do."""
    device = resolve_device(device_name)
    refuse_what_the_device_cannot_do(device, deterministic, compile, attention)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"
    elif device.type == "mps":
        where = "Apple GPU (Metal)"
    else:
        where = f"{os.cpu_count()} cores"
    why = " (auto: cuda > mps > cpu)" if device_name == "auto" else ""
    precision = resolve_precision(precision_name, device)
    flex = flex_attention_chosen(attention, device)
    lines = [
        f"device     {device} ({where}){why}",
        f"precision  {precision.describe()}",
        f"attention  {'FlexAttention block mask' if flex else 'SDPA with a boolean mask'} for the document mask"
        f" ({'requested' if attention != 'auto' else 'auto: FlexAttention on CUDA with Triton, SDPA elsewhere'})",
    ]
    if precision.name == "fp32" and tf32_capable(device):
        lines.append(f"tf32       {'on: fp32 matrix products on TF32 tensor cores' if tf32 else 'off (--no-tf32)'}")
    lines.append(
        f"batches    {'through pinned host memory (overlaps the copy)' if device.type == 'cuda' else 'no pinning'}"
        f" | compile {'available' if (has_triton() if device.type == 'cuda' else has_cpp_compiler()) else 'unavailable'}"
        f"{' (asked)' if compile else ''}"
    )
    return lines
