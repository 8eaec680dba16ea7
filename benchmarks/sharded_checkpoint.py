"""Sharded (FSDP) checkpoints: DCP's pickle format against its safetensors storage.

DCP's default format writes ``.metadata`` with ``pickle`` and reads it back with
``pickle.load``, so a crafted checkpoint runs code on load; its safetensors storage
(``HuggingFaceStorageWriter(save_distributed=True)`` / ``HuggingFaceStorageReader``) keeps
each rank's shard in a safetensors file and rebuilds the index from their JSON headers. This
measures what the safe format costs, in the same processes: save and load time of the
weights and Adam's moments of a ~14M-parameter GPT sharded over N ranks (gloo, CPU), then
loads each format on a different world size (resharding) and into one plain process, and
checks every load against the saved tensors. Prints JSON.

    python benchmarks/sharded_checkpoint.py                 # 2 ranks save; 2, 1 and a plain process load
    python benchmarks/sharded_checkpoint.py --ranks 2 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("pickle", "safetensors")


def _shape(big: bool) -> dict:
    return (
        dict(vocab_size=8192, seq_len=64, n_layer=6, n_head=6, n_embd=384)
        if big
        else dict(vocab_size=67, seq_len=32, n_layer=2, n_head=2, n_embd=36)
    )


def worker(args) -> None:
    """One rank: build, shard, take one AdamW step, then save or load in ``args.format``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from nanolm.base.sharded import _untied, load_sharded, save_sharded
    from nanolm.model import GPT, GPTConfig

    dist.init_process_group("gloo")
    torch.manual_seed(0 if args.action == "save" else 1)  # a load starts from other weights
    cfg = GPTConfig(**_shape(args.big))

    def sharded():
        model = GPT(cfg)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = sharded()
    if args.action == "save":
        x = torch.randint(cfg.vocab_size, (2, cfg.seq_len))
        model(x)[0].float().pow(2).mean().backward()
        opt.step()
    path = Path(args.dir) / args.format / "sharded"  # the layout of a checkpoint directory
    start = time.perf_counter()
    if args.action == "save":
        if args.format == "safetensors":
            groups = save_sharded(path, model, opt)
        else:
            model_state, optim_state = get_state_dict(model, opt)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
            groups = {"param_groups": optim_state["param_groups"]}
        seconds = time.perf_counter() - start
        full = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
        if dist.get_rank() == 0:
            torch.save({"weights": full, "groups": groups}, Path(args.dir) / f"reference-{args.format}.pt")
    else:
        ref = torch.load(Path(args.dir) / f"reference-{args.format}.pt", weights_only=True)
        if args.format == "safetensors":
            load_sharded(path.parent, model, opt, ref["groups"])  # reads CHECKPOINT/sharded
        else:
            model_state, optim_state = get_state_dict(model, opt)
            dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
        seconds = time.perf_counter() - start
        full = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
        assert all(torch.equal(full[k], ref["weights"][k]) for k in _untied(full, model)), "a load changed a weight"
    if dist.get_rank() == 0:
        print(json.dumps({"seconds": seconds}))
    del model, opt  # as Distributed.close: nothing may hold the group when it is destroyed (else gloo aborts)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def plain_load(args) -> None:
    """One plain process (what ``nanolm sample`` does with a sharded checkpoint)."""
    import torch

    from nanolm.base.sharded import load_sharded
    from nanolm.model import GPT, GPTConfig

    model = GPT(GPTConfig(**_shape(args.big)))
    start = time.perf_counter()
    load_sharded(Path(args.dir) / "safetensors", model)
    seconds = time.perf_counter() - start
    ref = torch.load(Path(args.dir) / "reference-safetensors.pt", weights_only=True)["weights"]
    assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref), "a plain load changed a weight"
    print(json.dumps({"seconds": seconds}))


def _launch(ranks: int, *argv) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(ranks),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        __file__,
        "--worker",
        *argv,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"a worker failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="processes that save (loads also run on 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true", help="a tiny model (a smoke test of the script)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--action", default="save", help=argparse.SUPPRESS)
    p.add_argument("--format", default="pickle", help=argparse.SUPPRESS)
    p.add_argument("--dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--big", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.plain:
        return plain_load(args)
    size = [] if args.small else ["--big"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            saves, loads, reshards = [], [], []
            for _ in range(args.repeats):
                for old in Path(tmp).iterdir():
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
                saves.append(_launch(args.ranks, "--action", "save", "--format", fmt, "--dir", tmp, *size))
                loads.append(_launch(args.ranks, "--action", "load", "--format", fmt, "--dir", tmp, *size))
                reshards.append(_launch(1, "--action", "load", "--format", fmt, "--dir", tmp, *size))
            files = [f for f in (Path(tmp) / fmt / "sharded").iterdir() if f.is_file()]
            results[fmt] = {
                "save_s_median": round(statistics.median(saves), 3),
                "load_s_median": round(statistics.median(loads), 3),
                f"load_on_1_of_{args.ranks}_s_median": round(statistics.median(reshards), 3),
                "files": sorted(f.name for f in files),
                "mb": round(sum(f.stat().st_size for f in files) / 1e6, 1),
            }
            if fmt == "safetensors":
                r = subprocess.run(
                    [sys.executable, __file__, "--plain", "--dir", tmp, *size],
                    capture_output=True,
                    text=True,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                )
                if r.returncode:
                    raise SystemExit(f"the plain load failed:\n{r.stderr[-3000:]}")
                results[fmt]["plain_process_load_s"] = round(
                    json.loads(r.stdout.strip().splitlines()[-1])["seconds"], 3
                )
    s, pk = results["safetensors"], results["pickle"]
    results["safetensors_over_pickle"] = {
        "save": round(s["save_s_median"] / pk["save_s_median"], 2),
        "load": round(s["load_s_median"] / pk["load_s_median"], 2),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
