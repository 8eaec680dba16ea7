"""One host read per training step: nothing else makes the host wait for the device.

Every read of a device tensor's value by the host (``.item()``, ``.tolist()``, ``float(t)``,
``if t:`` ...) blocks until the GPU has computed it; between two reads the GPU runs dry while
the host queues the next kernels. A per-parameter ``int(...)`` or a stray ``.item()`` costs
nothing visible on a CPU and a few percent per read on a GPU, so the budget is counted here on
real training steps (``conftest.HostReads`` says what counts as a read and what does not):

* the default loop: exactly one read per step, the guard's loss and gradient norm;
* fp16: the loss scaler's overflow check reuses the guard's reading, and the share of zero
  gradients (underflow) costs one read on logged steps;
* a guard that does not read every step: no read on a quiet step; the logged row's one read;
  fp16's overflow check is then the one read of every step.

Under torchrun (``tests/test_distributed.py``): the step's token count, summed over ranks,
is read by no one.
"""

import warnings

import pytest
import torch
from conftest import HostReads, tiny_model, tiny_run_config

import nanolm.train as train_module
from nanolm.precision import grad_zero_fraction
from nanolm.train import train

STEPS = 8  # logged: 1-3 (just started), 4 (--log-every); quiet: 5-7; the last, 8, also evaluates and saves
LOGGED, QUIET = [1, 2, 3, 4], [5, 6, 7]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _reads_per_step(tmp_path, stories_file, monkeypatch, precision="fp32", reading_guard=True):
    """Run STEPS training steps (two micro-batches each) and count the reads from the start of
    each step to the start of the next: the step, the guard, the observer, the checkpointer's
    check, everything the loop does for that step."""
    cfg = tiny_run_config(
        stories_file,
        tmp_path / "run",
        steps=STEPS,
        log_every=4,
        eval_every=100,
        stats_every=0,
        grad_accum=2,
        precision=precision,
        ckpt_every=100,
    )
    if not reading_guard:
        cfg.guard.on_nan, cfg.guard.on_spike = "stop", "off"
    with HostReads() as counter:
        _train_marking_each_step(cfg, monkeypatch, counter.at)
    return counter


def _train_marking_each_step(cfg, monkeypatch, mark):
    """Train ``cfg``, calling ``mark(step)`` as each step starts. The one place these tests wrap
    the loop's ``train_step``, the GPU test's included: a change of its signature fails here on
    every CPU run, not first on a rare GPU."""
    real_step = train_module.train_step

    def marked_step(setup, step, batches):
        mark(step)
        return real_step(setup, step, batches)

    monkeypatch.setattr(train_module, "train_step", marked_step)
    train(cfg, log=lambda *_: None)


def test_the_default_loop_reads_the_device_once_per_step(tmp_path, stories_file, monkeypatch):
    counter = _reads_per_step(tmp_path, stories_file, monkeypatch)
    assert counter.per_step(LOGGED + QUIET) == [1] * 7, counter.reads
    assert {where for step, _, where in counter.reads if step < STEPS} == {"step.py:train_step"}


def test_fp16_checks_overflow_without_a_read_of_its_own_and_underflow_with_one_per_logged_step(
    tmp_path, stories_file, monkeypatch
):
    counter = _reads_per_step(tmp_path, stories_file, monkeypatch, "fp16")
    assert counter.per_step(LOGGED) == [2] * 4 and counter.per_step(QUIET) == [1] * 3, counter.reads
    assert {where for step, _, where in counter.reads if step < STEPS} == {
        "step.py:train_step",
        "observer.py:after_update",
    }


@pytest.mark.parametrize("precision, quiet, logged", [("fp32", 0, 1), ("fp16", 1, 3)])
def test_without_a_reading_guard_a_quiet_step_reads_nothing_but_fp16s_overflow_check(
    tmp_path, stories_file, monkeypatch, precision, quiet, logged
):
    """``--on-nan stop --on-spike off``: the loss is read only in logged rows (one read for the
    row), and fp16's overflow check must read the gradient norm itself, once."""
    counter = _reads_per_step(tmp_path, stories_file, monkeypatch, precision, reading_guard=False)
    assert counter.per_step(QUIET) == [quiet] * 3 and counter.per_step(LOGGED) == [logged] * 4, counter.reads


@pytest.mark.kernels
def test_the_share_of_zero_gradients_is_summed_on_the_device_and_read_once():
    """One count per parameter tensor read one at a time would wait for the GPU once per tensor."""
    model = tiny_model()
    model(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
    with HostReads() as counter:
        counter.at(1)
        share = grad_zero_fraction(model.parameters())
    assert torch.is_tensor(share) and counter.reads == []
    grads = [p.grad for p in model.parameters()]
    assert share.item() == pytest.approx(sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_quiet_step_on_a_gpu_synchronises_once(tmp_path, stories_file, monkeypatch, precision):
    """The same budget as CUDA itself sees it: under ``torch.cuda.set_sync_debug_mode("warn")``
    every operation that makes the host wait for the GPU warns (reads, blocking copies, stream
    synchronisations). A quiet step (not logged, no evaluation, no checkpoint) warns once: the
    guard's read."""
    cfg = tiny_run_config(
        stories_file,
        tmp_path / "run",
        steps=STEPS,
        log_every=4,
        eval_every=100,
        stats_every=0,
        grad_accum=2,
        precision=precision,
        ckpt_every=100,
        device="cuda",
    )
    cfg.model.attention = "sdpa"
    starts = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _train_marking_each_step(cfg, monkeypatch, lambda step: starts.__setitem__(step, len(caught)))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [
        [str(w.message) for w in caught[starts[step] : starts[step + 1]] if "synchroniz" in str(w.message)]
        for step in QUIET
    ]
    assert [len(s) for s in syncs] == [1] * len(QUIET), syncs
