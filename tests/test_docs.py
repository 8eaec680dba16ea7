"""The docs point at things that exist, and hold no placeholder.

A document that names a test that was renamed, a module that moved or a file that is gone
sends a student the wrong way; a placeholder left in a doc is a promise nobody kept. These
checks read README.md and docs/*.md as text.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _test_names() -> set[str]:
    names = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(node.name)
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_doc_names_exists(doc):
    missing = [m for m in re.findall(r"\b((?:nanolm|tests|tools|benchmarks|configs|docs)/[\w./-]+\.(?:py|md|toml|sh))",
                                     _text(doc)) if not (ROOT / m).exists()]
    assert not missing, f"{doc.name} names files that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_test_a_doc_names_exists(doc):
    names = _test_names()
    missing = [n for n in re.findall(r"`(test_[a-z0-9_]+)`", _text(doc)) if n not in names]
    assert not missing, f"{doc.name} names tests that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_module_a_doc_names_exists(doc):
    missing = []
    for dotted in re.findall(r"`(nanolm(?:\.\w+)+)", _text(doc)):
        parts = dotted.split(".")
        for end in range(len(parts), 1, -1):  # nanolm.train.train: the module is nanolm/train.py
            base = ROOT.joinpath(*parts[:end])
            if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
                break
        else:
            missing.append(dotted)
    assert not missing, f"{doc.name} names modules that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_doc_holds_a_placeholder(doc):
    text = _text(doc)
    alone = [line for line in text.splitlines() if re.fullmatch(r"\s*[A-Z][A-Z0-9]*_[A-Z0-9_]+\s*", line)]
    markers = re.findall(r"\b(TODO|TBD|FIXME|XXX)\b", text)
    assert not alone and not markers, f"{doc.name}: placeholders {alone + markers}"
