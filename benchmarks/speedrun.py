"""CPU speedrun: training time until tiny-shakespeare's validation bits per byte <= 2.72.

Runs ``python -m nanolm train --config configs/speedrun_cpu.toml --data FILE --target-val-bpb 2.72``
as a fresh subprocess. A row's time is training time, as the GPU speedruns count it: from the
first step (the run's ``model:`` line, printed once the data is prepared and the model built) to
the end of the evaluation that reaches the target, evaluations included. Beside it, the time
before training (interpreter and PyTorch start-up, tokenizer training, tokenization, the model)
and after the target (the final save, the exit), and the whole process from launch to exit. The
validation set is the last 10 % of the file's bytes (a single-document corpus is split that way)
and bits per byte are computed on those bytes, so any tokenizer compares. 2.72 bits per byte is
the 1.886 nats per character nanoGPT's CPU recipe reaches (≈ 150 s on the 2-core development
machine).

Which validation tokens decide: the config's ``eval_batches`` covers the whole validation split,
so the decision is taken on every validation byte; the script re-evaluates the final weights on
the whole split afterwards (outside the timed process) and reports that figure too.

Prints JSON: for each repeat the curve (step, seconds since launch, val bpb), the training time
to target, the time before training and after the target, launch to exit, the child's CPU time
and peak RSS, and the load average around it.

    python benchmarks/speedrun.py --data path/to/tinyshakespeare.txt
    python benchmarks/speedrun.py --data shakespeare --repeats 3          # downloads it once
    python benchmarks/speedrun.py --data FILE --threads 1                 # on a busy machine
    python benchmarks/speedrun.py --data FILE --config configs/shakespeare_char.toml   # the baseline

**A time budget** (``--budget SECONDS``, the TinyStories per-minute track): no target; the row is
the run's validation bits per byte on the whole held-out split once trained. The per-minute
configs carry their budget (``time_budget``: the run plans its steps by its own clock and ends its
training and final evaluation inside it, ``nanolm.run.budget``); a config of fixed steps (or
``--time-budget off --steps N`` after ``--``) is the same run on every machine instead. Its training
time (the run's own clock, metrics.jsonl's ``elapsed_s`` at the last step: from the first step to
the end of the last one, evaluations on the way included, the final one not) must fit the budget,
as a median over the seeds; ``fits_budget`` says whether it fits on this one. Each run also reports how many
times it went over the training stories (``passes``). ``--holdout-shift K`` moves the file's first
K documents to its end before the run, so that another tenth of the stories is held out (K=5 with
the default 10 %: none of the usual validation stories): a record must hold on stories it never
trained on, whichever they are. ``--keep-runs DIR`` keeps each run's directory (weights,
tokenizer, metrics) as ``DIR/seed<N>``, to sample a record's stories from its own weights.

    python benchmarks/speedrun.py --budget 60 --config configs/tinystories_60s.toml --data tinystories_sample.txt --seeds 1337,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EVAL_LINE = re.compile(r"^eval step (\d+) \|.*\| val bpb ([0-9.]+)")
TRAIN_LINE = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+)")


def run_once(args, out_dir: Path) -> dict:
    # a budget run trains the config's steps: a target the config may carry (the 1.20 speedrun's) is switched off
    target = ["--target-val-bpb", "0" if args.budget else str(args.target)]
    cmd = [
        sys.executable,
        "-m",
        "nanolm",
        "train",
        "--config",
        args.config,
        "--data",
        args.data,
        "--out-dir",
        str(out_dir),
        *target,
        *args.extra,
    ]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    env.setdefault("PYTHONPATH", str(REPO))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    curve, train_curve, lines, phases = [], [], [], {}
    for line in proc.stdout:
        now = round(time.perf_counter() - start, 2)
        lines.append(line.rstrip())
        phases.setdefault("first_output_s", now)  # Python and PyTorch imported, config read
        if line.startswith("model: "):
            phases["data_ready_s"] = now  # tokenizer trained, text tokenized, model built
        m = EVAL_LINE.match(line)
        if m:
            curve.append({"step": int(m.group(1)), "seconds": now, "val_bpb": float(m.group(2))})
        m = TRAIN_LINE.match(line)
        if m:
            train_curve.append({"step": int(m.group(1)), "seconds": now, "loss": float(m.group(2))})
    proc.wait()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"training failed (exit {proc.returncode}):\n" + "\n".join(lines[-20:]))
    # the values themselves from metrics.jsonl (stdout only gives each one its time since launch)
    seen = {row["step"]: row["seconds"] for row in curve}
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [
        {
            "step": r["step"],
            "seconds": seen.get(r["step"]),
            "train_elapsed_s": round(r["elapsed_s"], 2),
            "val_bpb": round(r["val_bpb"], 4),
        }
        for r in rows
        if "val_bpb" in r
    ]
    common = {
        "before_training_s": phases.get("data_ready_s"),
        "launch_to_exit_s": round(wall, 2),
        "final_step": curve[-1]["step"] if curve else None,
        "final_val_bpb": curve[-1]["val_bpb"] if curve else None,
        "child_cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
        "child_peak_rss_mb": round(after.ru_maxrss / 1024, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "curve": curve,  # seconds since launch; step 0 comes after start-up, data preparation and one evaluation
        "train_loss_curve": train_curve,
    }
    if args.budget:
        return {**budget_figures(rows, out_dir, args.budget), **common}
    reached = [row for row in curve if row["val_bpb"] <= args.target]
    seen_at = reached[0]["seconds"] if reached else None
    return {
        "reached_target": bool(reached),
        "training_time_to_target_s": round(seen_at - phases["data_ready_s"], 2) if reached else None,
        "after_target_s": round(wall - seen_at, 2) if reached else None,
        "target_seen_at_s": seen_at,
        "phases": {**phases, "step0_eval_done_s": curve[0]["seconds"] if curve and curve[0]["step"] == 0 else None},
        **common,
    }


def budget_figures(rows, out_dir: Path, budget: float) -> dict:
    """A run of the time-budget track: its training time by its own clock, and how much of the
    training split it saw."""
    last = max((r for r in rows if "loss" in r), key=lambda r: r["step"])
    meta = json.loads((out_dir / "data" / "meta.json").read_text())
    train_tokens = meta["splits"]["train"]["tokens"]
    return {
        "training_time_s": round(last["elapsed_s"], 2),
        "fits_budget": last["elapsed_s"] <= budget,
        "steps": last["step"],
        "tokens_trained": last["tokens"],
        "train_split_tokens": train_tokens,
        "passes": round(last["tokens"] / train_tokens, 2),
    }


def shifted_holdout(data: str, shift: int, separator: str, directory: Path) -> str:
    """A copy of the text file ``data`` with its first ``shift`` documents moved to its end: every
    k-th document is held out (``nanolm.data.sources.split_documents``), so another set of them is."""
    if not Path(data).is_file():
        raise SystemExit(f"error: --holdout-shift moves documents of a text file; --data {data} is not one")
    lines = Path(data).read_text(encoding="utf-8").split("\n")
    docs, current = [], []
    for line in lines:
        if line == separator:
            docs.append(current)
            current = []
        else:
            current.append(line)
    docs.append(current)
    if not 0 < shift < len(docs):
        raise SystemExit(
            f"error: --holdout-shift must be between 1 and {len(docs) - 1} (the file holds {len(docs)} "
            f"documents), got {shift}"
        )
    docs = docs[shift:] + docs[:shift]
    shifted = directory / f"{Path(data).stem}.shift{shift}{Path(data).suffix}"
    shifted.write_text(f"\n{separator}\n".join("\n".join(doc) for doc in docs), encoding="utf-8")
    return str(shifted)


def full_validation_bpb(run_dir: Path, threads: int | None) -> dict:
    """Bits per byte of the final weights on every token of the validation split."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    sys.path.insert(0, str(REPO))
    from nanolm.batches import eval_batches, eval_window_starts
    from nanolm.checkpoint import load_weights
    from nanolm.data.shards import PreparedData
    from nanolm.evaluate import estimate_loss
    from nanolm.model import GPT
    from nanolm.precision import resolve_precision
    from nanolm.run.config import load_run_config

    cfg = load_run_config(run_dir / "config.toml")
    data = PreparedData(run_dir / "data")
    model = GPT(cfg.model.gpt_config(data.tokenizer.vocab_size))
    load_weights(model, run_dir / "model.safetensors")
    batches = eval_batches(
        data.val,
        cfg.model.seq_len,
        64,
        data.tokenizer.eos_id,
        doc_mask=cfg.data.doc_mask,
        reset_positions=cfg.data.reset_positions,
        mask_boundary=cfg.data.mask_boundary,
    )
    with resolve_precision(cfg.train.precision, torch.device("cpu")).autocast():
        result = estimate_loss(model, batches, torch.from_numpy(data.tokenizer.token_bytes()))
    all_windows = len(eval_window_starts(len(data.val.tokens), cfg.model.seq_len)[0])
    return {
        "full_val_bpb": round(result["bpb"], 4),
        "val_tokens": result["tokens"],
        "val_bytes": result["bytes"],
        # the run's own evaluations, in windows (load_run_config resolves --eval-batches and the default)
        "decided_on_the_full_val_split": cfg.train.eval_windows >= all_windows,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data", default="shakespeare", help="tiny-shakespeare: a local path, or 'shakespeare' to download it"
    )
    p.add_argument("--config", default="configs/speedrun_cpu.toml")
    p.add_argument("--target", type=float, default=2.72, help="validation bits per byte to reach")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds of training: the time-budget track (no target; the config's steps must fit)",
    )
    p.add_argument(
        "--holdout-shift",
        type=int,
        default=0,
        help="move the file's first K documents to its end: another tenth of them held out",
    )
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the run (default: PyTorch's)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seeds", default="", help="comma-separated seeds: one run each (× --repeats), --seed passed on")
    p.add_argument(
        "--keep-runs",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep each run's directory (weights, tokenizer, metrics) under DIR, as seed<N> (seed<N>_<i> with --repeats) or run<i>:"
        " a record's stories are sampled from its own weights",
    )
    p.add_argument("extra", nargs="*", help="more flags for nanolm train, after --")
    args = p.parse_args()
    if Path(args.data).exists():
        args.data = str(Path(args.data).resolve())
    if args.budget is not None and not args.budget > 0:
        raise SystemExit(f"error: --budget must be a positive number of seconds, got {args.budget}")
    if args.keep_runs is not None and args.keep_runs.exists():
        if not args.keep_runs.is_dir() or any(args.keep_runs.iterdir()):
            raise SystemExit(f"error: --keep-runs {args.keep_runs} is not empty: name a new directory")
    runs = []
    with tempfile.TemporaryDirectory(prefix="speedrun-") as tmp:
        if args.holdout_shift:
            sys.path.insert(0, str(REPO))
            from nanolm.tokenizer import EOS

            args.data = shifted_holdout(args.data, args.holdout_shift, EOS, Path(tmp))
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or [None]
        flags = args.extra
        for i, seed in enumerate(s for s in seeds for _ in range(args.repeats)):
            run_dir = Path(tmp) / f"run{i}"
            args.extra = flags + (["--seed", str(seed)] if seed is not None else [])
            result = run_once(args, run_dir)
            result["seed"] = seed
            result.update(full_validation_bpb(run_dir, args.threads))
            runs.append(result)
            if args.keep_runs is not None:
                kept = args.keep_runs / (f"seed{seed}" if seed is not None else f"run{i}")
                if args.repeats > 1 and seed is not None:
                    kept = kept.with_name(f"{kept.name}_{i}")
                shutil.copytree(run_dir, kept)
                result["kept_in"] = str(kept)
    if args.budget:
        print(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "config": args.config,
                    "data": args.data,
                    "budget_s": args.budget,
                    "holdout_shift": args.holdout_shift,
                    "threads": args.threads or "default",
                    "cpus": os.cpu_count(),
                    "extra_flags": flags,
                    "median_full_val_bpb": statistics.median(r["full_val_bpb"] for r in runs),
                    "median_training_time_s": statistics.median(r["training_time_s"] for r in runs),
                    "fits_budget": statistics.median(r["training_time_s"] for r in runs) <= args.budget,
                    "passes": statistics.median(r["passes"] for r in runs),
                    "runs": runs,
                },
                indent=2,
            )
        )
        return
    times = [r["training_time_to_target_s"] for r in runs if r["training_time_to_target_s"] is not None]
    whole = [r["launch_to_exit_s"] for r in runs if r["reached_target"]]
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "config": args.config,
                "data": args.data,
                "target_val_bpb": args.target,
                "threads": args.threads or "default",
                "cpus": os.cpu_count(),
                "extra_flags": flags,
                "median_training_time_to_target_s": statistics.median(times) if times else None,
                "median_before_training_s": statistics.median(r["before_training_s"] for r in runs),
                "median_launch_to_exit_s": statistics.median(whole) if whole else None,
                "reached": f"{len(times)}/{len(runs)}",
                "runs": runs,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
