"""The quick run on a machine another process keeps busy: --threads auto against fixed counts.

PyTorch's default of one thread per core makes every CPU kernel wait for the thread that
shares its core with someone else's job. This script keeps ``--busy`` cores busy with
spinning processes (a stand-in for a neighbour's job), then times the README's quick run
(``nanolm train --data data/toy.txt --steps 300 --vocab-size 400``) as a fresh process, from
launch to exit, at ``--threads auto`` (the default) and at each fixed count, one after the
other in the same run. ``--busy 0`` gives the same comparison on an idle machine (where auto
must cost nothing).

    python benchmarks/busy_machine.py                 # one core of the machine kept busy
    python benchmarks/busy_machine.py --busy 0        # idle
    python benchmarks/busy_machine.py --steps 100     # shorter

Prints JSON: each variant's wall time, its ratio to auto, the thread counts the run used (from
metrics.jsonl) and the switches it logged.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def spin() -> None:
    while True:
        pass


def time_run(threads: str, steps: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "nanolm",
        "train",
        "--data",
        str(REPO / "data" / "toy.txt"),
        "--steps",
        str(steps),
        "--vocab-size",
        "400",
        "--out-dir",
        str(out),
        "--threads",
        threads,
        "--progress",
        "lines",
        "--sample-tokens",
        "0",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OMP_NUM_THREADS", None)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"--threads {threads} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    used = sorted({r["threads"] for r in rows if "threads" in r})
    return {
        "threads": threads,
        "wall_s": round(wall, 2),
        "thread_counts_used": used,
        "switches": [line for line in proc.stdout.splitlines() if line.startswith("threads: ")],
        "final_val_loss": next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--busy", type=int, default=1, help="cores to keep busy with spinning processes")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--variants", default="auto,1,2", help="comma-separated --threads values, timed in this order")
    args = p.parse_args()
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    time.sleep(2 if spinners else 0)
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="busy-") as tmp:
            for i, threads in enumerate(args.variants.split(",")):
                results.append(time_run(threads.strip(), args.steps, Path(tmp) / f"run{i}"))
    finally:
        for s in spinners:
            s.terminate()
    auto = next((r["wall_s"] for r in results if r["threads"] == "auto"), None)
    for r in results:
        r["wall_vs_auto"] = round(r["wall_s"] / auto, 2) if auto else None
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "cores": os.cpu_count(),
                "busy_cores": args.busy,
                "steps": args.steps,
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
                "runs": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
