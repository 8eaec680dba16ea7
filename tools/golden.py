"""The golden run: "a refactor changes no number" (invariant 16 of the design), as a check.

Moving code between files, renaming, splitting a function: none of it may change what a run
computes. A change that does usually still trains, just differently, so the only way to know is
to compare numbers with the code before the change. This script runs one pinned recipe (the
quick run's, shortened: ``RECIPE``) under ``--deterministic --precision fp32 --threads 1`` and
compares, with what ``tests/fixtures/golden.json`` recorded: every step's training loss and
gradient norm, the validation losses, a digest of the final weights, and the digests of the
tokenizer and of the prepared data.

Bits depend on the machine as well as on the code: another CPU runs other vectorised kernels
(PyTorch picks them by the CPU's vector unit: ``ATEN_CPU_CAPABILITY`` is avx512, avx2 or default),
and they sum in another order. So each record is kept under the machine it was made on (PyTorch's
version, the CPU's vendor, model and vector unit). On that machine the comparison is exact, to the
last bit. On any other, the digests of the tokenizer and data are still exact (they involve no
floating point), and each loss and gradient norm must agree within what other kernels were
measured to do at that step, ``SAFETY`` times over: rounding differences start in the last bits
and every update of the weights amplifies them, so the allowed difference grows with the step
(:func:`allowed_drift`). ``--kernels`` measures it: it runs the recipe under every kernel path
this CPU has and records, per value, the largest relative difference between any two of them and
the other machines' records (``kernel_spread`` in the record file). Another PyTorch is not
compared at all: how far its kernels move the numbers was never measured (:func:`not_comparable`).

    python tools/golden.py              # check this machine against the record
    python tools/golden.py --update     # a change meant to move numbers: record them anew
    python tools/golden.py --add        # numbers unchanged, this machine not yet recorded
    python tools/golden.py --kernels    # measure what other kernels do: the drift allowed elsewhere
    python tools/golden.py --quick      # the README's whole quick run (300 steps)

``--update`` drops the other machines' records (they hold the numbers of before) and keeps the
kernel spread (it measures kernels, not numbers; each ``--kernels`` adds to it); ``--add`` keeps
them. ``--quick`` runs the whole quick run and checks it against its own record in the
same file (kept the same way), for a refactor that must leave the README's run bit-identical.
Exit status 1 when a number moved, with the first that did.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "fixtures" / "golden.json"
PINNED = [
    "--data",
    "data/toy.txt",
    "--vocab-size",
    "400",
    "--lr",
    "3e-3",
    "--deterministic",
    "--precision",
    "fp32",
    "--threads",
    "1",
    "--sample-tokens",
    "0",
    "--log-every",
    "1",
]
RECIPE = {
    "short": PINNED + ["--steps", "20", "--eval-every", "10"],  # the test's: short enough for the suite
    "quick": PINNED + ["--steps", "300"],
}  # the README's quick run, every step logged
KERNEL_PATHS = ("avx512", "avx2", "default")
"""Values of ``ATEN_CPU_CAPABILITY``: the vectorised kernels a CPU with AVX-512, one with AVX2 only
(most laptops) and any other runs. One machine running the recipe under each computes what those
CPUs would (MKL's and oneDNN's own choices, ``MKL_ENABLE_INSTRUCTIONS`` and ``ONEDNN_MAX_CPU_ISA``,
were measured to change no bit of this fp32 recipe: docs/benchmarks.md)."""
SAFETY = 10
"""Elsewhere, a number may differ from the record by this many times the largest difference
measured across kernel paths up to its step."""
FLOOR = 1e-6
"""...and always by this much (relative): about 16 roundings of an fp32 number (6e-8 each), one sum
taken in another order; a changed computation moves the first loss further."""


def machine() -> str:
    """What the bits of an fp32 run depend on besides the code: PyTorch's version, the CPU (vendor
    and model: two CPUs of one vendor and vector unit can still pick other matrix kernels) and
    the vector unit PyTorch's kernels use."""
    import torch

    return f"torch {torch.__version__} | {_cpu()} | {torch.backends.cpu.get_cpu_capability()}"


def _cpu() -> str:
    """The CPU's vendor and model, as the operating system names them."""
    if sys.platform == "darwin":
        brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
        return brand.stdout.strip() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            first = f.read().split("\n\n")[0]
    except OSError:  # Windows, or a system without /proc
        return platform.processor() or platform.machine()
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    if "vendor_id" in fields:  # x86
        return (
            f"{fields['vendor_id']} {fields.get('model name', '')} (family {fields.get('cpu family', '?')}, "
            f"model {fields.get('model', '?')})"
        )
    if "CPU implementer" in fields:  # ARM: the designer and the core, by number
        return f"{platform.machine()} implementer {fields['CPU implementer']} part {fields.get('CPU part', '?')}"
    return platform.machine()


def run_recipe(which: str, work: Path, tree: Path = ROOT, kernels: str | None = None) -> dict:
    """Train the pinned recipe in a fresh process (the command's own entry sets determinism and
    threads) and read back its numbers. ``tree``: the checkout whose package and data it runs (a
    copy with a change planted, in the tests); ``kernels``: a value of ``ATEN_CPU_CAPABILITY``."""
    out = work / which
    cmd = [sys.executable, "-m", "nanolm.train", *RECIPE[which], "--out-dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if kernels is not None:
        env["ATEN_CPU_CAPABILITY"] = kernels
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the golden run failed ({' '.join(cmd)}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    evals = [r for r in rows if "val_loss" in r]
    first = rows[0]

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    return {
        "loss": [r["loss"] for r in steps],
        "grad_norm": [r["grad_norm"] for r in steps],
        "val_loss": [[r["step"], r["val_loss"]] for r in evals],
        "weights_sha256": digest(out / "model.safetensors"),
        "tokenizer_sha256": digest(out / "tokenizer.json"),
        "data_digest": first["data_digest"],
    }


EXACT_EVERYWHERE = ("tokenizer_sha256", "data_digest")  # no floating point in them
FLOATS = ("loss", "grad_norm", "val_loss")


def _values(record: dict, key: str) -> list[float]:
    return [v[1] for v in record[key]] if key == "val_loss" else list(record[key])


def spread(runs: list[dict]) -> dict[str, list[float]]:
    """Per logged value, the largest relative difference between any two of ``runs`` (the same
    recipe computed by other kernels): what rounding alone does to it."""
    out = {}
    for key in FLOATS:
        columns = zip(*(_values(r, key) for r in runs))
        out[key] = [max((abs(a - b) / abs(b) for a in column for b in column if b), default=0.0) for column in columns]
    return out


def allowed_drift(kernel_spread: dict[str, list[float]]) -> dict[str, list[float]]:
    """The relative difference a number computed elsewhere may have from the record, per value:
    ``SAFETY`` times the largest spread measured up to that value (a value's own spread is noisy:
    one step's gradient norm can agree to 1e-5 between two that differ by 1e-3), and at least
    ``FLOOR``."""
    allowed = {}
    for key, values in kernel_spread.items():
        running, allowed[key] = 0.0, []
        for value in values:
            running = max(running, value)
            allowed[key].append(max(FLOOR, SAFETY * running))
    return allowed


def compare(recorded: dict, measured: dict, allowed: dict[str, list[float]] | None) -> str | None:
    """The first number that moved, in words, or None. ``allowed`` None: the record was made on
    this machine, so every bit must agree; else the digests of the weights cannot be compared and
    each float must agree within its ``allowed`` relative difference (:func:`allowed_drift`)."""
    for key in EXACT_EVERYWHERE:
        if recorded[key] != measured[key]:
            return f"{key} changed: {recorded[key]} -> {measured[key]}"
    if allowed is None and recorded["weights_sha256"] != measured["weights_sha256"]:
        first = _first_difference(recorded, measured, None)
        return "the final weights changed" + (f"; first: {first}" if first else " (every logged number is the same)")
    return _first_difference(recorded, measured, allowed)


def _first_difference(recorded: dict, measured: dict, allowed: dict[str, list[float]] | None) -> str | None:
    for key in FLOATS:
        old, new = recorded[key], measured[key]
        if len(old) != len(new):
            return f"{key}: {len(old)} values recorded, {len(new)} now"
        if allowed is not None and len(allowed[key]) != len(old):
            return f"{key}: the drift allowed elsewhere was measured for {len(allowed[key])} values, not {len(old)}"
        for i, (a, b) in enumerate(zip(old, new)):
            if key == "val_loss":
                if a[0] != b[0]:
                    return f"val_loss: evaluated at step {b[0]}, recorded at step {a[0]}"
                a, b = a[1], b[1]
            tolerance = 0.0 if allowed is None else allowed[key][i]
            if not _agrees(a, b, tolerance):
                where = f"step {recorded['val_loss'][i][0]}" if key == "val_loss" else f"value {i + 1}"
                within = f" (allowed {tolerance:.1e} relative, {abs(a - b) / abs(a):.1e} now)" if tolerance else ""
                return f"{key} at {where}: {a!r} recorded, {b!r} now{within}"
    return None


def _agrees(a: float, b: float, tolerance: float) -> bool:
    if tolerance == 0.0:
        return a == b or (math.isnan(a) and math.isnan(b))
    return math.isclose(a, b, rel_tol=tolerance)


def record_elsewhere(records: dict, here: str) -> tuple[str, dict]:
    """The record another machine is compared with: one made with the same vector unit if there
    is one (its kernels are this machine's), else the first."""
    unit = here.rsplit(" | ", 1)[-1]
    return next(((m, r) for m, r in records.items() if m.rsplit(" | ", 1)[-1] == unit), next(iter(records.items())))


def _torch(machine_key: str) -> str:
    return machine_key.split(" | ", 1)[0].split("+", 1)[0]


def not_comparable(record: dict, which: str) -> str | None:
    """Why this machine's numbers cannot be held against the records, or None: another PyTorch
    runs other kernels, and how far they move the numbers was never measured."""
    here = _torch(machine())
    made_with = sorted({_torch(m) for m in record[which]})
    if here in made_with:
        return None
    return (
        f"the {which} recipe's records were made with {', '.join(made_with)}, this is {here}: what its kernels do "
        f"to the numbers was never measured (python tools/golden.py --add records this machine)"
    )


def check(which: str, work: Path, record: dict | None = None) -> tuple[str | None, str]:
    """Run ``which`` and compare it with the record: (what moved or None, how it was compared)."""
    record = record if record is not None else json.loads(GOLDEN.read_text(encoding="utf-8"))
    here = machine()
    records = record[which]
    reason = not_comparable(record, which)
    if reason:
        return None, f"not compared: {reason}"
    measured = run_recipe(which, work)
    if here in records:
        return compare(records[here], measured, None), f"bit for bit, recorded on this machine ({here})"
    other, recorded = record_elsewhere({m: r for m, r in records.items() if _torch(m) == _torch(here)}, here)
    spread_measured = record.get("kernel_spread", {}).get(which)
    how = (
        f"within {SAFETY}x what other kernels do at each step (python tools/golden.py --kernels), against "
        f"the record of {other} (this machine, {here}, has none)"
    )
    if spread_measured is None:
        return f"no drift measured for the {which} recipe: run python tools/golden.py --kernels", how
    return compare(recorded, measured, allowed_drift(spread_measured["spread"])), how


def kernels_run_as(path: str | None) -> str:
    """The vector kernels PyTorch really runs when told ``path`` (``ATEN_CPU_CAPABILITY``; None:
    left alone): a CPU without AVX-512 runs avx2 when told avx512."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if path is not None:
        env["ATEN_CPU_CAPABILITY"] = path
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env,
        capture_output=True,
        text=True,
    )
    return probe.stdout.strip() or probe.stderr[-200:]


def measure_kernels(which: str, work: Path, record: dict) -> dict:
    """Run ``which`` under every kernel path this CPU has; the spread between them and the other
    machines' records, added to what earlier measurements (other machines') found: the largest
    of all, per value."""
    here = machine()
    mine = record.get(which, {}).get(here)
    runs, names = [], []
    for path in KERNEL_PATHS:
        runs_as = kernels_run_as(path)
        if runs_as.lower() != path:
            print(f"  {path}: this CPU cannot run it (it runs {runs_as})")
            continue
        run = run_recipe(which, work / path, kernels=path)
        moved = compare(mine, run, None) if mine is not None and runs_as == here.rsplit(" | ", 1)[1] else None
        if moved:
            raise SystemExit(
                f"error: the {which} recipe no longer computes this machine's record ({moved}): "
                f"changed numbers are not rounding; record them first (python tools/golden.py --update)"
            )
        runs.append(run)
        names.append(f"{path} on {_cpu()}")
        print(f"  {path}: done", flush=True)
    others = {m: r for m, r in record.get(which, {}).items() if m.split(" | ")[1] != here.split(" | ")[1]}
    if len(runs) + len(others) < 2:
        raise SystemExit(
            "error: one computation alone has no spread: this CPU runs one kernel path and no other "
            "machine's record is there to compare with"
        )
    measured = spread(runs + list(others.values()))
    names += [f"the record of {m}" for m in others]
    before = record.get("kernel_spread", {}).get(which)
    if before is not None and all(len(before["spread"][k]) == len(v) for k, v in measured.items()):
        measured = {k: [max(a, b) for a, b in zip(v, before["spread"][k])] for k, v in measured.items()}
        names = list(dict.fromkeys(before["runs"] + names))
    return {
        "runs": names,
        "command": "python tools/golden.py --kernels" + (" --quick" if which == "quick" else ""),
        "spread": measured,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    how = p.add_mutually_exclusive_group()
    how.add_argument("--update", action="store_true", help="record this machine's numbers and drop the others'")
    how.add_argument("--add", action="store_true", help="record this machine's numbers beside the others'")
    how.add_argument(
        "--kernels",
        action="store_true",
        help="measure the spread across kernel paths (and against the "
        "other machines' records): the drift allowed on a machine without a record",
    )
    p.add_argument("--quick", action="store_true", help="the README's whole quick run instead of the short recipe")
    args = p.parse_args()
    which = "quick" if args.quick else "short"
    record = json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.exists() else {"short": {}, "quick": {}}
    with tempfile.TemporaryDirectory(prefix="nanolm-golden-") as tmp:
        if args.kernels:
            record.setdefault("kernel_spread", {})[which] = measure_kernels(which, Path(tmp), record)
            GOLDEN.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
            measured = record["kernel_spread"][which]["spread"]
            for key, values in measured.items():  # (every list holds one value per logged number: none is empty)
                print(
                    f"{key}: largest relative difference {max(values):.1e} (value {values.index(max(values)) + 1} of "
                    f"{len(values)}); the first {values[0]:.1e}"
                )
            print(f"recorded in {GOLDEN.relative_to(ROOT)} (kernel_spread.{which})")
            return 0
        if args.update or args.add or not record.get(which):
            measured = run_recipe(which, Path(tmp))
            record[which] = ({} if args.update else record.get(which, {})) | {machine(): measured}
            before = record.get("kernel_spread", {}).get(which)
            stale = before is not None and any(len(before["spread"][k]) != len(_values(measured, k)) for k in FLOATS)
            if stale:  # measured on a recipe of another length: no longer about these numbers
                del record["kernel_spread"][which]
            GOLDEN.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
            print(
                f"recorded the {which} recipe on {machine()} in {GOLDEN.relative_to(ROOT)}"
                + (
                    f"; the recipe's length changed: measure what other kernels do with it, python tools/golden.py "
                    f"--kernels{' --quick' if args.quick else ''}"
                    if stale
                    else ""
                )
            )
            return 0
        moved, how_compared = check(which, Path(tmp), record)
    if how_compared.startswith("not compared"):
        print(how_compared)
        return 0
    if moved:
        print(
            f"a number moved ({how_compared}): {moved}\n"
            f"if the change is meant to move numbers: python tools/golden.py {'--quick ' if args.quick else ''}--update"
        )
        return 1
    print(f"the {which} recipe computes what it did ({how_compared})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
