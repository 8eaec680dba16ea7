"""``nanolm lab``: a healthy run and the same run broken on purpose, several ways, diagnosed.

The course's lab ("a run deliberately broken four ways"), made real. Every variant is the
real training code (:func:`nanolm.train.train`) on the built-in story corpus, with one
part swapped for a broken one (``nanolm.instruments.faults``, switched on by a hidden ``--debug-*``
option) or an ordinary option changed: targets not shifted,
attention that sees the future, a loss not divided by the accumulation count, fp16 without
loss scaling, a resume that forgets the optimizer state, a corrupted stretch of the data, a
learning rate ten times too high without warmup, clipping switched off, beta2 = 0.999 with a
short warmup, no learning-rate decay, weight decay on norms and embeddings, targets that do
not follow from the inputs, a tiny corpus memorised... For each the lab writes the run
directory, a dashboard that overlays the healthy baseline (``nanolm report``), and the
output of ``nanolm diagnose``, which sees only the run's metrics and events, never the
switch. The final table says, per variant, what was broken, the symptom one should expect,
what the diagnosis said, and whether it matched.

Two honest controls are part of the table. The healthy run must get no finding at all.
And a missing cross-document mask is *invisible* on this corpus: its stories are drawn
independently, so reading the previous story tells the model nothing about the next, and
no metric can show the bug (which is exactly why it survives in real code bases; the mask
has its own tests and a `nanolm doctor` check). The lab expects no finding there, and says so.

``--quick`` shrinks everything (a tiny model, a small corpus, 200 steps) so that a test can
run the variants in seconds. Six symptoms need the full-size model (a 2-layer, 32-wide model
does not spike, memorise...): each such variant says why in ``needs_full_length``, and
``--quick`` leaves it out and lists it with that reason under the table. The default takes
about half a minute per variant on two CPU cores (the fp16 one runs 20 steps: CPUs emulate
fp16 arithmetic slowly, and its symptom, gradients below fp16's range, shows from the first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..base import disk
from ..base.files import atomic_write_text, refuse_taken_outputs
from ..base.lock import RunLock
from ..errors import NanolmError
from ..run.config import RunConfig


@dataclass
class Variant:
    """One broken (or healthy) run: what is broken, the symptom to expect, and the finding
    names of which at least one must appear (none for the healthy run and the control)."""

    name: str
    broken: str
    symptom: str
    expect: tuple[str, ...]
    change: Callable[[RunConfig], None] = lambda cfg: None
    resume_at: float | None = None  # stop (SIGKILL) after the checkpoint at this share of the steps, then resume
    steps_scale: float = 1.0
    needs_full_length: str = ""  # why --quick's tiny model cannot show the symptom ("" when it can)


def _set(**values):
    """A config change: ``section__key=value`` pairs (a callable value gets the config)."""

    def change(cfg: RunConfig) -> None:
        for path, value in values.items():
            section, key = path.split("__")
            setattr(getattr(cfg, section), key, value(cfg) if callable(value) else value)

    return change


def _loss_not_averaged(cfg: RunConfig) -> None:
    cfg.train.grad_accum, cfg.train.batch_size = 4, max(1, cfg.train.batch_size // 4)
    cfg.debug.loss_not_averaged = True


VARIANTS = [
    Variant("healthy", "nothing", "the loss falls toward the floor; no finding", ()),
    Variant(
        "high_lr_no_warmup",
        "learning rate x10 and no warmup",
        "a loss spike after a gradient-norm spike in the first steps; attention logits in the hundreds",
        ("loss_spike", "attention_logits", "clipped_most_steps", "dead_units", "train_loss_rising"),
        _set(optim__lr=lambda c: c.optim.lr * 10, optim__warmup=0),
        needs_full_length=(
            "the tiny model's attention logits grow but its loss never spikes: a 2-layer, 32-wide "
            "model is too shallow to amplify a large update into a loss spike"
        ),
    ),
    Variant(
        "fp16_no_loss_scaling",
        "fp16 autocast without loss scaling",
        "about a fifth of the gradient values below fp16's normal range, from the first step (underflow)",
        ("fp16_underflow",),
        _set(train__precision="fp16", debug__no_loss_scaling=True),
        steps_scale=0.04,
    ),
    Variant(
        "targets_not_shifted",
        "targets are the inputs (not shifted by one)",
        "training loss far below the data's floor; validation worse than the untrained model",
        ("leak", "val_worse_than_start"),
        _set(debug__unshifted_targets=True),
    ),
    Variant(
        "non_causal",
        "attention sees the future (no causal mask)",
        "training and validation loss below the data's floor",
        ("leak",),
        _set(debug__non_causal=True),
        needs_full_length=(
            "in 200 steps the tiny model learns to read the next token only partly: its "
            "loss falls far below the healthy run's but stays far above the data's floor"
        ),
    ),
    Variant(
        "loss_not_averaged",
        "micro-batch losses not divided by grad_accum (4)",
        "gradient norm ~4x too large: every step clipped",
        ("clipped_most_steps",),
        _loss_not_averaged,
    ),
    Variant(
        "resume_without_optimizer_state",
        "killed after a checkpoint, resumed without the optimizer state",
        "a jolt in gradient norm and loss right after the resume",
        ("resume_jump",),
        _set(debug__drop_optimizer_state=True),
        resume_at=0.12,
        needs_full_length=(
            "a fresh optimizer's full-size first steps do not jolt a model this small: its "
            "gradient norm after the resume is below its level before"
        ),
    ),
    Variant(
        "no_doc_mask",
        "cross-document attention mask off",
        "none in the metrics: the stories are independent, so there is nothing to leak (control)",
        (),
        _set(data__doc_mask=False),
    ),
    Variant(
        "corrupt_data",
        "2% of the training tokens replaced by random ids (one stretch)",
        "isolated loss spikes without a gradient-norm rise; train loss above val loss",
        ("data_spikes",),
        _set(debug__corrupt_data=0.02),
    ),
    Variant(
        "bad_batch_nan",
        "one step's gradient made NaN (guard: --on-nan rollback)",
        "a NaN event, rolled back to the last checkpoint; the run ends close to healthy",
        ("non_finite",),
        _set(debug__inject_nan_at=lambda c: int(c.train.steps * 0.6)),
    ),
    Variant(
        "no_clipping_high_lr",
        "clipping off (--clip 0) at a learning rate x10",
        "gradient-norm spikes of tens of times the median reach the weights; attention logits run away",
        ("no_clipping",),
        _set(optim__clip=0.0, optim__lr=lambda c: c.optim.lr * 10),
        needs_full_length=(
            "the tiny model's gradient norm stays within a few times its median: no spike large "
            "enough to call unclipped"
        ),
    ),
    Variant(
        "beta2_0999_short_warmup",
        "AdamW beta2 = 0.999 with a 5-step warmup (learning rate x3)",
        "early gradient-norm spikes while the second moment still remembers the first steps; the loss lags",
        ("slow_second_moment",),
        _set(optim__beta2=0.999, optim__warmup=5, optim__lr=lambda c: c.optim.lr * 3),
        needs_full_length=(
            "the tiny model's early gradient norms stay close to its later ones: too small a "
            "model to go unstable while the second moment catches up"
        ),
    ),
    Variant(
        "constant_lr",
        "a constant learning rate: no decay (--min-lr = --lr)",
        "the loss still bounces at the end, above where a decayed run settles",
        ("no_lr_decay",),
        _set(optim__min_lr=lambda c: c.optim.lr),
    ),
    Variant(
        "decay_on_everything",
        "weight decay on norms, biases and embeddings too",
        "trains a little worse, nothing loud in the curves; the optimizer's recorded groups say it",
        ("decay_on_norms",),
        _set(debug__decay_everything=True),
    ),
    Variant(
        "random_targets",
        "targets drawn at random, independently of the inputs (a data bug)",
        "the loss stays at ln V: there is nothing to learn",
        ("loss_stuck",),
        _set(debug__random_targets=True),
    ),
    Variant(
        "memorising",
        "a tiny corpus (40 stories) trained 600 steps: ~60 epochs",
        "the training loss falls toward 0 while the validation loss rises",
        ("memorising",),
        _set(data__stories=40, train__steps=600),
        needs_full_length=(
            "the tiny model lacks the capacity to memorise even 40 stories: its validation loss is "
            "still falling at step 600"
        ),
    ),
]
BY_NAME = {v.name: v for v in VARIANTS}


def base_config(out_dir: Path, steps: int | None = None, quick: bool = False, seed: int = 1337) -> RunConfig:
    """The healthy run every variant starts from: the built-in stories, a small model, CPU.

    Every step is logged (``--log-every 1``) so that isolated spikes are visible, with
    per-layer statistics every 10 steps and an evaluation every tenth of the run. fp32 (unless
    a variant asks otherwise): a controlled experiment gives the same numbers on every CPU, where
    ``--precision auto`` would pick bf16 on some and fp32 on others.
    """
    cfg = RunConfig()
    m, d, t = cfg.model, cfg.data, cfg.train
    if quick:
        m.n_layer, m.n_head, m.n_embd, m.seq_len = 2, 2, 32, 32
        d.stories, d.vocab_size = 300, 300
        t.batch_size, t.steps, t.eval_windows = 8, steps or 200, 32
    else:
        m.n_layer, m.n_head, m.n_embd, m.seq_len = 4, 4, 128, 64
        d.stories = 2000
        t.batch_size, t.steps, t.eval_windows = 16, steps or 500, 160
    t.seed, t.device, t.log_every, t.stats_every, t.precision = seed, "cpu", 1, 10, "fp32"
    t.eval_every = max(10, t.steps // 10)
    t.sample_tokens, t.progress, t.out_dir = 0, "lines", str(out_dir)
    return cfg


@dataclass
class LabResult:
    name: str
    broken: str
    symptom: str
    expected: list[str]
    found: list[str]
    titles: list[str]
    matched: bool
    wall_s: float
    run_dir: str
    error: str | None = None
    dashboard: str | None = None
    extra: dict = field(default_factory=dict)

    def diagnosis(self) -> str:
        return "; ".join(f"{n}: {t}" for n, t in zip(self.found, self.titles)) or "no findings"


def _subprocess_env() -> dict:
    """Run child processes on this very nanolm (a checkout can differ from the installed one)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_variant(
    variant: Variant,
    out: Path,
    steps: int | None = None,
    quick: bool = False,
    seed: int = 1337,
    log_lines: list[str] | None = None,
) -> tuple[Path, str | None]:
    """Train one variant into ``out/<name>``; returns (run dir, error message or None)."""
    from ..base.lock import DirectoryBusy
    from ..train import train
    from .faults import factories

    run_dir = out / variant.name
    cfg = base_config(run_dir, steps, quick, seed)
    cfg.train.steps = max(20, round(cfg.train.steps * variant.steps_scale))
    cfg.train.eval_every = max(10, cfg.train.steps // 10)
    variant.change(cfg)
    lines = log_lines if log_lines is not None else []
    error = None
    try:
        if variant.resume_at:
            resolved = cfg.resolved()
            stop = max(resolved.optim.warmup + 2, round(cfg.train.steps * variant.resume_at))
            cfg.train.ckpt_every = stop
            first = cfg.resolved()  # a copy
            first.debug.drop_optimizer_state = False
            first.debug.kill_after_checkpoint = stop
            disk.make_dir(run_dir.parent, parents=True, exist_ok=True)
            config_file = out / f".{variant.name}-part1.toml"
            atomic_write_text(config_file, first.to_toml())
            proc = subprocess.run(
                [sys.executable, "-m", "nanolm", "train", "--config", str(config_file)],
                capture_output=True,
                text=True,
                env=_subprocess_env(),
            )
            disk.remove(config_file)
            lines += proc.stdout.splitlines() + proc.stderr.splitlines()
            if proc.returncode != -9 or not (run_dir / "checkpoints").is_dir():
                raise NanolmError(
                    f"the first part of {variant.name} did not stop at its checkpoint "
                    f"(exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:] or ''}"
                )
            lines.append(
                f"--- killed after the checkpoint of step {stop}; resuming "
                f"{'without' if cfg.debug.drop_optimizer_state else 'with'} the optimizer state"
            )
        train(cfg, log=lines.append, factories=factories(cfg))
    except DirectoryBusy:  # another process writes there: nothing of it is touched, not even train.log
        lines = None
        raise
    except NanolmError as e:
        error = str(e)
        lines.append(f"error: {e}")
    finally:
        if run_dir.is_dir() and lines is not None:
            atomic_write_text(run_dir / "train.log", "\n".join(lines) + "\n")
    return run_dir, error


def run_lab(
    out,
    only: list[str] | None = None,
    steps: int | None = None,
    quick: bool = False,
    seed: int = 1337,
    report: bool = True,
    log=print,
) -> list[LabResult]:
    """Run the variants (all, or ``only``) into ``out``; returns one :class:`LabResult` each
    and writes ``out/lab.md`` and ``out/lab.json``."""
    out = Path(out)
    names = only or [v.name for v in VARIANTS if not (quick and v.needs_full_length)]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise NanolmError(f"unknown lab variant {unknown[0]!r}; known: {', '.join(BY_NAME)}")
    if steps is not None and steps < 20:
        raise NanolmError(f"--steps must be at least 20 for the lab, got {steps}")
    with RunLock() as lock:  # one writer: a second lab on --out is refused, not mixed in
        lock.take(out, flag="--out", log=log)
        return _lab(names, out, steps, quick, seed, report, only, log)


def _lab(names: list[str], out: Path, steps, quick: bool, seed: int, report: bool, only, log) -> list[LabResult]:
    from .diagnose import diagnose, format_findings  # here: `nanolm train` reads VARIANTS for --help, nothing more

    refuse_taken_outputs(out, names)
    disk.make_dir(out, parents=True, exist_ok=True)
    results = []
    for name in names:
        variant = BY_NAME[name]
        log(f"lab: {name}: {variant.broken} ...")
        started = time.perf_counter()
        run_dir, error = run_variant(variant, out, steps, quick, seed)
        wall = time.perf_counter() - started
        try:
            findings = diagnose(run_dir)
        except NanolmError as e:
            findings, error = [], error or str(e)
        text = format_findings(run_dir, findings)
        if run_dir.is_dir():
            atomic_write_text(run_dir / "diagnosis.txt", text + "\n")
        found = [f.name for f in findings]
        matched = (not found) if not variant.expect else any(n in variant.expect for n in found)
        result = LabResult(
            name,
            variant.broken,
            variant.symptom,
            list(variant.expect),
            found,
            [f.title for f in findings],
            matched,
            round(wall, 1),
            str(run_dir),
            error,
        )
        if quick and variant.needs_full_length:
            result.extra["needs_full_length"] = variant.needs_full_length
        if report and run_dir.is_dir():
            result.dashboard = _dashboard(run_dir, out / "healthy" if name != "healthy" else None, log)
        results.append(result)
        log(text)
        log(f"lab: {name}: {'matched' if matched else 'NOT matched'} ({wall:.0f}s)\n")
    left_out = [] if only or not quick else [v for v in VARIANTS if v.needs_full_length]
    table = format_table(results, left_out)
    atomic_write_text(out / "lab.md", table + "\n")
    atomic_write_text(out / "lab.json", json.dumps([r.__dict__ for r in results], indent=2) + "\n")
    log(table)
    return results


def _dashboard(run_dir: Path, healthy: Path | None, log) -> str | None:
    """The variant's dashboard, with the healthy run on the same axes when there is one."""
    from .report import render

    runs = [run_dir] + ([healthy] if healthy is not None and (healthy / "metrics.jsonl").is_file() else [])
    try:
        return render(runs, run_dir / "report")["dashboard"]
    except NanolmError as e:  # matplotlib missing: the lab still diagnoses
        log(f"lab: no dashboard ({e})")
        return None


def format_table(results: list[LabResult], left_out: list[Variant] = ()) -> str:
    """The lab's summary as a Markdown table, then the variants ``--quick`` left out and why."""
    lines = [
        "| variant | what is broken | expected symptom | diagnosis | matched | wall |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        diagnosis = r.diagnosis() + (f" (run error: {r.error})" if r.error else "")
        if r.extra.get("needs_full_length"):
            diagnosis += f" (at --quick size this variant needs the full length: {r.extra['needs_full_length']})"
        lines.append(
            f"| {r.name} | {r.broken} | {r.symptom} | {diagnosis} | {'yes' if r.matched else 'NO'} | {r.wall_s:.0f} s |"
        )
    n = sum(r.matched for r in results)
    lines.append("")
    lines.append(f"{n} of {len(results)} variants matched.")
    if left_out:
        lines += [
            "",
            f"Not run with --quick ({len(left_out)}): their symptom needs the full-size model and run "
            "(run `nanolm lab` without --quick, or `--only NAME` to see one miss):",
        ]
        lines += [f"- {v.name}: {v.needs_full_length}" for v in left_out]
    return "\n".join(lines)
