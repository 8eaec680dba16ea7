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
import errno
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
from ..base.files import atomic_write_text, cache_dir, manifest, move_directory, replace_directory, sealed, sha256_file
from ..base.lock import LOCK_FILE, DirectoryBusy, RunLock, ScratchDirectory
from ..errors import NanolmError, brief
from ..tokenizer import Tokenizer, train_tokenizer
from .cache import keep_prepared, prepared_key, reuse_prepared
from .corpus import entropy_path, write_stories
from .download import resolve_data_path
from .encoders import Encoders
from .pieces import PIECE_CHARS, PROGRESS_FILE, Progress, SplitProgress, unfinished_attempt, writer_code_digest
from .progress import PrepareProgress, expected_text_bytes, format_seconds, megabytes, progress_mode
from .shards import DATA_FILES, META_FILE, PreparedData, SplitWriter
from .sources import SEPARATOR, DocumentSource, split_documents

BPE_TRAINING_CHARS = 100_000_000  # BPE learns its merges from at most this much training text


def boundary_crossing_windows(doc_starts: np.ndarray, n_tokens: int, seq_len: int) -> tuple[int, int]:
    """(windows whose input holds more than one document, all windows), stride ``seq_len``.

    A document's span starts at the EOS before its first token (the EOS opens it), so a
    window w crosses a boundary when such an EOS sits strictly inside it: w·T < eos < w·T + T.
    Counted a block of starts at a time (they may be memory-mapped: a corpus of millions of
    documents); the starts increase, so a window met at the end of one block and the start of the
    next is the same window, counted once.
    """
    n_windows = max(0, (n_tokens - 1) // seq_len)
    if n_windows == 0:
        return 0, 0
    crossing, last = 0, -1
    for begin in range(0, len(doc_starts), 1 << 20):
        starts = np.asarray(doc_starts[begin : begin + (1 << 20)])
        eos = starts[starts > 0] - 1
        eos = eos[eos % seq_len != 0]
        window = eos // seq_len
        window = np.unique(window[window < n_windows])
        crossing += len(window) - int(len(window) > 0 and window[0] == last)
        last = window[-1] if len(window) else last
    return int(crossing), n_windows


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
    work_dir=None,
    workers: int | None = None,
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

    ``workers``: processes that encode a large source (0: one per core; None, the default: this
    process's threads, which needs no main-module guard; ``nanolm/data/encoders.py``).

    ``progress``: ``"auto"`` (True), ``"bar"``, ``"lines"`` or False, as
    :class:`~nanolm.data.progress.PrepareProgress` shows it; a small source prepares silently
    whatever it says.

    The work is done a piece at a time in a scratch directory beside ``out_dir`` (or in
    ``work_dir``, from where the result is moved), and an interrupted prepare continues from its
    last finished piece (:mod:`nanolm.data.pieces`).
    """
    t0 = time.perf_counter()
    docs = DocumentSource(source, separator, text_field)
    docs.check()  # every shard's head, before anything is written
    out = Path(out_dir)
    _refuse_foreign_files(out)
    settings = dict(
        tokenizer=tokenizer_kind if tokenizer is None else f"given {tokenizer.fingerprint()}",
        vocab_size=vocab_size if tokenizer is None else None,
        val_fraction=val_fraction,
        separator=separator,
        text_field=text_field,
        seq_len=seq_len,
        compressor_sample_bytes=compressor_sample_bytes,
    )
    request = (settings, docs.identity(), writer_code_digest())
    target = out if work_dir is None else Path(work_dir) / out.name
    made = []
    scratch = None
    try:
        disk.make_dir(target.parent, parents=True, exist_ok=True, made=made)
        adopt = unfinished_attempt(target, *request, log=log)
        scratch = ScratchDirectory(target, "prepare", adopt=adopt)
        if adopt is None:
            disk.chmod(scratch.path, 0o777 & ~_umask())  # as a plain mkdir would make it (mkdtemp's is private)
        record = Progress.load(scratch.path) if adopt is not None else None
        _prepare_into(
            scratch.path,
            docs,
            source,
            request,
            record,
            tokenizer_kind,
            vocab_size,
            val_fraction,
            tokenizer,
            seq_len,
            progress,
            compressor_sample_bytes,
            log,
            t0,
            workers,
        )
        if work_dir is None:
            replace_directory(scratch.path / "data", out, last=META_FILE)
        else:
            disk.make_dir(out.parent, parents=True, exist_ok=True)
            move_directory(scratch.path / "data", out)
        disk.remove_tree(scratch.path, ignore_errors=True)
    except BaseException as e:  # refused, interrupted or out of room: --out as it was, a new one never made
        if scratch is not None and _worth_keeping(e, scratch.path):
            log(
                f"prepare: stopped ({brief(e) or type(e).__name__}); its finished pieces are kept in "
                f"{scratch.path}, and the same command continues from them"
            )
        elif scratch is not None:
            disk.remove_tree(scratch.path, ignore_errors=True)
            for directory in reversed(made):
                try:
                    disk.remove_dir(directory)
                except OSError:
                    break
        if scratch is not None and isinstance(e, OSError) and isinstance(e.filename, str):
            e.filename = e.filename.replace(str(scratch.path / "data"), str(out), 1)  # the file --out would hold
        raise
    finally:
        if scratch is not None:
            scratch.let_go()
    return PreparedData(out, verify=False)


def _worth_keeping(e: BaseException, attempt: Path) -> bool:
    """An interrupted prepare (Ctrl-C, a full or failing disk, a kill) keeps what it finished for the
    next attempt; one refused for its input (a damaged shard) or for its --out (a mount point that
    cannot be renamed over) leaves nothing: the next attempt is another command."""
    refused = isinstance(e, (NanolmError, disk.Stopped)) or (isinstance(e, OSError) and e.errno == errno.EBUSY)
    return not refused and (attempt / PROGRESS_FILE).is_file()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _prepare_into(
    work: Path,
    docs: DocumentSource,
    source,
    request: tuple,
    record: Progress | None,
    tokenizer_kind: str,
    vocab_size: int,
    val_fraction: float,
    tokenizer: Tokenizer | None,
    seq_len: int,
    progress,
    compressor_sample_bytes: int,
    log,
    t0: float,
    workers: int | None,
):
    """:func:`prepare`'s work in the scratch directory ``work``: the data in ``work/data``, which
    becomes ``--out`` only when whole; ``record``, the progress of an interrupted attempt."""
    total_bytes = docs.size_bytes()
    expected = expected_text_bytes(docs)  # the text inside, compressed or not
    shown = PrepareProgress(progress_mode(progress, expected, log), log)
    out = work / "data"
    if record is None:
        disk.make_dir(out)
        if tokenizer is None:
            tokenizer = _trained_tokenizer(docs, tokenizer_kind, vocab_size, val_fraction, expected, shown)
        tokenizer.save(out / "tokenizer.json")
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
        record = Progress(*request, tokenizer_fingerprint=tokenizer.fingerprint(), dtype=np.dtype(dtype).name)
        if expected > PIECE_CHARS:  # from here on, an interrupted prepare continues (one piece: nothing to continue)
            record.save(work)
    else:
        tokenizer = Tokenizer.load(out / "tokenizer.json")  # the record's (Progress.load checked it)
        dtype = np.dtype(record.dtype)
        done = sum(s.bytes for s in record.splits.values())
        log(
            f"prepare: continuing the interrupted prepare in {work}: {record.documents_read:,} documents "
            f"({megabytes(done)}) were encoded before"
        )
        expected = max(0, expected - done)
    writers = {
        name: SplitWriter(out / f"{name}.bin", work / f"{name}_docs.raw", dtype, record.splits[name])
        for name in ("train", "val")
    }
    doc_nats = _known_document_entropy(Path(source), log)
    shown.begin("encoding", expected)
    with ThreadPoolExecutor(max_workers=1) as hashing:  # the shards' digests, read beside the encoding
        digests = hashing.submit(_shard_digests, docs)
        try:
            val_nats, compressor_bpb = _encode(
                docs,
                tokenizer,
                writers,
                val_fraction,
                doc_nats,
                compressor_sample_bytes,
                shown,
                record,
                work,
                workers,
                expected,
            )
        except BaseException:
            for w in writers.values():  # what they hold was recorded or is cut back by the next attempt
                with contextlib.suppress(OSError):
                    w.f.close()
                    w.starts.close()
            raise
        source_files = digests.result()
    done, seconds = shown.end()
    shown.say(
        f"prepare: encoded {megabytes(done)} in {format_seconds(seconds)} ({done / 1e6 / max(seconds, 1e-9):.1f} MB/s)"
    )
    if docs.identity() != record.source:
        raise NanolmError(f"{source} changed while it was being prepared; run the command again")
    n_docs = {name: w.n_docs for name, w in writers.items()}
    if n_docs["train"] == 0:
        raise NanolmError(
            f"{source} holds no document with text (empty documents skipped: {docs.empty}"
            + (f"; bad records skipped: {len(docs.problems)}, the first: {docs.problems[0]}" if docs.problems else "")
            + ")"
        )
    for name, w in writers.items():
        w.close(out, name)

    seconds = time.perf_counter() - t0
    meta = _prepared_meta(
        source, tokenizer, dtype, writers, n_docs, docs, val_fraction, seq_len, seconds, total_bytes, out
    )
    meta["source_files"] = source_files
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


def _shard_digests(docs: DocumentSource) -> list[dict]:
    """Each shard's name, size and SHA-256, for the prepared data's meta: what it was made from."""
    return [{"name": s.name, "bytes": s.path.stat().st_size, "sha256": sha256_file(s.path)} for s in docs.shards]


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
    work = unfinished_work_dir(source, log)
    with RunLock() as lock:  # two runs preparing the same source: the second would remove the first's pieces
        if work is not None:
            try:
                lock.take(work, flag="--data")
            except DirectoryBusy as e:
                raise NanolmError(
                    f"{source} is being prepared by another nanolm now ({brief(e, 120)}); wait for it to "
                    f"finish, then run this again"
                ) from None
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
            work_dir=work,
        )
    if key:
        keep_prepared(key, data.dir, log)
    return data


def unfinished_work_dir(source, log=print) -> Path | None:
    """Where a run prepares ``source``, so that a run killed while it prepares continues the
    work when started again: ``$NANOLM_CACHE/preparing/<hash of the source's path>`` (a run
    prepares in a temporary directory, gone with the process). None where the cache cannot be
    written: the run prepares as before, and a kill costs the whole preparation."""
    import hashlib

    key = hashlib.sha256(str(Path(source).absolute()).encode()).hexdigest()[:16]
    work = cache_dir() / "preparing" / key
    try:
        disk.make_dir(work, parents=True, exist_ok=True)
    except (OSError, NanolmError) as e:
        log(f"warning: {work} cannot be made ({brief(e)}); a run stopped while it prepares will start that over")
        return None
    return work


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
    record: Progress,
    work: Path,
    workers: int | None,
    text_bytes: int,
) -> tuple[float, dict | None]:
    """The second pass: every document encoded into its split's shard, half a piece at a time,
    each half recorded in ``work``'s progress once it is on disk. The documents an earlier
    attempt recorded are read again but not encoded (they give the compressors their sample and
    the floor its information as before).

    Two halves are in the encoders at once, so that they never wait for the disk: while one is
    encoded, the one before it is written, synced and recorded, and the next is read. So a kill
    at any moment loses at most the two halves not yet recorded: one piece (``PIECE_CHARS`` of
    text per worker). Returns the validation documents' known information (nats) and the
    compressor bounds (None when ``compressor_sample_bytes`` is 0)."""
    sample = {"train": [], "val": []}
    sample_size = {"train": 0, "val": 0}
    val_nats = 0.0
    half: dict[str, list[str]] = {"train": [], "val": []}
    chars = 0
    in_flight = []  # (encoding, texts, documents read when it ends), oldest first: two at most

    def write(encoding, texts, documents_read, last=False):
        encoded = encoding.result()
        for name in ("train", "val"):
            before = writers[name].n_bytes
            writers[name].write_docs(encoded[name], texts[name], tokenizer.eos_id)
            shown.advance(writers[name].n_bytes - before)
        if last:  # the prepare finishes next: a kill there loses this half, as anywhere
            return
        for w in writers.values():
            w.sync()
        record.documents_read = documents_read
        record.splits = {name: SplitProgress(w.n_tokens, w.n_bytes, w.n_docs, w.max_id) for name, w in writers.items()}
        record.save(work)

    encoder = Encoders(tokenizer, workers, text_bytes, shown.log)
    half_chars = PIECE_CHARS // 2 * (encoder.workers if encoder.pool is not None else 1)
    i = -1
    with encoder, ThreadPoolExecutor(max_workers=1) as background:
        for i, (split, text) in enumerate(split_documents(iter(docs), val_fraction)):
            if doc_nats is not None and split == "val" and i < len(doc_nats):
                val_nats += doc_nats[i]
            if sample_size[split] < compressor_sample_bytes:
                part = text.encode("utf-8")[: compressor_sample_bytes - sample_size[split]]
                sample[split].append(part)
                sample_size[split] += len(part)
            if i < record.documents_read:
                continue  # encoded by an earlier attempt
            half[split].append(text)
            chars += len(text)
            if chars >= half_chars:
                if len(in_flight) == 2:  # the oldest is done by now, or nearly: written while the other encodes
                    write(*in_flight.pop(0))
                in_flight.append((encoder.submit(half), half, i + 1))
                half, chars = {"train": [], "val": []}, 0
        # the compressors run while the last halves encode
        compressor_bpb = (
            background.submit(compressor_bits_per_byte, b"".join(sample["train"]), b"".join(sample["val"]))
            if compressor_sample_bytes
            else None
        )
        if chars:
            if len(in_flight) == 2:
                write(*in_flight.pop(0))
            in_flight.append((encoder.submit(half), half, i + 1))
        while in_flight:
            write(*in_flight.pop(0), last=len(in_flight) == 0)
    return val_nats, compressor_bpb.result() if compressor_bpb is not None else None


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
    source, tokenizer, dtype, writers, n_docs, docs, val_fraction, seq_len, seconds, total_bytes, out
) -> dict:
    crossing, n_windows = boundary_crossing_windows(
        np.load(out / "train_docs.npy", mmap_mode="r", allow_pickle=False), writers["train"].n_tokens, seq_len
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
