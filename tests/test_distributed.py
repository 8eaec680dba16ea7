"""Data parallelism: two ranks under torchrun (gloo, CPU) train the run one process trains.

The runs are tiny (one layer, six steps) so that the whole file takes well under a minute on
two cores; what they check does not depend on size: the loss normalised over every rank's
counted tokens, gradients summed (not averaged) once per step, clipping on the global norm,
checkpoints that resume exactly, and a world-size change that continues the same run.
"""

import datetime
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import REPO, HostReads, tiny_model
from safetensors.torch import load_file

from nanolm.base.lock import LOCK_FILE, RunLock
from nanolm.batches import Batch, WindowSampler, pack_windows
from nanolm.checkpoint import load_run_checkpoint, load_state, save_run_checkpoint
from nanolm.data.shards import PreparedData
from nanolm.distributed import Distributed
from nanolm.errors import NanolmError
from nanolm.instruments.cli import main
from nanolm.optim import build_optimizer, muon_available
from nanolm.run.config import RunConfig
from nanolm.run.final import load_run
from nanolm.step import StepSetup, accumulate_gradients, counted_tokens, train_step
from nanolm.tokenizer import train_char
from nanolm.watch.sinks import read_metrics

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)

TIMING = {"tokens_per_sec", "elapsed_s", "mfu", "eta_s", "rss_mb", "cuda_max_alloc_mb", "peak_flops", "threads"}
SHAPE = ["--tokenizer", "char", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32"]
RUN = [
    *SHAPE,
    "--steps",
    "6",
    "--eval-every",
    "3",
    "--log-every",
    "1",
    "--sample-tokens",
    "0",
    "--mask-boundary",
    "--lr",
    "1e-2",
    "--clip",
    "0.5",
    "--ckpt-every",
    "3",
    "--keep",
    "0",
]
ONE_PROCESS = ["--batch-size", "2", "--grad-accum", "2", "--eval-batches", "2"]  # 4 windows per step
TWO_RANKS = ["--batch-size", "2", "--grad-accum", "1", "--eval-batches", "1"]  # 2 windows per rank per step
CLIP = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args, nproc=2, timeout=300) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 -m nanolm.train ARGS`` on loopback, importing this checkout."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if sys.platform == "linux":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        "-m",
        "nanolm.train",
        *map(str, args),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _rows(run_dir, after=0):
    return [
        {k: v for k, v in r.items() if k not in TIMING}
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r["step"] > after
    ]


def _weights(path):
    return load_file(str(path))


def _max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


def _norm_rel(a: dict, b: dict) -> float:
    """The largest ‖a - b‖ / ‖b‖ over the tensors."""
    assert a.keys() == b.keys()
    return max((torch.linalg.vector_norm(a[k] - b[k]) / torch.linalg.vector_norm(b[k])).item() for k in a)


def _assert_same_run(rows, ref_rows, rel=1e-6):
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]
    for r, ref in zip(rows, ref_rows):
        assert r.get("tokens") == ref.get("tokens"), r["step"]  # every rank's tokens counted, once
        for key in ("loss", "grad_norm", "val_loss"):
            if key in ref:
                assert r[key] == pytest.approx(ref[key], rel=rel), (r["step"], key)


@pytest.fixture(scope="module")
def uneven_corpus(tmp_path_factory):
    """Long documents alternating with runs of one-letter ones.

    With ``--mask-boundary`` the token after each EOS is not counted, so a window inside a
    long document counts almost every position and one among the one-letter documents about
    half: the ranks hold very different numbers of counted tokens.
    """
    rng = random.Random(0)
    docs = []
    for i in range(40):
        docs.append(" ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "and", "ran"]) for _ in range(45)))
        docs.extend(rng.choice("abcdefgh") for _ in range(40))
    path = tmp_path_factory.mktemp("uneven") / "uneven.txt"
    path.write_text("\n<|endoftext|>\n".join(docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, uneven_corpus):
    out = tmp_path_factory.mktemp("one") / "run"
    assert main(["train", "--data", str(uneven_corpus), "--out-dir", str(out), *RUN, *ONE_PROCESS]) == 0
    return out


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, uneven_corpus):
    out = tmp_path_factory.mktemp("ddp") / "run"
    _ok(torchrun("--data", uneven_corpus, "--out-dir", out, *RUN, *TWO_RANKS, "--dist", "ddp"))
    return out


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, uneven_corpus):
    out = tmp_path_factory.mktemp("fsdp") / "run"
    _ok(torchrun("--data", uneven_corpus, "--out-dir", out, *RUN, *TWO_RANKS, "--dist", "fsdp"))
    return out


def _counts_per_rank(run_dir, steps=6, world_size=2):
    data = PreparedData(run_dir / "data")
    samplers = [
        WindowSampler(len(data.train), 32, 2, seed=RunConfig().train.seed, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    return [
        [
            int(pack_windows(data.train.tokens, s.next_starts(), 32, data.tokenizer.eos_id, mask_boundary=True).counted)
            for s in samplers
        ]
        for _ in range(steps)
    ]


# ------------------------------------------------------------------ 2 ranks == 1 process
@pytest.mark.kernels
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process_with_twice_the_accumulation(mode, one_process, request):
    """Same losses (each the mean over both ranks' counted tokens), same gradient norms
    before clipping, same validation loss, same final weights, with uneven counts per rank."""
    run = request.getfixturevalue(f"{mode}_run")
    counts = _counts_per_rank(run)
    assert max(max(c) / min(c) for c in counts) > 1.5, counts  # the ranks' counts really differ
    rows, ref = _rows(run), _rows(one_process)
    _assert_same_run(rows, ref)
    assert all(r["grad_norm"] > CLIP for r in ref if "grad_norm" in r)  # clipping acted on every step
    _assert_same_weights(mode, _weights(run / "model.safetensors"), _weights(one_process / "model.safetensors"))


@pytest.mark.kernels
@pytest.mark.skipif(not muon_available(), reason="torch.optim.Muon needs PyTorch >= 2.9")
def test_muon_on_two_ranks_equals_one_process_with_twice_the_accumulation(tmp_path, uneven_corpus):
    """Under DDP every rank orthogonalises the same all-reduced gradient, so Muon's update is
    the one a single process computes on the whole batch."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert (
        main(["train", "--data", str(uneven_corpus), "--out-dir", str(one), *RUN, *ONE_PROCESS, "--optimizer", "muon"])
        == 0
    )
    _ok(torchrun("--data", uneven_corpus, "--out-dir", two, *RUN, *TWO_RANKS, "--dist", "ddp", "--optimizer", "muon"))
    _assert_same_run(_rows(two), _rows(one))
    _assert_same_weights("ddp", _weights(two / "model.safetensors"), _weights(one / "model.safetensors"))


def _assert_same_weights(mode: str, ours: dict, theirs: dict) -> None:
    if mode == "ddp":  # the same sums in the same order: equal to the last bit in practice
        assert _max_rel(ours, theirs) < 1e-6
    else:
        # FSDP's reduce-scatter adds the two ranks' gradients in another order than one process's
        # accumulation: a few float32 ULPs per step, which six Adam steps at lr 1e-2 carry to
        # ~1e-7..1.5e-6 on the worst single element depending on the AdamW kernel (measured:
        # foreach 1.8e-7, fused 1.4e-6). The tensors as a whole agree to 1e-6; a real
        # normalisation bug (a missing factor of 2, a mean of means) is off by > 1e-2.
        assert _norm_rel(ours, theirs) < 1e-6
        assert _max_rel(ours, theirs) < 1e-5


def test_ddp_checkpoints_have_the_single_process_layout_and_every_rank_rng(ddp_run, one_process):
    ddp, single = ddp_run / "checkpoints" / "step_000003", one_process / "checkpoints" / "step_000003"
    assert sorted(json.loads((ddp / "meta.json").read_text())["files"]) == sorted(
        json.loads((single / "meta.json").read_text())["files"]
    )
    assert json.loads((ddp / "meta.json").read_text())["world_size"] == 2
    state = load_state(ddp)
    assert len(state["rng_ranks"]) == 2
    assert not torch.equal(state["rng_ranks"][0]["torch"], state["rng_ranks"][1]["torch"])  # own dropout stream


def test_fsdp_writes_shards_and_one_whole_model_that_nanolm_can_load(fsdp_run):
    checkpoint = fsdp_run / "checkpoints" / "step_000006"
    files = json.loads((checkpoint / "meta.json").read_text())["files"]
    assert "model.safetensors" not in files
    shards = [name for name in files if name.startswith("sharded/")]
    assert len(shards) == 2 and all(name.endswith(".safetensors") for name in shards)  # one per rank, no pickle
    assert json.loads((checkpoint / "meta.json").read_text())["layout"] == "sharded"
    whole, _, _ = load_run(fsdp_run)
    (fsdp_run / "model.safetensors").rename(fsdp_run / "final.safetensors")  # now load_run reads the shards
    try:
        from_shards, _, _ = load_run(fsdp_run)
    finally:
        (fsdp_run / "final.safetensors").rename(fsdp_run / "model.safetensors")
    a, b = whole.state_dict(), from_shards.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Exploit:
    marker = None

    def __reduce__(self):
        return (os.system, (f"touch {_Exploit.marker}",))


@pytest.mark.parametrize("vouched", [False, True], ids=["damaged", "attacked"])
def test_a_crafted_pickle_in_any_file_of_a_sharded_checkpoint_runs_nothing(fsdp_run, tmp_path, capsys, vouched):
    """DCP's own format would unpickle ``sharded/.metadata``; nanolm's shards are safetensors
    files whose index is rebuilt from their JSON headers, so nothing in them can run."""
    import pickle
    import shutil

    from nanolm.base.files import sealed, sha256_file

    _Exploit.marker = tmp_path / "code-ran"
    original = fsdp_run / "checkpoints" / "step_000006"
    names = sorted(p.relative_to(original).as_posix() for p in original.rglob("*") if p.is_file())
    assert sum(n.startswith("sharded/") for n in names) == 2
    for rel in [*names, "sharded/.metadata"]:  # every file, and DCP's pickled index slipped in
        copy = tmp_path / "checkpoints" / "step_000006"
        shutil.rmtree(copy.parent, ignore_errors=True)
        shutil.copytree(original, copy)
        (copy / rel).write_bytes(pickle.dumps({"payload": _Exploit()}, protocol=2))
        if vouched and rel != "meta.json":
            meta = json.loads((copy / "meta.json").read_text())
            meta.pop("seal")
            meta["files"][rel] = sha256_file(copy / rel)
            (copy / "meta.json").write_text(json.dumps(sealed(meta)))
        code = main(["sample", "--run", str(copy), "--max-new-tokens", "4"])
        err = capsys.readouterr().err.strip().splitlines()
        assert not _Exploit.marker.exists(), rel
        if rel == "state.pt" and vouched:  # sample reads the weights only; a resume reads state.pt too
            assert code == 0
            with pytest.raises(NanolmError, match="must not contain code"):
                load_state(copy)
            assert not _Exploit.marker.exists()
            continue
        assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (rel, err)


# ------------------------------------------------------------------ resuming
def test_ddp_resume_after_sigkill_is_bit_identical(tmp_path, uneven_corpus, ddp_run):
    """Both ranks die right after the checkpoint of step 3; the same command continues."""
    args = ["--data", uneven_corpus, *RUN, *TWO_RANKS, "--dist", "ddp", "--out-dir", tmp_path / "run"]
    killed = torchrun(*args, "--debug-kill-after-checkpoint", 3)
    assert killed.returncode != 0 and not (tmp_path / "run" / "model.safetensors").exists()
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000003"
    r = _ok(torchrun(*args))
    assert "resumed from" in r.stdout
    a, b = _weights(ddp_run / "model.safetensors"), _weights(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(tmp_path / "run") == _rows(ddp_run)


def test_under_torchrun_rank_0_holds_the_one_lock_and_every_rank_follows_its_refusal(tmp_path, uneven_corpus):
    """One lock per run, whatever the number of processes: rank 0 takes it while it plans,
    the other ranks take none and stop with rank 0's refusal, before anything is written."""
    out = tmp_path / "run"
    with RunLock() as live:  # as if another run were writing there
        live.take(out)
        r = torchrun("--data", uneven_corpus, "--out-dir", out, *RUN, *TWO_RANKS, "--dist", "ddp")
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    refusal = f"error: {out} is being written by process {os.getpid()}"
    # each rank says it once; two ranks writing to one stderr at once may share a line
    assert r.returncode != 0 and r.stderr.count(refusal) == 2, r.stderr[-3000:]


def test_fsdp_resume_from_a_sharded_checkpoint_is_bit_identical(tmp_path, fsdp_run, uneven_corpus):
    out = tmp_path / "resumed"
    _ok(
        torchrun(
            "--data",
            uneven_corpus,
            "--out-dir",
            out,
            *RUN,
            *TWO_RANKS,
            "--dist",
            "fsdp",
            "--resume",
            fsdp_run / "checkpoints" / "step_000003",
        )
    )
    a, b = _weights(fsdp_run / "model.safetensors"), _weights(out / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(out) == _rows(fsdp_run, after=3)


@pytest.mark.kernels
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_resuming_two_ranks_on_one_process_with_the_same_global_batch_continues_the_run(
    mode, request, tmp_path, one_process, uneven_corpus, capsys
):
    """2 ranks × batch 2 → 1 process × batch 2 × accumulation 2: the same windows, the same
    gradient; FSDP's shards are gathered by torch.distributed.checkpoint in one process."""
    run = request.getfixturevalue(f"{mode}_run")
    out = tmp_path / "continued"
    assert (
        main(
            [
                "train",
                "--data",
                str(uneven_corpus),
                "--out-dir",
                str(out),
                *RUN,
                *ONE_PROCESS,
                "--dist",
                "none",
                "--resume",
                str(run / "checkpoints" / "step_000003"),
            ]
        )
        == 0
    )
    assert "world size: 2 -> 1" in capsys.readouterr().out
    _assert_same_run(_rows(out), _rows(one_process, after=3))
    _assert_same_weights(mode, _weights(out / "model.safetensors"), _weights(one_process / "model.safetensors"))


def test_resuming_with_a_different_global_batch_is_refused(ddp_run, tmp_path, uneven_corpus, capsys):
    out = tmp_path / "refused"
    code = main(
        [
            "train",
            "--data",
            str(uneven_corpus),
            "--out-dir",
            str(out),
            *RUN,
            *TWO_RANKS,
            "--resume",
            str(ddp_run / "checkpoints" / "step_000003"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "world size: 2 -> 1" in err and "= 4 -> " in err and "= 2 windows per step" in err
    assert not out.exists()


def test_fsdp_refuses_a_checkpoint_with_full_weights():
    saved, new = RunConfig(), RunConfig()
    _, _, refused = Distributed("fsdp", world_size=2).resume_rules({"world_size": 2, "layout": "single"}, saved, new)
    assert any("sharded" in line for line in refused)
    _, _, refused = Distributed("ddp", world_size=2).resume_rules({"world_size": 2, "layout": "sharded"}, saved, new)
    assert refused == []


# ------------------------------------------------------------------ misuse
def test_dist_ddp_without_torchrun_is_a_one_line_error(tmp_path, capsys):
    assert main(["train", "--out-dir", str(tmp_path / "x"), "--dist", "ddp"]) == 2
    err = capsys.readouterr().err
    assert "torchrun" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_dist_none_under_torchrun_with_several_processes_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["train", "--out-dir", str(tmp_path / "x"), "--dist", "none"]) == 2
    assert "--dist ddp or fsdp" in capsys.readouterr().err


def test_fsdp_with_pure_bf16_is_refused(tmp_path, capsys):
    assert main(["train", "--out-dir", str(tmp_path / "x"), "--dist", "fsdp", "--precision", "bf16-pure"]) == 2
    assert "bf16-pure" in capsys.readouterr().err


# ------------------------------------------------------------------ the gradient itself
def _uneven_micro_batches(n=4, rows=2, T=16, V=64):
    """n micro-batches whose counted tokens differ widely (one counts nothing at all)."""
    g = torch.Generator().manual_seed(0)
    counted = torch.tensor([0, 0, 1, 16, 3, 16, 7, 2, 16, 16, 5, 9, 12, 0, 4, 16])[: n * rows]
    out = []
    for i in range(n):
        idx = torch.randint(V, (rows, T), generator=g)
        targets = torch.randint(V, (rows, T), generator=g)
        mask = torch.arange(T)[None, :] < counted[i * rows : (i + 1) * rows, None]
        out.append(Batch(idx, targets, mask))
    return out


def _full_grads(model) -> dict:
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.named_parameters()
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _worker(rank, world_size, port, result_dir):
    """One rank of a 2-process gloo group: the gradient of one step, and the agreement helpers."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    result = {}
    try:
        micro = _uneven_micro_batches()
        reference = tiny_model(seed=0)
        ref_count = counted_tokens(micro)
        ref_loss = accumulate_gradients(reference, micro, ref_count) / ref_count  # 1 process, accumulation 4
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        ref_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm().item()
        mine = micro[2 * rank : 2 * rank + 2]  # 2 ranks, accumulation 2
        local = counted_tokens(mine)
        for mode in ("ddp", "fsdp"):
            ctx = Distributed(mode, torch.device("cpu"), rank, world_size)
            model = tiny_model(seed=rank)  # different on each rank: the wrapper must start all from rank 0's
            wrapped = ctx.wrap(model)
            count = ctx.sum_async(local)  # an all-reduce under way; accumulate_gradients waits for it
            loss = ctx.global_mean(accumulate_gradients(wrapped, mine, count, across_ranks=True), count.value())
            grads = _full_grads(model)
            norm = ctx.clip_grad_norm_(model, 0.1 * ref_norm)  # clipped to a tenth
            clipped = _full_grads(model)
            scale = 0.1 * ref_norm / (ref_norm + 1e-6)
            result[mode] = {
                "grad": max(_rel(grads[n], g) for n, g in ref_grads.items()),
                "clipped": max(_rel(clipped[n], scale * g) for n, g in ref_grads.items()),
                "loss": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
                "norm": abs(norm.item() - ref_norm) / ref_norm,
            }
        for mode in ("ddp", "fsdp"):  # a whole step, its reads counted (guard none: it reads nothing)
            ctx = Distributed(mode, torch.device("cpu"), rank, world_size)
            model = tiny_model(seed=0)
            wrapped = ctx.wrap(model)
            setup = StepSetup(
                model, build_optimizer(model, 1e-3, 0.1), schedule=lambda step: 1e-3, step_model=wrapped, dist=ctx
            )
            with HostReads() as counter:
                counter.at(1)
                train_step(setup, 1, mine)
            result[mode]["step_reads"] = counter.reads
            ctx = Distributed(mode, torch.device("cpu"), rank, world_size)
            model = tiny_model(seed=0)
            ctx.wrap(model)
            optimizer = torch.optim.AdamW(model.parameters())
            torch.manual_seed(1000 + rank)
            state = {"step": 1, "sampler": {"epoch": 0, "cursor": 0, "seed": 0}, "counters": {}}
            saved = save_run_checkpoint(
                ctx, result_dir / mode, 1, model, optimizer, state, "[train]\n", train_char(["ab"])
            )
            expected = torch.rand(3)
            torch.rand(5)
            load_run_checkpoint(ctx, saved, load_state(saved), model, optimizer)
            result[mode]["rng_restored"] = torch.equal(torch.rand(3), expected)
            result[mode]["rng_differs"] = not torch.equal(*[r["torch"] for r in load_state(saved)["rng_ranks"]])
        ctx = Distributed("ddp", torch.device("cpu"), rank, world_size)
        result["signal"] = ctx.first_signal(signal.SIGTERM if rank == 1 else None)
        ran = []
        try:
            with ctx.main_first():
                ran.append(rank)
                if rank == 0:
                    raise NanolmError("rank 0 cannot read the data")
        except NanolmError as e:
            result["main_first"] = {"error": str(e), "ran": ran}
        try:
            ctx.from_main(lambda: 1 / 0)
        except Exception as e:
            result["from_main"] = type(e).__name__ + ": " + str(e)
        result["broadcast"] = ctx.from_main(lambda: f"decided on rank {rank}")
    finally:
        (result_dir / f"rank{rank}.json").write_text(json.dumps(result))
        gc.collect()  # DDP's reducer sits in a reference cycle; freed after the group is gone, it aborts the process
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """What each of two ranks saw (a dict per rank)."""
    out = tmp_path_factory.mktemp("spawn")
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ranks_gradients_sum_to_the_whole_batch_gradient_with_accumulation(mode, two_ranks):
    """Each rank divides by the global count; the ranks' gradients are summed, not averaged,
    once, after the last micro-batch; clipping uses the global norm; every rank starts from
    rank 0's weights (they were initialised differently here)."""
    for rank, result in enumerate(two_ranks):
        for key in ("grad", "clipped", "loss", "norm"):
            assert result[mode][key] < 1e-6, (rank, key, result[mode])


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_ranks_step_waits_for_no_host_read_of_the_token_count(mode, two_ranks):
    """The step's token count is summed over ranks by an asynchronous all-reduce of a device
    tensor and divides the loss there: no rank reads it back (a GPU would wait for the whole
    queue before the first forward pass). Without a guard, a whole step reads nothing."""
    assert [r[mode]["step_reads"] for r in two_ranks] == [[], []]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_each_rank_resumes_its_own_random_stream(mode, two_ranks):
    """Dropout draws from each rank's own generator: a resumed rank must continue its own
    stream, not rank 0's."""
    assert all(r[mode]["rng_restored"] and r[mode]["rng_differs"] for r in two_ranks)


def test_a_stop_signal_on_one_rank_stops_every_rank(two_ranks):
    assert [r["signal"] for r in two_ranks] == [signal.SIGTERM, signal.SIGTERM]


def test_a_failure_on_rank_zero_reaches_every_rank_with_its_message(two_ranks):
    """Otherwise the other ranks would wait for rank 0 at their next collective."""
    assert [r["main_first"] for r in two_ranks] == [
        {"error": "rank 0 cannot read the data", "ran": [0]},
        {"error": "rank 0 cannot read the data", "ran": []},
    ]
    assert two_ranks[0]["from_main"].startswith("ZeroDivisionError")
    assert two_ranks[1]["from_main"].startswith("_RemoteFailure: rank 0 failed")
    assert [r["broadcast"] for r in two_ranks] == ["decided on rank 0"] * 2


# ------------------------------------------------------------------ on GPUs (benchmarks/gpu_check.sh)
@pytest.mark.kernels
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_nccl_ranks_on_gpus_equal_one_process(mode, tmp_path, uneven_corpus):
    """The same check over NCCL, one process per GPU (two GPUs, or one rank with twice the
    accumulation on a single GPU), in fp32 with deterministic kernels."""
    n = min(2, torch.cuda.device_count())
    gpu = ["--device", "cuda", "--precision", "fp32", "--attention", "sdpa", "--deterministic"]
    single, ranks = tmp_path / "one", tmp_path / "ranks"
    assert main(["train", "--data", str(uneven_corpus), "--out-dir", str(single), *RUN, *gpu, *ONE_PROCESS]) == 0
    r = _ok(
        torchrun(
            "--data",
            uneven_corpus,
            "--out-dir",
            ranks,
            *RUN,
            *gpu,
            "--batch-size",
            2,
            "--grad-accum",
            2 // n,
            "--eval-batches",
            2 // n,
            "--dist",
            mode,
            nproc=n,
        )
    )
    assert "(nccl)" in r.stdout
    _assert_same_run(_rows(ranks), _rows(single), rel=1e-5)
    assert _max_rel(_weights(ranks / "model.safetensors"), _weights(single / "model.safetensors")) < 1e-5
