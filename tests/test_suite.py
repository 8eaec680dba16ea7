"""The suite's own promises: what CI runs again on other CPUs' kernels is every test whose verdict
can depend on them.

CI runs the whole default suite once, on the machine's own vector kernels, and then, under
``ATEN_CPU_CAPABILITY=avx2`` and ``=default`` (a laptop's kernels and the plain fallback), only the
tests marked ``kernels``: those that compare a computed float with a recorded one (the golden
record, the reference bands, a pinned figure) or with another computation's result within a
tolerance (fused against plain, compiled against eager, bf16 against fp32). Those are the only
verdicts a change of kernels can move: an exact comparison (a resume bit-identical to an
uninterrupted run, a file's bytes, a count) holds on every kernel path or on none.

The mark is held here rather than trusted: a test that reaches a tolerance comparison (itself, or
through a helper of its module) without the mark fails this check, naming it, so a new test
cannot quietly drop out of the other-kernel runs.
"""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

TOLERANCES = {"approx", "allclose", "assert_close", "isclose", "assert_allclose"}
"""The names of the calls that compare floats within a tolerance (pytest, torch, numpy, math)."""
RECORDS = ("golden.json", "references/", "reference_of", "load_reference", "kernel_spread")
"""Strings and names that read a number recorded on another machine."""


def _marks(decorators) -> set[str]:
    """The pytest marks among ``decorators`` (``@pytest.mark.NAME`` or ``@pytest.mark.NAME(...)``)."""
    found = set()
    for d in decorators:
        node = d.func if isinstance(d, ast.Call) else d
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
            found.add(node.attr)
    return found


def _module_marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            value = node.value
            return _marks(value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value])
    return set()


def _compares_within_a_tolerance(node: ast.AST) -> bool:
    """Whether ``node``'s code makes a tolerance comparison or reads a recorded number: a call of
    one of :data:`TOLERANCES`, ``abs(a - b) <= tol``, or a reference to a record."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            if name in TOLERANCES:
                return True
        if isinstance(n, ast.Compare) and isinstance(n.left, ast.Call) and getattr(n.left.func, "id", "") == "abs":
            if n.left.args and isinstance(n.left.args[0], ast.BinOp) and isinstance(n.left.args[0].op, ast.Sub):
                return True
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and any(r in n.value for r in RECORDS):
            return True
        if isinstance(n, ast.Name) and n.id in RECORDS:
            return True
    return False


def _names(node: ast.AST) -> set[str]:
    """Every name ``node``'s code uses: the functions it calls, and those it passes on."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def unmarked_kernel_tests(source: str, name: str) -> list[str]:
    """The tests in ``source`` that reach a tolerance comparison, directly or through a function of
    their module (followed to any depth), and are not marked ``kernels`` (on the function, its
    class or the module)."""
    tree = ast.parse(source)
    module_marked = "kernels" in _module_marks(tree)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    uses = {f: _names(node) & functions.keys() for f, node in functions.items()}
    comparing = {f for f, node in functions.items() if _compares_within_a_tolerance(node)}
    grown = True
    while grown:  # a function that uses one that compares compares too, until nothing more joins
        more = {f for f, used in uses.items() if used & comparing} - comparing
        comparing |= more
        grown = bool(more)

    missing = []
    containers = [(tree, set())] + [(c, _marks(c.decorator_list)) for c in tree.body if isinstance(c, ast.ClassDef)]
    for container, class_marks in containers:
        for fn in container.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.name.startswith("test"):
                continue
            marked = module_marked or "kernels" in class_marks | _marks(fn.decorator_list)
            if not marked and fn.name in comparing:
                missing.append(f"{name}::{fn.name}")
    return missing


def test_every_test_whose_verdict_can_depend_on_the_cpus_kernels_is_marked_kernels():
    missing = [
        test
        for path in sorted(TESTS.glob("test_*.py"))
        if path.name != Path(__file__).name  # this file computes nothing: its own examples name records
        for test in unmarked_kernel_tests(path.read_text(encoding="utf-8"), path.name)
    ]
    assert not missing, (
        f"{len(missing)} tests compare floats within a tolerance, or read a recorded number, without "
        "@pytest.mark.kernels (CI runs the marked ones again on other CPUs' kernels; tests/test_suite.py): "
        + ", ".join(missing[:20])
    )


def test_the_kernel_check_sees_a_tolerance_through_a_helper_and_honours_each_place_of_the_mark():
    """The check itself: a comparison reached through a helper counts; the mark on the function,
    its class or the module is enough; an exact comparison needs no mark."""
    helper = "def _near(a, b):\n    return torch.allclose(a, b)\n"
    assert unmarked_kernel_tests(helper + "def test_a():\n    assert _near(x, y)\n", "m") == ["m::test_a"]
    assert unmarked_kernel_tests("def test_b():\n    assert abs(x - y) < 1e-3\n", "m") == ["m::test_b"]
    assert unmarked_kernel_tests("def test_c():\n    assert x == pytest.approx(0.5)\n", "m") == ["m::test_c"]
    assert unmarked_kernel_tests("def test_d():\n    assert load('golden.json')\n", "m") == ["m::test_d"]
    assert unmarked_kernel_tests("def test_e():\n    assert torch.equal(x, y)\n", "m") == []
    cycle = "def _a(x):\n    return _b(x)\ndef _b(x):\n    return _a(x) or torch.allclose(x, x)\n"
    calls_a = "def test_i():\n    assert _a(1)\ndef test_j():\n    assert _b(1)\n"
    assert unmarked_kernel_tests(cycle + calls_a, "m") == ["m::test_i", "m::test_j"]
    marked = "@pytest.mark.kernels\ndef test_f():\n    assert torch.allclose(x, y)\n"
    assert unmarked_kernel_tests(marked, "m") == []
    in_class = "@pytest.mark.kernels\nclass TestG:\n    def test_g(self):\n        assert torch.allclose(x, y)\n"
    assert unmarked_kernel_tests(in_class, "m") == []
    module = "pytestmark = [pytest.mark.kernels]\ndef test_h():\n    assert torch.allclose(x, y)\n"
    assert unmarked_kernel_tests(module, "m") == []
