"""Where the numbers go: ``metrics.jsonl`` (always), wandb and TensorBoard (if asked), the terminal.

``metrics.jsonl`` is the record of a run: one JSON object per logged step, flushed line by
line, so a crash loses nothing and any tool can read it. The other sinks are views of the
same rows. They are optional extras and must never cost the run anything: a sink that
fails (a full disk for TensorBoard, a wandb service that dies) is switched off with one
warning, and training continues; ``metrics.jsonl`` keeps every number.

The schema (every key is documented in ``docs/observability.md``):

* step-0 row: the untrained model's evaluation (``val_loss``, ``val_bpb``, ``val_ppl``,
  ``floor_bpb``/``floor_loss`` for a corpus of known entropy) and the run's constants
  (``n_params``, ``tokens_per_step``, ``flops_per_token``, ``peak_flops``);
* training rows: ``step`` (optimizer steps done), ``loss``, ``lr``, ``grad_norm`` (global,
  before clipping), ``clipped``, ``clipped_steps``, ``clipped_frac``, ``tokens_per_sec``,
  ``mfu`` (when a peak is known), ``elapsed_s``, ``eta_s``, ``rss_mb``,
  ``cuda_max_alloc_mb`` (CUDA only);
* every ``--stats-every`` steps, per group ``weight_norm/G``, ``grad_norm/G``,
  ``update_ratio/G`` (G = ``embed``, ``0``…``n-1``, ``final_norm``, ``head`` if untied) and
  per block ``attn_logit_max/i``, ``mlp_dead_frac/i``, ``act_rms/i``;
* under ``--precision fp16``, training rows add ``loss_scale`` (the scale after this step's
  update: halved if the step overflowed), ``skipped_steps`` (steps skipped for overflow so
  far; ``grad_norm`` is inf or NaN on such a step) and ``grad_zero_frac`` (share of gradient
  elements exactly zero: underflow);
* evaluation steps add the evaluation keys to the training row of the same step.

Steps only increase within a file; a resumed run cuts the file back to its checkpoint's
step first (:class:`MetricsFile`), so no step is missing or written twice.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from ..base import disk
from ..base.documents import read_jsonl
from ..base.files import atomic_write_text, naming_the_file
from .reference import format_band

LOG_SINKS = ("wandb", "tensorboard")
PROGRESS_MODES = ("auto", "bar", "lines")
SINK_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}


class MetricsFile:
    """Appends rows to ``metrics.jsonl``, flushed line by line so a crash loses nothing.

    ``resume_step``: continue an existing file from that step. Rows after it were written
    by the run that crashed after its last checkpoint; the resumed run will log those
    steps again, so they are dropped first (and a half-written last line with them). A
    damaged line (a flipped byte, a bad copy) is dropped too, with one warning: a resume
    must not stop on a log line. The kept rows are in :attr:`rows`.
    """

    def __init__(self, path, resume_step: int | None = None, log=print):
        self.path = Path(path)
        self.log = log
        self.rows: list[dict] = []
        if resume_step is not None and self.path.exists():
            rows, damaged = read_jsonl(self.path)
            good = [r for r in rows if _is_step_row(r)]
            damaged += len(rows) - len(good)
            self.rows = [r for r in good if r["step"] <= resume_step]
            if damaged:
                log(f"warning: {self.path}: {damaged} damaged line(s) dropped while resuming")
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))
        self.last_step = self.rows[-1]["step"] if self.rows else -1
        self.file = disk.create(self.path, "w" if resume_step is None else "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        if row["step"] <= self.last_step:
            raise ValueError(f"metrics step {row['step']} written after step {self.last_step}: steps must increase")
        with naming_the_file(self.path):
            disk.write(self.file, json.dumps(row) + "\n", self.path)
            self.file.flush()
        self.last_step = row["step"]

    def rewind(self, step: int) -> None:
        """Drop the rows after ``step``: a rollback discarded the trajectory they describe
        (``events.jsonl`` keeps the evidence)."""
        self.file.close()
        self.__init__(self.path, resume_step=step, log=self.log)

    def close(self) -> None:
        self.file.close()


TEXT_KEYS = frozenset({"optimizer", "schedule", "setup_digest", "data_digest", "precision", "device_type", "reference"})
"""The keys of a metrics row that hold text (the step-0 row's recipe and setup)."""
FLAG_KEYS = frozenset({"clipped"})
"""The keys that hold true or false; every other key holds a number (or null)."""


def _is_step_row(row) -> bool:
    """A row every reader may trust without checking again: an object with a whole step >= 0,
    text under :data:`TEXT_KEYS`, booleans under :data:`FLAG_KEYS` and numbers (or null)
    everywhere else. A row of any other shape (a damaged copy, a crafted file) is damage: left
    out and counted, so that no reader (diagnose, compare, report, a resume) meets a string where
    it adds numbers."""
    if not (isinstance(row, dict) and type(row.get("step")) is int and row["step"] >= 0):
        return False
    for key, value in row.items():
        if key in TEXT_KEYS:
            ok = isinstance(value, str)
        elif key in FLAG_KEYS:
            ok = isinstance(value, bool)
        else:
            ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            return False
    return True


def read_metrics(path, warn=None) -> list[dict]:
    """The rows of a ``metrics.jsonl``: damaged lines and rows of the wrong shape (see
    :func:`_is_step_row`) are left out (``warn`` hears how many); a half-written last line is
    skipped silently."""
    rows, damaged = read_jsonl(path)
    kept = [r for r in rows if _is_step_row(r)]
    lost = damaged + len(rows) - len(kept)
    if lost and warn is not None:
        warn(f"warning: {path}: {lost} damaged line(s) left out")
    return kept


class TensorBoardSink:
    """Scalars to ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``). Keys like
    ``weight_norm/3`` become one TensorBoard section per statistic."""

    name = "tensorboard"

    def __init__(self, out_dir: Path, config: dict, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=purge)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")

    def write(self, row: dict) -> None:
        for key, value in _numbers(row).items():
            self.writer.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Rows to Weights & Biases, in ``RUN_DIR/wandb``.

    Without an API key (no ``WANDB_API_KEY``, no ``wandb login``) and no ``WANDB_MODE`` set,
    the run is logged offline rather than stopping to ask for a key; ``wandb sync`` uploads
    it later. ``WANDB_PROJECT`` names the project (default ``nanolm``).
    """

    name = "wandb"

    def __init__(self, out_dir: Path, config: dict, resume_step: int | None = None):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_has_key() else "offline")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "nanolm"),
            name=Path(out_dir).name,
            dir=str(out_dir),
            config=config,
            mode=mode,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def write(self, row: dict) -> None:
        self.run.log(_numbers(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


SINKS = {"wandb": WandbSink, "tensorboard": TensorBoardSink}


def _numbers(row: dict) -> dict:
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


def parse_sinks(value: str) -> list[str]:
    """``--log wandb,tensorboard`` → ["wandb", "tensorboard"] (no repeats, order kept)."""
    names = [s.strip() for s in value.split(",") if s.strip()]
    return list(dict.fromkeys(names))


def missing_sink_packages(names) -> list[str]:
    """Sinks whose package is not installed (checked before the run directory is created)."""
    import importlib.util

    return [n for n in names if SINK_PACKAGES.get(n) and importlib.util.find_spec(SINK_PACKAGES[n]) is None]


class Terminal:
    """What a person watching sees: a progress bar on a terminal, plain lines elsewhere.

    ``bar``: one tqdm bar with loss, learning rate and tokens/s (and tqdm's own ETA);
    evaluations and warnings print above it. ``lines``: one line per logged step, plus a
    line of per-layer figures on statistics steps; right for CI logs and files, where a
    bar's carriage returns would be noise.
    """

    def __init__(self, total_steps: int, log=print, mode: str = "lines", start_step: int = 0):
        self.total_steps, self.log, self.mode = total_steps, log, mode
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stdout, dynamic_ncols=True)

    def planned(self, total_steps: int) -> None:
        """A time budget's new estimate of the run's steps."""
        self.total_steps = total_steps
        if self.bar is not None:
            self.bar.total = total_steps

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            self.log(line)

    def show(self, row: dict) -> None:
        if "loss" in row:
            if self.bar is not None:
                self.bar.set_postfix_str(
                    f"loss {row['loss']:.4f} | lr {row['lr']:.2e} | {row['tokens_per_sec'] / 1000:.1f}k tok/s",
                    refresh=False,
                )
                self.bar.update(row["step"] - self.bar.n)
            else:
                self.log(format_train_line(row, self.total_steps))
                if any(k.startswith("attn_logit_max/") or k.startswith("update_ratio/") for k in row):
                    self.log(format_stats_line(row))
        if "val_loss" in row:
            self.write(format_eval_line(row))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def choose_progress(mode: str, log) -> str:
    """``auto``: a bar when printing to a terminal, lines when output goes to a file, a pipe
    or a caller's own ``log`` function."""
    if mode != "auto":
        return mode
    return "bar" if log is print and sys.stdout.isatty() else "lines"


class Monitor:
    """Every row goes to ``metrics.jsonl``, the terminal and each extra sink.

    A sink that raises, when it starts or on any row, prints one warning and is switched
    off; the run goes on. ``metrics.jsonl`` is not optional: failing to write it (a full
    disk) is an error, as it would be for a checkpoint.
    """

    def __init__(
        self,
        out_dir,
        total_steps: int,
        sinks=(),
        config: dict | None = None,
        log=print,
        progress: str = "lines",
        resume_step: int | None = None,
    ):
        out_dir = Path(out_dir)
        self.metrics = MetricsFile(out_dir / "metrics.jsonl", resume_step, log)
        start = self.metrics.last_step if self.metrics.last_step > 0 else 0
        self.terminal = Terminal(total_steps, log, choose_progress(progress, log), start)
        self.sinks = []
        for name in sinks:
            try:
                self.sinks.append(SINKS[name](out_dir, config or {}, resume_step))
            except Exception as e:
                self._warn(name, "could not start", e)

    def record(self, row: dict) -> None:
        self.metrics.write(row)
        self.terminal.show(row)
        for sink in list(self.sinks):
            try:
                sink.write(row)
            except Exception as e:
                self.sinks.remove(sink)
                self._warn(sink.name, "failed", e)

    def write(self, line: str) -> None:
        self.terminal.write(line)

    def rewind(self, step: int) -> None:
        """After a rollback to ``step``: ``metrics.jsonl`` loses the discarded rows. Extra sinks
        keep them (they cannot delete), so their curves show the excursion."""
        self.metrics.rewind(step)

    def _warn(self, name: str, what: str, error: Exception) -> None:
        self.terminal.write(
            f"warning: the {name} logger {what} ({type(error).__name__}: {error}); it is off for "
            f"the rest of this run, and metrics.jsonl still records everything"
        )

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:
                self._warn(sink.name, "failed to close", e)
        self.sinks = []
        self.terminal.close()
        self.metrics.close()


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_train_line(row: dict, total_steps: int) -> str:
    width = len(str(total_steps))
    line = (
        f"step {row['step']:>{width}}/{total_steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
        f"grad norm {row['grad_norm']:.3f}{' (clipped)' if row.get('clipped') else ''} | "
        f"{row['tokens_per_sec'] / 1000:.1f}k tok/s"
    )
    if "mfu" in row:
        line += f" | mfu {100 * row['mfu']:.1f}%"
    line += f" | {row['elapsed_s']:.1f}s"
    if "eta_s" in row:
        line += f" | eta {format_duration(row['eta_s'])}"
    if "loss_scale" in row:
        line += (
            f" | scale {row['loss_scale']:g}, {row['skipped_steps']} skipped, {row['grad_zero_frac']:.1%} zero grads"
        )
    return line


def _per_block(row: dict, key: str) -> list[float]:
    values, i = [], 0
    while f"{key}/{i}" in row:
        values.append(row[f"{key}/{i}"])
        i += 1
    return values


def format_stats_line(row: dict) -> str:
    """The per-layer figures of a statistics step, summarised: the extreme block of each."""
    parts = [f"layers step {row['step']}"]
    ratios = _per_block(row, "update_ratio")
    if ratios:
        parts.append(f"update/weight {min(ratios):.1e}..{max(ratios):.1e}")
    logits = _per_block(row, "attn_logit_max")
    if logits:
        i = max(range(len(logits)), key=logits.__getitem__)
        parts.append(f"attn logit max {logits[i]:.2f} (block {i})")
    dead = _per_block(row, "mlp_dead_frac")
    if dead:
        i = max(range(len(dead)), key=dead.__getitem__)
        parts.append(f"dead MLP units {100 * dead[i]:.1f}% (block {i})")
    rms = _per_block(row, "act_rms")
    if rms:
        parts.append(f"activation rms {min(rms):.2f}..{max(rms):.2f}")
    return " | ".join(parts)


def format_eval_line(row: dict) -> str:
    line = f"eval step {row['step']} | val loss {row['val_loss']:.4f} | val bpb {row['val_bpb']:.4f}"
    if "val_ppl" in row:
        line += f" | ppl {row['val_ppl']:.2f}" if row["val_ppl"] < 1e6 else f" | ppl {row['val_ppl']:.3g}"
    if "floor_bpb" in row:
        line += f" | floor {row['floor_bpb']:.4f} bpb / {row['floor_loss']:.4f} nats/token"
    return line + format_band(row)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))
