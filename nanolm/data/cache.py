"""Prepared data kept between runs: the same text with the same settings is tokenized once.

A run given raw text (``--data FILE``) prepares it in its run directory: it trains a tokenizer
and encodes every document (docs/data.md says what that costs). A second run on the same text with the same settings, in another directory (the
next seed, the next config of a sweep), would do all of it again. So what a run prepares is also
kept in the cache, ``$NANOLM_CACHE/prepared/<key>`` (default ``~/.cache/nanolm``), and a later
run copies it in instead, checks every file against the manifest as it does any prepared data,
and says so in its ``data:`` line.

The key is the text's own SHA-256 (not its path or date: a copy elsewhere is the same text, an
edited file under the old name is not), the settings that shape the result (tokenizer, vocabulary,
validation share, separator, text field, the window the statistics count), and the code that
writes it (a nanolm that prepares differently keys differently). A kept copy that does not check
out is dropped and the text prepared again. Sources over 256 MB are not kept: hashing them takes
seconds and the copy doubles their disk (``nanolm prepare`` once and ``--data DIR`` serve those).
The cache never fails a run: one that cannot be written is skipped with a warning.
``NANOLM_NO_DATA_CACHE=1`` turns it off (the test suite does, outside the cache's own tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from ..base.documents import read_json
from ..base.files import SEAL, atomic_write_text, cache_dir, check_seal, sealed
from ..errors import NanolmError, brief
from .pieces import writer_code_digest
from .published import find_shards
from .shards import META_FILE, PreparedData

CACHEABLE_BYTES = 256 * 2**20
OFF = "NANOLM_NO_DATA_CACHE"


def _source_files(source) -> list[tuple[str, Path]] | None:
    """Every shard the source is made of (its name and path), in reading order; None if it is too
    large to keep or names nothing readable (prepare says why, in its own words)."""
    try:
        shards = find_shards(source)
    except NanolmError:
        return None
    if sum(s.path.stat().st_size for s in shards) > CACHEABLE_BYTES:
        return None
    return [(s.name, s.path) for s in shards]


def prepared_key(source, settings: dict) -> str | None:
    """The cache key of ``source`` prepared with ``settings``, or None when it is not to be kept."""
    if os.environ.get(OFF):
        return None
    source = Path(source)
    try:
        files = _source_files(source)
        if files is None:
            return None
        h = hashlib.sha256(writer_code_digest().encode())
        h.update(json.dumps(settings, sort_keys=True).encode())
        for name, path in files:
            h.update((name if len(files) > 1 or source.is_dir() else "").encode() + b"\0")
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        return h.hexdigest()[:32]
    except OSError:
        return None  # unreadable here: prepare says why, in its own words


def reuse_prepared(key: str, out: Path, source, log=print) -> PreparedData | None:
    """The kept preparation ``key`` copied to ``out`` and checked, or None (nothing kept, or a kept
    copy that does not check out, which is dropped)."""
    kept = cache_dir() / "prepared" / key
    if not (kept / META_FILE).is_file():
        return None
    try:
        shutil.copytree(kept, out)
        meta = read_json(out / META_FILE)
        check_seal(meta, str(kept / META_FILE))  # before it is sealed again with this run's source
        meta["source"] = str(source)  # where this run's text is (meta.json is outside the manifest)
        atomic_write_text(out / META_FILE, json.dumps(sealed({k: v for k, v in meta.items() if k != SEAL}), indent=2))
        data = PreparedData(out)  # every file against its checksum
    except (OSError, NanolmError, TypeError) as e:
        log(f"warning: the prepared data kept in {kept} does not check out ({brief(e)}); preparing it again")
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(kept, ignore_errors=True)
        return None
    log(f"data: prepared before with the same text and settings; reused from {kept}")
    return data


def keep_prepared(key: str, prepared: Path, log=print) -> None:
    """Keep a copy of the directory this run prepared, for the next run on the same text."""
    root = cache_dir() / "prepared"
    staging = root / f".{key}.{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.copytree(prepared, staging)
        os.rename(staging, root / key)  # whole or not at all; another run may have kept it first
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if not (root / key / META_FILE).is_file():
            log(f"warning: the prepared data could not be kept in {root} ({brief(e)}); the next run prepares it again")
