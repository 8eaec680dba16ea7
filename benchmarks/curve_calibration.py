"""How often the curve test flags a healthy run, simulated end to end, against the 1 % it states.

The truth is a normal with the shipped default reference's covariances (its seeds' covariance
for the test among seeds; its reruns' covariance, three times wider so the rerun floor does not
decide, for the own-seed test). Each trial draws N seeds (or N reruns), builds the test from them
as ``tools/reference_bands.py`` does, and judges one more healthy run at every evaluation. The
threshold is simulated two ways: as nanolm does now (the whole test done on simulated seeds,
:func:`nanolm.watch.curve.max_t_threshold`), and as it did before 2026-12-06 (a multivariate t
with the looks' estimated correlation and one chi-square for all of them), which this script
keeps for the comparison.

    python benchmarks/curve_calibration.py                  # 4000 trials a row (~6 minutes on 2 cores)
    python benchmarks/curve_calibration.py --trials 1000
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanolm.watch import curve as C  # noqa: E402
from nanolm.watch.reference import shipped_references  # noqa: E402


def threshold_before(cov: np.ndarray, df: int, false_alarm: float, seed: int, samples: int) -> float:
    """The threshold as simulated before 2026-12-06: the looks' correlation from ``cov`` taken as
    exact, and one chi-square with ``df`` degrees of freedom shared by every look."""
    corr = C.prefix_correlation(cov)
    rng = np.random.default_rng(seed)
    values, vectors = np.linalg.eigh(corr)
    z = rng.standard_normal((samples, corr.shape[0])) @ (vectors * np.sqrt(np.clip(values, 0, None))).T
    scale = np.sqrt(rng.chisquare(df, size=samples) / df)
    return float(np.quantile(np.abs(z / scale[:, None]).max(axis=1), 1 - false_alarm))


def flagged(truth: np.ndarray, runs: int, trials: int, samples: int, paired: bool, before: bool) -> int:
    rng = np.random.default_rng(2026)
    k = truth.shape[0]
    centre = np.log(np.linspace(3.0, 2.0, k))
    root = np.linalg.cholesky(truth)
    steps = list(range(1, k + 1))
    count = 0
    for trial in range(trials):
        draws = rng.standard_normal((runs + 1, k)) @ root.T
        if paired:
            cov = C.floored(draws[:runs].T @ draws[:runs] / runs, C.RERUN_FLOOR)
            middle, inflation, df = centre, 0.0, runs
        else:
            cov = np.atleast_2d(np.cov(draws[:runs], rowvar=False, ddof=1))
            middle, inflation, df = centre + draws[:runs].mean(axis=0), 1 / runs, runs - 1
        threshold = (
            threshold_before(cov, df, C.FALSE_ALARM, trial, samples)
            if before
            else C.max_t_threshold(cov, runs, C.FALSE_ALARM, trial, samples, paired=paired)
        )
        values = dict(zip(steps, np.exp(centre + draws[runs]).tolist()))
        looks = C._looks("val_loss", steps, middle, cov, inflation, df, threshold, values)
        count += any(look.departs for look in looks)
    return count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=4000, help="healthy runs judged per row")
    p.add_argument("--samples", type=int, default=2000, help="simulated cases per threshold")
    args = p.parse_args()
    ref = next(r for r in shipped_references() if r.name == "default-fp32")
    seeds_truth, rerun_truth = np.array(ref.curve.cov_log), 9 * np.array(ref.seed_curves.rerun_cov)
    print(
        f"{'test':18s} {'N':>3s}  {'now':>14s}  {'before 2026-12-06':>18s}   (1 % stated; "
        f"binomial sd {100 * math.sqrt(0.01 * 0.99 / args.trials):.2f} %)"
    )
    rows = []
    for paired, truth, label in ((False, seeds_truth, "among seeds"), (True, rerun_truth, "own seed")):
        for runs in (5, 10, 20):
            now = flagged(truth, runs, args.trials, args.samples, paired, before=False) / args.trials
            old = flagged(truth, runs, args.trials, args.samples, paired, before=True) / args.trials
            rows.append({"test": label, "runs": runs, "now": now, "before": old})
            print(f"{label:18s} {runs:3d}  {100 * now:12.2f} %  {100 * old:16.2f} %", flush=True)
    print(json.dumps({"trials": args.trials, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
