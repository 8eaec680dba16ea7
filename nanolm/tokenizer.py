"""Tokenizers: one id per character, or byte-level BPE trained on your text.

Both are stored as a Hugging Face ``tokenizers`` JSON file (``tokenizer.json``), so a
run directory is self-describing and an exported model loads with ``transformers``.

* **char**: the vocabulary is the set of characters of the training text plus EOS.
  Small and transparent (a loss in nats/char is directly comparable to the classic
  tiny-shakespeare numbers), but text with a character it never saw cannot be encoded.
* **bpe**: byte-level BPE. The base alphabet is the 256 byte values, so *any* UTF-8
  text round-trips exactly; merges learned on the training text then shorten common
  byte sequences into single tokens. Needs ``vocab_size >= 257`` (256 bytes + EOS).

The end-of-text token ``<|endoftext|>`` (id 0 in both) separates documents. The same
string inside a document's text is encoded as ordinary text, never as EOS, so a
document cannot forge a boundary.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .errors import NanolmError, brief

EOS = "<|endoftext|>"
MIN_BPE_VOCAB = 257
MAX_BPE_VOCAB = 1 << 24
"""The largest BPE vocabulary asked for: 64 times the largest in use (262,144 entries). The
tokenizer library reserves memory for every entry asked for before it learns one, and a request
far past what memory holds aborts the whole process, not with an error a caller can catch."""
KINDS = ("bpe", "char")
PIECE_CHARS = 1 << 16  # a longer text is encoded in pieces of about this size, in parallel
# a newline with a printable ASCII character on each side: byte-level BPE cannot join tokens across it
SAFE_CUT = re.compile(r"(?<=[!-~]\n)(?=[!-~])")


def safe_pieces(text: str, size: int | None = None) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters that encode, one after the other,
    to exactly the tokens of the whole.

    Why it is exact: byte-level BPE first splits text with GPT-2's pattern, and merges never
    cross those splits. The pattern puts whitespace in pieces of its own, so a newline between
    two visible characters is always a piece by itself, and cutting just after it changes no
    piece. (A run of newlines or spaces could be split differently, so the cut is never there.)
    Why cut at all: ``encode_batch`` encodes its texts in parallel, but one long text, a
    single-document corpus like tiny-shakespeare, on one core.
    """
    size = size or PIECE_CHARS
    if len(text) < 2 * size:
        return [text]
    cuts, start = [0], size
    while (found := SAFE_CUT.search(text, start)) is not None and found.start() < len(text) - size:
        cuts.append(found.start())
        start = found.start() + size
    cuts.append(len(text))
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


class Tokenizer:
    """A trained tokenizer: ``encode``/``decode`` plus what training and evaluation need."""

    def __init__(self, hf):
        self.hf = hf
        self.hf.encode_special_tokens = True
        spec = json.loads(hf.to_str())
        model = spec["model"]
        self.kind = "char" if model["type"] == "BPE" and not model["merges"] else "bpe"
        pre = spec.get("pre_tokenizer") or {}
        # safe_pieces is exact for the pipeline nanolm trains; a tokenizer.json from elsewhere
        # (a normalizer, a post-processor, another pre-tokenizer) is encoded whole
        self._cuttable = (
            pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True)
            and not pre.get("add_prefix_space")
            and spec.get("normalizer") is None
            and spec.get("post_processor") is None
        )
        self.eos_id = hf.token_to_id(EOS)
        if self.eos_id is None:
            raise NanolmError(f"tokenizer has no {EOS} token; retrain it with nanolm")
        vocab = hf.get_vocab()
        self.vocab_size = hf.get_vocab_size()
        if self.kind == "char":
            chars = [(i, t) for t, i in vocab.items() if i != self.eos_id]
            self._char_of_id = {i: t for i, t in chars}
            codepoints = np.array([ord(t) for _, t in chars], dtype=np.int64)
            ids = np.array([i for i, _ in chars], dtype=np.int64)
            order = np.argsort(codepoints)
            self._codepoints, self._ids = codepoints[order], ids[order]

    # -- encoding -----------------------------------------------------------------
    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no EOS added), as an int64 array."""
        if self.kind == "char":
            return self._encode_chars(text)
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Encode many texts; BPE runs them in parallel on all cores (Rust threads, their number
        ``RAYON_NUM_THREADS`` when set before the first batch), a long text in pieces (:func:`safe_pieces`) so that it, too, uses every core."""
        if self.kind == "char":
            return [self._encode_chars(t) for t in texts]
        pieces = [safe_pieces(t) if self._cuttable else [t] for t in texts]
        # the fast form skips the character offsets, which nothing here reads (tokenizers >= 0.20.3)
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        encoded = iter(encode([p for ps in pieces for p in ps]))
        ids = [[np.asarray(next(encoded).ids, dtype=np.int64) for _ in ps] for ps in pieces]
        return [parts[0] if len(parts) == 1 else np.concatenate(parts) for parts in ids]

    def _encode_chars(self, text: str) -> np.ndarray:
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        where = np.searchsorted(self._codepoints, codepoints)
        where = np.minimum(where, len(self._codepoints) - 1)
        unknown = self._codepoints[where] != codepoints
        if unknown.any():
            missing = sorted({chr(c) for c in codepoints[unknown]})
            shown = ", ".join(repr(c) for c in missing[:10]) + (" ..." if len(missing) > 10 else "")
            raise NanolmError(
                f"the char tokenizer has never seen {len(missing)} character(s) in this text: "
                f"{shown}; use --tokenizer bpe (any text) or train on text that contains them"
            )
        return self._ids[where]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "char":
            return "".join(EOS if i == self.eos_id else self._char_of_id.get(i, "\ufffd") for i in ids)
        return self.hf.decode(ids, skip_special_tokens=False)

    # -- facts ----------------------------------------------------------------------
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each token id stands for (0 for EOS).

        Turns a loss in nats per token into bits per byte, a number that does not depend
        on the tokenizer: bpb = Σ nats / (ln 2 · Σ bytes of the predicted tokens).
        """
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in self.hf.get_vocab().items():
            if i == self.eos_id:
                continue
            # byte-level BPE spells each byte as one printable character
            out[i] = len(token.encode("utf-8")) if self.kind == "char" else len(token)
        return out

    def fingerprint(self) -> str:
        """A short hash of the vocabulary and merges: equal iff the encodings are equal."""
        return hashlib.sha256(self.hf.to_str().encode()).hexdigest()[:16]

    def save(self, path) -> None:
        """Write ``tokenizer.json`` atomically (a crash leaves the old file or the new one)."""
        from .base.files import atomic_write_text

        atomic_write_text(path, self.hf.to_str(pretty=True))

    @classmethod
    def load(cls, path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise NanolmError(f"no tokenizer at {path}")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # the Rust parser's errors are not user-friendly types
            raise NanolmError(f"{path} is not a valid tokenizer.json ({brief(e)})") from None


def train_char(texts: Iterable[str]) -> Tokenizer:
    """A character vocabulary: every distinct character of ``texts``, in code-point order."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    chars: set[str] = set()
    for t in texts:
        chars.update(t)
    chars.discard("")
    vocab = {EOS: 0}
    for c in sorted(chars):
        vocab[c] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.add_special_tokens([EOS])
    hf.decoder = decoders.Fuse()
    return Tokenizer(hf)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with ``vocab_size`` entries (EOS included), learned from ``texts``.

    If the text is too small to learn that many merges, the vocabulary comes out smaller;
    the caller reads the real size from ``Tokenizer.vocab_size``.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise NanolmError(
            f"--vocab-size {vocab_size} is too small for byte-level BPE: it needs at least "
            f"{MIN_BPE_VOCAB} (256 byte values + EOS); use --tokenizer char for a tiny vocabulary"
        )
    if vocab_size > MAX_BPE_VOCAB:
        raise NanolmError(
            f"--vocab-size {vocab_size} is larger than nanolm trains (at most {MAX_BPE_VOCAB:,}, 64 times "
            f"the largest vocabularies in use)"
        )
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    return Tokenizer(hf)


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int) -> Tokenizer:
    if kind == "char":
        return train_char(texts)
    if kind == "bpe":
        return train_bpe(texts, vocab_size)
    raise NanolmError(f"unknown tokenizer {kind!r}; choose one of {', '.join(KINDS)}")
