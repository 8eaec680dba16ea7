"""The forms a corpus is published in: which files ``--data`` names, and how each is opened.

Corpora come as one file, a directory of shards (``train-00000-of-00099.parquet``...), a glob,
archives (``.jsonl.zst``, ``.txt.gz``) or a Hugging Face dataset saved with ``save_to_disk``.
:func:`find_shards` turns ``--data`` into the list of :class:`Shard` files in the order their
documents are read (sorted by name: the same on every machine, whatever order a file system lists
a directory in); :func:`open_binary` reads one, decompressing as it goes (never unpacked to
disk). What the documents inside look like is ``nanolm/data/sources.py``'s concern.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import io
import lzma
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..base.documents import read_json
from ..errors import NanolmError, brief

FORMS = {".txt": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
SINGLE_FILE_TEXT = (".md", ".text", "")  # read as text when named alone, not picked from a directory
COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
GLOB_CHARACTERS = "*?["
ARCHIVE_GUESS_RATIO = 4  # text per byte of a compressed file whose size it does not record, for the ETA
SUPPORTED = ".txt, .jsonl or .parquet files (the text forms also .gz, .bz2, .xz or .zst), or a save_to_disk directory"


@dataclass(frozen=True)
class Shard:
    """One file of a corpus: where it is, the name it is known by (relative to the source, as
    the prepared data's meta records it), how its documents are stored and compressed."""

    path: Path
    name: str
    form: str
    compression: str | None

    def identity(self) -> dict:
        """What says that the file is still the one read before: its size and modification time
        (a change to either, and a prepare that was interrupted starts over)."""
        st = self.path.stat()
        return {"name": self.name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def shard_form(path: Path, alone: bool = False) -> tuple[str, str | None] | None:
    """(form, compression) of a file by its name, or None if it holds no documents nanolm reads.
    ``alone``: the file was named by itself, where any other suffix is read as plain text."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    inner = (suffixes[-2] if len(suffixes) > 1 else "") if compression else (suffixes[-1] if suffixes else "")
    if inner in FORMS and not (compression and FORMS[inner] in ("parquet", "arrow")):
        return FORMS[inner], compression
    if alone and not compression and inner in SINGLE_FILE_TEXT:
        return "txt", None
    if alone and compression and inner in SINGLE_FILE_TEXT:
        return "txt", compression
    return None


def find_shards(path) -> list[Shard]:
    """The shards ``--data`` names, in the order their documents are read."""
    text = str(path)
    path = Path(path)
    if not path.exists() and any(c in text for c in GLOB_CHARACTERS):
        matches = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not matches:
            raise NanolmError(
                f"--data {text} matches no file; check the pattern (quote it so the shell does not expand it)"
            )
        root = Path(os.path.commonpath([str(m.parent) for m in matches]))
        shards = []
        for m in matches:
            form = shard_form(m)
            if form is None:
                raise NanolmError(f"{m} (matched by {text}) is not a corpus shard; supported: {SUPPORTED}")
            shards.append(Shard(m, m.relative_to(root).as_posix(), *form))
        return shards
    if not path.exists():
        raise NanolmError(f"data path {path} does not exist")
    if path.is_dir():
        return _directory_shards(path)
    if not path.is_file():  # a pipe: <(command), a FIFO, a terminal
        raise NanolmError(
            f"data path {path} is a pipe or a device, which can be read only once, and nanolm "
            f"reads its data twice (the tokenizer, then the shards); save it to a file first "
            f"(command > data.txt) and pass that file"
        )
    form = shard_form(path, alone=True)
    if form is None:
        raise NanolmError(f"{path}: unsupported file type {''.join(path.suffixes[-2:])!r}; use {SUPPORTED}")
    return [Shard(path, path.name, *form)]


def _directory_shards(path: Path) -> list[Shard]:
    if (path / "dataset_dict.json").is_file():
        raise NanolmError(
            f"{path} is a dataset dictionary saved with save_to_disk; pass one split's directory "
            f"(such as {path / 'train'})"
        )
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return _saved_dataset_shards(path)
    shards = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # .cache, .git: not the corpus
        for name in files:
            file = Path(root) / name
            form = None if name.startswith(".") else shard_form(file)
            if form is not None and file.is_file():
                shards.append(Shard(file, file.relative_to(path).as_posix(), *form))
    shards.sort(key=lambda s: s.name)
    if not shards:
        raise NanolmError(f"directory {path} holds no corpus shards ({SUPPORTED})")
    return shards


def _saved_dataset_shards(path: Path) -> list[Shard]:
    """The ``.arrow`` files of a Hugging Face dataset saved with ``save_to_disk``, in the order
    its ``state.json`` lists them (read with pyarrow: the ``datasets`` library is not needed)."""
    state = read_json(path / "state.json")
    files = state.get("_data_files") if isinstance(state, dict) else None
    names = (
        [f.get("filename") for f in files]
        if isinstance(files, list) and all(isinstance(f, dict) for f in files)
        else None
    )
    if not names or not all(isinstance(n, str) and n and "/" not in n and n not in (".", "..") for n in names):
        raise NanolmError(f"{path / 'state.json'} lists no data files (_data_files); save the dataset again")
    shards = [Shard(path / n, n, "arrow", None) for n in names]
    for shard in shards:
        if not shard.path.is_file():
            raise NanolmError(f"{shard.path} is listed in {path / 'state.json'} but missing; save the dataset again")
    return shards


def _damage_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [EOFError, lzma.LZMAError, zlib.error, gzip.BadGzipFile]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def is_damage(e: BaseException) -> bool:
    """A decompressor's complaint about its input (bz2 says ``OSError`` without an errno), not a
    failing disk (an ``OSError`` with one)."""
    return isinstance(e, _damage_errors()) or (isinstance(e, OSError) and e.errno is None)


def open_binary(shard: Shard):
    """The shard's bytes, decompressed as they are read."""
    if shard.compression is None:
        return open(shard.path, "rb")
    if shard.compression == "gzip":
        return gzip.open(shard.path, "rb")
    if shard.compression == "bzip2":
        return bz2.open(shard.path, "rb")
    if shard.compression == "xz":
        return lzma.open(shard.path, "rb")
    try:
        import zstandard
    except ImportError:
        raise NanolmError(f"reading {shard.path} needs zstandard: pip install 'nanolm[zstd]'") from None
    raw = zstandard.ZstdDecompressor().stream_reader(open(shard.path, "rb"), read_across_frames=True, closefd=True)
    return io.BufferedReader(raw, 1 << 20)


def damaged(shard: Shard, e: BaseException) -> NanolmError:
    return NanolmError(
        f"{shard.path} is damaged: its {shard.compression} data cannot be read ({brief(str(e) or type(e).__name__, 120)}); "
        f"download the shard again or remove it"
    )


def expected_text_bytes_of(shard: Shard, text_field: str) -> int:
    """The file's size, except where it is compressed: parquet's column size uncompressed (from
    its metadata), gzip's recorded size, zstd's first frame's when it records one, else a guess."""
    size = shard.path.stat().st_size
    try:
        if shard.form == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(shard.path).metadata
            names = [meta.schema.column(j).name for j in range(meta.num_columns)]
            j = names.index(text_field)
            return sum(meta.row_group(i).column(j).total_uncompressed_size for i in range(meta.num_row_groups))
        if shard.compression == "gzip":
            with open(shard.path, "rb") as f:
                f.seek(-4, os.SEEK_END)
                recorded = int.from_bytes(f.read(4), "little")  # modulo 4 GiB
            return recorded if recorded >= size else ARCHIVE_GUESS_RATIO * size
        if shard.compression == "zstd":
            import zstandard

            with open(shard.path, "rb") as f:
                recorded = zstandard.frame_content_size(f.read(18))
            return recorded if recorded > 0 else ARCHIVE_GUESS_RATIO * size
    except Exception:  # an unreadable file is reported by the reading itself
        pass
    return ARCHIVE_GUESS_RATIO * size if shard.compression else size
