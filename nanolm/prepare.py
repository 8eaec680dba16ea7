"""Preparing a corpus once: documents → tokenizer → token shards, with what a run needs to know of them.

:func:`prepare` tokenizes once and writes each split as one flat token file
(``train.bin``/``val.bin``, uint16 when the vocabulary fits, else uint32) read back through
``np.memmap``: the OS pages in only what a batch touches, so a corpus larger than memory
trains fine. The stream is ``EOS doc EOS doc ... doc EOS``: every document sits between two
EOS tokens, so every one of its tokens, and its end, is predicted. Beside the shards it
writes where each document starts (for the document mask), a sealed ``meta.json`` with the
files' checksums, and two references for the loss: the bits per byte that zlib and xz need
for the validation text, and, for the built-in stories, their exact entropy.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .batches import Split
from .errors import NanolmError
from .files import (
    atomic_write_text,
    check_manifest,
    check_seal,
    manifest,
    naming_the_file,
    read_json,
    sealed,
)
from .lock import LOCK_FILE
from .sources import SEPARATOR, DocumentSource, split_documents
from .tokenizer import Tokenizer, train_tokenizer

META_FILE = "meta.json"


class PreparedData:
    """A directory written by :func:`prepare`: ``train.bin``, ``val.bin``, document starts,
    ``tokenizer.json`` and ``meta.json``.

    Opening one checks it before anything trains on it: ``meta.json`` must parse with the
    expected fields, and the other files must be exactly those of its manifest with their
    SHA-256, so a changed token (even one inside the vocabulary, which would train silently
    on different data) or a swapped tokenizer is refused. The same pass finds the largest
    token id, so ids outside the model's vocabulary are refused before the first step, not
    met as an IndexError mid-training. ``verify=False`` skips the checksums for a directory
    this process has just written and checked.
    """

    def __init__(self, directory, verify: bool = True):
        self.dir = Path(directory)
        meta_path = self.dir / META_FILE
        if not meta_path.is_file():
            raise NanolmError(f"{self.dir} is not a prepared data directory (no {META_FILE}); run `nanolm prepare` first")
        self.meta = _checked_data_meta(read_json(meta_path, f"{meta_path}"), self.dir)
        dtype = np.dtype(self.meta["dtype"])
        largest = {"train.bin": -1, "val.bin": -1}

        def track_largest(name, block):
            whole = len(block) - len(block) % dtype.itemsize  # a damaged file may end mid-id; its checksum fails
            if name in largest and whole:
                largest[name] = max(largest[name], int(np.frombuffer(block[:whole], dtype=dtype).max()))

        if verify:
            check_manifest(self.dir, self.meta["files"], f"prepared data {self.dir}", skip=(META_FILE,),
                           on_block=track_largest)
            self.max_id = max(largest.values())
        else:
            self.max_id = self.meta["max_id"]
        self.tokenizer = Tokenizer.load(self.dir / "tokenizer.json")
        if self.tokenizer.fingerprint() != self.meta["tokenizer_fingerprint"]:
            raise NanolmError(f"{self.dir}/tokenizer.json is not the tokenizer these shards were made with; prepare the data again")
        self.splits = {}
        for name in ("train", "val"):
            n = self.meta["splits"][name]["tokens"]
            path = self.dir / f"{name}.bin"
            if path.stat().st_size != n * dtype.itemsize:
                raise NanolmError(f"{path} holds {path.stat().st_size} bytes, expected {n * dtype.itemsize}; it is truncated or corrupt, prepare again")
            tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
            starts = _load_doc_starts(self.dir / f"{name}_docs.npy", n)
            self.splits[name] = Split(tokens, starts, self.meta["splits"][name]["bytes"])

    @property
    def train(self) -> Split:
        return self.splits["train"]

    @property
    def val(self) -> Split:
        return self.splits["val"]

    @property
    def digest(self) -> str:
        """A short hash of the manifest: equal iff the prepared files are byte for byte equal."""
        return hashlib.sha256(json.dumps(self.meta["files"], sort_keys=True).encode()).hexdigest()[:16]

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse shards whose ids do not fit the model's embedding table."""
        if self.max_id >= vocab_size:
            raise NanolmError(
                f"{self.dir} holds token id {self.max_id} but the model's vocabulary has "
                f"{vocab_size} entries; the shards were made with another tokenizer"
            )


DATA_FILES = ("tokenizer.json", "train.bin", "val.bin", "train_docs.npy", "val_docs.npy")


def _checked_data_meta(meta, directory: Path) -> dict:
    """``meta.json`` of a prepared directory with every field a reader relies on checked."""
    def bad(what):
        return NanolmError(f"{directory / META_FILE}: {what}; prepare the data again")

    def count(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(meta, dict):
        raise bad("not an object")
    if "files" not in meta:
        raise bad("no manifest of checksums (prepared by an older nanolm)")
    check_seal(meta, f"{directory / META_FILE}")
    if not isinstance(meta["files"], dict) or set(meta["files"]) != set(DATA_FILES):
        raise bad(f"its manifest must list exactly {', '.join(DATA_FILES)}")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise bad(f"dtype {meta.get('dtype')!r} is not uint16 or uint32")
    if not isinstance(meta.get("tokenizer_fingerprint"), str) or not isinstance(meta.get("tokenizer"), str):
        raise bad("the tokenizer's fingerprint is missing")
    splits = meta.get("splits")
    if not (isinstance(splits, dict) and all(isinstance(splits.get(n), dict) and count(splits[n].get("tokens"))
                                             and count(splits[n].get("bytes")) for n in ("train", "val"))):
        raise bad("the token and byte counts of the splits are missing or malformed")
    if not isinstance(meta.get("max_id"), int):
        raise bad("max_id is missing")
    floor = meta.get("floor")
    if floor is not None and not (isinstance(floor, dict) and all(
            isinstance(floor.get(k), (int, float)) for k in ("nats", "bpb", "nats_per_token"))):
        raise bad("the entropy floor is malformed")
    compressors = meta.get("compressor_bpb")
    if compressors is not None and not (isinstance(compressors, dict)
                                        and all(isinstance(v, (int, float)) for v in compressors.values())):
        raise bad("the compressor figures are malformed")
    return meta


def _load_doc_starts(path: Path, n_tokens: int) -> np.ndarray:
    """Document start offsets, as plain int64 (``allow_pickle=False``: an .npy file can
    carry pickled objects, which would run code when loaded)."""
    try:
        starts = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise NanolmError(f"{path} is not a plain array of document offsets ({e}); prepare the data again") from None
    if starts.dtype != np.int64 or starts.ndim != 1 or (len(starts) and (starts.min() < 0 or starts.max() > n_tokens
                                                                        or (np.diff(starts) <= 0).any())):
        raise NanolmError(f"{path} does not hold increasing document offsets inside the split; prepare the data again")
    return starts


class _SplitWriter:
    def __init__(self, path: Path, dtype):
        self.path = path
        self.f = open(path, "wb")
        self.dtype = dtype
        self.n_tokens = 0
        self.n_bytes = 0
        self.doc_starts: list[int] = []
        self.max_id = -1

    def write_docs(self, ids_list: list[np.ndarray], texts: list[str], eos_id: int):
        if not ids_list:
            return
        parts = [] if self.n_tokens else [np.array([eos_id])]  # the stream opens with EOS
        offset = self.n_tokens + len(parts)
        for ids, text in zip(ids_list, texts):
            self.doc_starts.append(offset)
            parts += [ids, np.array([eos_id])]
            offset += len(ids) + 1
            self.n_bytes += len(text.encode("utf-8"))
        block = np.concatenate(parts)
        self.max_id = max(self.max_id, int(block.max()))
        with naming_the_file(self.path):
            self.f.write(block.astype(self.dtype).tobytes())
        self.n_tokens += len(block)

    def close(self, directory: Path, name: str):
        with naming_the_file(self.path):
            self.f.close()
        with naming_the_file(directory / f"{name}_docs.npy"):
            np.save(directory / f"{name}_docs.npy", np.asarray(self.doc_starts, dtype=np.int64))


def join_documents(ids_list: list[np.ndarray], eos_id: int) -> np.ndarray:
    """One token stream ``EOS doc EOS doc ... EOS`` from encoded documents."""
    eos = np.array([eos_id])
    return np.concatenate([eos] + [part for ids in ids_list for part in (ids, eos)])


def boundary_crossing_windows(doc_starts: np.ndarray, n_tokens: int, seq_len: int) -> tuple[int, int]:
    """(windows whose input holds more than one document, all windows), stride ``seq_len``.

    A document's span starts at the EOS before its first token (the EOS opens it), so a
    window w crosses a boundary when such an EOS sits strictly inside it: w·T < eos < w·T + T.
    """
    n_windows = max(0, (n_tokens - 1) // seq_len)
    if n_windows == 0:
        return 0, 0
    eos = np.asarray(doc_starts)[np.asarray(doc_starts) > 0] - 1
    eos = eos[eos % seq_len != 0]
    window = eos // seq_len
    crossing = np.unique(window[window < n_windows])
    return int(len(crossing)), n_windows


COMPRESSOR_SAMPLE_BYTES = 1 << 21  # of each split: the xz bound's context and text


def compressor_bits_per_byte(context: bytes, text: bytes) -> dict:
    """Bits per byte that zlib and xz need for ``text`` once they have seen ``context``.

    A general-purpose compressor is a language model too (a weak one). A trained model
    should need fewer bits per byte than xz; a model that does worse has learned less
    than a zip file. The four compressions run in parallel threads (zlib and lzma release
    the GIL): on tiny-shakespeare this takes about half the time of running them in turn.
    """
    if not text:
        return {}
    compressors = {"zlib": lambda b: len(zlib.compress(b, 9)), "xz": lambda b: len(lzma.compress(b, preset=6))}
    with ThreadPoolExecutor(max_workers=4) as pool:
        sizes = {(name, part): pool.submit(compress, data) for name, compress in compressors.items()
                 for part, data in (("context", context), ("both", context + text)) if data}
        sizes = {key: future.result() for key, future in sizes.items()}
    out = {}
    for name in compressors:
        extra = sizes[name, "both"] - sizes.get((name, "context"), 0)
        out[name] = round(8 * max(extra, 1) / len(text), 4)
    return out


def _known_document_entropy(source: Path) -> list[float] | None:
    """Per-document information (nats) written by ``nanolm data stories`` beside the text."""
    from .corpus import entropy_path

    path = entropy_path(source)
    if not source.is_file() or not path.is_file():
        return None
    try:
        return [float(x) for x in json.loads(path.read_text())["doc_nats"]]
    except (ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------- prepare's progress
PROGRESS_MIN_BYTES = 10_000_000  # a smaller source prepares in a few seconds: no progress is shown
PROGRESS_EVERY_S = 30.0  # lines mode: a line at least this often, besides one per 10 %
PROGRESS_GAP_S = 5.0  # lines mode: and at most this often (a phase of seconds needs no line per 10 %)
BPE_TRAINING_CHARS = 100_000_000  # BPE learns its merges from at most this much training text


def _progress_mode(progress, source_bytes: int, log) -> str | None:
    """How ``prepare`` shows its progress: ``"bar"``, ``"lines"`` or None (silent).

    ``progress`` takes the training loop's modes (``auto``, ``bar``, ``lines``, see
    :func:`nanolm.monitor.choose_progress`) so one ``--progress`` decides for both; True is
    ``auto`` and False silence. Silent below ``PROGRESS_MIN_BYTES`` (a few seconds of work:
    progress would only be noise) and on every torchrun rank but 0 (each rank would print
    the same lines, and bars from several processes garble a terminal).
    """
    from .monitor import PROGRESS_MODES, choose_progress

    if progress is False or progress is None:
        return None
    mode = "auto" if progress is True else progress
    if mode not in PROGRESS_MODES:
        raise NanolmError(f"progress {progress!r} is not one of {', '.join(PROGRESS_MODES)}")
    if os.environ.get("RANK", "0") != "0" or source_bytes < PROGRESS_MIN_BYTES:
        return None
    return choose_progress(mode, log)


def _expected_text_bytes(docs: DocumentSource) -> int:
    """About how many UTF-8 bytes of text ``docs`` holds, for the percentage and the ETA: the
    file sizes, except for parquet, whose file is compressed (there, the column's size
    uncompressed, from the file's metadata)."""
    if docs.path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(docs.path).metadata
            names = [meta.schema.column(j).name for j in range(meta.num_columns)]
            j = names.index(docs.text_field)
            return sum(meta.row_group(i).column(j).total_uncompressed_size for i in range(meta.num_row_groups))
        except Exception:  # an unreadable file is reported by the reading itself
            pass
    return docs.size_bytes()


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

            self.bar = tqdm(total=self.total, desc=f"prepare: {what}", unit="B", unit_scale=True, file=sys.stdout,
                            dynamic_ncols=True, leave=False)
        else:
            self.log(f"prepare: {what} ({_megabytes(self.total)} expected)")

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
                self.log(f"prepare: {self.what} {100 * self.done // self.total}% "
                         f"({_rate_and_eta(self.done, self.total, now - self.start)})")
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


def _megabytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _rate_and_eta(done: int, total: int, seconds: float) -> str:
    rate = done / max(seconds, 1e-9)
    return f"{_megabytes(done)}, {rate / 1e6:.1f} MB/s, ETA {format_seconds((total - done) / max(rate, 1e-9))}"


def format_seconds(seconds: float) -> str:
    from .monitor import format_duration

    return f"{seconds:.1f}s" if seconds < 60 else format_duration(seconds)


def prepare(
    source,
    out_dir,
    tokenizer_kind: str = "bpe",
    vocab_size: int = 512,
    val_fraction: float = 0.1,
    separator: str = SEPARATOR,
    text_field: str = "text",
    tokenizer: Tokenizer | None = None,
    seq_len: int = 256,
    progress: bool | str = True,
    compressor_sample_bytes: int = COMPRESSOR_SAMPLE_BYTES,
    log=print,
) -> PreparedData:
    """Tokenize ``source`` once into ``out_dir``; returns the opened result.

    Two streaming passes: the first trains the tokenizer (BPE on the training documents,
    up to 100 MB of them; the char vocabulary on everything), the second encodes in chunks,
    with BPE running on all cores, and appends to the shard files. Memory stays bounded by
    the chunk size whatever the corpus size.

    The compressor bounds (:func:`compressor_bits_per_byte`, on up to ``compressor_sample_bytes``
    of each split) run beside the last chunk's encoding; ``compressor_sample_bytes=0`` skips them
    (``meta["compressor_bpb"]`` is then None): a training run does, because xz competes with the
    encoding for the cores (tiny-shakespeare with BPE 8,192: 2.08 s with them, 1.29 s without,
    ``benchmarks/prepare_throughput.py``) and nothing in the run reads the figures.

    ``progress``: ``"auto"`` (True), ``"bar"``, ``"lines"`` or False, as :class:`PrepareProgress`
    shows it; a source under ``PROGRESS_MIN_BYTES`` prepares silently whatever it says.
    """
    t0 = time.perf_counter()
    docs = DocumentSource(source, separator, text_field)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NanolmError(f"--out {out} is a file; give a directory for the shards")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in (*DATA_FILES, META_FILE, LOCK_FILE)) \
        if out.is_dir() else []
    if foreign:
        raise NanolmError(f"{out} already holds {foreign[0]}, which prepare did not write; choose a new or empty --out")
    total_bytes = docs.size_bytes()
    shown = PrepareProgress(_progress_mode(progress, total_bytes, log), log)
    out.mkdir(parents=True, exist_ok=True)

    expected = _expected_text_bytes(docs) if shown.mode else 0
    if tokenizer is None:
        tokenizer = _trained_tokenizer(docs, tokenizer_kind, vocab_size, val_fraction, expected, shown)
    tokenizer.save(out / "tokenizer.json")
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    writers = {name: _SplitWriter(out / f"{name}.bin", dtype) for name in ("train", "val")}

    chunk: dict[str, list[str]] = {"train": [], "val": []}
    chunk_chars = 0
    sample = {"train": [], "val": []}
    sample_size = {"train": 0, "val": 0}

    def flush():
        nonlocal chunk_chars
        for name, texts in chunk.items():
            if texts:
                before = writers[name].n_bytes
                writers[name].write_docs(tokenizer.encode_batch(texts), texts, tokenizer.eos_id)
                shown.advance(writers[name].n_bytes - before)
        chunk["train"], chunk["val"], chunk_chars = [], [], 0

    doc_nats = _known_document_entropy(Path(source))
    val_nats = 0.0
    n_docs = {"train": 0, "val": 0}
    shown.begin("encoding", expected)
    for i, (split, text) in enumerate(split_documents(iter(docs), val_fraction)):
        chunk[split].append(text)
        n_docs[split] += 1
        if doc_nats is not None and split == "val" and i < len(doc_nats):
            val_nats += doc_nats[i]
        chunk_chars += len(text)
        if sample_size[split] < compressor_sample_bytes:
            piece = text.encode("utf-8")[: compressor_sample_bytes - sample_size[split]]
            sample[split].append(piece)
            sample_size[split] += len(piece)
        if chunk_chars >= 8_000_000:
            flush()
    with ThreadPoolExecutor(max_workers=1) as background:  # the compressors run while the last chunk encodes
        compressor_bpb = (background.submit(compressor_bits_per_byte, b"".join(sample["train"]),
                                            b"".join(sample["val"])) if compressor_sample_bytes else None)
        flush()
    done, seconds = shown.end()
    shown.say(f"prepare: encoded {_megabytes(done)} in {format_seconds(seconds)} "
              f"({done / 1e6 / max(seconds, 1e-9):.1f} MB/s)")
    for name, w in writers.items():
        w.close(out, name)
    if n_docs["train"] == 0:
        raise NanolmError(f"{source} holds no document with text (empty documents skipped: {docs.empty})")

    seconds = time.perf_counter() - t0
    meta = _prepared_meta(source, tokenizer, dtype, writers, n_docs, docs, val_fraction, seq_len, seconds, total_bytes)
    meta["compressor_bpb"] = compressor_bpb.result() if compressor_bpb is not None else None
    if doc_nats is not None and len(doc_nats) == sum(n_docs.values()) and writers["val"].n_tokens:
        meta["floor"] = {
            "nats": val_nats,
            "bpb": val_nats / math.log(2) / max(1, writers["val"].n_bytes),
            "nats_per_token": val_nats / (writers["val"].n_tokens - 1),
        }
    elif doc_nats is not None:
        log("note: the corpus's entropy file does not match its documents; no loss floor is reported")
    meta["files"] = manifest(out, DATA_FILES)
    atomic_write_text(out / META_FILE, json.dumps(sealed(meta), indent=2))
    for problem in docs.problems[:20]:
        log(f"skipped {problem}")
    if len(docs.problems) > 20:
        log(f"... and {len(docs.problems) - 20} more bad records")
    shown.closing(f"{_megabytes(total_bytes)} into {sum(w.n_tokens for w in writers.values()):,} tokens")
    return PreparedData(out, verify=False)


def _trained_tokenizer(docs, kind: str, vocab_size: int, val_fraction: float, expected: int,
                       shown: PrepareProgress) -> Tokenizer:
    """The first pass: the tokenizer learned from ``docs``, its progress shown by ``shown``."""
    start = time.monotonic()
    reads = expected if kind == "char" else min(BPE_TRAINING_CHARS, round(expected * (1 - val_fraction)))

    def read_all(done, seconds):
        if kind == "bpe":
            shown.say(f"prepare: the tokenizer read {_megabytes(done)} in {format_seconds(seconds)}; "
                      f"computing its merges")

    texts = shown.follow(_tokenizer_texts(docs, kind, val_fraction), f"training the {kind} tokenizer", reads,
                         on_end=read_all)
    # not the Rust trainer's own bars (show_progress): for texts from an iterator its first bar
    # has no end, hence no ETA, and it would draw over this one
    tokenizer = train_tokenizer(kind, texts, vocab_size)
    shown.say(f"prepare: tokenizer trained in {format_seconds(time.monotonic() - start)} "
              f"({kind}, {tokenizer.vocab_size} tokens)")
    return tokenizer


def _tokenizer_texts(docs, kind: str, val_fraction: float):
    """What the tokenizer learns from: BPE the training documents (up to 100 MB of them), the
    char vocabulary every document (a character only in validation must be encodable too)."""
    budget = BPE_TRAINING_CHARS
    for split, text in split_documents(iter(docs), val_fraction):
        if kind == "char" or split == "train":
            yield text
            budget -= len(text)
            if budget <= 0 and kind != "char":
                return


def _prepared_meta(source, tokenizer, dtype, writers, n_docs, docs, val_fraction, seq_len, seconds, total_bytes) -> dict:
    crossing, n_windows = boundary_crossing_windows(
        np.asarray(writers["train"].doc_starts), writers["train"].n_tokens, seq_len
    )
    return {
        "source": str(source),
        "tokenizer": tokenizer.kind,
        "tokenizer_fingerprint": tokenizer.fingerprint(),
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": np.dtype(dtype).name,
        "max_id": max(w.max_id for w in writers.values()),
        "val_fraction": val_fraction,
        "splits": {
            name: {"documents": n_docs[name], "tokens": w.n_tokens, "bytes": w.n_bytes}
            for name, w in writers.items()
        },
        "empty_documents_skipped": docs.empty,
        "bad_records": len(docs.problems),
        "mean_doc_tokens": round(writers["train"].n_tokens / max(1, n_docs["train"]), 1),
        "seq_len_for_stats": seq_len,
        "windows_crossing_a_boundary": crossing,
        "windows": n_windows,
        "seconds": round(seconds, 2),
        "mb_per_s": round(total_bytes / 1e6 / max(seconds, 1e-9), 2),
    }
