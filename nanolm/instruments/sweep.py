"""``nanolm sweep --lrs 1e-3,3e-3,1e-2``: pick a learning rate the way the course does.

Run the same short training (~200 steps) at each rate, draw the curves on the same axes,
and take the *largest stable* one. Why the largest: up to the point where training becomes
unstable, a higher rate learns faster, and the rate that is best for 200 steps is usually a
little below the edge; why stable: a rate that spikes or diverges in a short run only gets
worse over a long one, whose warmup ends at the same peak.

**The rule**, exactly. A rate is *stable* when its run

1. finished (the guard did not stop it) with finite losses throughout, and the guard never
   had to skip or roll back a step;
2. shows none of these findings of ``nanolm diagnose``: ``non_finite``, ``guard_actions``,
   ``loss_stuck``, ``loss_spike``, ``train_loss_rising``, ``fp16_overflow``;
3. ended within ``--tolerance`` (default 10 %) of the best final loss among the stable runs
   (the last validation loss, or the mean training loss of the last tenth of the run when
   there is no validation set), so that a rate that stays finite but learns badly is not
   recommended.

The recommendation is the largest rate that satisfies all three.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from pathlib import Path

from ..base import disk
from ..base.files import atomic_write_text
from ..errors import NanolmError

UNSTABLE_FINDINGS = ("non_finite", "guard_actions", "loss_stuck", "loss_spike", "train_loss_rising", "fp16_overflow")
DEFAULT_STEPS = 200


def parse_lrs(text: str) -> list[float]:
    """``"1e-3,3e-3,1e-2"`` → [0.001, 0.003, 0.01], checked: positive, finite, no repeats."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise NanolmError(f"--lrs: {part!r} is not a number (expected e.g. 1e-3,3e-3,1e-2)") from None
        if not (value > 0 and math.isfinite(value)):
            raise NanolmError(f"--lrs: every learning rate must be a positive number, got {part}")
        values.append(value)
    if not values:
        raise NanolmError("--lrs: give at least one learning rate, e.g. --lrs 1e-3,3e-3,1e-2")
    if len(set(values)) != len(values):
        raise NanolmError(f"--lrs: a learning rate is repeated in {text}")
    return sorted(values)


def lr_dir_name(lr: float) -> str:
    return f"lr_{lr:g}"


def final_loss(run_dir: Path) -> tuple[float | None, str]:
    """The run's final loss for comparing rates: its last validation loss, else the mean
    training loss of its last tenth of logged steps."""
    from ..watch.sinks import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in rows if r.get("step", 0) > 0 and isinstance(r.get("val_loss"), (int, float))]
    if evals and math.isfinite(evals[-1]["val_loss"]):
        return evals[-1]["val_loss"], "val"
    train = [r["loss"] for r in rows if r.get("step", 0) > 0 and isinstance(r.get("loss"), (int, float))]
    tail = train[-max(1, len(train) // 10) :]
    if tail and all(math.isfinite(x) for x in tail):
        return statistics.fmean(tail), "train"
    return None, "none"


def _config_for(args: argparse.Namespace, lr: float, out_dir: Path, steps_given: bool):
    from ..run.config import config_from_args

    ns = copy.copy(args)
    ns.lr, ns.out_dir = lr, str(out_dir)
    if not steps_given:
        ns.steps = DEFAULT_STEPS
    if not hasattr(ns, "sample_tokens"):
        ns.sample_tokens = 0
    if not hasattr(ns, "progress"):
        ns.progress = "lines"
    return config_from_args(ns)


def run_sweep(
    args: argparse.Namespace, lrs: list[float], out, tolerance: float = 0.1, report: bool = True, log=print
) -> dict:
    """Train at every rate in ``lrs`` into ``out/lr_<value>``; returns the table and the
    recommendation (see the module docstring for the rule)."""
    from ..base.lock import RunLock
    from ..run.config import load_toml

    if not 0 <= tolerance < 10:
        raise NanolmError(f"--tolerance must be a fraction such as 0.1, got {tolerance}")
    if hasattr(args, "out_dir"):
        raise NanolmError("nanolm sweep writes one run per rate under --out; do not pass --out-dir")
    if hasattr(args, "lr"):
        raise NanolmError("nanolm sweep takes its learning rates from --lrs; do not pass --lr")
    out = Path(out)
    steps_given = hasattr(args, "steps") or "steps" in (
        load_toml(args.config).get("train", {}) if getattr(args, "config", None) else {}
    )
    configs = {lr: _config_for(args, lr, out / lr_dir_name(lr), steps_given) for lr in lrs}  # validate all first
    with RunLock() as lock:  # one writer: a second sweep on --out is refused, not mixed in
        lock.take(out, flag="--out", log=log)
        return _sweep(configs, out, tolerance, report, log)


def _sweep(configs: dict, out: Path, tolerance: float, report: bool, log) -> dict:
    from ..base.files import refuse_taken_outputs
    from ..base.lock import DirectoryBusy
    from ..train import train
    from .diagnose import diagnose

    lrs = list(configs)
    refuse_taken_outputs(out, [lr_dir_name(lr) for lr in lrs])
    disk.make_dir(out, parents=True, exist_ok=True)
    rows = []
    for lr in lrs:
        cfg = configs[lr]
        run_dir = Path(cfg.train.out_dir)
        log(f"sweep: lr {lr:g}, {cfg.train.steps} steps -> {run_dir}")
        lines: list[str] = []
        started = time.perf_counter()
        error = None
        try:
            train(cfg, log=lines.append)
        except DirectoryBusy:  # another process writes there: nothing of it is touched
            raise
        except NanolmError as e:
            error = str(e)
            lines.append(f"error: {e}")
        if run_dir.is_dir():
            atomic_write_text(run_dir / "train.log", "\n".join(lines) + "\n")
        findings = diagnose(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        loss, kind = final_loss(run_dir) if (run_dir / "metrics.jsonl").is_file() else (None, "none")
        bad = [f.name for f in findings if f.name in UNSTABLE_FINDINGS]
        reasons = (
            ([f"stopped: {error}"] if error else []) + bad + ([] if loss is not None else ["no finite final loss"])
        )
        rows.append(
            {
                "lr": lr,
                "run_dir": str(run_dir),
                "final_loss": loss,
                "final_loss_kind": kind,
                "findings": [f.name for f in findings],
                "unstable_because": reasons,
                "wall_s": round(time.perf_counter() - started, 1),
            }
        )
        log(
            f"sweep: lr {lr:g}: final {kind} loss {loss if loss is None else round(loss, 4)}"
            f"{'; unstable: ' + ', '.join(reasons) if reasons else ''}"
        )
    recommended = recommend(rows, tolerance)
    result = {"rows": rows, "recommended_lr": recommended, "tolerance": tolerance, "out": str(out)}
    if report:
        from .report import render

        try:
            result["dashboard"] = render(
                [r["run_dir"] for r in rows if Path(r["run_dir"], "metrics.jsonl").is_file()], out / "report"
            )["dashboard"]
        except NanolmError as e:
            log(f"sweep: no plots ({e})")
    atomic_write_text(out / "sweep.md", format_sweep(result) + "\n")
    log(format_sweep(result))
    return result


def recommend(rows: list[dict], tolerance: float) -> float | None:
    """The largest stable rate whose final loss is within ``tolerance`` of the best stable one."""
    stable = [r for r in rows if not r["unstable_because"]]
    if not stable:
        return None
    best = min(r["final_loss"] for r in stable)
    for r in stable:
        r["within_tolerance"] = r["final_loss"] <= best * (1 + tolerance)
    good = [r["lr"] for r in stable if r["within_tolerance"]]
    return max(good)


def format_sweep(result: dict) -> str:
    lines = ["| lr | final loss | status | findings |", "| --- | --- | --- | --- |"]
    for r in result["rows"]:
        loss = "-" if r["final_loss"] is None else f"{r['final_loss']:.4f} ({r['final_loss_kind']})"
        if r["unstable_because"]:
            status = "unstable: " + ", ".join(r["unstable_because"])
        elif r.get("within_tolerance"):
            status = "stable"
        else:
            status = f"stable, but more than {result['tolerance']:.0%} above the best"
        mark = " **recommended**" if r["lr"] == result["recommended_lr"] else ""
        lines.append(f"| {r['lr']:g}{mark} | {loss} | {status} | {', '.join(r['findings']) or '-'} |")
    lines.append("")
    if result["recommended_lr"] is None:
        lines.append(
            "No stable learning rate: every run stopped, spiked, diverged or did not learn; try smaller rates."
        )
    else:
        lines.append(
            f"Recommended: --lr {result['recommended_lr']:g}, the largest stable rate (finite, no spike or "
            f"divergence, final loss within {result['tolerance']:.0%} of the best)."
        )
    return "\n".join(lines)
