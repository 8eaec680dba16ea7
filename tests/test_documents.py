"""The guarded readers of nanolm/base/documents.py at their limits: the largest integer, the deepest
nesting and the largest file accepted and the first refused, each refusal's one line, and which
lines of a JSON-lines log count as damage. test_hostile_files.py throws generated documents at
every reader; these tests pin each limit to its exact value."""

import json
import os

import pytest

from nanolm.base.documents import (
    LARGEST_INTEGER,
    MAX_NESTING,
    parse_json,
    parse_toml,
    read_json,
    read_jsonl,
    read_toml,
)
from nanolm.errors import NanolmError


def _nested(depth: int, leaf="1", open_="[", close="]") -> str:
    return open_ * depth + leaf + close * depth


def test_integers_are_read_up_to_64_bits_and_one_past_is_named_with_its_size():
    assert parse_json(str(LARGEST_INTEGER - 1), "f") == 2**63 - 1
    assert parse_json(str(-LARGEST_INTEGER), "f") == -(2**63)
    with pytest.raises(NanolmError) as e:
        parse_json(str(LARGEST_INTEGER), "f")
    assert str(e.value) == "f holds an integer of 65 bits (nanolm writes 64-bit integers); the file is damaged"
    with pytest.raises(NanolmError) as e:
        parse_json(f'[{{"a": {-LARGEST_INTEGER - 1}}}]', "f")
    assert str(e.value) == "f holds an integer of 65 bits (nanolm writes 64-bit integers); the file is damaged"
    with pytest.raises(NanolmError) as e:
        parse_toml(f"x = 0x{'f' * 40}", "g")
    assert str(e.value) == "g holds an integer of 161 bits (nanolm writes 64-bit integers)"
    assert parse_json("[true, false, null, 1.5e308]", "f") == [True, False, None, 1.5e308]
    for siblings in (f"[{2**64}, 1]", f"[{2**64}, null]", f"[{2**64}, true]", f'[{2**64}, "x", 2.5]'):
        with pytest.raises(NanolmError, match="an integer of 66 bits"):  # found whatever comes before or after it
            parse_json(siblings, "f")


def test_nesting_is_read_to_its_limit_and_one_level_deeper_is_refused():
    assert parse_json(_nested(MAX_NESTING), "f") is not None
    assert parse_json(_nested(MAX_NESTING, leaf="1", open_='{"a":', close="}"), "f") is not None
    for open_, close in (("[", "]"), ('{"a":', "}")):
        with pytest.raises(NanolmError) as e:
            parse_json(_nested(MAX_NESTING + 1, open_=open_, close=close), "f")
        assert str(e.value) == "f holds values nested more than 64 levels deep; the file is damaged"
    assert parse_json(_nested(MAX_NESTING - 2, leaf='[1, [2], {"b": 3}]'), "f") is not None  # siblings at the limit
    with pytest.raises(NanolmError, match="nested more than 64"):  # a deep branch after a shallow one
        parse_json("[[1], " + _nested(MAX_NESTING) + "]", "f")
    with pytest.raises(NanolmError, match="nested more than 64"):
        parse_toml("x = " + _nested(MAX_NESTING + 1), "g")


def test_each_way_a_document_fails_to_parse_is_one_line_naming_it():
    cases = [
        (lambda: parse_json(b'{"a": \xff}', "meta.json"), "meta.json is not UTF-8 text (byte 6); the file is damaged"),
        (
            lambda: parse_json('{"a": }', "meta.json"),
            "meta.json is not valid JSON (Expecting value: line 1 column 7 (char 6)); the file is damaged",
        ),
        (
            lambda: parse_json(_nested(100_000), "meta.json"),
            "meta.json nests its values deeper than Python can parse; the file is damaged",
        ),
        (
            lambda: parse_json("1" * 5000, "meta.json"),
            "meta.json holds a value Python cannot read (Exceeds the limit (4300 digits) for integer string conversion: "
            "value has 5000 digits); the file is damaged",
        ),
        (
            lambda: parse_toml("x = ", "config.toml"),
            "config.toml is not valid TOML (Invalid value (at end of document))",
        ),
    ]
    for call, message in cases:
        with pytest.raises(NanolmError) as e:
            call()
        assert str(e.value) == message


def test_a_metadata_file_is_read_up_to_its_size_limit_and_only_if_it_is_a_regular_file(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text(json.dumps({"a": "x" * 90}))
    size = path.stat().st_size
    assert read_json(path, max_bytes=size) == {"a": "x" * 90}
    with pytest.raises(NanolmError) as e:
        read_json(path, "meta", max_bytes=size - 1)
    assert str(e.value) == "meta is 0 MiB, far larger than any such file nanolm writes; the file is damaged"
    (tmp_path / "big.json").write_bytes(b" " * (3 << 20))
    with pytest.raises(NanolmError) as e:
        read_json(tmp_path / "big.json", "final.json", max_bytes=1 << 20)
    assert str(e.value) == "final.json is 3 MiB, far larger than any such file nanolm writes; the file is damaged"
    path.write_text("{bad")
    with pytest.raises(NanolmError) as e:
        read_json(path, "the run's meta.json")  # a parse error names the file as the size check does
    assert str(e.value).startswith("the run's meta.json is not valid JSON (")
    with pytest.raises(NanolmError) as e:
        read_json(path)  # named by its path when no name is given
    assert str(e.value).startswith(f"{path} is not valid JSON (")
    with pytest.raises(NanolmError) as e:
        read_json(tmp_path / "missing.json")
    assert str(e.value) == f"{tmp_path / 'missing.json'} cannot be read (No such file or directory)"

    def unreadable(self):
        raise PermissionError(13, "Permission denied", str(self))

    with pytest.MonkeyPatch.context() as m:  # a file its owner may not read (root reads any: a stand-in)
        m.setattr(type(path), "read_bytes", unreadable)
        with pytest.raises(NanolmError) as e:
            read_json(path, "meta.json")
    assert str(e.value) == "meta.json cannot be read (Permission denied)"
    with pytest.raises(NanolmError) as e:
        read_toml(tmp_path)
    assert str(e.value) == f"{tmp_path} is a directory, not a file"
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(NanolmError) as e:
            read_json(tmp_path / "fifo", "the pipe")  # refused before it is opened: reading would block
        assert str(e.value) == "the pipe is a pipe or a device, not a file"


def test_a_toml_file_that_is_not_utf8_is_named_by_its_first_bad_byte(tmp_path):
    (tmp_path / "config.toml").write_bytes(b'x = 1\ny = "\xe9"\n')
    with pytest.raises(NanolmError) as e:
        read_toml(tmp_path / "config.toml")
    assert str(e.value) == f"{tmp_path / 'config.toml'} is not valid TOML: it is not UTF-8 text (byte 11)"
    (tmp_path / "ok.toml").write_text("[train]\nsteps = 3\n")
    (tmp_path / "bad.toml").write_text("[train\n")
    with pytest.raises(NanolmError) as e:
        read_toml(tmp_path / "bad.toml", "the config")
    assert str(e.value).startswith("the config is not valid TOML (")
    assert read_toml(tmp_path / "ok.toml", "the config") == {"train": {"steps": 3}}


def test_a_half_written_last_line_is_not_damage_and_every_other_bad_line_is(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"step": 1}).encode()
    path.write_bytes(good + b"\n\n   \n" + b"{broken\n" + b"\xff\xfe\n" + good + b"\n" + b'{"step": 2, "lo')
    rows, damaged = read_jsonl(path)
    assert rows == [{"step": 1}, {"step": 1}] and damaged == 2  # the cut-off last line is a crash or a live run
    path.write_bytes(good + b"\n{broken\n")
    assert read_jsonl(path) == ([{"step": 1}], 1)  # a bad last line with its newline was written whole: damage
    path.write_bytes(b"{broken")
    assert read_jsonl(path) == ([], 0)
