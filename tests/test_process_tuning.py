"""``--process-tuning``: the command tunes its own process for a training run, and only its own.

The allocator's thresholds and the garbage collector's exemptions change the whole process, so
they happen in the command's entry (``nanolm train``, ``python -m nanolm``, ``python -m
nanolm.train``), under one option recorded in config.toml, and never in ``train()`` called from
Python (``nanolm.instruments.process``). Each check runs in a fresh process: these settings
cannot be undone, and the test process must not get them.
"""

import ctypes
import subprocess
import sys

import pytest
import tomllib

HAS_MALLINFO2 = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "mallinfo2")

# after the code under test: how many objects the collector skips, and whether a 64 MiB buffer
# (a step's worth of activations) comes from a fresh mapping (glibc's default) or the heap
AFTERWARDS = """
def afterwards():
    import ctypes, gc, torch
    mapped = -1
    if hasattr(ctypes.CDLL(None), "mallinfo2"):
        libc = ctypes.CDLL("libc.so.6")
        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]
        libc.mallinfo2.restype = MallInfo2
        before = libc.mallinfo2().hblkhd
        buffer = torch.empty(64 << 20, dtype=torch.uint8)
        mapped = libc.mallinfo2().hblkhd - before
    print("PROCESS frozen", gc.get_freeze_count(), "mapped", mapped, flush=True)
"""

COMMAND_PROBE = (
    AFTERWARDS
    + """
import atexit, runpy, sys
atexit.register(afterwards)
module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
)

LIBRARY_PROBE = (
    AFTERWARDS
    + """
import sys
from nanolm.run.config import config_from_args
from nanolm.instruments.cli import build_parser
from nanolm.train import train
train(config_from_args(build_parser().parse_args(sys.argv[1:])), log=lambda *_: None)
afterwards()
"""
)


def _train_args(stories_file, out_dir, *extra):
    return [
        "train",
        "--data",
        str(stories_file),
        "--out-dir",
        str(out_dir),
        "--steps",
        "1",
        "--tokenizer",
        "char",
        "--n-layer",
        "1",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "0",
        "--threads",
        "1",
        "--device",
        "cpu",
        *extra,
    ]


def _process(code, *args):
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    _, _, frozen, _, mapped = next(x for x in r.stdout.splitlines() if x.startswith("PROCESS ")).split()
    return int(frozen), int(mapped)


@pytest.mark.parametrize(  # `python -m nanolm.train` reaches the same entry (test_cli.py checks it starts): CI runs it
    "module, subcommand", [("nanolm", ["train"]), pytest.param("nanolm.train", [], marks=pytest.mark.exhaustive)]
)
def test_the_training_command_tunes_its_process_and_off_leaves_it_alone(tmp_path, stories_file, module, subcommand):
    """``nanolm train`` and ``python -m nanolm.train`` alike: with ``--process-tuning auto`` (the
    default) the objects that live until exit are exempted from collection and a 64 MiB buffer
    comes from the heap, not a fresh mapping; with ``off``, neither. config.toml records it."""
    for option in ("auto", "off"):
        out = tmp_path / option
        args = _train_args(stories_file, out, "--process-tuning", option)
        frozen, mapped = _process(COMMAND_PROBE, module, *(args if subcommand else args[1:]))
        with open(out / "config.toml", "rb") as f:
            assert tomllib.load(f)["train"]["process_tuning"] == option
        if option == "auto":
            assert frozen > 10_000
            assert mapped in (0, -1)  # from the heap, and kept there when freed (-1: no mallinfo2 to look)
        else:
            assert frozen == 0
            assert mapped >= 64 << 20 or mapped == -1  # glibc's default: a fresh mapping


def test_train_called_from_python_leaves_the_allocator_and_the_collector_alone(tmp_path, stories_file):
    """A notebook, the lab or a sweep calling ``train()`` keeps its process as it was, whatever
    ``--process-tuning`` says: nothing exempted from collection, glibc's default thresholds."""
    frozen, mapped = _process(LIBRARY_PROBE, *_train_args(stories_file, tmp_path / "run", "--process-tuning", "auto"))
    assert frozen == 0
    assert mapped >= 64 << 20 or (mapped == -1 and not HAS_MALLINFO2)


QUICK_EXIT_PROBE = """
import atexit, gc, sys
import torch
import nanolm.instruments.cli as cli

class FlushesWhenFinalized:  # a writer that flushes in __del__, say, caught in a reference cycle
    def __del__(self):
        with open(sys.argv[1], "w") as f:
            f.write("finalized")

def command(argv, process_tuning):
    process_tuning.before_training("auto", torch.device("meta"))  # what a training run with auto does
    garbage = FlushesWhenFinalized()
    garbage.itself = garbage
    return 3

atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))
cli.main = command
cli.entry()
"""


def test_the_command_exits_quickly_and_still_finalizes_its_garbage(tmp_path):
    """A tuned command exempts what survives at its end from the shutdown's collections. What
    is already garbage when the command ends must still be finalized, as the shutdown's own
    collection would have done: a writer caught in a reference cycle would otherwise never
    flush. The exit status is the command's, and the console script is the same entry."""
    import importlib.metadata

    out = tmp_path / "finalized.txt"
    r = subprocess.run([sys.executable, "-c", QUICK_EXIT_PROBE, str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert "frozen at exit: True" in r.stdout
    assert out.read_text() == "finalized"
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["nanolm"] == "nanolm.instruments.cli:entry"


@pytest.mark.skipif(not HAS_MALLINFO2, reason="glibc >= 2.33 only (mallinfo2)")
def test_keeping_freed_memory_applies_to_a_cpu_only():
    """A GPU's memory has PyTorch's own caching allocator: the glibc thresholds are for CPU runs."""
    import torch

    from nanolm.instruments.process import keep_freed_memory_for_reuse

    assert keep_freed_memory_for_reuse(torch.device("meta")) is False
