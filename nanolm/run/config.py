"""Run configuration: one small dataclass per concern, TOML in and out, flags for free.

Every option lives in exactly one place: a field of :class:`ModelOptions`,
:class:`DataOptions`, :class:`OptimOptions` or :class:`TrainOptions`, with its default
and its help text. The command-line flag ``--some-option`` and the TOML key
``some_option`` (in the section of its dataclass) are derived from the field, so they
cannot drift apart. Precedence: defaults < ``--config FILE.toml`` < command line.

A run writes its *resolved* configuration (derived values such as ``min_lr`` and
``warmup`` filled in) to ``config.toml``, so ``--config runs/x/config.toml`` repeats it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..base.documents import LARGEST_INTEGER, read_toml
from ..base.files import require_utf8
from ..batches import DEFAULT_EVAL_WINDOWS
from ..distributed import torchrun_env
from ..errors import NanolmError, brief
from ..model import ATTENTION_BACKENDS, MLP_KINDS, GPTConfig
from ..optim import OPTIMIZERS, muon_available
from ..precision import PRECISIONS
from ..step import SCHEDULES, default_min_lr
from ..tokenizer import EOS, MAX_BPE_VOCAB
from ..tokenizer import KINDS as TOKENIZER_KINDS
from ..watch.guards import NAN_ACTIONS, SPIKE_ACTIONS
from ..watch.sinks import LOG_SINKS, PROGRESS_MODES, parse_sinks
from .budget import NO_STEP_LIMIT, parse_duration

MAX_THREADS = 1024
"""The most CPU threads a run may ask for: twice the logical cores of the largest CPUs made. Far
more (tens of thousands) exhausts what the system lets one process start, and the thread pool
then crashes the process (a segmentation fault) instead of raising an error."""


def option(default, help: str, choices=None, flag: str | None = None, parse=None, shown: str | None = None):
    """A field with its help text; ``parse`` reads a value written as text (``--threads auto``);
    ``shown`` is the default as --help writes it, where the value itself would not say it."""
    metadata = {"help": help, "choices": choices, "flag": flag, "parse": parse, "shown": shown}
    return field(default=default, metadata=metadata)


def count_or_auto(text: str) -> int:
    """``auto`` (0) or a number (of threads, of positions per chunk): `--threads auto`, `--loss-chunk 256`."""
    return 0 if str(text).strip().lower() == "auto" else int(text)


count_or_auto.__name__ = "'auto' or whole number"  # argparse names the expected type by it: "invalid ... value"


@dataclass
class ModelOptions:
    seq_len: int = option(128, "context length in tokens (the window the model sees)")
    n_layer: int = option(4, "number of transformer blocks")
    n_head: int = option(4, "attention heads per block (must divide n_embd)")
    n_embd: int = option(128, "width of the residual stream")
    mlp: str = option("swiglu", "MLP kind", choices=MLP_KINDS)
    qk_norm: bool = option(False, "RMS-normalise queries and keys per head (bounds attention logits)")
    rope_theta: float = option(10000.0, "RoPE base: larger means slower-turning positions")
    tie_embeddings: bool = option(True, "share the input embedding and the output head")
    dropout: float = option(0.0, "dropout probability (0 is right for single-epoch pretraining)")
    attention: str = option(
        "auto",
        "attention kernel for the document mask: auto (FlexAttention on CUDA with Triton, "
        "SDPA with a boolean mask elsewhere), sdpa, or flex (CUDA only for training)",
        choices=ATTENTION_BACKENDS,
    )
    loss_chunk: int = option(
        0,
        "positions whose logits the output head and the loss compute at once in training and "
        "evaluation: auto (or 0) keeps a chunk's fp32 logits in a CPU's cache (~4 MB) or under "
        "~128 MB on a GPU; a number >= batch_size x seq_len computes them whole (docs/benchmarks.md)",
        parse=count_or_auto,
    )

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(vocab_size=vocab_size, **dataclasses.asdict(self))


@dataclass
class DataOptions:
    data: str = option(
        "",
        "training text: a .txt/.jsonl/.parquet file, a directory of .txt files, "
        "or a directory made by `nanolm prepare`; empty = the built-in story corpus",
    )
    tokenizer: str = option("bpe", "tokenizer to train on the data", choices=TOKENIZER_KINDS)
    vocab_size: int = option(512, "BPE vocabulary size, EOS included (257 to 16777216); ignored by char")
    val_fraction: float = option(0.1, "share of the data held out for validation (whole documents)")
    doc_mask: bool = option(True, "block-diagonal attention: tokens never attend across a document boundary")
    reset_positions: bool = option(False, "restart RoPE positions at 0 at every document")
    mask_boundary: bool = option(
        False,
        "do not count the prediction of a document's first token (by default EOS opens each document and predicts it)",
    )
    random_offset: bool = option(False, "shift the window grid by a random offset every epoch")
    separator: str = option(EOS, "line that separates documents in a .txt file")
    text_field: str = option("text", "field (jsonl) or column (parquet) holding the text")
    stories: int = option(4000, "documents of the built-in story corpus (used when --data is empty)")


@dataclass
class OptimOptions:
    lr: float = option(3e-3, "peak learning rate")
    min_lr: float | None = option(None, "final learning rate, where the decay ends (default: lr / 10)")
    warmup: int | None = option(None, "linear warmup steps (default: steps / 10, at most 200)")
    schedule: str | None = option(
        None,
        "the rate after warmup: cosine (decays from the end of warmup to --min-lr at "
        "--steps; the default) or wsd (warmup-stable-decay: the peak rate until the last --decay-fraction of "
        "the steps, then a straight line down to --min-lr; the default with --time-budget, which starts the "
        "decay by the clock; docs/speedrun.md)",
        choices=SCHEDULES,
    )
    decay_fraction: float = option(
        0.2,
        "with --schedule wsd: the share of --steps spent decaying at the end (with --time-budget: of the steps that fit)",
    )
    weight_decay: float = option(0.1, "AdamW weight decay on matrices (never on norms, biases, embeddings)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    clip: float = option(1.0, "clip the global gradient norm to this value (0 = never clip)")
    optimizer: str = option(
        "adamw",
        "adamw, or muon: Muon (orthogonalised momentum) on the hidden matrices, AdamW on "
        "embeddings, head, norms and biases (needs PyTorch >= 2.9; docs/speedrun.md)",
        choices=OPTIMIZERS,
    )
    muon_lr: float | None = option(
        None,
        "with --optimizer muon: peak learning rate of the hidden matrices (default: "
        "--lr; Muon's update is scaled to AdamW's size, so the same rate means the same "
        "step); the schedule (warmup, then --schedule's decay) applies to it alike",
    )
    muon_momentum: float = option(0.95, "with --optimizer muon: Muon's (Nesterov) momentum")


@dataclass
class TrainOptions:
    steps: int | None = option(
        None, "optimizer steps (default 1000; with --time-budget, the most steps its plan may take: default no limit)"
    )
    time_budget: float | None = option(
        None,
        "train for this long instead of a number of steps: 60, 90s, 5m, 1h (off: none). The run measures "
        "a step and an evaluation, plans its steps, warmup and warmup-stable-decay schedule to end its "
        "training and final evaluation inside the budget, and starts the decay by the clock (docs/speedrun.md)",
        parse=parse_duration,
        shown="off",
    )
    batch_size: int = option(16, "sequences per micro-batch")
    grad_accum: int = option(1, "micro-batches per optimizer step (tokens/step = batch_size × grad_accum × seq_len)")
    seed: int = option(1337, "seed for initialisation, data order and sampling")
    device: str = option("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    threads: int = option(
        0,
        "CPU threads for PyTorch's kernels: auto (or 0) measures, at the second step and "
        "whenever the machine's load changes, which count (all cores, half, one) runs the step "
        "fastest, and switches only for a clear gain: on a machine other jobs also use, fewer "
        "threads than cores is often several times faster. A number (up to 1024) fixes the count "
        "(--deterministic keeps PyTorch's default); docs/benchmarks.md",
        parse=count_or_auto,
    )
    process_tuning: str = option(
        "auto",
        "auto: the nanolm command (and python -m nanolm.train) tunes its own process "
        "for the run: on a CPU the C allocator keeps freed buffers for the next step, and the "
        "garbage collector skips the objects that live until exit; off: neither. train() "
        "called from Python never tunes the process (docs/benchmarks.md)",
        choices=("auto", "off"),
    )
    compile: bool = option(
        False,
        "torch.compile the blocks (one compiled block, reused by all): seconds to tens of seconds of "
        "compiling at the first step, less when this machine compiled the same shape before, then "
        "faster steps; a --time-budget counts the compiling (docs/benchmarks.md has the break-even "
        "on a CPU); leave it off while debugging",
    )
    precision: str = option(
        "auto",
        "number format: auto (bf16 on a GPU or CPU that multiplies it natively, fp16 with loss scaling on a GPU "
        "without bf16 tensor cores such as a T4 or V100, else fp32), fp32, bf16 or fp16 "
        "(autocast over fp32 weights; fp16 adds loss scaling), bf16-pure (bf16 weights, "
        "stochastic rounding); see docs/precision.md",
        choices=PRECISIONS,
    )
    fp32_master: bool = option(
        False,
        "with --precision bf16-pure: keep an fp32 master copy of the weights in the "
        "optimizer (round to nearest) instead of stochastic rounding",
    )
    eval_every: int = option(100, "evaluate on the validation set every N steps (and at the end)")
    eval_at_start: bool = option(
        True,
        "evaluate the untrained model at step 0: the reference that `nanolm diagnose` "
        "compares the run with (val_worse_than_start); skipping it saved 1-3 %% of the CPU speedrun",
    )
    eval_windows: int | None = option(
        None,
        "validation windows per evaluation, at most what the split holds: one fixed set whatever "
        "--batch-size, --grad-accum or the ranks (default: 320 for a new run, its own for a run continued)",
    )
    eval_batches: int | None = option(
        None, "the earlier sizing, still read: N batches of --batch-size per rank (--eval-windows wins)"
    )
    log_every: int = option(10, "print and record training metrics every N steps")
    stats_every: int = option(
        50,
        "record per-layer statistics after step 1 and every N steps: weight and gradient "
        "norms, update/weight ratios, max attention logit, dead MLP units, activation RMS (0 = never)",
    )
    log: str = option("", "extra metric sinks beside metrics.jsonl, comma-separated: " + ", ".join(LOG_SINKS))
    progress: str = option(
        "auto", "terminal output: a progress bar, plain lines, or auto (a bar on a terminal)", choices=PROGRESS_MODES
    )
    peak_flops: float = option(
        0.0, "peak FLOP/s that MFU is measured against (0 = the data sheet for known GPUs, a measured matmul on CPU)"
    )
    out_dir: str = option(
        "",
        "run directory (default: runs/<data name>, or runs/<data name>-N when that holds a "
        "different run; the same command always finds its own run there and continues it)",
    )
    sample_tokens: int = option(200, "tokens to generate as a sample at the end (0 = none)")
    target_val_bpb: float = option(
        0.0,
        "stop as soon as an evaluation's val bpb is at or below this, as if --steps "
        "were reached there (0 = never); the LR schedule still spans --steps",
    )
    ckpt_every: int | None = option(
        None,
        "save a checkpoint every N steps (default: at every evaluation); "
        "one is always saved at the end and on SIGINT/SIGTERM",
    )
    keep: int = option(3, "checkpoints to keep: the newest K plus the best by validation loss (0 = keep all)")
    resume: str = option(
        "auto",
        "auto: continue the run in --out-dir from its newest valid checkpoint, finish it, "
        "or restart an attempt that never saved one; never: only start a new run (a directory "
        "with checkpoints is refused); or the path of a checkpoint (or run) directory to continue from",
    )
    tf32: bool = option(
        True,
        "with --precision fp32 on an Ampere or later NVIDIA GPU: matrix products on TF32 tensor "
        "cores (fp32 range, 10-bit mantissa, fp32 accumulation; several times fp32's peak); --no-tf32 keeps full fp32 "
        "products (docs/gpu.md)",
    )
    deterministic: bool = option(
        False, "make every kernel deterministic (torch.use_deterministic_algorithms); free on CPU, slower on GPU"
    )
    dist: str = option(
        "auto",
        "data parallelism under torchrun: ddp (every rank holds the whole model), fsdp "
        "(weights, gradients and optimizer state sharded across ranks), none, or auto (ddp when "
        "torchrun started several processes); see docs/distributed.md",
        choices=("auto", "none", "ddp", "fsdp"),
    )


@dataclass
class GuardOptions:
    on_nan: str = option(
        "rollback",
        "on a non-finite loss or gradient: stop, skip the update, or roll back to the "
        "last checkpoint and skip the offending batches",
        choices=NAN_ACTIONS,
    )
    on_spike: str = option(
        "warn", "on a loss or gradient-norm spike: off, warn, skip the update, or roll back", choices=SPIKE_ACTIONS
    )
    spike_threshold: float = option(6.0, "a spike is this many robust standard deviations above the recent median")
    spike_window: int = option(50, "steps of history the spike detector compares with")
    max_rollbacks: int = option(3, "stop with a report after this many rollbacks")
    rollback_lr_scale: float = option(1.0, "multiply the learning rate by this after each rollback (e.g. 0.5)")


@dataclass
class DebugOptions:
    """Deliberate breakage for tests and the lab (``nanolm lab``); hidden from --help.

    Each switch breaks the real training code in one known way, so that what the logs show
    and what ``nanolm diagnose`` says can be checked against the truth. The training code
    never reads them: ``nanolm.instruments.faults`` turns them into broken components that
    replace the run's own.
    """

    drop_optimizer_state: bool = option(
        False, "on resume, do not restore the optimizer state", flag="debug-drop-optimizer-state"
    )
    kill_after_checkpoint: int = option(
        0, "SIGKILL this process right after saving the checkpoint of this step", flag="debug-kill-after-checkpoint"
    )
    unshifted_targets: bool = option(
        False, "targets are the inputs themselves, not the next tokens", flag="debug-unshifted-targets"
    )
    non_causal: bool = option(False, "attention sees the whole window, future included", flag="debug-non-causal")
    loss_not_averaged: bool = option(
        False, "micro-batch losses are not divided by the accumulation count", flag="debug-loss-not-averaged"
    )
    no_loss_scaling: bool = option(False, "fp16 without loss scaling", flag="debug-no-loss-scaling")
    corrupt_data: float = option(
        0.0,
        "replace this share of the training tokens (one contiguous region) with random ids",
        flag="debug-corrupt-data",
    )
    inject_nan_at: int = option(0, "make one gradient non-finite at this step", flag="debug-inject-nan-at")
    inject_spike_at: int = option(
        0, "multiply this step's loss and gradients by 100, like one bad batch", flag="debug-inject-spike-at"
    )
    decay_everything: bool = option(
        False, "apply weight decay to every parameter: norms, biases and embeddings too", flag="debug-decay-everything"
    )
    random_targets: bool = option(
        False, "targets drawn at random, independently of the inputs", flag="debug-random-targets"
    )


SECTIONS = {
    "model": ModelOptions,
    "data": DataOptions,
    "optim": OptimOptions,
    "train": TrainOptions,
    "guard": GuardOptions,
    "debug": DebugOptions,
}
HIDDEN_SECTIONS = {"debug"}


@dataclass
class RunConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    guard: GuardOptions = field(default_factory=GuardOptions)
    debug: DebugOptions = field(default_factory=DebugOptions)

    def resolved(self) -> "RunConfig":
        """A copy with derived defaults filled in and every value checked."""
        cfg = RunConfig(*(dataclasses.replace(getattr(self, s)) for s in SECTIONS))
        o, t = cfg.optim, cfg.train
        if o.min_lr is None:
            o.min_lr = default_min_lr(o.lr)
        if o.schedule is None:
            o.schedule = "cosine" if t.time_budget is None else "wsd"
        if t.steps is None:
            t.steps = 1000 if t.time_budget is None else NO_STEP_LIMIT
        if o.warmup is None and t.time_budget is None:  # a time budget's plan sets it from the steps that fit
            o.warmup = min(200, t.steps // 10)
        if o.optimizer == "muon" and o.muon_lr is None:
            o.muon_lr = o.lr
        if t.ckpt_every is None:
            t.ckpt_every = t.eval_every
        if t.eval_windows is None and t.eval_batches:  # counted per rank
            t.eval_windows = t.eval_batches * t.batch_size * (torchrun_env() or (0, 1, 0))[1]
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Every option checked before anything is read or written: one line naming the
        option, the value and what it must be."""
        m, d, o, t, g = self.model, self.data, self.optim, self.train, self.guard

        def need(ok: bool, name: str, value, rule: str) -> None:
            if not ok:
                raise NanolmError(f"--{flag_name(name)} must be {rule}, got {_brief(value)}")

        def finite(x) -> bool:
            return isinstance(x, (int, float)) and math.isfinite(x)

        for section in SECTIONS:  # config.toml is UTF-8: a name that is not (a byte such as 0xE9) cannot be kept
            for f in dataclasses.fields(getattr(self, section)):
                value = getattr(getattr(self, section), f.name)
                if isinstance(value, str):
                    require_utf8(f"--{flag_name(f.name)}", value, "the run's config.toml must hold it")
                if isinstance(value, int) and not isinstance(value, bool):  # TOML's integers are 64-bit
                    need(
                        -LARGEST_INTEGER <= value < LARGEST_INTEGER,
                        f.name,
                        value,
                        "below 2^63 (the run's config.toml holds 64-bit integers)",
                    )
        for name, value in (
            ("steps", t.steps),
            ("batch_size", t.batch_size),
            ("grad_accum", t.grad_accum),
            ("eval_every", t.eval_every),
            ("log_every", t.log_every),
            ("stories", d.stories),
            ("n_layer", m.n_layer),
            ("n_head", m.n_head),
            ("n_embd", m.n_embd),
        ):
            need(value > 0, name, value, "positive")
        need(
            t.ckpt_every is None or t.ckpt_every > 0,
            "ckpt_every",
            t.ckpt_every,
            "positive (a checkpoint every N steps)",
        )
        need(
            t.time_budget is None or (finite(t.time_budget) and t.time_budget > 0),
            "time_budget",
            t.time_budget,
            "a positive duration such as 60, 90s, 5m or 1h (off: train --steps)",
        )
        if t.time_budget is not None and o.schedule != "wsd":
            raise NanolmError(
                "--time-budget plans a warmup-stable-decay schedule, whose decay the clock starts; "
                "leave --schedule at its default (wsd with a budget), as a cosine decays from the first step by a count of steps"
            )
        need(t.eval_batches is None or t.eval_batches > 0, "eval_batches", t.eval_batches, "positive")
        need(t.eval_windows is None or t.eval_windows > 0, "eval_windows", t.eval_windows, "positive")
        need(finite(o.lr) and o.lr > 0, "lr", o.lr, "a positive number")
        need(
            o.min_lr is None or (finite(o.min_lr) and 0 <= o.min_lr <= o.lr),
            "min_lr",
            o.min_lr,
            f"between 0 and --lr ({o.lr})",
        )
        need(o.warmup is None or o.warmup >= 0, "warmup", o.warmup, ">= 0")
        need(
            finite(o.decay_fraction) and 0 < o.decay_fraction <= 1,
            "decay_fraction",
            o.decay_fraction,
            "in (0, 1]: the share of the steps that the wsd schedule spends decaying",
        )
        need(
            o.warmup is None or o.warmup <= t.steps,
            "warmup",
            o.warmup,
            f"at most --steps ({t.steps}): a warmup longer than the run never reaches --lr",
        )
        need(finite(o.weight_decay) and o.weight_decay >= 0, "weight_decay", o.weight_decay, ">= 0")
        need(finite(o.beta1) and 0 <= o.beta1 < 1, "beta1", o.beta1, "in [0, 1)")
        need(finite(o.beta2) and 0 <= o.beta2 < 1, "beta2", o.beta2, "in [0, 1)")
        need(finite(o.clip) and o.clip >= 0, "clip", o.clip, ">= 0 (0 disables clipping)")
        need(finite(m.rope_theta) and m.rope_theta > 0, "rope_theta", m.rope_theta, "a positive number")
        need(finite(m.dropout) and 0 <= m.dropout < 1, "dropout", m.dropout, "in [0, 1)")
        need(m.seq_len >= 2, "seq_len", m.seq_len, "at least 2")
        need(0 <= t.seed < 2**32, "seed", t.seed, "in [0, 2^32)")
        need(
            0 <= t.threads <= MAX_THREADS, "threads", t.threads, f"auto, or a number of threads from 1 to {MAX_THREADS}"
        )
        need(t.stats_every >= 0, "stats_every", t.stats_every, ">= 0 (0 = never)")
        need(t.keep >= 0, "keep", t.keep, ">= 0 (0 = keep every checkpoint)")
        need(t.sample_tokens >= 0, "sample_tokens", t.sample_tokens, ">= 0 (0 = no sample)")
        need(
            finite(t.peak_flops) and t.peak_flops >= 0,
            "peak_flops",
            t.peak_flops,
            "a FLOP/s figure >= 0 (0 = look it up)",
        )
        need(
            finite(t.target_val_bpb) and t.target_val_bpb >= 0,
            "target_val_bpb",
            t.target_val_bpb,
            ">= 0 (0 = no target)",
        )
        need(finite(d.val_fraction) and 0 <= d.val_fraction < 1, "val_fraction", d.val_fraction, "in [0, 1)")
        need(0 < d.vocab_size <= MAX_BPE_VOCAB, "vocab_size", d.vocab_size, f"positive and at most {MAX_BPE_VOCAB}")
        need(
            d.separator.strip() != "" and "\n" not in d.separator,
            "separator",
            d.separator,
            "one non-blank line of text",
        )
        unknown = [s for s in parse_sinks(t.log) if s not in LOG_SINKS]
        if unknown:
            raise NanolmError(
                f"unknown --log sink {unknown[0]!r}; known: {', '.join(LOG_SINKS)} (metrics.jsonl is always written)"
            )
        need(finite(g.spike_threshold) and g.spike_threshold > 0, "spike_threshold", g.spike_threshold, "> 0")
        need(g.spike_window >= 5, "spike_window", g.spike_window, ">= 5")
        need(g.max_rollbacks >= 0, "max_rollbacks", g.max_rollbacks, ">= 0")
        need(
            finite(g.rollback_lr_scale) and 0 < g.rollback_lr_scale <= 1,
            "rollback_lr_scale",
            g.rollback_lr_scale,
            "in (0, 1]",
        )
        if not 0 <= self.debug.corrupt_data < 1:
            raise NanolmError("--debug-corrupt-data must be in [0, 1)")
        if t.dist == "fsdp" and t.precision == "bf16-pure":
            raise NanolmError(
                "--precision bf16-pure does not combine with --dist fsdp (its stochastic rounding works "
                "on whole tensors, FSDP holds shards); use --precision bf16, or --dist ddp"
            )
        need(o.muon_lr is None or (finite(o.muon_lr) and o.muon_lr > 0), "muon_lr", o.muon_lr, "a positive number")
        need(finite(o.muon_momentum) and 0 <= o.muon_momentum < 1, "muon_momentum", o.muon_momentum, "in [0, 1)")
        if o.optimizer == "muon":
            if not muon_available():
                raise NanolmError(
                    f"--optimizer muon needs PyTorch >= 2.9 (torch.optim.Muon); this is {torch.__version__}. "
                    f"Upgrade PyTorch, or use --optimizer adamw"
                )
            if t.dist == "fsdp":
                raise NanolmError(
                    "--optimizer muon does not combine with --dist fsdp (Muon orthogonalises whole "
                    "matrices, FSDP holds each in shards); use --dist ddp"
                )
            if t.precision == "bf16-pure":
                raise NanolmError(
                    "--optimizer muon does not combine with --precision bf16-pure (its bf16 optimizer "
                    "is AdamW's); use --precision bf16"
                )
        elif o.muon_lr is not None:
            raise NanolmError("--muon-lr only applies to --optimizer muon")
        if t.fp32_master and t.precision != "bf16-pure":
            raise NanolmError(
                "--fp32-master only applies to --precision bf16-pure (fp32, bf16 and fp16 keep fp32 weights already)"
            )
        m.gpt_config(vocab_size=1)  # shape checks (n_embd divisible by n_head, ...)

    def to_toml(self) -> str:
        lines = []
        for section in SECTIONS:
            if section in HIDDEN_SECTIONS and getattr(self, section) == SECTIONS[section]():
                continue
            lines.append(f"[{section}]")
            for f in dataclasses.fields(getattr(self, section)):
                value = getattr(getattr(self, section), f.name)
                if value is not None:
                    lines.append(f"{f.name} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}


def _toml_value(value) -> str:
    """A value as TOML writes it. In a string, TOML allows no control character but the tab
    (a path or separator holding a carriage return would make a config.toml the run itself
    cannot read back), so those are written as escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    escaped = "".join(
        "\\" + ch if ch in '"\\' else f"\\u{ord(ch):04x}" if (ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F else ch
        for ch in str(value)
    )
    return f'"{escaped}"'


def flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")


@functools.cache
def _hints(section: type) -> dict:
    """A section's field types, resolved once: resolving a class's annotations evaluates every
    one of them again, and each command's parser and each config read ask for every option's."""
    return typing.get_type_hints(section)


def _field_type(f) -> type:
    hint = _hints(_OWNER[f.name])[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


_OWNER = {f.name: cls for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
assert len(_OWNER) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values()), "option names must be unique"


def _brief(value) -> str:
    return brief(repr(value), 80)  # a crafted file's megabyte string is not quoted whole


def _coerce(name: str, value, source: str):
    f = next(f for f in dataclasses.fields(_OWNER[name]) if f.name == name)
    kind = _field_type(f)
    if f.metadata["parse"] and isinstance(value, str):
        try:
            value = f.metadata["parse"](value)
        except ValueError:
            raise NanolmError(
                f"{name} in {source} must be a {f.metadata['parse'].__name__}, got {_brief(value)}"
            ) from None
        if value is None:  # "off"
            return None
    if kind is bool:
        if not isinstance(value, bool):
            raise NanolmError(f"{name} in {source} must be true or false, got {_brief(value)}")
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise NanolmError(f"{name} in {source} must be a {kind.__name__}, got {_brief(value)}")
    return value


def load_toml(path) -> dict[str, dict]:
    """Sections and values of a config file, checked against the known options."""
    path = Path(path)
    if not path.exists():
        raise NanolmError(f"config file {path} does not exist")
    raw = read_toml(path, f"config file {path}")
    out: dict[str, dict] = {}
    known_sections = ", ".join(f"[{s}]" for s in SECTIONS)
    for section, values in raw.items():
        if section not in SECTIONS:
            raise NanolmError(f"unknown section [{_brief(section)[1:-1]}] in {path}; known: {known_sections}")
        if not isinstance(values, dict):
            raise NanolmError(
                f"{section} in {path} must be a table of options ([{section}] and its lines), got "
                f"{type(values).__name__} {_brief(values)}"
            )
        known = {f.name for f in dataclasses.fields(SECTIONS[section])}
        for key, value in values.items():
            if key not in known:
                hint = f" (it belongs in [{_section_of(key)}])" if key in _OWNER else ""
                raise NanolmError(
                    f"unknown option {_brief(key)} in [{section}] of {path}{hint}; known: {', '.join(sorted(known))}"
                )
            out.setdefault(section, {})[key] = _coerce(key, value, str(path))
    return out


def _section_of(name: str) -> str:
    return next(s for s, cls in SECTIONS.items() if cls is _OWNER[name])


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option field, grouped by section, each showing its default."""
    parser.add_argument("--config", metavar="FILE.toml", help="read options from a TOML file (flags override it)")
    for section, cls in SECTIONS.items():
        hidden = section in HIDDEN_SECTIONS
        group = parser if hidden else parser.add_argument_group(f"{section} options")
        for f in dataclasses.fields(cls):
            kind = _field_type(f)
            default = f.default
            shown = f.metadata["shown"] or ("derived" if default is None else ('""' if default == "" else default))
            help_text = argparse.SUPPRESS if hidden else f"{f.metadata['help']} (default: {shown})"
            kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = f.metadata["parse"] or kind
                kwargs["metavar"] = f.name.upper() if not f.metadata["choices"] else None
                if f.metadata["choices"]:
                    kwargs["choices"] = f.metadata["choices"]
            group.add_argument(f"--{f.metadata['flag'] or flag_name(f.name)}", **kwargs)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults, then the TOML file, then the flags given on the command line."""
    values: dict[str, dict] = {s: {} for s in SECTIONS}
    if getattr(args, "config", None):
        for section, vals in load_toml(args.config).items():
            values[section].update(vals)
    for name, cls in _OWNER.items():
        if hasattr(args, name):
            values[_section_of(name)][name] = getattr(args, name)
    for section in values:  # choices given through TOML are checked here
        for name, value in values[section].items():
            choices = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name).metadata["choices"]
            if choices and value not in choices:
                raise NanolmError(f"{name} must be one of {', '.join(choices)}, got {_brief(value)}")
    return RunConfig(**{s: SECTIONS[s](**values[s]) for s in SECTIONS}).resolved()


def load_run_config(path) -> RunConfig:
    """The resolved configuration stored in a run directory's ``config.toml``."""
    values = load_toml(path)
    cfg = RunConfig(**{s: SECTIONS[s](**values.get(s, {})) for s in SECTIONS}).resolved()
    cfg.train.eval_windows = cfg.train.eval_windows or DEFAULT_EVAL_WINDOWS  # a run writes it; a hand-made file may not
    return cfg
