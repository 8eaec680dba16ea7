"""Encoding on every core: worker processes, each with its own copy of the tokenizer.

The tokenizer's batch encoding runs in Rust threads, but one process's threads share one memory
allocator and hand their results back through one Python thread, and they scale less well than
processes (measured in dev/data.md, "Corpora of gigabytes, as published"). So a
large corpus is encoded by ``workers`` processes, each limited to one thread: the main process
reads the documents, cuts each piece into one part per worker (by characters, in order), and
puts the parts' tokens back together in order, so the result is the same whatever the number of
workers. A small source (a few seconds of encoding) is encoded in this process instead: starting
the workers would cost more than they save. So is any source when ``workers`` is None, the default
of :func:`~nanolm.data.prepare.prepare` called from Python and of a training run: a worker
re-imports the main module, and a user's script without an ``if __name__ == "__main__":`` guard
would run again in each (the command line's entry has the guard; ``nanolm prepare`` uses workers).

The workers are started with ``spawn`` (a fresh interpreter: forking a process that has loaded
PyTorch or started the tokenizer's threads is unsafe), ignore Ctrl-C (the main process stops them
and keeps what is finished), and end with the main process.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

POOL_MIN_BYTES = 16_000_000  # text below this is encoded in this process


def default_workers() -> int:
    """Every core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class Encoders:
    """Encodes pieces of documents, ``{split: [text, ...]}`` to ``{split: [ids, ...]}``, in the
    background: :meth:`submit` returns at once, the result's ``.result()`` waits for it."""

    def __init__(self, tokenizer, workers: int | None, text_bytes: int, log=print):
        self.tokenizer, self.log = tokenizer, log
        self.workers = workers or default_workers()
        self.pool, self.broken = None, False
        self.thread = ThreadPoolExecutor(max_workers=1)  # the in-process encoder, or the gatherer
        if workers is not None and text_bytes >= POOL_MIN_BYTES:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(tokenizer.hf.to_str(),),
            )

    def submit(self, texts: dict[str, list[str]]) -> Future:
        if self.pool is None or self.broken:
            return self.thread.submit(_encode_in_process, self.tokenizer, texts)
        flat = [(name, t) for name in ("train", "val") for t in texts[name]]
        try:
            parts = [
                self.pool.submit(_encode_part, [t for _, t in part]) for part in _split_by_chars(flat, self.workers)
            ]
        except BrokenProcessPool as e:
            parts = e
        return self.thread.submit(self._gathered, texts, parts)

    def _gathered(self, texts: dict[str, list[str]], parts) -> dict[str, list[np.ndarray]]:
        """The parts' tokens in order; encoded here if the workers could not start or died (a
        main module they cannot import, such as a script read from standard input; a worker
        killed): slower, never wrong."""
        try:
            if isinstance(parts, BrokenProcessPool):
                raise parts
            ids = iter([a for part in parts for a in part.result()])
            return {name: [next(ids) for _ in texts[name]] for name in ("train", "val")}
        except BrokenProcessPool as e:
            if not self.broken:
                self.log(f"warning: the encoding workers stopped ({e}); encoding in this process from here on")
            self.broken = True
        return _encode_in_process(self.tokenizer, texts)

    def close(self, cancel: bool = False) -> None:
        self.thread.shutdown(wait=not cancel, cancel_futures=cancel)
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=not cancel, cancel_futures=cancel)

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        self.close(cancel=kind is not None)


def _encode_in_process(tokenizer, texts: dict[str, list[str]]) -> dict[str, list[np.ndarray]]:
    return {name: tokenizer.encode_batch(t) if t else [] for name, t in texts.items()}


def _split_by_chars(items: list, n: int) -> list[list]:
    """``items`` (split, text) cut into at most ``n`` runs, in order, of about equal characters."""
    total = sum(len(t) for _, t in items)
    parts, current, size = [], [], 0
    for item in items:
        current.append(item)
        size += len(item[1])
        if size * n >= total * (len(parts) + 1) and len(parts) < n - 1:
            parts.append(current)
            current = []
    if current or not parts:
        parts.append(current)
    return parts


_worker_tokenizer = None


def _start_worker(spec: str) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process answers Ctrl-C for all
    os.environ["RAYON_NUM_THREADS"] = "1"  # before the tokenizer's first batch starts its threads
    from tokenizers import Tokenizer as HFTokenizer

    from ..tokenizer import Tokenizer

    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(HFTokenizer.from_str(spec))


def _encode_part(texts: list[str]) -> list[np.ndarray]:
    dtype = np.uint16 if _worker_tokenizer.vocab_size <= 1 << 16 else np.uint32  # half the bytes to send back
    return [ids.astype(dtype) for ids in _worker_tokenizer.encode_batch(texts)]
