"""Pictures of training runs: ``nanolm report RUN_DIR [RUN_DIR ...]``.

Reads each run's ``metrics.jsonl`` (and ``config.toml``, for the clip threshold and the
differences between runs) and writes, into ``--out`` (default ``FIRST_RUN/report``):

* ``panels/NAME.png``, one picture per panel;
* ``dashboard.png``, every panel on one page;
* ``report.html``, the panels with a line under each on what healthy looks like, and a
  table of the runs. The images are embedded, so the file can be mailed or attached alone.

Several runs are drawn on the same axes, one colour per run, so a comparison the course
asks for ("the curves for batch×4 and for grad_accum=4 must match") is one command. A panel
whose numbers no run has (``loss_scale`` without fp16, the per-layer panels with
``--stats-every 0``) is left out rather than drawn empty. A run recognised as a shipped
recipe (``nanolm.watch.reference``) gets that recipe's band shaded behind its loss, bits-per-byte
and gradient-norm curves: where healthy seeds of the same recipe went.

matplotlib is imported here only (``pip install 'nanolm[report]'``), never by training.
"""

from __future__ import annotations

import base64
import html
import io
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..base import disk
from ..base.files import atomic_write_bytes, atomic_write_text
from ..errors import NanolmError
from ..run.directory import refuse_output_inside_a_run
from ..watch.reference import reference_for_digest
from ..watch.sinks import read_metrics

X_AXES = ("step", "tokens", "time")


@dataclass
class Run:
    """One run directory, read: its rows and its configuration (sections of config.toml)."""

    path: Path
    name: str
    rows: list[dict]
    config: dict = field(default_factory=dict)

    def option(self, section: str, key: str, default=None):
        """A number from config.toml (each one the report uses is), else ``default``: the file
        is read leniently, an older or damaged one must not stop the plots."""
        table = self.config.get(section)
        value = table.get(key, default) if isinstance(table, dict) else default
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    @property
    def tokens_per_step(self) -> int | None:
        for r in self.rows:
            if isinstance(r.get("tokens_per_step"), int):
                return r["tokens_per_step"]
        seq, batch = self.option("model", "seq_len"), self.option("train", "batch_size")
        accum = self.option("train", "grad_accum")
        return seq * batch * accum if seq and batch and accum else None

    def x_of(self, row: dict, x: str) -> float | None:
        if x == "time":
            return row.get("elapsed_s")
        if x == "tokens":
            per_step = self.tokens_per_step
            return row["step"] * per_step if per_step else None
        return row["step"]

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for r in self.rows:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and self.x_of(r, x) is not None:
                xs.append(self.x_of(r, x))
                ys.append(float(v))
        return xs, ys

    def has(self, key: str) -> bool:
        return any(key in r for r in self.rows)

    def groups(self, prefix: str) -> list[str]:
        """Group names under ``prefix/``: embed, the blocks in depth order, then the rest."""
        names = {k.split("/", 1)[1] for r in self.rows for k in r if k.startswith(prefix + "/")}
        blocks = sorted((n for n in names if n.isdigit()), key=int)
        first = [n for n in ("embed",) if n in names]
        rest = sorted(n for n in names if not n.isdigit() and n != "embed")
        return first + blocks + rest

    @property
    def reference(self):
        """The shipped reference this run was recognised as (its step-0 row's setup), or None."""
        return reference_for_digest(self.rows[0].get("setup_digest") if self.rows[0].get("step") == 0 else None)

    def last(self, key: str):
        for r in reversed(self.rows):
            if key in r:
                return r[key]
        return None


def load_run(path) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise NanolmError(f"{path} is not a run directory (no metrics.jsonl)")
    rows = read_metrics(metrics, lambda line: print(line, file=sys.stderr))
    if not rows:
        raise NanolmError(f"{metrics} holds no rows yet")
    config = {}
    if (path / "config.toml").is_file():
        from ..base.documents import read_toml

        config = {
            section: values for section, values in read_toml(path / "config.toml").items() if isinstance(values, dict)
        }
    return Run(path, path.name, rows, config)


# ---- panels: (name, title, what healthy looks like, what trouble looks like, draw function)


@dataclass
class Panel:
    name: str
    title: str
    healthy: str
    trouble: str
    keys: tuple[str, ...]  # the panel is drawn when some run has one of these (a trailing / = per-layer)
    draw: object = None
    log_y: bool = False

    def present(self, runs: list[Run]) -> bool:
        return any(run.has(k) if not k.endswith("/") else run.groups(k[:-1]) for run in runs for k in self.keys)


def _line(ax, run, key, x, color, label=None, **kw):
    xs, ys = run.series(key, x)
    if xs:
        ax.plot(xs, ys, color=color, label=label, **kw)
    return bool(xs)


def _reference_lines(ax, runs, colors, value_of, label):
    """Dashed horizontal lines (a floor, a threshold): one grey line when every run shares the value."""
    values = [(value_of(run), c) for run, c in zip(runs, colors) if value_of(run)]
    if len({v for v, _ in values}) == 1 and len(runs) > 1:
        values = [(values[0][0], "0.4")]
    for i, (v, c) in enumerate(values):
        ax.axhline(v, color=c, linestyle="--", linewidth=1, alpha=0.8, label=label if i == 0 else None)


def _bands(ax, runs, key, x, label="reference band"):
    """The reference band of ``key`` shaded behind the curves, once per reference the runs were
    recognised as (``nanolm.watch.reference``): where healthy seeds of the same recipe went."""
    if x == "time":  # the band is per step; seconds differ from machine to machine
        return
    seen = set()
    for run in runs:
        ref = run.reference
        band = ref.bands.get(key) if ref is not None else None
        if band is None or ref.name in seen:
            continue
        seen.add(ref.name)
        scale = (run.tokens_per_step or 0) if x == "tokens" else 1
        if not scale:
            continue
        xs = [s * scale for s in band.steps]
        ax.fill_between(
            xs,
            band.lo,
            band.hi,
            color="0.6",
            alpha=0.25,
            linewidth=0,
            zorder=0,
            label=f"{label} ({len(ref.seeds)} seeds)" if label and len(seen) == 1 else None,
        )


def draw_loss(ax, runs, x, colors):
    _bands(ax, runs, "loss", x)
    _bands(ax, runs, "val_loss", x, label=None)  # one legend entry for both
    for run, c in zip(runs, colors):
        multi = len(runs) > 1
        _line(ax, run, "loss", x, c, f"{run.name} train" if multi else "train loss", linewidth=1, alpha=0.7)
        _line(
            ax,
            run,
            "val_loss",
            x,
            c,
            f"{run.name} val" if multi else "val loss",
            marker="o",
            markersize=3,
            linewidth=1.5,
            linestyle="-" if not multi else ":",
        )
    _reference_lines(ax, runs, colors, lambda run: run.last("floor_loss"), "floor (entropy of the data)")
    ax.set_ylabel("nats / token")


def draw_bpb(ax, runs, x, colors):
    _bands(ax, runs, "val_bpb", x)
    for run, c in zip(runs, colors):
        _line(ax, run, "val_bpb", x, c, _name(run, runs), marker="o", markersize=3)
    _reference_lines(ax, runs, colors, lambda run: run.last("floor_bpb"), "floor")
    ax.set_ylabel("bits / byte")


def draw_grad_norm(ax, runs, x, colors):
    _bands(ax, runs, "grad_norm", x)
    for run, c in zip(runs, colors):
        _line(ax, run, "grad_norm", x, c, _name(run, runs), linewidth=1)
    _reference_lines(ax, runs, colors, lambda run: run.option("optim", "clip"), "clip threshold")
    ax.set_ylabel("global L2 norm, before clipping")


def _name(run, runs):
    """Label lines with the run's name only when there is more than one run to tell apart."""
    return run.name if len(runs) > 1 else None


def draw_lr(ax, runs, x, colors):
    for run, c in zip(runs, colors):
        _line(ax, run, "lr", x, c, _name(run, runs))


def draw_clipped(ax, runs, x, colors):
    """Per logging window: clipped steps / steps; dashed: since the start."""
    for run, c in zip(runs, colors):
        rows = [r for r in run.rows if "clipped_steps" in r and run.x_of(r, x) is not None]
        xs, window = [], []
        prev_step, prev_count = 0, 0
        for r in rows:
            if r["step"] > prev_step:
                xs.append(run.x_of(r, x))
                window.append((r["clipped_steps"] - prev_count) / (r["step"] - prev_step))
            prev_step, prev_count = r["step"], r["clipped_steps"]
        if xs:
            label = f"{run.name} per window" if len(runs) > 1 else "per logging window"
            ax.step(xs, window, where="post", color=c, linewidth=1, label=label)
        _line(ax, run, "clipped_frac", x, c, "since the start" if run is runs[0] else None, linestyle="--", linewidth=1)
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("fraction of steps clipped")


def draw_tokens(ax, runs, x, colors):
    for run, c in zip(runs, colors):
        _line(ax, run, "tokens_per_sec", x, c, _name(run, runs), linewidth=1)
    ax.set_ylabel("tokens / s")


def draw_mfu(ax, runs, x, colors):
    for run, c in zip(runs, colors):
        xs, ys = run.series("mfu", x)
        if xs:
            ax.plot(xs, [100 * y for y in ys], color=c, label=_name(run, runs), linewidth=1)
    ax.set_ylabel("% of peak FLOP/s")


def draw_memory(ax, runs, x, colors):
    for run, c in zip(runs, colors):
        _line(ax, run, "rss_mb", x, c, f"{run.name} process RSS" if len(runs) > 1 else "process RSS", linewidth=1)
        _line(ax, run, "cuda_max_alloc_mb", x, c, "CUDA max allocated" if run is runs[0] else None, linestyle="--")
    ax.set_ylabel("MiB")


def _per_layer(prefix, ylabel, percent=False):
    """Lines per layer: one run in depth colours (viridis), several in their run colours, shaded by depth."""

    def draw(ax, runs, x, colors):
        from matplotlib import colormaps

        single = len(runs) == 1
        for run, c in zip(runs, colors):
            names = run.groups(prefix)
            blocks = [n for n in names if n.isdigit()]
            for name in names:
                xs, ys = run.series(f"{prefix}/{name}", x)
                if not xs:
                    continue
                if percent:
                    ys = [100 * y for y in ys]
                depth = blocks.index(name) / max(len(blocks) - 1, 1) if name in blocks else None
                style = {"linewidth": 1.2}
                if depth is None:
                    style.update(linestyle={"embed": "--", "head": "-."}.get(name, ":"), color="0.3" if single else c)
                elif single:
                    style["color"] = colormaps["viridis"](0.9 * depth)
                else:
                    style.update(color=c, alpha=0.3 + 0.7 * depth)
                if single:
                    label = f"block {name}" if name.isdigit() else name
                else:  # one legend entry per run, on its deepest block
                    label = run.name if name == (blocks or names)[-1] else None
                ax.plot(xs, ys, label=label, **style)
        ax.set_ylabel(ylabel)
        if percent:
            top = max((max(line.get_ydata(), default=0) for line in ax.get_lines()), default=0)
            ax.set_ylim(-0.5, max(5.0, 1.15 * top))
        if not single:
            ax.text(
                0.01, 0.01, "shade: light = first block, dark = last", transform=ax.transAxes, fontsize=6, alpha=0.7
            )

    return draw


def draw_loss_scale(ax, runs, x, colors):
    for run, c in zip(runs, colors):
        _line(ax, run, "loss_scale", x, c, _name(run, runs), drawstyle="steps-post")
    ax.set_ylabel("fp16 loss scale")


PANELS = [
    Panel(
        "loss",
        "Loss and validation loss",
        "falls fast, then slowly; val tracks train; both stay above the floor",
        "flat from step 1 (LR, data); val rising while train falls (overfitting); below the floor (a leak); "
        "spikes that do not come back down",
        ("loss", "val_loss"),
        draw_loss,
        log_y=True,
    ),
    Panel(
        "val_bpb",
        "Validation bits per byte",
        "falls toward the floor; comparable across tokenizers",
        "below the floor: the model sees what it should not",
        ("val_bpb",),
        draw_bpb,
    ),
    Panel(
        "grad_norm",
        "Gradient norm (before clipping)",
        "rises briefly in warmup, then settles below the clip line and drifts slowly",
        "lives above the clip line (every step clipped: LR too high); sudden spikes "
        "(bad batch, instability); a steady climb late in training",
        ("grad_norm",),
        draw_grad_norm,
        log_y=True,
    ),
    Panel(
        "lr",
        "Learning rate",
        "linear warmup, then the cosine down to min_lr (or, with --schedule wsd, flat at the "
        "peak and a straight line down to min_lr at the end)",
        "anything else is a schedule bug, or a resume that restarted the schedule",
        ("lr",),
        draw_lr,
    ),
    Panel(
        "clipped_frac",
        "Clipped steps",
        "many clipped steps in warmup, few or none afterwards",
        "most steps clipped after warmup: the clip is doing the LR's job; lower --lr",
        ("clipped_steps",),
        draw_clipped,
    ),
    Panel(
        "tokens_per_sec",
        "Throughput",
        "flat after the first steps",
        "a slow decline (a leak, thermal throttling, a shared machine); dips at evaluations are expected",
        ("tokens_per_sec",),
        draw_tokens,
    ),
    Panel(
        "mfu",
        "Model FLOPs utilisation",
        "flat; 30-50 % is good on a GPU in bf16",
        "a few % on a GPU: the input pipeline, host syncs or tiny batches dominate",
        ("mfu",),
        draw_mfu,
    ),
    Panel(
        "memory",
        "Memory",
        "flat after the first steps",
        "a steady climb: something keeps tensors alive",
        ("rss_mb", "cuda_max_alloc_mb"),
        draw_memory,
    ),
    Panel(
        "weight_norm",
        "Weight norm per layer",
        "slow, smooth change; weight decay keeps it bounded",
        "a layer that grows without end; a sudden jump",
        ("weight_norm/",),
        _per_layer("weight_norm", "‖w‖"),
        log_y=True,
    ),
    Panel(
        "layer_grad_norm",
        "Gradient norm per layer",
        "within an order of magnitude of each other",
        "first blocks far below the last (vanishing) or far above (exploding)",
        ("grad_norm/",),
        _per_layer("grad_norm", "‖g‖, before clipping"),
        log_y=True,
    ),
    Panel(
        "update_ratio",
        "Update / weight per layer",
        "1e-3 to a few 1e-2, highest after warmup, falling with the schedule",
        "above ~5e-2 for long (weights rewritten within tens of steps); below 1e-5 (a layer that stopped "
        "learning); one layer far from the others",
        ("update_ratio/",),
        _per_layer("update_ratio", "‖Δw‖ / ‖w‖"),
        log_y=True,
    ),
    Panel(
        "attn_logit_max",
        "Max attention logit per layer",
        "grows early, then levels off (tens at most)",
        "keeps growing (hundreds): attention saturates onto single tokens and training destabilises; "
        "QK-norm (--qk-norm) bounds it",
        ("attn_logit_max/",),
        _per_layer("attn_logit_max", "max q·k/√d"),
    ),
    Panel(
        "mlp_dead_frac",
        "Dead MLP units per layer",
        "near 0 %",
        "a share that keeps rising: units that never open again, capacity lost (LR too high is the usual cause)",
        ("mlp_dead_frac/",),
        _per_layer("mlp_dead_frac", "% never open on the probe batch", percent=True),
    ),
    Panel(
        "act_rms",
        "Activation RMS per block",
        "grows with depth and over training, smoothly",
        "one block exploding relative to its neighbours: where divergence starts",
        ("act_rms/",),
        _per_layer("act_rms", "RMS of the residual stream"),
        log_y=True,
    ),
    Panel(
        "loss_scale",
        "fp16 loss scale",
        "settles to a plateau, with rare halvings",
        "halving again and again: gradients overflow (inf/NaN) on many steps",
        ("loss_scale",),
        draw_loss_scale,
        log_y=True,
    ),
]

X_LABELS = {"step": "optimizer step", "tokens": "training tokens", "time": "seconds"}


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _draw(panel: Panel, ax, runs: list[Run], x: str) -> None:
    panel.draw(ax, runs, x, _colors(len(runs)))
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(X_LABELS[x], fontsize=8)
    ax.tick_params(labelsize=7)
    ax.yaxis.label.set_size(8)
    if panel.log_y and any(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if labels:
        ax.legend(fontsize=6, ncol=2 if len(labels) > 6 else 1, loc="best")


def _png(fig, dpi: int) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _unique_names(runs: list[Run]) -> None:
    names = [r.name for r in runs]
    if len(set(names)) < len(names):
        for r in runs:
            r.name = str(r.path)


def render(run_dirs, out_dir=None, x: str = "step", dpi: int = 90) -> dict:
    """Draw the runs in ``run_dirs``; returns the paths written and the panels drawn."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise NanolmError("nanolm report needs matplotlib: pip install 'nanolm[report]'") from None
    if x not in X_AXES:
        raise NanolmError(f"--x must be one of {', '.join(X_AXES)}, got {x!r}")
    runs = [load_run(d) for d in run_dirs]
    _unique_names(runs)
    out = Path(out_dir) if out_dir else runs[0].path / "report"
    refuse_output_inside_a_run(out, "--out")
    disk.make_dir(out / "panels", parents=True, exist_ok=True)
    panels = [p for p in PANELS if p.present(runs)]

    images = {}
    for panel in panels:
        fig = Figure(figsize=(5.2, 3.4), layout="constrained")
        _draw(panel, fig.add_subplot(), runs, x)
        images[panel.name] = _png(fig, dpi)
        atomic_write_bytes(out / "panels" / f"{panel.name}.png", images[panel.name])

    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(5.2 * cols, 3.4 * rows + 0.4), layout="constrained")
    fig.suptitle("nanolm: " + ", ".join(r.name for r in runs), fontsize=12)
    for i, panel in enumerate(panels):
        _draw(panel, fig.add_subplot(rows, cols, i + 1), runs, x)
    atomic_write_bytes(out / "dashboard.png", _png(fig, int(dpi * 0.75)))
    # each file whole, the old one or the new: a full disk half-way leaves a report that opens
    atomic_write_text(out / "report.html", _html(runs, panels, images))
    return {
        "out_dir": str(out),
        "dashboard": str(out / "dashboard.png"),
        "html": str(out / "report.html"),
        "panels": [p.name for p in panels],
    }


def summary(run: Run) -> dict:
    """A run in one line of figures: where it ended, and how it got there."""

    def median(key):
        return statistics.median(run.series(key)[1]) if run.has(key) else None

    return {
        "run": run.name,
        "steps": run.last("step"),
        "loss": run.last("loss"),
        "val_loss": run.last("val_loss"),
        "val_bpb": run.last("val_bpb"),
        "floor_bpb": run.last("floor_bpb"),
        "clipped_frac": run.last("clipped_frac"),
        "tokens_per_sec (median)": median("tokens_per_sec"),
        "mfu (median)": median("mfu"),
    }


def config_differences(runs: list[Run]) -> dict[str, list]:
    """Options whose values differ between the runs (the run directory itself aside)."""
    flat = [{f"{s}.{k}": v for s, vals in r.config.items() for k, v in vals.items() if k != "out_dir"} for r in runs]
    keys = sorted(set().union(*flat)) if flat else []
    return {k: [f.get(k) for f in flat] for k in keys if len({repr(f.get(k)) for f in flat}) > 1}


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))


def _html(runs: list[Run], panels: list[Panel], images: dict[str, bytes]) -> str:
    rows = [summary(r) for r in runs]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
    diffs = config_differences(runs) if len(runs) > 1 else {}
    diff_table = ""
    if diffs:
        diff_head = "<th>option</th>" + "".join(f"<th>{html.escape(r.name)}</th>" for r in runs)
        diff_body = "".join(
            f"<tr><td>{html.escape(k)}</td>" + "".join(f"<td>{_fmt(v)}</td>" for v in vals) + "</tr>"
            for k, vals in diffs.items()
        )
        diff_table = f"<h2>Options that differ</h2><table><tr>{diff_head}</tr>{diff_body}</table>"
    figures = "".join(
        f'<figure id="panel-{p.name}"><img alt="{html.escape(p.title)}" '
        f'src="data:image/png;base64,{base64.b64encode(images[p.name]).decode()}">'
        f"<figcaption><b>{html.escape(p.title)}.</b> Healthy: {html.escape(p.healthy)}. "
        f"Trouble: {html.escape(p.trouble)}.</figcaption></figure>"
        for p in panels
    )
    title = "nanolm report: " + ", ".join(r.name for r in runs)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1em; font-size: 0.85em; }}
td, th {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }}
.grid {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(480px, 1fr)); gap: 1em; }}
figure {{ margin: 0; }} img {{ width: 100%; }} figcaption {{ font-size: 0.8em; color: #444; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<table><tr>{head}</tr>{body}</table>
{diff_table}
<p>What each panel means, and what trouble looks like: docs/observability.md ("Reading your training logs").</p>
<div class="grid">{figures}</div>
</body></html>
"""
