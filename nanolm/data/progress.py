"""What a person sees while ``nanolm prepare`` works through a large corpus: a bar on a
terminal, a line every tenth of the way in a log, nothing for a small corpus."""

from __future__ import annotations

import os
import sys
import time

from ..errors import NanolmError
from .sources import DocumentSource

PROGRESS_MIN_BYTES = 10_000_000  # a smaller source prepares in a few seconds: no progress is shown
PROGRESS_EVERY_S = 30.0  # lines mode: a line at least this often, besides one per 10 %
PROGRESS_GAP_S = 5.0  # lines mode: and at most this often (a phase of seconds needs no line per 10 %)


def progress_mode(progress, source_bytes: int, log) -> str | None:
    """How ``prepare`` shows its progress: ``"bar"``, ``"lines"`` or None (silent).

    ``progress`` takes the training loop's modes (``auto``, ``bar``, ``lines``, see
    :func:`nanolm.watch.sinks.choose_progress`) so one ``--progress`` decides for both; True is
    ``auto`` and False silence. Silent below ``PROGRESS_MIN_BYTES`` (a few seconds of work:
    progress would only be noise) and on every torchrun rank but 0 (each rank would print
    the same lines, and bars from several processes garble a terminal).
    """
    from ..watch.sinks import PROGRESS_MODES, choose_progress

    if progress is False or progress is None:
        return None
    mode = "auto" if progress is True else progress
    if mode not in PROGRESS_MODES:
        raise NanolmError(f"progress {progress!r} is not one of {', '.join(PROGRESS_MODES)}")
    if os.environ.get("RANK", "0") != "0" or source_bytes < PROGRESS_MIN_BYTES:
        return None
    return choose_progress(mode, log)


def expected_text_bytes(docs: DocumentSource) -> int:
    """About how many UTF-8 bytes of text ``docs`` holds, for the percentage and the ETA (the
    file sizes, read through what compresses them: :meth:`DocumentSource.expected_text_bytes`)."""
    return docs.expected_text_bytes()


class PrepareProgress:
    """What a person sees while ``prepare`` works through a large corpus.

    Preparing 1 GB of text takes minutes (docs/benchmarks.md), and a command that prints
    nothing for minutes looks hung. Each phase (training the tokenizer, encoding) counts the
    UTF-8 bytes of the documents it is done with and shows how far it is, how fast, and when
    it should end: a tqdm bar on a terminal (``"bar"``), or, where a bar's carriage returns
    would be noise (a log file, CI, a notebook's captured output), a line at each tenth of the
    way and at least every ``PROGRESS_EVERY_S`` seconds, but not twice within ``PROGRESS_GAP_S``
    (``"lines"``). Each phase ends with a line in both. ``mode`` None shows nothing and costs
    nothing.

    Progress only watches: :meth:`follow`, through which the tokenizer reads its documents,
    yields every one it is given, unchanged and in order, so the prepared files are byte for
    byte those of a silent run (``test_progress_does_not_change_the_prepared_bytes``).
    """

    def __init__(self, mode: str | None, log=print):
        self.mode, self.log = mode, log
        self.bar = None
        self.started = time.monotonic()

    def say(self, line: str) -> None:
        if self.mode is None:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            self.log(line)

    def begin(self, what: str, total: int) -> None:
        """A phase ``what`` that expects to go through ``total`` bytes."""
        if self.mode is None:
            return
        self.what, self.total, self.done, self.next_tenth = what, max(1, total), 0, 1
        self.start = self.last_line = time.monotonic()
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                desc=f"prepare: {what}",
                unit="B",
                unit_scale=True,
                file=sys.stdout,
                dynamic_ncols=True,
                leave=False,
            )
        else:
            self.log(f"prepare: {what} ({megabytes(self.total)} expected)")

    def advance(self, n: int) -> None:
        if self.mode is None:
            return
        self.done += n
        if self.done > self.total:  # the estimate was short: the end moves, the percentage stays below 100
            self.total = self.done
            if self.bar is not None:
                self.bar.total = self.total
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        since = now - self.last_line
        if (self.done * 10 >= self.next_tenth * self.total and since >= PROGRESS_GAP_S) or since >= PROGRESS_EVERY_S:
            if self.done < self.total:
                self.log(
                    f"prepare: {self.what} {100 * self.done // self.total}% "
                    f"({_rate_and_eta(self.done, self.total, now - self.start)})"
                )
            self.next_tenth, self.last_line = self.done * 10 // self.total + 1, now

    def end(self) -> tuple[int, float]:
        """(bytes, seconds) of the phase that ends."""
        if self.mode is None:
            return 0, 0.0
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        return self.done, time.monotonic() - self.start

    def follow(self, texts, what: str, total: int, on_end=None):
        """``texts``, counted as the phase ``what``, each text once the consumer asks for the next
        (it is then done with it). ``on_end(bytes, seconds)`` runs when ``texts`` is exhausted."""
        if self.mode is None:
            return texts
        return self._counted(texts, what, total, on_end)

    def _counted(self, texts, what: str, total: int, on_end):
        self.begin(what, total)
        for text in texts:
            yield text
            self.advance(len(text.encode("utf-8")))
        done = self.end()
        if on_end is not None:
            on_end(*done)

    def closing(self, line: str) -> None:
        self.say(f"prepare: {line} (done in {format_seconds(time.monotonic() - self.started)})")


def megabytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _rate_and_eta(done: int, total: int, seconds: float) -> str:
    rate = done / max(seconds, 1e-9)
    return f"{megabytes(done)}, {rate / 1e6:.1f} MB/s, ETA {format_seconds((total - done) / max(rate, 1e-9))}"


def format_seconds(seconds: float) -> str:
    from ..watch.sinks import format_duration

    return f"{seconds:.1f}s" if seconds < 60 else format_duration(seconds)
