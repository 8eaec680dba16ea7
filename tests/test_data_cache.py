"""The cache of prepared data: the same text with the same settings is tokenized once, and what a
later run copies in is exactly what it would have prepared (``nanolm/data/cache.py``)."""

from __future__ import annotations

import shutil

import pytest
from conftest import run_main, tiny_run_config

from nanolm.data.prepare import load_training_data


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv("NANOLM_NO_DATA_CACHE", raising=False)
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "prepared"


def _prepared(data, scratch, **data_options):
    cfg = tiny_run_config(data, scratch / "run")
    cfg.data.tokenizer, cfg.data.vocab_size = "bpe", 300
    for k, v in data_options.items():
        setattr(cfg.data, k, v)
    said = []
    prepared = load_training_data(cfg.resolved(), scratch, log=said.append, compressor_bounds=False)
    return prepared, " ".join(said)


def test_the_same_text_and_settings_are_prepared_once_and_reused_to_the_byte(tmp_path, stories_file, cache):
    first, said = _prepared(stories_file, tmp_path / "a")
    assert "reused" not in said and len(list(cache.iterdir())) == 1
    moved = tmp_path / "elsewhere.txt"
    shutil.copy(stories_file, moved)  # the same text under another name is the same text
    again, said = _prepared(moved, tmp_path / "b")
    assert "prepared before with the same text and settings; reused from" in said
    assert again.digest == first.digest and again.meta["source"] == str(moved)
    assert (
        again.train.tokens == first.train.tokens
    ).all() and again.tokenizer.fingerprint() == first.tokenizer.fingerprint()


def test_another_setting_or_an_edited_text_is_prepared_anew(tmp_path, stories_file, cache):
    first, _ = _prepared(stories_file, tmp_path / "a")
    other, said = _prepared(stories_file, tmp_path / "b", vocab_size=320)
    assert "reused" not in said and other.tokenizer.vocab_size == 320
    edited = tmp_path / "edited.txt"
    edited.write_bytes(stories_file.read_bytes() + b"\nOne more story.\n")
    changed, said = _prepared(edited, tmp_path / "c")
    assert "reused" not in said and changed.digest != first.digest
    assert len(list(cache.iterdir())) == 3


def test_a_damaged_kept_copy_is_dropped_and_the_text_prepared_again(tmp_path, stories_file, cache):
    first, _ = _prepared(stories_file, tmp_path / "a")
    kept = next(cache.iterdir())
    damaged = bytearray((kept / "train.bin").read_bytes())
    damaged[10] ^= 1  # one token changed: it would train, silently, on other data
    (kept / "train.bin").write_bytes(bytes(damaged))
    again, said = _prepared(stories_file, tmp_path / "b")
    assert "does not check out" in said and "preparing it again" in said
    assert again.digest == first.digest
    assert [p.name for p in cache.iterdir()] == [kept.name], "prepared again, and kept again"


def test_a_cache_that_cannot_be_written_never_fails_a_run(tmp_path, stories_file, monkeypatch):
    monkeypatch.delenv("NANOLM_NO_DATA_CACHE", raising=False)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("NANOLM_CACHE", str(blocked))
    r = run_main(
        "train", "--data", stories_file, "--tokenizer", "char", "--steps", "2", "--n-layer", "1", "--n-embd", "32",
        "--n-head", "2", "--seq-len", "32", "--batch-size", "2", "--eval-windows", "4", "--sample-tokens", "0",
        "--threads", "1", "--out-dir", tmp_path / "run",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "warning: the prepared data could not be kept in" in r.stdout
