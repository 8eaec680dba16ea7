"""Data parallelism under torchrun: DDP and FSDP2, numerically the same run as one process.

N processes (ranks) each take a slice of every batch and combine their gradients before the
optimizer steps; done right, the step is the one a single process would take on the whole
batch, and nanolm's tests check exactly that. Without torchrun nanolm is one process and none
of this module does anything. How the loss is normalised across ranks (one all-reduce of the
token count, gradients *summed*, not averaged), why the reduction runs once per step, how
clipping, checkpoints and a resume on another world size work: docs/distributed.md, told once;
the functions below say what each guarantees.

    torchrun --nproc_per_node 8 -m nanolm.train --dist ddp ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import NanolmError
from .machine.runtime import derived_seed, seed_everything

SPLIT_OPTIONS = {"batch_size", "grad_accum"}
"""Options that only say how the global batch is split; they may change on resume."""


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) as torchrun sets them, or None for a plain process."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    except ValueError:
        raise NanolmError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (they are set by torchrun)") from None


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Reduce gradients across ranks in the backward pass inside this block, or hold them.

    Enter it *before* the forward pass: DDP decides in the forward whether the coming
    backward reduces. A model that is not distributed ignores it.
    """
    inner = getattr(model, "_orig_mod", model)
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        with contextlib.nullcontext() if enabled else inner.no_sync():
            yield
        return
    if hasattr(inner, "set_requires_gradient_sync"):
        inner.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)
        return
    yield


def _sum_gradients(process_group, bucket):
    """DDP communication hook: sum each gradient bucket across ranks, without dividing by N.

    Each rank's gradient is already divided by the global count of counted tokens, so the
    sum is the gradient of the global mean loss.
    """
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@dataclass
class PendingSum:
    """A sum over ranks that may still be under way (:meth:`Distributed.sum_async`).

    ``value()`` waits for it and returns it: a Python int on one process, an int64 device
    tensor under torchrun. On a GPU the wait is the device's (NCCL's stream joins the
    current one), not the host's: nothing is read back.
    """

    total: int | torch.Tensor
    work: object = None

    def value(self) -> int | torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.total


class Muted:
    """Stands in for rank 0's outputs (metrics file, log) on the other ranks: does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def __call__(self, *args, **kwargs):
        return None


class _RemoteFailure(Exception):
    """Raised on the ranks that did not fail, with the failing rank's message."""


@dataclass
class Distributed:
    """This process's place in the run: its rank, the world size, the mode and its device.

    A single process (no torchrun) is ``Distributed("none", device)``: rank 0 of 1, and the
    collectives the loop calls return their input untouched, so the loop has one code path.
    The step's own (:meth:`sum_async`, :meth:`global_mean`, the sharded clip) run only under
    torchrun: ``train_step`` says so with ``if dist.active``.
    """

    mode: str = "none"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    active: bool = field(init=False)  # a process group exists (torchrun, --dist ddp or fsdp)
    sharded: bool = field(init=False)  # FSDP: each rank holds a shard of every parameter

    def __post_init__(self):
        # plain attributes, not properties: the step reads them, and reads nothing else of this file on one process
        self.active, self.sharded = self.mode != "none", self.mode == "fsdp"

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes the run directory and decides; the others follow."""
        return self.rank == 0

    def describe(self) -> str:
        if not self.active:
            return "one process"
        backend = dist.get_backend()
        return f"{self.mode} over {self.world_size} processes ({backend}); this is rank {self.rank}"

    # ------------------------------------------------------------------ collectives
    def sum(self, value):
        """The sum of a number over all ranks (a float64 all-reduce; exact for counts)."""
        if not self.active:
            return value
        t = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return type(value)(t.item()) if isinstance(value, int) else t.item()

    def sum_async(self, count: int) -> PendingSum:
        """Start summing a count over all ranks, without waiting for it and without a host
        read: :meth:`PendingSum.value` gives the sum when it is needed.

        The step's token count is needed at its first backward pass, not before: its
        all-reduce (of an int64 on the device, exact) runs while the first forward pass is
        computed. Under torchrun only: on one process the count is already the sum, and the
        step keeps it a Python int.
        """
        local = torch.tensor(count, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        local = local.to(self.device, non_blocking=True)  # from pinned memory: no wait for the device's queue
        return PendingSum(local, dist.all_reduce(local, async_op=True))

    def global_mean(self, local_sum: torch.Tensor, global_count: int | torch.Tensor) -> torch.Tensor:
        """The mean over every rank's counted tokens: the ranks' sums added, then divided by
        the global count (not the mean of the ranks' means: a rank with few counted tokens
        must weigh less). ``global_count`` is the device tensor :meth:`sum_async` gave (no host
        read). Under torchrun only: on one process the step divides by its own count."""
        total = local_sum.detach().double()
        dist.all_reduce(total)
        return (total / global_count.clamp(min=1)).float()

    def first_signal(self, requested: int | None) -> int | None:
        """A stop signal seen by any rank, so that every rank stops after the same step."""
        if not self.active:
            return requested
        t = torch.tensor(requested or 0, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item()) or None

    def sum_tensors(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tensors summed over all ranks (in place)."""
        if self.active:
            for t in tensors:
                dist.all_reduce(t)
        return tensors

    def share_of(self, batches: list) -> list:
        """This rank's share of a fixed list of batches: every world_size-th one.

        Evaluation splits the validation set this way, and :meth:`sum_tensors` adds up the
        ranks' totals: the set is the one a single process with the global batch evaluates,
        in 1/N of the time. Under FSDP every rank must run as many forward passes as the
        others (each one gathers weights from all ranks), so a short share is topped up with
        a batch that counts no token.
        """
        if not self.active:
            return batches
        mine = batches[self.rank :: self.world_size]
        if self.sharded and batches:
            blank = dataclasses.replace(batches[0], loss_mask=torch.zeros_like(batches[0].loss_mask))
            mine += [blank] * (math.ceil(len(batches) / self.world_size) - len(mine))
        return mine

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (any picklable value)."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def from_main(self, fn):
        """Run ``fn`` on rank 0 only; every rank returns its result (sent to the others, so
        small and picklable) or raises its error.

        Without the error travelling, a failure on rank 0 would leave the other ranks
        waiting forever at their next collective.
        """
        if not self.active:
            return fn()
        result = error = None
        if self.is_main:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after telling the others
                error = e
        result, failure = self.broadcast((result, None if error is None else _describe(error)))
        if error is not None:
            raise error
        if failure is not None:
            raise _as_error(failure, rank=0)
        return result

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block, then the other ranks do (finding what rank 0 wrote).

        A failure on any rank is raised on every rank, with its message, so that all stop.
        """
        if not self.active:
            yield
            return
        if self.is_main:
            try:
                yield
            except BaseException as e:
                self.all_gather(_describe(e))
                raise
            self.all_gather(None)
            failures = self.all_gather(None)
        else:
            failures = self.all_gather(None)
            if failures[0] is not None:
                raise _as_error(failures[0], rank=0)
            try:
                yield
            except BaseException as e:
                self.all_gather(_describe(e))
                raise
            failures = self.all_gather(None)
        for rank, failure in enumerate(failures):
            if failure is not None and rank != self.rank:
                raise _as_error(failure, rank)

    # ------------------------------------------------------------------ the model
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the training step calls: DDP around the GPT, or the GPT sharded in place.

        Under FSDP the optimizer must be built *after* this call, on the sharded parameters.
        """
        if self.mode == "ddp":
            DDP = torch.nn.parallel.DistributedDataParallel
            # the only buffers are the RoPE tables, identical everywhere: no need to resend them every forward
            quiet = (
                "forward_sync_buffers"
                if "forward_sync_buffers" in inspect.signature(DDP).parameters
                else "broadcast_buffers"
            )
            ddp = DDP(
                model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                **{quiet: False},
            )
            ddp.register_comm_hook(None, _sum_gradients)
            return ddp
        if self.mode == "fsdp":
            from torch.distributed.fsdp import FSDPModule, fully_shard

            with torch.no_grad():  # every shard must come from the same initial weights
                for tensor in model.state_dict().values():
                    dist.broadcast(tensor, src=0)
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
            return model
        return model

    def reshard(self, model: torch.nn.Module) -> None:
        """Free the gathered weights FSDP keeps after a forward pass with no backward (an
        evaluation): its root module holds them for the backward pass that usually follows."""
        if self.sharded:
            model.reshard()

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm to ``max_norm``; returns the norm before clipping."""
        if not self.sharded:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def seed_this_rank(self, seed: int) -> None:
        """Give every rank but rank 0 its own random stream (dropout), after the model is built.

        Rank 0 keeps the stream one process would have. Were all ranks seeded alike, they
        would all draw the same dropout mask for different data.
        """
        if self.rank:
            seed_everything(derived_seed(seed, self.rank))

    def resume_rules(self, meta: dict, saved_cfg, cfg) -> tuple[set[str], list[str], list[str]]:
        """How resuming a checkpoint (its ``meta.json``) in this world may differ from its run.

        Returns (options that may change, allowed changes, refused changes): the split of the
        global batch may change as long as the global batch does not.
        """
        saved_world = int(meta.get("world_size", 1))
        s, t = saved_cfg.train, cfg.train
        before = s.batch_size * s.grad_accum * saved_world
        after = t.batch_size * t.grad_accum * self.world_size
        allowed, refused = [], []
        if saved_world != self.world_size:
            line = (
                f"world size: {saved_world} -> {self.world_size} (global batch: batch_size × grad_accum × "
                f"world size = {s.batch_size}×{s.grad_accum}×{saved_world} = {before} -> "
                f"{t.batch_size}×{t.grad_accum}×{self.world_size} = {after} windows per step)"
            )
            (allowed if before == after else refused).append(line)
        if meta.get("layout", "single") == "single" and self.sharded:
            refused.append(
                "dist: the checkpoint holds full weights (--dist none or ddp); --dist fsdp resumes only "
                "sharded checkpoints"
            )
        return (SPLIT_OPTIONS if before == after else set()), allowed, refused

    def close(self, failed: bool = False) -> None:
        """Leave the process group. DDP's gradient reducer sits in a reference cycle and holds
        the group; collected only at interpreter exit, after the group is gone, it aborts the
        process ("terminate called without an active exception") about one run in four. So
        it is collected here, while the group still exists.

        A rank that ``failed`` (out of memory in its backward pass, say) leaves without the
        closing barrier: the other ranks are waiting in a collective it will never join, and
        a barrier would keep this one waiting for them in turn. It exits with its error, and
        torchrun stops the others."""
        if self.active and dist.is_initialized():
            gc.collect()
            if not failed:
                dist.barrier()
            dist.destroy_process_group()


def _describe(error: BaseException) -> tuple[bool, str]:
    return isinstance(error, NanolmError), str(error) or type(error).__name__


def _as_error(failure: tuple[bool, str], rank: int) -> Exception:
    user_error, message = failure
    return NanolmError(message) if user_error else _RemoteFailure(f"rank {rank} failed: {message}")


def setup(mode: str, device: torch.device) -> Distributed:
    """Join the process group torchrun prepared, or stay a single process.

    ``mode`` auto means DDP under torchrun with several processes, else one process.
    Every misuse that a user can fix is a :class:`NanolmError` raised before any
    communication, identically on every rank.
    """
    env = torchrun_env()
    if env is None:
        if mode in ("ddp", "fsdp"):
            raise NanolmError(
                f"--dist {mode} needs processes started by torchrun, e.g. "
                f"torchrun --nproc_per_node 2 -m nanolm.train --dist {mode} ... (see docs/distributed.md)"
            )
        return Distributed("none", device)
    rank, world_size, local_rank = env
    if mode == "none" and world_size > 1:
        raise NanolmError(
            f"--dist none under torchrun with {world_size} processes would train {world_size} separate "
            "copies writing to one run directory; use --dist ddp or fsdp (or auto)"
        )
    if mode in ("none", "auto") and world_size == 1:
        return Distributed("none", device)
    mode = "ddp" if mode == "auto" else mode
    if not dist.is_available():
        raise NanolmError("this PyTorch build has no torch.distributed; --dist needs it")
    if device.type == "mps":
        raise NanolmError("--dist: PyTorch has no distributed backend for MPS; use --device cpu")
    if device.type == "cuda":
        if device.index is not None and device.index != local_rank:
            raise NanolmError(
                f"--device {device}: under torchrun every process uses cuda:LOCAL_RANK (here "
                f"cuda:{local_rank}); pass --device cuda (or auto), and choose GPUs with CUDA_VISIBLE_DEVICES"
            )
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise NanolmError(
                f"torchrun started local rank {local_rank} on a node with {count} GPU(s); "
                f"use --nproc_per_node {count} or fewer"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return Distributed(mode, device, rank, world_size, local_rank)


@contextlib.contextmanager
def launch(mode: str, device: torch.device):
    """:func:`setup`, then leave the process group however the block ends."""
    ctx = setup(mode, device)
    try:
        yield ctx
    except BaseException:
        ctx.close(failed=True)
        raise
    ctx.close()
