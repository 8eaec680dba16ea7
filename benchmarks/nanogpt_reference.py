"""The reference the CPU speedrun is timed against: nanoGPT's CPU recipe on tiny-shakespeare.

nanoGPT's README trains a character-level model on a laptop CPU with::

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

and reaches a validation loss of about 1.88 nats per character at the end. This script runs
that command in a checkout of nanoGPT that you provide (nothing of nanoGPT is shipped with
nanolm), on a tiny-shakespeare file you provide, and times it from launch to exit. Its data
step (characters to ids, the first 90 % for training, the rest for validation, as nanoGPT's
``data/shakespeare_char/prepare.py`` does) is done here so that no download and no extra
package is needed; it is timed too and reported apart.

The last 10 % of the file is the validation split of both nanoGPT and nanolm's speedrun, and
tiny-shakespeare is ASCII, so nats per character / ln 2 = bits per byte: nanoGPT's 1.886 is
nanolm's 2.72 bits per byte. nanoGPT estimates its validation loss on 20 random batches of
12 x 64 characters (noisy, ±0.01); nanolm's speedrun decides on the whole split.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanogpt
    python benchmarks/nanogpt_reference.py --nanogpt /tmp/nanogpt --data path/to/tinyshakespeare.txt
    python benchmarks/nanogpt_reference.py --nanogpt /tmp/nanogpt --data tinystories_sample.txt --target 1.20

Any other text works the same way (the TinyStories track states what this plain char model
reaches in the track's time); its bits per byte are nats per character × the validation split's
characters per UTF-8 byte ÷ ln 2, so non-ASCII text compares too. Its validation split is the
last 10 % of the characters, not nanolm's held-out stories: comparable, not identical.

Prints JSON: the wall time (data step + training process), when the validation estimate
first reached the target, and the curve of evaluations (every 250 iterations).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RECIPE = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--dropout=0.0",
]
EVAL_LINE = re.compile(r"^step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)")


def prepare_chars(text: str, out: Path) -> float:
    """Characters to ids in nanoGPT's on-disk format: uint16 ``train.bin``/``val.bin`` and a
    ``meta.pkl`` holding the vocabulary (nanoGPT's train.py reads ``vocab_size`` from it).

    Returns the validation split's characters per UTF-8 byte (1 for ASCII text such as
    tiny-shakespeare), which turns nanoGPT's nats per character into bits per byte."""
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    split = int(len(text) * 0.9)
    out.mkdir(parents=True, exist_ok=True)
    ids[:split].tofile(out / "train.bin")
    ids[split:].tofile(out / "val.bin")
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return (len(text) - split) / len(text[split:].encode("utf-8"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", required=True, help="a checkout of https://github.com/karpathy/nanoGPT")
    p.add_argument(
        "--data",
        required=True,
        help="tiny-shakespeare (input.txt of char-rnn, 1,115,394 bytes), or any "
        "UTF-8 text to train the same char model on",
    )
    p.add_argument(
        "--target",
        type=float,
        default=2.72,
        help="validation bits per byte (bits per character on ASCII text such as tiny-shakespeare)",
    )
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the run (default: PyTorch's)")
    p.add_argument("--max-iters", type=int, default=2000, help="the recipe's 2000; fewer for a quick check")
    args = p.parse_args()
    repo = Path(args.nanogpt).resolve()
    if not (repo / "train.py").is_file() or not (repo / RECIPE[0]).is_file():
        raise SystemExit(f"error: {repo} is not a nanoGPT checkout (no train.py and {RECIPE[0]})")
    text = Path(args.data).read_text(encoding="utf-8")

    start = time.perf_counter()
    chars_per_byte = prepare_chars(text, repo / "data" / "shakespeare_char")
    data_s = time.perf_counter() - start
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # nanoGPT prints without flushing: each line is timed when it arrives
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    out_dir = Path("/tmp") / f"nanogpt-reference-{os.getpid()}"
    iters = [f"--max_iters={args.max_iters}", f"--lr_decay_iters={args.max_iters}"]
    cmd = [sys.executable, "train.py", *RECIPE, *iters, f"--out_dir={out_dir}"]
    curve = []
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        m = EVAL_LINE.match(line)
        if m:
            val = float(m.group(3))
            curve.append(
                {
                    "iter": int(m.group(1)),
                    "seconds": round(time.perf_counter() - start, 2),
                    "val_loss": val,
                    "val_bpb": round(val / math.log(2) * chars_per_byte, 4),
                }
            )
    proc.wait()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit("nanoGPT failed:\n" + "\n".join(tail))
    reached = [c for c in curve if c["val_bpb"] <= args.target]
    print(
        json.dumps(
            {
                "command": " ".join(cmd),
                "wall_s": round(wall, 2),
                "data_step_s": round(data_s, 2),
                "val_chars_per_byte": round(chars_per_byte, 5),
                "target_val_bpb": args.target,
                "target_seen_at_s": reached[0]["seconds"] if reached else None,
                "final_val_bpb": curve[-1]["val_bpb"] if curve else None,
                "curve": curve,
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
