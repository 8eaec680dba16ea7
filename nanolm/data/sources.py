"""Reading documents: the text files, directories, JSON lines and Parquet files a corpus comes in.

A corpus is a sequence of documents (stories, articles, files). They are read from a ``.txt``
file (one document, or several separated by lines holding exactly ``<|endoftext|>``), a
directory of ``.txt`` files (one document each), a ``.jsonl`` file (one JSON object per line
with a text field) or a ``.parquet`` file (the Hugging Face datasets layout; needs
``pyarrow``). The validation split holds out *whole documents* (every k-th one,
:func:`split_documents`), so no validation story was half-seen in training.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ..base.documents import parse_json
from ..errors import NanolmError
from ..tokenizer import EOS

SEPARATOR = EOS
MAX_DOC_CHARS = 1 << 24  # 16 Mi characters; longer documents are split at a line boundary
BINARY_SNIFF_BYTES = 8192  # a file whose head holds a NUL byte is binary, named before its bytes fail as UTF-8


def _open_text_lines(path: Path):
    """Lines of a UTF-8 text file (whatever the system's locale: Windows would read cp1252), with
    errors that name the problem. A NUL byte is no text: a binary file is named as one from its
    head (before its bytes fail as UTF-8), and a NUL further on (a damaged download) too, at its line."""
    with open(path, "rb") as f:
        head = f.read(BINARY_SNIFF_BYTES)
    if b"\x00" in head:
        raise NanolmError(f"{path} looks like a binary file (it contains NUL bytes); pass a UTF-8 text file")
    try:
        with open(path, encoding="utf-8", newline="") as f:
            for lineno, line in enumerate(f, start=1):
                if "\x00" in line:
                    raise NanolmError(
                        f"{path} looks like a binary file (line {lineno} contains a NUL byte); pass a UTF-8 text file"
                    )
                yield line
    except UnicodeDecodeError as e:
        raise NanolmError(f"{path} is not valid UTF-8 ({e.reason} near byte {e.start}); convert it to UTF-8") from None


def _txt_documents(path: Path, separator: str) -> Iterator[str]:
    """Documents of a text file split on lines that hold exactly ``separator``.

    The line break before a separator line is not part of the document. Over-long documents
    (more than ``MAX_DOC_CHARS``) are cut at the next line end into pieces that become
    documents of their own, so no single document has to fit in memory.
    """
    parts: list[str] = []
    size = 0
    for line in _open_text_lines(path):
        if separator and line.rstrip("\r\n") == separator:
            yield _strip_one_line_break("".join(parts))
            parts, size = [], 0
            continue
        parts.append(line)
        size += len(line)
        if size >= MAX_DOC_CHARS:
            yield "".join(parts)
            parts, size = [], 0
    yield "".join(parts)


def _strip_one_line_break(text: str) -> str:
    """The line break just before a separator line belongs to the separator, not the text,
    whichever kind it is (Unix \\n, Windows \\r\\n, old Mac \\r: the file is read split at all three)."""
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith(("\n", "\r")) else text


def _jsonl_documents(path: Path, text_field: str, problems: list[str]) -> Iterator[str]:
    for lineno, line in enumerate(_open_text_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line, "it")
        except NanolmError as e:  # not JSON, or JSON Python cannot hold (too deep, an integer too long)
            problems.append(f"{path}:{lineno}: {str(e).removeprefix('it ').split('; the file')[0]}")
            continue
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            problems.append(f"{path}:{lineno}: no string field {text_field!r}")
            continue
        yield text


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise NanolmError("reading .parquet needs pyarrow: pip install 'nanolm[parquet]'") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise NanolmError(f"{path} is not a readable parquet file ({e})") from None
    if text_field not in pf.schema_arrow.names:
        raise NanolmError(
            f"{path} has no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); set --text-field"
        )
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str):
                yield text


class DocumentSource:
    """Iterates the documents of a path, counting what it skips.

    ``problems`` collects unreadable records (bad JSON lines with their line number);
    ``empty`` counts documents skipped because they hold only whitespace.
    """

    def __init__(self, path, separator: str = SEPARATOR, text_field: str = "text"):
        self.path = Path(path)
        self.separator = separator
        self.text_field = text_field
        self.problems: list[str] = []
        self.empty = 0
        if not self.path.exists():
            raise NanolmError(f"data path {self.path} does not exist")
        if not self.path.is_dir() and not self.path.is_file():  # a pipe: <(command), a FIFO, a terminal
            raise NanolmError(
                f"data path {self.path} is a pipe or a device, which can be read only once, and nanolm "
                f"reads its data twice (the tokenizer, then the shards); save it to a file first "
                f"(command > data.txt) and pass that file"
            )
        if self.path.is_dir():
            self.files = sorted(p for p in self.path.rglob("*.txt") if p.is_file())
            if not self.files:
                raise NanolmError(f"directory {self.path} holds no .txt files")
        elif self.path.suffix not in (".txt", ".jsonl", ".parquet", ".md", ".text", ""):
            raise NanolmError(
                f"{self.path}: unsupported file type {self.path.suffix!r}; use .txt, .jsonl, .parquet or a directory of .txt files"
            )
        if self.path.is_file() and self.path.stat().st_size == 0:
            raise NanolmError(f"{self.path} is empty")

    def size_bytes(self) -> int:
        if self.path.is_dir():
            return sum(f.stat().st_size for f in self.files)
        return self.path.stat().st_size

    def _raw(self) -> Iterator[str]:
        if self.path.is_dir():
            for f in self.files:
                yield "".join(_open_text_lines(f))
        elif self.path.suffix == ".jsonl":
            yield from _jsonl_documents(self.path, self.text_field, self.problems)
        elif self.path.suffix == ".parquet":
            yield from _parquet_documents(self.path, self.text_field)
        else:
            yield from _txt_documents(self.path, self.separator)

    def __iter__(self) -> Iterator[str]:
        self.problems.clear()
        self.empty = 0
        for doc in self._raw():
            if doc.strip():
                yield doc
            else:
                self.empty += 1


def split_single_document(text: str, val_fraction: float) -> tuple[str, str]:
    """Train and validation parts of a corpus that is one document: the last
    ``val_fraction`` of its UTF-8 bytes (moved back to a character boundary) is validation."""
    data = text.encode("utf-8")
    cut = int(len(data) * (1 - val_fraction))
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:  # back off a continuation byte
        cut -= 1
    return data[:cut].decode("utf-8"), data[cut:].decode("utf-8")


def split_documents(docs: Iterator[str], val_fraction: float) -> Iterator[tuple[str, str]]:
    """(split, text) for every document: every k-th document (k = round(1 / val_fraction))
    is held out for validation. A corpus of a single document is split by bytes instead
    (its last ``val_fraction``), one with fewer than k documents gives its last one."""
    k = max(2, round(min(1 / val_fraction, 2**62))) if val_fraction > 0 else 0  # 1 / 1e-320 is inf
    iterator = iter(docs)
    first = next(iterator, None)
    if first is None:
        return
    second = next(iterator, None)
    if second is None:
        train, val = split_single_document(first, val_fraction)
        yield "train", train
        if val:
            yield "val", val
        return
    pending, any_val, i = None, False, 0
    for doc in _chain([first, second], iterator):
        if pending is not None:
            yield "train", pending
            pending = None
        if k and i % k == k - 1:
            any_val = True
            yield "val", doc
        else:
            pending = doc
        i += 1
    if pending is not None:
        yield ("val" if k and not any_val else "train"), pending


def _chain(first, rest):
    yield from first
    yield from rest
