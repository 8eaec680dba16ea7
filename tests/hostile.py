"""Hypothesis strategies for the files a hostile (or unlucky) user hands nanolm.

Two kinds of trouble reach a reader. *Text* that no valid document holds, or that Python's
parsers choke on although it is valid: an integer of 5,000 digits, arrays nested deeper than
the recursion limit, a hexadecimal TOML integer of any length, bytes that are not UTF-8.
And *documents* that parse but are not what the reader expects: a real file nanolm wrote
with one value swapped for another type, a key gone, a table where a number was, a huge
number, a string of a megabyte. :func:`mutated` makes the second kind from a real document,
so every key path a reader follows is tried, not only the ones a person thought of.
"""

from __future__ import annotations

import copy
import json

from hypothesis import strategies as st

PATHOLOGICAL_JSON = [
    "1" * 5000,  # longer than Python converts
    "-" + "9" * 4301,
    "[" * 5000 + "]" * 5000,  # deeper than the recursion limit
    '{"a":' * 3000 + "1" + "}" * 3000,
    "[" * 100 + "]" * 100,  # deep, though Python would parse it
    "1e999999",
    "-1e999999",
    "NaN",
    "Infinity",
    "1." + "1" * 5000,
    '"' + "x" * 100_000 + '"',
    "",
    " ",
    "\x00",
    "\ufeff{}",
    "null",
    "true",
    "[]",
    "{}",
    '"text"',
    "0",
]

PATHOLOGICAL_TOML = [
    "a = " + "1" * 5000,
    "a = 0x" + "f" * 5000,  # Python's TOML parser accepts a hex integer of any length
    "a = " + "[" * 3000 + "]" * 3000,
    "a = " + "{b = " * 1000 + "1" + "}" * 1000,
    "[" + "a." * 2000 + "b]",
    "model = 3",
    "model = [1, 2]",
    "model = 'text'",
    "[model]\nn_layer = 0x7fffffffffffffff",
    "[train]\nsteps = 9223372036854775807",
    "[train]\nsteps = -9223372036854775808",
    "[train]\nlr = inf",
    "[train]\nlr = nan",
    "[optim]\nlr = 1e308",
    "[data]\ndata = '" + "x" * 5000 + "'",
    "[model]\n[model]",
    "[train]\nsteps = 1\nsteps = 2",
    "\x00",
    "[train]\nseed = 1979-05-27",
    "[[train]]\nsteps = 2",
    "[train.sub]\nx = 1",
    "[train]\nthreads = 'many'",
    "[train]\nthreads = ''",
]

INTERESTING_INTEGERS = [0, 1, -1, 2, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30]


def leaves():
    return st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(INTERESTING_INTEGERS),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.sampled_from(["", "nan", "inf", "step_000004", "single", "sharded", "x" * 10_000]),
    )


def json_values():
    """Any JSON value, shallow and small, with the numbers and strings readers trip on."""
    return st.recursive(
        leaves(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=8,
    )


def json_texts():
    """Text a JSON reader may be handed: pathological documents, serialised hostile values,
    and arbitrary text."""
    serialised = json_values().map(lambda v: json.dumps(v, allow_nan=True))
    return st.one_of(st.sampled_from(PATHOLOGICAL_JSON), serialised, st.text(max_size=40))


def mutated(document, data):
    """A copy of ``document`` (parsed JSON or TOML) with one hostile change at a path drawn
    by ``data``: a value replaced, a key removed or added, or the whole document replaced."""
    document = copy.deepcopy(document)
    if data.draw(st.integers(0, 9), label="replace the whole document") == 0:
        return data.draw(json_values(), label="whole")
    node = document
    path = []
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans(), label="go deeper"):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))), label="key")
        path.append(key)
        node = node[key]
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    operation = data.draw(st.sampled_from(["replace", "delete", "add"]), label="operation")
    if not path:  # at the top
        if isinstance(document, dict):
            if operation == "delete" and document:
                del document[data.draw(st.sampled_from(sorted(document)), label="top key")]
            else:
                document[data.draw(st.text(max_size=8), label="new key")] = data.draw(json_values(), label="value")
        return document
    last = path[-1]
    if operation == "delete" and isinstance(parent, dict):
        del parent[last]
    elif operation == "add" and isinstance(node, dict):
        node[data.draw(st.text(max_size=8), label="new key")] = data.draw(json_values(), label="value")
    else:
        parent[last] = data.draw(json_values(), label="value")
    return document


def toml_texts():
    """TOML a config reader may be handed: pathological documents, and tables of hostile values."""
    return st.one_of(st.sampled_from(PATHOLOGICAL_TOML), st.text(max_size=40))


def _toml_key(key) -> str:
    return json.dumps(str(key), ensure_ascii=False)


def _toml_inline(value) -> str:
    if value is None:
        return "[]"  # TOML has no null
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(str(value), repr(value))
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_inline(v) for v in value) + "]"
    return "{" + ", ".join(f"{_toml_key(k)} = {_toml_inline(v)}" for k, v in value.items()) + "}"


def to_toml(document) -> str:
    """``document`` (what :func:`mutated` made of a parsed config.toml) written back as TOML,
    tables as ``[section]`` blocks, so a reader meets the change rather than a syntax error."""
    if not isinstance(document, dict):
        return f"value = {_toml_inline(document)}\n"
    lines = [f"{_toml_key(k)} = {_toml_inline(v)}" for k, v in document.items() if not isinstance(v, dict)]
    for section, table in document.items():
        if isinstance(table, dict):
            lines.append(f"[{_toml_key(section)}]")
            lines += [f"{_toml_key(k)} = {_toml_inline(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
