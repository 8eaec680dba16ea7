import atexit
import getpass
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from nanolm.data.corpus import write_stories
from nanolm.model import GPT, GPTConfig

REPO = Path(__file__).resolve().parent.parent
LIST_GPU_MARKS = "NANOLM_LIST_GPU_MARKS"

SHELL_SETTINGS = (
    "PYTHONUNBUFFERED",
    "PYTHONIOENCODING",
    "PYTHONUTF8",
    "NANOLM_NO_LOCK",
    "NANOLM_CACHE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""What a developer's shell or a CI service may set that changes how nanolm or Python behaves: the
suite runs without them, as in a user's bare shell, and its commands with them too (a child
process inherits this environment). A test that needs one sets it itself."""
for _name in SHELL_SETTINGS:
    os.environ.pop(_name, None)
# What a run keeps between runs (a CPU's measured matmul peak, downloads) goes to a cache of this
# session's own, never the user's: each test starts from what the suite itself kept.
_CACHE = tempfile.mkdtemp(prefix="nanolm-tests-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["NANOLM_CACHE"] = _CACHE
# Each run prepares its own text, as the tests of preparation expect; the cache of prepared data
# has its tests (tests/test_data_cache.py), which turn it on.
os.environ["NANOLM_NO_DATA_CACHE"] = "1"
# The property tests (Hypothesis) draw the same examples on every run and keep no example database:
# CI's verdict on a tree never depends on chance, nor on what an earlier run in the same clone found.
# NANOLM_EXPLORE=1 draws fresh random examples each time (and keeps what fails), to search further.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("NANOLM_EXPLORE") else "repeatable")
# torch.compile's cache does not tell the kernel paths apart (PyTorch 2.13): a step compiled under
# the machine's own kernels, loaded again under ATEN_CPU_CAPABILITY=avx2, computes garbage. The
# suite keeps one cache per path, as a machine of that kind would have.
_USER = os.getuid() if hasattr(os, "getuid") else getpass.getuser()  # one cache per user: /tmp is shared
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
    Path(tempfile.gettempdir()) / f"nanolm-tests-inductor-{_USER}-{torch.backends.cpu.get_cpu_capability()}"
)


MAX_WORKERS = 4
"""``-n auto`` (the README's command) runs one worker a core, up to four: each worker imports
PyTorch and trains its own session fixtures, so more than a few costs memory and start-up for
little gain on a suite of many short tests."""


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_WORKERS, _cores()))


def pytest_xdist_make_scheduler(config, log):
    """Each test file goes whole to one worker: a file's module-scoped fixtures (the runs its tests
    only read) are then trained once, not once in each worker that got one of its tests."""
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


# Under pytest-xdist each worker takes its share of the cores for PyTorch's threads: two workers
# that each start a thread a core would fight over them (a step several times slower, and the
# tests that time something see a machine busier than any user's).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


LONGEST_FILES = (
    "test_terminal.py",
    "test_curve.py",
    "test_distributed.py",
    "test_run_lock.py",
    "test_signal_points.py",
    "test_run_directory.py",
    "test_precision.py",
    "test_continued_runs.py",
    "test_checkpoint.py",
)
"""The test files that take longest (dev/measurements.md, "The suite's time"), started first when
pytest-xdist shares the files among workers: a long file dealt last keeps one worker busy while the
other waits. Only the order changes; a file missing here is dealt in its usual place."""


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the longest files first (:data:`LONGEST_FILES`; a plain run keeps the
    order it was given, which ``tools/silent_bugs.py`` chooses). With NANOLM_LIST_GPU_MARKS set,
    print each collected test and whether it is marked ``gpu`` (what tests/test_gpu.py's check of
    GPU-only tests reads, from one collection)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {name: i for i, name in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    if os.environ.get(LIST_GPU_MARKS):
        for item in items:
            print(f"{LIST_GPU_MARKS} {item.get_closest_marker('gpu') is not None} {item.nodeid}")


def tiny_model(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def run_cli(*args, cwd=None, timeout=300):
    """Run ``python -m nanolm ARGS`` in a fresh process; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "nanolm", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


def run_main(*args) -> subprocess.CompletedProcess:
    """``nanolm ARGS`` run in this process through :func:`~nanolm.instruments.cli.main` (what every
    command runs after its entry), its output captured, as :func:`run_cli` returns it. For a test
    that needs no fresh interpreter (no signal, no kill, no process-wide setting, no import to
    watch): it saves the ~2 s that starting Python and PyTorch costs each command."""
    import contextlib
    import io

    from nanolm.instruments.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's refusal or --help, with the status Python would exit with
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["nanolm", *map(str, args)], code, out.getvalue(), err.getvalue())


def run_harness(harness: Path, data, work: Path, *options) -> dict:
    """Run a harness of forked runs (``tests/signal_points.py``, ``tests/continued_runs.py``) in a
    fresh process (a child must not be forked from one that ran PyTorch) and return its result;
    its own failures fail the test, one line each."""
    result = work / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(harness),
            "--data",
            str(data),
            "--work",
            str(work / "w"),
            "--json",
            str(result),
            *map(str, options),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(  # a mutated copy's path stays first
                filter(None, [os.environ.get("PYTHONPATH"), str(harness.parents[1])])
            ),
        },
    )
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    outcome = json.loads(result.read_text())
    assert not outcome["failures"], "\n".join(
        f"{case}: {'; '.join(broken)}" for case, broken in outcome["failures"].items()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return outcome


TINY_TRAIN = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--eval-batches",
    "2",
    "--sample-tokens",
    "20",
    "--vocab-size",
    "300",
]


@pytest.fixture(scope="session")
def stories_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "stories.txt"
    write_stories(path, 300, seed=3)
    return path


def tiny_run_config(data, out_dir, **train):
    """A RunConfig for a few-second training run on ``data`` (char tokenizer, one small block)."""
    from nanolm.run.config import RunConfig

    cfg = RunConfig()
    cfg.data.data, cfg.data.tokenizer = str(data), "char"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.seq_len = 1, 2, 32, 32
    cfg.train.out_dir, cfg.train.sample_tokens, cfg.train.eval_batches = str(out_dir), 0, 2
    cfg.train.batch_size, cfg.train.log_every = 4, 1
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory, stories_file) -> Path:
    """A short run with every observation on: per-layer statistics at steps 1, 2 and 4, a clip
    threshold that clips some steps and not others, TensorBoard when it is installed."""
    import importlib.util

    from nanolm.train import train

    out = tmp_path_factory.mktemp("observed") / "run"
    cfg = tiny_run_config(stories_file, out, steps=5, stats_every=2, eval_every=3)
    cfg.model.n_layer = 2
    cfg.optim.clip = 1.25
    if importlib.util.find_spec("tensorboard") is not None:
        cfg.train.log = "tensorboard"
    train(cfg, log=lambda *_: None)
    return out


class HostReads:
    """Counts the places where the host reads a tensor's values, while ``step`` is set.

    A read (``item``, ``tolist``, ``bool``/``float``/``int``/``index`` of a tensor, ``cpu``,
    ``numpy``) of a tensor on a GPU makes the host wait for the GPU to finish everything queued
    before it: a device-to-host synchronisation. On the CPU nothing waits, but the same calls
    run, so counting them here counts the synchronisations a GPU run would make.

    What is *not* counted: reads of the batches' token counts (``Batch.counted``). The batches
    are built on the host and only copies of them travel to the device (``Batch.to``), so in a
    GPU run these are host arithmetic, not synchronisations; every value ``Batch.counted``
    returns is remembered and its reads are left out. A read inside another read (``float``
    calling ``item``) counts once.

    ``reads`` lists (step, what, where) with ``where`` the reading function as file:name (a
    comprehension's reads are its function's).
    Usable as a context manager without pytest (in spawned ranks).
    """

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")

    def __init__(self):
        self.reads, self.step, self._host, self._depth, self._saved = [], None, [], 0, {}

    def __enter__(self):
        from nanolm.batches import Batch

        for name in self.NAMES:
            self._saved[(torch.Tensor, name)] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        self._saved[(Batch, "counted")] = Batch.__dict__["counted"]
        host_count = Batch.counted.fget

        def counted(batch):
            value = host_count(batch)
            self._host.append(value)
            return value

        Batch.counted = property(counted)
        return self

    def __exit__(self, *exc):
        for (owner, name), value in self._saved.items():
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        return False

    def _wrap(self, name, original):
        def read(tensor, *args, **kwargs):
            if self.step is not None and self._depth == 0 and not any(tensor is h for h in self._host):
                frame = sys._getframe(1)
                while frame.f_code.co_name.startswith("<") and frame.f_back is not None:  # a comprehension's
                    frame = frame.f_back
                self.reads.append((self.step, name, f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"))
            self._depth += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._depth -= 1

        return read

    def at(self, step):
        """Count from here on as reads of step ``step`` (the batches' counts of earlier steps forgotten)."""
        self.step, self._host = step, []

    def per_step(self, steps) -> list[int]:
        return [sum(1 for s, _, _ in self.reads if s == step) for step in steps]
