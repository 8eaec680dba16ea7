"""The golden run: "a refactor changes no number" (invariant 16 of the design), as a check.

Moving code between files, renaming, splitting a function: none of it may change what a run
computes. A change that does usually still trains, just differently, so the only way to know is
to compare numbers with the code before the change. This script runs one pinned recipe (the
quick run's, shortened: ``RECIPE``) under ``--deterministic --precision fp32 --threads 1`` and
compares, with what ``tests/fixtures/golden.json`` recorded: every step's training loss and
gradient norm, the validation losses, a digest of the final weights, and the digests of the
tokenizer and of the prepared data.

Bits depend on the machine as well as on the code: a CPU without AVX-512, another vendor's
matrix library or another PyTorch can round differently. So each record is kept under the
machine it was made on (PyTorch's version, the CPU's vendor and vector unit). On that machine
the comparison is exact, to the last bit. On any other, the digests of the tokenizer and data
are still exact (they involve no floating point), and the losses and gradient norms must agree
within ``ELSEWHERE`` (relative): far above the rounding of another machine, far below what a
changed computation moves (``tests/test_golden.py`` measures both).

    python tools/golden.py              # check this machine against the record
    python tools/golden.py --update     # a change meant to move numbers: record them anew
    python tools/golden.py --add        # numbers unchanged, this machine not yet recorded
    python tools/golden.py --quick      # the README's whole quick run (300 steps)

``--update`` drops the other machines' records (they hold the numbers of before); ``--add``
keeps them. ``--quick`` runs the whole quick run and checks it against its own record in the
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
PINNED = ["--data", "data/toy.txt", "--vocab-size", "400", "--lr", "3e-3",
          "--deterministic", "--precision", "fp32", "--threads", "1", "--sample-tokens", "0", "--log-every", "1"]
RECIPE = {"short": PINNED + ["--steps", "20", "--eval-every", "10"],  # the test's: short enough for the suite
          "quick": PINNED + ["--steps", "300"]}  # the README's quick run, every step logged
ELSEWHERE = 1e-3  # relative agreement of losses and gradient norms on a machine without a record


def machine() -> str:
    """What the bits of an fp32 run depend on besides the code: PyTorch's version, the CPU's
    vendor and the vector unit PyTorch's kernels use."""
    import torch

    vendor = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), vendor)
    except OSError:
        pass
    return f"torch {torch.__version__} | {vendor} | {torch.backends.cpu.get_cpu_capability()}"


def run_recipe(which: str, work: Path) -> dict:
    """Train the pinned recipe in a fresh process (the command's own entry sets determinism and
    threads) and read back its numbers."""
    out = work / which
    cmd = [sys.executable, "-m", "nanolm.train", *RECIPE[which], "--out-dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
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


def compare(recorded: dict, measured: dict, exact: bool) -> str | None:
    """The first number that moved, in words, or None. ``exact``: the record was made on this
    machine, so every bit must agree; else the digests of the weights cannot be compared and the
    floats must agree within ``ELSEWHERE``."""
    for key in EXACT_EVERYWHERE:
        if recorded[key] != measured[key]:
            return f"{key} changed: {recorded[key]} -> {measured[key]}"
    if exact and recorded["weights_sha256"] != measured["weights_sha256"]:
        first = _first_difference(recorded, measured, 0.0)
        return "the final weights changed" + (f"; first: {first}" if first else " (every logged number is the same)")
    return _first_difference(recorded, measured, 0.0 if exact else ELSEWHERE)


def _first_difference(recorded: dict, measured: dict, tolerance: float) -> str | None:
    for key in ("loss", "grad_norm", "val_loss"):
        old, new = recorded[key], measured[key]
        if len(old) != len(new):
            return f"{key}: {len(old)} values recorded, {len(new)} now"
        for i, (a, b) in enumerate(zip(old, new)):
            if key == "val_loss":
                if a[0] != b[0]:
                    return f"val_loss: evaluated at step {b[0]}, recorded at step {a[0]}"
                a, b = a[1], b[1]
            if not _agrees(a, b, tolerance):
                where = f"step {recorded['val_loss'][i][0]}" if key == "val_loss" else f"value {i + 1}"
                return f"{key} at {where}: {a!r} recorded, {b!r} now"
    return None


def _agrees(a: float, b: float, tolerance: float) -> bool:
    if tolerance == 0.0:
        return a == b or (math.isnan(a) and math.isnan(b))
    return math.isclose(a, b, rel_tol=tolerance)


def check(which: str, work: Path, record: dict | None = None) -> tuple[str | None, str]:
    """Run ``which`` and compare it with the record: (what moved or None, how it was compared)."""
    record = record if record is not None else json.loads(GOLDEN.read_text(encoding="utf-8"))
    here = machine()
    records = record[which]
    measured = run_recipe(which, work)
    if here in records:
        return compare(records[here], measured, exact=True), f"bit for bit, recorded on this machine ({here})"
    other, recorded = next(iter(records.items()))
    return (compare(recorded, measured, exact=False),
            f"within {ELSEWHERE:g} relative, against the record of {other} (this machine, {here}, has none)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    how = p.add_mutually_exclusive_group()
    how.add_argument("--update", action="store_true", help="record this machine's numbers and drop the others'")
    how.add_argument("--add", action="store_true", help="record this machine's numbers beside the others'")
    p.add_argument("--quick", action="store_true", help="the README's whole quick run instead of the short recipe")
    args = p.parse_args()
    which = "quick" if args.quick else "short"
    record = json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.exists() else {"short": {}, "quick": {}}
    with tempfile.TemporaryDirectory(prefix="nanolm-golden-") as tmp:
        if args.update or args.add or not record.get(which):
            measured = run_recipe(which, Path(tmp))
            record[which] = ({} if args.update else record.get(which, {})) | {machine(): measured}
            GOLDEN.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
            print(f"recorded the {which} recipe on {machine()} in {GOLDEN.relative_to(ROOT)}")
            return 0
        moved, how_compared = check(which, Path(tmp), record)
    if moved:
        print(f"a number moved ({how_compared}): {moved}\n"
              f"if the change is meant to move numbers: python tools/golden.py {'--quick ' if args.quick else ''}--update")
        return 1
    print(f"the {which} recipe computes what it did ({how_compared})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
