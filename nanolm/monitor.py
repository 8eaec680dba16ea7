"""Where the numbers go: ``metrics.jsonl`` (always) and the terminal.

``metrics.jsonl`` has one JSON object per line. Training rows hold ``step`` (optimizer
steps done), ``loss`` (mean over the step's counted tokens), ``lr``, ``grad_norm`` (global
norm before clipping), ``tokens_per_sec`` (since the previous row) and ``elapsed_s``.
Evaluation rows add ``val_loss`` (nats per token), ``val_bpb`` (bits per byte of text) and,
for a corpus of known entropy, ``floor_bpb``. The row at step 0 is the evaluation of the
untrained model and has no training fields. Under ``--precision fp16`` training rows add
``loss_scale`` (the scale after this step's update: halved if the step overflowed),
``skipped_steps`` (steps skipped for overflow so far; ``grad_norm`` is inf or NaN on such a
step) and ``grad_zero_frac`` (share of gradient elements exactly zero: underflow).
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsFile:
    """Appends rows to ``metrics.jsonl``, flushed line by line so a crash loses nothing.

    ``after_step`` continues an existing file for a resumed run: rows of later steps (logged
    after the checkpoint the run resumes from, and about to be logged again) are dropped, so
    the file has neither duplicated nor missing steps.
    """

    def __init__(self, path, after_step: int | None = None):
        self.path = Path(path)
        if after_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line)["step"] <= after_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            tmp.replace(self.path)
        self.file = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_train_line(row: dict, total_steps: int) -> str:
    width = len(str(total_steps))
    return (
        f"step {row['step']:>{width}}/{total_steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
        f"grad norm {row['grad_norm']:.3f} | {row['tokens_per_sec'] / 1000:.1f}k tok/s | {row['elapsed_s']:.1f}s"
    ) + (f" | scale {row['loss_scale']:g}, {row['skipped_steps']} skipped, {row['grad_zero_frac']:.1%} zero grads"
         if "loss_scale" in row else "")


def format_eval_line(row: dict) -> str:
    line = f"eval step {row['step']} | val loss {row['val_loss']:.4f} | val bpb {row['val_bpb']:.4f}"
    if "val_ppl" in row:
        line += f" | ppl {row['val_ppl']:.2f}"
    if "floor_bpb" in row:
        line += f" | floor {row['floor_bpb']:.4f} bpb / {row['floor_loss']:.4f} nats/token"
    return line


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))
