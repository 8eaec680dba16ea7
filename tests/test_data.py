import json
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_run_config
from hypothesis import given, settings
from hypothesis import strategies as st

import nanolm.data.progress as progress_mod
import nanolm.data.sources as sources_mod
from nanolm.batches import (
    Split,
    TrainBatches,
    WindowSampler,
    eval_batches,
    eval_window_starts,
    pack_windows,
)
from nanolm.data.prepare import boundary_crossing_windows, prepare
from nanolm.data.shards import PreparedData
from nanolm.data.sources import DocumentSource
from nanolm.errors import NanolmError
from nanolm.tokenizer import EOS

E = 0  # EOS id


# ------------------------------------------------------------------ packing and the mask
def test_eos_opens_the_next_document_by_default():
    tokens = np.array([5, 6, E, 7, 8, 9, E, 3, 4])
    b = pack_windows(tokens, np.array([0]), 8, eos_id=E, doc_mask=True, reset_positions=True)
    assert b.idx.tolist() == [[5, 6, E, 7, 8, 9, E, 3]]
    assert b.targets.tolist() == [[6, E, 7, 8, 9, E, 3, 4]]
    assert b.doc_ids.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]  # EOS belongs to the document it opens
    assert b.positions.tolist() == [[0, 1, 0, 1, 2, 3, 0, 1]]
    assert b.loss_mask.all()  # every prediction is made from inside one document


def test_mask_boundary_leaves_the_first_token_of_a_document_unpredicted():
    tokens = np.array([5, 6, E, 7, 8, 9, E, 3, 4])
    b = pack_windows(tokens, np.array([0]), 8, eos_id=E, doc_mask=True, reset_positions=True, mask_boundary=True)
    assert b.doc_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]  # EOS closes the document it ends
    assert b.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert b.loss_mask.tolist() == [[True, True, False, True, True, True, False, True]]


def test_without_the_mask_batches_carry_no_document_ids():
    b = pack_windows(np.arange(1, 20), np.array([0, 5]), 8, eos_id=E, doc_mask=False)
    assert b.doc_ids is None and b.positions is None
    assert torch.equal(b.targets[:, :-1], b.idx[:, 1:])


# ------------------------------------------------------------------ sampler
def test_sampler_is_deterministic_for_a_seed():
    a = WindowSampler(10_000, 16, 8, seed=3)
    b = WindowSampler(10_000, 16, 8, seed=3)
    c = WindowSampler(10_000, 16, 8, seed=4)
    draws_a = [a.next_starts() for _ in range(5)]
    assert all(np.array_equal(x, b.next_starts()) for x in draws_a)
    assert not all(np.array_equal(x, c.next_starts()) for x in draws_a)


def test_sampler_visits_every_window_once_per_epoch():
    s = WindowSampler(1001, 10, 7, seed=0)  # 100 windows, batches of 7 cross the epoch boundary
    seen = np.concatenate([s.next_starts() for _ in range(100)])  # 700 windows = 7 epochs
    for epoch in range(7):
        chunk = seen[epoch * 100 : (epoch + 1) * 100]
        assert sorted(chunk.tolist()) == list(range(0, 1000, 10))
    assert not np.array_equal(seen[:100], seen[100:200])  # a new order each epoch


def test_random_offset_shifts_the_grid_each_epoch_and_stays_in_range():
    s = WindowSampler(1001, 10, 33, seed=0, random_offset=True)
    seen = np.concatenate([s.next_starts() for _ in range(9)])
    assert seen.max() + 11 <= 1001
    offsets = {int(x) % 10 for x in seen[:99]}, {int(x) % 10 for x in seen[99:198]}
    assert all(len(o) == 1 for o in offsets)  # one grid per epoch


def test_sampler_state_round_trips_mid_epoch():
    s = WindowSampler(5000, 16, 4, seed=9)
    for _ in range(37):
        s.next_starts()
    state = json.loads(json.dumps(s.state_dict()))  # a few integers, JSON-safe
    expected = [s.next_starts() for _ in range(200)]
    fresh = WindowSampler(5000, 16, 4, seed=0)
    fresh.load_state_dict(state)
    assert all(np.array_equal(e, fresh.next_starts()) for e in expected)


def test_ranks_draw_disjoint_windows_that_together_make_the_single_process_batch():
    single = WindowSampler(5000, 16, 8, seed=1)
    ranks = [WindowSampler(5000, 16, 4, seed=1, rank=r, world_size=2) for r in range(2)]
    for _ in range(50):
        parts = [r.next_starts() for r in ranks]
        assert not set(parts[0]) & set(parts[1])
        assert np.array_equal(np.concatenate(parts), single.next_starts())


def test_sampler_refuses_a_split_shorter_than_one_window():
    with pytest.raises(NanolmError, match="fewer than one window"):
        WindowSampler(10, 16, 2)


def test_evaluation_windows_count_every_target_exactly_once():
    for n, T in [(101, 10), (107, 10), (11, 10), (50, 7)]:
        tokens = np.arange(n) + 1
        counted = []
        for batch in eval_batches(Split(tokens, np.zeros(0), 0), T, 3, eos_id=0, doc_mask=False):
            counted += batch.targets[batch.loss_mask].tolist()
        assert sorted(counted) == list(range(2, n + 1))
    starts, _ = eval_window_starts(10_000, 10, max_windows=7)
    assert len(starts) == 7 and np.array_equal(starts, eval_window_starts(10_000, 10, max_windows=7)[0])


# ------------------------------------------------------------------ sources and prepare
DOCS = [
    "First story about a cat.\nIt had two lines.",
    "Second: caf\u00e9 \u65e5\u672c \U0001f600",
    "Third one.",
    "Fourth, short.",
    "Fifth story!\n\nWith a blank line inside.",
]


def _decode_split(data: PreparedData, name: str) -> list[str]:
    split = data.splits[name]
    tokens = np.asarray(split.tokens).astype(np.int64)
    bounds = list(split.doc_starts) + [len(tokens)]
    assert tokens[0] == data.tokenizer.eos_id  # the stream opens with EOS
    docs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert tokens[b - 1] == data.tokenizer.eos_id  # every document is followed by EOS
        docs.append(data.tokenizer.decode(tokens[a : b - 1]))
    return docs


def _write_txt(path, docs):
    path.write_text(f"\n{EOS}\n".join(docs) + "\n", encoding="utf-8")
    return path


def test_prepare_round_trip_gives_back_the_documents(tmp_path):
    for kind in ("bpe", "char"):
        src = _write_txt(tmp_path / f"docs_{kind}.txt", DOCS * 3)
        data = prepare(src, tmp_path / f"out_{kind}", kind, 300, val_fraction=0.2, progress=False)
        train, val = _decode_split(data, "train"), _decode_split(data, "val")
        assert len(val) == 3 and len(train) == 12  # every 5th document is held out, whole
        assert train == [d for i, d in enumerate(DOCS * 3) if i % 5 != 4]
        assert val == [DOCS[4]] * 2 + [DOCS[4] + "\n"]  # the file's final line break ends the last one
        assert data.meta["dtype"] == "uint16" and data.meta["splits"]["val"]["documents"] == 3


def test_each_source_format_gives_the_same_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "dir").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "dir" / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "d.parquet")
    _write_txt(tmp_path / "d.txt", DOCS)
    for src in ("dir", "d.jsonl", "d.parquet"):
        assert list(DocumentSource(tmp_path / src)) == DOCS, src
    assert list(DocumentSource(tmp_path / "d.txt"))[:-1] == DOCS[:-1]
    data = prepare(tmp_path / "d.parquet", tmp_path / "out", "bpe", 300, val_fraction=0.2, progress=False)
    assert _decode_split(data, "train") == DOCS[:4] and _decode_split(data, "val") == DOCS[4:]


_LINE = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\r\n\x00"), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    lines=st.lists(st.one_of(_LINE, st.just(EOS)), min_size=1, max_size=12),
    ends_with_break=st.booleans(),
    line_break=st.sampled_from(["\r\n", "\r"]),
)
def test_line_breaks_of_any_kind_split_text_into_the_same_documents(lines, ends_with_break, line_break):
    """Unix, Windows and old Mac line breaks cut a .txt file into the same documents: only the
    breaks inside each document differ, and the break before a separator line belongs to the
    separator whichever kind it is (a lone \\r used to stay at the end of each document)."""
    unix = "\n".join(lines) + ("\n" if ends_with_break else "")
    if not unix.strip():
        return  # an empty or blank file is refused, whatever its breaks
    with tempfile.TemporaryDirectory() as tmp:
        documents = []
        for text in (unix, unix.replace("\n", line_break)):
            path = Path(tmp) / "d.txt"
            path.write_bytes(text.encode("utf-8"))
            documents.append(list(DocumentSource(path)))
    assert documents[1] == [d.replace("\n", line_break) for d in documents[0]]


def test_bad_jsonl_lines_are_reported_with_their_line_numbers(tmp_path):
    lines = [
        json.dumps({"text": "good one"}),
        "{broken",
        json.dumps({"body": "no text"}),
        json.dumps({"text": "good two"}),
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    messages = []
    data = prepare(
        tmp_path / "d.jsonl", tmp_path / "out", "char", val_fraction=0.0, progress=False, log=messages.append
    )
    assert any("d.jsonl:2:" in m and "JSON" in m for m in messages)
    assert any("d.jsonl:3:" in m and "'text'" in m for m in messages)
    assert data.meta["bad_records"] == 2 and _decode_split(data, "train") == ["good one", "good two"]


def test_empty_documents_are_skipped_and_counted(tmp_path):
    src = _write_txt(tmp_path / "d.txt", ["one", "", "  \n ", "two", "three"])
    data = prepare(src, tmp_path / "out", "char", val_fraction=0.0, progress=False)
    assert data.meta["empty_documents_skipped"] == 2
    assert _decode_split(data, "train") == ["one", "two", "three\n"]


def test_over_long_documents_are_split_at_line_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_mod, "MAX_DOC_CHARS", 20)
    long_doc = "".join(f"line number {i}\n" for i in range(6))  # 6 lines of 14-15 chars
    src = _write_txt(tmp_path / "d.txt", ["short", long_doc.rstrip("\n")])
    docs = list(DocumentSource(src))
    assert docs[0] == "short"
    assert "".join(docs[1:]) == long_doc.rstrip("\n") + "\n"
    assert all(len(d) <= 20 + 15 for d in docs) and len(docs) == 4
    assert all(d.endswith("\n") for d in docs[1:-1])  # cut only at line ends


def test_a_single_document_is_split_by_bytes(tmp_path):
    text = "".join(f"Line {i}: to be or not to be.\n" for i in range(200))
    (tmp_path / "one.txt").write_text(text)
    data = prepare(tmp_path / "one.txt", tmp_path / "out", "char", val_fraction=0.1, progress=False)
    train, val = _decode_split(data, "train"), _decode_split(data, "val")
    assert train[0] + val[0] == text
    assert len(val[0].encode()) == len(text.encode()) - int(len(text.encode()) * 0.9)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"\x00\x01\x02binary", "binary"),
        (b"caf\xe9 latin-1", "not valid UTF-8"),
    ],
)
def test_unreadable_sources_get_a_clear_error(tmp_path, content, message):
    path = tmp_path / "d.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(NanolmError, match=message):
        prepare(path, tmp_path / "out", "char", progress=False)


def test_shards_from_another_tokenizer_are_refused(tmp_path):
    src = _write_txt(tmp_path / "d.txt", DOCS * 2)
    data = prepare(src, tmp_path / "out", "bpe", 300, progress=False)
    with pytest.raises(NanolmError, match="another tokenizer"):
        data.check_vocab(200)
    from nanolm.tokenizer import train_char

    train_char(["xyz"]).save(tmp_path / "out" / "tokenizer.json")
    with pytest.raises(NanolmError, match="tokenizer.json is corrupt"):
        PreparedData(tmp_path / "out")
    with pytest.raises(NanolmError, match="not the tokenizer these shards were made with"):
        PreparedData(tmp_path / "out", verify=False)


def test_truncated_shards_are_detected(tmp_path):
    src = _write_txt(tmp_path / "d.txt", DOCS * 4)
    prepare(src, tmp_path / "out", "char", progress=False)
    with open(tmp_path / "out" / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(NanolmError, match="truncated"):
        PreparedData(tmp_path / "out")


@pytest.mark.parametrize("size", [9, 11])
def test_shards_that_end_mid_token_are_named_as_damaged(tmp_path, size):
    """A shard cut (or overwritten) at an odd byte count ends in half a token id: the check
    names the file, it does not trip over the half id."""
    src = _write_txt(tmp_path / "d.txt", DOCS * 4)
    prepare(src, tmp_path / "out", "bpe", 300, progress=False)  # 2-byte ids
    (tmp_path / "out" / "train.bin").write_bytes(b"\x01" * size)
    with pytest.raises(NanolmError, match="train.bin"):
        PreparedData(tmp_path / "out")


def test_boundary_statistics_match_a_brute_force_count():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=200)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    n = int(lengths.sum())
    for T in (8, 16, 64):
        crossing, windows = boundary_crossing_windows(starts, n, T)
        brute = sum(any(w * T < s - 1 < w * T + T for s in starts[1:]) for w in range((n - 1) // T))
        assert windows == (n - 1) // T and crossing == brute


def test_prepare_reports_compressor_bounds(tmp_path, stories_file):
    data = prepare(stories_file, tmp_path / "out", "bpe", 300, progress=False)
    bounds = data.meta["compressor_bpb"]
    assert 0 < bounds["xz"] < bounds["zlib"] < 8
    assert data.meta["mb_per_s"] > 0


def test_a_training_run_skips_the_compressor_bounds_that_prepare_and_doctor_report(tmp_path, stories_file):
    """xz competes with the encoding for the cores (~1 s of tiny-shakespeare's 2.8 s preparation)
    and nothing in a run reads its bound, so a run's own preparation skips it, with the same
    shards; ``nanolm prepare`` and ``nanolm doctor`` (``load_training_data``'s default)
    still report the bound a model must beat."""
    from nanolm.data.prepare import load_training_data
    from nanolm.instruments.doctor import check_loss_floor
    from nanolm.train import train

    text = tmp_path / "plain.txt"  # no entropy file beside it: doctor falls back on the compressors
    text.write_text(stories_file.read_text())
    cfg = tiny_run_config(text, tmp_path / "run", steps=1, eval_every=1)
    bounded = load_training_data(cfg, tmp_path / "doctor", log=lambda *_: None)
    skipped = load_training_data(cfg, tmp_path / "run_scratch", log=lambda *_: None, compressor_bounds=False)
    assert 0 < bounded.meta["compressor_bpb"]["xz"] < 8 and "xz" in check_loss_floor(bounded).detail
    assert skipped.meta["compressor_bpb"] is None and skipped.digest == bounded.digest
    train(cfg, log=lambda *_: None)
    assert json.loads((tmp_path / "run" / "data" / "meta.json").read_text())["compressor_bpb"] is None


def test_a_changed_token_inside_the_vocabulary_is_refused(tmp_path):
    """An in-range id trains silently on different data; only the checksum can tell."""
    src = _write_txt(tmp_path / "d.txt", DOCS * 4)
    data = prepare(src, tmp_path / "out", "char", progress=False)
    tokens = np.fromfile(tmp_path / "out" / "train.bin", dtype=data.meta["dtype"])
    tokens[5] = (int(tokens[5]) + 1) % data.tokenizer.vocab_size
    tokens.tofile(tmp_path / "out" / "train.bin")
    with pytest.raises(NanolmError, match="train.bin is corrupt"):
        PreparedData(tmp_path / "out")


def test_token_ids_outside_the_vocabulary_are_refused_before_training_even_when_vouched_for(tmp_path):
    """The largest id is read from the shards themselves, not from meta.json: a lying
    max_id (with the manifest and seal recomputed) cannot smuggle in an IndexError."""
    from nanolm.base.files import sealed, sha256_file

    src = _write_txt(tmp_path / "d.txt", DOCS * 4)
    data = prepare(src, tmp_path / "out", "char", progress=False)
    tokens = np.fromfile(tmp_path / "out" / "train.bin", dtype=data.meta["dtype"])
    tokens[5] = 60000
    tokens.tofile(tmp_path / "out" / "train.bin")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    meta.pop("seal")
    meta["files"]["train.bin"] = sha256_file(tmp_path / "out" / "train.bin")
    (tmp_path / "out" / "meta.json").write_text(json.dumps(sealed(meta)))
    reopened = PreparedData(tmp_path / "out")
    assert reopened.meta["max_id"] < 60000 and reopened.max_id == 60000
    with pytest.raises(NanolmError, match="holds token id 60000"):
        reopened.check_vocab(data.tokenizer.vocab_size)


def test_prepare_refuses_a_directory_holding_other_files(tmp_path):
    src = _write_txt(tmp_path / "d.txt", DOCS * 4)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    with pytest.raises(NanolmError, match="mine.txt, which prepare did not write"):
        prepare(src, tmp_path / "out", "char", progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["mine.txt"]


def test_prepare_refuses_a_directory_holding_only_hidden_files(tmp_path, capsys):
    """A directory whose only entries are hidden (a ``git init`` made for the data, a Finder's
    .DS_Store) is still someone's: taken as prepare's own, it would be swapped away whole for the
    shards, its repository with it. Refused in one line, it is left exactly as it was."""
    from nanolm.instruments.cli import main

    src = _write_txt(tmp_path / "d.txt", DOCS * 4)
    out = tmp_path / "out"
    (out / ".git").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    before = _tree(out)
    assert main(["prepare", "--data", str(src), "--out", str(out), "--tokenizer", "char"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {out} already holds .DS_Store, which prepare did not write; choose a new or empty --out"]
    assert _tree(out) == before and sorted(p.name for p in out.iterdir()) == [".DS_Store", ".git"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.txt", "out"]  # no scratch left beside it


def test_the_bpe_tokenizer_learns_from_training_documents_only():
    """Merges learnt from validation text would let the held-out documents compress better than
    unseen text does: a validation loss flattered by the tokenizer. The char vocabulary sees
    every document, since a character only in validation must still be encodable."""
    from nanolm.data.prepare import _tokenizer_texts
    from nanolm.data.sources import split_documents

    docs = [f"story {i} " + ("zyzzyva " * 20 if i % 10 == 9 else "plain words ") for i in range(40)]
    val = {text for split, text in split_documents(iter(docs), 0.1) if split == "val"}
    seen = list(_tokenizer_texts(docs, "bpe", 0.1))
    assert val and not val & set(seen) and len(seen) == len(docs) - len(val)
    assert set(_tokenizer_texts(docs, "char", 0.1)) >= val


# ------------------------------------------------------------------ prepare's progress
@pytest.fixture(scope="module")
def progress_runs(tmp_path_factory):
    """One corpus prepared twice, silently and with plain progress lines (the size threshold and
    the least gap between lines lowered so that 1.5 MB shows them): (silent data, shown data, the lines)."""
    from nanolm.data.corpus import write_stories

    tmp = tmp_path_factory.mktemp("progress")
    write_stories(tmp / "stories.txt", 4000, seed=0)
    lines = []
    threshold, progress_mod.PROGRESS_MIN_BYTES = progress_mod.PROGRESS_MIN_BYTES, 0
    gap, progress_mod.PROGRESS_GAP_S = progress_mod.PROGRESS_GAP_S, 0.0
    try:
        quiet = prepare(
            tmp / "stories.txt",
            tmp / "quiet",
            "bpe",
            512,
            progress=False,
            compressor_sample_bytes=0,
            log=lambda *_: None,
        )
        shown = prepare(
            tmp / "stories.txt",
            tmp / "shown",
            "bpe",
            512,
            progress="lines",
            compressor_sample_bytes=0,
            log=lines.append,
        )
    finally:
        progress_mod.PROGRESS_MIN_BYTES, progress_mod.PROGRESS_GAP_S = threshold, gap
    return quiet, shown, lines


def test_progress_does_not_change_the_prepared_bytes(progress_runs):
    """Progress only watches: the tokenizer reads its documents through the progress meter,
    and a meter that consumed or dropped any of them would train another tokenizer."""
    quiet, shown, _ = progress_runs
    assert shown.tokenizer.fingerprint() == quiet.tokenizer.fingerprint()
    assert shown.digest == quiet.digest


def test_plain_progress_shows_each_phase_with_an_eta(progress_runs):
    *_, lines = progress_runs
    assert all(line.startswith("prepare: ") for line in lines)
    text = "\n".join(lines)
    assert "prepare: training the bpe tokenizer (" in text and "prepare: encoding (" in text
    for phase in ("training the bpe tokenizer", "encoding"):
        with_eta = [
            line for line in lines if line.startswith(f"prepare: {phase} ") and "% (" in line and "ETA " in line
        ]
        assert with_eta, f"no progress line with an ETA for {phase}"
        assert len(with_eta) <= 10  # a line per tenth at most (the 30 s cadence is not reached here)
    assert "computing its merges" in text and "tokenizer trained in" in text and "prepare: encoded " in text
    assert lines[-1].startswith("prepare: ") and "done in" in lines[-1]


@pytest.mark.parametrize("why", ["small source", "rank 1"])
def test_progress_stays_out_of_the_way(stories_file, tmp_path, monkeypatch, why):
    """A source under the threshold prepares in seconds: no progress. Under torchrun only rank 0
    shows it (every rank would print the same lines)."""
    if why == "rank 1":
        monkeypatch.setattr(progress_mod, "PROGRESS_MIN_BYTES", 0)
        monkeypatch.setenv("RANK", "1")
    lines = []
    prepare(stories_file, tmp_path / "out", "char", progress="lines", compressor_sample_bytes=0, log=lines.append)
    assert not [line for line in lines if line.startswith("prepare:")]


def test_prepare_refuses_an_unknown_progress_mode(stories_file, tmp_path):
    with pytest.raises(NanolmError, match="progress 'fancy' is not one of auto, bar, lines"):
        prepare(stories_file, tmp_path / "out", "char", progress="fancy")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("seconds_per_percent, expected", [(1.0, 9), (0.05, 0), (0.1, 1), (10.0, 39)])
def test_plain_progress_lines_come_at_a_modest_cadence(monkeypatch, seconds_per_percent, expected):
    """A line per tenth, but none within 5 s of the last (a phase of seconds needs none) and at
    least one every 30 s (a slow tenth still shows life); 100 % is the phase's end line."""
    clock = [0.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: clock[0])
    lines = []
    shown = progress_mod.PrepareProgress("lines", log=lines.append)
    shown.begin("encoding", 100)
    for _ in range(100):
        clock[0] += seconds_per_percent
        shown.advance(1)
    shown.end()
    assert len(lines) - 1 == expected, lines


# ------------------------------------------------------------------ a refused or interrupted prepare changes nothing
def _tree(directory):
    """Every file below ``directory`` and its bytes: what a user would call "the same directory"."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "name, content",
    [
        ("separators.txt", f"{EOS}\n{EOS}\n"),
        ("blank.txt", "   \n\n\t\n"),
        ("nofield.jsonl", '{"body": "a story"}\n{"body": "another"}\n'),
        ("crafted.jsonl", "[" * 5000 + "]" * 5000 + "\n"),
    ],
)
def test_a_refused_prepare_leaves_an_existing_prepared_directory_byte_identical(tmp_path, name, content):
    """A source with no text is refused only once it has been read; before, the shards had
    already been emptied, and the data the user had prepared was gone."""
    out = tmp_path / "prepared"
    prepare(_write_txt(tmp_path / "d.txt", DOCS * 4), out, "char", progress=False)
    before = _tree(out)
    (tmp_path / name).write_text(content)
    with pytest.raises(NanolmError, match="holds no document with text|records have no string field"):
        prepare(tmp_path / name, out, "char", progress=False)
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["prepared", "d.txt", name])  # no scratch left
    PreparedData(out)


def test_a_refused_prepare_into_a_new_directory_leaves_none(tmp_path):
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(NanolmError):
        prepare(tmp_path / "blank.txt", tmp_path / "new" / "deeper", "char", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.txt"]


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_an_interrupted_prepare_leaves_out_as_it_was_and_keeps_its_pieces_for_the_rerun(
    tmp_path, monkeypatch, interruption
):
    """Ctrl-C or a full disk in the middle of the shards: --out holds the old data, whole; the
    pieces finished are kept beside it, and the same prepare again continues from them."""
    import nanolm.data.prepare as prepare_mod

    out = tmp_path / "prepared"
    prepare(_write_txt(tmp_path / "d.txt", DOCS * 4), out, "char", progress=False)
    before = _tree(out)
    real_encode = prepare_mod._encode

    def encode_then_fail(docs, tokenizer, writers, *args):
        real_encode(docs, tokenizer, writers, *args)
        raise interruption

    monkeypatch.setattr(prepare_mod, "_encode", encode_then_fail)
    monkeypatch.setattr(prepare_mod, "PIECE_CHARS", 40)  # several pieces, recorded (one piece records nothing)
    with pytest.raises(type(interruption) if isinstance(interruption, Exception) else interruption):
        prepare(_write_txt(tmp_path / "e.txt", DOCS * 8), out, "char", progress=False)
    assert _tree(out) == before
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept[1:] == ["d.txt", "e.txt", "prepared"] and kept[0].startswith(".prepared.prepare-"), kept
    monkeypatch.setattr(prepare_mod, "_encode", real_encode)
    lines = []
    prepare(tmp_path / "e.txt", out, "char", progress=False, log=lines.append)
    assert any("continuing the interrupted prepare" in line for line in lines), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.txt", "e.txt", "prepared"]
    prepare(tmp_path / "e.txt", tmp_path / "whole", "char", progress=False)
    assert PreparedData(out).digest == PreparedData(tmp_path / "whole").digest


def test_a_prepare_replaces_a_prepared_directory_whole(tmp_path, monkeypatch):
    """On a system without an atomic directory swap the files are moved in one by one, meta.json
    last; either way the result is exactly what a prepare into a new directory gives."""
    import nanolm.base.files as files_mod

    fresh, replaced, by_file = tmp_path / "fresh", tmp_path / "replaced", tmp_path / "by_file"
    new_source = _write_txt(tmp_path / "e.txt", DOCS * 8)
    prepare(new_source, fresh, "char", progress=False)
    for out in (replaced, by_file):
        prepare(_write_txt(tmp_path / "d.txt", DOCS * 4), out, "char", progress=False)
    prepare(new_source, replaced, "char", progress=False)
    monkeypatch.setattr(files_mod, "_exchange", lambda a, b: False)
    prepare(new_source, by_file, "char", progress=False)

    def data(directory):
        return {k: v for k, v in _tree(directory).items() if k != "meta.json"}

    assert data(replaced) == data(fresh) == data(by_file)
    assert PreparedData(replaced).digest == PreparedData(by_file).digest == PreparedData(fresh).digest
    assert not list(tmp_path.glob(".*"))  # no scratch directory left beside them


def test_the_entropy_file_of_a_large_corpus_is_read_and_a_refused_one_is_named(tmp_path, monkeypatch, stories_file):
    """The stories' entropy file grows with the corpus (one number per story): the loss floor of a
    million stories must not vanish because its file passed the few megabytes of a metadata file.
    Played here with a small corpus and a limit below its entropy file's size."""
    import nanolm.data.prepare as prepare_mod
    from nanolm.data.corpus import entropy_path

    monkeypatch.setattr(prepare_mod, "MAX_METADATA_BYTES", entropy_path(stories_file).stat().st_size - 1)
    notes = []
    data = prepare(stories_file, tmp_path / "large", "char", compressor_sample_bytes=0, log=notes.append)
    assert data.meta["floor"]["bpb"] > 0 and not [n for n in notes if "floor" in n]

    source = tmp_path / "stories.txt"  # an entropy file larger than the text it describes: not nanolm's
    source.write_text(stories_file.read_text())
    entropy_path(source).write_text(json.dumps({"doc_nats": [1.0] * 200_000}))
    notes = []
    assert (
        "floor" not in prepare(source, tmp_path / "foreign", "char", compressor_sample_bytes=0, log=notes.append).meta
    )
    assert [n for n in notes if "floor" in n] == [
        f"note: {entropy_path(source)} is 1 MiB, far larger than any such file nanolm writes; the file is damaged; "
        f"no loss floor is reported"
    ]


@pytest.mark.parametrize(
    "doc_nats, note",
    [
        ("one too few", "note: the corpus's entropy file does not match its documents; no loss floor is reported"),
        ({"doc_nats": "many"}, "holds no list of numbers under doc_nats"),
        ({"doc_nats": [1.0, True]}, "holds no list of numbers under doc_nats"),
        ({"nats": []}, "holds no list of numbers under doc_nats"),
        ([1.0], "holds no list of numbers under doc_nats"),
    ],
)
def test_an_entropy_file_that_does_not_describe_the_stories_gives_no_floor_and_says_so(
    tmp_path, stories_file, doc_nats, note
):
    """The loss floor is the stories' known information: from a file that describes other stories (or
    none), a floor would be a wrong number under a trusted name."""
    from nanolm.data.corpus import entropy_path

    source = tmp_path / "stories.txt"
    source.write_text(stories_file.read_text())
    if doc_nats == "one too few":
        doc_nats = {"doc_nats": json.loads(entropy_path(stories_file).read_text())["doc_nats"][:-1]}
    entropy_path(source).write_text(json.dumps(doc_nats))
    notes = []
    assert "floor" not in prepare(source, tmp_path / "p", "char", compressor_sample_bytes=0, log=notes.append).meta
    assert (
        [n for n in notes if n.startswith("note:")] == [note]
        if note.startswith("note:")
        else [n for n in notes if n.startswith("note:")]
        == [f"note: {entropy_path(source)} {note}; no loss floor is reported"]
    )


def test_stories_without_validation_documents_have_no_floor_and_no_note(tmp_path, stories_file):
    notes = []
    data = prepare(stories_file, tmp_path / "p", "char", val_fraction=0.0, compressor_sample_bytes=0, log=notes.append)
    assert "floor" not in data.meta and not [n for n in notes if n.startswith("note:")]
    assert prepare(stories_file, tmp_path / "q", "char", compressor_sample_bytes=0, log=notes.append).meta["floor"]


# ------------------------------------------------------------------ what a run does with --data
def test_a_run_without_data_trains_on_the_built_in_stories_the_same_whatever_its_seed(tmp_path):
    from nanolm.data.prepare import load_training_data
    from nanolm.run.config import RunConfig

    prepared = []
    for seed in (0, 7):
        cfg = RunConfig()
        cfg.data.stories, cfg.data.tokenizer, cfg.train.seed, cfg.train.progress = 40, "char", seed, False
        said = []
        scratch = tmp_path / f"s{seed}"
        scratch.mkdir()
        data = load_training_data(cfg, scratch, log=said.append, compressor_bounds=False)
        assert said[0] == "data: 40 generated stories (the built-in corpus; its entropy is known)"
        assert (
            data.dir == scratch / "data"
            and data.meta["splits"]["train"]["documents"] + data.meta["splits"]["val"]["documents"] == 40
            and data.meta["floor"]["bpb"] > 0
        )
        prepared.append(data.digest)
    assert prepared[0] == prepared[1]
    from nanolm.data.corpus import write_stories

    write_stories(tmp_path / "stories.txt", 40, seed=0)  # the corpus of seed 0, whatever the run's
    assert (
        prepare(tmp_path / "stories.txt", tmp_path / "p", "char", progress=False, compressor_sample_bytes=0).digest
        == prepared[0]
    )


def test_a_run_on_a_text_file_prepares_it_with_the_commands_options(tmp_path):
    """Every option of ``[data]`` reaches the preparation: the tokenizer and its size, the held-out
    share, the separator, and the window length its statistics are counted at."""
    from nanolm.data.prepare import load_training_data
    from nanolm.run.config import RunConfig

    source = tmp_path / "docs.txt"
    source.write_text(
        "\n===\n".join(f"document number {i}: " + "words and more words " * (i % 5 + 1) for i in range(40))
    )
    cfg = RunConfig()
    d = cfg.data
    d.data, d.tokenizer, d.vocab_size, d.val_fraction, d.separator = str(source), "bpe", 300, 0.25, "==="
    cfg.model.seq_len, cfg.train.progress = 16, False
    said = []
    data = load_training_data(cfg, tmp_path, log=said.append, compressor_bounds=False)
    m = data.meta
    assert said[0] == f"data: {source}" and data.dir == tmp_path / "data"
    assert (m["tokenizer"], m["vocab_size"], m["val_fraction"], m["seq_len_for_stats"]) == ("bpe", 300, 0.25, 16)
    assert m["eos_id"] == data.tokenizer.eos_id and m["dtype"] == "uint16"  # what a reader of the shards needs
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 40  # split at "===" lines
    assert m["compressor_bpb"] is None  # a run skips the bounds; doctor asks for them
    (tmp_path / "data").rename(tmp_path / "first")
    assert load_training_data(cfg, tmp_path, log=said.append).meta["compressor_bpb"]["xz"] > 0


def test_a_run_on_jsonl_reads_its_text_field(tmp_path):
    from nanolm.data.prepare import load_training_data
    from nanolm.run.config import RunConfig

    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"body": f"story {i} " * 20, "text": "x"}) + "\n" for i in range(30)))
    cfg = RunConfig()
    cfg.data.data, cfg.data.tokenizer, cfg.data.text_field, cfg.train.progress = str(source), "char", "body", False
    data = load_training_data(cfg, tmp_path, log=lambda *_: None, compressor_bounds=False)
    assert data.tokenizer.vocab_size > 5  # the bodies' characters, not only "x"


def test_a_run_on_prepared_shards_uses_them_as_they_are_and_says_the_tokenizer_options_do_not_apply(tmp_path):
    from nanolm.data.prepare import load_training_data
    from nanolm.run.config import RunConfig

    shards = tmp_path / "shards"
    made = prepare(_write_txt(tmp_path / "d.txt", DOCS * 4), shards, "char", progress=False)
    cfg = RunConfig()
    cfg.data.data, cfg.data.tokenizer, cfg.data.vocab_size = str(shards), "bpe", 4096
    said = []
    data = load_training_data(cfg, tmp_path / "unused", log=said.append)
    assert data.dir == shards and data.digest == made.digest and not (tmp_path / "unused").exists()
    assert said == [
        f"data: prepared shards in {shards}; their char tokenizer of {made.tokenizer.vocab_size} tokens "
        f"is used (--tokenizer and --vocab-size do not apply)"
    ]


def test_the_compressor_bounds_are_the_bits_per_byte_zlib_and_xz_add_for_the_text_after_its_context():
    import lzma
    import zlib

    from nanolm.data.prepare import compressor_bits_per_byte

    context, text = b"the cat sat on the mat. " * 40, b"the dog sat on the log, and the cat saw it."
    zlib_extra = len(zlib.compress(context + text, 9)) - len(zlib.compress(context, 9))
    xz_extra = len(lzma.compress(context + text, preset=6)) - len(lzma.compress(context, preset=6))
    assert compressor_bits_per_byte(context, text) == {
        "zlib": round(8 * zlib_extra / len(text), 4),
        "xz": round(8 * xz_extra / len(text), 4),
    }
    alone = b"hello world, hello there"  # no context: the whole compressed size counts
    alone_zlib, alone_xz = len(zlib.compress(alone, 9)), len(lzma.compress(alone, preset=6))
    assert compressor_bits_per_byte(b"", alone) == {
        "zlib": round(8 * alone_zlib / len(alone), 4),
        "xz": round(8 * alone_xz / len(alone), 4),
    }
    # text the context already predicts adds nothing to either: counted as the least a byte can cost, 1 byte
    assert compressor_bits_per_byte(b"a" * 1000, b"aa") == {"zlib": 4.0, "xz": 4.0}
    assert compressor_bits_per_byte(context, b"") == {}
    assert compressor_bits_per_byte(b"", b"abc" * 7)["zlib"] == round(8 * len(zlib.compress(b"abc" * 7, 9)) / 21, 4)


@pytest.mark.parametrize(
    "docs",
    [
        ["ab", "abc", "abcd", "x", "y"],
        ["a single document, split by its bytes " * 20],
        [f"{i} " + "the quick brown fox " * 25 for i in range(2000)],
    ],
)  # 1 MB: a rate to read
def test_meta_json_sums_up_the_shards_with_the_figures_the_prepare_line_prints(tmp_path, docs):
    data = prepare(
        _write_txt(tmp_path / "d.txt", docs), tmp_path / "p", "char", progress=False, compressor_sample_bytes=0
    )
    m, train = data.meta, data.meta["splits"]["train"]
    assert m["mean_doc_tokens"] == round(train["tokens"] / train["documents"], 1)  # to a tenth: 12 / 4 ... 3.7
    assert train["documents"] == (1 if len(docs) == 1 else len(docs) - m["splits"]["val"]["documents"])
    for key in ("seconds", "mb_per_s"):  # to the hundredth: what `nanolm prepare` prints
        assert isinstance(m[key], float) and m[key] == round(m[key], 2) and m[key] >= 0, key
    megabytes = Path(tmp_path / "d.txt").stat().st_size / 1e6  # the rate: the source's size over the time taken
    fastest, slowest = megabytes / max(m["seconds"] - 0.005, 1e-9), megabytes / (m["seconds"] + 0.005)
    assert slowest - 0.005 <= m["mb_per_s"] <= fastest + 0.005


def test_a_corpus_past_one_chunk_is_encoded_a_chunk_at_a_time_each_document_once(tmp_path, monkeypatch):
    """``prepare`` encodes ~8 MB of text at a time, so its memory does not grow with the corpus:
    past a chunk, every document is still in its split once and in order, the progress counts each
    byte once, and the compressor bounds read exactly the first 2 MiB of each split."""
    import nanolm.data.prepare as prepare_mod
    from nanolm.data.prepare import COMPRESSOR_SAMPLE_BYTES
    from nanolm.data.sources import split_documents
    from nanolm.tokenizer import Tokenizer

    docs = [f"{i:05d} " + "the quick brown fox jumps over the lazy dog. " * 12 for i in range(15_500)]  # 8.5 MB
    source = _write_txt(tmp_path / "big.txt", docs)
    encoded, compressed = [], []
    encode_batch, bounds = Tokenizer.encode_batch, prepare_mod.compressor_bits_per_byte
    monkeypatch.setattr(
        Tokenizer, "encode_batch", lambda self, texts: encoded.append(len(texts)) or encode_batch(self, texts)
    )
    monkeypatch.setattr(
        prepare_mod,
        "compressor_bits_per_byte",
        lambda context, text: compressed.append((context, text)) or bounds(context, text),
    )
    said = []
    monkeypatch.setattr(progress_mod, "PROGRESS_MIN_BYTES", 0)  # shown as for a larger corpus
    data = prepare(source, tmp_path / "p", "char", val_fraction=0.5, progress="lines", log=said.append)
    assert len(encoded) == 6 and sum(encoded) == len(docs)  # each split three times: two halves of a piece, the rest
    assert not [line for line in said if line.startswith("note:")]  # plain text: no entropy file, and none missed
    by_split = {"train": [], "val": []}
    as_read = list(DocumentSource(source, sources_mod.SEPARATOR, "text"))
    assert len(as_read) == len(docs)
    for split, text in split_documents(iter(as_read), 0.5):
        by_split[split].append(text)
    assert _decode_split(data, "train") == by_split["train"] and _decode_split(data, "val") == by_split["val"]
    m = data.meta["splits"]
    encoded_line = [line for line in said if line.startswith("prepare: encoded ")]
    assert len(encoded_line) == 1 and encoded_line[0].startswith(
        f"prepare: encoded {(m['train']['bytes'] + m['val']['bytes']) / 1e6:.1f} MB in "
    ), said

    def first(split):
        return "".join(by_split[split]).encode()[:COMPRESSOR_SAMPLE_BYTES]

    assert compressed == [(first("train"), first("val"))] and len(first("val")) == COMPRESSOR_SAMPLE_BYTES
    assert data.meta["compressor_bpb"] == bounds(first("train"), first("val"))


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_the_tokenizers_progress_expects_the_text_it_will_read(tmp_path, monkeypatch, kind):
    """BPE learns from the training documents only (the held-out ones would leak into the
    vocabulary), the char vocabulary from all of them: the progress expects that much, and BPE
    says when its reading ends and its merges begin (the part with no progress to show)."""
    from nanolm.data.progress import expected_text_bytes, megabytes

    docs = [f"{i:05d} " + "the quick brown fox jumps over the lazy dog. " * 12 for i in range(2000)]
    source = _write_txt(tmp_path / "m.txt", docs)
    monkeypatch.setattr(progress_mod, "PROGRESS_MIN_BYTES", 0)  # shown as for a larger corpus
    said = []
    prepare(
        source,
        tmp_path / "p",
        kind,
        vocab_size=300,
        val_fraction=0.5,
        progress="lines",
        log=said.append,
        compressor_sample_bytes=0,
    )
    expected = expected_text_bytes(DocumentSource(source, sources_mod.SEPARATOR, "text"))
    reads = expected if kind == "char" else round(expected * 0.5)
    assert said[0] == f"prepare: training the {kind} tokenizer ({megabytes(reads)} expected)"
    merges = [line for line in said if line.endswith("; computing its merges")]
    assert len(merges) == (kind == "bpe") and all(line.startswith("prepare: the tokenizer read ") for line in merges)
    assert said[1 + len(merges)].startswith("prepare: tokenizer trained in ")
    assert f"prepare: encoding ({megabytes(expected)} expected)" in said


@pytest.mark.parametrize("vocab_size, dtype", [(1 << 16, "uint16"), ((1 << 16) + 1, "uint32")])
def test_shards_hold_each_token_id_in_the_smallest_integer_that_holds_every_id(tmp_path, vocab_size, dtype):
    """Ids run from 0 to vocab_size - 1: 65,536 of them fit 16 bits, one more does not (an id that
    wrapped around would silently be another token)."""
    from nanolm.tokenizer import train_char

    chars = [chr(c) for c in range(0x4E00, 0x30000) if chr(c).isprintable() and not chr(c).isspace()][: vocab_size - 1]
    text = "".join(chars)
    tokenizer = train_char([text])
    assert tokenizer.vocab_size == vocab_size  # every character and the document token
    docs = [text[i : i + 4096] for i in range(0, len(text), 4096)]
    (tmp_path / "many.txt").write_text(f"\n{EOS}\n".join(docs), encoding="utf-8")  # no line end: not in the vocabulary
    data = prepare(
        tmp_path / "many.txt", tmp_path / "p", tokenizer=tokenizer, progress=False, compressor_sample_bytes=0
    )
    assert data.meta["dtype"] == dtype and data.meta["max_id"] == vocab_size - 1
    assert "".join(_decode_split(data, "train") + _decode_split(data, "val")) == "".join(
        docs[i] for i in range(len(docs)) if i % 10 != 9
    ) + "".join(docs[i] for i in range(9, len(docs), 10))


def test_bpe_learns_from_the_training_documents_up_to_its_budget_and_the_char_vocabulary_from_all(monkeypatch):
    import nanolm.data.prepare as prepare_mod

    monkeypatch.setattr(prepare_mod, "BPE_TRAINING_CHARS", 1000)
    docs = [f"{i:03d}" + "x" * 97 for i in range(40)]  # 100 characters each: the budget ends exactly at a document
    train_docs = [d for i, d in enumerate(docs) if i % 10 != 9]
    assert list(prepare_mod._tokenizer_texts(iter(docs), "bpe", 0.1)) == train_docs[:10]
    assert list(prepare_mod._tokenizer_texts(iter(docs), "char", 0.1)) == docs  # held-out characters included
    monkeypatch.setattr(prepare_mod, "BPE_TRAINING_CHARS", 1001)
    assert list(prepare_mod._tokenizer_texts(iter(docs), "bpe", 0.1)) == train_docs[:11]


def test_prepare_shows_a_bar_on_a_terminal_and_lines_elsewhere(tmp_path, monkeypatch):
    import sys

    import nanolm.data.prepare as prepare_mod

    shown = []

    class Recorded(prepare_mod.PrepareProgress):
        def __init__(self, mode, log):
            shown.append(mode)
            super().__init__(None, log)

    monkeypatch.setattr(prepare_mod, "PrepareProgress", Recorded)
    monkeypatch.setattr(progress_mod, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    source = _write_txt(tmp_path / "d.txt", DOCS * 4)
    prepare(source, tmp_path / "a", "char", progress=True, log=print, compressor_sample_bytes=0)
    prepare(source, tmp_path / "b", "char", progress=True, log=lambda *_: None, compressor_sample_bytes=0)
    assert shown == ["bar", "lines"]


def test_prepare_called_with_its_defaults_makes_what_nanolm_prepare_makes(tmp_path, monkeypatch):
    """The library's defaults are the command's: BPE of 512 tokens, 10 % held out, statistics at a
    window of 256 tokens, progress shown (for a corpus big enough to need it)."""
    docs = [f"{i:04d} " + "the quick brown fox jumps over the lazy dog. " * 8 for i in range(300)]
    monkeypatch.setattr(progress_mod, "PROGRESS_MIN_BYTES", 0)  # shown as for a larger corpus
    said = []
    data = prepare(_write_txt(tmp_path / "d.txt", docs), tmp_path / "p", log=said.append)
    m = data.meta
    assert (m["tokenizer"], m["vocab_size"], m["val_fraction"], m["seq_len_for_stats"]) == ("bpe", 512, 0.1, 256)
    assert m["splits"]["val"]["documents"] == 30 and said and said[0].startswith("prepare: training the bpe tokenizer")


def test_prepare_into_a_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "out").write_text("mine")
    with pytest.raises(NanolmError, match=rf"^--out {tmp_path / 'out'} is a file; give a directory for the shards$"):
        prepare(_write_txt(tmp_path / "d.txt", DOCS), tmp_path / "out", "char", progress=False)
    assert (tmp_path / "out").read_text() == "mine"


def test_a_runs_data_is_prepared_with_its_progress_option_and_says_so_through_its_log(tmp_path, monkeypatch):
    from nanolm.data.prepare import load_training_data
    from nanolm.run.config import RunConfig

    monkeypatch.setattr(progress_mod, "PROGRESS_MIN_BYTES", 0)  # shown as for a larger corpus
    source = _write_txt(tmp_path / "d.txt", DOCS * 8)
    for progress, shown in (("lines", True), (False, False)):
        cfg = RunConfig()
        cfg.data.data, cfg.data.tokenizer, cfg.train.progress = str(source), "char", progress
        said = []
        scratch = tmp_path / f"s{progress}"
        scratch.mkdir()
        load_training_data(cfg, scratch, log=said.append, compressor_bounds=False)
        assert said[0] == f"data: {source}"
        assert any(line.startswith("prepare: training the char tokenizer") for line in said) is shown, said
        trained = [line for line in said if line.startswith("prepare: tokenizer trained in ")]
        assert all(re.match(r"prepare: tokenizer trained in \d+\.\ds \(char, \d+ tokens\)$", t) for t in trained)


def test_a_run_on_a_corpus_name_says_what_it_downloads_through_its_log(tmp_path, monkeypatch):
    import urllib.error
    import urllib.request

    from nanolm.data.download import CORPORA
    from nanolm.data.prepare import load_training_data
    from nanolm.run.config import RunConfig

    monkeypatch.setenv("NANOLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # no local path of that name

    def offline(*_, **__):
        raise urllib.error.URLError("offline")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / CORPORA["shakespeare"].filename).write_text("not the corpus")
    cfg = RunConfig()
    cfg.data.data = "shakespeare"
    said = []
    with pytest.raises(NanolmError, match="could not download shakespeare"):
        load_training_data(cfg, tmp_path, log=said.append)
    assert said[0].startswith("cached ") and said[0].endswith(
        "does not match the expected size/checksum; downloading it again"
    )
    assert said[1] == f"downloading shakespeare from {CORPORA['shakespeare'].url}"


def test_a_failed_encoding_reaches_the_user_as_itself_even_when_closing_its_shards_fails_too(tmp_path, monkeypatch):
    """The shards are closed before the scratch directory goes; a close that fails too (the same
    full disk) must not replace the error the user needs to see."""
    import errno

    import nanolm.data.prepare as prepare_mod

    class FailingClose:
        def __init__(self, f):
            self.f = f

        def close(self):
            self.f.close()
            raise OSError(errno.ENOSPC, "No space left on device")

    def disk_fills(docs, tokenizer, writers, *_):
        for w in writers.values():
            w.f = FailingClose(w.f)
        raise OSError(errno.ENOSPC, "No space left on device", "train.bin")

    monkeypatch.setattr(prepare_mod, "_encode", disk_fills)
    with pytest.raises(OSError) as raised:
        prepare(_write_txt(tmp_path / "d.txt", DOCS), tmp_path / "p", "char", progress=False)
    assert raised.value.errno == errno.ENOSPC and not (tmp_path / "p").exists()


def _resident_kb_of_mapping(path) -> int:
    """Resident kilobytes of this process's mappings of ``path`` (Linux's /proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the resident pages from Linux's /proc")
def test_the_training_windows_leave_no_page_of_the_shard_mapped(tmp_path):
    """A run's resident memory must not grow with its corpus: the windows are copied out of the
    memory-mapped shard, and the pages they touched (and the runs of cached pages the kernel maps
    around them) are unmapped again, step after step."""
    path = tmp_path / "train.bin"
    np.arange(4_000_000, dtype=np.uint16).tofile(path)  # 8 MB, in the page cache
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    batches = TrainBatches(tokens, WindowSampler(len(tokens), 64, 8), 64, eos_id=0)
    for step in range(20):
        batches.next(step)
    assert _resident_kb_of_mapping(path) == 0
    int(tokens[::2048].sum())  # reading maps pages, and the measure sees them
    assert _resident_kb_of_mapping(path) > 0
