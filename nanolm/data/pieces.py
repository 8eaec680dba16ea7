"""An unfinished prepare, kept so that the same command continues it: the record of its pieces.

Encoding a corpus of gigabytes takes minutes to hours, and a run can be killed, hit a full disk
or meet Ctrl-C on the way. ``prepare`` works in a scratch directory beside ``--out``
(``.OUT.prepare-XXXXXXXX``) and encodes its documents a *piece* at a time (about 8 MB of text).
After each piece the shards' new bytes are synced and then ``progress.json`` is replaced
(atomically) to say how far the work got: how many documents were read, and how many tokens,
bytes, documents and document starts each split holds. The files may hold more than that (a
piece written but not yet recorded): the next attempt cuts them back to the record, so a kill at
any moment costs at most one piece of work.

The next ``prepare`` into the same ``--out`` looks for such a directory that no live process
holds, and continues it only if the record matches what it is asked to do now: the same settings,
the same nanolm code writing the data, and every shard of the source with the same size and
modification time. Anything else (an edited shard, another ``--vocab-size``) is said in one line
and the work starts over: two sources, or two settings, are never mixed in one result. The
result is byte for byte what an uninterrupted prepare writes (tests/test_prepare_resume.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..base import disk
from ..base.documents import read_json
from ..base.files import atomic_write_text, remove_abandoned_writes
from ..base.lock import abandoned_scratch
from ..errors import NanolmError

PROGRESS_FILE = "progress.json"
PIECE_CHARS = 8_000_000  # characters of text a piece holds (about 8 MB of English)
_WRITERS = ("prepare.py", "pieces.py", "shards.py", "sources.py", "published.py", "corpus.py", "../tokenizer.py")


def writer_code_digest() -> str:
    """A hash of the code that decides what a prepared directory holds: a nanolm that prepares
    differently continues nothing an older one began."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _WRITERS:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


@dataclass
class SplitProgress:
    """How much of one split is on disk and counted."""

    tokens: int = 0
    bytes: int = 0
    documents: int = 0
    max_id: int = -1


@dataclass
class Progress:
    """What ``progress.json`` records: the request (settings, source, code) and how far it got."""

    settings: dict
    source: list[dict]
    code: str
    tokenizer_fingerprint: str
    dtype: str
    documents_read: int = 0
    splits: dict[str, SplitProgress] = field(default_factory=lambda: {"train": SplitProgress(), "val": SplitProgress()})

    def save(self, directory: Path) -> None:
        atomic_write_text(directory / PROGRESS_FILE, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, directory: Path) -> Progress | None:
        """The record in ``directory``, or None if there is none or it is not whole (a directory
        killed before its first record, or damaged: its work is started over)."""
        path = directory / PROGRESS_FILE
        if not path.is_file():
            return None
        try:
            raw = read_json(path)
            splits = {name: SplitProgress(**raw["splits"][name]) for name in ("train", "val")}
            progress = cls(
                settings=raw["settings"],
                source=raw["source"],
                code=raw["code"],
                tokenizer_fingerprint=raw["tokenizer_fingerprint"],
                dtype=raw["dtype"],
                documents_read=raw["documents_read"],
                splits=splits,
            )
        except (NanolmError, KeyError, TypeError):
            return None
        shapes = (
            isinstance(progress.settings, dict)
            and isinstance(progress.code, str)
            and isinstance(progress.tokenizer_fingerprint, str)
            and isinstance(progress.source, list)
            and all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in progress.source)
        )
        if not shapes:  # damaged, or written by hand: its work is started over
            return None
        counts = [progress.documents_read] + [c for s in splits.values() for c in (s.tokens, s.bytes, s.documents)]
        largest = [s.max_id for s in splits.values()]
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) or not all(
            isinstance(m, int) and not isinstance(m, bool) and m >= -1 for m in largest
        ):
            return None
        if progress.dtype not in ("uint16", "uint32") or not _files_hold_the_record(directory, progress):
            return None
        return progress


def _files_hold_the_record(directory: Path, progress: Progress) -> bool:
    """The tokenizer is the record's, and the shards and start files are at least as long as the
    record says (they were synced before it was written; anything else is not this attempt's
    work, and it starts over)."""
    from ..tokenizer import Tokenizer

    itemsize = 2 if progress.dtype == "uint16" else 4
    try:  # a finished attempt swapped with the old --out holds the old data: not this record's
        if Tokenizer.load(directory / "data" / "tokenizer.json").fingerprint() != progress.tokenizer_fingerprint:
            return False
        for name, split in progress.splits.items():
            if (directory / "data" / f"{name}.bin").stat().st_size < split.tokens * itemsize:
                return False
            if (directory / f"{name}_docs.raw").stat().st_size < split.documents * 8:
                return False
    except (OSError, NanolmError):
        return False
    return True


def why_not_the_same(progress: Progress, settings: dict, source: list[dict], code: str) -> str | None:
    """None if ``progress`` records this very request, else what differs, in a few words."""
    if progress.code != code:
        return "nanolm's data code changed since"
    if progress.settings != settings:
        changed = sorted(
            k for k in settings.keys() | progress.settings.keys() if settings.get(k) != progress.settings.get(k)
        )
        return f"it was asked with another {', '.join(changed)}"
    then = {s["name"]: s for s in progress.source}
    now = {s["name"]: s for s in source}
    for name in sorted(then.keys() | now.keys()):
        if name not in now:
            return f"its shard {name} is gone"
        if name not in then:
            return f"{name} was added to the source"
        if then[name] != now[name]:
            return f"{name} changed (its size or modification time)"
    if [s["name"] for s in progress.source] != [s["name"] for s in source]:
        return "its shards are in another order"
    return None


def unfinished_attempt(out: Path, settings: dict, source: list[dict], code: str, log=print) -> Path | None:
    """An abandoned scratch directory of a prepare into ``out`` that this request continues;
    the others (a different request, or killed before their first record) are deleted."""
    found = None
    for attempt in abandoned_scratch(out, "prepare"):
        progress = Progress.load(attempt)
        reason = None if progress is None else why_not_the_same(progress, settings, source, code)
        if progress is not None and reason is None and found is None:
            found = attempt
            continue
        if progress is not None and reason is not None:
            log(f"prepare: not continuing the interrupted prepare into {out}: {reason}; starting over")
        disk.remove_tree(attempt, ignore_errors=True)
    if found is not None:  # the temporary files of writes a kill cut short
        remove_abandoned_writes(found, [PROGRESS_FILE])
        remove_abandoned_writes(found / "data", ["meta.json", "tokenizer.json"])
    return found
