"""How small a regression the reference catches, and how often it cries wolf on healthy runs.

A bug usually costs a few per cent of the loss, not a collapse: "it still trains, just worse".
This plants regressions of known kind in a copy of nanolm (or through a hidden ``--debug-*``
switch, which a run's setup does not count), trains the recipe under each with the seeds the
reference's curve was measured on, and judges every run as a real run is judged
(``nanolm.watch.reference``):

* **its own seed**: the run against its seed's own reference run, the test a run of one of the
  reference's seeds (the recipe's default seed among them) gets;
* **among seeds**: the run against the seeds' mean, the test a run of any other seed gets, here
  left-one-out (the curve rebuilt without the run's own seed, so the seed is new to it);
* **band**: the per-point band.

Each regression's cost is the final validation loss against the same seed's healthy run. Before
them, the size the tests see: healthy curves scaled up by 1 to 8 % at every evaluation (what a
bug costing that much shows; no training needed), judged each way. The
false alarms: healthy ``--held-out`` seeds the reference never saw (among seeds, band), and each
rerun of a reference seed judged against its own curve with the rerun differences rebuilt
without it (its own seed). Last, the smallest regression flagged in at least 95 % of seeds.

    python benchmarks/band_sensitivity.py --recipe quick --precision fp32 --jobs 2
    python benchmarks/band_sensitivity.py --recipe quick --precision bf16 --regressions lr_x0.9,corrupt_3pct

Runs are kept in ``--work`` (shared with ``tools/reference_bands.py``, whose runs of the
reference's seeds, reruns and held-out seeds it reuses) and reused, so a rerun only judges
again; ``--json FILE`` writes the figures. The regressions:

* ``lr_xF``: the learning rate of every step scaled by F (0.95, 0.9, 0.8, 0.5): a schedule bug.
* ``attention_tT``: attention logits divided by T (1.25, 2): a wrong softmax scale.
* ``corrupt_Ppct``: P % of the training tokens (one region) replaced by random ids: bad data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

from reference_bands import RECIPES, default_data_dir, parse_seeds, train, val_curve  # noqa: E402

from nanolm.watch.curve import curve_from_seeds, seed_curves_from_runs  # noqa: E402
from nanolm.watch.reference import curve_departure, departures, shipped_references  # noqa: E402
from nanolm.watch.sinks import read_metrics  # noqa: E402

STEP_LR = "    lr = setup.schedule(step) * (setup.guard.lr_scale if setup.guard is not None else 1.0)"
ROPE_QK = "        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v"


def _lr(factor: float):
    return ("nanolm/step.py", STEP_LR, STEP_LR.replace("lr = setup", f"lr = {factor} * setup"))


def _temperature(t: float):
    return ("nanolm/model.py", ROPE_QK, ROPE_QK.replace("apply_rope(q, cos, sin),", f"apply_rope(q / {t}, cos, sin),"))


REGRESSIONS = {  # name: (planted (file, correct, broken) or None, extra flags)
    "lr_x0.95": (_lr(0.95), ()),
    "lr_x0.9": (_lr(0.9), ()),
    "lr_x0.8": (_lr(0.8), ()),
    "lr_x0.5": (_lr(0.5), ()),
    "attention_t1.25": (_temperature(1.25), ()),
    "attention_t2": (_temperature(2), ()),
    "corrupt_3pct": (None, ("--debug-corrupt-data", "0.03")),
    "corrupt_10pct": (None, ("--debug-corrupt-data", "0.1")),
}


def planted_tree(tmp: Path, plant) -> Path:
    """A copy of the package, configs and data with one line changed (the recipes' paths are relative)."""
    copy = tmp / "nanolm_copy"
    for part in ("nanolm", "configs", "data"):
        shutil.copytree(ROOT / part, copy / part)
    if plant is not None:
        file, correct, broken = plant
        text = (copy / file).read_text()
        if text.count(correct) != 1:
            raise SystemExit(f"error: the line to plant is not found once in {file}; update {Path(__file__).name}")
        (copy / file).write_text(text.replace(correct, broken))
    return copy


def _flagged(looks) -> bool:
    return any(look.departs for look in looks)


SHIFTS = (0.01, 0.02, 0.03, 0.05, 0.08)


def _scaled(curve: dict[int, float], shift: float) -> dict[int, float]:
    """A validation curve ``shift`` higher at every evaluation after step 0."""
    return {step: value * (1 + shift) if step > 0 else value for step, value in curve.items()}


def _share(x) -> str:
    return "  n/a" if x is None else f"{x:4.0%}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="quick", choices=list(RECIPES))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--held-out", default="100-119", help="healthy seeds the reference never saw (false alarms)")
    p.add_argument(
        "--regressions", default=",".join(REGRESSIONS), help=f"comma-separated, of: {', '.join(REGRESSIONS)}"
    )
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "nanolm" / "reference_runs")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument(
        "--rerun-seeds",
        default="",
        help="the reference seeds whose reruns it judges (the reference's "
        "--reruns; default: every curve seed, none where the reference holds no seeds' own curves)",
    )
    p.add_argument("--jobs", type=int, default=1, help="trainings at once, one thread each")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    ref = next((r for r in shipped_references() if r.name == f"{args.recipe}-{args.precision}"), None)
    if ref is None or ref.curve is None:
        raise SystemExit(
            f"error: nanolm ships no reference {args.recipe}-{args.precision} with a curve test "
            f"(tools/reference_bands.py --curve-seeds ...)"
        )
    data_dir = (args.data_dir or default_data_dir()).resolve()
    seeds, held_out = ref.curve_seeds, parse_seeds(args.held_out)
    if set(held_out) & set(seeds):
        raise SystemExit("error: held-out seeds must be new to the reference")
    # a reference without its seeds' own curves (where reruns differ too much for them) judges every run among
    # seeds; --rerun-seeds then measures what the own-seed test would have done
    rerun_seeds = parse_seeds(args.rerun_seeds) if args.rerun_seeds else (seeds if ref.seed_curves is not None else [])
    if not set(rerun_seeds) <= set(seeds):
        raise SystemExit(
            "error: --rerun-seeds must be among the reference's curve seeds (a rerun is judged against "
            "its seed's first run)"
        )
    if rerun_seeds and len(rerun_seeds) < 6:
        raise SystemExit(
            "error: --rerun-seeds needs at least 6 seeds (each rerun is judged against the noise of the "
            "others, at least 5)"
        )
    regressions = [r for r in args.regressions.split(",") if r]
    unknown = [r for r in regressions if r not in REGRESSIONS]
    if unknown:
        raise SystemExit(f"error: unknown regression {unknown[0]!r}; of: {', '.join(REGRESSIONS)}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def healthy_run(seed, replicate=False):
        return train(args.recipe, args.precision, seed, args.work, data_dir, env=env, replicate=replicate)

    with ThreadPoolExecutor(args.jobs) as pool:
        firsts = dict(zip(seeds, pool.map(healthy_run, seeds)))
        held = list(pool.map(healthy_run, held_out))
    reruns = {s: healthy_run(s, replicate=True) for s in rerun_seeds}  # two threads each: one at a time
    curves = {s: val_curve(d) for s, d in firsts.items()}
    final = {s: c[max(c)] for s, c in curves.items()}

    # false alarms: held-out seeds among seeds and against the band; each rerun against its own curve, left-one-out
    held_rows = [read_metrics(d / "metrics.jsonl") for d in held]
    among_alarms = sum(_flagged(ref.curve.looks(val_curve(d))) for d in held)
    band_alarms = sum(bool(departures(ref, rows)) for rows in held_rows)
    own_alarms = 0
    for s in rerun_seeds:
        others = {k: val_curve(d) for k, d in reruns.items() if k != s}
        own = seed_curves_from_runs("val_loss", curves, others)
        own_alarms += _flagged(own.looks(s, val_curve(reruns[s])))
    report = {
        "reference": ref.name,
        "band_seeds": len(ref.seeds),
        "curve_seeds": len(seeds),
        "false_alarms": {
            "own_seed": [own_alarms, len(rerun_seeds)],
            "among_seeds": [among_alarms, len(held)],
            "band": [band_alarms, len(held)],
        },
        "regressions": {},
    }
    own_line = (
        f"own seed {own_alarms} of {len(rerun_seeds)} reruns (left-one-out)" if rerun_seeds else "no reruns judged"
    )
    if ref.seed_curves is None and rerun_seeds:
        own_line += " (the reference holds no own-seed test: what it would do)"
    print(
        f"{ref.name}: false alarms: {own_line}, among seeds {among_alarms} of {len(held)} held-out seeds, band "
        f"{band_alarms} of {len(held)}",
        flush=True,
    )

    # a loss X % higher at every evaluation, as a bug of that cost shows: healthy curves scaled, no training needed
    loo_own = {
        s: seed_curves_from_runs("val_loss", curves, {k: val_curve(d) for k, d in reruns.items() if k != s})
        for s in rerun_seeds
    }
    report["shifted"] = {}
    for shift in SHIFTS:
        own = sum(_flagged(loo_own[s].looks(s, _scaled(val_curve(reruns[s]), shift))) for s in rerun_seeds)
        own_share = own / len(rerun_seeds) if rerun_seeds else None
        among = sum(_flagged(ref.curve.looks(_scaled(val_curve(d), shift))) for d in held)
        band = sum(
            any(ref.bands["val_loss"].side(step, v) for step, v in _scaled(val_curve(d), shift).items()) for d in held
        )
        report["shifted"][f"{100 * shift:g}%"] = {
            "own_seed": own_share,
            "among_seeds": among / len(held),
            "val_loss_band": band / len(held),
        }
        print(
            f"val loss +{100 * shift:g} % at every evaluation: flagged own seed {_share(own_share)}  "
            f"among seeds {among / len(held):4.0%}  val_loss band {band / len(held):4.0%}",
            flush=True,
        )

    loo = {s: curve_from_seeds("val_loss", [c for k, c in curves.items() if k != s]) for s in seeds}
    for name in regressions:
        plant, flags = REGRESSIONS[name]
        with tempfile.TemporaryDirectory() as tmp:
            copy = planted_tree(Path(tmp), plant)
            planted_env = {**os.environ, "PYTHONPATH": str(copy)}
            with ThreadPoolExecutor(args.jobs) as pool:
                runs = dict(
                    zip(
                        seeds,
                        pool.map(
                            lambda s: train(
                                args.recipe,
                                args.precision,
                                s,
                                args.work / f"regression-{name}",
                                data_dir,
                                env=planted_env,
                                cwd=copy,
                                extra=flags,
                            ),
                            seeds,
                        ),
                    )
                )
        costs, own, among, band = [], 0, 0, 0
        for s, d in runs.items():
            rows, values = read_metrics(d / "metrics.jsonl"), val_curve(d)
            costs.append(100 * (values[max(values)] / final[s] - 1))
            look = curve_departure(ref, rows)  # the test the run gets: its own seed's
            own += look is not None and look.own_seed
            among += _flagged(loo[s].looks(values))
            band += bool(departures(ref, rows))
        n = len(runs)
        entry = {
            "final_val_loss_regression_percent": round(statistics.fmean(costs), 2),
            "regression_percent_range": [round(min(costs), 2), round(max(costs), 2)],
            "runs": n,
            "flagged_own_seed": round(own / n, 3) if ref.seed_curves is not None else None,
            "flagged_among_seeds": round(among / n, 3),
            "flagged_band": round(band / n, 3),
        }
        report["regressions"][name] = entry
        print(
            f"{name:16s} final val loss {entry['final_val_loss_regression_percent']:+6.2f} % "
            f"({min(costs):+.1f}..{max(costs):+.1f})   flagged: own seed {_share(entry['flagged_own_seed'])}  "
            f"among seeds {among / n:4.0%}  band {band / n:4.0%}  ({n} seeds)",
            flush=True,
        )
    for test in ("own_seed", "among_seeds"):
        caught = [
            (v["final_val_loss_regression_percent"], k)
            for k, v in report["regressions"].items()
            if (v[f"flagged_{test}"] or 0) >= 0.95 and v["final_val_loss_regression_percent"] > 0
        ]
        report[f"smallest_flagged_in_95_percent_{test}"] = min(caught) if caught else None
        print(
            f"smallest regression flagged in >= 95 % of seeds, {test.replace('_', ' ')}: "
            + (f"{min(caught)[0]:+.2f} % ({min(caught)[1]})" if caught else "none of those tried")
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
