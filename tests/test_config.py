"""A run's configuration survives its own file.

A run writes its resolved configuration to ``config.toml`` and reads it back on every resume,
``compare``, ``diagnose`` and ``sample``. Any value the options accept must therefore come back
from that file exactly as it went in: a value TOML cannot hold (a carriage return in a path, an
integer past 64 bits) used to be written anyway, and the run could not be continued
("holds a run whose configuration cannot be read").
"""

import dataclasses
import math
import tempfile
from pathlib import Path

import pytest
from conftest import tiny_run_config
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolm.errors import NanolmError
from nanolm.run.config import SECTIONS, RunConfig, _field_type, load_toml

_VALUES = {
    bool: st.booleans(),
    int: st.integers(-(2**63), 2**63 - 1),
    float: st.floats(allow_nan=True, allow_infinity=True),
    str: st.text(st.characters(exclude_categories=("Cs",)), max_size=16),  # any character a str can hold in UTF-8
}


@st.composite
def configs(draw) -> RunConfig:
    """A RunConfig with any value of its type in each option (most of them would not pass
    validation: the file format must hold them all the same)."""
    sections = {}
    for name, cls in SECTIONS.items():
        values = {
            f.name: draw(_VALUES[_field_type(f)]) for f in dataclasses.fields(cls) if draw(st.booleans())
        }  # about half left at their default
        sections[name] = cls(**values)
    return RunConfig(**sections)


def _same(a, b) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or (
        a == b and type(a) is type(b)
    )


@settings(max_examples=200, deadline=None)
@given(cfg=configs())
def test_a_config_round_trips_through_its_toml_file_for_any_values(cfg):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(cfg.to_toml(), encoding="utf-8")
        values = load_toml(path)
    back = RunConfig(**{s: SECTIONS[s](**values.get(s, {})) for s in SECTIONS})
    for section in SECTIONS:
        for f in dataclasses.fields(SECTIONS[section]):
            written, read = getattr(getattr(cfg, section), f.name), getattr(getattr(back, section), f.name)
            assert _same(written, read), f"[{section}] {f.name}: wrote {written!r}, read back {read!r}"


@pytest.mark.parametrize("separator", ["<|end\roftext|>", "<|end\x1boftext|>", "<|end\x7foftext|>"])
def test_a_separator_with_a_control_character_is_written_as_an_escape(separator, tmp_path):
    cfg = tiny_run_config(tmp_path / "d.txt", tmp_path / "run")
    cfg.data.separator = separator
    text = cfg.to_toml()
    assert separator not in text
    (tmp_path / "config.toml").write_text(text, encoding="utf-8")
    assert load_toml(tmp_path / "config.toml")["data"]["separator"] == separator


@pytest.mark.parametrize(
    "option,section", [("steps", "train"), ("seed", "train"), ("vocab_size", "data"), ("spike_window", "guard")]
)
def test_an_integer_option_past_64_bits_is_refused_before_a_run_writes_it(option, section, tmp_path):
    """Its config.toml could not be read back: TOML's integers are 64-bit."""
    cfg = tiny_run_config(tmp_path / "d.txt", tmp_path / "run")
    setattr(getattr(cfg, section), option, 2**63)
    with pytest.raises(NanolmError, match=f"--{option.replace('_', '-')} must be"):
        cfg.resolved()


def test_the_largest_integer_toml_holds_is_accepted(tmp_path):
    cfg = tiny_run_config(tmp_path / "d.txt", tmp_path / "run", steps=2**63 - 1)
    assert cfg.resolved().train.steps == 2**63 - 1
