"""``nanolm compare RUN_A RUN_B``: did two runs train the same thing?

The course's own check for an accumulation bug is to train batch 32 and batch 8 with
``--grad-accum 4`` and see that the curves match. By eye, "match" is vague; here it has two
precise meanings, chosen from the runs' setups (``nanolm.watch.reference.setup_of``):

* **The same training, split differently** (same seed, data, model and recipe; only how each
  step's batch is cut into micro-batches or ranks, or what is logged, differs): each step sees
  the same windows and must compute the same numbers up to floating-point rounding. The
  curves agree to ``FP_TOLERANCE`` (relative) at every common logged step until rounding
  differences, which training amplifies step after step (docs/health.md), have grown to that
  size; a difference that appears from one logged step to the next, without a
  growing drift before it, is where the runs *part*, and the verdict names that step. After
  rounding has taken over, the runs are compared as two seeds are.
* **The same recipe, different seeds**: the curves agree within seed noise. The noise is the
  width of a shipped reference band when the runs are recognised (two healthy seeds both lie
  in it), otherwise estimated from the runs themselves (the step-to-step scatter of their
  training loss); the verdict says which tolerance it used.

Runs whose setups differ in anything else did not train the same thing by construction: the
verdict names the options. Exit status as ``diff``: 0 when they agree, 1 when they differ,
2 when an argument is not a run nanolm can read.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import NanolmError
from ..run.config import load_run_config
from ..watch.reference import differences, find_reference, setup_of
from ..watch.sinks import read_metrics

FP_TOLERANCE = 1e-4  # relative: two splits of one batch agree this closely while rounding differences are small
DRIFT = 1e-6  # a difference already this large at the previous logged step has grown there: amplified rounding
SPLIT_OPTIONS = {
    "train.batch_size",
    "train.grad_accum",
    "run.world_size",  # how a step's batch is cut up ...
    "run.val_windows",
}  # ... and the validation set's size: val_loss is then not compared
SAME_TRAINING_KEYS = ("loss", "grad_norm", "lr")
SEED_NOISE_SIGMAS = 4.0  # different seeds: the smoothed training losses may differ by this many noise units
SMOOTHING = 5  # logged steps averaged before two seeds' training losses are compared
MIN_NOISE_STEPS = 10  # logged training losses a run needs for its noise to be estimated (from its second half)


@dataclass
class RunRecord:
    path: Path
    cfg: object
    rows: list[dict]
    setup: dict

    @property
    def seed(self) -> int:
        return self.cfg.train.seed

    @property
    def val_windows(self) -> int:
        return self.setup["run"]["val_windows"]


def read_run(path) -> RunRecord:
    """A run directory's configuration, metrics and setup; one line naming what is missing."""
    path = Path(path)
    if not (path / "config.toml").is_file():
        raise NanolmError(f"{path} is not a run directory (no config.toml); give directories written by nanolm train")
    if not (path / "metrics.jsonl").is_file():
        raise NanolmError(f"{path} has no metrics.jsonl: the run logged nothing to compare")
    cfg = load_run_config(path / "config.toml")
    rows = read_metrics(path / "metrics.jsonl", warn=lambda line: print(line, file=sys.stderr))
    if not rows:
        raise NanolmError(f"{path}/metrics.jsonl holds no rows")
    return RunRecord(path, cfg, rows, setup_of(cfg, *recorded_run(path, cfg, rows[0])))


def recorded_run(path: Path, cfg, first: dict) -> tuple[str, str, str, int]:
    """(data digest, number format, device type, world size) as the step-0 row records them;
    for a run logged before nanolm recorded them: from its data directory, its config and its
    tokens per step (on a CPU)."""
    per_rank = cfg.train.batch_size * cfg.train.grad_accum * cfg.model.seq_len
    tokens = first.get("tokens_per_step")
    world_size = first.get("world_size")
    if not (type(world_size) is int and world_size >= 1):  # not a bool: True is an int to Python
        world_size = max(1, tokens // per_rank) if type(tokens) is int else 1
    precision, device_type = first.get("precision", cfg.train.precision), first.get("device_type", "cpu")
    if "data_digest" in first:
        return first["data_digest"], precision, device_type, world_size
    from ..data.shards import PreparedData

    try:
        digest = PreparedData(path / "data", verify=False).digest
    except NanolmError:
        digest = "unknown"
    return digest, precision, device_type, world_size


@dataclass
class Comparison:
    kind: str  # "same_training", "seeds", "different_setups"
    agree: bool
    lines: list[str] = field(default_factory=list)
    parted_at: int | None = None

    def exit_code(self) -> int:
        return 0 if self.agree else 1


def relative(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def common_rows(a: list[dict], b: list[dict], key: str) -> list[tuple[int, float, float]]:
    """(step, a's value, b's value) at the steps both runs logged ``key``, in step order. A step
    logged twice (a hand-edited or merged log) counts with its last row in either run, so the
    pairs do not depend on which run is named first."""
    by_step = [{r["step"]: float(r[key]) for r in rows if _number(r.get(key))} for rows in (a, b)]
    return [(step, by_step[0][step], by_step[1][step]) for step in sorted(by_step[0].keys() & by_step[1].keys())]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def compare_runs(path_a, path_b) -> Comparison:
    return compare_records(read_run(path_a), read_run(path_b))


def compare_records(a: RunRecord, b: RunRecord) -> Comparison:
    """The verdict on two runs already read; the same, and with the same tolerance, whichever
    is named first (only the order of the figures in its lines follows the arguments)."""
    diff = differences(a.setup, b.setup)
    split = [d for d in diff if d in SPLIT_OPTIONS]
    other = [f"{d} ({_value(a.setup, d)} vs {_value(b.setup, d)})" for d in diff if d not in SPLIT_OPTIONS]
    tokens = [
        r.setup["train"]["batch_size"] * r.setup["train"]["grad_accum"] * r.setup["run"]["world_size"] for r in (a, b)
    ]
    if tokens[0] != tokens[1]:
        other.append(f"sequences per step ({tokens[0]} vs {tokens[1]})")
    if other:
        return Comparison(
            "different_setups", False, [f"different setups: {', '.join(other)}; they did not train the same thing"]
        )
    kind = "same_training" if a.seed == b.seed else "seeds"
    budget_note = []
    if a.setup["train"].get("time_budget") is not None:
        a, b, line = until_the_schedules_part(a, b)
        budget_note = [line]
        if not a.rows:
            return Comparison(kind, True, budget_note)
    broken = first_non_finite_difference(a.rows, b.rows, ("loss", "val_loss", "grad_norm"))
    if broken is not None:
        step, key, x, y = broken
        return Comparison(
            kind,
            False,
            [
                f"they differ at step {step}: {key} {x:.6g} vs {y:.6g}: one run's value is not "
                f"finite, the other's is (only finite values are compared beyond it)"
            ],
            parted_at=step,
        )
    verdict = _same_training(a, b, split) if a.seed == b.seed else _seeds(a, b)
    verdict.lines[:0] = budget_note
    return verdict


def until_the_schedules_part(a: RunRecord, b: RunRecord) -> tuple[RunRecord, RunRecord, str]:
    """Two runs with one time budget: each one's clock planned its warmup and started its decay, so
    their learning rates may part at any step, and past it the runs no longer train the same
    thing (a difference there is the plans', not a bug's). Returns both runs cut before the first
    logged step where their rates differ (no rows: no trained step is left to compare), and a line
    that says where the comparison stops."""
    rates = common_rows(a.rows, b.rows, "lr")
    parted = next((step for step, x, y in rates if x != y), None)
    if parted is None:
        return a, b, "time budget: their learning rates agree at every logged step, so they are compared whole"
    why = f"their time budgets' plans give step {parted} different learning rates (each run's clock planned its own)"
    compared = any(step < parted for step, _, _ in rates)
    cut = [
        dataclasses.replace(r, rows=[row for row in r.rows if row["step"] < parted] if compared else []) for r in (a, b)
    ]
    if not compared:
        return cut[0], cut[1], f"not compared: {why}, and no earlier trained step was logged by both"
    return cut[0], cut[1], f"compared up to step {parted - 1}: {why}"


def first_non_finite_difference(a: list[dict], b: list[dict], keys) -> tuple[int, str, float, float] | None:
    """The first step where both runs logged ``key`` and exactly one value is NaN or infinite:
    (step, key, a's value, b's value). Every other comparison reads finite values only, so a run
    that went NaN would otherwise be compared on the steps before, and called the other's equal."""
    found = None
    for key in keys:
        by_step = [{r["step"]: float(r[key]) for r in rows if _logged_number(r.get(key))} for rows in (a, b)]
        for step in sorted(by_step[0].keys() & by_step[1].keys()):
            x, y = by_step[0][step], by_step[1][step]
            if math.isfinite(x) != math.isfinite(y):
                if found is None or step < found[0]:
                    found = (step, key, x, y)
                break
    return found


def _logged_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _value(setup: dict, dotted: str):
    """The value of ``section.option`` in a setup (every setup has every section; no option's name
    holds a dot)."""
    section, key = dotted.split(".")
    return setup[section].get(key)


def _same_training(a: RunRecord, b: RunRecord, split: list[str]) -> Comparison:
    cut = [d for d in split if d != "run.val_windows"]
    how = (
        f"the batch is split differently ({', '.join(f'{d} {_value(a.setup, d)} vs {_value(b.setup, d)}' for d in cut)})"
        if cut
        else "the same setup"
    )
    lines = [
        f"same seed ({a.seed}), data and recipe; {how}: each step sees the same windows, so the curves must agree "
        f"to floating-point rounding (relative {FP_TOLERANCE:g})"
    ]
    keys = list(SAME_TRAINING_KEYS)
    if a.val_windows == b.val_windows:
        keys.append("val_loss")
    else:
        lines.append(
            f"val_loss not compared: the validation sets differ ({a.val_windows} vs {b.val_windows} windows); "
            f"give both the same --eval-windows"
        )
    parting, drift_from = find_parting(a.rows, b.rows, keys)
    if parting is not None:
        step, key, x, y, d = parting
        lines.append(
            f"they part at step {step}: {key} {x:.6g} vs {y:.6g} ({d:.1e} relative, {x / y if y else math.inf:.3g}x), "
            f"against a rounding tolerance of {FP_TOLERANCE:g}, with no drift before it"
        )
        return Comparison("same_training", False, lines, parted_at=step)
    if drift_from is None:
        n = len(common_rows(a.rows, b.rows, "loss"))
        lines.append(f"agree at every common logged step ({n}) within {FP_TOLERANCE:g}")
        return Comparison("same_training", True, lines)
    lines.append(
        f"agree to rounding until step {drift_from}, where their rounding differences, growing step by step, "
        f"pass {FP_TOLERANCE:g}: from there on they are compared as two seeds are"
    )
    rest = _seeds(a, b, after=drift_from)
    return Comparison("same_training", rest.agree, lines + rest.lines[1:], rest.parted_at)


def find_parting(rows_a: list[dict], rows_b: list[dict], keys) -> tuple[tuple | None, int | None]:
    """Where two runs of the same training stop agreeing to rounding: ``(parting, drift_from)``.
    ``parting`` is (step, key, a, b, relative difference) for the first jump past ``FP_TOLERANCE``
    with no drift before it; ``drift_from`` the first step where a difference that had been
    growing (already ``DRIFT`` at the previous logged step) passes it: rounding, amplified."""
    parting, drift_from = None, None
    for key in keys:
        previous = 0.0
        for step, x, y in common_rows(rows_a, rows_b, key):
            d = relative(x, y)
            if d > FP_TOLERANCE:
                if previous >= DRIFT:  # grew from a drift: amplified rounding, not a parting
                    drift_from = step if drift_from is None else min(drift_from, step)
                elif parting is None or step < parting[0]:
                    parting = (step, key, x, y, d)
                break
            previous = d
    if parting is not None and drift_from is not None and drift_from < parting[0]:
        parting = None  # rounding had taken over before: later steps are judged as seeds
    return parting, drift_from


def _seeds(a: RunRecord, b: RunRecord, after: int = 0) -> Comparison:
    ref = find_reference(a.setup)
    lines = [f"different seeds ({a.seed}, {b.seed}) of the same setup: the curves must agree within seed noise"]
    if ref is not None:
        lines.append(f"tolerance: the width of the reference band of {ref.describe()} at each step")
        checks = [(key, band) for key, band in ref.bands.items() if key in ("loss", "val_loss", "grad_norm", "lr")]
        for key, band in sorted(checks, key=lambda kb: kb[0]):
            for step, x, y in common_rows(a.rows, b.rows, key):
                bounds = band.at(step)
                if step <= after or bounds is None:
                    continue
                width = bounds[1] - bounds[0]
                if abs(x - y) > width:
                    lines.append(
                        f"they differ at step {step}: {key} {x:.6g} vs {y:.6g}, more than the band's width {width:.4g}"
                    )
                    return Comparison("seeds", False, lines, parted_at=step)
        lines.append("agree within the band's width at every common step")
        return Comparison("seeds", True, lines)
    noise = _loss_noise(a.rows) + _loss_noise(b.rows)
    if not noise:
        raise NanolmError(
            f"too few logged training steps to estimate the seed noise (at least {MIN_NOISE_STEPS} "
            f"each); log more often (--log-every) or compare against a recognised recipe"
        )
    sigma = statistics.median(noise)
    tolerance = SEED_NOISE_SIGMAS * sigma * math.sqrt(2 / SMOOTHING)
    lines.append(
        f"tolerance: {tolerance:.3g} nats (no reference band for this setup; estimated from the runs: the "
        f"step-to-step scatter of their training loss, sigma {sigma:.3g}, for a mean over {SMOOTHING} logged "
        f"steps; {SEED_NOISE_SIGMAS:g} sigma)"
    )
    loss_a, loss_b = _smoothed(a.rows, after), _smoothed(b.rows, after)
    for step in sorted(set(loss_a) & set(loss_b)):
        if abs(loss_a[step] - loss_b[step]) > tolerance:
            lines.append(f"they differ at step {step}: mean training loss {loss_a[step]:.4f} vs {loss_b[step]:.4f}")
            return Comparison("seeds", False, lines, parted_at=step)
    if a.val_windows == b.val_windows:
        for step, x, y in common_rows(a.rows, b.rows, "val_loss"):
            if step > max(after, 0) and abs(x - y) > tolerance:
                lines.append(f"they differ at step {step}: val_loss {x:.4f} vs {y:.4f}")
                return Comparison("seeds", False, lines, parted_at=step)
    lines.append("agree within that tolerance at every common step")
    return Comparison("seeds", True, lines)


def _loss_noise(rows: list[dict]) -> list[float]:
    """The training loss's step-to-step scatter, from the second half of the run (where the
    trend is slow): 1.48 x the median absolute successive difference / sqrt 2 per run."""
    losses = [r["loss"] for r in rows if _number(r.get("loss"))]
    if len(losses) < MIN_NOISE_STEPS:
        return []
    half = losses[len(losses) // 2 :]
    diffs = [abs(x - y) for x, y in zip(half, half[1:])]
    return [1.4826 * statistics.median(diffs) / math.sqrt(2)]


def _smoothed(rows: list[dict], after: int) -> dict[int, float]:
    points = [(r["step"], r["loss"]) for r in rows if _number(r.get("loss"))]
    out = {}
    for i in range(SMOOTHING - 1, len(points)):
        window = points[i - SMOOTHING + 1 : i + 1]
        if window[0][0] > after:
            out[window[-1][0]] = sum(v for _, v in window) / SMOOTHING
    return out


def format_comparison(path_a, path_b, result: Comparison) -> str:
    verdict = "they agree (exit 0)" if result.agree else "they differ (exit 1)"
    return "\n".join([f"compare {path_a} {path_b}", *result.lines, f"verdict: {verdict}"])
