"""The curve test: is this run's whole validation curve where healthy seeds put it?

The band (``nanolm.watch.reference``) judges one evaluation at a time, so it must be wide: a
seed lands anywhere between the seeds' extremes. A bug that costs a few per cent of the loss
stays inside it at every evaluation. Yet such a run sits above the seeds' mean at *every*
evaluation, and that is far less likely by chance than any one point: this module asks the
question of the curve as a whole.

**The statistic.** For each evaluation after step 0, the log of the run's validation loss
minus the mean of the seeds' logs at that step: how many per cent above (or below) the seeds'
mean the run is there. Their average over the evaluations so far is the run's *excess*
(``exp(excess) - 1`` is the "+6.1 %" of the log line). Not a plain average: healthy seeds agree
closely at some evaluations (at the end of a run with a decayed learning rate, within a few
tenths of a per cent) and wander apart at others (mid-run, by several per cent), and a
departure of 2 % means much where they agree and nothing where they do not. So each evaluation
is weighted by one over the seeds' standard deviation there: the test then adds the
evaluations' departures in units of the seeds' spread, each evaluation's z-score, as Stouffer's
method combines correlated tests; with equal spreads it is the plain average. (Weights of one
over the variance, the precision, lean harder on the last evaluations: measured, they see
smaller shifts on the default run and larger ones on the quick run, docs/benchmarks.md.)
Successive evaluations of one run are strongly correlated (a seed that starts high tends to stay
high), so averaging them does not shrink the noise as it would for independent points: the
excess's variance is taken from the seeds' own covariance of the evaluations, ``w' C w`` for the
weights ``w`` of the first ``k`` of them (summing to one), times ``1 + 1/N`` because the seeds'
mean is itself an estimate from ``N`` seeds. The excess over
its standard deviation is then a t statistic with ``N - 1`` degrees of freedom (a prediction
test: is a new draw from the same recipe this far out?), and "a healthy run is this far about
1 time in M" is its one-sided tail.

**Looking at every evaluation.** A run is judged at each of its evaluations, and a statistic
checked K times raises K chances of a false alarm. The threshold is therefore not the t
quantile of one look but that of the largest ``|t|`` over all the looks, for the correlation
the looks really have (the running averages share most of their terms) and for how little a
few seeds tell of their covariance: it is found by doing the whole test on simulated healthy
seeds and runs (:func:`max_t_threshold`). Healthy runs then cross it at any evaluation with the
stated probability (:data:`FALSE_ALARM`): ``tests/test_curve.py`` checks that by simulation, at
five seeds and at the shipped references' numbers, and ``benchmarks/band_sensitivity.py``
measures it on seeds the curve never saw.

**A seed the reference trained.** Seeds differ: one lands a few per cent above another, for
good (a better draw of initial weights and data order), so a bug of that size hides among seeds
whatever the statistic. The same seed trained twice does not: a rerun with its sums in another
order (another thread count, another CPU's kernels) ends within a few tenths of a per cent of
the first. So the reference keeps each of its seeds' own curves (:class:`SeedCurves`), and a run
of one of those seeds (the recipe's default among them) is compared with its own: the same test,
on the difference from its own curve, against the differences that reruns of the seeds show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FALSE_ALARM = 0.01
"""The share of healthy runs the curve test may flag, at any of their evaluations, either way."""
SIMULATED_CURVES = 200_000
CHUNK = 10_000
"""Simulated cases computed at a time (memory: a few times CHUNK x runs x evaluations numbers)."""


@dataclass
class Curve:
    """The seeds' validation curve as the test needs it: at each evaluation step after 0, the
    mean of the seeds' log values and their covariance; how many seeds; the threshold on |t|."""

    key: str
    steps: list[int]
    mean_log: list[float]
    cov_log: list[list[float]]
    seeds: int
    threshold: float
    false_alarm: float = FALSE_ALARM

    def looks(self, values: dict[int, float]) -> list["Look"]:
        """The test at each of the run's evaluations (``values``: step -> value), in order: the
        first k evaluations of the curve, for each k the run has reached without a gap."""
        return _looks(
            self.key,
            self.steps,
            self.mean_log,
            np.asarray(self.cov_log),
            1 / self.seeds,
            self.seeds - 1,
            self.threshold,
            values,
        )

    def widened(self, factor: float) -> "Curve":
        """The same test with every look's t divided by ``factor`` (the covariance times its square;
        the threshold, which depends on correlations alone, unchanged). For a reference whose
        seeds, all trained on one machine, agree closer than healthy runs on other CPUs do with
        them: ``factor`` is the root mean square of those runs' t, measured
        (``benchmarks/other_cpus.py``), so that their t is about 1 again."""
        cov = np.asarray(self.cov_log, dtype=np.float64) * factor**2
        return Curve(
            self.key,
            self.steps,
            self.mean_log,
            [[nine_figures(x) for x in row] for row in cov],
            self.seeds,
            self.threshold,
            self.false_alarm,
        )

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "steps": self.steps,
            "mean_log": self.mean_log,
            "cov_log": self.cov_log,
            "seeds": self.seeds,
            "threshold": self.threshold,
            "false_alarm": self.false_alarm,
        }


@dataclass
class SeedCurves:
    """Each of the reference's seeds' own curve (log values at ``steps``), and what a rerun of a
    seed differs from its first run by: the covariance of the log differences of ``reruns``
    pairs (their second moment: a rerun is the same run, its differences have no mean), each
    step's standard deviation at least :data:`RERUN_FLOOR`."""

    key: str
    steps: list[int]
    logs: dict[str, list[float]]
    rerun_cov: list[list[float]]
    reruns: int
    threshold: float
    false_alarm: float = FALSE_ALARM

    def looks(self, seed, values: dict[int, float]) -> list["Look"]:
        """The test at each evaluation of a run of ``seed`` (none for a seed the reference lacks)."""
        own = self.logs.get(str(seed))
        if own is None:
            return []
        return _looks(
            self.key,
            self.steps,
            own,
            np.asarray(self.rerun_cov),
            0.0,
            self.reruns,
            self.threshold,
            values,
            own_seed=True,
        )

    def with_floor(self, floor: float, seed: int = 0) -> "SeedCurves":
        """The same curves with each step's rerun noise at least ``floor`` and the threshold
        simulated again: what a new floor makes of a shipped reference, without its trainings."""
        cov = floored(np.asarray(self.rerun_cov, dtype=np.float64), floor)
        threshold = max_t_threshold(cov, self.reruns, self.false_alarm, seed, paired=True)
        return SeedCurves(
            self.key,
            self.steps,
            self.logs,
            [[nine_figures(x) for x in row] for row in cov],
            self.reruns,
            nine_figures(threshold),
            self.false_alarm,
        )

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "steps": self.steps,
            "logs": self.logs,
            "rerun_cov": self.rerun_cov,
            "reruns": self.reruns,
            "threshold": self.threshold,
            "false_alarm": self.false_alarm,
        }


RERUN_FLOOR = 0.004
"""The least standard deviation of a rerun's log difference at a step: 0.4 %. Reruns on one CPU
measure only another order of sums; another CPU's kernels round further (by about this much,
measured: docs/benchmarks.md, the shipped references on other CPUs), and the floor keeps the
test from calling that a bug."""


def floored(cov: np.ndarray, floor: float) -> np.ndarray:
    """``cov`` with each step's standard deviation raised to at least ``floor``, its correlations kept."""
    sd = np.sqrt(np.diag(cov))
    corr = cov / np.outer(np.maximum(sd, 1e-12), np.maximum(sd, 1e-12))
    np.fill_diagonal(corr, 1.0)
    at_least = np.maximum(sd, floor)
    return corr * np.outer(at_least, at_least)


def seed_curves_from_runs(
    key: str,
    firsts: dict[int, dict[int, float]],
    reruns: dict[int, dict[int, float]],
    false_alarm: float = FALSE_ALARM,
    seed: int = 0,
    samples: int = SIMULATED_CURVES,
) -> SeedCurves | None:
    """The seeds' own curves (``firsts``: seed -> {step: value}) and what their reruns
    (``reruns``, some of the same seeds) differ by; None with fewer than 5 reruns."""
    paired = [s for s in reruns if s in firsts]
    if len(paired) < 5:
        return None
    steps = sorted(set.intersection(*(set(firsts[s]) for s in firsts), *(set(reruns[s]) for s in paired)))
    steps = [t for t in steps if t > 0]
    if not steps:
        return None
    diffs = np.array([[math.log(reruns[s][t]) - math.log(firsts[s][t]) for t in steps] for s in paired])
    cov = floored(diffs.T @ diffs / len(paired), RERUN_FLOOR)
    threshold = max_t_threshold(cov, len(paired), false_alarm, seed, samples, paired=True)
    return SeedCurves(
        key,
        steps,
        {str(s): [nine_figures(math.log(firsts[s][t])) for t in steps] for s in sorted(firsts)},
        [[nine_figures(x) for x in row] for row in cov],
        len(paired),
        nine_figures(threshold),
        false_alarm,
    )


def _looks(
    key: str,
    steps: list[int],
    centre,
    cov: np.ndarray,
    inflation: float,
    df: int,
    threshold: float,
    values: dict[int, float],
    own_seed: bool = False,
) -> list["Look"]:
    """The running-mean test at each evaluation: the weighted mean (:func:`look_weights`) of
    log(value) - ``centre`` over the first k steps, over its standard deviation from ``cov``
    (times 1 + ``inflation``)."""
    weights = look_weights(cov)
    out, deltas = [], []
    for i, step in enumerate(steps):
        value = values.get(step)
        if value is None:
            break
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            deltas.append(math.inf)  # a non-finite loss is as far above as it gets
        else:
            deltas.append(math.log(value) - centre[i])
        w = weights[i, : i + 1]
        sd = math.sqrt(max(float(w @ cov[: i + 1, : i + 1] @ w), 1e-30) * (1 + inflation))
        excess = float(w @ np.array(deltas))  # +inf after a non-finite value: every weight is positive
        t = excess / sd
        out.append(Look(key, steps[0], step, excess, t, t_tail(abs(t), df), abs(t) > threshold, own_seed))
    return out


@dataclass
class Look:
    """The curve test after one evaluation: the run's mean excess over the seeds' mean since
    ``since`` (log ratio), its t statistic, how rare that is for a healthy run (one-sided), and
    whether it crosses the threshold."""

    key: str
    since: int
    step: int
    excess: float
    t: float
    tail: float
    departs: bool
    own_seed: bool = False  # judged against its own seed's reference run, not the seeds' mean

    @property
    def percent(self) -> float:
        return 100 * math.expm1(self.excess) if math.isfinite(self.excess) else math.inf

    @property
    def side(self) -> int:
        return (1 if self.t > 0 else -1) if self.departs else 0

    def one_in(self) -> str:
        """How often a healthy run is this far, as "1 in 2,300" (rounded to two figures)."""
        if self.tail <= 0:
            return "never"
        n = 1 / self.tail
        return f"1 in {_two_figures(n):,}" if n >= 2 else "1 in 2 or more often"

    @property
    def against(self) -> str:
        return "its seed's reference run" if self.own_seed else "the seeds' mean"

    def describe(self) -> str:
        where = "above" if self.excess > 0 else "below"
        healthy = "a rerun of that seed" if self.own_seed else "a healthy run"
        return (
            f"{self.key} {self.percent:+.1f} % {where} {self.against} since step {self.since} (through step "
            f"{self.step}); {healthy} is this far about {self.one_in()}"
        )


def _two_figures(n: float) -> int:
    if n >= 1e12:
        return int(1e12)
    digits = max(0, int(math.floor(math.log10(n))) - 1)
    return int(round(n / 10**digits) * 10**digits)


def curve_from_seeds(
    key: str,
    per_seed: list[dict[int, float]],
    false_alarm: float = FALSE_ALARM,
    seed: int = 0,
    samples: int = SIMULATED_CURVES,
) -> Curve | None:
    """The curve test for ``key`` from each seed's ``{step: value}``: the evaluations after step 0
    that every seed logged, finite and positive. None with fewer than 5 seeds or no evaluation.
    ``seed`` and ``samples``: the threshold's simulation (:func:`max_t_threshold`)."""
    steps = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    steps = [s for s in steps if s > 0 and all(0 < run[s] < math.inf for run in per_seed)]
    if len(per_seed) < 5 or not steps:
        return None
    logs = np.log(np.array([[run[s] for s in steps] for run in per_seed], dtype=np.float64))
    cov = np.atleast_2d(np.cov(logs, rowvar=False, ddof=1))
    threshold = max_t_threshold(cov, len(per_seed), false_alarm, seed, samples)
    return Curve(
        key,
        steps,
        [nine_figures(x) for x in logs.mean(axis=0)],
        [[nine_figures(x) for x in row] for row in cov],
        len(per_seed),
        nine_figures(threshold),
        false_alarm,
    )


SPREAD_FLOOR = 1e-6
"""The least standard deviation an evaluation's weight is computed from, so that seeds that
agree exactly at a step (none do) give a huge weight, not a division by zero."""


def look_weights(cov: np.ndarray) -> np.ndarray:
    """Row j: the weights of the first j + 1 evaluations in the test's look after them, each in
    proportion to one over its standard deviation (from the diagonal of ``cov``), summing to one."""
    rows = np.tril(np.ones(cov.shape)) / np.maximum(np.sqrt(np.diag(cov)), SPREAD_FLOOR)
    return rows / rows.sum(axis=1, keepdims=True)


def prefix_correlation(cov: np.ndarray) -> np.ndarray:
    """The correlation of the running means (first 1, 2, ... K evaluations, weighted by
    :func:`look_weights`) of a curve whose evaluations have covariance ``cov``: the looks the
    test takes, one per evaluation."""
    weights = look_weights(cov)
    prefix = weights @ cov @ weights.T
    sd = np.sqrt(np.maximum(np.diag(prefix), 1e-300))
    return prefix / np.outer(sd, sd)


def max_t_threshold(
    cov: np.ndarray,
    runs: int,
    false_alarm: float,
    seed: int = 0,
    samples: int = SIMULATED_CURVES,
    *,
    paired: bool = False,
) -> float:
    """The |t| that healthy runs exceed at any of their looks with probability ``false_alarm``.

    Found by doing the test itself, many times, on healthy runs drawn from a normal with
    covariance ``cov`` (a parametric bootstrap, with a fixed ``seed``: the same band file gives the
    same threshold): each time ``runs`` curves are drawn, the test's centre, covariance and
    weights are estimated from them exactly as from the real ones, and one more healthy curve is
    judged at every look; the threshold is the quantile of its largest |t|. ``paired``: the
    own-seed test, where the curves are reruns' differences from their first runs (no mean
    estimated); else the seeds' test (their mean and covariance, the new run's t scaled by
    1 + 1/``runs``). An own-seed covariance raised to :data:`RERUN_FLOOR` is simulated as if it
    were measured so: a floored step's spread then varies in the simulation, not in the test,
    which makes the threshold higher than the floor alone would need (fewer false alarms).

    Why not the simpler simulation (a multivariate t with the looks' estimated correlation and one
    chi-square for all of them, as before 2026-12-06): it takes the covariance that a few seeds
    estimate for exact, and every look's estimated variance for the same multiple of the true one:
    with few seeds, healthy runs crossed that threshold far more often than stated (measured in
    docs/benchmarks.md, "Calibration"; ``tests/test_curve.py``'s calibration tests hold it)."""
    cov = np.atleast_2d(np.asarray(cov, dtype=np.float64))
    k = cov.shape[0]
    values, vectors = np.linalg.eigh(cov)
    root = vectors * np.sqrt(np.clip(values, 0, None))
    rng = np.random.default_rng(seed)
    largest, done = [], 0
    while done < samples:
        n = min(CHUNK, samples - done)
        curves = rng.standard_normal((n, runs, k)) @ root.T
        new = rng.standard_normal((n, k)) @ root.T
        if paired:
            estimated = curves.transpose(0, 2, 1) @ curves / runs
            excess_of, inflation = new, 0.0
        else:
            centre = curves.mean(axis=1)
            spread = curves - centre[:, None, :]
            estimated = spread.transpose(0, 2, 1) @ spread / (runs - 1)
            excess_of, inflation = new - centre, 1 / runs
        sd = np.sqrt(np.einsum("nii->ni", estimated))
        weights = np.tril(np.ones((k, k)))[None] / np.maximum(sd, SPREAD_FLOOR)[:, None, :]
        weights = weights / weights.sum(axis=2, keepdims=True)
        excess = (weights @ excess_of[:, :, None])[:, :, 0]
        variance = ((weights @ estimated) * weights).sum(axis=2) * (1 + inflation)
        largest.append(np.abs(excess / np.sqrt(np.maximum(variance, 1e-30))).max(axis=1))
        done += n
    return float(np.quantile(np.concatenate(largest), 1 - false_alarm))


def t_tail(t: float, df: int) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom (t >= 0)."""
    if not math.isfinite(t):
        return 0.0
    return 0.5 * _incomplete_beta(df / 2, 0.5, df / (df + t * t))


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (modified
    Lentz), evaluated where it converges fast and mirrored elsewhere."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _incomplete_beta(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f / a


def nine_figures(x: float) -> float:
    """``x`` to nine significant figures: what the reference files store (readable, and far
    finer than any seed's spread)."""
    return float(f"{x:.9g}")
