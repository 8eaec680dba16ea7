"""The process a run lives in: the settings it changes and puts back, seeds and random state, threads and signals.

Everything here is set once, before the first step, and none of it is the training itself;
it is gathered in one place so that the loop does not carry it and two copies cannot drift
(a run's seeding and a distributed rank's are the same function).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import random
import signal
import threading
import time

import numpy as np
import torch

from ..errors import NanolmError
from .device import tf32_capable


@contextlib.contextmanager
def settings_restored():
    """PyTorch's process-wide switches that a run sets, put back as they were when it ends.

    ``train()`` called from a notebook, a sweep or the lab must leave the process as it found
    it: a later run (or the user's own code) would otherwise inherit deterministic kernels
    (slower on a GPU, and an error on an operation that has none), TF32 matrix products or
    another thread count without asking for them. The random generators a run seeds (Python's,
    NumPy's, torch's on the CPU, and on each GPU already in use) continue where the caller's were.
    """
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.allow_tf32,
        torch.get_num_threads(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    cuda_in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    generators = (
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if cuda_in_use else None,
    )
    try:
        yield
    finally:
        deterministic, matmul, benchmark, cudnn_tf32, threads, workspace = before
        if torch.are_deterministic_algorithms_enabled() != deterministic:
            torch.use_deterministic_algorithms(deterministic)
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = benchmark, cudnn_tf32
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace
        python_rng, numpy_rng, torch_rng, cuda_rngs = generators
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
        torch.set_rng_state(torch_rng)
        if cuda_rngs is not None:
            torch.cuda.set_rng_state_all(cuda_rngs)


def configure_tf32(device: torch.device, precision_name: str, allowed: bool) -> str | None:
    """fp32 matrix products on TF32 tensor cores, where the GPU has them and ``--tf32`` allows.

    TF32 keeps fp32's range with a 10-bit mantissa (bf16 has 7) inside the product and
    accumulates in fp32: the data sheets' TF32 peak is several times their fp32 one (``nanolm.machine.hardware``'s table),
    and training curves match fp32 (NVIDIA's and PyTorch's own guidance for deep learning). Only an fp32
    run's products change (autocast runs in 16 bits already). Returns the sentence that says
    so, or None when nothing was switched on.
    """
    if not (allowed and precision_name == "fp32" and tf32_capable(device)):
        return None
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    return "fp32 matrix products on TF32 tensor cores (--no-tf32 for full fp32 products)"


def seed_everything(seed: int) -> None:
    """Seed every generator a run draws from: Python's, NumPy's and torch's (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def derived_seed(*parts) -> int:
    """A 32-bit seed from several integers, different for every combination."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def capture_rng(device: torch.device) -> dict:
    """Every generator a training step may draw from, as tensors and plain numbers: Python's,
    NumPy's, torch's on the CPU, and the run's own accelerator's (``device``).

    Only the run's device: a CPU run on a GPU machine must not start a CUDA context, and a
    checkpoint must resume on a machine with another number of GPUs (or another
    ``CUDA_VISIBLE_DEVICES``), which a state per visible GPU would refuse."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state = {
        "python": {"version": version, "state": list(py_state), "gauss": py_gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    device = torch.device(device)
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    """Put back what :func:`capture_rng` saved; the accelerator's stream only on that kind of device."""
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise NanolmError(f"the checkpoint's random state is malformed ({type(e).__name__}: {e})") from None
    device = torch.device(device)
    if device.type == "cuda" and "cuda" in state:
        saved = state["cuda"]
        if isinstance(saved, list):  # checkpoints before 2026-12 kept one state per visible GPU
            index = device.index if device.index is not None else torch.cuda.current_device()
            saved = saved[index] if index < len(saved) else saved[0]
        torch.cuda.set_rng_state(saved, device)
    elif device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"])


def configure_determinism(enabled: bool) -> None:
    """Deterministic kernels everywhere, or PyTorch's defaults.

    On CPU nanolm's step is already deterministic for a given thread count, so this costs
    nothing there. On CUDA it forbids the non-deterministic (atomic-add) backward kernels,
    e.g. of the embedding lookup, which makes those slower, and raises on an operation that
    has no deterministic version at all.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    if enabled != torch.are_deterministic_algorithms_enabled():  # the call imports torch._inductor: 1.3 s on a CPU
        torch.use_deterministic_algorithms(enabled)


def configure_threads(threads: int, device: torch.device, log=print, auto: bool = True) -> None:
    """Set ``--threads`` (0: leave PyTorch's default, which ``--threads auto`` then tunes,
    see ``nanolm.machine.threads``) and warn when a fixed count meets a CPU busy with other work.

    PyTorch splits each CPU kernel across one thread per core, and every thread waits for
    the slowest at the end of each kernel. When another process holds a core, the thread on
    it runs late on every one of the thousands of small kernels of a step (docs/benchmarks.md,
    "A busy machine", has the measured slowdowns). The 1-minute load average is
    the only cheap sign of such a neighbour (it lags, so a job that just ended can trigger the
    hint).
    """
    if threads:
        torch.set_num_threads(threads)
    if device.type != "cpu" or not hasattr(os, "getloadavg") or (not threads and auto):
        return  # --threads auto measures for itself
    cores, used = os.cpu_count() or 1, torch.get_num_threads()
    busy = os.getloadavg()[0]
    if used > 1 and busy + used > cores + 0.75:
        log(
            f"cpu: {used} threads on {cores} cores while the load average says other processes keep ~{busy:.1f} "
            f"busy; PyTorch's threads then wait on each other, and the steps can run several times slower "
            f"(docs/benchmarks.md). If this run crawls, try --threads {max(1, cores - math.ceil(busy - 0.25))}."
        )


class TrainingInterrupted(Exception):
    """Training stopped on a signal (or a closed output), after saving a checkpoint when one was
    due; ``exit_code`` is 128 + the signal's number, as a shell reports a process that signal ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
"""What asks a run to stop after its step and save: Ctrl-C, ``kill`` (a scheduler's end of a job)
and the end of the terminal or SSH session it was started from (SIGHUP, POSIX only)."""
OUTPUT_CLOSED = getattr(signal, "SIGPIPE", 13)
"""The stop request of a run whose output went away (``nanolm train | head``): as for SIGPIPE."""


def stop_reason(signum: int) -> str:
    """What stopped a run, as its last line says it: ``SIGTERM``, ``SIGHUP``, or its output closed."""
    if signum == OUTPUT_CLOSED:
        return "output closed (SIGPIPE)"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """What the two ways of handling a stop signal share: which signals, and what happens to
    them once the run has been asked to stop and is on its way out.

    ``quiet_after_stop`` is the command entry's to set (it owns the process): once a stop was
    requested, the signals stay ignored when the phase is left, so that a further signal while
    the process saves, cleans up and exits changes neither what it does nor its status (the
    first signal's). ``train()`` called from Python leaves it False and gets its handlers back
    as they were."""

    quiet_after_stop = False

    def __init__(self):
        self.requested: int | None = None
        self._previous = {}

    def _install(self, handler) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, handler)

    def _restore(self, passing: BaseException | None) -> None:
        """Put the handlers back as they were, or ignore the signals when the process is on its way
        out of a stop: this phase's own, or one raised by a phase inside it (``passing``)."""
        stopping = self.requested is not None or isinstance(passing, (TrainingInterrupted, StoppedAtOnce))
        quiet = StopSignals.quiet_after_stop and stopping
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if quiet else handler)


class StopAtOnce(StopSignals):
    """SIGINT, SIGTERM and SIGHUP end the command at once, through its cleanup: for the phases
    with nothing to save (a run being set up, its data prepared; its final weights written).

    By default SIGTERM and SIGHUP kill a process on the spot, and a run killed while it prepares
    its data leaves the scratch directory of a half-tokenized corpus in the system's temporary
    directory, which nothing ever removes. Here the first stop signal raises, as Ctrl-C does, so
    the code on the way out removes what it made, and the command ends with 128 + the signal's
    number and one line saying ``then``: what has happened and what to run. Signals that follow
    (a launcher forwarding the Ctrl-C the terminal already delivered, a SIGHUP after a SIGTERM)
    change nothing: raising again would interrupt that very cleanup."""

    def __init__(self, then: str):
        super().__init__()
        self.then = then

    def _handle(self, signum, frame):
        if self.requested is not None:
            return
        self.requested = signum
        raise TrainingInterrupted(f"{stop_reason(signum)} {self.then}", signum)

    def __enter__(self):
        self._install(self._handle)
        return self

    def __exit__(self, kind, passing, trace):
        self._restore(passing)


SAME_REQUEST_SECONDS = 1.0
"""A second Ctrl-C this soon after the first stop signal is the same request delivered twice
(a launcher such as torchrun forwards to its workers the Ctrl-C the terminal already sent
them; a key pressed twice in a hurry), not a wish to leave at once."""


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C, well after the first stop signal: the run ends at once, without waiting
    for its step or a checkpoint (a step that hangs, a save on a slow disk). A KeyboardInterrupt,
    so that nothing on the way out mistakes it for an error to recover from; ``exit_code`` is the
    first signal's status, which says why the run ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopOnSignal(StopSignals):
    """Turns SIGINT, SIGTERM and SIGHUP into a request to stop after the current step.

    Killing a run mid-step would lose everything since the last checkpoint; instead the
    loop finishes its step, saves a checkpoint and exits with the first signal's status.
    Further signals change nothing, except a Ctrl-C more than :data:`SAME_REQUEST_SECONDS`
    after the first request, which stops at once (:class:`StoppedAtOnce`; the checkpoints
    already saved are whole, so the same command resumes from the last one).
    Closing the terminal sends SIGHUP, which by default ends a process on the spot: here it
    is a stop like SIGTERM. A reader that closed the run's output (``| head``) is the same
    request, made by the command's entry through :meth:`request` (:attr:`active` is the
    instance in force).
    """

    active: "StopOnSignal | None" = None

    def __init__(self, clock=time.monotonic):
        super().__init__()
        self._outer = None
        self._clock = clock
        self._requested_at = 0.0

    def request(self, signum: int) -> None:
        """Stop after this step, as on ``signum`` (the first request is the one reported)."""
        if self.requested is None:
            self.requested, self._requested_at = signum, self._clock()

    def _handle(self, signum, frame):
        if (
            self.requested is not None
            and signum == signal.SIGINT
            and self._clock() - self._requested_at > SAME_REQUEST_SECONDS
        ):
            raise StoppedAtOnce(
                f"{stop_reason(signum)} after {stop_reason(self.requested)}: stopped at once, without "
                f"saving this step; run the same command again to resume from the last checkpoint",
                self.requested,
            )
        self.request(signum)

    def __enter__(self):
        self._install(self._handle)
        self._outer, StopOnSignal.active = StopOnSignal.active, self
        return self

    def __exit__(self, kind, passing, trace):
        StopOnSignal.active = self._outer
        self._restore(passing)
