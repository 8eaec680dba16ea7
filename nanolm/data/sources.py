"""Reading documents out of a corpus's shards, and holding out whole ones for validation.

A corpus is a sequence of documents (stories, articles, files), read from its shards in order
(``nanolm/data/published.py`` finds them and opens archives). A ``.txt`` shard holds one document,
or several separated by lines holding exactly ``<|endoftext|>``; a ``.jsonl`` shard one JSON object
per line with a text field (``.json`` is read the same way); a ``.parquet`` or ``.arrow`` shard a
text column (read with ``pyarrow``). The validation split holds out *whole documents* (every k-th
one, :func:`split_documents`) counted across the shards, so the same documents give the same split
whatever form they arrive in, and no validation story was half-seen in training.

Every shard is looked at before anything is written (:meth:`DocumentSource.check`): an empty
shard, a shard without the text column, a damaged archive's head are one line each then, not a
failure an hour into the encoding.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

from ..base.documents import parse_json
from ..errors import NanolmError, brief
from ..tokenizer import EOS
from .published import Shard, damaged, expected_text_bytes_of, find_shards, is_damage, open_binary, shard_form

SEPARATOR = EOS
MAX_DOC_CHARS = 1 << 24  # 16 Mi characters; longer documents are split at a line boundary
BINARY_SNIFF_BYTES = 8192  # a file whose head holds a NUL byte is binary, named before its bytes fail as UTF-8


def _text_lines(shard: Shard) -> Iterator[str]:
    """Lines of a UTF-8 text shard (whatever the system's locale: Windows would read cp1252),
    with errors that name the problem. A NUL byte is no text: a binary file is named as one
    from its head (before its bytes fail as UTF-8), and a NUL further on (a damaged download)
    too, at its line. A damaged archive is named as one wherever its damage is met."""
    path = shard.path
    try:
        with open_binary(shard) as f:
            head = f.read(BINARY_SNIFF_BYTES)
        if b"\x00" in head:
            raise NanolmError(f"{path} looks like a binary file (it contains NUL bytes); pass a UTF-8 text file")
        with open_binary(shard) as f:
            for lineno, line in enumerate(io.TextIOWrapper(f, encoding="utf-8", newline=""), start=1):
                if "\x00" in line:
                    raise NanolmError(
                        f"{path} looks like a binary file (line {lineno} contains a NUL byte); pass a UTF-8 text file"
                    )
                yield line
    except UnicodeDecodeError as e:
        raise NanolmError(f"{path} is not valid UTF-8 ({e.reason} near byte {e.start}); convert it to UTF-8") from None
    except NanolmError:
        raise
    except Exception as e:
        if shard.compression and is_damage(e):
            raise damaged(shard, e) from None
        raise


def _as_shard(shard) -> Shard:
    return (
        shard
        if isinstance(shard, Shard)
        else Shard(Path(shard), Path(shard).name, *shard_form(Path(shard), alone=True))
    )


def _txt_documents(shard: Shard | Path, separator: str) -> Iterator[str]:
    """Documents of a text shard split on lines that hold exactly ``separator``.

    The line break before a separator line is not part of the document. Over-long documents
    (more than ``MAX_DOC_CHARS``) are cut at the next line end into pieces that become
    documents of their own, so no single document has to fit in memory.
    """
    parts: list[str] = []
    size = 0
    for line in _text_lines(_as_shard(shard)):
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


def _jsonl_documents(shard: Shard | Path, text_field: str, problems: list[str]) -> Iterator[str]:
    shard = _as_shard(shard)
    for lineno, line in enumerate(_text_lines(shard), start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line, "it")
        except NanolmError as e:  # not JSON, or JSON Python cannot hold (too deep, an integer too long)
            problems.append(f"{shard.path}:{lineno}: {str(e).removeprefix('it ').split('; the file')[0]}")
            continue
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            problems.append(f"{shard.path}:{lineno}: no string field {text_field!r}")
            continue
        yield text


def _pyarrow(shard: Shard):
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise NanolmError(f"reading .{shard.form} needs pyarrow: pip install 'nanolm[parquet]'") from None
    return pyarrow


def _table_batches(shard: Shard, text_field: str, check_only: bool = False):
    """The text column of a parquet or arrow shard, a batch at a time, after its schema is checked."""
    pa = _pyarrow(shard)
    try:
        if shard.form == "parquet":
            table = pa.parquet.ParquetFile(shard.path)
            schema, rows = table.schema_arrow, table.metadata.num_rows
        else:
            table = _arrow_reader(pa, shard.path)
            schema, rows = table.schema, None
    except NanolmError:
        raise
    except Exception as e:
        raise NanolmError(f"{shard.path} is not a readable {shard.form} file ({brief(str(e), 160)})") from None
    if text_field not in schema.names:
        raise NanolmError(
            f"{shard.path} has no column {text_field!r} (columns: {', '.join(schema.names)}); set --text-field"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise NanolmError(f"{shard.path}: column {text_field!r} holds {kind}, not text; set --text-field")
    if check_only:
        if rows == 0:
            raise NanolmError(f"{shard.path} holds no rows (an empty shard); remove it from the corpus")
        return iter(())
    if shard.form == "parquet":
        return (b.column(0) for b in table.iter_batches(columns=[text_field], batch_size=1024))
    index = schema.get_field_index(text_field)
    return (b.column(index) for b in _arrow_batches(table))


def _arrow_reader(pa, path: Path):
    """An ``.arrow`` file as ``save_to_disk`` writes it (the IPC stream format), or the IPC file format."""
    try:
        return pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.memory_map(str(path)))


def _arrow_batches(reader):
    if hasattr(reader, "num_record_batches"):
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def _table_documents(shard: Shard, text_field: str) -> Iterator[str]:
    for column in _table_batches(shard, text_field):
        for text in column.to_pylist():
            if isinstance(text, str):
                yield text


class DocumentSource:
    """Iterates the documents of ``--data``'s shards, counting what it skips.

    ``problems`` collects unreadable records (bad JSON lines with their line number);
    ``empty`` counts documents skipped because they hold only whitespace.
    """

    def __init__(self, path, separator: str = SEPARATOR, text_field: str = "text"):
        self.path = Path(path)
        self.separator = separator
        self.text_field = text_field
        self.problems: list[str] = []
        self.empty = 0
        self.shards = find_shards(path)
        for shard in self.shards:
            if shard.path.stat().st_size == 0:
                raise NanolmError(
                    f"{shard.path} is empty"
                    + ("" if len(self.shards) == 1 else f" (a shard of {path}); remove it from the corpus")
                )

    def check(self) -> None:
        """Look at every shard's head before anything is written: its schema (the text column),
        rows, compression and text encoding. Damage further inside is found where it is read."""
        for shard in self.shards:
            if shard.form in ("parquet", "arrow"):
                _table_batches(shard, self.text_field, check_only=True)
                continue
            lines = _text_lines(shard)
            first = next((line for line in lines if line.strip()), None)
            lines.close()
            if first is None and len(self.shards) > 1:
                raise NanolmError(f"{shard.path} holds no text (an empty shard); remove it from the corpus")
            if shard.form == "jsonl" and first is not None:
                try:
                    record = parse_json(first, "its first line")
                except NanolmError:
                    continue  # a bad record, skipped and counted like any other
                if isinstance(record, dict) and not isinstance(record.get(self.text_field), str):
                    raise NanolmError(
                        f"{shard.path}: its records have no string field {self.text_field!r} "
                        f"(fields: {', '.join(map(str, record)) or 'none'}); set --text-field"
                    )

    def identity(self) -> list[dict]:
        """Each shard's name, size and modification time: equal iff (for all practical purposes)
        the same files are read again."""
        return [s.identity() for s in self.shards]

    def size_bytes(self) -> int:
        return sum(s.path.stat().st_size for s in self.shards)

    def expected_text_bytes(self) -> int:
        """About how many UTF-8 bytes of text the shards hold, for the percentage and the ETA."""
        return sum(expected_text_bytes_of(s, self.text_field) for s in self.shards)

    def _raw(self) -> Iterator[str]:
        for shard in self.shards:
            if shard.form == "jsonl":
                yield from _jsonl_documents(shard, self.text_field, self.problems)
            elif shard.form in ("parquet", "arrow"):
                yield from _table_documents(shard, self.text_field)
            else:
                yield from _txt_documents(shard, self.separator)

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
