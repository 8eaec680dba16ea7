import random

import numpy as np
import pytest

from nanolm.errors import NanolmError
from nanolm.tokenizer import EOS, Tokenizer, train_bpe, train_char

TRAINING_TEXT = (
    "The cat sat on the mat. The dog sat on the log. " * 40
) + "Caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f600\n"


def random_unicode(rng: random.Random, n: int) -> str:
    ranges = [
        (0x20, 0x7E),
        (0x0, 0x1F),
        (0xA0, 0x24F),
        (0x0300, 0x036F),
        (0x0400, 0x04FF),
        (0x4E00, 0x9FFF),
        (0x1F300, 0x1FAFF),
        (0x10000, 0x10FFF),
    ]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


@pytest.fixture(scope="module")
def bpe():
    return train_bpe([TRAINING_TEXT], vocab_size=300)


def test_bpe_round_trips_arbitrary_unicode(bpe):
    rng = random.Random(0)
    for _ in range(50):
        text = random_unicode(rng, rng.randint(0, 200))
        assert bpe.decode(bpe.encode(text)) == text
    assert bpe.decode(bpe.encode("")) == ""
    assert bpe.vocab_size == 300 and bpe.eos_id == 0


def test_end_of_text_inside_a_document_is_plain_text_not_eos(bpe):
    ids = bpe.encode(f"before {EOS} after")
    assert bpe.eos_id not in ids.tolist()
    assert bpe.decode(ids) == f"before {EOS} after"
    char = train_char([f"abc {EOS}"])
    assert char.eos_id not in char.encode(f"a{EOS}").tolist()


def test_char_tokenizer_round_trips_and_names_unknown_characters():
    tok = train_char(["hello world\n", "\u00e9\U0001f600"])
    assert tok.vocab_size == len(set("hello world\n\u00e9\U0001f600")) + 1
    text = "world hello \U0001f600\u00e9\n"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    with pytest.raises(NanolmError, match="'z'"):
        tok.encode("zebra")


def test_token_bytes_add_up_to_the_utf8_length(bpe):
    rng = random.Random(1)
    text = TRAINING_TEXT[:300] + random_unicode(rng, 100)
    table = bpe.token_bytes()
    assert table[bpe.eos_id] == 0
    assert table[bpe.encode(text)].sum() == len(text.encode("utf-8"))
    char = train_char([text])
    assert char.token_bytes()[char.encode(text)].sum() == len(text.encode("utf-8"))


def test_bpe_refuses_a_vocabulary_smaller_than_the_byte_alphabet():
    with pytest.raises(NanolmError, match="at least 257"):
        train_bpe(["abc"], vocab_size=200)


def test_saved_tokenizer_reloads_identically(tmp_path, bpe):
    for tok in (bpe, train_char([TRAINING_TEXT])):
        tok.save(tmp_path / "tokenizer.json")
        again = Tokenizer.load(tmp_path / "tokenizer.json")
        assert again.kind == tok.kind and again.fingerprint() == tok.fingerprint()
        np.testing.assert_array_equal(again.encode(TRAINING_TEXT), tok.encode(TRAINING_TEXT))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(NanolmError, match="not a valid tokenizer"):
        Tokenizer.load(tmp_path / "bad.json")


def test_a_long_text_encodes_in_pieces_to_exactly_the_tokens_of_the_whole(monkeypatch):
    """A single long document is cut at newlines between visible characters and its pieces
    encoded in parallel: the ids must be those of encoding the whole text at once, wherever
    runs of newlines, spaces before newlines, tabs and non-ASCII text fall."""
    import nanolm.tokenizer as tok

    rng = random.Random(0)
    words = ["the", "King", "’s", "crown", "¡olé!", "日本語", "'s", "--", "x1", "\t", "ROMEO:", "\u00a0"]
    lines = []
    for _ in range(3000):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
        lines.append(line + rng.choice(["", "", " ", "  ", "\t"]))
    text = "".join(line + rng.choice(["\n", "\n", "\n", "\n\n", "\n \n", "\r\n"]) for line in lines)
    tokenizer = train_bpe([text], 600)
    monkeypatch.setattr(tok, "PIECE_CHARS", 500)
    pieces = tok.safe_pieces(text, 500)
    assert len(pieces) > 50 and "".join(pieces) == text
    whole = np.asarray(tokenizer.hf.encode(text).ids)
    assert np.array_equal(tokenizer.encode_batch([text, "short"])[0], whole)
    assert np.array_equal(np.concatenate([tokenizer.encode_batch([p])[0] for p in pieces]), whole)
    # a tokenizer.json from elsewhere, with a normalizer (here one that strips each text), is never cut
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import normalizers

    foreign = HFTokenizer.from_str(tokenizer.hf.to_str())
    foreign.normalizer = normalizers.Strip()
    assert np.array_equal(Tokenizer(foreign).encode_batch([text])[0], np.asarray(foreign.encode(text).ids))
