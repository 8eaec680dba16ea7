"""One process against N ranks under torchrun (DDP and FSDP), on this machine's CPUs or GPUs.

Trains the same steps three ways (1 process with N× accumulation, N ranks with DDP, N ranks
with FSDP), then prints JSON: tokens per second (median over steps), and how far each
distributed run's losses and final weights are from the single process (max relative
difference). On CPU the ranks use gloo and one thread each; the single process uses N threads.

    python benchmarks/data_parallel.py --steps 30 --nproc 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: list[str], nproc: int, threads: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    if nproc == 1:
        cmd = [sys.executable, "-m", "nanolm.train", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "-m",
            "nanolm.train",
            *args,
        ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="--n-layer 4 --n-head 4 --n-embd 128 --seq-len 128")
    p.add_argument(
        "--single-threads",
        type=int,
        default=None,
        help="threads of the single process (default: as many as the ranks use together)",
    )
    a = p.parse_args()
    common = [
        "--data",
        str(REPO / "data" / "toy.txt"),
        "--tokenizer",
        "char",
        *a.shape.split(),
        "--steps",
        str(a.steps),
        "--log-every",
        "1",
        "--eval-every",
        str(a.steps),
        "--eval-batches",
        "2",
        "--sample-tokens",
        "0",
        "--device",
        a.device,
        "--batch-size",
        str(a.batch_size),
    ]
    cpus = os.cpu_count() or 1
    out: dict = {
        "nproc": a.nproc,
        "steps": a.steps,
        "device": a.device,
        "shape": a.shape,
        "tokens_per_step": a.batch_size * a.nproc * int(a.shape.split("--seq-len")[1].split()[0]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        single = Path(tmp) / "single"
        threads = a.single_threads or min(cpus, a.nproc)
        out["single_threads"] = threads
        run(
            [*common, "--out-dir", str(single), "--grad-accum", str(a.nproc), "--eval-batches", str(2 * a.nproc)],
            1,
            threads,
        )
        reference = rows(single)
        ref_weights = load_file(str(single / "model.safetensors"))
        results = {"single": single}
        for mode in ("ddp", "fsdp"):
            results[mode] = Path(tmp) / mode
            run([*common, "--out-dir", str(results[mode]), "--dist", mode], a.nproc, max(1, cpus // a.nproc))
        for name, run_dir in results.items():
            r = [x for x in rows(run_dir) if "tokens_per_sec" in x]
            entry = {"tokens_per_sec": statistics.median(x["tokens_per_sec"] for x in r[len(r) // 5 :])}
            if name != "single":
                losses = [(x["loss"], y["loss"]) for x, y in zip(r, [y for y in reference if "loss" in y])]
                entry["max_rel_loss_diff"] = max(abs(x - y) / abs(y) for x, y in losses)
                w = load_file(str(run_dir / "model.safetensors"))
                entry["max_rel_weight_diff"] = max(
                    ((w[k] - ref_weights[k]).abs().max() / ref_weights[k].abs().max()).item() for k in w
                )
            out[name] = entry
    for mode in ("ddp", "fsdp"):
        out[mode]["speed_vs_single"] = out[mode]["tokens_per_sec"] / out["single"]["tokens_per_sec"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
