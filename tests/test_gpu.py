"""The CUDA paths: bf16 autocast, fused AdamW, FlexAttention's document mask, torch.compile.

Each test skips without a CUDA GPU; ``benchmarks/gpu_check.sh`` runs them on a GPU machine
(its ``gpu_tests`` part: ``pytest -m gpu``; docs/gpu.md). They compare every fast path with the plain one it replaces, the way the
CPU tests compare SDPA with ``reference_attention``.
"""

import warnings

import pytest
import torch

from nanolm.batches import pack_windows
from nanolm.model import GPT, GPTConfig
from nanolm.optim import build_optimizer, get_param_groups
from nanolm.precision import resolve_precision
from nanolm.step import accumulate_gradients, counted_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


def _model(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=256, seq_len=256, n_layer=2, n_head=4, n_embd=128)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg)).to(CUDA)


def _documents(B=4, T=256, V=256, seed=0):
    """idx with EOS (id 0) at uneven places, and the doc_ids that pack_windows derives."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, V, (B * T + 1,), generator=g)
    tokens[torch.randint(0, B * T, (3 * B,), generator=g)] = 0
    starts = torch.arange(B) * T
    batch = pack_windows(tokens.numpy(), starts.numpy(), T, eos_id=0, doc_mask=True)
    return batch


def test_auto_precision_is_bf16_on_a_gpu_with_native_bf16():
    p = resolve_precision("auto", CUDA)
    assert p.name == ("bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32")


def test_flex_attention_document_mask_equals_the_sdpa_reference_forward_and_backward():
    """FlexAttention's block mask (the CUDA default for the document mask) gives the logits and
    the gradients of SDPA with the boolean block-diagonal mask, in fp32."""
    batch = _documents()
    assert (batch.doc_ids[:, -1] > 0).all()  # every window holds several documents
    results = {}
    for backend in ("flex", "sdpa"):
        model = _model(attention=backend)
        assert model.uses_flex_attention(CUDA) == (backend == "flex")
        b = batch.to(CUDA)
        logits, _ = model(b.idx, doc_ids=b.doc_ids)
        _, loss = model(b.idx, targets=b.targets, doc_ids=b.doc_ids)
        loss.backward()
        results[backend] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(results["flex"][0], results["sdpa"][0], rtol=1e-3, atol=1e-4)
    for name, grad in results["flex"][1].items():  # a wrong mask is off by O(1), not by rounding
        torch.testing.assert_close(grad, results["sdpa"][1][name], rtol=5e-3, atol=5e-5, msg=name)


def test_no_cross_document_leak_with_flex_attention_on_cuda():
    """Changing a token of the first document leaves every logit of the later ones unchanged."""
    model = _model().eval()
    batch = _documents(B=2).to(CUDA)
    first_end = int((batch.doc_ids[0] == 0).sum())
    changed = batch.idx.clone()
    changed[0, : first_end - 1] = (changed[0, : first_end - 1] + 1) % 256
    with torch.no_grad():
        a, _ = model(batch.idx, doc_ids=batch.doc_ids)
        b, _ = model(changed, doc_ids=batch.doc_ids)
    torch.testing.assert_close(a[0, first_end:], b[0, first_end:], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(a[0, 1:first_end - 1], b[0, 1:first_end - 1])


def test_fused_adamw_on_cuda_follows_the_textbook_update():
    fused_model, loop_model = _model(), _model()
    fused = build_optimizer(fused_model, lr=1e-2, weight_decay=0.1)
    assert all(group["fused"] for group in fused.param_groups)
    loop = torch.optim.AdamW(get_param_groups(loop_model, 0.1), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    for step in range(3):
        batch = _documents(seed=step).to(CUDA)
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            model(batch.idx, targets=batch.targets)[1].backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_step_follows_the_fp32_step():
    """The training step under bf16 autocast: fp32 weights and gradients, a loss within bf16's
    precision of the fp32 loss, gradients pointing the same way."""
    batch = _documents()
    bf16, fp32 = _model(), _model()
    count = counted_tokens([batch])
    loss_bf16 = accumulate_gradients(bf16, [batch], count, resolve_precision("bf16", CUDA).autocast) / count
    loss_fp32 = accumulate_gradients(fp32, [batch], count) / count
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in bf16.parameters())
    assert abs(loss_bf16.item() - loss_fp32.item()) < 0.02 * loss_fp32.item()
    g_bf16 = torch.cat([p.grad.flatten() for p in bf16.parameters()])
    g_fp32 = torch.cat([p.grad.flatten() for p in fp32.parameters()])
    assert torch.nn.functional.cosine_similarity(g_bf16, g_fp32, dim=0) > 0.99


def test_compiled_model_matches_eager_with_and_without_the_document_mask():
    """torch.compile (the --compile path, FlexAttention inside) gives eager's loss and gradients."""
    batch = _documents().to(CUDA)
    for doc_ids in (batch.doc_ids, None):
        eager, compiled = _model(), _model()
        step_model = torch.compile(compiled)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, loss_c = step_model(batch.idx, targets=batch.targets, doc_ids=doc_ids)
        _, loss_e = eager(batch.idx, targets=batch.targets, doc_ids=doc_ids)
        loss_c.backward()
        loss_e.backward()
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-4)
        for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=5e-3, atol=5e-5, msg=name)
