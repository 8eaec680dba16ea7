"""How the shipped references judge healthy runs made on other CPUs: their false alarms.

A reference (``nanolm/watch/references/``) was measured on one machine. A user's run of the same
recipe on another CPU computes with other vectorised kernels and sums in another order, so even
its own seed's curve is not the reference's to the bit; the curve test allows for that through
the rerun differences and their floor (``RERUN_FLOOR`` in nanolm/watch/curve.py), the band
through its width. This measures whether that is enough: it trains healthy runs of a recipe
under each kernel path PyTorch can be told to use (``ATEN_CPU_CAPABILITY``: this CPU's own,
``avx2`` as on most laptops, ``default`` as on a CPU with neither) and another thread count,
judges each as a real run is judged (:func:`nanolm.watch.reference.curve_departure`: a seed the
reference trained against its own curve, any other against the seeds' mean; and the band), and
counts the alarms. All of them are false: every run is healthy.

    python benchmarks/other_cpus.py --recipe quick --precision fp32 --jobs 2
    python benchmarks/other_cpus.py --recipe default --precision fp32 --paths native,avx2 --threads 1 \\
        --own-seeds 1337,1,2 --new-seeds 100-102 --jobs 2

``closest`` is the largest |t| over the test's threshold among a setting's runs (1.0 is an alarm:
how far the healthy runs stay from one); ``rms t`` the root mean square of their last looks' t,
about 1 where the test's noise model fits them. A handful of runs cannot show a 1 % rate; the
rms says whether the noise the test assumes is the noise these runs have. Runs are kept in
``--work`` and reused.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

from golden import kernels_run_as  # noqa: E402
from reference_bands import default_data_dir, parse_seeds, train  # noqa: E402

from nanolm.watch.reference import curve_looks, departures, shipped_references  # noqa: E402
from nanolm.watch.sinks import read_metrics  # noqa: E402

PATHS = ("native", "avx2", "default")  # native: whatever this CPU runs when left alone


def judge(ref, out: Path) -> dict:
    """What the run's evaluation lines said of it: the curve test it got, and the band."""
    rows = read_metrics(out / "metrics.jsonl")
    looks = curve_looks(ref, rows)
    own = bool(looks) and looks[-1].own_seed
    threshold = (ref.seed_curves if own else ref.curve).threshold if looks else None
    return {
        "own_seed": own,
        "curve_alarm": any(look.departs for look in looks),
        "closest": max((abs(look.t) / threshold for look in looks), default=0.0) if looks else None,
        "last_t": looks[-1].t if looks else None,
        "band_alarm": bool(departures(ref, rows)),
    }


def rms(values) -> float:
    """Root mean square of the last looks' t: about 1 where the test's noise model fits the runs
    (its threshold, about 3.2, then holds the stated 1 % of false alarms), above 1 where it does not."""
    values = [v for v in values if v is not None]
    return round(math.sqrt(sum(v * v for v in values) / len(values)), 2) if values else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="quick", choices=("quick", "default"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated kernel paths, of: {', '.join(PATHS)}")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts each path is trained with")
    p.add_argument(
        "--own-seeds",
        default="1337,1-4",
        help="seeds the reference trained (judged against their own curves, where the reference holds them)",
    )
    p.add_argument("--new-seeds", default="100-104", help="seeds the reference never saw (judged among seeds)")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "nanolm" / "other_cpus")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--jobs", type=int, default=1, help="one-thread trainings at once")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    ref = next((r for r in shipped_references() if r.name == f"{args.recipe}-{args.precision}"), None)
    if ref is None:
        raise SystemExit(f"error: nanolm ships no reference {args.recipe}-{args.precision}")
    paths = [x for x in args.paths.split(",") if x]
    unknown = [x for x in paths if x not in PATHS]
    if unknown:
        raise SystemExit(f"error: unknown kernel path {unknown[0]!r}; of: {', '.join(PATHS)}")
    try:
        threads = [int(x) for x in args.threads.split(",") if x]
    except ValueError:
        raise SystemExit(f"error: --threads {args.threads!r}: write thread counts as 1,2") from None
    if not threads or min(threads) < 1:
        raise SystemExit("error: --threads needs at least one count of 1 or more")
    if args.jobs < 1:
        raise SystemExit("error: --jobs needs at least 1")
    own_seeds, new_seeds = parse_seeds(args.own_seeds), parse_seeds(args.new_seeds)
    if set(new_seeds) & set(ref.curve_seeds or ref.seeds):
        raise SystemExit("error: --new-seeds must be seeds the reference never trained")
    data_dir = (args.data_dir or default_data_dir()).resolve()
    print(
        f"{ref.name}: measured on {ref.machine} (torch {ref.torch}); judged here on {paths} x threads {threads}",
        flush=True,
    )

    report = {"reference": ref.name, "reference_machine": ref.machine, "settings": []}
    for path in paths:
        runs_as = kernels_run_as(None if path == "native" else path)
        for n in threads:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            env.pop("ATEN_CPU_CAPABILITY", None)
            if path != "native":
                env["ATEN_CPU_CAPABILITY"] = path
            work = args.work / f"{path}-threads{n}"

            def healthy(seed, work=work, env=env, n=n):
                return train(args.recipe, args.precision, seed, work, data_dir, env=env, extra=("--threads", str(n)))

            with ThreadPoolExecutor(args.jobs if n == 1 else 1) as pool:
                dirs = list(pool.map(healthy, own_seeds + new_seeds))
            verdicts = [judge(ref, d) for d in dirs]
            own = [v for v in verdicts if v["own_seed"]]
            among = [v for v in verdicts if not v["own_seed"]]
            row = {
                "path": path,
                "runs_as": runs_as,
                "threads": n,
                "own_seed": [sum(v["curve_alarm"] for v in own), len(own)],
                "among_seeds": [sum(v["curve_alarm"] for v in among), len(among)],
                "band": [sum(v["band_alarm"] for v in verdicts), len(verdicts)],
                "closest_own": round(max((v["closest"] for v in own), default=0.0), 3),
                "closest_among": round(max((v["closest"] for v in among if v["closest"] is not None), default=0.0), 3),
                "rms_t_own": rms(v["last_t"] for v in own),
                "rms_t_among": rms(v["last_t"] for v in among),
            }
            report["settings"].append(row)
            print(
                f"{path:8s} ({runs_as}) threads {n}: false alarms own seed {row['own_seed'][0]}/{row['own_seed'][1]} "
                f"(closest {row['closest_own']:.2f}, rms t {row['rms_t_own']:.2f}), among seeds "
                f"{row['among_seeds'][0]}/{row['among_seeds'][1]} (closest {row['closest_among']:.2f}, rms t "
                f"{row['rms_t_among']:.2f}), band {row['band'][0]}/{row['band'][1]}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
