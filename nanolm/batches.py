"""Batches: packed windows of a token stream, the sampler that picks them, and the validation set.

A window is ``seq_len + 1`` consecutive tokens of a split's stream (``EOS doc EOS doc ...``,
written by ``nanolm.data.prepare``), cut with no regard for where documents start: no padding, no
waste. A window can therefore start with the end of a recipe and continue with a news story.
Three things make that honest:

* ``doc_ids``: with the document mask on, attention is block-diagonal, so the news story
  cannot read the recipe.
* ``positions``: optionally restart RoPE positions at each document.
* the boundary rule. Each EOS *opens* the document after it (it is that document's
  first token, like a BOS): the last token of the recipe predicts EOS from the recipe,
  and EOS predicts the news story's first token from nothing else. Every position is
  counted and nothing crosses a boundary. The other choice (``--mask-boundary``)
  leaves the token after EOS unpredicted (not counted) and lets EOS close the
  document it ends instead.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch

from .errors import NanolmError


@dataclass
class Split:
    """One split of a prepared corpus: a flat token stream and where its documents start."""

    tokens: np.ndarray  # memmap, uint16 or uint32
    doc_starts: np.ndarray  # int64, offset of each document's first token
    n_bytes: int  # UTF-8 bytes of the text (EOS excluded)

    def __len__(self):
        return len(self.tokens)


@dataclass
class Batch:
    """One micro-batch. ``idx``/``targets``/``loss_mask``/``doc_ids``/``positions`` are (B, T).

    ``doc_ids`` is None when the document mask is off (plain causal attention), and
    ``positions`` is None when positions simply run 0..T-1.
    """

    idx: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    def to(self, device) -> "Batch":
        """The batch on ``device``. From the host to CUDA through pinned (page-locked) memory, so
        the copy can overlap the GPU's work; a tensor already on a GPU cannot be pinned and needs
        no staging. MPS shares memory with the CPU and gains nothing from pinning."""
        device = torch.device(device)
        if device.type == "cpu":
            return self

        def move(t):
            if t is None:
                return None
            if device.type == "cuda" and not t.is_cuda:
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device, non_blocking=t.is_cuda)

        return Batch(move(self.idx), move(self.targets), move(self.loss_mask), move(self.doc_ids), move(self.positions))

    @property
    def counted(self) -> torch.Tensor:
        return self.loss_mask.sum()


def pack_windows(
    tokens: np.ndarray,
    starts: np.ndarray,
    seq_len: int,
    eos_id: int,
    doc_mask: bool = True,
    reset_positions: bool = False,
    mask_boundary: bool = False,
) -> Batch:
    """Cut windows of ``seq_len + 1`` tokens at ``starts`` and describe their documents.

    Default boundary rule: an EOS starts a new document (it is that document's first
    token). With ``mask_boundary`` the EOS ends the document before it and the token after
    it is not counted.
    """
    offsets = np.arange(seq_len + 1)
    window = torch.from_numpy(tokens[np.asarray(starts)[:, None] + offsets].astype(np.int64))
    idx, targets = window[:, :-1], window[:, 1:]
    is_eos = idx == eos_id
    loss_mask = ~is_eos if mask_boundary else torch.ones_like(idx, dtype=torch.bool)
    doc_ids = positions = None
    if doc_mask or reset_positions:
        if mask_boundary:
            new_doc = torch.zeros_like(is_eos)
            new_doc[:, 1:] = is_eos[:, :-1]
        else:
            new_doc = is_eos
        ar = torch.arange(seq_len).expand_as(idx)
        if doc_mask:
            doc_ids = new_doc.cumsum(1, dtype=torch.int32)
        if reset_positions:
            doc_start = torch.where(new_doc, ar, 0).cummax(1).values
            positions = ar - doc_start
    return Batch(idx, targets, loss_mask, doc_ids, positions)


def fewer_tokens_than_a_window(n_tokens: int, seq_len: int) -> NanolmError:
    """The refusal of a training split too short to cut one window from (the run's directory
    checks it before anything is written; the sampler, where the windows are cut)."""
    return NanolmError(
        f"the training split holds {n_tokens} tokens, fewer than one window of --seq-len + 1 = "
        f"{seq_len + 1}; use more text or a smaller --seq-len"
    )


class WindowSampler:
    """Seeded, epoch-based, without replacement: every window once per epoch.

    Window i covers tokens [o + i·T, o + i·T + T] (T + 1 tokens, consecutive windows
    overlapping by the one token that is a target in the first and an input in the next).
    Each epoch visits the windows in a fresh permutation drawn from (seed, epoch); with
    ``random_offset`` the grid itself shifts by a random o in [0, T) each epoch, so
    different cuts of the same text are seen over the epochs.

    The whole state is (epoch, cursor): a checkpoint can hold it and a resumed run draws
    exactly the windows the uninterrupted run would have. Under torchrun each rank takes
    its own disjoint slice of every global batch.
    """

    def __init__(
        self,
        n_tokens: int,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        random_offset: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.random_offset, self.rank, self.world_size = random_offset, rank, world_size
        self.n_windows = (n_tokens - 1 - (seq_len if random_offset else 0)) // seq_len
        if self.n_windows < 1:
            raise fewer_tokens_than_a_window(n_tokens, seq_len)
        self.epoch, self.cursor = 0, 0
        self._order = None

    def _epoch_order(self):
        if self._order is None or self._order[0] != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            perm = torch.randperm(self.n_windows, generator=g).numpy()
            offset = int(torch.randint(self.seq_len, (1,), generator=g)) if self.random_offset else 0
            self._order = (self.epoch, perm * self.seq_len + offset)
        return self._order[1]

    def next_starts(self) -> np.ndarray:
        """Start offsets of this rank's windows for the next micro-batch."""
        need = self.batch_size * self.world_size
        taken = []
        while need:
            order = self._epoch_order()
            take = order[self.cursor : self.cursor + need]
            taken.append(take)
            self.cursor += len(take)
            need -= len(take)
            if self.cursor >= self.n_windows:
                self.epoch, self.cursor = self.epoch + 1, 0
        starts = np.concatenate(taken)
        return starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self.seed = int(state["epoch"]), int(state["cursor"]), int(state["seed"])
        self._order = None


class TrainBatches:
    """The training stream: each optimizer step's micro-batches, ``grad_accum`` packed batches
    of windows drawn by the sampler. Its state is the sampler's position (a few integers),
    which a checkpoint saves and a rollback leaves where it is."""

    def __init__(
        self,
        tokens: np.ndarray,
        sampler: "WindowSampler",
        seq_len: int,
        eos_id: int,
        grad_accum: int = 1,
        doc_mask: bool = True,
        reset_positions: bool = False,
        mask_boundary: bool = False,
    ):
        self.tokens, self.sampler, self.seq_len, self.eos_id, self.grad_accum = (
            tokens,
            sampler,
            seq_len,
            eos_id,
            grad_accum,
        )
        self.pack = dict(doc_mask=doc_mask, reset_positions=reset_positions, mask_boundary=mask_boundary)

    def next(self, step: int) -> list[Batch]:
        """The micro-batches of optimizer step ``step``."""
        batches = [
            pack_windows(self.tokens, self.sampler.next_starts(), self.seq_len, self.eos_id, **self.pack)
            for _ in range(self.grad_accum)
        ]
        let_go_of_pages(self.tokens)
        return batches

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def let_go_of_pages(tokens: np.ndarray) -> None:
    """Unmap the pages of a memory-mapped shard that the last windows touched.

    The windows were copied out (``pack_windows``), so nothing needs those pages mapped. Left
    mapped, each window read from a shard the page cache holds maps whole runs of pages around it
    (the cache keeps large folios of a file written in order), and a run's resident memory grew
    step by step with the size of its corpus (docs/data.md, Benchmarks). ``MADV_DONTNEED`` drops
    the mappings, not the data (it stays in the page cache, shared and reclaimable), and costs
    microseconds. Windows (no ``madvise``) keeps the old behaviour."""
    handle = getattr(tokens, "_mmap", None)
    if handle is not None and hasattr(handle, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            handle.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):  # closed, or a platform that refuses it: only memory is at stake
            pass


def get_batch(tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator | None = None):
    """The simplest batcher: ``batch_size`` windows at uniformly random offsets.

    This is "packing without regard to boundaries": a window can start in the middle of
    one document and run into the next, and the model, attending causally over the whole
    window, conditions the second document on the first. It learns that an unrelated text
    predicts the next story's opening, which is noise at best and a leak at worst, and
    positions restart nowhere. Random offsets also revisit some tokens and skip others
    within an "epoch". nanolm's own pipeline (:class:`TrainBatches`) masks attention at
    document boundaries and visits every window once per epoch; this function stays as the
    baseline to compare against.

    Returns ``(x, y)``: inputs and the same windows shifted by one token.
    """
    starts = torch.randint(len(tokens) - seq_len - 1, (batch_size,), generator=generator).numpy()
    window = torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return window[:, :-1], window[:, 1:]


def eval_window_starts(n_tokens: int, seq_len: int, max_windows: int | None = None) -> tuple[np.ndarray, int]:
    """Fixed evaluation windows: (starts, first counted position of the last window).

    The windows tile the split back to back, so every target token is counted exactly once;
    the last one is moved back to end on the final token and only its new targets count.
    With ``max_windows``, an evenly spaced subset (always the same one) is used instead.
    """
    if n_tokens < seq_len + 1:
        return np.zeros(0, dtype=np.int64), 0
    full = (n_tokens - 1) // seq_len
    starts = np.arange(full, dtype=np.int64) * seq_len
    tail_from = 0
    covered = full * seq_len
    if covered < n_tokens - 1:
        last = n_tokens - 1 - seq_len
        tail_from = covered - last
        starts = np.append(starts, last)
    if max_windows is not None and len(starts) > max_windows:
        pick = np.linspace(0, full - 1, max_windows).round().astype(np.int64)
        return starts[np.unique(pick)], 0
    return starts, tail_from


def eval_window_count(n_tokens: int, seq_len: int, max_windows: int | None = None) -> int:
    """How many windows :func:`eval_batches` scores: ``max_windows`` or fewer, as many as the split
    holds. What the memory check before a run counts, so that ``--eval-windows 1000000000`` is
    the split's windows, not a billion the check would refuse."""
    return len(eval_window_starts(n_tokens, seq_len, max_windows)[0])


DEFAULT_EVAL_WINDOWS = 320
"""The validation set's size when a run does not say (``--eval-windows``): 20 batches of the
default 16 windows, as it was first counted; a run continued keeps its own."""


def eval_batches(
    split: Split, seq_len: int, batch_size: int, eos_id: int, max_windows: int | None = None, **pack_options
) -> list[Batch]:
    """The validation set as a list of batches, identical at every evaluation."""
    starts, tail_from = eval_window_starts(len(split.tokens), seq_len, max_windows)
    batches = []
    for i in range(0, len(starts), batch_size):
        batch = pack_windows(split.tokens, starts[i : i + batch_size], seq_len, eos_id, **pack_options)
        if tail_from and i + batch_size >= len(starts):
            batch.loss_mask[-1, :tail_from] = False
        batches.append(batch)
    return batches
