"""Downloads are real code paths: tested against local files (file:// URLs) and a refused
loopback port, never the network."""

import hashlib

import pytest

import nanolm.data.download as dl
from nanolm.data.download import RemoteCorpus, fetch, resolve_data_path
from nanolm.errors import NanolmError


@pytest.fixture
def upstream(tmp_path, monkeypatch):
    source = tmp_path / "upstream.txt"
    source.write_text("To be, or not to be, that is the question.\n" * 50)
    payload = source.read_bytes()
    entry = RemoteCorpus(
        source.as_uri(), "corpus.txt", len(payload), hashlib.sha256(payload).hexdigest(), "test corpus"
    )
    monkeypatch.setitem(dl.CORPORA, "testcorpus", entry)
    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    return source, entry


def test_download_is_verified_cached_and_reused(upstream, tmp_path):
    source, entry = upstream
    path = fetch("testcorpus", log=lambda *_: None, progress=False)
    assert path == tmp_path / "cache" / "corpus.txt" and path.read_bytes() == source.read_bytes()
    source.unlink()  # the cached copy is used from now on: no second download
    assert fetch("testcorpus", log=lambda *_: None, progress=False) == path


@pytest.mark.parametrize("field, value", [("size", 7), ("sha256", "0" * 64)])
def test_a_download_that_does_not_match_is_not_kept(upstream, tmp_path, monkeypatch, field, value):
    _, entry = upstream
    monkeypatch.setitem(dl.CORPORA, "testcorpus", RemoteCorpus(**{**entry.__dict__, field: value}))
    with pytest.raises(NanolmError, match="does not match"):
        fetch("testcorpus", log=lambda *_: None, progress=False)
    assert not (tmp_path / "cache").exists()  # not even the directory made for it


def test_an_unpinned_checksum_is_recorded_then_enforced(upstream, tmp_path, monkeypatch):
    source, entry = upstream
    monkeypatch.setitem(dl.CORPORA, "testcorpus", RemoteCorpus(**{**entry.__dict__, "sha256": None}))
    path = fetch("testcorpus", log=lambda *_: None, progress=False)
    assert path.with_name("corpus.txt.sha256").read_text().strip() == entry.sha256
    path.write_bytes(path.read_bytes().replace(b"question", b"answer!!"))  # same size, other content
    messages = []
    fetch("testcorpus", log=messages.append, progress=False)  # detected and fetched again
    assert any("does not match" in m for m in messages) and path.read_bytes() == source.read_bytes()


def test_offline_download_fails_with_one_line_naming_the_fix(upstream, monkeypatch):
    _, entry = upstream
    monkeypatch.setitem(dl.CORPORA, "testcorpus", RemoteCorpus(**{**entry.__dict__, "url": "http://127.0.0.1:9/x.txt"}))
    with pytest.raises(NanolmError, match="could not download testcorpus .*--data PATH") as e:
        fetch("testcorpus", log=lambda *_: None, progress=False)
    assert "\n" not in str(e.value)


def test_data_names_resolve_to_local_paths_first(upstream, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert str(resolve_data_path("some/file.txt")) == "some/file.txt"
    (tmp_path / "testcorpus").write_text("a local file wins over the corpus name")
    assert str(resolve_data_path("testcorpus")) == "testcorpus"
    (tmp_path / "testcorpus").unlink()
    assert resolve_data_path("testcorpus", log=lambda *_: None) == tmp_path / "cache" / "corpus.txt"


def test_shipped_checksum_matches_the_shared_tiny_shakespeare_if_present():
    from pathlib import Path

    local = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
    if not local.is_file():
        pytest.skip("no local copy of tiny-shakespeare")
    entry = dl.CORPORA["shakespeare"]
    assert local.stat().st_size == entry.size
    assert hashlib.sha256(local.read_bytes()).hexdigest() == entry.sha256
