"""Training throughput: nanolm's real step against the loop a user would write, same shape, same run.

The *reference* is written out below the way a PyTorch user writes a first GPT training loop
(nanoGPT's model): GPT-2 blocks (LayerNorm and Linear layers with biases, SDPA causal, GELU
MLP 4x wide, learned position embeddings, tied head), ``torch.optim.AdamW`` with PyTorch's
defaults for the device, fp32, random windows (``nanolm.train.get_batch``), ``F.cross_entropy``,
gradient clipping at 1.0. *nanolm* is the training loop's own step, :func:`nanolm.step.train_step`,
on the sampler's windows packed with the document mask (``TrainBatches``): the learning rate,
the masked loss ÷ the step's token count, clipping, ``build_optimizer``'s AdamW, on ``GPT`` with
its defaults (RoPE, RMSNorm, SwiGLU, tied embeddings), at ``--precision``.

Variants, all timed in one process, alternating (A B C, C B A, A B C, ... rounds of ``--steps``
steps) so that machine noise hits all of them alike; the figures are medians over rounds and
every ratio is of medians from the same process:

* ``reference``; ``nanolm``; ``nanolm_mask_off`` (plain causal attention);
* ``nanolm_bf16`` on a CPU with native bf16 (``--precision bf16``; the reference stays fp32);
* ``nanolm_compiled`` with ``--compile`` (``torch.compile``; compile time reported apart);
* with ``--ablations``: nanolm with one of its optimisations undone (``before_*``), to show
  what each one is worth, and with all of them undone (``before_all``);
* with ``--breakdown``: what each difference from the reference costs (``nanolm_model_in_plain_loop``:
  nanolm's model in the reference's loop; ``without_rope``; ``layer_norm_for_rms_norm``: stand-ins
  that price one part, not models anyone should train);
* with either, two yardsticks. A variant that only patches the code (``before_rope_roll``,
  ``before_qkv_split``, ``without_rope``, ``layer_norm_for_rms_norm``) runs on nanolm's own
  runner, switched on for its rounds (:func:`toggled`), and ``nanolm_again``, the same runner
  with nothing switched, is the noise floor of its ratio. A variant with a model or optimizer of
  its own (``before_fused_adamw``, ``before_all``, the plain-loop one) has ``nanolm_twin``, a
  second, identical nanolm runner: how far apart two runners of the same code land (2-5 % on a
  shared CPU, from where their buffers sit) is the noise floor of those;
* with ``--threads 1,2``: every variant at each thread count (``name@1``, ``name@2``).

Also reported: ``matmuls_alone``, the step's own matrix multiplies (their shapes recorded over
one nanolm step) run back to back with nothing else, the compute limit of the step;
the loader's share of nanolm's step (``pack_windows`` alone vs the whole step),
achieved GFLOP/s (``GPT.flops_per_token``; MFU on CUDA against ``--peak-tflops``), peak RSS and,
on CUDA, peak VRAM. Data: the built-in story corpus with a char tokenizer (documents of ~600
characters, so the document mask has real boundaries to respect), or ``--data FILE``.

    python benchmarks/throughput.py                                  # nanoGPT's CPU shape and a larger one
    python benchmarks/throughput.py --shapes nanogpt --ablations --compile
    python benchmarks/throughput.py --shapes nanogpt --threads 1,2
    python benchmarks/throughput.py --shapes nanogpt --threads 1 --breakdown --rounds 20
    python benchmarks/throughput.py --device cuda --shapes gpt2 --no-reference --compile
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanolm.model
from nanolm.batches import TrainBatches, WindowSampler, get_batch, pack_windows
from nanolm.data.corpus import write_stories
from nanolm.data.prepare import prepare
from nanolm.model import GPT, GPTConfig, compile_blocks
from nanolm.optim import build_optimizer, get_param_groups
from nanolm.precision import cpu_has_native_bf16, resolve_precision
from nanolm.step import StepSetup, train_step

SHAPES = {
    # nanoGPT's shakespeare_char recipe on CPU (n_layer, n_head, n_embd, seq_len, batch)
    "nanogpt": dict(n_layer=4, n_head=4, n_embd=128, seq_len=64, batch_size=12),
    # nanoGPT's shakespeare_char GPU model (6 layers, 384 wide, context 256): ~13x the compute per
    # token; batch 4 on a CPU
    "large": dict(n_layer=6, n_head=6, n_embd=384, seq_len=256, batch_size=4),
    # GPT-2 small (124M parameters with a 50257-token vocabulary) at context 1024, for a GPU
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, seq_len=1024, batch_size=16, vocab_size=50304),
}


# --------------------------------------------------------------------------- the reference
class RefBlock(nn.Module):
    def __init__(self, d: int, n_head: int, bias: bool = True):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=bias), nn.LayerNorm(d, bias=bias)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=bias), nn.Linear(d, d, bias=bias)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d, bias=bias), nn.Linear(4 * d, d, bias=bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class RefGPT(nn.Module):
    """nanoGPT's model, initialised as nanoGPT does (N(0, 0.02), biases at zero, the two
    projections into the residual stream at 0.02 / sqrt(2 · n_layer)). ``bias`` False is what
    nanoGPT's ``train.py`` trains by default (``loss_per_step.py``); the throughput reference
    keeps GPT-2's biases."""

    def __init__(self, vocab: int, seq_len: int, n_layer: int, n_head: int, d: int, bias: bool = True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(RefBlock(d, n_head, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, bias=bias)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith(("c_proj.weight", "mlp_proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# --------------------------------------------------------------------------- what nanolm did before
def rope_cat(x, cos, sin):
    """RoPE as nanolm wrote it before: rotate_half by cat, sin unsigned."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def queries_keys_values_indexed(self, x, cos, sin):
    """``Attention.queries_keys_values`` as nanolm wrote it before: ``qkv`` viewed as
    (3, B, H, T, D) and indexed (each index's backward fills a zero gradient of the whole
    tensor), q and k rotated in one call (the benchmark's model has no QK-norm)."""
    B, T, _ = x.shape
    qkv = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k = nanolm.model.apply_rope(qkv[:2], cos, sin)
    return q, k, qkv[2]


@contextlib.contextmanager
def patched(target=nanolm.model, **replacements):
    """Replace attributes of ``target`` (``nanolm.model`` or one of its classes) for the
    duration of a timed round."""
    saved = {name: getattr(target, name) for name in replacements}
    for name, value in replacements.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(target, name, value)


# --------------------------------------------------------------------------- runners
class Runner:
    """One variant: ``step()`` runs one optimizer step, ``timed(n)`` the seconds per step of n."""

    def __init__(self, name, step, model, device, patch=None, threads=None):
        self.name, self.step, self.model, self.device = name, step, model, device
        self.patch, self.threads = patch, threads

    def timed(self, steps: int) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) per step over ``steps`` steps."""
        if self.threads:
            torch.set_num_threads(self.threads)
        with self.patch() if self.patch else contextlib.nullcontext():
            sync(self.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(steps):
                self.step()
            sync(self.device)
            return (time.perf_counter() - start) / steps, (time.process_time() - cpu_start) / steps


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference_runner(shape, vocab, tokens, device, autocast, lr=1e-3):
    torch.manual_seed(0)
    model = RefGPT(vocab, shape["seq_len"], shape["n_layer"], shape["n_head"], shape["n_embd"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(0)

    def step():
        x, y = get_batch(tokens, shape["batch_size"], shape["seq_len"], g)
        x, y = x.to(device), y.to(device)
        with autocast():
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Runner("reference", step, model, device)


def model_in_plain_loop_runner(name, shape, vocab, tokens, device, autocast, lr=1e-3):
    """nanolm's ``GPT`` trained by the reference's loop (random windows, no document mask,
    ``F.cross_entropy``, PyTorch's clipping, nanolm's fused AdamW): what the model costs
    apart from the step around it."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=vocab,
            seq_len=shape["seq_len"],
            n_layer=shape["n_layer"],
            n_head=shape["n_head"],
            n_embd=shape["n_embd"],
        )
    ).to(device)
    opt = build_optimizer(model, lr, 0.1)
    g = torch.Generator().manual_seed(0)

    def step():
        x, y = get_batch(tokens, shape["batch_size"], shape["seq_len"], g)
        x, y = x.to(device), y.to(device)
        with autocast():
            logits, _ = model(x)
        F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Runner(name, step, model, device)


def layer_norm_instead(self, x):
    """A stand-in, not nanolm's model: LayerNorm (no bias) where RMSNorm is, to price RMSNorm
    against the fused LayerNorm kernel the reference uses."""
    return F.layer_norm(x, (x.shape[-1],), self.weight, None, self.eps)


def nanolm_runner(
    name,
    shape,
    vocab,
    tokens,
    eos,
    device,
    autocast,
    doc_mask=True,
    compile=False,
    fused_adamw=True,
    lr=1e-3,
    patch=None,
):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=vocab,
            seq_len=shape["seq_len"],
            n_layer=shape["n_layer"],
            n_head=shape["n_head"],
            n_embd=shape["n_embd"],
        )
    ).to(device)
    if compile:
        compile_blocks(model)  # what --compile does
    if fused_adamw:
        opt = build_optimizer(model, lr, 0.1)
    else:  # PyTorch's default AdamW for the device: one tensor at a time on CPU
        opt = torch.optim.AdamW(get_param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    setup = StepSetup(
        model,
        opt,
        schedule=lambda step: lr,
        clip=1.0,
        autocast=autocast,
    )
    batches = TrainBatches(
        tokens,
        WindowSampler(len(tokens), shape["seq_len"], shape["batch_size"], seed=0),
        shape["seq_len"],
        eos,
        doc_mask=doc_mask,
    )
    steps = iter(range(1, 1 << 62))

    def step():  # the training loop's own step (no loss scaler: fp32 or bf16; no guard: every step taken)
        n = next(steps)
        train_step(setup, n, batches.next(n))

    return Runner(name, step, model, device, patch)


def all_of(*patches):
    """One patch context made of several."""

    @contextlib.contextmanager
    def combined():
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch())
            yield

    return combined


def before_rope(runner: Runner) -> Runner:
    """The same runner with the cat-based RoPE and its unsigned sin table (the table's first half
    negated while the patch is on, and back after: negation is exact, so the runner's own rounds
    see the table unchanged)."""
    sin = runner.model.rope_sin
    half = sin.shape[-1] // 2

    @contextlib.contextmanager
    def unsigned_table_and_cat():
        sin[:, :half].neg_()
        try:
            with patched(apply_rope=rope_cat):
                yield
        finally:
            sin[:, :half].neg_()

    runner.patch = all_of(runner.patch, unsigned_table_and_cat) if runner.patch else unsigned_table_and_cat
    return runner


def toggled(base: Runner, name: str, patch=None) -> Runner:
    """``base`` itself (its model, optimizer and batches) under ``patch``, as a variant of its own.

    Two runners of identical code land 2-5 % apart on a shared CPU (``nanolm_twin``): where their
    models and buffers sit in memory, which neighbours the other core has. A variant that only
    patches the code is therefore timed on nanolm's own runner, switched on for its rounds and off
    for nanolm's, so that the ratio is the patch's alone; ``nanolm_again`` (nanolm toggled
    against itself, no patch) is the noise floor of such ratios (0.4-2 % on the development CPU).
    """
    return Runner(name, base.step, base.model, base.device, patch)


def interleaved(runners: list[Runner], rounds: int, steps: int, warmup: int) -> tuple[dict, dict]:
    """Median (wall, CPU) seconds per step of each runner, rounds alternating their order."""
    for r in runners:
        r.timed(warmup)
    times = {r.name: [] for r in runners}
    for i in range(rounds):
        for r in runners if i % 2 == 0 else runners[::-1]:
            times[r.name].append(r.timed(steps))
    wall = {name: statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    return wall, cpu


def loader_seconds(tokens, eos, shape, calls: int = 200) -> float:
    """Median seconds of one ``pack_windows`` call (sampler included), the loader's whole work."""
    sampler = WindowSampler(len(tokens), shape["seq_len"], shape["batch_size"], seed=1)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        pack_windows(tokens, sampler.next_starts(), shape["seq_len"], eos, doc_mask=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


MATMUL_OPS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1)}  # which arguments are the two matrices


def matmul_floor_seconds(runner: Runner, repeats: int = 7) -> tuple[float, int]:
    """(seconds, count) of the matrix multiplies of one ``runner`` step, timed alone.

    A dispatch mode records the shapes and dtypes of every ``mm``/``addmm``/``bmm`` that one
    step calls (forward, backward, output head; not attention's own kernel, which multiplies
    inside SDPA; under autocast the call as it reaches the kernel, in the low-precision dtype);
    the same products are then run back to back on fixed random inputs (one pair per distinct
    shape and dtype), outside the recording, and the median of ``repeats`` passes is returned.
    It is the compute limit of the step on this machine: what it would cost were everything
    else free (and the inputs warm in cache, so a slightly optimistic one). A dispatch mode
    rather than the profiler: the profiler's record of dtypes differs between PyTorch versions
    (2.11's has none).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordProducts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            which = MATMUL_OPS.get(func.overloadpacket.__name__)
            if which is not None:
                self.seen.append((tuple(args[which[0]].shape), tuple(args[which[1]].shape), args[which[0]].dtype))
            return func(*args, **(kwargs or {}))

    with RecordProducts() as recorded:
        runner.step()
    inputs, products = {}, []
    for key in recorded.seen:
        if key not in inputs:
            inputs[key] = (
                torch.randn(key[0], device=runner.device, dtype=key[2]),
                torch.randn(key[1], device=runner.device, dtype=key[2]),
            )
        products.append(inputs[key])

    def mm(a, b):
        return torch.bmm(a, b) if a.dim() == 3 else torch.mm(a, b)

    times = []
    for _ in range(repeats + 1):
        sync(runner.device)
        start = time.perf_counter()
        for a, b in products:
            mm(a, b)
        sync(runner.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), len(products)


def load_tokens(data: str | None, tmp: Path):
    if data:
        source = Path(data)
    else:
        source = tmp / "stories.txt"
        write_stories(source, 3000, seed=0)
    prepared = prepare(source, tmp / "prepared", "char", progress=False, log=lambda *_: None)
    return np.array(prepared.train.tokens), prepared.tokenizer.vocab_size, prepared.tokenizer.eos_id


def peak_memory(device) -> dict:
    out = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device.type == "cuda":
        out["peak_vram_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


def build_runners(args, shape, vocab, tokens, eos, device, precision, threads):
    auto = precision.autocast
    bf16 = resolve_precision("bf16", device).autocast
    runners = [
        nanolm_runner("nanolm", shape, vocab, tokens, eos, device, auto),
        nanolm_runner("nanolm_mask_off", shape, vocab, tokens, eos, device, auto, doc_mask=False),
    ]
    extra_bf16 = device.type == "cpu" and precision.name == "fp32" and cpu_has_native_bf16()
    if extra_bf16:
        runners.append(nanolm_runner("nanolm_bf16", shape, vocab, tokens, eos, device, bf16))
    if not args.no_reference:
        runners.append(
            reference_runner(shape, vocab, tokens, device, resolve_precision(args.reference_precision, device).autocast)
        )
    base = runners[0]
    if args.ablations or args.breakdown:
        runners += [
            nanolm_runner("nanolm_twin", shape, vocab, tokens, eos, device, auto),  # another runner: its noise
            toggled(base, "nanolm_again"),
        ]  # the same runner again: the noise of the toggled variants
    if args.ablations:
        sdpa_as_is = functools.partial(patched, attention=F.scaled_dot_product_attention)
        qkv_indexed = functools.partial(
            patched, nanolm.model.Attention, queries_keys_values=queries_keys_values_indexed
        )
        runners += [
            nanolm_runner("before_fused_adamw", shape, vocab, tokens, eos, device, auto, fused_adamw=False),
            before_rope(toggled(base, "before_rope_roll")),
            toggled(base, "before_qkv_split", qkv_indexed),
            before_rope(
                nanolm_runner(
                    "before_all", shape, vocab, tokens, eos, device, auto, fused_adamw=False, patch=qkv_indexed
                )
            ),
        ]
        if extra_bf16:
            runners.append(
                nanolm_runner("before_fp32_attention_bf16", shape, vocab, tokens, eos, device, bf16, patch=sdpa_as_is)
            )
    if args.breakdown:
        runners += [
            model_in_plain_loop_runner("nanolm_model_in_plain_loop", shape, vocab, tokens, device, auto),
            toggled(base, "without_rope", functools.partial(patched, apply_rope=lambda x, cos, sin: x)),
            toggled(
                base,
                "layer_norm_for_rms_norm",
                functools.partial(patched, nanolm.model.RMSNorm, forward=layer_norm_instead),
            ),
        ]
    if args.compile:
        for r in [
            nanolm_runner("nanolm_compiled", shape, vocab, tokens, eos, device, auto, compile=True),
            nanolm_runner(
                "nanolm_mask_off_compiled", shape, vocab, tokens, eos, device, auto, doc_mask=False, compile=True
            ),
        ] + (
            [nanolm_runner("nanolm_bf16_compiled", shape, vocab, tokens, eos, device, bf16, compile=True)]
            if extra_bf16
            else []
        ):
            if threads:
                torch.set_num_threads(threads)
            start = time.perf_counter()
            r.timed(2)  # compiles (forward, backward)
            r.compile_s = round(time.perf_counter() - start, 1)
            runners.append(r)
    for r in runners:
        r.threads = threads
    return runners


def time_ratios(runners, secs: dict, thread_counts: list) -> dict:
    """Each variant's time over nanolm's at the same thread count, nanolm compiled with the mask
    over without it, and every nanolm variant's speedup over the reference loop."""
    ratios = {}
    for suffix in [f"@{t}" for t in thread_counts] if len(thread_counts) > 1 else [""]:
        base = secs[f"nanolm{suffix}"]
        for r in runners:
            if r.name.endswith(suffix) and r.name != f"nanolm{suffix}":
                ratios[f"{r.name} / nanolm{suffix}"] = round(secs[r.name] / base, 3)
        if f"nanolm_compiled{suffix}" in secs:
            ratios[f"nanolm_compiled{suffix} / nanolm_mask_off_compiled{suffix}"] = round(
                secs[f"nanolm_compiled{suffix}"] / secs[f"nanolm_mask_off_compiled{suffix}"], 3
            )
        if f"reference{suffix}" in secs:
            for n in ("nanolm", "nanolm_bf16", "nanolm_compiled", "nanolm_bf16_compiled"):
                if f"{n}{suffix}" in secs:
                    ratios[f"speedup {n}{suffix} over reference{suffix}"] = round(
                        secs[f"reference{suffix}"] / secs[f"{n}{suffix}"], 3
                    )
    return ratios


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="nanogpt,large", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--data", default=None, help="text file (default: generated stories), char tokenizer")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--precision",
        default=None,
        help="nanolm's --precision (default: fp32 on CPU, the reference's, with a nanolm_bf16 variant "
        "beside it where the CPU multiplies bf16 natively; auto elsewhere: bf16 on a GPU that has it)",
    )
    p.add_argument("--reference-precision", default="fp32")
    p.add_argument("--threads", default="", help="comma-separated thread counts to compare (default: PyTorch's)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=None, help="override the shapes' batch size")
    p.add_argument("--no-reference", action="store_true", help="skip the plain loop")
    p.add_argument("--ablations", action="store_true", help="also nanolm with each optimisation undone")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also what each difference from the reference costs: nanolm's model in the reference's "
        "loop, nanolm without RoPE, with LayerNorm for RMSNorm (stand-ins, not models to train)",
    )
    p.add_argument("--compile", action="store_true", help="also nanolm under torch.compile (slow to start)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="for MFU on CUDA (H100/H200 bf16 dense: 989)")
    args = p.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU is available")
    precision = resolve_precision(args.precision or ("fp32" if device.type == "cpu" else "auto"), device)
    thread_counts = [int(t) for t in args.threads.split(",") if t] or [None]
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "precision": precision.name,
        "default_threads": torch.get_num_threads(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "shapes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tokens, char_vocab, eos = load_tokens(args.data, Path(tmp))
    for name in args.shapes.split(","):
        shape = dict(SHAPES[name])
        vocab = shape.pop("vocab_size", char_vocab)
        if args.batch_size:
            shape["batch_size"] = args.batch_size
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        runners = []
        for threads in thread_counts:
            group = build_runners(args, shape, vocab, tokens, eos, device, precision, threads)
            for r in group:
                r.name += f"@{threads}" if len(thread_counts) > 1 else ""
            runners += group
        seconds, cpu_seconds = interleaved(runners, args.rounds, args.steps, args.warmup)
        tokens_per_step = shape["batch_size"] * shape["seq_len"]
        flops = runners[0].model.flops_per_token()
        out = {
            "shape": shape,
            "vocab_size": vocab,
            "parameters": runners[0].model.num_params(),
            "flops_per_token": flops,
        }
        for r in runners:
            tps = tokens_per_step / seconds[r.name]
            row = {
                "ms_per_step": round(seconds[r.name] * 1e3, 2),
                "tokens_per_sec": round(tps),
                "gflops_per_sec": round(flops * tps / 1e9, 1),
                "cpu_ms_per_step": round(cpu_seconds[r.name] * 1e3, 2),
            }
            if device.type == "cuda" and not r.name.startswith("reference"):
                row["mfu"] = round(flops * tps / (args.peak_tflops * 1e12), 4)
            if hasattr(r, "compile_s"):
                row["compile_s"] = r.compile_s
            out[r.name] = row
        out["time_ratios"] = {
            kind: time_ratios(runners, secs, thread_counts)  # "cpu": process CPU time,
            for kind, secs in (("wall", seconds), ("cpu", cpu_seconds))
        }  # robust on a busy machine
        loader = loader_seconds(tokens, eos, shape)
        out["loader_ms_per_step"] = round(loader * 1e3, 3)
        out["loader_share_of_step"] = round(loader / seconds[runners[0].name], 4)
        if runners[0].threads:
            torch.set_num_threads(runners[0].threads)
        floor, count = matmul_floor_seconds(runners[0])
        out["matmuls_alone"] = {
            "count_per_step": count,
            "ms_per_step": round(floor * 1e3, 2),
            "share_of_nanolm_step": round(floor / seconds[runners[0].name], 3),
        }
        results["shapes"][name] = out
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    results.update(peak_memory(device))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
