"""The CUDA paths: bf16 autocast, fused AdamW, FlexAttention's document mask, torch.compile.

They compare every fast path with the plain one it replaces, the way the CPU tests compare SDPA
with ``reference_attention``. Each test runs twice: on a CUDA GPU (marked ``gpu``, skipped
without one; ``benchmarks/gpu_check.sh`` runs them, docs/gpu.md) and on the CPU as the GPU's
stand-in. A GPU is lent rarely and briefly; a test that only ever ran there would rot unseen
(a changed signature, a renamed option) and waste the first minutes of the next GPU. On the CPU
the same body runs, minus what the CPU cannot do, each named where it is left out: FlexAttention's
backward (forward only on a CPU) and Inductor's code generation (the compiled model is traced
by ``aot_eager`` instead, the same graphs without the kernels).
"""

import ast
import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import LIST_GPU_MARKS, REPO

from nanolm.batches import pack_windows
from nanolm.model import GPT, GPTConfig
from nanolm.optim import build_optimizer, get_param_groups
from nanolm.precision import cpu_has_native_bf16, resolve_precision
from nanolm.step import accumulate_gradients, counted_tokens

ON_A_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(params=[pytest.param("cuda", marks=ON_A_GPU), "cpu"], ids=["gpu", "cpu_stand_in"])
def device(request) -> torch.device:
    return torch.device(request.param)


def _model(device, seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=256, seq_len=256, n_layer=2, n_head=4, n_embd=128)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg)).to(device)


def _documents(B=4, T=256, V=256, seed=0):
    """idx with EOS (id 0) at uneven places, and the doc_ids that pack_windows derives."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, V, (B * T + 1,), generator=g)
    tokens[torch.randint(0, B * T, (3 * B,), generator=g)] = 0
    starts = torch.arange(B) * T
    batch = pack_windows(tokens.numpy(), starts.numpy(), T, eos_id=0, doc_mask=True)
    return batch


def test_auto_precision_is_the_devices_fast_format(device):
    """bf16 where the device multiplies it natively; otherwise fp16 with loss scaling on a GPU
    (T4/V100 class) and fp32 on a CPU."""
    p = resolve_precision("auto", device)
    if device.type == "cuda":
        assert p.name == ("bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16")
    else:
        assert p.name == ("bf16" if cpu_has_native_bf16() else "fp32")


@pytest.mark.kernels
def test_flex_attention_document_mask_equals_the_sdpa_reference_forward_and_backward(device):
    """FlexAttention's block mask (the CUDA default for the document mask) gives the logits and
    the gradients of SDPA with the boolean block-diagonal mask, in fp32."""
    batch = _documents()
    assert (batch.doc_ids[:, -1] > 0).all()  # every window holds several documents
    backward = device.type == "cuda"  # FlexAttention has no backward on a CPU
    results = {}
    for backend in ("flex", "sdpa"):
        model = _model(device, attention=backend)
        assert model.uses_flex_attention(device) == (backend == "flex")
        b = batch.to(device)
        with torch.set_grad_enabled(backward), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # on a CPU: "flex_attention called without torch.compile"
            logits, _ = model(b.idx, doc_ids=b.doc_ids)
            _, loss = model(b.idx, targets=b.targets, doc_ids=b.doc_ids)
        if backward:
            loss.backward()
        results[backend] = (logits.detach(), {n: p.grad for n, p in model.named_parameters() if backward})
    torch.testing.assert_close(results["flex"][0], results["sdpa"][0], rtol=1e-3, atol=1e-4)
    assert len(results["flex"][1]) == (len(list(model.parameters())) if backward else 0)
    for name, grad in results["flex"][1].items():  # a wrong mask is off by O(1), not by rounding
        torch.testing.assert_close(grad, results["sdpa"][1][name], rtol=5e-3, atol=5e-5, msg=name)


@pytest.mark.kernels
def test_no_cross_document_leak_with_flex_attention(device):
    """Changing a token of the first document leaves every logit of the later ones unchanged."""
    model = _model(device, attention="flex").eval()
    batch = _documents(B=2).to(device)
    first_end = int((batch.doc_ids[0] == 0).sum())
    changed = batch.idx.clone()
    changed[0, : first_end - 1] = (changed[0, : first_end - 1] + 1) % 256
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, _ = model(batch.idx, doc_ids=batch.doc_ids)
        b, _ = model(changed, doc_ids=batch.doc_ids)
    torch.testing.assert_close(a[0, first_end:], b[0, first_end:], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(a[0, 1 : first_end - 1], b[0, 1 : first_end - 1])


@pytest.mark.kernels
def test_fused_adamw_follows_the_textbook_update(device):
    """Three steps of the fused kernel land where the textbook loop does, to a thousandth of a
    step. Not to the last bit: where a gradient is as small as Adam's eps (1e-8), the update
    m / (sqrt(v) + eps) hangs on its last bits, and a kernel vectorised for AVX-512 rounds them
    differently from the loop (about 1e-4 of a step there). A wrong update (no bias correction,
    decay on a norm, swapped betas) is off by a sizeable part of every step."""
    lr, steps = 1e-2, 3
    fused_model, loop_model = _model(device), _model(device)
    fused = build_optimizer(fused_model, lr=lr, weight_decay=0.1)
    assert all(group["fused"] for group in fused.param_groups)
    loop = torch.optim.AdamW(get_param_groups(loop_model, 0.1), lr=lr, betas=(0.9, 0.95), foreach=False)
    for step in range(steps):
        batch = _documents(seed=step).to(device)
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            model(batch.idx, targets=batch.targets)[1].backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-3 * lr * steps)


@pytest.mark.kernels
def test_bf16_autocast_step_follows_the_fp32_step(device):
    """The training step under bf16 autocast: fp32 weights and gradients, a loss within bf16's
    precision of the fp32 loss, gradients pointing the same way."""
    batch = _documents().to(device)
    bf16, fp32 = _model(device), _model(device)
    count = counted_tokens([batch])
    loss_bf16 = accumulate_gradients(bf16, [batch], count, resolve_precision("bf16", device).autocast) / count
    loss_fp32 = accumulate_gradients(fp32, [batch], count) / count
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in bf16.parameters())
    assert abs(loss_bf16.item() - loss_fp32.item()) < 0.02 * loss_fp32.item()
    g_bf16 = torch.cat([p.grad.flatten() for p in bf16.parameters()])
    g_fp32 = torch.cat([p.grad.flatten() for p in fp32.parameters()])
    assert torch.nn.functional.cosine_similarity(g_bf16, g_fp32, dim=0) > 0.99


@pytest.mark.kernels
def test_compiled_model_matches_eager_with_and_without_the_document_mask(device):
    """The compiled blocks (the --compile path, FlexAttention inside) give eager's loss and gradients."""
    from nanolm.model import compile_blocks

    batch = _documents().to(device)
    backend = "inductor" if device.type == "cuda" else "aot_eager"  # a CPU: the graphs, not the kernels
    for doc_ids in (batch.doc_ids, None):
        eager, compiled = _model(device), _model(device)
        compile_blocks(compiled, backend=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, loss_c = compiled(batch.idx, targets=batch.targets, doc_ids=doc_ids)
        _, loss_e = eager(batch.idx, targets=batch.targets, doc_ids=doc_ids)
        loss_c.backward()
        loss_e.backward()
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-4)
        for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=5e-3, atol=5e-5, msg=name)


# Tests that run only on a GPU, each with the CPU tests that run its code on every machine.
GPU_ONLY = {
    "test_a_quiet_step_on_a_gpu_synchronises_once": ("tests/test_host_reads.py", "_train_marking_each_step"),
    "test_nccl_ranks_on_gpus_equal_one_process": ("tests/test_distributed.py", "_assert_same_run"),
}


def _collected(session) -> tuple[set[str], set[str]]:
    """The test functions pytest collects from tests/ (without parameters): those marked ``gpu``,
    and those that are not. This session's own when it collected every test file (the README's
    command), else from a collection of its own."""
    files = {p.name for p in (REPO / "tests").glob("test_*.py")}
    if files <= {item.path.name for item in session.items}:
        found = {True: set(), False: set()}
        for item in session.items:
            found[item.get_closest_marker("gpu") is not None].add(item.name.split("[")[0])
        return found[True], found[False]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, LIST_GPU_MARKS: "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = {"True": set(), "False": set()}
    for line in done.stdout.splitlines():
        if line.startswith(LIST_GPU_MARKS):
            _, marked, nodeid = line.split(" ", 2)
            found[marked].add(nodeid.split("::")[-1].split("[")[0])
    return found["True"], found["False"]


def test_every_gpu_test_runs_its_code_on_the_cpu_too(request):
    """A GPU-only test that nothing runs on the CPU rots unseen until the next (rare, short)
    GPU: every test marked ``gpu`` has a CPU stand-in of its own, or is listed in ``GPU_ONLY``
    with a helper that it and at least one CPU test of its file call."""
    on_gpu, on_cpu = _collected(request.session)
    assert on_gpu, "no test marked gpu was collected"
    without_stand_in = on_gpu - on_cpu
    assert without_stand_in == set(GPU_ONLY), "a GPU-only test with no CPU counterpart: give it a CPU stand-in"
    for name, (path, helper) in GPU_ONLY.items():
        functions = [
            f for f in ast.parse((REPO / path).read_text(encoding="utf-8")).body if isinstance(f, ast.FunctionDef)
        ]
        callers, grown = {helper}, True
        while grown:  # what calls the helper, directly or through the file's other helpers
            before = len(callers)
            callers |= {
                f.name for f in functions if any(isinstance(n, ast.Name) and n.id in callers for n in ast.walk(f))
            }
            grown = len(callers) > before
        assert name in callers and callers & on_cpu, f"{name}: {helper} is not shared with a CPU test of {path}"
