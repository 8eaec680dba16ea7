"""Measure the reference bands nanolm ships: each recipe, several seeds, each CPU number format.

For every recipe (the quick run, the default ``nanolm train``, each ``configs/*.toml`` on the
data it names, both speedrun tracks) and number format, this trains the recipe once per seed
exactly as a user would run it (only the seed, the output directory, the thread count and the
sample at the end differ, none of which the band counts), then writes
``nanolm/watch/references/<recipe>-<format>.json``: the runs' shared setup (checked equal across
seeds), the band of every logged number over ``--seeds`` (``nanolm.watch.reference``), the curve
test of the validation loss over ``--curve-seeds`` where given (``nanolm.watch.curve``: 20 or more
seeds make it trustworthy), the command, the machine and the date.

    python tools/reference_bands.py --data-dir ../shared/data                      # every recipe, fp32
    python tools/reference_bands.py --recipes quick --precisions fp32,bf16 --jobs 2 --curve-seeds 1337,1-19
    python tools/reference_bands.py --recipes quick --seeds 11,12,13,14,15 --check  # false alarms: judge new seeds, write nothing
    python tools/reference_bands.py --recipes quick --seeds 11 --check --plants lr_one_step_late,betas_swapped
                                    # planted silent bugs (tools/silent_bugs.py), each trained once: does it leave the band?

Runs are kept in ``--work`` (one directory per recipe, format and seed) and reused when
finished, so an interrupted measurement continues where it stopped. ``--jobs 2`` runs two
trainings at once, one thread each (on 2 cores, the fastest way through many small runs).
bf16 on a CPU without bf16 units is emulated: ~9x slower than fp32 there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from nanolm.instruments.compare import recorded_run  # noqa: E402
from nanolm.run.config import load_run_config  # noqa: E402
from nanolm.watch.curve import curve_from_seeds, seed_curves_from_runs  # noqa: E402
from nanolm.watch.reference import (  # noqa: E402
    REFERENCE_DIR,
    Reference,
    bands_from_runs,
    curve_departure,
    departures,
    setup_digest,
    setup_of,
)
from nanolm.watch.sinks import read_metrics  # noqa: E402

# name: (title, the command's arguments after `nanolm train`, the data files it needs in --data-dir)
RECIPES = {
    "quick": ("the quick run", "--data data/toy.txt --steps 300 --vocab-size 400 --lr 3e-3", ()),
    "default": ("the default nanolm train", "", ()),
    "shakespeare_char": (
        "configs/shakespeare_char.toml",
        "--config configs/shakespeare_char.toml --data {data_dir}/tinyshakespeare.txt",
        ("tinyshakespeare.txt",),
    ),
    "shakespeare_bpe": (
        "configs/shakespeare_bpe.toml",
        "--config configs/shakespeare_bpe.toml --data {data_dir}/tinyshakespeare.txt",
        ("tinyshakespeare.txt",),
    ),
    "tinystories": (
        "configs/tinystories.toml",
        "--config configs/tinystories.toml --data {data_dir}/TinyStoriesV2-GPT4-valid.txt",
        ("TinyStoriesV2-GPT4-valid.txt",),
    ),
    "speedrun_shakespeare": (
        "the CPU speedrun, shakespeare track (configs/speedrun_cpu.toml)",
        "--config configs/speedrun_cpu.toml --data {data_dir}/tinyshakespeare.txt",
        ("tinyshakespeare.txt",),
    ),
    "speedrun_tinystories": (
        "the CPU speedrun, TinyStories track (configs/speedrun_tinystories.toml)",
        "--config configs/speedrun_tinystories.toml --data {data_dir}/tinystories_sample.txt",
        ("tinystories_sample.txt",),
    ),
    "tinystories_60s": (
        "TinyStories in 60 seconds (configs/tinystories_60s.toml)",
        "--config configs/tinystories_60s.toml --time-budget off --steps 700 --data {data_dir}/tinystories_sample.txt",
        ("tinystories_sample.txt",),
    ),
    "tinystories_5min": (
        "TinyStories in 5 minutes (configs/tinystories_5min.toml)",
        "--config configs/tinystories_5min.toml --time-budget off --steps 1500 --data {data_dir}/tinystories_sample.txt",
        ("tinystories_sample.txt",),
    ),
}
SEEDS = (1337, 1, 2, 3, 4)  # the recipes' own default seed and four more
NOT_COUNTED_FLAGS = "--threads 1 --progress lines --sample-tokens 0"


def default_data_dir() -> Path:
    from nanolm.data.download import cache_dir

    return cache_dir()


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.backends.cpu.get_cpu_capability()}"


REPLICATE_THREADS = 2
"""A replicate run is the same seed trained with this many threads: its sums in another order."""


def run_dir(work: Path, recipe: str, precision: str, seed: int, replicate: bool = False) -> Path:
    return work / recipe / precision / (f"seed-{seed}-threads{REPLICATE_THREADS}" if replicate else f"seed-{seed}")


def train(
    recipe: str,
    precision: str,
    seed: int,
    work: Path,
    data_dir: Path,
    python: str = sys.executable,
    env=None,
    cwd: Path = ROOT,
    extra: tuple[str, ...] = (),
    replicate: bool = False,
) -> Path:
    """One training run of the recipe (skipped when already finished); returns its directory.
    ``extra``: flags a run's setup does not count (the hidden ``--debug-*`` faults); ``replicate``:
    the same seed once more, with :data:`REPLICATE_THREADS` threads."""
    out = run_dir(work, recipe, precision, seed, replicate)
    if replicate:
        extra = (*extra, "--threads", str(REPLICATE_THREADS))
    if (out / "final.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    args = RECIPES[recipe][1].format(data_dir=data_dir)
    cmd = [
        python,
        "-m",
        "nanolm.train",
        *shlex.split(args),
        "--seed",
        str(seed),
        "--precision",
        precision,
        "--out-dir",
        str(out),
        *shlex.split(NOT_COUNTED_FLAGS),
        *extra,
    ]
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        result = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed (exit {result.returncode}); see {out.parent}/{out.name}.log")
    print(f"  {recipe} {precision} {out.name}: {time.perf_counter() - start:.0f} s", flush=True)
    return out


def run_setup(out: Path) -> dict:
    """The setup of a finished run, derived from its directory (its configuration, its data's
    digest, the number format its step-0 row records)."""
    cfg = load_run_config(out / "config.toml")
    return setup_of(cfg, *recorded_run(out, cfg, read_metrics(out / "metrics.jsonl")[0]))


def val_curve(out: Path) -> dict[int, float]:
    return {
        r["step"]: float(r["val_loss"])
        for r in read_metrics(out / "metrics.jsonl")
        if isinstance(r.get("val_loss"), (int, float))
    }


def build(
    recipe: str, precision: str, dirs: list[Path], curve_dirs: list[Path], rerun_dirs: dict[int, Path] | None = None
) -> Reference:
    setups = [run_setup(d) for d in dirs + curve_dirs]
    if any(s != setups[0] for s in setups[1:]):
        raise SystemExit(f"error: the {recipe} {precision} runs do not share one setup; remove {dirs[0].parent}")
    runs = [read_metrics(d / "metrics.jsonl") for d in dirs]
    import torch

    command = f"nanolm train {RECIPES[recipe][1]}".strip().replace("{data_dir}/", "")

    def seed_of(d):
        return int(load_run_config(d / "config.toml").train.seed)

    seeds, curve_seeds = [seed_of(d) for d in dirs], [seed_of(d) for d in curve_dirs]
    curve = curve_from_seeds("val_loss", [val_curve(d) for d in curve_dirs])
    # bf16 holds no own-seed test: another CPU's bf16 units round a seed's run further than a rerun does
    # (docs/benchmarks.md, the shipped references on other CPUs)
    own = (
        None
        if precision == "bf16"
        else seed_curves_from_runs(
            "val_loss",
            {s: val_curve(d) for s, d in zip(curve_seeds, curve_dirs)},
            {s: val_curve(d) for s, d in (rerun_dirs or {}).items()},
        )
    )
    return Reference(
        name=f"{recipe}-{precision}",
        title=RECIPES[recipe][0],
        command=command,
        precision=precision,
        seeds=seeds,
        machine=machine(),
        date=datetime.date.today().isoformat(),
        torch=torch.__version__.split("+")[0],
        setup=setups[0],
        bands=bands_from_runs(runs),
        regenerate=f"python tools/reference_bands.py --recipes {recipe} --precisions {precision} "
        f"--seeds {','.join(map(str, seeds))}"
        + (f" --curve-seeds {','.join(map(str, curve_seeds))}" if curve else "")
        + (" --reruns" if own else "")
        + (f" {','.join(map(str, rerun_dirs))}" if own and set(rerun_dirs) != set(curve_seeds) else "")
        + (" --data-dir DIR" if RECIPES[recipe][2] else ""),
        curve=curve,
        curve_seeds=curve_seeds if curve else [],
        seed_curves=own,
    )


def parse_seeds(text: str) -> list[int]:
    """``1337,1-19`` as [1337, 1, 2, ..., 19]."""
    seeds = []
    for part in (p for p in text.split(",") if p):
        first, _, last = part.partition("-")
        try:
            seeds += list(range(int(first), int(last) + 1)) if last else [int(first)]
        except ValueError:
            raise SystemExit(f"error: {part!r} is not a seed or a range of seeds (write them as 1337,1-19)") from None
    return list(dict.fromkeys(seeds))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of: {', '.join(RECIPES)}")
    p.add_argument(
        "--precisions",
        default="fp32",
        help="comma-separated: fp32, bf16 (what --precision auto picks on a CPU without and with bf16 units)",
    )
    p.add_argument(
        "--seeds",
        default=",".join(map(str, SEEDS)),
        help="the seeds a band is measured over (at least 5; ranges such as 1-19 allowed)",
    )
    p.add_argument(
        "--curve-seeds",
        default="",
        help="the seeds the curve test is measured over (20 or more; may share the band's); none: no curve test",
    )
    p.add_argument(
        "--reruns",
        nargs="?",
        const="all",
        default="",
        metavar="SEEDS",
        help="train each curve seed (or those of SEEDS, at least 5) once more with its sums in another "
        "order (2 threads): what a rerun of a seed differs by, for judging a run of one of those seeds "
        "against its own curve",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path.home() / ".cache" / "nanolm" / "reference_runs",
        help="where the runs are kept (reused when finished)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="directory holding tinyshakespeare.txt, "
        "tinystories_sample.txt and TinyStoriesV2-GPT4-valid.txt (default: nanolm's download cache)",
    )
    p.add_argument("--jobs", type=int, default=1, help="trainings at once, one thread each")
    p.add_argument(
        "--check",
        action="store_true",
        help="judge the seeds' runs against the shipped bands instead of "
        "writing bands: the false-alarm rate of seeds the bands were not measured on",
    )
    p.add_argument(
        "--plants",
        default="",
        help="with --check: comma-separated bugs of tools/silent_bugs.py, each "
        "planted in a copy of nanolm and trained with each seed instead of the healthy code",
    )
    p.add_argument("--out", type=Path, default=REFERENCE_DIR, help="where the reference files are written")
    p.add_argument(
        "--table",
        action="store_true",
        help="print the shipped references as a table (the whole of it is in "
        "dev/health.md; docs/health.md shows a row per recipe), and train nothing",
    )
    p.add_argument(
        "--refloor",
        action="store_true",
        help="raise the shipped references' own-seed noise to the "
        "current RERUN_FLOOR (nanolm/watch/curve.py) and simulate their thresholds again; trains nothing "
        "(it only raises: a lower floor needs the references regenerated)",
    )
    p.add_argument(
        "--rethreshold",
        action="store_true",
        help="simulate the shipped references' thresholds again "
        "from their stored covariances (after a change to how a threshold is simulated); trains nothing",
    )
    p.add_argument(
        "--widen",
        metavar="NAME=FACTOR",
        default="",
        help="widen a shipped reference's test among seeds "
        "FACTOR times (the root mean square t of healthy runs on other CPUs: benchmarks/other_cpus.py); "
        "trains nothing",
    )
    args = p.parse_args()
    if args.widen:
        widen(args.out, args.widen)
        return 0
    if args.table:
        print_table(args.out)
        return 0
    if args.refloor:
        refloor(args.out)
        return 0
    if args.rethreshold:
        rethreshold(args.out)
        return 0
    recipes = [r for r in args.recipes.split(",") if r]
    precisions = [x for x in args.precisions.split(",") if x]
    seeds, curve_seeds = parse_seeds(args.seeds), parse_seeds(args.curve_seeds)
    unknown = [r for r in recipes if r not in RECIPES] + [x for x in precisions if x not in ("fp32", "bf16")]
    if unknown:
        raise SystemExit(f"error: unknown recipe or format {unknown[0]!r}")
    if len(seeds) < 5 and not args.check:
        raise SystemExit("error: a band needs at least 5 seeds")
    rerun_seeds = curve_seeds if args.reruns == "all" else parse_seeds(args.reruns)
    if not set(rerun_seeds) <= set(curve_seeds):
        raise SystemExit(
            "error: --reruns SEEDS must be among the --curve-seeds (a rerun is judged against its first run)"
        )
    if args.reruns and not args.check and len(rerun_seeds) < 5:
        raise SystemExit(
            "error: --reruns needs at least 5 of the --curve-seeds (fewer cannot say what a rerun differs by)"
        )
    data_dir = (args.data_dir or default_data_dir()).resolve()
    todo, skipped = [], []
    for recipe in recipes:
        missing = [f for f in RECIPES[recipe][2] if not (data_dir / f).is_file()]
        if missing:
            skipped.append(f"{recipe} (no {data_dir / missing[0]})")
            continue
        todo += [(recipe, precision, seed) for precision in precisions for seed in dict.fromkeys(seeds + curve_seeds)]
    for line in skipped:
        print(f"skipped: {line}")
    plants = [x for x in args.plants.split(",") if x]
    if plants:
        if not args.check:
            raise SystemExit("error: --plants needs --check (a band is never measured on broken code)")
        return check_plants(plants, todo, args, data_dir)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda job: (job, train(*job, args.work, data_dir, env=env)), todo))
    reruns: dict[tuple[str, str], dict[int, Path]] = {}
    if rerun_seeds and not args.check:  # two threads each: one at a time
        for recipe, precision, seed in todo:
            if seed in rerun_seeds:
                out = train(recipe, precision, seed, args.work, data_dir, env=env, replicate=True)
                reruns.setdefault((recipe, precision), {})[seed] = out
    groups: dict[tuple[str, str], dict[int, Path]] = {}
    for (recipe, precision, seed), out in done:
        groups.setdefault((recipe, precision), {})[seed] = out
    if args.check:
        from nanolm.watch.reference import shipped_references

        refs = {r.name: r for r in shipped_references(args.out)}
        for (recipe, precision), dirs in groups.items():
            ref = refs.get(f"{recipe}-{precision}")
            if ref is None:
                print(f"{recipe} {precision}: no shipped reference")
                continue
            alarms = curve_alarms = 0
            for d in dirs.values():
                if setup_digest(run_setup(d)) != ref.digest:
                    print(f"  {d}: a different setup than the reference's")
                    continue
                rows = read_metrics(d / "metrics.jsonl")
                found, look = departures(ref, rows), curve_departure(ref, rows)
                alarms += bool(found)
                curve_alarms += look is not None
                print(
                    f"  {d.name}: {'; '.join(x.describe() for x in found) if found else 'inside every band'}"
                    + (f"; curve: {look.describe()}" if look else "")
                )
            print(
                f"{recipe} {precision}: {alarms} of {len(dirs)} runs left a band, {curve_alarms} departed by the "
                f"curve test (false alarms)"
            )
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for (recipe, precision), dirs in groups.items():
        ref = build(
            recipe, precision, [dirs[s] for s in seeds], [dirs[s] for s in curve_seeds], reruns.get((recipe, precision))
        )
        path = args.out / f"{ref.name}.json"
        write_reference(ref, path)
        print(
            f"wrote {path} ({len(ref.bands)} bands over {len(seeds)} seeds"
            + (f", the curve test over {len(ref.curve_seeds)}" if ref.curve else "")
            + ")"
        )
    return 0


def write_reference(ref, path: Path) -> None:
    text = json.dumps(ref.to_json(), indent=1)  # one line per array of numbers: a small file that diffs well
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    path.write_text(text + "\n", encoding="utf-8")


def refloor(directory: Path) -> None:
    """Each reference's own-seed noise raised to the current ``RERUN_FLOOR`` and its threshold
    simulated again, without training: what a new floor makes of the shipped references."""
    from nanolm.watch.curve import RERUN_FLOOR
    from nanolm.watch.reference import shipped_references

    for ref in shipped_references(directory):
        if ref.seed_curves is None:
            continue
        before = ref.seed_curves.threshold
        ref.seed_curves = ref.seed_curves.with_floor(RERUN_FLOOR)
        write_reference(ref, directory / f"{ref.name}.json")
        print(
            f"{ref.name}: rerun noise at least {RERUN_FLOOR:.1%} an evaluation, threshold {before} -> "
            f"{ref.seed_curves.threshold}"
        )


def rethreshold(directory: Path) -> None:
    """Each reference's thresholds simulated again from its stored covariances, without training:
    what a change to :func:`~nanolm.watch.curve.max_t_threshold` makes of the shipped references
    (their regeneration would compute the same, from the same runs)."""
    import dataclasses

    import numpy as np

    from nanolm.watch.curve import RERUN_FLOOR, max_t_threshold, nine_figures
    from nanolm.watch.reference import shipped_references

    for ref in shipped_references(directory):
        said = []
        if ref.curve is not None:
            before = ref.curve.threshold
            ref.curve = dataclasses.replace(
                ref.curve,
                threshold=nine_figures(
                    max_t_threshold(np.array(ref.curve.cov_log), ref.curve.seeds, ref.curve.false_alarm)
                ),
            )
            said.append(f"among seeds {before} -> {ref.curve.threshold}")
        if ref.seed_curves is not None:
            before = ref.seed_curves.threshold
            ref.seed_curves = ref.seed_curves.with_floor(RERUN_FLOOR)  # already there: only the threshold changes
            said.append(f"own seed {before} -> {ref.seed_curves.threshold}")
        if said:
            write_reference(ref, directory / f"{ref.name}.json")
            print(f"{ref.name}: threshold {', '.join(said)}")


def widen(directory: Path, spec: str) -> None:
    """``NAME=FACTOR``: the reference NAME's test among seeds widened by FACTOR (:meth:`Curve.widened`),
    and the command that regenerates it told to do the same after its trainings."""
    from nanolm.watch.reference import shipped_references

    name, _, factor_text = spec.partition("=")
    ref = next((r for r in shipped_references(directory) if r.name == name), None)
    try:
        factor = float(factor_text)
    except ValueError:
        factor = 0.0
    if ref is None or ref.curve is None or not 1.0 <= factor < 10.0:
        raise SystemExit(
            f"error: --widen {spec!r}: write NAME=FACTOR, NAME a shipped reference with a curve test, "
            f"FACTOR from 1 to 10 (the healthy runs' root mean square t on other CPUs)"
        )
    if f"--widen {name}=" in ref.regenerate:
        raise SystemExit(
            f"error: {name} is widened already (its regenerate command says so); a second --widen would "
            f"multiply the two: regenerate it first"
        )
    ref.curve = ref.curve.widened(factor)
    ref.regenerate += f" && python tools/reference_bands.py --widen {name}={factor:g}"
    write_reference(ref, directory / f"{ref.name}.json")
    print(f"{ref.name}: the test among seeds widened {factor:g} times")


def print_table(directory: Path) -> None:
    from nanolm.watch.reference import shipped_references

    print("| reference | recipe | seeds | the last evaluation's band: validation loss; bits per byte | measured |")
    print("| --- | --- | --- | --- | --- |")
    for ref in shipped_references(directory):
        val, bpb = ref.bands.get("val_loss"), ref.bands.get("val_bpb")
        last = (
            f"step {val.steps[-1]}: {val.lo[-1]:.4f}..{val.hi[-1]:.4f} (median {val.mid[-1]:.4f}); "
            f"{bpb.lo[-1]:.3f}..{bpb.hi[-1]:.3f} bpb"
            if val and bpb
            else "none"
        )
        seeds = ", ".join(map(str, ref.seeds))
        if ref.curve is not None:
            seeds += f"; curve over {len(ref.curve_seeds)} (threshold \\|t\\| {ref.curve.threshold:.2f})"
        print(
            f"| `{ref.name}` | {ref.title}: `{ref.command}` | {seeds} | {last} | "
            f"{ref.date}, {ref.machine}, torch {ref.torch} |"
        )


def check_plants(plants: list[str], todo, args, data_dir: Path) -> int:
    """Each planted bug in its own copy of the package, trained on every (recipe, format, seed):
    the departures from the shipped band, or that it stayed inside (the bug escaped the band)."""
    import shutil
    import tempfile

    from silent_bugs import BUGS, plant

    from nanolm.watch.reference import shipped_references

    bugs = {b.name: b for b in BUGS}
    unknown = [p for p in plants if p not in bugs]
    if unknown:
        raise SystemExit(f"error: unknown bug {unknown[0]!r}; see python tools/silent_bugs.py --list")
    refs = {r.name: r for r in shipped_references(args.out)}
    left = 0
    for name in plants:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "nanolm_copy"  # the recipes' paths (configs/, data/) are relative to it
            for part in ("nanolm", "configs", "data"):
                shutil.copytree(ROOT / part, copy / part)
            plant(copy, bugs[name])
            env = {**os.environ, "PYTHONPATH": str(copy)}  # `python -m` puts the working directory first anyway
            for recipe, precision, seed in todo:
                ref = refs.get(f"{recipe}-{precision}")
                if ref is None:
                    raise SystemExit(f"error: no shipped reference {recipe}-{precision}")
                out = train(recipe, precision, seed, args.work / f"plant-{name}", data_dir, env=env, cwd=copy)
                rows = read_metrics(out / "metrics.jsonl")
                found, look = departures(ref, rows), curve_departure(ref, rows)
                left += bool(found) or look is not None
                verdict = found[0].describe() if found else "stayed inside every band"
                verdict += f"; curve: {look.describe()}" if look else ""
                print(
                    f"{name:40s} {recipe} {precision} seed {seed}: {verdict}"
                    + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""),
                    flush=True,
                )
    print(f"{left} of {len(plants) * len(todo)} planted runs left their band or departed by the curve test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
