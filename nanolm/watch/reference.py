"""Reference curves: is this run normal?

A loss curve on its own answers nothing: "is 1.47 at step 1,000 good?" depends on the data,
the model, the recipe and luck. What answers it is the same recipe trained with several
seeds: where those runs went, step by step, is the *band* a healthy run of that recipe stays
in, and a run that leaves it has something that differs from the recipe (a setting, the
data, or a bug) rather than bad luck.

nanolm ships bands for its own recipes (``nanolm/watch/references/*.json``, one file per recipe and
number format, each with the command and the machine that measured it; ``python
tools/reference_bands.py`` regenerates them). A run is *recognised* when everything that
shapes its training equals a reference's: the configuration (without the seed, where it
writes, what it logs and how many threads it uses), the prepared data (byte for byte: the
digest of its manifest) and the number format. A run that is not recognised is told so once
and judged by nothing: a band measured on another setup would raise false alarms.

**The band.** At each logged step and for each number (training loss, learning rate,
gradient norm, share of clipped steps, validation loss and bits per byte, each group's
update/weight ratio), the seeds' lowest and highest values, widened on both sides by three
times their spread (and by at least a small share of the value: some numbers agree across
seeds to four digits). Five seeds' extremes alone would leave a sixth seed outside at one
point in three, and five seeds' spread is itself a rough estimate (a seed that lands far
from the others is common enough), so the widening is generous; how generous was chosen
by cross-validating healthy seeds (docs/benchmarks.md has the measurement).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..batches import DEFAULT_EVAL_WINDOWS
from .curve import Curve, Look, SeedCurves, nine_figures

REFERENCE_DIR = Path(__file__).resolve().parent / "references"
FORMAT = 1

NOT_COUNTED = {
    # what does not change the numbers a run trains through: the seed (the band is over seeds),
    # where it writes and reads from (the data itself is counted, by its digest), what it logs
    # and when, how fast it runs, and when it stops early
    "train": {
        "seed",
        "out_dir",
        "log",
        "log_every",
        "stats_every",
        "progress",
        "threads",
        "process_tuning",
        "resume",
        "keep",
        "ckpt_every",
        "eval_every",
        "eval_at_start",
        "sample_tokens",
        "peak_flops",
        "target_val_bpb",
        "device",
        "deterministic",
        "tf32",
        "dist",
        "eval_batches",
        "eval_windows",  # as run.val_windows
        "precision",
    },  # as run.precision, what it resolved to: "auto" and "fp32" are one format on such a CPU
    "data": {"data"},
    "model": {"loss_chunk"},  # how the head and loss are computed, not what
}
SECTIONS_NOT_COUNTED = (
    "guard",
    "debug",
)  # the guard acts only on trouble; debug switches are bugs, which bands exist to catch

TRAIN_METRICS = ("loss", "lr", "grad_norm", "clipped_frac")
EVAL_METRICS = ("val_loss", "val_bpb")
GROUP_METRICS = ("update_ratio/",)  # one band per group of layers

# the least half-width a band gets, relative to the seeds' largest value in size (the learning rate
# is a function of the step: any difference is a different schedule), and absolute for shares in [0, 1]
RELATIVE_FLOOR = {"lr": 1e-6, "loss": 0.005, "val_loss": 0.002, "val_bpb": 0.002, "grad_norm": 0.02}
ABSOLUTE_FLOOR = {"clipped_frac": 0.1}  # a running share of clipped steps moves by 1/step per clipped step
WIDEN = 3.0  # the seeds' extremes are widened on each side by this many times their spread
GROUP_RELATIVE_FLOOR = 0.02


def banded(key: str) -> bool:
    return key in TRAIN_METRICS or key in EVAL_METRICS or key.startswith(GROUP_METRICS)


def setup_of(cfg, data_digest: str, precision: str, device_type: str, world_size: int) -> dict:
    """What a run's training depends on, as one plain dict: equal dicts train alike up to the seed.
    The validation set counts by its size in windows (``--eval-windows``), however it was asked for."""
    setup = {}
    for section, options in cfg.to_dict().items():
        if section in SECTIONS_NOT_COUNTED:
            continue
        skip = NOT_COUNTED.get(section, set())
        setup[section] = {k: v for k, v in options.items() if k not in skip}
    if setup["train"].get("time_budget", 0) is None:  # no budget: the setup of every fixed-step run before budgets
        del setup["train"]["time_budget"]
    t = cfg.train
    setup["run"] = {
        "data_digest": data_digest,
        "precision": precision,
        "device_type": device_type,
        "world_size": world_size,
        "val_windows": t.eval_windows or DEFAULT_EVAL_WINDOWS,
    }
    return setup


def setup_digest(setup: dict) -> str:
    return hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:16]


def differences(a: dict, b: dict) -> list[str]:
    """The options in which two setups differ, as ``section.option``."""
    return sorted(
        f"{s}.{k}"
        for s in set(a) | set(b)
        for k in set(a.get(s, {})) | set(b.get(s, {}))
        if a.get(s, {}).get(k) != b.get(s, {}).get(k)
    )


@dataclass
class Band:
    """One number's band: at each step of ``steps``, healthy runs lay in ``[lo, hi]``; ``mid``
    is the seeds' median."""

    steps: list[int]
    lo: list[float]
    mid: list[float]
    hi: list[float]

    def at(self, step: int) -> tuple[float, float] | None:
        try:
            i = self.steps.index(step)
        except ValueError:
            return None
        return self.lo[i], self.hi[i]

    def side(self, step: int, value: float) -> int | None:
        """-1 below the band, 0 inside, +1 above, None where the band has no value at this step."""
        bounds = self.at(step)
        if bounds is None or value is None:
            return None
        lo, hi = bounds
        if not math.isfinite(value):
            return 1
        return -1 if value < lo else 1 if value > hi else 0


def band_from_seeds(key: str, per_seed: list[dict[int, float]]) -> Band | None:
    """The band of one number from each seed's ``{step: value}``: at each step all seeds
    logged, their extremes widened by their spread (at least the number's floor)."""
    steps = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    steps = [s for s in steps if all(math.isfinite(run[s]) for run in per_seed)]
    if len(per_seed) < 2 or not steps:
        return None
    lo, mid, hi = [], [], []
    for step in steps:
        values = sorted(run[step] for run in per_seed)
        median = (
            values[len(values) // 2]
            if len(values) % 2
            else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
        )
        spread = values[-1] - values[0]
        # the floor is a share of the seeds' largest size, not of their median: a seed added below
        # the others moves the median down, and a band must never narrow when a seed is added
        size = max(abs(values[0]), abs(values[-1]))
        floor = (GROUP_RELATIVE_FLOOR if key.startswith(GROUP_METRICS) else RELATIVE_FLOOR.get(key, 0.0)) * size
        widen = max(WIDEN * spread, floor, ABSOLUTE_FLOOR.get(key, 0.0))
        lo.append(_round(values[0] - widen, -1))
        mid.append(_round(median))
        hi.append(_round(values[-1] + widen, +1))
    return Band(steps, lo, mid, hi)


def _round(x: float, outward: int = 0) -> float:
    """``x`` to nine significant figures (the reference files stay readable); an edge of a band
    rounded ``outward`` (-1 down, +1 up), so that rounding never leaves one of its own seeds outside."""
    r = nine_figures(x)
    if not outward or not math.isfinite(x) or (r - x) * outward >= 0:
        return r
    return nine_figures(r + outward * 10.0 ** (math.floor(math.log10(abs(x))) - 8))


def bands_from_runs(runs: list[list[dict]]) -> dict[str, Band]:
    """Every banded number's band, from each seed's metrics rows."""
    keys = sorted({k for rows in runs for row in rows for k in row if banded(k)})
    bands = {}
    for key in keys:
        per_seed = [{r["step"]: float(r[key]) for r in rows if isinstance(r.get(key), (int, float))} for rows in runs]
        band = band_from_seeds(key, per_seed)
        if band is not None:
            bands[key] = band
    return bands


@dataclass
class Reference:
    """A recipe's band, as shipped: which setup it is for, how it was measured, the bands."""

    name: str
    title: str
    command: str
    precision: str
    seeds: list[int]
    machine: str
    date: str
    torch: str
    setup: dict
    bands: dict[str, Band]
    regenerate: str = ""  # the command that measures this band again
    curve: Curve | None = None  # the curve test of the validation loss (``nanolm.watch.curve``), over curve_seeds
    curve_seeds: list[int] = dataclasses.field(default_factory=list)
    seed_curves: SeedCurves | None = None  # each curve seed's own curve, for a run of that seed

    @property
    def digest(self) -> str:
        return setup_digest(self.setup)

    def describe(self) -> str:
        curve = f", its curve over {len(self.curve_seeds)}" if self.curve is not None else ""
        return (
            f"{self.title} ({self.precision}, band over {len(self.seeds)} seeds{curve}, measured {self.date} on "
            f"{self.machine})"
        )

    def to_json(self) -> dict:
        out = {
            "format": FORMAT,
            **{
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if f.name not in ("bands", "curve", "seed_curves")
            },
        }
        out["bands"] = {k: dataclasses.asdict(b) for k, b in sorted(self.bands.items())}
        for name in ("curve", "seed_curves"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).to_json()
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Reference":
        if data.get("format") != FORMAT:
            raise ValueError(f"reference format {data.get('format')!r}, expected {FORMAT}")
        fields = {
            f.name: data[f.name]
            for f in dataclasses.fields(cls)
            if f.name not in ("bands", "curve", "seed_curves") and f.name in data
        }  # later fields may be absent
        return cls(
            **fields,
            bands={k: Band(**b) for k, b in data["bands"].items()},
            curve=Curve(**data["curve"]) if data.get("curve") else None,
            seed_curves=SeedCurves(**data["seed_curves"]) if data.get("seed_curves") else None,
        )


def shipped_references(directory=None) -> tuple[Reference, ...]:
    """The references in ``directory`` (default: the package's own, ``REFERENCE_DIR``)."""
    return _read_references(str(directory or REFERENCE_DIR))


@lru_cache(maxsize=None)
def _read_references(directory: str) -> tuple[Reference, ...]:
    return tuple(
        Reference.from_json(json.loads(path.read_text(encoding="utf-8")))
        for path in sorted(Path(directory).glob("*.json"))
    )


def find_reference(setup: dict, references=None) -> Reference | None:
    """The reference whose setup is ``setup`` (default: among the shipped ones), or None."""
    return reference_for_digest(setup_digest(setup), references)


def reference_for_digest(digest: str | None, references=None) -> Reference | None:
    """The reference of a run that recorded ``digest`` (its step-0 row's ``setup_digest``)."""
    refs = shipped_references() if references is None else references
    return next((ref for ref in refs if ref.digest == digest), None) if digest else None


def closest_reference(setup: dict, references=None) -> tuple[Reference, list[str]] | None:
    """The shipped reference on the same data and number format that differs from ``setup`` in
    the fewest options (at most three), and those options: "my numbers differ from the
    README's" is most often one changed flag."""
    run = setup["run"]
    candidates = []
    for ref in shipped_references() if references is None else references:
        if ref.setup["run"] != run:
            continue
        diff = differences(ref.setup, setup)
        if len(diff) <= 3:
            candidates.append((len(diff), ref.name, ref, diff))
    if not candidates:
        return None
    _, _, ref, diff = min(candidates, key=lambda c: c[:2])
    return ref, diff


def no_reference_line(setup: dict, references=None) -> str:
    near = closest_reference(setup, references)
    line = "reference: none for this setup (nanolm ships reference curves for its own recipes); no band is checked"
    if near is not None:
        ref, diff = near
        line += f"; the closest, {ref.title} ({ref.precision}), differs in {', '.join(diff)}"
    return line


@dataclass
class Departure:
    """A number outside its band: from ``step`` (where it left) to ``until`` (the last step seen outside)."""

    key: str
    step: int
    value: float
    lo: float
    hi: float
    side: int
    until: int

    def describe(self) -> str:
        where = "above" if self.side > 0 else "below"
        return (
            f"{self.key} {where} its band from step {self.step} ({self.value:.4g} against {self.lo:.4g}..{self.hi:.4g})"
        )


# a training number must stay outside for this many logged steps in a row to count: one noisy
# batch is not a departure; an evaluation (the same fixed set every time) counts at once
PERSISTENCE = 2


def departures(reference: Reference, rows: list[dict]) -> list[Departure]:
    """Each banded number's first lasting departure from ``reference`` in a run's rows, earliest first."""
    found = []
    for key, band in reference.bands.items():
        need = 1 if key in EVAL_METRICS or key == "lr" else PERSISTENCE
        streak: list[tuple[int, float, int]] = []
        for row in rows:
            value = row.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            side = band.side(row["step"], float(value))
            if side is None:
                continue
            if side != 0 and (not streak or streak[-1][2] == side):
                streak.append((row["step"], float(value), side))
            else:
                if len(streak) >= need:
                    break
                streak = [(row["step"], float(value), side)] if side != 0 else []
        if len(streak) >= need:
            step, value, side = streak[0]
            lo, hi = band.at(step)
            found.append(Departure(key, step, value, lo, hi, side, streak[-1][0]))
    return sorted(found, key=lambda d: (d.step, d.key not in EVAL_METRICS, d.key))


def curve_looks(reference: Reference, rows: list[dict], seed=None) -> list[Look]:
    """The curve test at each of a run's evaluations: against its seed's own reference run when
    the reference trained that seed (``seed``, else the one the step-0 row records), else against
    the seeds' mean; none without a curve in the reference."""
    if seed is None and rows and rows[0].get("step") == 0:
        seed = rows[0].get("seed")
    key = reference.curve.key if reference.curve is not None else "val_loss"
    values = {row["step"]: row[key] for row in rows if isinstance(row.get(key), (int, float))}
    if reference.seed_curves is not None and seed is not None:
        own = reference.seed_curves.looks(seed, values)
        if own:
            return own
    return reference.curve.looks(values) if reference.curve is not None else []


def population_look(reference: Reference, rows: list[dict]) -> Look | None:
    """The run's last look against the seeds' mean, whatever its seed (None without a curve)."""
    looks = curve_looks(reference, rows, seed=_NO_SEED)
    return looks[-1] if looks else None


_NO_SEED = object()  # a seed no reference trained: the test against the seeds' mean


def curve_departure(reference: Reference, rows: list[dict]) -> Look | None:
    """The latest evaluation at which the run's curve departs from the seeds' (the one with the
    most evaluations behind it; the test's threshold holds its false-alarm rate over all the
    looks), or None."""
    return next((look for look in reversed(curve_looks(reference, rows)) if look.departs), None)


class BandWatch:
    """What the evaluation line says of the validation loss against a recognised run's band:
    inside it, or above or below it since which evaluation; and, where the reference has a curve,
    how far the run's curve is from the seeds' mean since its first evaluation and how rare that
    is. The state is rebuilt from the rows already in ``metrics.jsonl`` when a run resumes."""

    KEY = "val_loss"

    def __init__(self, reference: Reference, seed: int | None = None):
        self.reference, self.band, self.seed = reference, reference.bands.get(self.KEY), seed
        self.side, self.since = 0, None
        self.values: dict[int, float] = {}

    def resume(self, rows: list[dict]) -> None:
        self.side, self.since, self.values = 0, None, {}
        for row in rows:
            if self.KEY in row:
                self.update(row["step"], row[self.KEY])

    def update(self, step: int, value: float) -> dict:
        """The row's band keys for this evaluation ({} where the band has no value at this step)."""
        self.values[step] = value
        out = self._curve_keys(step)
        side = self.band.side(step, value) if self.band is not None else None
        if side is None:
            return out
        if side != self.side:
            self.side, self.since = side, (step if side != 0 else None)
        lo, hi = self.band.at(step)
        out.update(val_band_lo=lo, val_band_hi=hi, val_band_side=side)
        if self.since is not None:
            out["val_band_since"] = self.since
        return out

    def _curve_keys(self, step: int) -> dict:
        looks = curve_looks(
            self.reference, [{"step": s, self.KEY: v} for s, v in sorted(self.values.items())], self.seed
        )
        if not looks or looks[-1].step != step:
            return {}
        look = looks[-1]
        return {
            "val_curve_since": look.since,
            "val_curve_excess": look.excess,
            "val_curve_t": look.t,
            "val_curve_tail": look.tail,
            "val_curve_side": look.side,
            "val_curve_own_seed": int(look.own_seed),
        }


def format_band(row: dict) -> str:
    """The evaluation line's verdict: `` | band 0.27..0.29 inside`` or ``... above since step 200``,
    then the curve's: `` | +1.2 % vs seeds`` or `` | +6.1 % above the seeds' mean since step 100, a
    healthy run 1 in 2,300``."""
    text = ""
    if "val_band_side" in row:
        text = f" | band {row['val_band_lo']:.4f}..{row['val_band_hi']:.4f} "
        side = row["val_band_side"]
        text += "inside" if side == 0 else f"{'above' if side > 0 else 'below'} since step {row['val_band_since']}"
    if "val_curve_excess" in row:
        look = Look(
            "val_loss",
            row["val_curve_since"],
            row["step"],
            row["val_curve_excess"],
            row["val_curve_t"],
            row["val_curve_tail"],
            row["val_curve_side"] != 0,
            bool(row.get("val_curve_own_seed")),
        )
        if look.departs:
            where = "above" if look.excess > 0 else "below"
            text += (
                f" | {look.percent:+.1f} % {where} {look.against} since step {look.since}, "
                f"{'a rerun' if look.own_seed else 'a healthy run'} {look.one_in()}"
            )
        else:
            text += f" | {look.percent:+.1f} % vs {'its seed' if look.own_seed else 'seeds'}"
    return text
