"""The prepared data on disk: token shards, document starts and a sealed ``meta.json``.

``nanolm prepare`` (``nanolm/data/prepare.py``) writes each split as one flat token file
(``train.bin``/``val.bin``, uint16 when the vocabulary fits, else uint32), read back through
``np.memmap``: the OS pages in only what a batch touches, so a corpus larger than memory
trains fine. The stream's layout is :func:`join_documents`'s. Beside the shards: where each
document starts (for the document mask), the tokenizer, and ``meta.json`` with every file's
checksum. :class:`PreparedData` opens such a directory and checks it before anything trains on it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..base import disk
from ..base.documents import read_json
from ..base.files import check_manifest, check_seal, naming_the_file
from ..base.lock import LOCK_FILE
from ..batches import Split
from ..errors import NanolmError, brief
from ..tokenizer import Tokenizer

META_FILE = "meta.json"


class PreparedData:
    """A directory written by :func:`~nanolm.data.prepare.prepare`: ``train.bin``, ``val.bin``, document starts,
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
            raise NanolmError(
                f"{self.dir} is not a prepared data directory (no {META_FILE}); run `nanolm prepare` first"
            )
        self.meta = _checked_data_meta(read_json(meta_path, f"{meta_path}"), self.dir)
        dtype = np.dtype(self.meta["dtype"])
        largest = {"train.bin": -1, "val.bin": -1}

        def track_largest(name, block):
            whole = len(block) - len(block) % dtype.itemsize  # a damaged file may end mid-id; its checksum fails
            if name in largest and whole:
                largest[name] = max(largest[name], int(np.frombuffer(block[:whole], dtype=dtype).max()))

        if verify:
            check_manifest(
                self.dir,
                self.meta["files"],
                f"prepared data {self.dir}",
                skip=(META_FILE, LOCK_FILE),
                on_block=track_largest,
            )
            self.max_id = max(largest.values())
        else:
            self.max_id = self.meta["max_id"]
        self.tokenizer = Tokenizer.load(self.dir / "tokenizer.json")
        if self.tokenizer.fingerprint() != self.meta["tokenizer_fingerprint"]:
            raise NanolmError(
                f"{self.dir}/tokenizer.json is not the tokenizer these shards were made with; prepare the data again"
            )
        self.splits = {}
        for name in ("train", "val"):
            n = self.meta["splits"][name]["tokens"]
            path = self.dir / f"{name}.bin"
            if path.stat().st_size != n * dtype.itemsize:
                raise NanolmError(
                    f"{path} holds {path.stat().st_size} bytes, expected {n * dtype.itemsize}; it is truncated or corrupt, prepare again"
                )
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
        raise bad(f"dtype {brief(repr(meta.get('dtype')), 40)} is not uint16 or uint32")
    if not isinstance(meta.get("tokenizer_fingerprint"), str) or not isinstance(meta.get("tokenizer"), str):
        raise bad("the tokenizer's fingerprint is missing")
    splits = meta.get("splits")
    if not (
        isinstance(splits, dict)
        and all(
            isinstance(splits.get(n), dict) and count(splits[n].get("tokens")) and count(splits[n].get("bytes"))
            for n in ("train", "val")
        )
    ):
        raise bad("the token and byte counts of the splits are missing or malformed")
    if not isinstance(meta.get("max_id"), int):
        raise bad("max_id is missing")
    floor = meta.get("floor")
    if floor is not None and not (
        isinstance(floor, dict)
        and all(isinstance(floor.get(k), (int, float)) for k in ("nats", "bpb", "nats_per_token"))
    ):
        raise bad("the entropy floor is malformed")
    compressors = meta.get("compressor_bpb")
    if compressors is not None and not (
        isinstance(compressors, dict) and all(isinstance(v, (int, float)) for v in compressors.values())
    ):
        raise bad("the compressor figures are malformed")
    return meta


def _load_doc_starts(path: Path, n_tokens: int) -> np.ndarray:
    """Document start offsets, as plain int64 (``allow_pickle=False``: an .npy file can
    carry pickled objects, which would run code when loaded)."""
    try:
        starts = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise NanolmError(f"{path} is not a plain array of document offsets ({e}); prepare the data again") from None
    if (
        starts.dtype != np.int64
        or starts.ndim != 1
        or (len(starts) and (starts.min() < 0 or starts.max() > n_tokens or (np.diff(starts) <= 0).any()))
    ):
        raise NanolmError(f"{path} does not hold increasing document offsets inside the split; prepare the data again")
    return starts


class SplitWriter:
    """Appends one split's documents to its ``.bin``, each after an EOS, and where each starts to
    a raw file of int64 offsets beside it, counting tokens, bytes, documents and the largest id.

    ``done``: what an interrupted prepare recorded of this split (:mod:`nanolm.data.pieces`);
    the files are cut back to it (a piece written after the record is written again)."""

    def __init__(self, path: Path, starts_path: Path, dtype, done=None):
        self.path, self.starts_path, self.dtype = path, starts_path, np.dtype(dtype)
        self.n_tokens = done.tokens if done else 0
        self.n_bytes = done.bytes if done else 0
        self.n_docs = done.documents if done else 0
        self.max_id = done.max_id if done else -1
        self.f = _opened_at(path, self.n_tokens * self.dtype.itemsize)
        self.starts = _opened_at(starts_path, self.n_docs * 8)

    def write_docs(self, ids_list: list[np.ndarray], texts: list[str], eos_id: int):
        if not ids_list:
            return
        parts = [] if self.n_tokens else [np.array([eos_id])]  # the stream opens with EOS
        offset = self.n_tokens + len(parts)
        starts = []
        for ids, text in zip(ids_list, texts):
            starts.append(offset)
            parts += [ids, np.array([eos_id])]
            offset += len(ids) + 1
            self.n_bytes += len(text.encode("utf-8"))
        block = np.concatenate(parts)
        self.max_id = max(self.max_id, int(block.max()))
        with naming_the_file(self.path):
            disk.write(self.f, block.astype(self.dtype).tobytes(), self.path)
        with naming_the_file(self.starts_path):
            disk.write(self.starts, np.asarray(starts, dtype=np.int64).tobytes(), self.starts_path)
        self.n_tokens += len(block)
        self.n_docs += len(starts)

    def sync(self) -> None:
        """The bytes written so far on the disk: a record that counts them may follow."""
        for f, path in ((self.f, self.path), (self.starts, self.starts_path)):
            with naming_the_file(path):
                f.flush()
                disk.sync(f, path)

    def close(self, directory: Path, name: str):
        """Seal the split: the shard synced, the document starts written as ``NAME_docs.npy``
        (copied from the raw file a block at a time: memory stays bounded however many documents)."""
        self.sync()
        self.f.close()
        self.starts.close()
        starts = directory / f"{name}_docs.npy"
        header = {
            "descr": np.lib.format.dtype_to_descr(np.dtype(np.int64)),
            "fortran_order": False,
            "shape": (self.n_docs,),
        }
        with naming_the_file(starts), disk.create(starts, "wb") as f, open(self.starts_path, "rb") as raw:
            with disk.written_by_library(starts):
                np.lib.format.write_array_header_1_0(f, header)
            for block in iter(lambda: raw.read(1 << 22), b""):
                disk.write(f, block, starts)
            f.flush()
            disk.sync(f, starts)


def _opened_at(path: Path, length: int):
    """``path`` open for appending after its first ``length`` bytes (a new file when 0)."""
    if length == 0:
        return disk.create(path, "wb")
    f = disk.create(path, "r+b")
    try:
        if path.stat().st_size < length:
            raise NanolmError(f"{path} is shorter than its prepare recorded; prepare again")
        disk.truncate_fd(f.fileno(), length, path)
        f.seek(length)
    except BaseException:
        f.close()
        raise
    return f


def join_documents(ids_list: list[np.ndarray], eos_id: int) -> np.ndarray:
    """One token stream ``EOS doc EOS doc ... doc EOS`` from encoded documents: every document
    sits between two EOS tokens, so every one of its tokens, and its end, is predicted (the
    EOS before it is the context of its first token)."""
    eos = np.array([eos_id])
    return np.concatenate([eos] + [part for ids in ids_list for part in (ids, eos)])
