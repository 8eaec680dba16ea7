"""Training: the loop, read top to bottom, and ``python -m nanolm.train``.

One optimizer step, in order:

1. set the learning rate for this step (a pure function of the step number);
2. draw ``grad_accum`` micro-batches; :func:`accumulate_gradients` counts the tokens that
   count in *all* of them, then for each micro-batch runs forward, divides the sum of its
   token losses by that step-wide count, and runs backward (gradients add up);
3. every ``--stats-every`` steps: take per-layer statistics (see ``nanolm.diagnostics``);
4. fp16 only: divide the gradients by the loss scale; clip the global gradient norm once,
   after every backward pass;
5. update the weights (fp16: unless a gradient overflowed), zero the gradients;
6. every few steps: log (``metrics.jsonl``, the terminal, wandb/TensorBoard if asked),
   evaluate on the fixed validation set, save a checkpoint.

Dividing each micro-batch's *sum* by the step-wide count makes the accumulated gradient
exactly the gradient of the mean loss over every counted token of the step, the same as
one big batch. Averaging per-micro-batch means instead would weigh a token in a short
micro-batch more than one in a long micro-batch.

Under torchrun (``nanolm.distributed``) the step-wide count is also summed over every rank,
gradients are summed across ranks after the last micro-batch only, and rank 0 logs and
writes the run directory: the same step, split over processes.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from .checkpoint import clear_final, load_state, read_checkpoint_meta
from .config import RunConfig, load_run_config, resume_differences
from .corpus import write_stories
from .download import resolve_data_path
from .data import Batch, PreparedData, WindowSampler, eval_batches, pack_windows, prepare
from .distributed import Distributed, Muted, gradient_sync, launch
from .errors import NanolmError
from .files import atomic_write_text, read_json
from .loss import masked_cross_entropy_sum
from .model import GPT
from .diagnostics import LayerStats, StepMeter, is_stats_step, peak_flops
from .guards import Guard, nan_origin
from .monitor import Monitor, missing_sink_packages, parse_sinks, perplexity
from .optim import build_optimizer, cosine_lr, get_param_groups
from .plan import check_memory
from .precision import BF16AdamW, DynamicLossScaler, cast_weights_, grad_zero_fraction, resolve_precision
from .rundir import locate_run, valid_resume_checkpoint
from .tokenizer import Tokenizer


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator | None = None):
    """The simplest batcher: ``batch_size`` windows at uniformly random offsets.

    This is "packing without regard to boundaries": a window can start in the middle of
    one document and run into the next, and the model, attending causally over the whole
    window, conditions the second document on the first. It learns that an unrelated text
    predicts the next story's opening, which is noise at best and a leak at worst, and
    positions restart nowhere. Random offsets also revisit some tokens and skip others
    within an "epoch". nanolm's own pipeline (``nanolm.data``) masks attention at document
    boundaries and visits every window once per epoch; this function stays as the
    baseline to compare against.

    Returns ``(x, y)``: inputs and the same windows shifted by one token.
    """
    starts = torch.randint(len(tokens) - seq_len - 1, (batch_size,), generator=generator).numpy()
    window = torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return window[:, :-1], window[:, 1:]


def accumulate_gradients(model, micro_batches: list[Batch], device, autocast=contextlib.nullcontext,
                         loss_scale: float = 1.0, step_count: int | None = None) -> tuple[torch.Tensor, int]:
    """Forward and backward over every micro-batch of one optimizer step.

    The tokens that count are first counted over *all* micro-batches; each micro-batch
    then backpropagates (sum of its token losses) ÷ (that count). The gradients that
    accumulate are exactly those of the mean loss over every counted token of the step,
    whatever the split, and a micro-batch with nothing to count adds zero.

    The forward pass runs under ``autocast()`` (see ``nanolm.precision``); the loss, in fp32,
    is multiplied by ``loss_scale`` before backward (fp16; the caller divides it out again).
    ``step_count`` overrides the count: under data parallelism it is the count summed over
    every rank, so that the gradients, once summed across ranks, are those of one big batch.
    A distributed model reduces gradients across ranks in the last micro-batch's backward
    pass only (the others accumulate locally).
    Returns (the mean loss over this process's counted tokens, detached and unscaled; the
    count used).
    """
    local_count = sum(int(b.counted) for b in micro_batches)
    step_count = max(1, local_count if step_count is None else step_count)
    loss_sum = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        batch = batch.to(device)
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            with autocast():
                logits, _ = model(batch.idx, doc_ids=batch.doc_ids, positions=batch.positions)
            micro_sum, _ = masked_cross_entropy_sum(logits, batch.targets, batch.loss_mask)
            (micro_sum / step_count * loss_scale).backward()
        loss_sum += micro_sum.detach()
    return loss_sum / max(1, local_count), step_count


@torch.no_grad()
def estimate_loss(model: GPT, batches: list[Batch], token_bytes: torch.Tensor, device="cpu", reduce=None) -> dict:
    """Loss (nats per counted token) and bits per byte over a fixed list of batches.

    Deterministic: the same batches, the model in eval mode (no dropout), sums accumulated
    in float64. Bits per byte divides the total information by the bytes of text the
    predicted tokens spell (EOS spells none), so it compares across tokenizers.
    ``reduce`` combines the three sums (nats, tokens, bytes) with other processes' before
    the division: each rank evaluates its share of the batches.
    """
    was_training = model.training
    model.eval()
    nats = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.int64, device=device)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    token_bytes = token_bytes.to(device)
    for batch in batches:
        batch = batch.to(device)
        logits, _ = model(batch.idx, doc_ids=batch.doc_ids, positions=batch.positions)
        total, count = masked_cross_entropy_sum(logits, batch.targets, batch.loss_mask)
        nats += total.double()
        tokens += count
        n_bytes += (token_bytes[batch.targets] * batch.loss_mask).sum()
    model.train(was_training)
    if reduce is not None:
        nats, tokens, n_bytes = reduce(nats, tokens, n_bytes)
    nats, tokens, n_bytes = nats.item(), tokens.item(), n_bytes.item()
    return {
        "loss": nats / max(tokens, 1),
        "bpb": nats / math.log(2) / max(n_bytes, 1),
        "tokens": tokens,
        "bytes": n_bytes,
    }


def load_training_data(cfg: RunConfig, scratch: Path, log=print) -> PreparedData:
    """The run's data, prepared (tokenized into shards) if it is raw text.

    No ``--data``: the built-in story corpus, generated from the seed, with its exact
    entropy. A directory made by ``nanolm prepare`` is used as it is, tokenizer included.
    A known corpus name (``shakespeare``, ``tinystories``) that is not a local path is
    downloaded once, verified and cached.
    """
    d = cfg.data
    if not d.data:
        source = scratch / "stories.txt"
        write_stories(source, d.stories, seed=0)  # the corpus stays fixed whatever --seed is
        log(f"data: {d.stories} generated stories (the built-in corpus; its entropy is known)")
    else:
        source = resolve_data_path(d.data, log)
        if (source / "meta.json").is_file():
            data = PreparedData(source)
            log(f"data: prepared shards in {source}; their {data.meta['tokenizer']} tokenizer of "
                f"{data.tokenizer.vocab_size} tokens is used (--tokenizer and --vocab-size do not apply)")
            return data
        log(f"data: {source}")
    return prepare(source, scratch / "data", d.tokenizer, d.vocab_size, d.val_fraction, d.separator,
                   d.text_field, seq_len=cfg.model.seq_len, progress=False, log=log)


def open_run_data(run_data: Path, checkpoint: Path, cfg: RunConfig, scratch: Path, log=print) -> PreparedData:
    """The tokenized data a resumed run trained on, checked against its manifest.

    A damaged copy is not trained on: the data is prepared again from its source, and if
    that gives back exactly the files the checkpoint was trained on (its data digest), the
    fresh copy replaces the damaged one (the caller moves it in); else the resume stops.
    """
    try:
        return PreparedData(run_data)
    except NanolmError as e:
        log(f"warning: {e}; preparing the run's data again from its source")
    data = load_training_data(cfg, scratch, log)
    if read_checkpoint_meta(checkpoint).get("data_digest") != data.digest:
        raise NanolmError(f"{run_data} is damaged, and its source ({cfg.data.data or 'the built-in corpus'}) no "
                          f"longer gives the data the run was trained on; restore the source, or start a new run "
                          f"with another --out-dir")
    return data


def step_count_without_averaging(micro_batches: list[Batch], grad_accum: int) -> int:
    """The lab's "loss not divided by grad_accum" bug: each micro-batch's mean is summed."""
    return max(1, sum(int(b.counted) for b in micro_batches) // grad_accum)


def poison_one_gradient(model: torch.nn.Module) -> None:
    """The lab's one-off fault: one gradient element becomes NaN (under FSDP, in rank 0's shard;
    the global norm then carries it to every rank)."""
    grad = next(model.parameters()).grad
    grad = grad.to_local() if hasattr(grad, "to_local") else grad
    if grad.numel():
        grad.view(-1)[0] = float("nan")


def corrupt_tokens(tokens: np.ndarray, share: float, vocab_size: int, seed: int) -> np.ndarray:
    """The lab's corrupted shard: one contiguous region of random ids (a copy; shards stay intact)."""
    out = np.array(tokens, dtype=np.int64)
    n = int(len(out) * share)
    start = min(len(out) // 3, len(out) - n)  # a third of the way in, or as far as a large share allows
    out[start : start + n] = np.random.default_rng(seed).integers(1, vocab_size, size=n)
    return out


class TrainingInterrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving a checkpoint; ``exit_code`` is 128 + signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopOnSignal:
    """Turns SIGINT/SIGTERM into a request to stop after the current step.

    Killing a run mid-step would lose everything since the last checkpoint; instead the
    loop finishes its step, saves a checkpoint and exits. A second Ctrl-C stops at once.
    """

    def __init__(self):
        self.requested: int | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def configure_determinism(enabled: bool) -> None:
    """Deterministic kernels everywhere, or PyTorch's defaults.

    On CPU nanolm's step is already deterministic for a given thread count, so this costs
    nothing there. On CUDA it forbids the non-deterministic (atomic-add) backward kernels,
    e.g. of the embedding lookup, which makes those slower, and raises on an operation that
    has no deterministic version at all.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled)


def configure_threads(threads: int, device: torch.device, log=print) -> None:
    """Set ``--threads`` and warn when the CPU is already busy with other work.

    PyTorch splits each CPU kernel across one thread per core, and every thread waits for
    the slowest at the end of each kernel. When another process holds a core, the thread on
    it runs late on every one of the thousands of small kernels of a step: measured at
    nanoGPT's shape on 2 cores with one of them busy, 2 threads ran 3.6k tokens/s against
    9.5k for 1 thread. The 1-minute load average is the only cheap sign of such a neighbour
    (it lags, so a job that just ended can trigger the hint).
    """
    if threads:
        torch.set_num_threads(threads)
    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return
    cores, used = os.cpu_count() or 1, torch.get_num_threads()
    busy = os.getloadavg()[0]
    if used > 1 and busy + used > cores + 0.75:
        log(f"cpu: {used} threads on {cores} cores while the load average says other processes keep ~{busy:.1f} "
            f"busy; PyTorch's threads wait on each other then (measured 2.6x slower steps on 2 cores with one "
            f"busy). If this run crawls, try --threads {max(1, cores - math.ceil(busy - 0.25))}.")


def train(cfg: RunConfig, log=print) -> dict:
    """Train a model as ``cfg`` says; returns the final figures. Writes the run directory.

    With ``--resume auto`` (the default) a run directory that holds checkpoints is continued
    from its newest valid one, exactly where it stopped. Under torchrun every process calls
    this; they train one model together (``--dist``).
    """
    cfg = cfg.resolved()
    device = resolve_device(cfg.train.device)
    if cfg.model.attention == "flex" and device.type != "cuda":
        raise NanolmError("FlexAttention has no backward pass on CPU or MPS; use --attention sdpa (or auto)")
    missing = missing_sink_packages(parse_sinks(cfg.train.log))
    if missing:
        raise NanolmError(f"--log {missing[0]} needs the {missing[0]} package: pip install 'nanolm[{missing[0]}]'")
    use_prepared_tokenizer(cfg)
    try:
        with launch(cfg.train.dist, device) as dist:
            return _train(cfg, dist, log if dist.is_main else Muted())
    except torch.OutOfMemoryError:
        raise NanolmError(f"out of memory on {device} (--batch-size {cfg.train.batch_size}, --seq-len "
                          f"{cfg.model.seq_len}); lower --batch-size and raise --grad-accum for the same tokens "
                          f"per step, then run the same command again: it resumes from the last checkpoint") from None


def use_prepared_tokenizer(cfg: RunConfig) -> None:
    """With ``--data DIR`` made by ``nanolm prepare`` the tokenizer is the one in DIR: the
    config says so (``--tokenizer``/``--vocab-size`` do not apply), so that two commands on
    the same shards have the same configuration."""
    d = cfg.data
    meta = Path(d.data) / "meta.json" if d.data else None
    if meta is not None and meta.is_file():
        prepared = read_json(meta)
        if isinstance(prepared, dict) and prepared.get("tokenizer") in ("bpe", "char") \
                and isinstance(prepared.get("vocab_size"), int):
            d.tokenizer, d.vocab_size = prepared["tokenizer"], prepared["vocab_size"]


def _train(cfg: RunConfig, dist: Distributed, log) -> dict:
    t, o, d, g = cfg.train, cfg.optim, cfg.data, cfg.guard
    device = dist.device
    precision = resolve_precision(t.precision, device)
    log(f"precision: {precision.describe()}")
    configure_threads(t.threads, device, log)
    if dist.active:
        log(f"distributed: {dist.describe()}")
    plan = dist.from_main(lambda: locate_run(cfg, dist.world_size, log))
    if plan.finished:
        log(plan.message)
        return {"out_dir": str(plan.out_dir), "finished": True}
    out_dir, checkpoint = plan.out_dir, plan.checkpoint
    configure_determinism(t.deterministic)
    seed_everything(t.seed)

    # ---- data: validated and tokenized in a scratch directory; out_dir is untouched so far.
    # Rank 0 prepares it; the other ranks then read what it wrote.
    with dist.main_first(), tempfile.TemporaryDirectory(prefix="nanolm-", ignore_cleanup_errors=True) as scratch:
        scratch = Path(scratch)
        run_data = out_dir / "data"
        if not dist.is_main and (run_data / "meta.json").is_file():
            data = PreparedData(run_data, verify=False)  # rank 0 has just written or verified it
        elif checkpoint is not None and run_data.exists() and not plan.restart:
            data = open_run_data(run_data, checkpoint, cfg, scratch, log)  # tokenized once, checked
        else:
            data = load_training_data(cfg, scratch, log)
        tokenizer = data.tokenizer
        if len(data.train) < cfg.model.seq_len + 1:
            raise NanolmError(
                f"the training split holds {len(data.train)} tokens, fewer than one window of "
                f"--seq-len + 1 = {cfg.model.seq_len + 1}; use more text or a smaller --seq-len"
            )
        if checkpoint is not None:
            check_resume_compatible(checkpoint, cfg, tokenizer, log, dist, data)
        model = GPT(cfg.model.gpt_config(tokenizer.vocab_size))
        data.check_vocab(model.config.vocab_size)
        check_memory(model.config, precision.name, dist, t.batch_size, t.eval_batches * t.batch_size * dist.world_size)
        config_toml = cfg.to_toml()
        if dist.is_main:  # config.toml first: it marks the directory as this run's (see nanolm.rundir)
            out_dir.mkdir(parents=True, exist_ok=True)
            if plan.restart:
                for stale in ("metrics.jsonl", "events.jsonl", "final.json"):
                    (out_dir / stale).unlink(missing_ok=True)
            atomic_write_text(out_dir / "config.toml", config_toml)
            tokenizer.save(out_dir / "tokenizer.json")
            if data.dir.parent == scratch:
                if run_data.exists():  # an attempt that never committed a checkpoint left it
                    shutil.rmtree(run_data)
                shutil.move(str(data.dir), run_data)
                data = PreparedData(run_data, verify=False)
    floor = data.meta.get("floor")

    # ---- model, optimizer, batches
    model.to(device)
    if precision.pure_bf16:
        cast_weights_(model, torch.bfloat16)
    step_model = dist.wrap(model)  # DDP around it, or sharded in place (FSDP): before the optimizer sees it
    dist.seed_this_rank(t.seed)
    if precision.pure_bf16:
        optimizer = BF16AdamW(get_param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                              master_weights=t.fp32_master, seed=t.seed)
    else:
        optimizer = build_optimizer(model, o.lr, o.weight_decay, betas=(o.beta1, o.beta2))
    scaler = DynamicLossScaler(enabled=precision.name == "fp16")
    step_model = torch.compile(step_model) if t.compile else step_model
    pack = dict(doc_mask=d.doc_mask, reset_positions=d.reset_positions, mask_boundary=d.mask_boundary)
    sampler = WindowSampler(len(data.train), cfg.model.seq_len, t.batch_size, seed=t.seed, random_offset=d.random_offset,
                            rank=dist.rank, world_size=dist.world_size)
    val_batches = eval_batches(data.val, cfg.model.seq_len, t.batch_size, tokenizer.eos_id,
                               max_windows=t.eval_batches * t.batch_size * dist.world_size, **pack)
    token_bytes = torch.from_numpy(tokenizer.token_bytes())
    tokens_per_step = t.batch_size * t.grad_accum * cfg.model.seq_len * dist.world_size
    counters = {"tokens_seen": 0, "elapsed_s": 0.0, "best_val_loss": None, "val_loss": None, "val_bpb": None,
                "lr_scale": 1.0, "rollbacks": 0}
    model.see_the_future = cfg.debug.non_causal
    if cfg.debug.no_loss_scaling:
        scaler = DynamicLossScaler(enabled=False)
    if cfg.debug.corrupt_data:
        data.train.tokens = corrupt_tokens(data.train.tokens, cfg.debug.corrupt_data, tokenizer.vocab_size, t.seed)

    def restore(path: Path, data_position: bool = True) -> int:
        """Load a checkpoint into the live run; returns its step. A rollback keeps the data
        position and the random streams (``data_position=False``), so the offending batches
        are not replayed."""
        state = load_state(path)
        dist.load_checkpoint(path, state, model, None if cfg.debug.drop_optimizer_state else optimizer, log,
                             rng=data_position)
        if data_position:
            sampler.load_state_dict(state["sampler"])
        scaler.load_state_dict(state["scaler"])
        counters.update({k: v for k, v in state["counters"].items() if data_position or k not in ("lr_scale", "rollbacks")})
        return state["step"]

    start_step = 0
    if checkpoint is not None:
        start_step = restore(checkpoint)
        log(f"resumed from {checkpoint} at step {start_step}")
    # the last checkpoint of a finished run: only the final weights are left to write
    target_met = 0 < t.target_val_bpb and counters["val_bpb"] is not None and counters["val_bpb"] <= t.target_val_bpb
    finishing = start_step >= t.steps or target_met
    if dist.is_main and not finishing:
        clear_final(out_dir)  # this run trains on: its old final weights no longer describe it
    log(f"model: {model.num_params() / 1e6:.2f}M parameters | {tokenizer.kind} vocabulary of {tokenizer.vocab_size} | "
        f"{tokens_per_step} tokens per step | device {device} | run dir {out_dir}")
    if not val_batches:
        log("warning: the validation split is shorter than one window; no validation loss will be reported")
    peak, peak_source = peak_flops(device, precision.autocast_dtype or next(model.parameters()).dtype, t.peak_flops)
    log(f"MFU: {model.flops_per_token() / 1e6:.2f} MFLOP per token, against "
        f"{f'{peak / 1e12:.3g} TFLOP/s' if peak else 'no peak'} ({peak_source})")

    def evaluate(step: int, row: dict) -> dict:
        if not val_batches:
            return row
        with precision.autocast():
            result = estimate_loss(model, dist.share_of(val_batches), token_bytes, device, reduce=dist.sum_tensors)
        dist.reshard(model)
        row.update(step=step, val_loss=result["loss"], val_bpb=result["bpb"], val_ppl=perplexity(result["loss"]))
        if floor:
            row.update(floor_bpb=floor["bpb"], floor_loss=floor["nats_per_token"])
        best = counters["best_val_loss"]
        counters["best_val_loss"] = result["loss"] if best is None else min(best, result["loss"])
        counters["val_loss"], counters["val_bpb"] = result["loss"], result["bpb"]
        return row

    def save_checkpoint_at(step: int, row: dict) -> Path:
        counters["rollbacks"] = guard.rollbacks
        state = {"step": step, "sampler": sampler.state_dict(), "scaler": scaler.state_dict(), "counters": dict(counters)}
        return dist.save_checkpoint(out_dir, step, model, optimizer, state, config_toml, tokenizer,
                                    row.get("val_loss"), t.keep, meta_extra={"data_digest": data.digest})

    resuming = checkpoint is not None
    # rank 0 writes metrics and events; every rank runs the guard, on the same global numbers
    monitor = (Monitor(out_dir, t.steps, parse_sinks(t.log), cfg.to_dict(), log, t.progress,
                       resume_step=start_step if resuming else None) if dist.is_main else Muted())
    guard = Guard(out_dir if dist.is_main else None, g.on_nan, g.on_spike, g.spike_window, g.spike_threshold,
                  g.max_rollbacks, monitor.write)
    guard.rollbacks = counters["rollbacks"]  # this count is the guard's own: a rollback does not rewind it
    meter = StepMeter(t.steps, tokens_per_step, model.flops_per_token(), peak * dist.world_size if peak else None,
                      o.clip, device, start_step=start_step, clipped_steps=counters.get("clipped_steps", 0), elapsed_s=counters["elapsed_s"],
                      host_values=guard.reads_every_step)
    if resuming:
        guard.note("resume", start_step)
    else:
        monitor.record(evaluate(0, {"step": 0, "elapsed_s": 0.0, "n_params": model.num_params(), **meter.constants()}))
    meter.lap(start_step)
    row: dict = {}
    step, resumed_at = start_step, start_step
    with StopOnSignal() as stop:
        while step < t.steps and not finishing:
            done = step + 1
            lr = cosine_lr(step, o.lr, o.warmup, t.steps, o.min_lr) * counters["lr_scale"]
            for group in optimizer.param_groups:
                group["lr"] = lr

            micro_batches = [pack_windows(data.train.tokens, sampler.next_starts(), cfg.model.seq_len,
                                          tokenizer.eos_id, **pack) for _ in range(t.grad_accum)]
            if cfg.debug.unshifted_targets:
                for b in micro_batches:
                    b.targets = b.idx.clone()
            local_count = sum(int(b.counted) for b in micro_batches)
            step_count = dist.sum(local_count)  # counted tokens of the whole step: every micro-batch of every rank
            loss, _ = accumulate_gradients(step_model, micro_batches, device, precision.autocast, scaler.loss_scale,
                                           step_count_without_averaging(micro_batches, t.grad_accum)
                                           if cfg.debug.loss_not_averaged else step_count)
            loss = dist.global_mean(loss, local_count, step_count)
            if cfg.debug.inject_nan_at == done and not guard.rollbacks:  # a one-off fault, like a bad batch
                poison_one_gradient(model)
            if cfg.debug.inject_spike_at == done and not guard.rollbacks:  # a one-off bad batch, loud and finite
                loss = loss * 100
                torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], 100.0)
            stats_now = is_stats_step(done, t.stats_every)
            log_now = (done % t.log_every == 0 or done % t.eval_every == 0 or done == t.steps or done == 1
                       or stats_now or done - resumed_at <= 3)  # the first steps after a (re)start are all shown
            underflow = {"grad_zero_frac": grad_zero_fraction(model.parameters())} if log_now and precision.name == "fp16" else {}

            scaler.unscale_(model.parameters())
            # per-layer probes run on rank 0's own model; under FSDP no rank holds whole layers
            layer_stats = (LayerStats(model, micro_batches[0], precision.autocast)
                           if stats_now and dist.is_main and not dist.sharded else None)
            grad_norm = dist.clip_grad_norm_(model, o.clip if o.clip > 0 else math.inf)
            action, event = "take", None
            if guard.reads_every_step:
                loss, grad_norm = torch.stack([loss.float(), grad_norm.float().to(loss.device)]).tolist()  # the step's one read
                if not (scaler.enabled and not math.isfinite(grad_norm)):  # an fp16 overflow is the scaler's to skip
                    action, event = guard.check(done, loss, grad_norm, lr)  # global numbers: every rank decides alike
            if action == "take" and scaler.update(grad_norm):  # False only under fp16, when a gradient overflowed
                meter.count_clipped(grad_norm)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            if event is not None:
                if event["kind"] == "nan":
                    event.update(nan_origin(model, micro_batches[0], precision.autocast, tokenizer.vocab_size))
                target = dist.from_main(lambda: valid_resume_checkpoint(out_dir, monitor.write)) if action == "rollback" else None
                if action == "rollback" and target is None:
                    action, event["note"] = "skip", "no checkpoint yet: skipped instead of rolled back"
                if action == "rollback" and guard.rollbacks >= g.max_rollbacks:
                    action, event["note"] = "stop", f"already rolled back {g.max_rollbacks} times (--max-rollbacks)"
                if action == "rollback":
                    guard.rollbacks += 1  # never rewound by a restore: no bug can make the run loop forever
                    step = restore(target, data_position=False)
                    counters["lr_scale"] *= g.rollback_lr_scale
                    guard.record(event, "rollback", to_step=step, lr_scale=counters["lr_scale"])
                    guard.reset_history()
                    meter.set_clipped_steps(counters.get("clipped_steps", 0))
                    monitor.rewind(step)
                    meter.lap(step)
                    resumed_at = step
                    continue
                guard.record(event, {"take": "warn"}.get(action, action))
                if action == "stop":
                    monitor.close()
                    raise NanolmError(f"training stopped at step {done} on a {event['kind']} event "
                                      f"({event.get('origin') or event.get('note') or 'see events.jsonl'}); "
                                      f"run `nanolm diagnose {out_dir}`")

            counters["tokens_seen"] += tokens_per_step
            row = {}
            if log_now:
                row = meter.row(done, loss, lr, grad_norm)  # the one host sync of a logged step
                row["tokens"] = counters["tokens_seen"]
                row.update(**scaler.metrics(), **underflow)
                if layer_stats is not None:
                    row.update(layer_stats.after_update())
                if not math.isfinite(row["loss"]) and not scaler.enabled and not guard.reads_every_step:
                    monitor.record(row)
                    monitor.close()
                    raise NanolmError(f"the loss became {row['loss']} at step {done}; lower --lr or raise --warmup")
                if done % t.eval_every == 0 or done == t.steps:
                    row = evaluate(done, row)
                monitor.record(row)
                meter.lap(done)

            reached = 0 < t.target_val_bpb and row.get("val_bpb", math.inf) <= t.target_val_bpb
            stop_signal = dist.first_signal(stop.requested)  # every rank stops after the same step
            if done % t.ckpt_every == 0 or done == t.steps or stop_signal or reached:
                counters["elapsed_s"] = meter.elapsed()
                counters["clipped_steps"] = int(meter.clipped_steps)
                saved = save_checkpoint_at(done, row)
                if cfg.debug.kill_after_checkpoint == done:
                    os.kill(os.getpid(), signal.SIGKILL)
                if stop_signal:
                    monitor.close()
                    name = signal.Signals(stop_signal).name
                    raise TrainingInterrupted(f"{name} at step {done}: checkpoint saved to {saved}; "
                                              f"run the same command again to resume", stop_signal)
            step = done
            if reached:
                log(f"val bpb {row['val_bpb']:.4f} <= --target-val-bpb {t.target_val_bpb} at step {done}: done")
                break

    monitor.close()
    final_val = counters["val_loss"]
    if final_val is not None and not math.isfinite(final_val):  # e.g. --on-nan skip, skipping to the end
        raise NanolmError(f"the final model's validation loss is {final_val}: the run did not produce a usable "
                          f"model (no final weights written); run `nanolm diagnose {out_dir}`")
    # rank 0: the whole model, unsharded, then final.json, the proof that the run finished
    whole = dist.save_final_weights(model, out_dir, step, {"val_loss": final_val, "val_bpb": counters["val_bpb"]})
    result = {"out_dir": str(out_dir), "elapsed_s": meter.elapsed(), **row}
    if t.sample_tokens and dist.is_main and not dist.sharded:
        with precision.autocast():
            result["sample"] = sample_text(whole, tokenizer, device, t.sample_tokens, seed=t.seed)
        log("sample:\n" + result["sample"])
    elif t.sample_tokens and dist.sharded:
        log(f"no sample under --dist fsdp (the whole model may not fit one device); nanolm sample --run {out_dir}")
    log(f"done in {result['elapsed_s']:.1f}s; weights, config, tokenizer, checkpoints and metrics in {out_dir}")
    return result


def check_resume_compatible(checkpoint: Path, cfg: RunConfig, tokenizer, log=print,
                            dist: Distributed | None = None, data: PreparedData | None = None) -> None:
    """Refuse a resumption that would silently mix two different runs; log allowed changes.

    The split of the global batch (batch size, accumulation, world size) may change as long
    as the global batch itself does not (see ``nanolm.distributed``).
    """
    saved = load_run_config(checkpoint / "config.toml")
    meta = read_checkpoint_meta(checkpoint)
    regroup, allowed_split, refused_split = (dist or Distributed()).resume_rules(meta, saved, cfg)
    allowed, refused = resume_differences(saved, cfg, also_allowed=regroup)
    allowed, refused = allowed + allowed_split, refused + refused_split
    if Tokenizer.load(checkpoint / "tokenizer.json").fingerprint() != tokenizer.fingerprint():
        refused.append("tokenizer: the data's tokenizer is not the one the run was trained with")
    elif data is not None and meta.get("data_digest", data.digest) != data.digest:
        refused.append(f"data: {data.dir} is not the data the checkpoint was trained on (its files differ)")
    if refused:
        raise NanolmError(f"cannot resume from {checkpoint}: incompatible changes: {'; '.join(refused)}. "
                          f"Keep those settings, or start a new run with another --out-dir")
    for line in allowed:
        log(f"resume: {line} (allowed)")


def sample_text(model: GPT, tokenizer, device, max_new_tokens: int, prompt: str = "",
                temperature: float = 0.8, top_k: int | None = 50, top_p: float | None = None, seed: int = 0) -> str:
    """Generate text: a new document (it starts after EOS) continuing ``prompt``."""
    ids = [tokenizer.eos_id] + list(tokenizer.encode(prompt)) if prompt else [tokenizer.eos_id]
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, top_p,
                         eos_id=tokenizer.eos_id, generator=generator)
    new = out[0, len(ids):].tolist()
    if tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
    return prompt + tokenizer.decode(new)


def main(argv=None) -> int:
    from .cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
