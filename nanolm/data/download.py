"""Public corpora, fetched from their canonical locations, verified, and cached.

``nanolm data download shakespeare`` (or ``--data shakespeare`` when no such local path
exists) downloads once into the cache (``$NANOLM_CACHE``, default ``~/.cache/nanolm``),
checks the size and the SHA-256, and reuses the file afterwards. A file that does not
match is never kept: a truncated download or a changed upstream file would otherwise
silently change every figure measured on it.

Where no published checksum was available to pin (the TinyStories files), the size is
checked and the SHA-256 measured at the first download is recorded beside the file and
checked on every later use ("trust on first use"); it is printed so it can be compared.
"""

from __future__ import annotations

import contextlib
import hashlib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..base import disk
from ..base.files import atomic_write_text, cache_dir, naming_the_file, parents_made, replace, sha256_file
from ..errors import NanolmError


@dataclass(frozen=True)
class RemoteCorpus:
    url: str
    filename: str
    size: int
    sha256: str | None
    about: str


CORPORA = {
    "shakespeare": RemoteCorpus(
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        "tinyshakespeare.txt",
        1_115_394,
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        "tiny-shakespeare: 1.1 MB of Shakespeare's plays, one document (the classic char-level benchmark)",
    ),
    "tinystories": RemoteCorpus(
        "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-valid.txt",
        "TinyStoriesV2-GPT4-valid.txt",
        22_502_601,
        None,
        "TinyStories (GPT-4 stories, the 22 MB validation file: plenty for CPU-sized runs)",
    ),
    "tinystories-train": RemoteCorpus(
        "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-train.txt",
        "TinyStoriesV2-GPT4-train.txt",
        2_227_753_162,
        None,
        "TinyStories (GPT-4 stories, the 2.2 GB training file)",
    ),
}


def fetch(name: str, directory: Path | None = None, log=print, progress: bool = True) -> Path:
    """Path of the verified local copy of corpus ``name``, downloading it if needed."""
    if name not in CORPORA:
        raise NanolmError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    corpus = CORPORA[name]
    directory = Path(directory) if directory else cache_dir()
    path = directory / corpus.filename
    recorded = path.with_name(path.name + ".sha256")
    if path.is_file():
        expected = corpus.sha256 or (recorded.read_text().strip() if recorded.is_file() else None)
        if path.stat().st_size == corpus.size and expected and sha256_file(path) == expected:
            return path
        log(f"cached {path} does not match the expected size/checksum; downloading it again")
        disk.remove(path)
    with parents_made(path):  # a download that fails leaves no directory made for it
        return _download(name, corpus, path, log, progress)


def _download(name: str, corpus: RemoteCorpus, path: Path, log, progress: bool) -> Path:
    """:func:`fetch`'s download into ``path``, verified before it takes that name."""
    recorded = path.with_name(path.name + ".sha256")
    partial = path.with_name(path.name + ".partial")
    log(f"downloading {name} from {corpus.url}")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(corpus.url, timeout=30) as response, disk.create(partial, "wb") as out:
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=corpus.size, unit="B", unit_scale=True, desc=name, leave=False)
            for block in iter(lambda: response.read(1 << 20), b""):
                with naming_the_file(partial):  # a write's error is this disk's, not the network's
                    disk.write(out, block, partial)
                digest.update(block)
                if bar is not None:
                    bar.update(len(block))
            if bar is not None:
                bar.close()
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        with contextlib.suppress(OSError):
            disk.remove(partial, missing_ok=True)
        if isinstance(e, OSError) and e.filename == str(partial):  # a full or read-only disk: said as such
            raise
        reason = getattr(e, "reason", e)
        raise NanolmError(
            f"could not download {name} ({reason}); if this machine is offline, fetch {corpus.url} "
            f"elsewhere and pass the file with --data PATH"
        ) from None
    size, sha = partial.stat().st_size, digest.hexdigest()
    if size != corpus.size or (corpus.sha256 and sha != corpus.sha256):
        disk.remove(partial)
        raise NanolmError(
            f"the download of {name} does not match: {size} bytes, sha256 {sha[:16]}…; expected "
            f"{corpus.size} bytes"
            + (f", sha256 {corpus.sha256[:16]}…" if corpus.sha256 else "")
            + "; nothing was kept. Try again, or download it yourself and pass --data PATH"
        )
    replace(partial, path)
    if corpus.sha256 is None:
        atomic_write_text(recorded, sha + "\n")
        log(f"no published checksum to compare with; recorded sha256 {sha} for later checks")
    log(f"saved {path} ({size} bytes, verified)")
    return path


def resolve_data_path(data: str, log=print) -> Path:
    """A local path as given, or, when no such path exists, a known corpus name fetched."""
    path = Path(data)
    if path.exists() or data not in CORPORA:
        return path
    return fetch(data, log=log)
