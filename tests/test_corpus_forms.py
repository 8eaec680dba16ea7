"""A corpus as it is published: the same documents, in whatever form and however many shards,
prepare to the same tokens and the same split; each bad shard is one line, and nothing is written."""

import bz2
import gzip
import json
import lzma

import pytest
from conftest import run_main

from nanolm.data.prepare import prepare
from nanolm.data.shards import PreparedData
from nanolm.data.sources import DocumentSource
from nanolm.errors import NanolmError
from nanolm.tokenizer import EOS

DOCS = [
    f"Story {i}: the {'cat' if i % 3 else 'dog'} saw {i % 7} birds.\nThe end, caf\u00e9 \U0001f600." for i in range(60)
]


def _txt(docs) -> str:
    return f"\n{EOS}\n".join(docs)


def _jsonl(docs) -> str:
    return "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))


def _zstd(data: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(data)


COMPRESS = {"": lambda b: b, ".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress, ".zst": _zstd}


def _write_form(root, form: str):
    """The corpus ``DOCS`` written as ``form``; returns what --data names."""
    root.mkdir()
    halves = [DOCS[:25], DOCS[25:]]
    if form.split(".")[0] in ("txt", "jsonl"):
        kind, _, compression = form.partition(".")
        suffix = "." + compression if compression else ""
        text = _txt if kind == "txt" else _jsonl
        path = root / f"corpus.{kind}{suffix}"
        path.write_bytes(COMPRESS[suffix](text(DOCS).encode()))
        return path
    if form == "txt-shards":  # a directory of shards, each of many documents; its dataset card skipped
        for i, half in enumerate(halves):
            (root / f"part-{i:05d}.txt").write_text(_txt(half), encoding="utf-8")
        (root / "README.md").write_text("# a dataset card, not data")
        return root
    if form == "jsonl-glob":  # compressed shards in two forms, named by a glob
        (root / "a-0.jsonl.gz").write_bytes(gzip.compress(_jsonl(halves[0]).encode()))
        (root / "a-1.jsonl.xz").write_bytes(lzma.compress(_jsonl(halves[1]).encode()))
        return str(root / "a-*.jsonl.*")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    if form == "parquet-shards":
        for i, half in enumerate(halves):
            pq.write_table(
                pa.table({"id": list(range(len(half))), "text": half}), root / f"train-{i:05d}-of-00002.parquet"
            )
        return root
    assert form == "saved-dataset"  # Hugging Face's save_to_disk: arrow streams listed in state.json
    names = []
    for i, half in enumerate(halves):
        names.append(f"data-{i:05d}-of-00002.arrow")
        table = pa.table({"text": pa.array(half, pa.large_string())})
        with pa.ipc.new_stream(str(root / names[-1]), table.schema) as w:
            w.write_table(table, max_chunksize=10)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (root / "dataset_info.json").write_text("{}")
    return root


FORMS = [
    "txt",
    "txt.gz",
    "txt.bz2",
    "txt.xz",
    "txt.zst",
    "jsonl",
    "jsonl.zst",
    "txt-shards",
    "jsonl-glob",
    "parquet-shards",
    "saved-dataset",
]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    return PreparedData(prepare(_write_form(root / "src", "txt"), root / "out", "char", progress=False).dir)


@pytest.mark.parametrize("form", FORMS)
def test_the_same_documents_in_every_form_prepare_to_identical_tokens_and_split(tmp_path, form, plain):
    source = _write_form(tmp_path / "src", form)
    assert list(DocumentSource(source)) == DOCS
    data = prepare(source, tmp_path / "out", "char", progress=False)
    assert data.digest == plain.digest  # every file: tokens, document starts, tokenizer
    assert data.meta["splits"] == plain.meta["splits"]
    assert [f["name"] for f in data.meta["source_files"]] == [s.name for s in DocumentSource(source).shards]


def test_a_directory_reads_its_shards_in_sorted_order_and_skips_hidden_entries(tmp_path):
    order = [7, 2, 11, 0, 5, 9, 1, 10, 3, 8, 4, 6]  # written out of order: a listing's order is the disk's
    for i in order:
        (tmp_path / f"part-{i:02d}.txt").write_text(_txt(DOCS[5 * i : 5 * i + 5]))
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "z.txt").write_text("not the corpus")
    (tmp_path / ".hidden.txt").write_text("not the corpus either")
    assert list(DocumentSource(tmp_path)) == DOCS


def _zst_damaged(root):
    data = _zstd(_txt(DOCS * 40).encode())
    (root / "a.txt.zst").write_bytes(data[: len(data) // 2] + bytes(64) + data[len(data) // 2 :])
    return root / "a.txt.zst"


BAD_SOURCES = {
    "an empty shard": (
        lambda root: [(root / "a.txt").write_text(_txt(DOCS)), (root / "b.txt").write_text(""), root][-1],
        r"b\.txt is empty \(a shard of .*\); remove it from the corpus",
    ),
    "a shard of whitespace": (
        lambda root: [(root / "a.txt").write_text(_txt(DOCS)), (root / "b.txt").write_text("\n \n"), root][-1],
        r"b\.txt holds no text \(an empty shard\); remove it from the corpus",
    ),
    "a parquet shard without the text column": (
        lambda root: _parquet_pair(root, {"body": ["x"]}),
        r"b\.parquet has no column 'text' \(columns: body\); set --text-field",
    ),
    "a parquet shard whose text column holds numbers": (
        lambda root: _parquet_pair(root, {"text": [1, 2]}),
        r"b\.parquet: column 'text' holds int64, not text; set --text-field",
    ),
    "an empty parquet shard": (
        lambda root: _parquet_pair(root, {"text": __import__("pyarrow").array([], "string")}),
        r"b\.parquet holds no rows \(an empty shard\); remove it from the corpus",
    ),
    "a jsonl shard with another schema": (
        lambda root: [
            (root / "a.jsonl").write_text(_jsonl(DOCS)),
            (root / "b.jsonl").write_text('{"body": "x"}\n'),
            root,
        ][-1],
        r"b\.jsonl: its records have no string field 'text' \(fields: body\); set --text-field",
    ),
    "a .zst that is not zstd": (
        lambda root: [(root / "a.txt.zst").write_bytes(b"not zstd at all" * 10), root / "a.txt.zst"][-1],
        r"a\.txt\.zst is damaged: its zstd data cannot be read \(.*\); download the shard again or remove it",
    ),
    "a .zst damaged inside": (
        _zst_damaged,
        r"a\.txt\.zst is damaged: its zstd data cannot be read \(.*\); download the shard again or remove it",
    ),
    "a truncated .gz": (
        lambda root: [
            (root / "a.txt.gz").write_bytes(gzip.compress(_txt(DOCS * 40).encode())[:-600]),
            root / "a.txt.gz",
        ][-1],
        r"a\.txt\.gz is damaged: its gzip data cannot be read \(.*\); download the shard again or remove it",
    ),
    "a glob that matches nothing": (
        lambda root: str(root / "shards-*.parquet"),
        r"--data .*shards-\*\.parquet matches no file; check the pattern",
    ),
    "a glob that matches a file of another kind": (
        lambda root: [(root / "a.txt").write_text("x"), (root / "a.csv").write_text("x"), str(root / "a.*")][-1],
        r"a\.csv \(matched by .*\) is not a corpus shard",
    ),
    "a dataset dictionary": (
        lambda root: [(root / "dataset_dict.json").write_text('{"splits": ["train"]}'), root][-1],
        r"is a dataset dictionary saved with save_to_disk; pass one split's directory",
    ),
}


def _parquet_pair(root, columns):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": DOCS}), root / "a.parquet")
    pq.write_table(pa.table(columns), root / "b.parquet")
    return root


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_each_bad_shard_is_one_line_and_nothing_is_written(tmp_path, case):
    make, message = BAD_SOURCES[case]
    src = tmp_path / "src"
    src.mkdir()
    source = make(src)
    before = sorted(p.name for p in src.iterdir())
    result = run_main("prepare", "--data", source, "--out", tmp_path / "out", "--tokenizer", "char")
    assert result.returncode == 2, result.stdout + result.stderr
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") and __import__("re").search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no --out, no kept pieces
    assert sorted(p.name for p in src.iterdir()) == before


def test_a_compressed_text_is_read_without_unpacking_it_to_disk(tmp_path, monkeypatch):
    """Shards are streamed: reading one writes nothing (a 2 GB .zst would need 8 GB unpacked)."""
    source = _write_form(tmp_path / "src", "txt.gz")
    opened = []
    real_open = open

    def watching_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            opened.append(file)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watching_open)
    assert list(DocumentSource(source)) == DOCS
    assert opened == []


def test_a_missing_decompressor_is_named_with_its_install(tmp_path, monkeypatch):
    import sys

    source = _write_form(tmp_path / "src", "txt.zst")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(NanolmError, match=r"needs zstandard: pip install 'nanolm\[zstd\]'"):
        list(DocumentSource(source))


def test_the_tokens_are_the_same_whatever_the_number_of_encoding_workers(tmp_path, monkeypatch):
    """A large corpus is encoded by worker processes, each piece cut into one part per worker and
    put back together in order: one, two or three workers write the same bytes as this process."""
    import nanolm.data.encoders as encoders

    source = _write_form(tmp_path / "src", "txt")
    here = prepare(source, tmp_path / "here", "bpe", vocab_size=300, progress=False)
    monkeypatch.setattr(encoders, "POOL_MIN_BYTES", 0)  # the corpus is small: use the workers anyway
    monkeypatch.setattr("nanolm.data.prepare.PIECE_CHARS", 500)  # and several pieces
    for workers in (1, 3):
        data = prepare(source, tmp_path / f"w{workers}", "bpe", vocab_size=300, progress=False, workers=workers)
        assert data.digest == here.digest, workers


def test_workers_that_cannot_start_leave_the_encoding_to_this_process(tmp_path, monkeypatch):
    """Worker processes re-import the main module; where they cannot (a script read from standard
    input) or die, the piece is encoded here instead, with a warning: slower, never wrong."""
    import concurrent.futures.process

    import nanolm.data.encoders as encoders

    source = _write_form(tmp_path / "src", "txt")
    here = prepare(source, tmp_path / "here", "char", progress=False)
    monkeypatch.setattr(encoders, "POOL_MIN_BYTES", 0)

    class Broken:
        def __init__(self, *args, **kwargs):
            pass

        def submit(self, *args):
            raise concurrent.futures.process.BrokenProcessPool("a worker died")

        def shutdown(self, **kwargs):
            pass

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Broken)
    lines = []
    data = prepare(source, tmp_path / "out", "char", progress="lines", log=lines.append, workers=2)
    assert data.digest == here.digest
    assert any("the encoding workers stopped (a worker died); encoding in this process" in line for line in lines)
