"""The documents nanolm reads (JSON, JSON lines, TOML), parsed under guard: one line, never a traceback.

A file nanolm did not just write itself may be damaged or crafted: a run directory copied from
elsewhere, a config from a forum, a log cut short by a full disk. Valid JSON and TOML can still
be pathological. Python's parsers raise ``ValueError`` on an integer of more than 4,300 digits
and ``RecursionError`` on nesting deeper than their recursion limit, not the decode error a
reader expects; TOML accepts a hexadecimal integer of any length, which Python then cannot even
print. Every such document is refused here, in one :class:`NanolmError` naming the file, before
any reader looks at a field: nanolm itself writes 64-bit integers, a few levels of nesting and
metadata files of kilobytes. What a field then holds is each reader's to check (its type, its
range); ``tests/test_hostile_files.py`` generates hostile documents for every one of them.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

from ..errors import NanolmError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MAX_METADATA_BYTES = 16 << 20
"""The largest metadata file (meta.json, final.json, config.toml) read: nanolm writes a few
kilobytes, so anything near this size is damage, refused before it is read into memory."""
MAX_NESTING = 64
"""The deepest nesting of lists and objects accepted in a file nanolm reads (it writes at most a
few levels): deeper is damage, and Python's parsers would hit their recursion limit on it."""
LARGEST_INTEGER = 2**63
"""Integers are 64-bit in every file nanolm writes (and in TOML's own rules): a longer one is
damage, and Python refuses even to print one of more than 4,300 digits."""


def _shape_problem(value) -> str | None:
    """What makes a parsed document pathological (too deep, an integer too long), or None.
    Walked with an explicit stack: a document deep enough to matter would overflow a recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, int) and not -LARGEST_INTEGER <= item < LARGEST_INTEGER:  # (a bool is a small int)
            return f"an integer of {item.bit_length() + 1} bits (nanolm writes 64-bit integers)"  # with its sign
        if isinstance(item, (dict, list)):
            if depth > MAX_NESTING:
                return f"values nested more than {MAX_NESTING} levels deep"
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return None


def parse_json(raw: bytes | str, what: str):
    """The value of a JSON document, or one :class:`NanolmError` naming ``what`` and what is wrong.

    Valid JSON can still be pathological: an integer too long for Python to convert, nesting
    deeper than its recursion limit. Python's parser raises ``ValueError`` or ``RecursionError``
    on those, not the ``JSONDecodeError`` a reader expects, and a crafted or damaged file became
    a traceback; here every such document is refused in one line."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise NanolmError(f"{what} is not UTF-8 text (byte {e.start}); the file is damaged") from None
    return _parsed(json.loads, json.JSONDecodeError, "JSON", text, what, "; the file is damaged")


def _parsed(loads, syntax_error, language: str, text: str, what: str, damaged: str):
    """``loads(text)``, every way it can fail one line (``damaged`` ends each), then its shape checked."""
    try:
        value = loads(text)
    except syntax_error as e:
        raise NanolmError(f"{what} is not valid {language} ({e}){damaged}") from None
    except RecursionError:
        raise NanolmError(f"{what} nests its values deeper than Python can parse{damaged}") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise NanolmError(f"{what} holds a value Python cannot read ({str(e).split(';')[0]}){damaged}") from None
    problem = _shape_problem(value)
    if problem is not None:
        raise NanolmError(f"{what} holds {problem}{damaged}")
    return value


def _read_small_file(path, what: str, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``, or one line saying why not."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError as e:
        raise NanolmError(f"{what} cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a pipe or a device"
        raise NanolmError(f"{what} is {kind}, not a file")
    if info.st_size > max_bytes:
        raise NanolmError(
            f"{what} is {info.st_size / 2**20:.0f} MiB, far larger than any such file nanolm writes; "
            f"the file is damaged"
        )
    try:
        return path.read_bytes()
    except OSError as e:
        raise NanolmError(f"{what} cannot be read ({e.strerror or e})") from None


def read_json(path, what: str | None = None, max_bytes: int = MAX_METADATA_BYTES):
    """A JSON file's value, or a :class:`NanolmError` naming ``what`` (default: the path)."""
    what = what or str(path)
    return parse_json(_read_small_file(path, what, max_bytes), what)


def parse_toml(text: str, what: str) -> dict:
    """A TOML document's tables, or one :class:`NanolmError` naming ``what``: the same
    pathologies as :func:`parse_json` (Python's TOML parser raises ``ValueError`` or
    ``RecursionError`` on them), and a hexadecimal integer of any length, which it accepts."""
    return _parsed(tomllib.loads, tomllib.TOMLDecodeError, "TOML", text, what, "")


def read_toml(path, what: str | None = None) -> dict:
    """A TOML file's tables (UTF-8, a regular file of sane size), or one line saying what is wrong."""
    what = what or str(path)
    raw = _read_small_file(path, what, MAX_METADATA_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NanolmError(f"{what} is not valid TOML: it is not UTF-8 text (byte {e.start})") from None
    return parse_toml(text, what)


def read_jsonl(path) -> tuple[list, int]:
    """(the parsed lines of a JSON-lines file, how many lines were damaged).

    A half-written last line (a crash, a live run) is not counted as damage. Lines are
    read as bytes, so a byte that is not UTF-8 damages one line, not the file; so does a line
    that :func:`parse_json` refuses (too deep, an integer too long).
    """
    with open(path, "rb") as f:
        lines = [line for line in f if line.strip()]
    rows, damaged = [], 0
    for i, line in enumerate(lines):
        try:
            rows.append(parse_json(line, "a line"))
        except NanolmError:
            if i < len(lines) - 1 or line.endswith(b"\n"):
                damaged += 1
    return rows, damaged
