"""What Python's garbage collector costs a short run, during the run and at exit, with nanolm's
exemptions (``nanolm.instruments.process``) and without them.

Importing PyTorch leaves ~170,000 objects that the cyclic garbage collector tracks, and the
optimizer's first import of ``torch._dynamo`` ~120,000 more. Every full collection walks all of
them, and the interpreter's shutdown runs several. ``nanolm train`` exempts what exists once
its options are read and, at exit, collects once and exempts the rest (``gc.freeze``);
``--process-tuning off`` leaves the collector alone (and the allocator: on a CPU both differ).

Each configuration runs ``python -m nanolm train ARGS --process-tuning auto|off`` in fresh processes, alternated round by round,
with a hook that adds up the time spent in collections until the command returns. Reported per
configuration (medians over rounds): the collections' seconds during the command (with the
exemption, the one collection it makes when the command returns included), the seconds from its
return to the process's exit (the shutdown), the whole process's wall seconds (the noisiest of
the three) and how many objects were exempted. By default the command is the shakespeare
speedrun's training run.

    python benchmarks/garbage_collector.py --data path/to/tinyshakespeare.txt
    python benchmarks/garbage_collector.py --rounds 5 -- train --data FILE --steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# runs `python -m nanolm` as the command line does, and prints when it returns and what collections cost
PROBE = """
import atexit, gc, runpy, sys, time
spent, started = [0.0], [0.0]
def clock(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        spent[0] += time.perf_counter() - started[0]
gc.callbacks.append(clock)
atexit.register(lambda: print(f"\\nPROBE returned_at {time.time():.4f} gc_seconds {spent[0]:.4f} "
                              f"frozen {gc.get_freeze_count()}", flush=True))
sys.argv = ["nanolm", *sys.argv[1:]]
runpy.run_module("nanolm", run_name="__main__", alter_sys=True)
"""


def one_process(args: list[str], freeze: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [*args, "--process-tuning", "auto" if freeze else "off"]
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, cwd=REPO)
    end = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"error: `nanolm {' '.join(args)}` failed:\n{proc.stderr[-2000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))
    _, _, returned_at, _, gc_seconds, _, frozen = line.split()
    return {
        "wall_s": end - start,
        "exit_s": end - float(returned_at),
        "gc_s": float(gc_seconds),
        "frozen_objects": int(frozen),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="text file for the default command (the shakespeare speedrun)")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per configuration, alternated")
    p.add_argument("command", nargs="*", help="nanolm train's arguments, after -- (default: the shakespeare speedrun)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        command = args.command
        if not command:
            if not args.data:
                raise SystemExit("error: give --data FILE (tiny-shakespeare) or a nanolm command after --")
            command = ["train", "--config", "configs/speedrun_cpu.toml", "--data", str(Path(args.data).resolve())]
        if command[0] != "train":
            raise SystemExit("error: --process-tuning is a training run's option: give `train ...` after --")
        runs = {True: [], False: []}
        for r in range(args.rounds):
            for freeze in (True, False) if r % 2 == 0 else (False, True):
                extra = ["--out-dir", str(Path(tmp) / f"run_{r}_{freeze}")]
                runs[freeze].append(one_process(command + extra, freeze))
    out = {"date": time.strftime("%Y-%m-%d"), "command": command, "python": sys.version.split()[0]}
    for freeze, name in ((True, "exempted"), (False, "collector_alone")):
        out[name] = {
            key: round(statistics.median(r[key] for r in runs[freeze]), 3) for key in ("gc_s", "exit_s", "wall_s")
        }
        out[name]["each"] = [{k: round(v, 3) for k, v in r.items()} for r in runs[freeze]]
        out[name]["frozen_objects"] = statistics.median(r["frozen_objects"] for r in runs[freeze])
    out["saved_s"] = {
        key: round(out["collector_alone"][key] - out["exempted"][key], 3) for key in ("gc_s", "exit_s", "wall_s")
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
