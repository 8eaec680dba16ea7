"""Cost of a checkpoint: save time, size on disk, and the resume path's load time.

Builds a ~11M-parameter GPT (6 layers, 384 wide, 2048-token vocabulary by default), takes one AdamW
step so the optimizer state is full, then times ``save_checkpoint`` (fsyncs included) and
the resume path (find the newest valid checkpoint, verify every checksum, load weights,
optimizer, sampler and RNG state). Prints JSON.

    python benchmarks/checkpoint_cost.py
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

import torch

from nanolm.checkpoint import latest_valid_checkpoint, load_state, load_weights, save_checkpoint
from nanolm.machine.runtime import capture_rng, restore_rng
from nanolm.model import GPT, GPTConfig
from nanolm.optim import build_optimizer
from nanolm.tokenizer import train_char


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab_size, seq_len=256, n_layer=args.n_layer, n_head=6, n_embd=args.n_embd))
    opt = build_optimizer(model, 1e-3, 0.1)
    model(torch.randint(args.vocab_size, (2, 64)), targets=torch.randint(args.vocab_size, (2, 64)))[1].backward()
    opt.step()
    tok = train_char(["abc"])
    state = {
        "step": 1,
        "optimizer": opt.state_dict(),
        "sampler": {"epoch": 0, "cursor": 1, "seed": 0},
        "rng": capture_rng("cpu"),
        "counters": {"tokens_seen": 128},
    }
    saves, loads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            start = time.perf_counter()
            path = save_checkpoint(tmp, i + 1, model, state, "[train]\n", tok, keep=2)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            found = latest_valid_checkpoint(tmp)
            fresh = GPT(model.config)
            load_weights(fresh, found / "model.safetensors")
            loaded = load_state(found)
            build_optimizer(fresh, 1e-3, 0.1).load_state_dict(loaded["optimizer"])
            restore_rng(loaded["rng"], "cpu")
            loads.append(time.perf_counter() - start)
        sizes = {f.name: f.stat().st_size for f in path.iterdir()}
    print(
        json.dumps(
            {
                "parameters": model.num_params(),
                "save_s_median": round(statistics.median(saves), 3),
                "resume_load_s_median": round(statistics.median(loads), 3),
                "checkpoint_mb": round(sum(sizes.values()) / 1e6, 2),
                "files_mb": {k: round(v / 1e6, 3) for k, v in sizes.items()},
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
