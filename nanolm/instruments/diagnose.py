"""``nanolm diagnose RUN_DIR``: say in plain words what went wrong in a run, with the numbers.

Diagnosis reads a run's two records, ``metrics.jsonl`` and ``events.jsonl``, and nothing else:
not the configuration, and certainly not the hidden ``--debug-*`` switches the lab breaks runs
with. A rule that fired because it knew how the run was broken would teach nothing; each rule
recognises a failure the way a person reading the curves would, from the numbers alone, and a
rule that is unsure stays silent (a false alarm on a healthy run costs more trust than a missed
subtle problem). Each returns a :class:`Finding`: a name, what was seen and what it usually
means, the evidence, and the section of docs/runbooks.md that says what to do.

The rules, their thresholds (the module constants below, set so that healthy runs of several
seeds, rhythms, a clean resume and fp16 give no finding: ``tests/test_diagnose.py`` holds both
directions) and how spikes are found are told once, in docs/health.md ("nanolm diagnose").
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import NanolmError
from ..watch.reference import curve_departure, departures, population_look, reference_for_digest

# ---- thresholds (docs/health.md lists them; dev/health.md says why each value)
MIN_STEPS = 50  # rules about a run's course need at least this many steps of it
STUCK_FRACTION = 0.9  # loss_stuck: never below this share of the starting loss
LEAK_FRACTION = 0.85  # leak: a loss below this share of the floor (sampling noise stays far above)
LEAK_MIN_ROWS = 5  # leak on training loss: the median of this many consecutive rows
SPIKE_SIGMAS = 6.0  # a loss spike: this many local robust standard deviations above the local median
SPIKE_MIN_JUMP = 0.05  # ... and at least this many nats, and this share of the level:
SPIKE_MIN_REL = 0.05
GRAD_PRECURSOR = 2.0  # a gradient-norm spike: this many times its recent median
DATA_SPIKES_MIN = 3  # data_spikes: at least this many isolated spikes without a gradient warning,
DATA_SPIKE_MIN_JUMP = 0.15  # ... each at least this many nats (a healthy run's noise reaches ~0.1 at loss ~0.5)
CLIPPED_FRACTION = 0.5  # clipped_most_steps: share of post-warmup steps clipped
MEMORISE_RISE = 0.05  # memorising: val loss this share above its minimum ...
MEMORISE_MIN_RISE = 0.02  # ... and this many nats, over at least two evaluations
RISING_FACTOR = 1.3  # train_loss_rising: smoothed loss ends this many times above its best ...
RISING_MIN = 0.1  # ... and this many nats
RESUME_GRAD_RATIO = 2.5  # resume_jump: gradient norm after a resume vs its median before
OVERFLOW_SKIPPED = 0.02  # fp16_overflow: share of steps skipped (and at least 5) ...
OVERFLOW_MIN_SKIPPED = 5
SCALE_COLLAPSE = 2.0**-8  # ... or the loss scale fell to this share of its maximum
UNDERFLOW_SHARE = 0.05  # fp16_underflow: median share of gradient values below fp16's normal range (a scaled run: ~0)
UNDERFLOW_ROWS = 5  # ... over at least this many logged steps
UNDERFLOW_LATE = 5e-4  # (runs without that share) late share of exactly-zero gradients at least this ...
UNDERFLOW_GROWTH = 3.0  # ... and this many times its early share
ATTENTION_LOGIT_MAX = 100.0  # attention_logits: a max logit above this (healthy runs: ~10-30)
DEAD_FRACTION = 0.1  # dead_units: share of a block's units shut, persisting to the end
UNCLIPPED_SPIKE = 10.0  # no_clipping: without clipping, a gradient norm this many times its median
SLOW_BETA2 = 0.99  # slow_second_moment: beta2 at least this, with a warmup shorter than ...
SLOW_WARMUP_SHARE = 0.1  # ... this share of the second moment's memory, 1 / (1 - beta2) steps ...
EARLY_INSTABILITY = 8.0  # ... and an early gradient norm this many times the later median
NO_DECAY_SHARE = 0.9  # no_lr_decay: the last learning rate at least this share of the peak


@dataclass
class Finding:
    """One diagnosis: ``name`` (stable, for programs), ``title`` (a few words), ``message``
    (plain words: what was seen, what it usually means, what to do) and ``evidence`` (the
    steps and values it rests on)."""

    name: str
    title: str
    message: str
    evidence: dict = field(default_factory=dict)
    runbook: str | None = None  # the section of docs/runbooks.md that says what to do, step by step

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- reading a run
def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _r(x, digits: int = 4):
    """Round for evidence: significant digits, so that 3e-5 and 1234.5 both read well."""
    if not _finite(x):
        return x if not isinstance(x, float) else str(x)
    if x == 0 or isinstance(x, int):
        return x
    return float(f"{x:.{digits}g}")


class Trace:
    """A run's rows and events, with the derived series the rules share (computed once, here)."""

    def __init__(self, rows: list[dict], events: list[dict] | None = None, references=None):
        self.rows = sorted((r for r in rows if "step" in r), key=lambda r: r["step"])
        self.events = sorted((e for e in events or [] if "step" in e), key=lambda e: e["step"])
        self.references = references  # the reference bands to judge by (None: the shipped ones)
        self.last_step = self.rows[-1]["step"] if self.rows else 0
        self.train = [r for r in self.rows if r["step"] > 0 and _finite(r.get("loss"))]  # step 0 has no loss
        self.evals = [r for r in self.rows if _finite(r.get("val_loss"))]
        floors = [r["floor_loss"] for r in self.rows if _finite(r.get("floor_loss"))]
        self.floor = floors[-1] if floors else None
        lrs = [(r["step"], r["lr"]) for r in self.train if _finite(r.get("lr"))]
        self.peak_lr = max(lr for _, lr in lrs) if lrs else None
        # the step at which the learning rate first came within 1 % of its peak (1: no warmup; 0: no rate logged)
        self.warmup_end = next(step for step, lr in lrs if lr >= 0.99 * self.peak_lr) if lrs else 0

    def blocks(self, key: str) -> list[tuple[int, dict[str, float]]]:
        """(step, {block: value}) for every row holding ``key/<block>`` values."""
        out = []
        prefix = key + "/"
        for r in self.rows:
            values = {k[len(prefix) :]: v for k, v in r.items() if k.startswith(prefix) and _finite(v)}
            if values:
                out.append((r["step"], values))
        return out

    def events_of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e.get("kind") == kind]


def read_run(run_dir) -> Trace:
    """The trace of a run directory, or a one-line error when it is not one."""
    from ..watch.guards import read_events
    from ..watch.sinks import read_metrics

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NanolmError(f"{run_dir} is not a directory (expected a run directory written by `nanolm train`)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise NanolmError(f"{run_dir} has no metrics.jsonl; is it a run directory written by `nanolm train`?")
    warn = lambda line: print(line, file=sys.stderr)  # noqa: E731 - stdout may be --json
    rows = read_metrics(path, warn)
    events = read_events(run_dir, warn)
    if not rows:
        raise NanolmError(f"{path} holds no rows yet")
    return Trace(rows, events)


# --------------------------------------------------------------------------- shared analyses
def _loss_spikes(train: list[dict]) -> list[dict]:
    """Rows whose loss jumps far above the local median, with what came before them.

    The local median (11 rows centred on the row) follows the loss's downward trend, so a
    steep but smooth fall leaves no residual. The noise scale is the median absolute residual
    of the 31 rows around (a robust standard deviation: as long as fewer than half the rows
    are spikes, they do not inflate it). In the first rows, where the fall is too steep for
    any yardstick, one thing is unmistakable: a loss that climbs back above where it started.

    Each spike records whether the gradient norm rose first: its largest value in the three
    rows before the spike (rows that are spikes themselves do not count: a bad batch raises
    both at once), against its median over the ten rows before those (or after the spike,
    at the very start). The spike's own row counts only when the steps between logged rows
    are unseen. ``isolated``: the loss fell straight back on the next row.
    """
    n = len(train)
    if n < 12:
        return []
    losses = [r["loss"] for r in train]
    base = [statistics.median(losses[max(0, i - 5) : i + 6]) for i in range(n)]
    resid = [loss - b for loss, b in zip(losses, base)]
    norms = [r.get("grad_norm") for r in train]
    start, fell = losses[0], False
    flagged: dict[int, dict] = {}
    for i in range(1, n):
        fell = fell or losses[i - 1] < 0.95 * start
        above_start = fell and losses[i] > start and all(loss <= start for loss in losses[1:i])
        threshold = math.inf
        if i >= 5:  # before that the centred window is lopsided toward the (lower) future
            around = [abs(resid[j]) for j in range(max(0, i - 15), min(n, i + 16))]
            threshold = max(SPIKE_SIGMAS * 1.4826 * statistics.median(around), SPIKE_MIN_JUMP, SPIKE_MIN_REL * base[i])
        if resid[i] > threshold or above_start:
            jump = losses[i] - (statistics.median(losses[max(0, i - 3) : i]) if above_start else base[i])
            flagged[i] = {"above_start": above_start, "jump": jump}
    spikes = []
    for i, f in flagged.items():
        earlier = [g for g in norms[max(0, i - 13) : max(0, i - 3)] if _finite(g)]
        if len(earlier) < 3:
            earlier = [g for g in norms[i + 3 : i + 13] if _finite(g)]
        reference = statistics.median(earlier) if earlier else None
        sparse = train[i]["step"] - train[i - 1]["step"] > 1
        window = [
            (train[j]["step"], norms[j])
            for j in range(max(0, i - 3), i + (1 if sparse else 0))
            if _finite(norms[j]) and (j not in flagged or j == i)
        ]
        peak_step, peak_norm = max(window, key=lambda sv: sv[1]) if window else (None, None)
        precursor = bool(peak_norm and reference and peak_norm >= GRAD_PRECURSOR * reference)
        isolated = i + 1 < n and i + 1 not in flagged
        spikes.append(
            {
                "index": i,
                "step": train[i]["step"],
                "loss": losses[i],
                "baseline": losses[i] - f["jump"],
                "jump": f["jump"],
                "lr": train[i].get("lr"),
                "above_start": f["above_start"],
                "grad_norm": norms[i],
                "grad_norm_peak": peak_norm,
                "grad_norm_peak_step": peak_step,
                "grad_norm_reference": reference,
                "precursor": precursor,
                "isolated": isolated,
            }
        )
    return spikes


def _smoothed(values: list[float], k: int = 4) -> list[float]:
    return [statistics.median(values[max(0, i - k) : i + k + 1]) for i in range(len(values))]


# --------------------------------------------------------------------------- the rules
def rule_non_finite(t: Trace) -> Finding | None:
    events = t.events_of("nan")
    bad_rows = [r["step"] for r in t.rows if "loss" in r and not _finite(r["loss"])]
    if not events and not bad_rows:
        return None
    parts, evidence = [], {}
    if events:
        described = []
        for e in events:
            what = {
                "rollback": f"rolled back to step {e.get('to_step')}",
                "skip": "the update was skipped",
                "stop": "the run stopped",
            }.get(e.get("action"), e.get("action", "?"))
            origin = f"; first non-finite: {e['origin']}" if e.get("origin") else ""
            ids = f"; {e['bad_ids']} token ids outside the vocabulary" if e.get("bad_ids") else ""
            described.append(
                f"step {e['step']} (loss {e.get('loss')}, grad norm {e.get('grad_norm')}): {what}{origin}{ids}"
            )
        parts.append("A non-finite loss or gradient appeared at " + "; at ".join(described) + ".")
        evidence["events"] = [
            {
                k: e.get(k)
                for k in ("step", "loss", "grad_norm", "lr", "action", "to_step", "origin", "bad_ids")
                if e.get(k) is not None
            }
            for e in events
        ]
    if bad_rows:
        parts.append(f"The logged loss is not finite at step(s) {bad_rows[:10]}.")
        evidence["non_finite_loss_steps"] = bad_rows[:20]
    parts.append(
        "One bad batch (ids out of range, a corrupted shard) gives a one-off event that a "
        "rollback cures; repeated events after rising gradient norms mean the run is diverging "
        "(lower --lr, longer --warmup, --qk-norm); under fp16, try bf16 or fp32 to rule out the format."
    )
    return Finding("non_finite", "NaN or inf in the loss or gradients", " ".join(parts), evidence)


def rule_guard_actions(t: Trace) -> Finding | None:
    acted = [e for e in t.events_of("spike") if e.get("action") in ("skip", "rollback", "stop")]
    if not acted:
        return None
    steps = [e["step"] for e in acted]
    kinds = sorted({a for e in acted for a in e.get("on", [])})
    actions = sorted({e["action"] for e in acted})
    return Finding(
        "guard_actions",
        "the guard skipped or rolled back spikes",
        f"The spike guard acted {len(acted)} time(s) ({', '.join(actions)}) on {' and '.join(kinds) or 'spikes'} at "
        f"step(s) {steps[:10]}. Each rollback discards the work since the last checkpoint. One event is a bad batch; "
        f"several, or a rollback that is followed by another spike, mean the learning rate is too high for this "
        f"model (lower --lr, or --rollback-lr-scale 0.5 to let the guard lower it).",
        {
            "spikes": [
                {
                    k: _r(e.get(k))
                    for k in ("step", "loss", "grad_norm", "lr", "z_loss", "z_grad_norm", "action")
                    if e.get(k) is not None
                }
                for e in acted[:10]
            ]
        },
    )


def rule_loss_stuck(t: Trace) -> Finding | None:
    train = t.train
    if len(train) < 5 or train[-1]["step"] < MIN_STEPS:
        return None
    start = train[0]["loss"]
    step0 = [r["val_loss"] for r in t.evals if r["step"] == 0]
    if step0:
        start = max(start, step0[0])
    tail = [r["loss"] for r in train[-max(3, len(train) // 5) :]]
    late = statistics.median(tail)
    best = min(_smoothed([r["loss"] for r in train]))
    if late < STUCK_FRACTION * start or best < STUCK_FRACTION * start:
        return None
    lrs = [r["lr"] for r in train if _finite(r.get("lr"))]
    return Finding(
        "loss_stuck",
        "the loss never moved from its starting value",
        f"The loss started at {start:.3f} and is still {late:.3f} at step {train[-1]['step']} (its best, smoothed: "
        f"{best:.3f}). e^{start:.2f} "
        + (f"≈ {math.exp(start):.0f}" if start <= 50 else f"> {math.exp(50):.1e}")
        + ": the model guesses uniformly among about that "
        "many tokens, the vocabulary, and has learned nothing. When the optimizer works ("
        + (f"the learning rate was {min(lrs):.2e}..{max(lrs):.2e}" if lrs else "no learning rate was logged: check it")
        + "), a flat loss at ln V means the targets do not follow from the inputs: "
        "misaligned or shuffled labels, corrupted or random token shards, the wrong tokenizer for the shards. "
        "Decode a batch and look at it (`nanolm doctor` does); check the gradients reach the weights.",
        {
            "start_loss": _r(start),
            "final_loss": _r(late),
            "best_smoothed_loss": _r(best),
            "ln_vocab_estimate": _r(start),
            "vocab_estimate": round(math.exp(min(start, 50))),
            "lr_range": [_r(min(lrs)), _r(max(lrs))] if lrs else None,
            "last_step": train[-1]["step"],
        },
    )


def rule_leak(t: Trace) -> Finding | None:
    floor = t.floor
    if floor is None or floor <= 0:
        return None
    limit = LEAK_FRACTION * floor
    val_below = [r for r in t.evals if r["step"] > 0 and r["val_loss"] < limit]
    train = t.train
    train_below = None
    losses = [r["loss"] for r in train]
    for i in range(0, max(0, len(train) - LEAK_MIN_ROWS + 1)):
        window = losses[i : i + LEAK_MIN_ROWS]
        if statistics.median(window) < limit:
            train_below = train[i + LEAK_MIN_ROWS // 2]
            break
    if not val_below and train_below is None:
        return None
    start = next((r["val_loss"] for r in t.evals if r["step"] == 0), None)
    later = [r["val_loss"] for r in t.evals if r["step"] > 0]
    if not val_below and start and later and min(later) < 0.7 * start:
        # the model learned honest validation text too: a training loss under the floor is
        # then memorisation of the training set (many epochs), which rule_memorising reports
        return None
    last_val = t.evals[-1] if t.evals else None
    evidence = {"floor_loss": _r(floor)}
    if val_below:
        first = val_below[0]
        evidence.update(
            val_below_floor_from_step=first["step"],
            val_loss=_r(first["val_loss"]),
            final_val_loss=_r(last_val["val_loss"]),
        )
        message = (
            f"The validation loss fell to {first['val_loss']:.4f} nats/token at step {first['step']} "
            f"({last_val['val_loss']:.4f} at step {last_val['step']}), below the data's entropy floor of "
            f"{floor:.4f}. No model can predict text with fewer nats than its information content, so this "
            f"is never a very good model: the model sees the tokens it predicts. Usual causes: attention that "
            f"is not causal (a mask missing or turned around), targets equal to the inputs, documents in a "
            f"window that see each other when they share content. `nanolm doctor` checks causality and the "
            f"document mask."
        )
    else:
        evidence.update(train_below_floor_from_step=train_below["step"], train_loss=_r(train_below["loss"]))
        val_far = last_val is not None and last_val["val_loss"] > floor + 1.0
        if last_val is not None:
            evidence.update(final_val_loss=_r(last_val["val_loss"]), final_val_step=last_val["step"])
        message = (
            f"The training loss fell below the data's entropy floor of {floor:.4f} nats/token from step "
            f"{train_below['step']} on (loss {train_below['loss']:.4f})"
            + (
                f", while the validation loss is {last_val['val_loss']:.3f} at step {last_val['step']}, far above "
                f"it. The model found a shortcut that exists only in the training batches: the targets leak "
                f"into the inputs (targets not shifted by one token, so it learns to copy), which does not "
                f"transfer to honest validation windows. Check that targets are the inputs shifted by one."
                if val_far
                else ". No model can go below the floor on text it has not memorised, and the validation loss never "
                "improved much: the targets leak into the inputs in training (not shifted, a non-causal mask)."
            )
        )
    return Finding("leak", "loss below the data's floor: the model sees what it predicts", message, evidence)


def rule_loss_spike(t: Trace) -> Finding | None:
    spikes = [s for s in _loss_spikes(t.train) if s["precursor"]]
    if not spikes:
        return None
    s = max(spikes, key=lambda s: s["jump"])
    peak, warm = t.peak_lr, t.warmup_end
    lr = s.get("lr")
    high = bool(_finite(lr) and peak and lr >= 0.5 * peak)
    if peak is None:
        when = f"at step {s['step']} (no learning rate was logged)"
    elif warm <= 1:
        when = "with no warmup: the first steps already ran at the peak rate"
    elif s["step"] < warm:
        when = f"during warmup (the learning rate peaks at step {warm})"
    elif s["step"] <= 2 * warm + 10:
        when = f"near the end of warmup (the learning rate peaked at step {warm})"
    else:
        when = f"at step {s['step']}, well after warmup (which ended at step {warm})"
    return Finding(
        "loss_spike",
        "loss spike after a gradient-norm spike (learning rate too high)",
        f"The loss jumped from about {s['baseline']:.3f} to {s['loss']:.3f} at step {s['step']}, right after the "
        f"gradient norm rose to {s['grad_norm_peak']:.3g} at step {s['grad_norm_peak_step']} "
        f"({s['grad_norm_peak'] / s['grad_norm_reference']:.1f}x its recent median {s['grad_norm_reference']:.3g}), "
        f"{when}" + (f", at a learning rate of {lr:.2e}{' (the peak)' if high else ''}" if _finite(lr) else "") + ". "
        "A gradient that grows first and a loss "
        "that follows is an optimisation instability, not bad data: the update was too large for the curvature "
        "there. Lower --lr, lengthen --warmup, or bound the attention logits with --qk-norm; "
        "--on-spike rollback with --rollback-lr-scale 0.5 recovers automatically."
        + (
            f" {len(spikes)} such spikes in all, at steps {[x['step'] for x in spikes][:10]}."
            if len(spikes) > 1
            else ""
        )
        + (
            f" One caution: the gradient norm and the loss rose in the same logged row, and the steps between rows are "
            f"not logged, so which came first is not known; a single bad batch raises both at once and is gone by the "
            f"next row. `nanolm replay RUN_DIR --step {s['step']}` tells them apart: a bad batch raises every layer's "
            f"gradient alike and leaves the attention logits as they were."
            if s["grad_norm_peak_step"] == s["step"] and s["isolated"]
            else ""
        ),
        {
            "step": s["step"],
            "loss": _r(s["loss"]),
            "loss_before": _r(s["baseline"]),
            "grad_norm_peak": _r(s["grad_norm_peak"]),
            "grad_norm_peak_step": s["grad_norm_peak_step"],
            "grad_norm_median_before": _r(s["grad_norm_reference"]),
            "lr": _r(lr),
            "peak_lr": _r(peak),
            "warmup_end_step": warm,
            "spike_steps": [x["step"] for x in spikes][:20],
        },
    )


def rule_data_spikes(t: Trace) -> Finding | None:
    spikes = [s for s in _loss_spikes(t.train) if not s["precursor"]]
    isolated = [s for s in spikes if s["isolated"] and s["jump"] >= DATA_SPIKE_MIN_JUMP]
    if len(isolated) < DATA_SPIKES_MIN or len(isolated) < 0.6 * len(spikes):
        return None
    ratios = [
        s["grad_norm"] / s["grad_norm_reference"]
        for s in isolated
        if _finite(s["grad_norm"]) and s["grad_norm_reference"]
    ]
    evidence = {
        "spike_steps": [s["step"] for s in isolated][:20],
        "jumps": [_r(s["jump"], 3) for s in isolated][:20],
        "grad_norm_at_spikes_vs_median": _r(statistics.median(ratios), 3) if ratios else None,
        "logged_rows": len(t.train),
    }
    gap = ""
    if t.evals:
        pairs = []
        for e in t.evals:
            near = [r["loss"] for r in t.train if abs(r["step"] - e["step"]) <= max(10, t.last_step // 20)]
            if e["step"] > 0 and near:
                pairs.append((e["step"], statistics.median(near), e["val_loss"]))
        if pairs:
            step, train_loss, val_loss = pairs[-1]
            evidence.update(train_loss_near_last_eval=_r(train_loss), val_loss_last_eval=_r(val_loss))
            if train_loss > 1.2 * val_loss:
                gap = (
                    f" The training loss around step {step} ({train_loss:.3f}) is also well above the validation "
                    f"loss ({val_loss:.3f}): the training batches are harder than held-out text, which clean data "
                    f"of the same source never is."
                )
    return Finding(
        "data_spikes",
        "isolated loss spikes without a gradient warning (bad data)",
        f"The loss jumped up on {len(isolated)} isolated logged steps (e.g. {evidence['spike_steps'][:6]}, by "
        f"{evidence['jumps'][:6]} nats) and fell straight back on the next one, with no rise of the gradient norm "
        f"before them. An optimisation instability builds up and lingers; a jump that comes from nowhere and vanishes "
        f"is a batch unlike the others: random or corrupted tokens, a foreign-language or binary document, a shard "
        f"written with another tokenizer.{gap} Find the windows those steps drew and decode them; drop or repair "
        f"the shard.",
        evidence,
    )


def rule_clipped_most_steps(t: Trace) -> Finding | None:
    train = [r for r in t.train if "clipped" in r]
    warm = t.warmup_end
    after = [r for r in train if r["step"] > warm]
    if len(after) < 5 or t.last_step - warm < MIN_STEPS:
        return None
    counted = [r for r in after if _finite(r.get("clipped_steps"))]
    at_warm = [r for r in train if r["step"] <= warm and _finite(r.get("clipped_steps"))]
    if counted and at_warm:
        frac = (counted[-1]["clipped_steps"] - at_warm[-1]["clipped_steps"]) / max(
            1, counted[-1]["step"] - at_warm[-1]["step"]
        )
    else:
        frac = sum(bool(r["clipped"]) for r in after) / len(after)
    frac = min(frac, 1.0)
    if frac < CLIPPED_FRACTION:
        return None
    norms = [r["grad_norm"] for r in after if _finite(r.get("grad_norm"))]
    clipped = [r["grad_norm"] for r in after if r["clipped"] and _finite(r.get("grad_norm"))]
    unclipped = [r["grad_norm"] for r in train if not r["clipped"] and _finite(r.get("grad_norm"))]
    low = max(unclipped) if unclipped else None
    high = min(clipped) if clipped else None
    median_norm = statistics.median(norms) if norms else None
    spread = (
        statistics.quantiles(norms, n=10)[-1] / max(statistics.quantiles(norms, n=10)[0], 1e-12)
        if len(norms) >= 10
        else None
    )
    if low is not None and high is not None and low <= high:
        threshold, bounds = f" (the clip threshold lies between {low:.3g} and {high:.3g})", [_r(low), _r(high)]
    elif high is not None:
        threshold, bounds = (
            f" (every logged step was clipped: the clip threshold is below {high:.3g})",
            [None, _r(high)],
        )
    else:
        threshold, bounds = "", None
    return Finding(
        "clipped_most_steps",
        "most steps clipped after warmup",
        f"{frac:.0%} of the steps after warmup (step {warm}) were clipped"
        + (
            f"; the median gradient norm after warmup is {median_norm:.3g}{threshold}"
            if median_norm is not None
            else "; no gradient norm was logged after warmup"
        )
        + ". In a healthy run clipping is frequent during warmup and rare after it. "
        "Clipping every step means the clip, not the learning rate, sets the step size: usually the learning rate "
        "is too high (lower --lr). If the loss otherwise falls smoothly and the norm sits at a steady multiple of the "
        "threshold, the gradient itself is scaled up: a loss summed instead of averaged (not divided by the "
        "gradient-accumulation count or the token count) multiplies every gradient, which Adam hides and only the "
        "clipping shows.",
        {
            "clipped_fraction_after_warmup": _r(frac, 3),
            "warmup_end_step": warm,
            "median_grad_norm_after_warmup": _r(median_norm),
            "clip_threshold_between": bounds,
            "grad_norm_p90_over_p10": _r(spread, 3),
        },
    )


def rule_memorising(t: Trace) -> Finding | None:
    evals = t.evals
    if len(evals) < 4:
        return None
    first = evals[0]
    best = min(evals, key=lambda r: r["val_loss"])
    after = [r for r in evals if r["step"] > best["step"]]
    last = evals[-1]
    if best is first or best["val_loss"] > 0.9 * first["val_loss"] or len(after) < 2:
        return None
    if first["step"] == 0 and last["val_loss"] >= first["val_loss"]:
        return None  # worse than the untrained model: rule_val_worse_than_start says what that means
    rise = last["val_loss"] - best["val_loss"]
    if rise < max(MEMORISE_RISE * best["val_loss"], MEMORISE_MIN_RISE) or not all(
        r["val_loss"] > best["val_loss"] for r in after
    ):
        return None

    def train_near(step):
        near = [r["loss"] for r in t.train if abs(r["step"] - step) <= max(10, t.last_step // 20)]
        return statistics.median(near) if near else None

    tb, tl = train_near(best["step"]), train_near(last["step"])
    if tb is None or tl is None or tl >= tb:
        return None
    return Finding(
        "memorising",
        "validation loss rising while training loss falls (memorising)",
        f"The validation loss was lowest at step {best['step']} ({best['val_loss']:.4f}) and rose to "
        f"{last['val_loss']:.4f} by step {last['step']}, while the training loss kept falling ({tb:.4f} -> {tl:.4f}). "
        f"The model is learning the training set by heart rather than the language: too many passes over too little "
        f"data for its size. Use the best checkpoint (kept by --keep), more data, a smaller model or fewer steps; "
        f"dropout and weight decay help a little.",
        {
            "best_val_step": best["step"],
            "best_val_loss": _r(best["val_loss"]),
            "last_val_step": last["step"],
            "last_val_loss": _r(last["val_loss"]),
            "train_loss_at_best": _r(tb),
            "train_loss_at_last": _r(tl),
        },
    )


def rule_val_worse_than_start(t: Trace) -> Finding | None:
    evals = t.evals
    start = next((r for r in evals if r["step"] == 0), None)
    later = [r for r in evals if r["step"] > 0]
    if start is None or len(later) < 2 or t.last_step < MIN_STEPS:
        return None
    tail = later[-2:]
    if not all(r["val_loss"] > start["val_loss"] + MEMORISE_MIN_RISE for r in tail):
        return None
    train_tail = [r["loss"] for r in t.train[-max(3, len(t.train) // 10) :]]
    train_late = statistics.median(train_tail) if train_tail else None
    if train_late is None or train_late >= STUCK_FRACTION * start["val_loss"]:
        return None  # training did not learn either: rule_loss_stuck covers it
    return Finding(
        "val_worse_than_start",
        "validation worse than the untrained model while training improves",
        f"The validation loss ended at {tail[-1]['val_loss']:.3f} (step {tail[-1]['step']}), worse than the untrained "
        f"model's {start['val_loss']:.3f} at step 0, while the training loss fell to {train_late:.3f}. That is not "
        f"ordinary memorising, which first helps the validation loss and then slowly hurts it: the model learned "
        f"something that holds only in the training batches. Usual causes: the training targets leak into the inputs "
        f"(targets equal to the inputs instead of the next tokens, so the model learns to copy), or the training and "
        f"validation data are prepared differently (another tokenizer, another shift, another mask).",
        {
            "val_loss_step0": _r(start["val_loss"]),
            "val_loss_last": _r(tail[-1]["val_loss"]),
            "last_eval_step": tail[-1]["step"],
            "train_loss_late": _r(train_late),
            "best_val_loss": _r(min(r["val_loss"] for r in later)),
        },
    )


def rule_train_loss_rising(t: Trace) -> Finding | None:
    train = t.train
    if len(train) < 20 or t.last_step < MIN_STEPS:
        return None
    smooth = _smoothed([r["loss"] for r in train])
    i = min(range(len(smooth)), key=smooth.__getitem__)
    end = statistics.median(smooth[-3:])
    if end < RISING_FACTOR * smooth[i] + RISING_MIN:
        return None
    return Finding(
        "train_loss_rising",
        "the training loss ended well above its best",
        f"The training loss (smoothed over 9 logged steps) was lowest at step {train[i]['step']} ({smooth[i]:.4f}) "
        f"and ended at {end:.4f} at step {train[-1]['step']}. A loss that climbs back up is diverging or was knocked "
        f"off course (see any spike, clipping or attention finding above); lower --lr, and restart from the best "
        f"checkpoint rather than the last.",
        {
            "best_step": train[i]["step"],
            "best_loss_smoothed": _r(smooth[i]),
            "final_loss_smoothed": _r(end),
            "final_step": train[-1]["step"],
        },
    )


def rule_resume_jump(t: Trace) -> Finding | None:
    findings = []
    for e in t.events_of("resume"):
        s = e["step"]
        before = [r for r in t.train if s - 100 < r["step"] <= s and _finite(r.get("grad_norm"))][-20:]
        after = [r for r in t.train if s < r["step"] <= s + 3 and _finite(r.get("grad_norm"))]
        if len(before) < 3 or not after:
            continue
        reference = statistics.median(r["grad_norm"] for r in before)
        peak = max(after, key=lambda r: r["grad_norm"])
        if reference <= 0 or peak["grad_norm"] < RESUME_GRAD_RATIO * reference:
            continue
        later = [r for r in t.train if s + 1 < r["step"] <= s + 5]
        first_loss = after[0]["loss"]
        worst = max(later, key=lambda r: r["loss"]) if later else None
        findings.append((e, reference, peak, first_loss, worst, before[-1]))
    if not findings:
        return None
    e, reference, peak, first_loss, worst, last_before = findings[0]
    s = e["step"]
    loss_part = (
        f" and the loss went from {first_loss:.4f} (step {s + 1}, before that update) to {worst['loss']:.4f} "
        f"(step {worst['step']})"
        if worst is not None
        else ""
    )
    return Finding(
        "resume_jump",
        "a jolt right after resuming (optimizer state missing?)",
        f"Right after the run resumed at step {s}, the gradient norm jumped to {peak['grad_norm']:.3g} at step "
        f"{peak['step']}, {peak['grad_norm'] / reference:.1f}x its median of {reference:.3g} over the steps before"
        f"{loss_part}. A resume that restores everything continues exactly where the run stopped; a jolt means the "
        f"first update after it was oversized. The classic cause is a missing optimizer state: a fresh AdamW's "
        f"bias-corrected first step moves every weight by the full learning rate, whatever its gradient's history. "
        f"Check that the checkpoint holds the optimizer state and that it is loaded (and the LR schedule's step too).",
        {
            "resume_step": s,
            "grad_norm_after": _r(peak["grad_norm"]),
            "grad_norm_after_step": peak["step"],
            "grad_norm_median_before": _r(reference),
            "loss_first_after": _r(first_loss),
            "loss_worst_after": _r(worst["loss"]) if worst else None,
            "loss_last_before": _r(last_before["loss"]),
            "resumes_with_a_jolt": [f[0]["step"] for f in findings],
        },
    )


def rule_fp16_overflow(t: Trace) -> Finding | None:
    rows = [r for r in t.train if _finite(r.get("loss_scale"))]
    if not rows:
        return None
    skipped = max(r.get("skipped_steps", 0) for r in rows)
    scales = [r["loss_scale"] for r in rows]
    top = max(scales)
    collapsed = min(scales) <= SCALE_COLLAPSE * top
    many = skipped >= OVERFLOW_MIN_SKIPPED and skipped >= OVERFLOW_SKIPPED * t.last_step
    if not (many or collapsed):
        return None
    skip_steps = [b["step"] for a, b in zip(rows, rows[1:]) if b.get("skipped_steps", 0) > a.get("skipped_steps", 0)]
    return Finding(
        "fp16_overflow",
        "fp16 overflow: skipped steps and a collapsing loss scale",
        "Under fp16, "
        + (
            f"{skipped} of {t.last_step} steps were skipped because a gradient overflowed"
            if any("skipped_steps" in r for r in rows)
            else "the skipped steps were not logged"
        )
        + (
            f", and the loss scale went from {top:g} down to {min(scales):g} (last {scales[-1]:g})"
            if min(scales) < top
            else f", at a loss scale of {top:g} throughout"
        )
        + ". A healthy fp16 run skips a step now and "
        "then, when the scale probes upward; repeated overflows mean the gradients (or activations) themselves "
        "exceed fp16's range of 65,504: the run is diverging or its activations are huge. Lower --lr, use --qk-norm, "
        "or train in bf16 (fp32's range, no loss scaling needed).",
        {
            "skipped_steps": skipped,
            "steps": t.last_step,
            "max_loss_scale": top,
            "min_loss_scale": min(scales),
            "last_loss_scale": scales[-1],
            "logged_steps_with_new_skips": skip_steps[:20],
        },
    )


def rule_fp16_underflow(t: Trace) -> Finding | None:
    rows = [r for r in t.train if _finite(r.get("grad_subnormal_frac"))]
    if len(rows) < UNDERFLOW_ROWS:
        return _zero_gradients_rising(t)  # a run logged before nanolm measured fp16's range
    share = statistics.median(r["grad_subnormal_frac"] for r in rows)
    if share < UNDERFLOW_SHARE:
        return None
    scales = [r["loss_scale"] for r in rows if _finite(r.get("loss_scale"))]
    cause = (
        f"A loss scale is logged (last {scales[-1]:g}), so it is too low for these gradients: check it is not pinned."
        if scales
        else "No loss scale is logged for this fp16 run: loss scaling looks switched off."
    )
    message = (
        f"Under fp16, {share:.0%} of the gradient values (median of {len(rows)} logged steps, from step "
        f"{rows[0]['step']}) were below fp16's normal range during backward (2^-14 = 6.1e-5, at the loss scale "
        f"used): there fp16 keeps only a few of its digits, and below 6e-8 none, so those gradients are noise "
        f"or 0 and their weights learn little or nothing. This follows from the gradients' sizes and the format, "
        f"on any hardware. {cause} Multiply the loss by a scale before backward (nanolm's --precision fp16 does, "
        f"dynamically) or use bf16."
    )
    evidence = {
        "grad_subnormal_frac_median": _r(share),
        "first_step": rows[0]["step"],
        "last_step": rows[-1]["step"],
        "loss_scale_logged": bool(scales),
    }
    return Finding("fp16_underflow", "fp16 underflow: the gradients lie below fp16's range", message, evidence)


def _zero_gradients_rising(t: Trace) -> Finding | None:
    """The older sign, for runs without ``grad_subnormal_frac``: a rising share of exact zeros
    (it depends on whether the kernels flush fp16's subnormals, so it shows on some CPUs only)."""
    rows = [r for r in t.train if _finite(r.get("grad_zero_frac"))]
    if len(rows) < 8 or t.last_step < MIN_STEPS:
        return None
    q = max(2, len(rows) // 5)
    early = statistics.median(r["grad_zero_frac"] for r in rows[:q])
    late = statistics.median(r["grad_zero_frac"] for r in rows[-q:])
    if late < UNDERFLOW_LATE or late < UNDERFLOW_GROWTH * early:
        return None
    return Finding(
        "fp16_underflow",
        "fp16 underflow: more and more gradients are exactly zero",
        f"The share of gradient elements that are exactly zero rose from {early:.2e} (first logged steps) to "
        f"{late:.2e} (last ones), {late / max(early, 1e-12):.0f}x. Under fp16 a gradient below ~6e-8 comes out 0, "
        f"and its weight stops learning. Multiply the loss by a scale before backward (nanolm's --precision fp16 "
        f"does, dynamically) or use bf16.",
        {
            "grad_zero_frac_early": _r(early),
            "grad_zero_frac_late": _r(late),
            "first_step": rows[0]["step"],
            "last_step": rows[-1]["step"],
        },
    )


def rule_attention_logits(t: Trace) -> Finding | None:
    series = t.blocks("attn_logit_max")
    if not series:
        return None
    step, block, value = max(((s, b, v) for s, values in series for b, v in values.items()), key=lambda x: x[2])
    if value < ATTENTION_LOGIT_MAX:
        return None
    trajectory = [(s, _r(values.get(block), 3)) for s, values in series if block in values]
    picks = sorted({0, len(trajectory) // 4, len(trajectory) // 2, 3 * len(trajectory) // 4, len(trajectory) - 1})
    return Finding(
        "attention_logits",
        "attention logits far too large (use QK-norm or a lower LR)",
        f"The largest attention logit reached {value:.0f} in block {block} at step {step} (last: "
        f"{trajectory[-1][1]} at step {trajectory[-1][0]}); healthy runs level off around 10-30. Softmax over logits "
        f"that far apart is a hard argmax: heads lock onto single tokens, their gradient vanishes, and this growth is "
        f"the usual prelude to loss spikes and divergence. --qk-norm bounds the logits by construction; a lower --lr "
        f"or a longer --warmup keeps them from running away.",
        {"max_logit": _r(value), "block": block, "step": step, "trajectory": [trajectory[i] for i in picks]},
    )


def rule_dead_units(t: Trace) -> Finding | None:
    series = t.blocks("mlp_dead_frac")
    if len(series) < 3:
        return None
    tail = series[-max(2, len(series) // 3) :]
    blocks = set().union(*(values for _, values in tail))
    worst = {b: statistics.median(values.get(b, 0.0) for _, values in tail) for b in blocks}
    block = max(worst, key=worst.get)
    if worst[block] < DEAD_FRACTION:
        return None
    return Finding(
        "dead_units",
        "many MLP units dead for good",
        f"{worst[block]:.0%} of block {block}'s MLP units never opened on the probe batch over the last "
        f"{len(tail)} statistics steps (steps {tail[0][0]}..{tail[-1][0]}). A unit that is shut on every token gets "
        f"almost no gradient and rarely recovers, so the model has lost that capacity. The usual cause is a "
        f"learning rate too high early on (one large update pushes whole units shut): lower --lr or lengthen --warmup.",
        {
            "block": block,
            "dead_fraction": _r(worst[block], 3),
            "steps": [tail[0][0], tail[-1][0]],
            "per_block": {b: _r(v, 3) for b, v in sorted(worst.items())},
        },
    )


# --------------------------------------------------------------------------- the recipe (step-0 row)
def _recipe(t: Trace) -> dict:
    """The optimizer's settings the run recorded in its step-0 row (older runs have none)."""
    return next((r for r in t.rows if r["step"] == 0 and "peak_lr" in r), {})


def rule_no_clipping(t: Trace) -> Finding | None:
    recipe = _recipe(t)
    norms = [(r["step"], r["grad_norm"]) for r in t.train if _finite(r.get("grad_norm"))]
    if recipe.get("clip") != 0 or len(norms) < 20:
        return None
    median = statistics.median(n for _, n in norms)
    step, peak = max(norms, key=lambda sn: sn[1])
    if peak < UNCLIPPED_SPIKE * median:
        return None
    return Finding(
        "no_clipping",
        "gradient-norm spikes reached the weights unclipped",
        f"Clipping is off (clip 0) and the gradient norm reached {peak:.3g} at step {step}, {peak / median:.0f}x its "
        f"median of {median:.3g}. Adam normalises each coordinate by its running second moment, so a sudden large "
        f"gradient is not fully normalised away: that step moves the weights far more than a typical one, and at a "
        f"high learning rate such steps push attention logits and norms into regions the run must then recover from. "
        f"Clip the global norm (--clip 1.0, the usual value): it caps those steps and leaves the others alone.",
        {
            "clip": 0,
            "grad_norm_max": _r(peak),
            "grad_norm_max_step": step,
            "grad_norm_median": _r(median),
            "ratio": _r(peak / median, 3),
        },
    )


def rule_slow_second_moment(t: Trace) -> Finding | None:
    recipe = _recipe(t)
    beta2, warmup = recipe.get("beta2"), recipe.get("warmup_steps")
    if not (_finite(beta2) and _finite(warmup)) or beta2 < SLOW_BETA2 or len(t.train) < 20:
        return None
    memory = 1 / (1 - beta2)
    if warmup >= SLOW_WARMUP_SHARE * memory:
        return None
    cut = max(warmup + 1, t.last_step // 5)
    early = [r["grad_norm"] for r in t.train if r["step"] <= cut and _finite(r.get("grad_norm"))]
    later = [r["grad_norm"] for r in t.train if r["step"] > cut and _finite(r.get("grad_norm"))]
    if not early or not later:
        return None
    ratio = max(early) / statistics.median(later)
    logits = [max(v.values()) for _, v in t.blocks("attn_logit_max")]
    if ratio < EARLY_INSTABILITY and not (logits and max(logits) > ATTENTION_LOGIT_MAX):
        return None
    return Finding(
        "slow_second_moment",
        "Adam's second moment adapts too slowly for this warmup",
        f"beta2 = {beta2:g} averages the squared gradients over ~{memory:.0f} steps, but the warmup lasts "
        f"{warmup} steps; early in the run the gradient norm reached {max(early):.3g}, {ratio:.0f}x its later median"
        + (
            f", and the attention logits grew to {max(logits):.0f}"
            if logits and max(logits) > ATTENTION_LOGIT_MAX
            else ""
        )
        + ". While the second moment still remembers the first, unrepresentative gradients, each "
        "coordinate's step is mis-sized: too large where gradients grew, too small where they shrank, at the full "
        "learning rate. Use beta2 = 0.95 (the usual choice for language models), or a warmup of at least "
        f"~{SLOW_WARMUP_SHARE * memory:.0f} steps.",
        {
            "beta2": beta2,
            "warmup_steps": warmup,
            "second_moment_memory_steps": _r(memory, 3),
            "early_grad_norm_max": _r(max(early)),
            "later_grad_norm_median": _r(statistics.median(later)),
            "attention_logit_max": _r(max(logits)) if logits else None,
        },
    )


def rule_no_lr_decay(t: Trace) -> Finding | None:
    lrs = [(r["step"], r["lr"]) for r in t.train if _finite(r.get("lr"))]
    if len(lrs) < 20 or t.last_step - t.warmup_end < MIN_STEPS * 2 or not t.peak_lr:
        return None
    last_step, last_lr = lrs[-1]
    if last_lr < NO_DECAY_SHARE * t.peak_lr:
        return None
    recipe = _recipe(t)
    start, end = recipe.get("decay_start_step"), recipe.get("decay_end_step")
    if start is not None and end is not None and _finite(recipe.get("min_lr")):
        # a WSD run holds its peak until `start` by design, then decays in a straight line: only a
        # rate above what that line gives by now is a missing decay
        done = min(1.0, max(0.0, (last_step - start) / max(1, end - start)))
        if t.peak_lr - (t.peak_lr - recipe["min_lr"]) * done >= NO_DECAY_SHARE * t.peak_lr:
            return None
    n = t.last_step
    window = [r["loss"] for r in t.train if 0.6 * n < r["step"] <= 0.8 * n]
    final = [r["loss"] for r in t.train if r["step"] > 0.8 * n]
    change = (
        (statistics.median(window) - statistics.median(final)) / statistics.median(window) if window and final else None
    )
    return Finding(
        "no_lr_decay",
        "the learning rate never decays",
        f"The learning rate is still {last_lr:.3g} at step {last_step}, {last_lr / t.peak_lr:.0%} of its peak: it never "
        f"decayed."
        + (
            f" Over the last fifth of the run the loss {'fell' if change >= 0 else 'rose'} {abs(change):.1%}."
            if change is not None
            else ""
        )
        + " At a constant rate the weights keep bouncing around the minimum at the scale the rate sets; lowering "
        "the rate at the end (cosine or linear decay to ~10 % of the peak, or the decay phase of a warmup-stable-decay "
        "schedule) lets them settle, and the loss drops further in the last steps. Set --min-lr below --lr (its "
        "default is lr / 10).",
        {
            "last_lr": _r(last_lr),
            "peak_lr": _r(t.peak_lr),
            "last_step": last_step,
            "loss_change_last_fifth": _r(change, 3) if change is not None else None,
        },
    )


def rule_decay_on_norms(t: Trace) -> Finding | None:
    recipe = _recipe(t)
    decayed = recipe.get("decayed_norms_biases_embeddings")
    if not decayed or not recipe.get("weight_decay"):
        return None
    final = [(s, v["final_norm"]) for s, v in t.blocks("weight_norm") if "final_norm" in v]
    return Finding(
        "decay_on_norms",
        "weight decay is applied to norms, biases or embeddings",
        f"The optimizer applies weight decay {recipe['weight_decay']:g} to {decayed} parameter tensors that are norm "
        f"gains, biases or embeddings. Decay pulls weights toward zero: right for the matrices that mix "
        f"features, wrong for a norm's gains (their natural value is 1, and shrinking them rescales every activation "
        f"after it) and for embeddings (a rare token's row gets a gradient only when the token occurs, but is decayed "
        f"at every step). The run still trains, a little worse. Put those parameters in a group with weight_decay 0 "
        f"(nanolm.optim.get_param_groups); `nanolm doctor` checks the groups before a run.",
        {
            "decayed_norms_biases_embeddings": decayed,
            "weight_decay": recipe["weight_decay"],
            "final_norm_weight_norm": [_r(final[0][1]), _r(final[-1][1])] if len(final) >= 2 else None,
        },
    )


def rule_left_reference_band(t: Trace) -> Finding | None:
    ref = reference_for_digest(
        t.rows[0].get("setup_digest") if t.rows and t.rows[0]["step"] == 0 else None, t.references
    )
    if ref is None:
        return None
    found = departures(ref, t.rows)
    look = curve_departure(ref, t.rows)
    if not found and look is None:
        return None
    said = []
    if look is not None and look.own_seed:
        among = population_look(ref, t.rows)
        said.append(
            f"its validation curve is {look.describe()} (a run of this seed differs from its reference run "
            f"by what reruns of the seeds differ, crossing the test's threshold "
            f"{100 * ref.seed_curves.false_alarm:g} % of the time"
            + (
                f"; among all the seeds it is {among.percent:+.1f} %, {among.one_in()} for a healthy run"
                if among is not None
                else ""
            )
            + ")"
        )
    elif look is not None:
        said.append(
            f"its validation curve is {look.describe()} (the seeds' curves over {len(ref.curve_seeds)} seeds; "
            f"a healthy run crosses the test's threshold at any evaluation {100 * ref.curve.false_alarm:g} % "
            f"of the time)"
        )
    if found:
        said.append(
            found[0].describe() + (f"; also {'; '.join(d.describe() for d in found[1:6])}" if found[1:] else "")
        )
    evidence = {"reference": ref.name}
    if found:
        first = found[0]
        evidence.update(
            {
                "key": first.key,
                "step": first.step,
                "value": _r(first.value),
                "band": [_r(first.lo), _r(first.hi)],
                "outside_until": first.until,
                "also": [f"{d.key}@{d.step}" for d in found[1:6]] or None,
            }
        )
    if look is not None:
        evidence["curve"] = {
            "excess_percent": _r(look.percent, 3),
            "since": look.since,
            "through": look.step,
            "t": _r(look.t, 3),
            "healthy_one_in": look.one_in(),
            "against": "its seed's reference run" if look.own_seed else "the seeds' mean",
        }
    return Finding(
        "left_reference_band",
        f"the run left the reference of {ref.title}",
        f"This run's setup (configuration, data and number format) is that of {ref.describe()}. Here "
        + "; and ".join(said)
        + ". Seeds alone do not do this (the band is the seeds' extremes widened by their "
        "spread; the curve test is calibrated on their curves): something differs from the recipe that the "
        "configuration does not show, such as changed code (a bug), other library versions, or a very different "
        "machine's arithmetic. Train the recipe again with the installed nanolm (`nanolm compare` says where two runs "
        "part), and compare the code with the one that measured the band. The earliest departure is where to look.",
        evidence,
    )


RULES = [
    rule_non_finite,
    rule_guard_actions,
    rule_loss_stuck,
    rule_leak,
    rule_loss_spike,
    rule_data_spikes,
    rule_clipped_most_steps,
    rule_memorising,
    rule_val_worse_than_start,
    rule_train_loss_rising,
    rule_resume_jump,
    rule_fp16_overflow,
    rule_fp16_underflow,
    rule_attention_logits,
    rule_dead_units,
    rule_no_clipping,
    rule_slow_second_moment,
    rule_no_lr_decay,
    rule_decay_on_norms,
    rule_left_reference_band,
]


# --------------------------------------------------------------------------- entry points
RUNBOOKS = {  # finding -> the section of docs/runbooks.md that says what to do, in order
    "non_finite": "the-loss-becomes-nan",
    "fp16_overflow": "the-loss-becomes-nan",
    "fp16_underflow": "the-loss-becomes-nan",
    "guard_actions": "the-loss-jumped-and-recovered",
    "loss_spike": "the-loss-jumped-and-recovered",
    "data_spikes": "the-loss-jumped-and-recovered",
    "attention_logits": "the-loss-jumped-and-recovered",
    "no_clipping": "the-loss-jumped-and-recovered",
    "train_loss_rising": "a-loss-spike-that-never-recovers",
    "slow_second_moment": "a-loss-spike-that-never-recovers",
    "memorising": "validation-loss-rises-while-training-loss-falls",
    "val_worse_than_start": "validation-loss-rises-while-training-loss-falls",
    "loss_stuck": "the-loss-is-flat-from-the-start",
    "clipped_most_steps": "clipping-fires-on-most-steps",
}


def diagnose_trace(rows: list[dict], events: list[dict] | None = None, rules=None, references=None) -> list[Finding]:
    """Every finding of ``rules`` (default: all) on a run's metric rows and events; ``references``:
    the reference bands a recognised run is judged by (default: the shipped ones)."""
    trace = Trace(rows, events, references)
    if not trace.rows:
        return []
    found = []
    for rule in RULES if rules is None else rules:
        result = rule(trace)
        if result is not None:
            result.runbook = result.runbook or RUNBOOKS.get(result.name)
            found.append(result)
    return found


def diagnose(run_dir) -> list[Finding]:
    """The findings for a run directory (its ``metrics.jsonl`` and ``events.jsonl`` only)."""
    trace = read_run(run_dir)
    return diagnose_trace(trace.rows, trace.events)


def format_findings(run_dir, findings: list[Finding]) -> str:
    """The findings as a person reads them: title, message, evidence."""
    if not findings:
        return f"{run_dir}: no findings"
    lines = [f"{run_dir}: {len(findings)} finding{'s' if len(findings) > 1 else ''}"]
    for i, f in enumerate(findings, 1):
        lines.append("")
        lines.append(f"{i}. [{f.name}] {f.title}")
        lines.append(f"   {f.message}")
        lines.append(
            "   evidence: " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in f.evidence.items() if v is not None)
        )
        if f.runbook:
            lines.append(f"   what to do, step by step: docs/runbooks.md#{f.runbook}")
    return "\n".join(lines)
