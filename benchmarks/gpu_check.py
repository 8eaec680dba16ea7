"""Prove nanolm on a CUDA GPU with one command: every part prints PASS or FAIL with its figure.

A GPU is lent rarely and briefly (think of one short rental, start-up included), so the first
run must prove what matters most and fit the time there is. The parts come in three groups,
each one run of this script:

* ``first`` (the default, ~6 minutes cold by the parts' estimates): the real ``nanolm train``
  loop with its defaults on the device, end to end (evaluation, statistics, checkpoints, the
  sample, ``eval`` and ``export``); a ``kill -9`` in the middle of a ``--deterministic`` run
  whose rerun ends bit-identical to an uninterrupted one; FlexAttention's document mask against
  SDPA's boolean mask and the hand-written reference, forward and backward, fp32 and bf16; one
  batch under bf16 autocast against fp32.
* ``second``: fp16 with the loss scaler through an overflow, bf16-pure with stochastic rounding,
  a planted NaN rolled back, Muon, ``--compile`` against eager, the GPU-marked tests.
* ``timing``, each part alone on a quiet device: what FlexAttention's document mask costs
  against plain causal attention; tokens/s and MFU at GPT-2 small's shape (124M parameters,
  context 1024), eager and compiled, with the mask and without; the output head and the loss
  at GPT-2's vocabulary.

Each part runs in a process of its own with its own time limit, so a crash or a hung kernel
costs that part and not the report: it is killed with its children and says ``timed out``. The
parts that only check numbers run a few at a time (``--jobs``); the ones that time the device run
alone, after them. Each part has an estimate of its time on a cold H200 (printed at the start,
summed; docs/gpu.md), and the run must fit ``--budget`` seconds (360 by default, with cold
compile caches: each run compiles into a fresh ``TORCHINDUCTOR_CACHE_DIR`` unless the
environment sets one); a part that cannot start before the budget ends fails and says so.
Everything lands in the one directory ``--out``: ``<part>.json``, ``summary.json``, and each
part's output in ``logs/<part>.log``, written as it comes (a part stopped at its limit leaves
what it said); the last line is the verdict, and the exit status is 0 only when every part
passed (2 when no GPU is visible: then nothing runs).

    bash benchmarks/gpu_check.sh --out /tmp/gpu_check                        # the first contact
    bash benchmarks/gpu_check.sh --out /tmp/gpu_check2 --parts second --budget 420
    bash benchmarks/gpu_check.sh --out /tmp/gpu_check3 --parts timing --budget 480
    python3 benchmarks/gpu_check.py --device cpu --tiny --threads 1 --parts all --out DIR   # the harness itself

``--device cpu --tiny`` runs every part at toy sizes on the CPU, leaving out only what a CPU
cannot do (FlexAttention's backward pass): that is how tests/test_gpu_check.py proves the
harness on machines without a GPU. It proves nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "data" / "toy.txt"
BUDGET_S = 360


class Failed(Exception):
    """A part's check did not hold: the message is the FAIL line's reason."""


class Skipped(Exception):
    """A part this device cannot run at all (no bf16 on a T4, no Muon before PyTorch 2.9)."""


def check(ok: bool, reason: str) -> None:
    if not ok:
        raise Failed(reason)


# --------------------------------------------------------------------------- what a part works with
@dataclass
class Context:
    """One part's device, sizes and scratch directory, its figures, and how it runs ``nanolm``."""

    device: str
    tiny: bool
    work: Path
    threads: int | None = None
    append: list[str] = field(default_factory=list)  # --append PART=ARGS: added to every `nanolm train`
    figures: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what a CPU left out of a part that still passed

    def sized(self, full, tiny):
        return tiny if self.tiny else full

    def train_args(self, *run_args: str) -> list[str]:
        """``nanolm train`` on the toy corpus, on this device: nanolm's defaults on a GPU (a BPE
        vocabulary of 512, 4 blocks of width 128, context 128, batch 16, bf16 where the GPU has it,
        FlexAttention's document mask), a one-block char model on a CPU; then ``run_args``."""
        base = ["--data", str(TOY), "--device", self.device, "--progress", "lines"]
        if self.tiny:
            base += [
                "--tokenizer",
                "char",
                "--n-layer",
                "1",
                "--n-head",
                "2",
                "--n-embd",
                "32",
                "--seq-len",
                "32",
                "--batch-size",
                "4",
                "--eval-batches",
                "2",
            ]
        if self.threads:
            base += ["--threads", str(self.threads)]
        return [*base, *run_args, *self.append]

    def nanolm(self, *args) -> str:
        """Run ``python -m nanolm ARGS`` to the end; returns what it printed (also in this part's log)."""
        code, output = streamed([sys.executable, "-m", "nanolm", *map(str, args)], self.work)
        if code != 0:
            raise Failed(f"`nanolm {args[0]}` exited {code}: {last_line(output)}")
        return output

    def start_nanolm(self, *args, log: Path) -> subprocess.Popen:
        argv = [sys.executable, "-m", "nanolm", *map(str, args)]
        print("$ " + shlex.join(["python", *argv[1:]]) + "  (in the background)", flush=True)
        with open(log, "w") as out:
            return subprocess.Popen(argv, cwd=self.work, stdout=out, stderr=subprocess.STDOUT, text=True)


def streamed(argv: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``argv``, copying its output line by line into this part's log as it comes (a part
    stopped at its time limit still shows how far it got); returns (exit status, output)."""
    print("$ " + shlex.join(["python", *argv[1:]]), flush=True)
    start, lines = time.perf_counter(), []
    with subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
    print(f"(exit {proc.returncode} after {time.perf_counter() - start:.1f} s)", flush=True)
    return proc.returncode, "".join(lines)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def metrics(run: Path) -> list[dict]:
    from nanolm.watch.sinks import read_metrics

    return read_metrics(run / "metrics.jsonl")


def events(run: Path) -> list[dict]:
    from nanolm.base.documents import read_jsonl

    return read_jsonl(run / "events.jsonl")[0] if (run / "events.jsonl").exists() else []


def finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def final_weights(run: Path) -> dict:
    """The run's ``model.safetensors``: every tensor finite, as a finished run promises."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(run / "model.safetensors"))
    bad = [name for name, w in weights.items() if not bool(torch.isfinite(w.float()).all())]
    check(not bad, f"{run.name}/model.safetensors holds non-finite values in {bad[:3]}")
    return weights


def evaluations(rows: list[dict]) -> list[dict]:
    evals = [r for r in rows if "val_loss" in r]
    check(len(evals) >= 2, f"expected an evaluation at step 0 and at the end, found {len(evals)}")
    check(all(finite(r["val_loss"], r["val_bpb"]) for r in evals), "a validation loss is not finite")
    return evals


def learned(rows: list[dict], what: str) -> tuple[float, float]:
    """(first, last) validation bits per byte; the last must be clearly lower."""
    evals = evaluations(rows)
    first, last = evals[0], evals[-1]
    check(
        last["val_loss"] < 0.95 * first["val_loss"],
        f"{what} did not learn: val loss {first['val_loss']:.3f} at step {first['step']}, {last['val_loss']:.3f} "
        f"at step {last['step']}",
    )
    return first["val_bpb"], last["val_bpb"]


def median_of(rows: list[dict], key: str, after_step: int = 3):
    """The median of ``key`` over the logged steps after the first few (which include start-up)."""
    values = [r[key] for r in rows if key in r and r["step"] > after_step and finite(r[key])]
    return statistics.median(values) if values else None


def toy_tokens(ctx: Context):
    """The toy corpus prepared as a run would (BPE 512 on a GPU, char on a CPU): (tokens, vocab, eos)."""
    import numpy as np

    from nanolm.data.prepare import prepare

    data = prepare(TOY, ctx.work / "prepared", ctx.sized("bpe", "char"), 512, progress=False, log=lambda *_: None)
    return np.array(data.train.tokens), data.tokenizer.vocab_size, data.tokenizer.eos_id


def default_model(ctx: Context, vocab: int):
    """nanolm's default model (``nanolm train``'s), or the toy one on a CPU."""
    import torch

    from nanolm.model import GPT
    from nanolm.run.config import ModelOptions

    options = ModelOptions() if not ctx.tiny else ModelOptions(n_layer=1, n_head=2, n_embd=32, seq_len=32)
    torch.manual_seed(0)
    return GPT(options.gpt_config(vocab)).to(ctx.device)


# --------------------------------------------------------------------------- the parts
def part_train(ctx: Context) -> str:
    """``nanolm train`` with its defaults on the device (300 steps instead of 1,000), end to end:
    evaluations, per-layer statistics, checkpoints, the sample; then ``nanolm eval`` and
    ``nanolm export`` on the finished run."""
    steps = ctx.sized(300, 20)
    run = ctx.work / "run"
    said = ctx.nanolm(
        "train",
        *ctx.train_args(
            "--steps", steps, *ctx.sized([], ["--eval-every", "10", "--stats-every", "5", "--sample-tokens", "20"])
        ),
        "--out-dir",
        run,
    )
    device = re.search(r"\| device (\S+) \|", said)
    check(
        device is not None and device.group(1).split(":")[0] == ctx.device.split(":")[0],
        f"the run did not train on {ctx.device}: {device.group(0) if device else 'no device line'}",
    )
    precision = re.search(r"^precision: (\S+)", said, re.M)
    rows = metrics(run)
    first, last = learned(rows, "the default run")
    stats = [r for r in rows if any(k.startswith("attn_logit_max/") for k in r)]
    check(len(stats) >= 2, f"per-layer statistics on {len(stats)} steps, expected step 1 and every --stats-every")
    check(all(finite(*(v for k, v in r.items() if "/" in k)) for r in stats), "a per-layer statistic is not finite")
    latest = (run / "checkpoints" / "latest").read_text().strip()
    check(latest == f"step_{steps:06d}", f"the newest checkpoint is {latest}, expected step_{steps:06d}")
    check((run / "final.json").exists(), "no final.json: the run does not say it finished")
    final_weights(run)
    sample = said.split("sample:\n", 1)
    check(len(sample) == 2 and sample[1].split("\ndone in")[0].strip(), "no sample printed at the end")
    evaluated = ctx.nanolm("eval", "--run", run, "--data", TOY, "--device", ctx.device, "--json")
    scored = json.loads([line for line in evaluated.splitlines() if line.startswith("{")][-1])
    check(finite(scored["loss"], scored["bpb"]), f"`nanolm eval` gave {scored}")
    ctx.nanolm("export", run, "--out", ctx.work / "export")
    exported = sorted(p.name for p in (ctx.work / "export").iterdir())
    check({"config.json", "model.safetensors"} <= set(exported), f"the export holds {exported}")
    tokens_per_s, mfu = median_of(rows, "tokens_per_sec"), median_of(rows, "mfu")
    memory = max((r["cuda_max_alloc_mb"] for r in rows if "cuda_max_alloc_mb" in r), default=None)
    ctx.figures.update(
        steps=steps,
        precision=precision.group(1) if precision else None,
        val_bpb_start=first,
        val_bpb_end=last,
        eval_bpb_whole_file=scored["bpb"],
        tokens_per_sec=tokens_per_s,
        mfu=mfu,
        cuda_max_alloc_mb=memory,
        stats_steps=[r["step"] for r in stats],
        exported=exported,
    )
    return (
        f"{ctx.figures['precision']}, val bpb {first:.3f} -> {last:.3f} in {steps} steps, "
        f"{tokens_per_s / 1e3:.0f}k tokens/s"
        + (f", MFU {mfu:.1%}" if mfu is not None else "")
        + "; evaluation, statistics, checkpoint, sample, eval, export"
    )


def part_bf16_vs_fp32(ctx: Context) -> str:
    """One training batch through the same model twice: in fp32, and under bf16 autocast. The
    weights and gradients stay fp32; the loss agrees within bf16's precision and the gradients
    point the same way (a wrong cast or a dtype mix-up shows up as O(1) differences). On a GPU
    with TF32 tensor cores, a third time in fp32 with TF32 products, as an fp32 run uses them."""
    import torch

    from nanolm.batches import pack_windows
    from nanolm.errors import NanolmError
    from nanolm.machine.runtime import configure_tf32, settings_restored
    from nanolm.precision import resolve_precision
    from nanolm.step import accumulate_gradients, counted_tokens

    device = torch.device(ctx.device)
    try:
        bf16 = resolve_precision("bf16", device)
    except NanolmError as e:
        raise Skipped(str(e)) from None
    tokens, vocab, eos = toy_tokens(ctx)
    model_fp32, model_bf16 = default_model(ctx, vocab), default_model(ctx, vocab)
    T, B = model_fp32.config.seq_len, ctx.sized(16, 4)
    batch = pack_windows(tokens, torch.arange(B).numpy() * 7 * T, T, eos)
    count = counted_tokens([batch])
    loss32 = (accumulate_gradients(model_fp32, [batch], count) / count).item()
    loss16 = (accumulate_gradients(model_bf16, [batch], count, bf16.autocast) / count).item()
    dtypes = {str(t.dtype) for p in model_bf16.parameters() for t in (p, p.grad)}
    check(dtypes == {"torch.float32"}, f"under bf16 autocast the weights and gradients are {sorted(dtypes)}, not fp32")
    cosine = gradient_cosine(model_bf16, model_fp32)
    rel = abs(loss16 - loss32) / loss32
    ctx.figures.update(loss_fp32=loss32, loss_bf16=loss16, relative_loss_difference=rel, gradient_cosine=cosine)
    check(
        rel < 0.02 and cosine > 0.99,
        f"bf16 autocast strays from fp32: loss {loss16:.4f} vs {loss32:.4f}, gradient cosine {cosine:.4f}",
    )
    figure = f"loss {loss16:.4f} (bf16) vs {loss32:.4f} (fp32), relative {rel:.1e}; gradient cosine {cosine:.5f}"
    with settings_restored():  # an fp32 run on Ampere or later multiplies on TF32 tensor cores (--no-tf32: not)
        if configure_tf32(device, "fp32", True):
            model_tf32 = default_model(ctx, vocab)
            loss_tf32 = (accumulate_gradients(model_tf32, [batch], count) / count).item()
            cosine_tf32, rel_tf32 = gradient_cosine(model_tf32, model_fp32), abs(loss_tf32 - loss32) / loss32
            ctx.figures.update(
                loss_tf32=loss_tf32, relative_loss_difference_tf32=rel_tf32, gradient_cosine_tf32=cosine_tf32
            )
            check(
                rel_tf32 < 0.005 and cosine_tf32 > 0.999,
                f"TF32 products stray from fp32: loss {loss_tf32:.5f} vs "
                f"{loss32:.5f}, gradient cosine {cosine_tf32:.5f}",
            )
            figure += f"; TF32 loss relative {rel_tf32:.1e}, gradient cosine {cosine_tf32:.5f}"
        else:
            ctx.notes.append("no TF32 on this device")
    return figure


def gradient_cosine(a, b) -> float:
    import torch

    ga, gb = (torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (a, b))
    return torch.nn.functional.cosine_similarity(ga, gb, dim=0).item()


def part_fp16_overflow(ctx: Context) -> str:
    """fp16 autocast with nanolm's loss scaler through one overflow: a batch whose loss is
    multiplied by 2^24 (the lab's one-off bad batch) overflows fp16 in the backward pass. The
    step must be skipped (weights untouched, optimizer state finite), the scale halved, and after
    ``growth_interval`` clean steps doubled again."""
    import torch

    from nanolm.batches import WindowSampler
    from nanolm.errors import NanolmError
    from nanolm.instruments.faults import OneOffBadBatch
    from nanolm.optim import build_optimizer
    from nanolm.precision import DynamicLossScaler, resolve_precision
    from nanolm.step import StepSetup, train_step

    try:
        fp16 = resolve_precision("fp16", torch.device(ctx.device))
    except NanolmError as e:
        raise Skipped(str(e)) from None
    tokens, vocab, eos = toy_tokens(ctx)
    model = default_model(ctx, vocab)
    T, B, bad_step, growth = model.config.seq_len, ctx.sized(16, 4), 3, 3
    bad = OneOffBadBatch(bad_step, 2.0**24)
    batches = bad.batches(tokens, WindowSampler(len(tokens), T, B, seed=0), T, eos)
    scaler = DynamicLossScaler(growth_interval=growth)
    optimizer = build_optimizer(model, 3e-3, 0.1)
    setup = StepSetup(
        model, optimizer, schedule=lambda step: 3e-3, scaler=scaler, autocast=fp16.autocast, loss_fn=bad.loss_fn
    )
    history = []
    for step in range(1, bad_step + growth + 2):
        before = [p.detach().clone() for p in model.parameters()]
        result = train_step(setup, step, batches.next(step))
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        history.append(
            {
                "step": step,
                "updated": bool(result.updated),
                "weights_unchanged": unchanged,
                "grad_norm": float(result.grad_norm),
                "loss_scale": scaler.loss_scale,
            }
        )
    ctx.figures["history"] = history
    scales = [h["loss_scale"] for h in history]
    start = 2.0**16
    expected = [start] * (bad_step - 1) + [start / 2] * growth + [start] * 2
    skipped = [h["step"] for h in history if not h["updated"]]
    check(skipped == [bad_step], f"steps skipped: {skipped}, expected only the overflowing step {bad_step}")
    check(not math.isfinite(history[bad_step - 1]["grad_norm"]), "the 2^24 batch did not overflow fp16")
    check(history[bad_step - 1]["weights_unchanged"], "the overflowing step changed the weights")
    check(
        scales == expected,
        f"loss scale per step {scales}, expected {expected} (halve on overflow, double after {growth} clean steps)",
    )
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    check(
        all(bool(torch.isfinite(t).all()) for t in state + list(model.parameters())),
        "a weight or an optimizer moment is not finite after the overflow",
    )
    return (
        f"step {bad_step} overflowed (grad norm inf) and was skipped; scale 65536 -> 32768 -> 65536 after "
        f"{growth} clean steps; weights and AdamW moments finite"
    )


def part_bf16_pure(ctx: Context) -> str:
    """``--precision bf16-pure``: bf16 weights updated with stochastic rounding. A short run must
    learn and save bf16 weights; on the device itself, rounding 1 + 2^-10 (an eighth of bf16's
    gap above 1) must round up one time in eight, so that the mean is kept (round-to-nearest
    would give 1 every time and lose the update)."""
    import torch

    from nanolm.precision import stochastic_round_to_bf16

    x = torch.full((1 << 20,), 1.0 + 2.0**-10, device=ctx.device)
    rounded = stochastic_round_to_bf16(x, torch.Generator(device=ctx.device).manual_seed(0)).float()
    values = sorted(set(torch.unique(rounded).tolist()))
    up = (rounded > 1).float().mean().item()
    check(values == [1.0, 1.0078125], f"stochastic rounding of 1 + 2^-10 gave {values[:4]}")
    check(abs(up - 0.125) < 0.005, f"stochastic rounding went up {up:.4f} of the time, expected 0.125")
    run = ctx.work / "run"
    ctx.nanolm("train", *ctx.train_args("--precision", "bf16-pure", *short_run(ctx)), "--out-dir", run)
    first, last = learned(metrics(run), "the bf16-pure run")
    dtypes = sorted({str(w.dtype) for w in final_weights(run).values()})
    check(dtypes == ["torch.bfloat16"], f"a bf16-pure run saved weights in {dtypes}")
    ctx.figures.update(rounded_up_fraction=up, val_bpb_start=first, val_bpb_end=last, saved_dtypes=dtypes)
    return f"rounded up {up:.4f} of the time (expected 0.125); val bpb {first:.3f} -> {last:.3f}; weights saved in bf16"


def short_run(ctx: Context) -> list[str]:
    return ctx.sized(
        ["--steps", "60", "--eval-every", "30", "--sample-tokens", "0"],
        ["--steps", "20", "--eval-every", "10", "--sample-tokens", "0"],
    )


def part_muon(ctx: Context) -> str:
    """``--optimizer muon`` (Muon on the hidden matrices, AdamW on the rest): a short run learns."""
    from nanolm.optim import muon_available

    if not muon_available():
        import torch

        raise Skipped(f"torch.optim.Muon needs PyTorch 2.9 or later; this is {torch.__version__}")
    run = ctx.work / "run"
    said = ctx.nanolm("train", *ctx.train_args("--optimizer", "muon", *short_run(ctx)), "--out-dir", run)
    check("optimizer: Muon on" in said, "the run does not say it uses Muon")
    rows = metrics(run)
    first, last = learned(rows, "the Muon run")
    final_weights(run)
    ctx.figures.update(val_bpb_start=first, val_bpb_end=last, tokens_per_sec=median_of(rows, "tokens_per_sec"))
    return f"val bpb {first:.3f} -> {last:.3f} in {short_run(ctx)[1]} steps"


def part_compile(ctx: Context) -> str:
    """``--compile`` against the same run eager: the same first loss (same weights, same batch:
    a wrongly compiled graph is off by far more than kernel rounding), a final validation loss
    within 3 % (bf16 rounding compounds over the steps), and what compiling costs and buys."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        run = ctx.work / name
        start = time.perf_counter()
        ctx.nanolm("train", *ctx.train_args(*short_run(ctx), *extra), "--out-dir", run)
        runs[name] = (metrics(run), time.perf_counter() - start)
    eager_s, compiled_s = runs["eager"][1], runs["compiled"][1]
    first = {name: next(r for r in rows if r["step"] == 1)["loss"] for name, (rows, _) in runs.items()}
    final = {name: evaluations(rows)[-1]["val_loss"] for name, (rows, _) in runs.items()}
    rel_first = abs(first["compiled"] - first["eager"]) / first["eager"]
    rel_final = abs(final["compiled"] - final["eager"]) / final["eager"]
    tps = {name: median_of(rows, "tokens_per_sec") for name, (rows, _) in runs.items()}
    ctx.figures.update(
        first_loss=first,
        final_val_loss=final,
        relative_first=rel_first,
        relative_final=rel_final,
        tokens_per_sec=tps,
        wall_s={"eager": eager_s, "compiled": compiled_s},
    )
    check(rel_first < 5e-3, f"the first loss differs: {first['compiled']:.5f} compiled vs {first['eager']:.5f} eager")
    check(rel_final < 0.03, f"the final val loss differs: {final['compiled']:.4f} compiled vs {final['eager']:.4f}")
    return (
        f"first loss {first['compiled']:.5f} vs {first['eager']:.5f} eager, final val loss within {rel_final:.2%}; "
        f"{tps['compiled'] / 1e3:.0f}k vs {tps['eager'] / 1e3:.0f}k tokens/s; the run took {compiled_s:.0f} s "
        f"compiled, {eager_s:.0f} s eager"
    )


def part_kill9(ctx: Context) -> str:
    """``kill -9`` during a ``--deterministic`` run, right after its first checkpoint, then the
    same command again: every logged figure and the final weights' bytes must equal those of a
    run that was never interrupted (invariant 15, on the device)."""
    steps, every = ctx.sized((120, 40), (100, 20))
    args = ctx.train_args(
        "--deterministic",
        "--steps",
        steps,
        "--ckpt-every",
        every,
        "--eval-every",
        every,
        "--log-every",
        "1",
        "--sample-tokens",
        "0",
        *ctx.sized([], ["--n-layer", "2", "--n-embd", "64", "--seq-len", "64", "--batch-size", "8"]),
    )
    reference, crashed = ctx.work / "uninterrupted", ctx.work / "killed"
    ctx.nanolm("train", *args, "--out-dir", reference)
    proc = ctx.start_nanolm("train", *args, "--out-dir", crashed, log=ctx.work / "killed.log")
    killed_after = None
    deadline = time.perf_counter() + 300
    while proc.poll() is None and time.perf_counter() < deadline:
        rows = logged_steps(crashed)
        if (crashed / "checkpoints" / f"step_{every:06d}").is_dir() and rows and rows[-1] > every:
            os.kill(proc.pid, signal.SIGKILL)  # mid-run: the first checkpoint committed, training on past it
            killed_after = rows[-1]
            break
        time.sleep(0.002)
    proc.wait()
    print((ctx.work / "killed.log").read_text() + f"(exit {proc.returncode}: killed after step {killed_after})")
    check(
        killed_after is not None and proc.returncode == -signal.SIGKILL,
        f"the run ended (exit {proc.returncode}) before it could be killed after its first checkpoint",
    )
    rerun = ctx.nanolm("train", *args, "--out-dir", crashed)
    resumed = re.search(r"resumed from \S+ at step (\d+)", rerun)
    check(resumed is not None, "the rerun did not resume from a checkpoint")
    compared = ("loss", "grad_norm", "val_loss", "val_bpb")
    want = {r["step"]: {k: r.get(k) for k in compared} for r in metrics(reference)}
    got = {r["step"]: {k: r.get(k) for k in compared} for r in metrics(crashed)}
    differing = [s for s in want if got.get(s) != want[s]]
    differing = differing or sorted(set(got) ^ set(want))
    check(not differing, f"the resumed run's metrics differ from the uninterrupted run's at steps {differing[:5]}")
    same_bytes = (reference / "model.safetensors").read_bytes() == (crashed / "model.safetensors").read_bytes()
    ctx.figures.update(
        steps=steps,
        killed_after_step=killed_after,
        resumed_at_step=int(resumed.group(1)),
        steps_compared=len(want),
        identical_weights=same_bytes,
    )
    check(same_bytes, "model.safetensors differs from the uninterrupted run's")
    return (
        f"killed after step {killed_after}, resumed at step {resumed.group(1)}: {len(want)} logged steps and "
        f"model.safetensors bit-identical to the uninterrupted run"
    )


def logged_steps(run: Path) -> list[int]:
    """The steps in ``metrics.jsonl`` so far (read while the run writes it: a half line is skipped)."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return []
    return [int(m.group(1)) for m in (re.match(r'\{"step": (\d+)', line) for line in lines) if m]


def part_nan_rollback(ctx: Context) -> str:
    """A NaN planted in one step's gradients (``--debug-inject-nan-at``): the guard rolls back to
    the last checkpoint, the run finishes with finite weights and losses."""
    nan_at, every, steps = ctx.sized((30, 20, 60), (8, 5, 20))
    run = ctx.work / "run"
    ctx.nanolm(
        "train",
        *ctx.train_args(
            "--steps",
            steps,
            "--ckpt-every",
            every,
            "--eval-every",
            every * 2,
            "--sample-tokens",
            "0",
            "--debug-inject-nan-at",
            nan_at,
        ),
        "--out-dir",
        run,
    )
    actions = [(e.get("step"), e.get("action"), e.get("to_step")) for e in events(run) if e.get("kind") == "nan"]
    check(
        actions == [(nan_at, "rollback", nan_at - nan_at % every)],
        f"NaN events {actions}, expected one at step {nan_at} rolled back to step {nan_at - nan_at % every}",
    )
    rows = metrics(run)
    check(
        rows[-1]["step"] == steps and all(finite(r["loss"]) for r in rows if "loss" in r),
        f"the run after the rollback ended at step {rows[-1]['step']} or logged a non-finite loss",
    )
    last = evaluations(rows)[-1]
    final_weights(run)
    ctx.figures.update(nan_at=nan_at, rolled_back_to=nan_at - nan_at % every, final_val_bpb=last["val_bpb"])
    return (
        f"NaN at step {nan_at} rolled back to step {nan_at - nan_at % every}; finished {steps} steps, "
        f"val bpb {last['val_bpb']:.3f}, weights finite"
    )


def flex_windows(ctx: Context):
    """(device, whether to go backward, the document ids of windows of the toy corpus, B, H, T, D):
    GPT-2 small's attention (12 heads of 64, context 1024) at half its batch, windows holding
    several stories each."""
    import torch

    from nanolm.batches import WindowSampler, pack_windows

    device = torch.device(ctx.device)
    tokens, _, eos = toy_tokens(ctx)
    B, H, T, D = ctx.sized((8, 12, 1024, 64), (4, 2, 256, 16))
    doc_ids = pack_windows(tokens, WindowSampler(len(tokens), T, B, seed=0).next_starts(), T, eos).doc_ids.to(device)
    check(
        bool((doc_ids[:, -1] > 0).float().mean() >= 0.5),
        "fewer than half the windows hold two documents: too little for the mask to separate",
    )
    return device, device.type == "cuda", doc_ids, (B, H, T, D)  # FlexAttention has no backward pass on a CPU


def part_flex(ctx: Context) -> str:
    """FlexAttention's block mask (the CUDA path of the document mask) against SDPA with the
    boolean block-diagonal mask and the hand-written reference, on windows of the toy corpus
    (several stories each): outputs and the gradients of q, k and v, in fp32 and bf16."""
    import torch
    import torch.nn.functional as F

    from nanolm.model import document_causal_mask, flex_attention, flex_document_mask, reference_attention

    device, backward, doc_ids, (B, H, T, D) = flex_windows(ctx)
    if not backward:
        ctx.notes.append("backward not checked: FlexAttention has no backward pass on a CPU")
    docs = (doc_ids[:, -1] + 1).float().mean().item()
    errors = {}
    for dtype, tolerance in ((torch.float32, 5e-3), (torch.bfloat16, 3e-2)):
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, grad = (torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g) for _ in range(4))
        dense = document_causal_mask(doc_ids)
        results = {}
        for name in ("flex", "sdpa", "reference"):
            leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
            with torch.set_grad_enabled(backward):
                if name == "flex":
                    out = flex_attention(*leaves, flex_document_mask(doc_ids))
                elif name == "sdpa":
                    out = F.scaled_dot_product_attention(*leaves, attn_mask=dense)
                else:
                    out = reference_attention(*leaves, dense)
                if backward:
                    out.backward(grad)
            results[name] = [out.detach()] + ([t.grad for t in leaves] if backward else [])
        label = str(dtype).removeprefix("torch.")
        for other in ("sdpa", "reference"):
            for tensor, a, b in zip(("out", "dq", "dk", "dv"), results["flex"], results[other]):
                err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                errors[f"{label} {tensor} vs {other}"] = err
                check(
                    err < tolerance,
                    f"{label}: FlexAttention's {tensor} differs from {other}'s by {err:.2e} "
                    f"of its largest value (tolerance {tolerance})",
                )
    ctx.figures.update(shape=[B, H, T, D], documents_per_window=docs, relative_max_errors=errors)
    worst = max(errors, key=errors.get)
    return f"largest difference {errors[worst]:.1e} ({worst}), {docs:.1f} documents per window"


def part_flex_cost(ctx: Context) -> str:
    """What FlexAttention's document mask costs, forward and backward in bf16 at GPT-2 small's
    attention (12 heads of 64, context 1024; batch 8), against plain causal attention (SDPA's
    own kernel and a causal block mask), the block mask's construction (once per forward
    pass, shared by every layer) timed apart."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask

    from nanolm.model import document_causal_mask, flex_attention, flex_document_mask

    device, backward, doc_ids, (B, H, T, D) = flex_windows(ctx)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v, grad = (torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g) for _ in range(4))
    doc_mask = flex_document_mask(doc_ids)
    causal_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=device, _compile=backward)
    variants = {
        "flex_document": lambda q, k, v: flex_attention(q, k, v, doc_mask),
        "flex_causal": lambda q, k, v: flex_attention(q, k, v, causal_mask),
        "sdpa_causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa_boolean_document": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=document_causal_mask(doc_ids)
        ),
    }
    ms = {
        name: timed_ms(device, lambda f=f: attend(f, (q, k, v), grad, backward), ctx.sized(20, 3))
        for name, f in variants.items()
    }
    ms["block_mask_build"] = timed_ms(device, lambda: flex_document_mask(doc_ids), ctx.sized(20, 3))
    kept = document_causal_mask(doc_ids).float().mean().item() / ((T + 1) / (2 * T))
    ratio = ms["flex_document"] / ms["sdpa_causal"]
    ctx.figures.update(
        cost_dtype=str(dtype),
        ms=ms,
        timed="forward and backward" if backward else "forward",
        share_of_causal_pairs_kept=kept,
        flex_document_over_sdpa_causal=ratio,
        flex_document_over_flex_causal=ms["flex_document"] / ms["flex_causal"],
    )
    return (
        f"document mask {ms['flex_document']:.2f} ms vs "
        f"{ms['sdpa_causal']:.2f} ms plain causal ({ratio:.2f}x, keeping {kept:.0%} of the causal pairs), "
        f"block mask {ms['block_mask_build']:.2f} ms"
    )


def attend(f, qkv, grad, backward: bool):
    import torch

    leaves = [t.detach().requires_grad_(backward) for t in qkv]
    with torch.set_grad_enabled(backward):
        out = f(*leaves)
        if backward:
            out.backward(grad)


def timed_ms(device, fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` after two warm-up calls (which compile what needs compiling)."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def part_throughput(ctx: Context) -> str:
    """``benchmarks/throughput.py`` at GPT-2 small's shape (124M parameters, context 1024, batch
    16, vocabulary 50,304, ``--precision auto``): nanolm's training step with the document mask
    and without, eager and compiled: tokens/s, MFU against the GPU's data-sheet peak, compile
    time, the mask's cost, peak memory."""
    import torch

    from nanolm.machine.hardware import gpu_peak_flops
    from nanolm.precision import resolve_precision

    args = [
        "--device",
        ctx.device,
        "--no-reference",
        "--rounds",
        ctx.sized("3", "1"),
        "--steps",
        ctx.sized("5", "1"),
        "--warmup",
        ctx.sized("2", "1"),
    ]
    if ctx.tiny:
        args += ["--shapes", "nanogpt", "--batch-size", "2"] + (["--threads", str(ctx.threads)] if ctx.threads else [])
    else:
        args += ["--shapes", "gpt2", "--compile"]
        auto = resolve_precision("auto", torch.device(ctx.device))
        name = torch.cuda.get_device_name(ctx.device)
        declared = os.environ.get("PEAK_TFLOPS")  # a GPU the data sheet table does not know
        peak = (
            float(declared) * 1e12
            if declared
            else gpu_peak_flops(name, auto.autocast_dtype or torch.float32, torch.backends.cuda.matmul.allow_tf32)
        )
        if peak:
            args += ["--peak-tflops", f"{peak / 1e12:g}"]
        else:
            ctx.notes.append(
                f"MFU against throughput.py's 989 TFLOP/s: {name} is not in nanolm.machine.hardware's table; "
                f"set PEAK_TFLOPS"
            )
        ctx.figures["peak_tflops"] = peak / 1e12 if peak else None
    shape = ctx.sized("gpt2", "nanogpt")
    report = run_benchmark(ctx, "throughput.py", args)
    s = report["shapes"][shape]
    variants = {k: v for k, v in s.items() if isinstance(v, dict) and "tokens_per_sec" in v}
    expected = {"nanolm", "nanolm_mask_off"} | (set() if ctx.tiny else {"nanolm_compiled", "nanolm_mask_off_compiled"})
    check(expected <= set(variants), f"variants measured: {sorted(variants)}, expected {sorted(expected)}")
    check(all(v["tokens_per_sec"] > 0 for v in variants.values()), "a variant measured no throughput")
    if ctx.tiny:
        ctx.notes.append("no compiled variants and no MFU at toy sizes on a CPU")
    ctx.figures.update(
        parameters=s["parameters"],
        precision=report["precision"],
        variants=variants,
        time_ratios=s["time_ratios"]["wall"],
        peak_vram_mb=report.get("peak_vram_mb"),
    )
    labels = {
        "nanolm": "mask on",
        "nanolm_mask_off": "mask off",
        "nanolm_compiled": "compiled mask on",
        "nanolm_mask_off_compiled": "compiled mask off",
    }
    shown = [
        f"{label} {variants[name]['tokens_per_sec'] / 1e3:.0f}k"
        + (f" ({variants[name]['mfu']:.0%})" if "mfu" in variants[name] else "")
        for name, label in labels.items()
        if name in variants
    ]
    return f"{s['parameters'] / 1e6:.0f}M, {report['precision']}, tokens/s (MFU): " + ", ".join(shown)


def run_benchmark(ctx: Context, script: str, args: list[str]) -> dict:
    """Run ``benchmarks/SCRIPT ARGS``; returns the JSON it prints last. What it says goes to this
    part's log as it comes, so a benchmark stopped at the part's time limit still shows how far
    it got."""
    code, output = streamed([sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)], ctx.work)
    check(code == 0, f"{script} exited {code}: {last_line(output)}")
    lines = output.splitlines()
    start = max((i for i, line in enumerate(lines) if line == "{"), default=None)
    check(start is not None, f"{script} printed no JSON: {last_line(output)}")
    return json.loads("\n".join(lines[start:]))


def part_head_and_loss(ctx: Context) -> str:
    """``benchmarks/head_and_loss.py`` at GPT-2's vocabulary (50,304), 16 x 1024 positions of
    width 768: the output head and the loss from the whole logits against nanolm's fused chunks,
    time and peak memory of each, and whether their gradients agree."""
    args = ctx.sized(
        ["--vocab", "50304", "--tokens", "16384", "--width", "768", "--rounds", "5"],
        ["--vocab", "256", "--tokens", "256", "--width", "32", "--rounds", "1", "--threads", "1"],
    )
    report = run_benchmark(ctx, "head_and_loss.py", ["--device", ctx.device.split(":")[0], *args])
    r = report["results"][0]
    ctx.figures.update(r)
    check(r["same_gradients"], "the fused head and loss do not give the whole logits' gradients")
    memory = f", {r['peak_mb_whole']} vs {r['peak_mb_fused']} MiB peak" if r.get("peak_mb_whole") else ""
    return f"whole {r['whole_ms']} ms, fused {r['fused_ms']} ms{memory}; same gradients"


def part_gpu_tests(ctx: Context) -> str:
    """The GPU-marked tests (``pytest -m gpu``): fused AdamW, bf16 autocast, FlexAttention, torch.compile
    and NCCL against their plain counterparts. On a CPU they all skip, which is what this checks there."""
    code, output = streamed(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs", str(ROOT / "tests")], ROOT
    )
    summary = last_line(output)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    ctx.figures.update(counts=counts, summary=summary)
    check(code == 0, f"pytest -m gpu: {summary}")
    if ctx.device == "cpu":
        check(
            counts.get("passed", 0) == 0 and counts.get("skipped", 0) > 0, f"on a CPU every GPU test skips: {summary}"
        )
        ctx.notes.append("every GPU test skipped on the CPU")
    return summary.strip("= ")


@dataclass(frozen=True)
class Part:
    name: str
    run: Callable[[Context], str]
    limit_s: int  # its own time limit on a GPU (toy sizes on a CPU get the same)
    estimate_s: int  # what it should take on a cold H200 (empty compile caches), by its steps: docs/gpu.md
    group: str  # first, second or timing: which run of the script it belongs to
    alone: bool = False  # times the device: runs by itself, after the others


# In the order of what a first contact must prove, most important first. Each estimate counts a
# process's start (~10 s: Python, PyTorch, CUDA's context), Triton compiling FlexAttention's
# kernels cold (~30 s forward and backward, per process: parts that start together do not share
# a cache yet) and the work itself; docs/gpu.md has the table.
PARTS = [
    Part("train", part_train, 240, 100, "first"),  # 3 processes: train (300 steps), eval, export
    Part("kill9", part_kill9, 240, 110, "first"),  # 3 runs of 120 steps, the first compiling cold
    Part("flex", part_flex, 180, 80, "first"),  # forward and backward in 2 dtypes: 2 cold compiles
    Part("bf16_vs_fp32", part_bf16_vs_fp32, 120, 45, "first"),  # one batch, twice
    Part("fp16_overflow", part_fp16_overflow, 120, 45, "second"),
    Part("nan_rollback", part_nan_rollback, 150, 60, "second"),
    Part("bf16_pure", part_bf16_pure, 150, 60, "second"),
    Part("muon", part_muon, 150, 60, "second"),
    Part("compile", part_compile, 240, 150, "second"),  # a whole-model compile, cold
    Part("gpu_tests", part_gpu_tests, 300, 180, "second"),  # pytest -m gpu: two compiled models
    Part("flex_cost", part_flex_cost, 180, 60, "timing", alone=True),
    Part("throughput", part_throughput, 330, 300, "timing", alone=True),  # two cold compiles of GPT-2 small
    Part("head_and_loss", part_head_and_loss, 120, 60, "timing", alone=True),
]
GROUPS = {
    "first": "the first contact: the default training loop end to end, kill -9 and a bit-identical resume, "
    "FlexAttention against SDPA, bf16 against fp32",
    "second": "the other number formats, the NaN guard, Muon, --compile, the GPU-marked tests",
    "timing": "what the device does per second, each part alone: FlexAttention's cost, tokens/s and MFU, "
    "the head and the loss",
}
BY_NAME = {p.name: p for p in PARTS}


def planned_seconds(parts: list[Part], jobs: int) -> float:
    """When the last part would end by the estimates: the parts that check numbers ``jobs`` at a
    time, in order, each starting as a slot frees; then the timing parts, one after another."""
    slots = [0.0] * max(1, jobs)
    for part in (p for p in parts if not p.alone):
        slots[slots.index(min(slots))] += part.estimate_s
    return max(slots) + sum(p.estimate_s for p in parts if p.alone)


def chosen_parts(spec: str) -> list[str]:
    """``--parts``: group names (first, second, timing, all) and part names, comma-separated."""
    names = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        if item == "all":
            names += [p.name for p in PARTS]
        elif item in GROUPS:
            names += [p.name for p in PARTS if p.group == item]
        else:
            names.append(item)
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------- one part, in its own process
def run_one_part(args) -> int:
    """The child: run one part, write what it found to ``--result``. Its stdout is the part's log."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    append = shlex.split(dict(args.append).get(args.part, ""))
    ctx = Context(args.device, args.tiny, Path(args.work), args.threads, append)
    part = BY_NAME[args.part]
    print(
        f"== {part.name} on {args.device}{' (toy sizes)' if args.tiny else ''}: {part.run.__doc__.split(chr(10))[0]}",
        flush=True,
    )
    start = time.perf_counter()
    status, figure = "PASS", ""
    try:
        figure = part.run(ctx)
    except Failed as e:
        status, figure = "FAIL", str(e)
    except Skipped as e:
        status, figure = "SKIP", str(e)
    print(f"== {status} {part.name}: {figure}", flush=True)
    result = {
        "part": args.part,
        "status": status,
        "figure": figure,
        "notes": ctx.notes,
        "seconds": round(time.perf_counter() - start, 1),
        "figures": ctx.figures,
    }
    Path(args.result).write_text(json.dumps(result, indent=2, default=str))
    return 0


# --------------------------------------------------------------------------- the driver
@dataclass
class Running:
    part: Part
    proc: subprocess.Popen
    started: float
    limit: float
    log: object


def stop_group(proc: subprocess.Popen) -> None:
    """Kill a part's process and whatever it started (a `nanolm train` it was waiting for, one it
    left running in the background): they share its process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def machine(device: str) -> dict:
    import platform

    import torch

    info = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
    }
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(device)
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "missing (torch.compile and FlexAttention need it)"
        info.update(
            gpu=p.name,
            memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
            gpus=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            triton=triton_version,
            bf16=torch.cuda.is_bf16_supported(including_emulation=False),
        )
    else:
        info.update(cpus=os.cpu_count())
    return info


def parse_pairs(values: list[str], what: str, kind=str) -> list[tuple[str, object]]:
    pairs = []
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or name not in BY_NAME:
            print(
                f"gpu_check: --{what} wants PART=VALUE with PART one of {', '.join(BY_NAME)}, got {value!r}",
                file=sys.stderr,
            )
            raise SystemExit(2)
        pairs.append((name, kind(rest)))
    return pairs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out",
        default="runs/gpu_check",
        help="directory for the figures (JSON) and the logs, absolute "
        "or relative to the current one (default: %(default)s)",
    )
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (with --tiny: the harness's own test)")
    p.add_argument("--tiny", action="store_true", help="toy sizes, for running the parts on a CPU")
    p.add_argument(
        "--parts",
        default="first",
        help="comma-separated groups or parts (default: %(default)s). Groups: "
        + "; ".join(f"{g}: {', '.join(p.name for p in PARTS if p.group == g)}" for g in GROUPS)
        + "; all: every part",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="parts that only check numbers run this many at a time (default: 4 on a GPU, 1 on a CPU)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=BUDGET_S,
        help="seconds for the whole run: a part that cannot start "
        "before it ends is not run (default: %(default)s; the estimates of the parts chosen are printed "
        "at the start)",
    )
    p.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="a part's own time limit instead of its default",
    )
    p.add_argument(
        "--append",
        action="append",
        default=[],
        metavar="PART=ARGS",
        help="options added to every `nanolm train` of a part (the tests plant faults this way, e.g. "
        "kill9='--debug-drop-optimizer-state')",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads of every process (default: PyTorch's)")
    p.add_argument("--work", default=None, help="scratch directory for the runs (default: a temporary one, removed)")
    p.add_argument("--part", help=argparse.SUPPRESS)  # the child: run this one part
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


class PartRunner:
    """Runs the chosen parts, each in a process of its own (``jobs`` at a time, an ``alone`` part
    by itself), each within its time limit and all within the budget; records each result as
    it ends (``OUT/PART.json`` and a line)."""

    def __init__(self, args, names: list[str], limits: dict, jobs: int, out: Path, work: Path, env: dict):
        self.args, self.limits, self.jobs, self.out, self.work, self.env = args, limits, jobs, out, work, env
        self.queue = [BY_NAME[n] for n in names if not BY_NAME[n].alone] + [
            BY_NAME[n] for n in names if BY_NAME[n].alone
        ]
        self.running: list[Running] = []
        self.results: dict[str, dict] = {}
        self.deadline = time.perf_counter() + args.budget

    def run(self) -> None:
        try:
            while self.queue or self.running:
                now = time.perf_counter()
                alone_next = self.queue and self.queue[0].alone
                while self.queue and self.deadline - now < 5:  # no time left to start anything
                    self.record(
                        self.queue.pop(0),
                        {
                            "status": "FAIL",
                            "figure": f"not run: the {self.args.budget:.0f} s budget was spent",
                            "figures": {},
                        },
                        0.0,
                    )
                if self.queue and (
                    (not alone_next and len(self.running) < self.jobs) or (alone_next and not self.running)
                ):
                    self.launch(self.queue.pop(0))
                    continue
                for r in list(self.running):
                    if r.proc.poll() is not None or time.perf_counter() - r.started > r.limit:
                        timed_out = r.proc.poll() is None
                        stop_group(r.proc)
                        self.running.remove(r)
                        self.finish(r, timed_out)
                time.sleep(0.1)
        finally:
            for r in self.running:  # interrupted: leave nothing running on the GPU
                stop_group(r.proc)

    def launch(self, part: Part) -> None:
        args, work = self.args, self.work
        limit = min(self.limits[part.name], self.deadline - time.perf_counter())
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--part",
            part.name,
            "--device",
            args.device,
            "--work",
            str(work / part.name),
            "--result",
            str(work / f"{part.name}.result.json"),
        ]
        argv += ["--tiny"] * args.tiny + (["--threads", str(args.threads)] if args.threads else [])
        argv += [f"--append={name}={value}" for name, value in args.append]
        (work / f"{part.name}.result.json").unlink(missing_ok=True)  # a --work used before holds old ones
        log = open(self.out / "logs" / f"{part.name}.log", "w")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=work, start_new_session=True
        )  # its own process group: a timeout kills its children too
        self.running.append(Running(part, proc, time.perf_counter(), limit, log))

    def finish(self, r: Running, timed_out: bool) -> None:
        r.log.close()
        seconds = round(time.perf_counter() - r.started, 1)
        result_file = self.work / f"{r.part.name}.result.json"
        if timed_out:
            budget_end = r.limit < self.limits[r.part.name]
            result = {
                "status": "FAIL",
                "figure": f"timed out after {r.limit:.0f} s"
                + (" (the end of the --budget)" if budget_end else " (the part's time limit)"),
                "figures": {},
            }
        elif result_file.exists():
            result = json.loads(result_file.read_text())
        else:
            result = {
                "status": "FAIL",
                "figure": f"crashed (exit {r.proc.returncode}): "
                f"{last_line((self.out / 'logs' / f'{r.part.name}.log').read_text(errors='replace'))}",
                "figures": {},
            }
        self.record(r.part, result, seconds)

    def record(self, part: Part, result: dict, seconds: float) -> None:
        result = {**result, "part": part.name, "seconds": seconds, "device": self.args.device, "tiny": self.args.tiny}
        self.results[part.name] = result
        (self.out / f"{part.name}.json").write_text(json.dumps(result, indent=2, default=str))
        notes = f" [{'; '.join(result['notes'])}]" if result.get("notes") else ""
        print(f"{result['status']} {part.name} ({seconds:.1f} s): {result['figure']}{notes}", flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.append = parse_pairs(args.append, "append")
    if args.part:
        return run_one_part(args)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA GPU is visible to PyTorch {torch.__version__} (torch.cuda.is_available() is False); "
            f"nothing was run",
            file=sys.stderr,
        )
        return 2
    names = chosen_parts(args.parts)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        print(
            f"gpu_check: unknown part(s) {unknown}; known: {', '.join(BY_NAME)}, or the groups "
            f"{', '.join(GROUPS)}, all",
            file=sys.stderr,
        )
        return 2
    limits = {p.name: p.limit_s for p in PARTS} | dict(parse_pairs(args.timeout, "timeout", float))
    jobs = args.jobs or (4 if args.device.startswith("cuda") else 1)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PYTHONUNBUFFERED": "1",
    }
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor_cache"))  # cold: the budget holds without a warm one
    info = machine(args.device)
    where = (
        f"{info['gpu']}, {info['memory_gib']} GiB, compute capability {info['capability']} | "
        f"torch {info['torch']}, CUDA {info['cuda']}, Triton {info['triton']}"
        if "gpu" in info
        else f"cpu, {info['cpus']} cores{', toy sizes' if args.tiny else ''} | torch {info['torch']}"
    )
    print(f"gpu_check: {where} | {len(names)} parts, {args.budget:.0f} s budget | {info['date']}", flush=True)
    estimates = {n: BY_NAME[n].estimate_s for n in names}
    planned = planned_seconds([BY_NAME[n] for n in names], jobs)
    print(
        "gpu_check: estimated seconds on a cold H200: "
        + ", ".join(f"{n} {e}" for n, e in estimates.items())
        + f"; {sum(estimates.values())} s one after another, ~{planned:.0f} s {jobs} at a time"
        + (
            ""
            if planned <= args.budget
            else f": more than the {args.budget:.0f} s budget, raise --budget or choose fewer --parts"
        ),
        flush=True,
    )

    start = time.perf_counter()
    runner = PartRunner(args, names, limits, jobs, out, work, env)
    try:
        runner.run()
    except KeyboardInterrupt:
        print("gpu_check: interrupted; every part still running was stopped", file=sys.stderr)
        return 130
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)

    seconds, results = time.perf_counter() - start, runner.results
    passed = sum(r["status"] == "PASS" for r in results.values())
    skipped = sum(r["status"] == "SKIP" for r in results.values())
    failed = [name for name, r in results.items() if r["status"] == "FAIL"]
    summary = {
        "passed": passed,
        "skipped": skipped,
        "failed": failed,
        "parts": len(names),
        "seconds": round(seconds, 1),
        "budget_s": args.budget,
        "estimates_s": estimates,
        "planned_s": planned,
        "machine": info,
        "argv": sys.argv[1:] if argv is None else argv,
        "results": {n: results[n] for n in names},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(
        f"gpu_check: {passed}/{len(names)} parts passed"
        + (f", {skipped} skipped" if skipped else "")
        + (f", FAILED: {', '.join(failed)}" if failed else "")
        + f" in {seconds:.0f} s on "
        f"{info.get('gpu', 'cpu (toy sizes: this proves the harness, not a GPU)')}; figures in {out}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
