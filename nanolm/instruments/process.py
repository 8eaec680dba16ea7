"""``--process-tuning auto``: what the ``nanolm`` command does to its own process for a training run.

Two settings change the whole process rather than the training, so they belong to the command
that owns the process (:func:`nanolm.instruments.cli.entry`, which ``nanolm``, ``python -m
nanolm`` and ``python -m nanolm.train`` all go through), never to :func:`nanolm.train.train`: a
notebook, the lab or a sweep that calls ``train()`` keeps its process as it was.

* the C allocator keeps the buffers a CPU step frees, for the next step
  (:func:`keep_freed_memory_for_reuse`);
* the garbage collector skips the objects that live until the process exits, during the run
  and at its exit (:func:`exempt_existing_objects_from_collection`,
  :func:`prepare_to_exit_quickly`).

Neither changes a number of the run. ``--process-tuning off`` does neither; the choice is
recorded in the run's ``config.toml``. Why each is kept, and what it gains, is measured in
docs/benchmarks.md ("Process tuning").
"""

from __future__ import annotations

import ctypes
import gc

import torch

KEPT_FREED_BYTES = 1 << 30  # blocks up to this size stay in the process when freed


def keep_freed_memory_for_reuse(device: torch.device) -> bool:
    """On a CPU, let the C allocator keep the buffers a step frees, for the next step.

    Every step allocates and frees the same large buffers (activations, attention scores,
    chunks of logits). glibc's malloc gives freed blocks above a threshold back to the
    kernel (``munmap``, or trimming the top of the heap), so the next step gets them again as
    fresh pages that the kernel must fault in and zero one 4 KiB page at a time. Raising both
    thresholds (``mallopt``: M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, to 1 GiB; an older glibc
    caps the first at 32 MiB) keeps those blocks for reuse. The price: the process's memory
    does not shrink after a peak, which a training run reaches again every step anyway.

    Linux with glibc, CPU runs only (a GPU's memory has PyTorch's own caching allocator).
    Returns whether it applied.
    """
    if device.type != "cpu":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl): their allocators differ
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    trim = bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREED_BYTES))
    # older glibc refuses an mmap threshold above 32 MiB (HEAP_MAX_SIZE / 2): take the largest it allows
    mmap = bool(mallopt(M_MMAP_THRESHOLD, KEPT_FREED_BYTES)) or bool(mallopt(M_MMAP_THRESHOLD, 32 << 20))
    return trim and mmap


def exempt_existing_objects_from_collection() -> None:
    """Take every object that exists now out of the garbage collector's sight, for good.

    Python's cyclic garbage collector walks every object it tracks in each full collection.
    Importing PyTorch creates a great many that live until the process ends (modules, classes,
    functions), and a run triggers several full collections while it sets up. ``gc.freeze()``
    moves them to a permanent generation that collections skip; what is created afterwards is
    collected as usual. The price is that garbage among them is never collected.
    """
    gc.freeze()


def prepare_to_exit_quickly() -> None:
    """Before the process exits: collect garbage once, then exempt every survivor from collection.

    The interpreter's shutdown runs full collections while it tears the modules down, and each
    walks every object again. One collection now finalizes whatever is already garbage in
    reference cycles (an object whose ``__del__`` closes or flushes something runs it, as the
    shutdown would have run it); freezing the rest lets the shutdown skip them. It still runs the
    atexit handlers, waits for threads, flushes stdout and stderr and frees objects by
    reference count.
    """
    gc.collect()
    gc.freeze()


class ProcessTuning:
    """The command's process tuning for one training run: :meth:`before_training` once its
    options are known, :meth:`before_exit` when the command returns (only if it tuned)."""

    def __init__(self):
        self.tuned = False
        self.kept_freed_memory = False

    def before_training(self, option: str, device: torch.device) -> None:
        if option != "auto":
            return
        exempt_existing_objects_from_collection()  # PyTorch's modules and nanolm's, imported by now
        self.kept_freed_memory = keep_freed_memory_for_reuse(device)  # a CPU step reuses its freed buffers
        self.tuned = True

    def before_exit(self) -> None:
        if self.tuned:
            prepare_to_exit_quickly()
