"""Reading documents at their edges: the long-document cut, separator lines, the validation split,
the byte split of a single document, the file types and their error messages.

The middle of each reader is tested in test_data.py through ``prepare``; these tests hold each
rule exactly where it changes its answer (a document exactly ``MAX_DOC_CHARS`` long, a cut on a
multi-byte character, k documents where k - 1 gave none to validation), mostly as properties
checked against a second, plainer statement of the rule.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import nanolm.data.sources as sources_mod
from nanolm.data.published import SUPPORTED
from nanolm.data.sources import DocumentSource, split_documents, split_single_document
from nanolm.errors import NanolmError
from nanolm.tokenizer import EOS

_CONTENT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\r\n\x00"), max_size=8)
# lines that are a separator, and lines that only look like one (a separator line holds exactly it)
_LINE = st.one_of(_CONTENT, st.sampled_from([EOS, EOS + " ", " " + EOS, EOS + "X", "X" + EOS, EOS + "\t"]))


def _documents_by_the_rule(lines: list[str], line_break: str, final_break: bool, max_chars: int) -> list[str]:
    """The documents a .txt file should give, stated in two plain steps: the lines between separator
    lines form a document (the break before a separator belongs to the separator), and a document
    is cut after the first line at which it reaches ``max_chars``, again and again."""
    groups, current = [], []
    for line in lines:
        if line == EOS:
            groups.append((current, True))
            current = []
        else:
            current.append(line)
    groups.append((current, False))
    documents = []
    for index, (group, before_separator) in enumerate(groups):
        last_group = index == len(groups) - 1
        texts = [
            line + (line_break if not (last_group and i == len(group) - 1 and not final_break) else "")
            for i, line in enumerate(group)
        ]
        piece = ""
        for text in texts:
            piece += text
            if len(piece) >= max_chars:
                documents.append(piece)
                piece = ""
        documents.append(piece[: -len(line_break)] if before_separator and piece.endswith(line_break) else piece)
    return documents


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(_LINE, min_size=1, max_size=14),
    line_break=st.sampled_from(["\n", "\r\n", "\r"]),
    final_break=st.booleans(),
    max_chars=st.integers(1, 24),
)
@example(lines=["abcd", "abcd", "abcd"], line_break="\n", final_break=True, max_chars=10)  # exactly at the limit
@example(lines=["abcd", "abcd", "abcd"], line_break="\n", final_break=True, max_chars=11)  # one short of it
def test_a_text_file_is_cut_at_separator_lines_and_after_the_line_reaching_the_length_limit(
    lines, line_break, final_break, max_chars
):
    text = line_break.join(lines) + (line_break if final_break else "")
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(sources_mod, "MAX_DOC_CHARS", max_chars):
        path = Path(tmp) / "d.txt"
        path.write_bytes(text.encode("utf-8"))
        got = list(sources_mod._txt_documents(path, EOS))
    assert got == _documents_by_the_rule(lines, line_break, final_break, max_chars)


def _boundaries(text: str) -> list[int]:
    """The byte offsets at which a character of ``text`` starts, and its end."""
    offsets, at = [0], 0
    for ch in text:
        at += len(ch.encode("utf-8"))
        offsets.append(at)
    return offsets


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
    val_fraction=st.floats(0.0, 0.99, allow_nan=False),
)
@example(text="", val_fraction=0.1)
@example(text="é", val_fraction=0.5)  # the cut lands on the second byte of the first character
@example(text="a€", val_fraction=0.25)  # three bytes back from inside a 3-byte character
def test_a_single_document_splits_at_the_last_character_boundary_before_its_validation_share(text, val_fraction):
    data = text.encode("utf-8")
    target = int(len(data) * (1 - val_fraction))
    cut = max(b for b in _boundaries(text) if b <= target)
    assert split_single_document(text, val_fraction) == (data[:cut].decode("utf-8"), data[cut:].decode("utf-8"))


def _splits_by_the_rule(docs: list[str], val_fraction: float) -> list[tuple[str, str]]:
    """Every k-th document (k = round(1 / val_fraction), at least 2) goes to validation; with none
    so chosen (fewer than k documents), the last one does; a lone document is split by bytes."""
    if not docs:
        return []
    if len(docs) == 1:
        if val_fraction == 0:
            return [("train", docs[0])]
        train, val = split_single_document(docs[0], val_fraction)
        return [("train", train)] + ([("val", val)] if val else [])
    if val_fraction == 0:
        return [("train", d) for d in docs]
    k = max(2, round(1 / val_fraction)) if val_fraction > 1e-300 else None  # tinier: k beyond any corpus
    held = [k is not None and i % k == k - 1 for i in range(len(docs))]
    if not any(held):
        held[-1] = True
    return [("val" if h else "train", d) for h, d in zip(held, docs)]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 25),
    val_fraction=st.one_of(
        st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.5, 0.6, 0.9]), st.floats(0.0, 0.99, allow_nan=False)
    ),
)
@example(n=1, val_fraction=0.0)  # one document and no validation: all of it trains
@example(n=1, val_fraction=1e-9)  # a cut at the very end of the document (it raised IndexError)
@example(n=2, val_fraction=5e-324)  # 1 / val_fraction is inf (it raised OverflowError)
@example(n=130, val_fraction=5e-324)  # k is past any corpus, not a small number standing in for infinity
@example(n=3, val_fraction=0.1)  # fewer documents than k: the last one validates
@example(n=4, val_fraction=0.5)  # k = 2: every second document
def test_every_kth_document_is_held_out_in_order_and_some_document_always_validates(n, val_fraction):
    docs = [f"document {i}: {'ab' * i}" for i in range(n)]
    got = list(split_documents(iter(docs), val_fraction))
    assert got == _splits_by_the_rule(docs, val_fraction)


def test_a_lone_document_without_a_validation_share_trains_whole():
    assert list(split_documents(iter(["é" * 10]), 0.0)) == [("train", "é" * 10)]
    assert list(split_documents(iter([""]), 0.3)) == [("train", "")]


# ------------------------------------------------------------------ JSON lines


def test_a_bad_json_line_is_named_by_its_place_and_its_fault_alone(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"text": "a"}),
                "{broken",
                "[" * 100 + "]" * 100,
                '{"text": ' + "1" * 5000 + "}",
                json.dumps({"text": "b"}),
            ]
        )
        + "\n"
    )
    source = DocumentSource(path)
    assert list(source) == ["a", "b"]
    assert (
        source.problems[0] == f"{path}:2: is not valid JSON (Expecting property name enclosed in double quotes: "
        f"line 1 column 2 (char 1))"
    )
    assert source.problems[1] == f"{path}:3: holds values nested more than 64 levels deep"
    assert source.problems[2].startswith(f"{path}:4: holds a value Python cannot read (")
    assert all("the file" not in p for p in source.problems)


def test_a_blank_line_in_a_jsonl_file_is_skipped_and_reading_goes_on(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n\n   \n" + json.dumps({"text": "b"}) + "\n")
    source = DocumentSource(path)
    assert list(source) == ["a", "b"] and source.problems == []


# ------------------------------------------------------------------ Parquet


def test_parquet_reads_the_text_column_wherever_it_stands(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": list(range(3)), "text": ["one", None, "three"]}), tmp_path / "d.parquet")
    assert list(DocumentSource(tmp_path / "d.parquet")) == ["one", "three"]


def test_parquet_problems_are_one_line_naming_the_file_and_the_fix(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": [1], "body": ["x"]}), tmp_path / "cols.parquet")
    with pytest.raises(NanolmError) as e:
        list(DocumentSource(tmp_path / "cols.parquet"))
    assert str(e.value) == f"{tmp_path / 'cols.parquet'} has no column 'text' (columns: id, body); set --text-field"
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(NanolmError, match=r"bad\.parquet is not a readable parquet file \("):
        list(DocumentSource(tmp_path / "bad.parquet"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(NanolmError) as e:
        list(DocumentSource(tmp_path / "cols.parquet"))
    assert str(e.value) == "reading .parquet needs pyarrow: pip install 'nanolm[parquet]'"


# ------------------------------------------------------------------ paths, types, bytes


@pytest.mark.parametrize("name", ["notes.md", "story.text", "README"])
def test_markdown_plain_text_and_suffixless_files_are_read_as_text(tmp_path, name):
    (tmp_path / name).write_text(f"first\n{EOS}\nsecond\n")
    assert list(DocumentSource(tmp_path / name)) == ["first", "second\n"]


def test_an_unsupported_file_type_is_named_with_the_types_nanolm_reads(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(NanolmError) as e:
        DocumentSource(tmp_path / "d.csv")
    assert str(e.value) == f"{tmp_path / 'd.csv'}: unsupported file type '.csv'; use {SUPPORTED}"


def test_a_directory_without_text_files_is_named(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.csv").write_text("x")
    with pytest.raises(NanolmError) as e:
        DocumentSource(tmp_path / "d")
    assert str(e.value) == f"directory {tmp_path / 'd'} holds no corpus shards ({SUPPORTED})"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are a POSIX thing")
def test_a_pipe_is_refused_because_nanolm_reads_its_data_twice(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(
        NanolmError, match=r"fifo is a pipe or a device, which can be read only once.*command > data\.txt"
    ):
        DocumentSource(tmp_path / "fifo")


def test_a_directory_counts_the_bytes_of_its_text_files_only(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("12345")
    (tmp_path / "d" / "sub" / "b.txt").write_text("123")
    (tmp_path / "d" / "skip.csv").write_text("1234567")
    source = DocumentSource(tmp_path / "d")
    assert source.size_bytes() == 8 and list(source) == ["12345", "123"]


def test_a_source_counts_nothing_skipped_before_it_is_read(tmp_path):
    (tmp_path / "d.txt").write_text(f"a\n{EOS}\n \n{EOS}\nb")
    source = DocumentSource(tmp_path / "d.txt")
    assert source.empty == 0 and source.problems == []
    assert list(source) == ["a", "b"] and source.empty == 1


def test_a_nul_byte_is_named_in_the_head_and_beyond_it_at_its_line(tmp_path):
    head = sources_mod.BINARY_SNIFF_BYTES
    line = "x" * 99 + "\n"  # 100 bytes a line
    for at, message in [(head - 1, "it contains NUL bytes"), (head, f"line {head // 100 + 1} contains a NUL byte")]:
        text = bytearray((line * (head // 100 + 20)).encode())
        text[at] = 0
        (tmp_path / "d.txt").write_bytes(bytes(text))
        with pytest.raises(NanolmError, match=message):
            list(DocumentSource(tmp_path / "d.txt"))


def test_text_is_read_as_utf8_whatever_the_locale(tmp_path):
    """Windows and a C locale would read a file as cp1252 or ASCII if nanolm let them choose."""
    (tmp_path / "d.txt").write_text(f"Ünïcödé — 日本\n{EOS}\nzwei\n", encoding="utf-8")
    assert list(DocumentSource(tmp_path / "d.txt")) == ["Ünïcödé — 日本", "zwei\n"]  # here, and under a C locale:
    code = "import sys; from nanolm.data.sources import DocumentSource; print(ascii(list(DocumentSource(sys.argv[1]))))"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": "ascii"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "d.txt")], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ascii(["Ünïcödé — 日本", "zwei\n"])
