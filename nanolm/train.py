"""Training: the loop, read top to bottom, and ``python -m nanolm.train``.

One optimizer step, in order:

1. set the learning rate for this step (a pure function of the step number);
2. draw ``grad_accum`` micro-batches; :func:`accumulate_gradients` counts the tokens that
   count in *all* of them, then for each micro-batch runs forward, divides the sum of its
   token losses by that step-wide count, and runs backward (gradients add up);
3. every ``--stats-every`` steps: take per-layer statistics before clipping (see
   ``nanolm.diagnostics``);
4. clip the global gradient norm once, after every backward pass;
5. update the weights, zero the gradients;
6. every few steps: log (``metrics.jsonl``, the terminal, wandb/TensorBoard if asked),
   evaluate on the fixed validation set.

Dividing each micro-batch's *sum* by the step-wide count makes the accumulated gradient
exactly the gradient of the mean loss over every counted token of the step, the same as
one big batch. Averaging per-micro-batch means instead would weigh a token in a short
micro-batch more than one in a long micro-batch.
"""

from __future__ import annotations

import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from .checkpoint import atomic_write_text, save_weights
from .config import RunConfig
from .corpus import write_stories
from .data import Batch, PreparedData, WindowSampler, eval_batches, pack_windows, prepare
from .diagnostics import LayerStats, StepMeter, is_stats_step, peak_flops
from .errors import NanolmError
from .loss import masked_cross_entropy_sum
from .model import GPT
from .monitor import Monitor, missing_sink_packages, parse_sinks, perplexity
from .optim import build_optimizer, cosine_lr


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


def accumulate_gradients(model, micro_batches: list[Batch], device) -> tuple[torch.Tensor, int]:
    """Forward and backward over every micro-batch of one optimizer step.

    The tokens that count are first counted over *all* micro-batches; each micro-batch
    then backpropagates (sum of its token losses) ÷ (that count). The gradients that
    accumulate are exactly those of the mean loss over every counted token of the step,
    whatever the split, and a micro-batch with nothing to count adds zero.
    Returns (that mean loss, detached; the count).
    """
    step_count = max(1, sum(int(b.counted) for b in micro_batches))
    loss_sum = torch.zeros((), device=device)
    for batch in micro_batches:
        batch = batch.to(device)
        logits, _ = model(batch.idx, doc_ids=batch.doc_ids, positions=batch.positions)
        micro_sum, _ = masked_cross_entropy_sum(logits, batch.targets, batch.loss_mask)
        (micro_sum / step_count).backward()
        loss_sum += micro_sum.detach()
    return loss_sum / step_count, step_count


@torch.no_grad()
def estimate_loss(model: GPT, batches: list[Batch], token_bytes: torch.Tensor, device="cpu") -> dict:
    """Loss (nats per counted token) and bits per byte over a fixed list of batches.

    Deterministic: the same batches, the model in eval mode (no dropout), sums accumulated
    in float64. Bits per byte divides the total information by the bytes of text the
    predicted tokens spell (EOS spells none), so it compares across tokenizers.
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
    """
    d = cfg.data
    if not d.data:
        source = scratch / "stories.txt"
        write_stories(source, d.stories, seed=cfg.train.seed)
        log(f"data: {d.stories} generated stories (the built-in corpus; its entropy is known)")
    else:
        source = Path(d.data)
        if (source / "meta.json").is_file():
            data = PreparedData(source)
            log(f"data: prepared shards in {source} ({data.meta['tokenizer']} tokenizer, {data.tokenizer.vocab_size} tokens)")
            return data
        log(f"data: {source}")
    return prepare(source, scratch / "data", d.tokenizer, d.vocab_size, d.val_fraction, d.separator,
                   d.text_field, seq_len=cfg.model.seq_len, progress=False, log=log)


def default_out_dir(cfg: RunConfig) -> Path:
    name = Path(cfg.data.data.rstrip("/")).stem if cfg.data.data else "stories"
    out = Path("runs") / name
    n = 2
    while out.exists():
        out = Path("runs") / f"{name}-{n}"
        n += 1
    return out


def train(cfg: RunConfig, log=print) -> dict:
    """Train a model as ``cfg`` says; returns the final figures. Writes the run directory."""
    cfg = cfg.resolved()
    t, o = cfg.train, cfg.optim
    device = resolve_device(t.device)
    out_dir = Path(t.out_dir) if t.out_dir else default_out_dir(cfg)
    if (out_dir / "metrics.jsonl").exists():
        raise NanolmError(f"{out_dir} already holds a run; choose another --out-dir (or delete it)")
    missing = missing_sink_packages(parse_sinks(t.log))
    if missing:
        raise NanolmError(f"--log {missing[0]} needs the {missing[0]} package: pip install 'nanolm[{missing[0]}]'")
    seed_everything(t.seed)

    # ---- data: validated and tokenized in a scratch directory; out_dir is untouched so far
    scratch = Path(tempfile.mkdtemp(prefix="nanolm-"))
    try:
        data = load_training_data(cfg, scratch, log)
        tokenizer = data.tokenizer
        if len(data.train) < cfg.model.seq_len + 1:
            raise NanolmError(
                f"the training split holds {len(data.train)} tokens, fewer than one window of "
                f"--seq-len + 1 = {cfg.model.seq_len + 1}; use more text or a smaller --seq-len"
            )
        cfg.data.tokenizer, cfg.data.vocab_size = tokenizer.kind, tokenizer.vocab_size
        model = GPT(cfg.model.gpt_config(tokenizer.vocab_size))
        data.check_vocab(model.config.vocab_size)
        out_dir.mkdir(parents=True, exist_ok=True)
        if data.dir.parent == scratch:
            shutil.move(str(data.dir), out_dir / "data")
            data = PreparedData(out_dir / "data")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    atomic_write_text(out_dir / "config.toml", cfg.to_toml())
    tokenizer.save(out_dir / "tokenizer.json")
    floor = data.meta.get("floor")

    # ---- model, optimizer, batches
    model.to(device)
    optimizer = build_optimizer(model, o.lr, o.weight_decay, betas=(o.beta1, o.beta2))
    step_model = torch.compile(model) if t.compile else model
    d = cfg.data
    pack = dict(doc_mask=d.doc_mask, reset_positions=d.reset_positions, mask_boundary=d.mask_boundary)
    sampler = WindowSampler(len(data.train), cfg.model.seq_len, t.batch_size, seed=t.seed, random_offset=d.random_offset)
    val_batches = eval_batches(data.val, cfg.model.seq_len, t.batch_size, tokenizer.eos_id,
                               max_windows=t.eval_batches * t.batch_size, **pack)
    token_bytes = torch.from_numpy(tokenizer.token_bytes())
    tokens_per_step = t.batch_size * t.grad_accum * cfg.model.seq_len
    log(f"model: {model.num_params() / 1e6:.2f}M parameters | {tokenizer.kind} vocabulary of {tokenizer.vocab_size} | "
        f"{tokens_per_step} tokens per step | device {device} | run dir {out_dir}")
    if not val_batches:
        log("warning: the validation split is shorter than one window; no validation loss will be reported")
    peak, peak_source = peak_flops(device, torch.float32, t.peak_flops)
    log(f"MFU: {model.flops_per_token() / 1e6:.2f} MFLOP per token, against "
        f"{f'{peak / 1e12:.3g} TFLOP/s' if peak else 'no peak'} ({peak_source})")

    def evaluate(step: int, row: dict) -> dict:
        if not val_batches:
            return row
        result = estimate_loss(model, val_batches, token_bytes, device)
        row.update(step=step, val_loss=result["loss"], val_bpb=result["bpb"], val_ppl=perplexity(result["loss"]))
        if floor:
            row.update(floor_bpb=floor["bpb"], floor_loss=floor["nats_per_token"])
        return row

    monitor = Monitor(out_dir, t.steps, parse_sinks(t.log), cfg.to_dict(), log, t.progress)
    meter = StepMeter(t.steps, tokens_per_step, model.flops_per_token(), peak, o.clip, device)
    started = time.perf_counter()
    monitor.record(evaluate(0, {"step": 0, "elapsed_s": 0.0, "n_params": model.num_params(), **meter.constants()}))
    meter.lap(0)
    row: dict = {}
    for step in range(t.steps):
        done = step + 1
        lr = cosine_lr(step, o.lr, o.warmup, t.steps, o.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr

        micro_batches = [pack_windows(data.train.tokens, sampler.next_starts(), cfg.model.seq_len,
                                      tokenizer.eos_id, **pack) for _ in range(t.grad_accum)]
        loss, step_count = accumulate_gradients(step_model, micro_batches, device)

        layer_stats = LayerStats(model, micro_batches[0]) if is_stats_step(done, t.stats_every) else None
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip if o.clip > 0 else math.inf)
        meter.count_clipped(grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        logged = done % t.log_every == 0 or done % t.eval_every == 0 or done == t.steps or done == 1
        if logged or layer_stats is not None:
            row = meter.row(done, loss, lr, grad_norm)  # the one host sync of the step
            if layer_stats is not None:
                row.update(layer_stats.after_update())
            if not math.isfinite(row["loss"]):
                monitor.record(row)
                monitor.close()
                raise NanolmError(f"the loss became {row['loss']} at step {done}; lower --lr or raise --warmup")
            if done % t.eval_every == 0 or done == t.steps:
                row = evaluate(done, row)
            monitor.record(row)
            meter.lap(done)

    monitor.close()
    save_weights(model, out_dir / "model.safetensors")
    result = {"out_dir": str(out_dir), "elapsed_s": time.perf_counter() - started, **row}
    if t.sample_tokens:
        result["sample"] = sample_text(model, tokenizer, device, t.sample_tokens, seed=t.seed)
        log("sample:\n" + result["sample"])
    log(f"done in {result['elapsed_s']:.1f}s; weights, config, tokenizer and metrics in {out_dir}")
    return result


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
