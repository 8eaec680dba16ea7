"""The docs point at things that exist, and hold no placeholder.

A document that names a test that was renamed, a module that moved or a file that is gone
sends a student the wrong way; a placeholder left in a doc is a promise nobody kept. These
checks read README.md, CONTRIBUTING.md and docs/*.md as text.

The docs also keep a word budget: a page a user reads holds the conclusion, the figure they need
and the command that reproduces it; how each figure was measured lives in dev/, the lab notebook,
which has no budget. Words are counted as ``wc -w`` counts them (whitespace-separated tokens).
"""

import argparse
import ast
import functools
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS_WORD_BUDGET = 28_000  # every markdown file under docs/, together
README_WORD_BUDGET = 2_000


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)  # every page asks: the suite's files are parsed once
def _test_names() -> frozenset[str]:
    names = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(node.name)
    return frozenset(names)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_doc_names_exists(doc):
    missing = [
        m
        for m in re.findall(
            r"\b((?:nanolm|tests|tools|benchmarks|configs|docs)/[\w./-]+\.(?:py|md|toml|sh))", _text(doc)
        )
        if not (ROOT / m).exists()
    ]
    assert not missing, f"{doc.name} names files that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_test_a_doc_names_exists(doc):
    names = _test_names()
    missing = [n for n in re.findall(r"`(test_[a-z0-9_]+)`", _text(doc)) if n not in names]
    assert not missing, f"{doc.name} names tests that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_test_a_doc_names_with_its_file_is_in_that_file(doc):
    """`tests/test_model.py::test_model_is_causal` is a command a student copies: the test must be
    in the file the doc puts it in, not only somewhere in the suite."""
    wrong = []
    for file, name in re.findall(r"`(tests/test_\w+\.py)::(test_\w+)`", _text(doc)):
        path = ROOT / file
        defined = (
            {n.name for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.FunctionDef)}
            if path.is_file()
            else set()
        )
        if name not in defined:
            wrong.append(f"{file}::{name}")
    assert not wrong, f"{doc.name} puts tests in files that do not hold them: {sorted(set(wrong))}"


def test_the_course_gives_each_test_with_its_file():
    text = _text(ROOT / "docs" / "course.md")
    bare = re.findall(r"`(test_[a-z0-9_]+)`", text)
    assert not bare and len(re.findall(r"`tests/test_\w+\.py::test_\w+`", text)) >= 30, bare


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


def test_the_worked_example_of_the_course_runs_as_written(capsys):
    """docs/course.md's per-token vs per-example example: its code, run here, prints what the doc shows."""
    text = _text(ROOT / "docs" / "course.md")
    after = text.split("<!-- worked example:", 1)[1]
    code = re.search(r"```python\n(.*?)```", after, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", after, re.S).group(1)
    exec(compile(code, "docs/course.md", "exec"), {"__name__": "course_example"})
    assert capsys.readouterr().out == shown


def _doc_commands(text: str) -> list[list[str]]:
    """The ``nanolm ...`` commands a doc shows, as argument lists.

    In shell blocks: continuation lines joined, comments dropped, one command per
    ``&&``/``;``/``|`` segment; ``python -m nanolm`` and ``torchrun ... -m nanolm`` count too.
    In the prose, inline spans such as `nanolm replay RUN --step N` are synopses: their
    upper-case metavariables become ``1`` (which every option type accepts), ``SAME_FLAGS``
    goes, and ``a|b`` takes its first choice. A bare command name is a reference, not a
    command, and is checked as a name only.
    """
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.lstrip("$ "), comments=True)
            segment: list[str] = []
            for word in words + [";"]:
                if word not in ("&&", "||", ";", "|"):
                    segment.append(word)
                    continue
                while segment and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", segment[0]):  # OMP_NUM_THREADS=1 nanolm ...
                    segment.pop(0)
                if segment[:1] == ["nanolm"]:
                    commands.append(segment[1:])
                elif "-m" in segment and segment[segment.index("-m") + 1 :][:1] == ["nanolm"]:
                    commands.append(segment[segment.index("-m") + 2 :])
                segment = []
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`nanolm ([^`]+)`", prose):
        words = [w.split("|")[0] for w in shlex.split(span) if w != "SAME_FLAGS"]
        commands.append([re.sub(r"^[A-Z][A-Z0-9_]*$", "1", w) for w in words])
    return commands


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_nanolm_command_in_the_docs_parses(doc, capsys):
    """A command copied from the docs must at least be one the CLI accepts: a renamed option or a
    command that moved would otherwise fail only in a student's terminal."""
    from nanolm.instruments.cli import build_parser

    parser = build_parser()
    names = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    bad = []
    for argv in _doc_commands(_text(doc)):
        if "--help" in argv or "-h" in argv:
            continue
        if len(argv) == 1 and not argv[0].startswith("-"):
            if argv[0] not in names:
                bad.append(f"nanolm {argv[0]} (no such command)")
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            bad.append("nanolm " + " ".join(argv) + ": " + capsys.readouterr().err.strip().splitlines()[-1])
    assert not bad, f"{doc.name}: commands the CLI refuses: {bad}"


def test_the_runbooks_and_the_course_show_commands_to_check():
    """The parse check above is only worth something if it finds the commands."""
    runbooks = [c[0] for c in _doc_commands(_text(ROOT / "docs" / "runbooks.md"))]
    course = [c[0] for c in _doc_commands(_text(ROOT / "docs" / "course.md"))]
    assert {"train", "diagnose", "replay", "doctor"} <= set(runbooks) and len(runbooks) >= 20
    assert {"train", "doctor", "diagnose", "lab", "report", "prepare"} <= set(course) and len(course) >= 10


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped,
    spaces as hyphens (so "`nanolm lab`: break it" is #nanolm-lab-break-it)."""
    text = re.sub(r"```.*?```", "", _text(path), flags=re.S)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#{1,6} (.+)$", text, re.M)
    }


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_between_the_docs_lands_on_a_heading(doc):
    broken = []
    for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?#([\w-]+)\)", _text(doc)):
        path = (doc.parent / target) if target else doc
        if not path.is_file() or anchor not in _anchors(path):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{doc.name} links to headings that do not exist: {broken}"


def _words(path: Path) -> int:
    """The words of a file as ``wc -w`` counts them: whitespace-separated tokens."""
    return len(_text(path).split())


def test_docs_stay_within_their_word_budget():
    pages = sorted((ROOT / "docs").rglob("*.md"))
    counts = {page.relative_to(ROOT).as_posix(): _words(page) for page in pages}
    total = sum(counts.values())
    largest = ", ".join(f"{name} {n:,}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:3])
    assert total <= DOCS_WORD_BUDGET, (
        f"docs/ has {total:,} words, over its {DOCS_WORD_BUDGET:,} budget: move measurements to dev/ "
        f"(the lab notebook), keeping in docs the conclusion, the figure a user needs and its command, "
        f"with a link to dev/ (largest: {largest})"
    )


def test_readme_stays_within_its_word_budget():
    words = _words(ROOT / "README.md")
    assert words <= README_WORD_BUDGET, (
        f"README.md has {words:,} words, over its {README_WORD_BUDGET:,} budget: move detail to the "
        f"docs/ page it links to, and keep in the README what a first reader needs"
    )
