"""Preparing a corpus once: documents → tokenizer → token shards, with what a run needs to know of them.

:func:`prepare` trains the tokenizer and tokenizes once into the shards of
``nanolm/data/shards.py`` (whose :func:`~nanolm.data.shards.join_documents` says how the
documents are laid out in the stream). Beside the shards it records two references for the loss: the bits per byte that zlib and xz need for the
validation text, and, for the built-in stories, their exact entropy. :func:`load_training_data`
is what a run does with ``--data``: the built-in corpus, shards prepared before, a corpus
downloaded by name, or a file prepared now (or copied from the cache of what an earlier run
prepared from the same text, ``nanolm/data/cache.py``).
"""

from __future__ import annotations

import contextlib
import json
import lzma
import math
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..base import disk
from ..base.documents import MAX_METADATA_BYTES, read_json
from ..base.files import atomic_write_text, manifest, replace_directory, sealed
from ..base.lock import LOCK_FILE, ScratchDirectory, remove_abandoned_scratch
from ..errors import NanolmError
from ..tokenizer import Tokenizer, train_tokenizer
from .cache import keep_prepared, prepared_key, reuse_prepared
from .corpus import entropy_path, write_stories
from .download import resolve_data_path
from .progress import PrepareProgress, expected_text_bytes, format_seconds, megabytes, progress_mode
from .shards import DATA_FILES, META_FILE, PreparedData, SplitWriter
from .sources import SEPARATOR, DocumentSource, split_documents

BPE_TRAINING_CHARS = 100_000_000  # BPE learns its merges from at most this much training text


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
        sizes = {
            (name, part): pool.submit(compress, data)
            for name, compress in compressors.items()
            for part, data in (("context", context), ("both", context + text))
            if data
        }
        sizes = {key: future.result() for key, future in sizes.items()}
    out = {}
    for name in compressors:
        extra = sizes[name, "both"] - sizes.get((name, "context"), 0)
        out[name] = round(8 * max(extra, 1) / len(text), 4)
    return out


def _known_document_entropy(source: Path, log=print) -> list[float] | None:
    """Per-document information (nats) written by ``nanolm data stories`` beside the text.

    The file holds one number per story, so a large corpus has a large one: it is read up to the size of the text it describes (each story is longer than
    its number), not up to the few megabytes of a metadata file. A damaged or foreign file gives
    no floor, and a note says so."""
    path = entropy_path(source)
    if not source.is_file() or not path.is_file():
        return None
    try:
        nats = read_json(path, max_bytes=max(MAX_METADATA_BYTES, source.stat().st_size))["doc_nats"]
        if isinstance(nats, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in nats):
            return [float(x) for x in nats]
        problem = f"{path} holds no list of numbers under doc_nats"
    except NanolmError as e:
        problem = str(e)
    except (KeyError, TypeError, IndexError):
        problem = f"{path} holds no list of numbers under doc_nats"
    log(f"note: {problem}; no loss floor is reported")
    return None


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
    encoding for the cores and nothing in the run reads the figures (``benchmarks/prepare_throughput.py``
    measures the difference).

    ``progress``: ``"auto"`` (True), ``"bar"``, ``"lines"`` or False, as
    :class:`~nanolm.data.progress.PrepareProgress` shows it; a small source prepares silently
    whatever it says.
    """
    t0 = time.perf_counter()
    docs = DocumentSource(source, separator, text_field)
    out = Path(out_dir)
    _refuse_foreign_files(out)
    made = []
    scratch = None
    try:
        disk.make_dir(out.parent, parents=True, exist_ok=True, made=made)
        scratch = ScratchDirectory(out, "prepare")
        staging = scratch.path
        disk.chmod(staging, 0o777 & ~_umask())  # as a plain mkdir would make it (mkdtemp's is private)
        _prepare_into(
            staging,
            docs,
            source,
            tokenizer_kind,
            vocab_size,
            val_fraction,
            tokenizer,
            seq_len,
            progress,
            compressor_sample_bytes,
            log,
            t0,
        )
        replace_directory(staging, out, last=META_FILE)
    except BaseException as e:  # refused, interrupted or out of room: --out as it was, a new one never made
        if scratch is not None:
            disk.remove_tree(scratch.path, ignore_errors=True)
            if isinstance(e, OSError) and isinstance(e.filename, str):  # the file --out would have held
                e.filename = e.filename.replace(str(scratch.path), str(out), 1)
        for directory in reversed(made):
            try:
                disk.remove_dir(directory)
            except OSError:
                break
        raise
    finally:
        if scratch is not None:
            scratch.let_go()
    return PreparedData(out, verify=False)


def remove_abandoned_attempts(out_dir) -> None:
    """Delete the scratch directories that killed preparations into ``out_dir`` left beside it
    (``kill -9`` runs no cleanup). Only for a caller that holds ``out_dir``'s lock: then no
    other preparation into it is under way."""
    remove_abandoned_scratch(out_dir, "prepare")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _prepare_into(
    out: Path,
    docs: DocumentSource,
    source,
    tokenizer_kind: str,
    vocab_size: int,
    val_fraction: float,
    tokenizer: Tokenizer | None,
    seq_len: int,
    progress,
    compressor_sample_bytes: int,
    log,
    t0: float,
):
    """:func:`prepare`'s work, into ``out``: a scratch directory that becomes ``--out`` only when whole."""
    total_bytes = docs.size_bytes()
    shown = PrepareProgress(progress_mode(progress, total_bytes, log), log)
    expected = expected_text_bytes(docs) if shown.mode else 0
    if tokenizer is None:
        tokenizer = _trained_tokenizer(docs, tokenizer_kind, vocab_size, val_fraction, expected, shown)
    tokenizer.save(out / "tokenizer.json")
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    writers = {name: SplitWriter(out / f"{name}.bin", dtype) for name in ("train", "val")}
    doc_nats = _known_document_entropy(Path(source), log)
    shown.begin("encoding", expected)
    try:
        n_docs, val_nats, compressor_bpb = _encode(
            docs, tokenizer, writers, val_fraction, doc_nats, compressor_sample_bytes, shown
        )
    except BaseException:
        for w in writers.values():  # the scratch directory is deleted next
            with contextlib.suppress(OSError):
                w.f.close()
        raise
    done, seconds = shown.end()
    shown.say(
        f"prepare: encoded {megabytes(done)} in {format_seconds(seconds)} ({done / 1e6 / max(seconds, 1e-9):.1f} MB/s)"
    )
    if n_docs["train"] == 0:
        raise NanolmError(
            f"{source} holds no document with text (empty documents skipped: {docs.empty}"
            + (f"; bad records skipped: {len(docs.problems)}, the first: {docs.problems[0]}" if docs.problems else "")
            + ")"
        )
    for name, w in writers.items():
        w.close(out, name)

    seconds = time.perf_counter() - t0
    meta = _prepared_meta(source, tokenizer, dtype, writers, n_docs, docs, val_fraction, seq_len, seconds, total_bytes)
    meta["compressor_bpb"] = compressor_bpb
    if doc_nats is not None and len(doc_nats) == sum(n_docs.values()) and writers["val"].n_tokens:
        meta["floor"] = {
            "nats": val_nats,
            "bpb": val_nats / math.log(2) / max(1, writers["val"].n_bytes),
            "nats_per_token": val_nats / (writers["val"].n_tokens - 1),
        }
    elif doc_nats is not None and len(doc_nats) != sum(n_docs.values()):
        log("note: the corpus's entropy file does not match its documents; no loss floor is reported")
    meta["files"] = manifest(out, DATA_FILES)
    atomic_write_text(out / META_FILE, json.dumps(sealed(meta), indent=2))
    for problem in docs.problems[:20]:
        log(f"skipped {problem}")
    if len(docs.problems) > 20:
        log(f"... and {len(docs.problems) - 20} more bad records")
    shown.closing(f"{megabytes(total_bytes)} into {sum(w.n_tokens for w in writers.values()):,} tokens")


def load_training_data(cfg, scratch: Path, log=print, compressor_bounds: bool = True) -> PreparedData:
    """The run's data, prepared (tokenized into shards) if it is raw text.

    No ``--data``: the built-in story corpus, generated from the seed, with its exact
    entropy. A directory made by ``nanolm prepare`` is used as it is, tokenizer included.
    A known corpus name (``shakespeare``, ``tinystories``) that is not a local path is
    downloaded once, verified and cached. ``compressor_bounds`` False skips the zlib and xz
    bounds of raw text (:func:`prepare`): training does, ``nanolm doctor`` does not.
    """
    d = cfg.data
    if not d.data:
        source = scratch / "stories.txt"
        write_stories(source, d.stories, seed=0)  # the corpus stays fixed whatever --seed is
        log(f"data: {d.stories} generated stories (the built-in corpus; its entropy is known)")
    else:
        source = resolve_data_path(d.data, log)
        if (source / "meta.json").is_file():
            data = PreparedData(source)
            log(
                f"data: prepared shards in {source}; their {data.meta['tokenizer']} tokenizer of "
                f"{data.tokenizer.vocab_size} tokens is used (--tokenizer and --vocab-size do not apply)"
            )
            return data
        log(f"data: {source}")
    compressor_sample_bytes = COMPRESSOR_SAMPLE_BYTES if compressor_bounds else 0
    settings = dict(
        tokenizer=d.tokenizer,
        vocab_size=d.vocab_size,
        val_fraction=d.val_fraction,
        separator=d.separator,
        text_field=d.text_field,
        seq_len=cfg.model.seq_len,
        compressor_sample_bytes=compressor_sample_bytes,
    )
    key = prepared_key(source, settings)  # None: not kept (too large, the cache off)
    kept = reuse_prepared(key, scratch / "data", source, log) if key else None
    if kept is not None:
        return kept
    data = prepare(
        source,
        scratch / "data",
        d.tokenizer,
        d.vocab_size,
        d.val_fraction,
        d.separator,
        d.text_field,
        seq_len=cfg.model.seq_len,
        progress=cfg.train.progress,
        log=log,
        compressor_sample_bytes=compressor_sample_bytes,
    )
    if key:
        keep_prepared(key, data.dir, log)
    return data


def _refuse_foreign_files(out: Path) -> None:
    """``out`` must be a directory that holds nothing but what prepare writes (or not exist yet)."""
    if out.exists() and not out.is_dir():
        raise NanolmError(f"--out {out} is a file; give a directory for the shards")
    foreign = (
        sorted(p.name for p in out.iterdir() if p.name not in (*DATA_FILES, META_FILE, LOCK_FILE))
        if out.is_dir()
        else []
    )
    if foreign:
        raise NanolmError(f"{out} already holds {foreign[0]}, which prepare did not write; choose a new or empty --out")


def _encode(
    docs,
    tokenizer: Tokenizer,
    writers: dict,
    val_fraction: float,
    doc_nats: list[float] | None,
    compressor_sample_bytes: int,
    shown: PrepareProgress,
) -> tuple[dict, float, dict | None]:
    """The second pass: every document encoded into its split's shard, ~8 MB of text at a time.
    Returns the documents per split, the validation documents' known information (nats) and
    the compressor bounds (None when ``compressor_sample_bytes`` is 0)."""
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

    val_nats = 0.0
    n_docs = {"train": 0, "val": 0}
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
        compressor_bpb = (
            background.submit(compressor_bits_per_byte, b"".join(sample["train"]), b"".join(sample["val"]))
            if compressor_sample_bytes
            else None
        )
        flush()
    return n_docs, val_nats, compressor_bpb.result() if compressor_bpb is not None else None


def _trained_tokenizer(
    docs, kind: str, vocab_size: int, val_fraction: float, expected: int, shown: PrepareProgress
) -> Tokenizer:
    """The first pass: the tokenizer learned from ``docs``, its progress shown by ``shown``."""
    start = time.monotonic()
    reads = expected if kind == "char" else min(BPE_TRAINING_CHARS, round(expected * (1 - val_fraction)))

    def read_all(done, seconds):
        if kind == "bpe":
            shown.say(
                f"prepare: the tokenizer read {megabytes(done)} in {format_seconds(seconds)}; computing its merges"
            )

    texts = shown.follow(
        _tokenizer_texts(docs, kind, val_fraction), f"training the {kind} tokenizer", reads, on_end=read_all
    )
    # not the Rust trainer's own bars (show_progress): for texts from an iterator its first bar
    # has no end, hence no ETA, and it would draw over this one
    tokenizer = train_tokenizer(kind, texts, vocab_size)
    shown.say(
        f"prepare: tokenizer trained in {format_seconds(time.monotonic() - start)} "
        f"({kind}, {tokenizer.vocab_size} tokens)"
    )
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


def _prepared_meta(
    source, tokenizer, dtype, writers, n_docs, docs, val_fraction, seq_len, seconds, total_bytes
) -> dict:
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
            name: {"documents": n_docs[name], "tokens": w.n_tokens, "bytes": w.n_bytes} for name, w in writers.items()
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
