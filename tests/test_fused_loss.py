"""The output head and the loss fused, a chunk of positions at a time (``head_cross_entropy_sum``
in nanolm/model.py): the numbers of the loss of the whole logits, in every number format, with
nothing from the positions that do not count."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanolm.fused_loss import head_cross_entropy_sum, loss_chunk_positions
from nanolm.model import masked_cross_entropy_sum


def _head_and_loss_both_ways(hidden, weight, targets, mask, chunk, autocast=False, factor=0.37):
    """(loss, grad of hidden, grad of weight) from the logits whole and from the fused chunks."""
    out = []
    for fused in (False, True):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if fused:
                total, count = head_cross_entropy_sum(h, w, targets, mask, chunk)
            else:
                total, count = masked_cross_entropy_sum(h @ w.t(), targets, mask)
        (total * factor).backward()  # the step's 1 / count: backward must carry the factor through
        out.append((total.detach(), count, h.grad, w.grad))
    return out


@pytest.mark.kernels
@pytest.mark.parametrize("chunk", [1, 7, 8, 10, 64, 1000])
def test_the_fused_head_and_loss_equals_the_loss_of_the_whole_logits(chunk):
    """Chunk sizes that divide the 3 x 21 = 63 positions (1, 7), that leave a short last chunk
    (8: 7 full chunks and 7 positions; 10: 6 and 3) and that hold them all: the same loss, count
    and gradients as the logits computed whole."""
    torch.manual_seed(3)
    hidden, weight = torch.randn(3, 21, 16), torch.randn(50, 16) * 0.3
    targets = torch.randint(50, (3, 21))
    mask = torch.rand(3, 21) > 0.3
    (whole, n_whole, gh_whole, gw_whole), (fused, n_fused, gh_fused, gw_fused) = _head_and_loss_both_ways(
        hidden, weight, targets, mask, chunk
    )
    assert n_fused.item() == n_whole.item() == mask.sum().item()
    torch.testing.assert_close(fused, whole, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gh_fused, gh_whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw_fused, gw_whole, rtol=1e-5, atol=1e-6)


@pytest.mark.kernels
def test_masked_positions_give_the_fused_loss_nothing_and_get_no_gradient():
    torch.manual_seed(4)
    hidden, weight = torch.randn(2, 9, 8), torch.randn(30, 8) * 0.3
    targets = torch.randint(30, (2, 9))
    mask = torch.rand(2, 9) > 0.5
    absurd = hidden.clone()
    absurd[~mask] = 1e4  # logits in the millions: any leak would dominate the loss
    absurd_targets = torch.where(mask, targets, torch.full_like(targets, -100))
    (_, _, _, _), (clean, _, gh_clean, gw_clean) = _head_and_loss_both_ways(hidden, weight, targets, mask, 4)
    (_, _, _, _), (loud, _, gh_loud, gw_loud) = _head_and_loss_both_ways(absurd, weight, absurd_targets, mask, 4)
    assert loud.item() == pytest.approx(clean.item(), rel=1e-6)
    assert (gh_loud[~mask] == 0).all() and (gh_clean[~mask] == 0).all()
    torch.testing.assert_close(gh_loud[mask], gh_clean[mask])
    torch.testing.assert_close(gw_loud, gw_clean)  # the head's gradient takes nothing from a masked row


@pytest.mark.kernels
def test_the_fused_loss_takes_its_softmax_in_fp32_under_bf16_autocast():
    """The head's product runs in bf16 under autocast (as nn.Linear would), the log-sum-exp in fp32:
    the loss equals nanolm's fp32 loss over the same bf16 logits, and the gradients agree with the
    whole logits' to bf16's rounding."""
    torch.manual_seed(5)
    hidden, weight = torch.randn(4, 32, 64), torch.randn(512, 64) * 0.5
    targets = torch.randint(512, (4, 32))
    mask = torch.ones(4, 32, dtype=torch.bool)
    (whole, _, gh_whole, gw_whole), (fused, _, gh_fused, gw_fused) = _head_and_loss_both_ways(
        hidden, weight, targets, mask, 48, autocast=True
    )
    assert fused.dtype == torch.float32
    assert fused.item() == pytest.approx(whole.item(), rel=1e-5)  # a log-softmax in bf16 is ~1e-3 off
    for a, b in ((gh_fused, gh_whole), (gw_fused, gw_whole)):
        assert a.dtype == torch.float32 and float((a - b).norm() / b.norm()) < 1e-2


def test_the_fused_loss_gradients_survive_fp16_before_the_loss_scale_is_known():
    """Under fp16 autocast the head's gradients are computed in the forward pass, before the
    step's 1 / token count and loss scale reach them: summed over 4,096 positions of large
    hidden states, an fp16 product would overflow (65,504) where the whole-logits path, whose
    gradient arrives already divided by the count, stays finite. The gradient of the logits
    is scaled down by a power of two before its fp16 cast, enough that no entry can overflow."""
    torch.manual_seed(7)
    hidden, weight = torch.rand(1, 4096, 16) * 20 + 10, torch.randn(32, 16) * 0.01
    targets = torch.zeros(1, 4096, dtype=torch.long)  # one column's gradient adds up over every position
    mask = torch.ones(1, 4096, dtype=torch.bool)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        total, count = head_cross_entropy_sum(h, w, targets, mask, chunk=4096)
    (total / count).backward()
    (_, _, gh_ref, gw_ref), _ = _head_and_loss_both_ways(hidden, weight, targets, mask, 4096, factor=1 / 4096)
    assert torch.isfinite(w.grad).all() and torch.isfinite(h.grad).all()
    assert float((w.grad - gw_ref).norm() / gw_ref.norm()) < 1e-2
    assert float((h.grad - gh_ref).norm() / gh_ref.norm()) < 1e-2


class _MatmulDtypes(TorchDispatchMode):
    """Records the dtypes of the operands of every matrix-matrix product."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.seen.append({a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() == 2})
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_fused_heads_three_products_run_in_the_autocast_dtype(dtype):
    """Under fp16 or bf16 autocast the logits and both gradient products (of the hidden states
    and of the head's weight) multiply 16-bit operands, as ``nn.Linear`` and its backward do:
    on a T4, whose fp16 tensor cores run 8x its fp32 rate, fp32 gradient products would take
    ~16x the time of the logits' product. Three products per chunk."""
    torch.manual_seed(9)
    hidden = torch.randn(2, 24, 16, requires_grad=True)
    weight = (torch.randn(40, 16) * 0.3).requires_grad_()
    targets = torch.randint(40, (2, 24))
    with torch.autocast("cpu", dtype=dtype), _MatmulDtypes() as products:
        total, _ = head_cross_entropy_sum(hidden, weight, targets, chunk=16)
    assert len(products.seen) == 3 * 3  # 48 positions in 3 chunks
    assert all(seen == {dtype} for seen in products.seen), products.seen
    total.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32


def test_the_fused_fp16_gradients_of_unlikely_tokens_keep_their_digits():
    """The head's weight gradient of a token that is unlikely at every position is a sum of
    tiny probabilities (here mostly 1e-10 to 3e-7) times the hidden states. Cast to fp16 as they are,
    these fall below its smallest normal number (6e-5) and lose most digits (~50 % error); one
    scale for every token, limited by the frequent token's row (the target of half the
    positions), still loses some (~1 %). With a scale per token, every row is as accurate as
    fp16 operands allow, against the same product computed in fp32 from the same fp16 logits."""
    torch.manual_seed(10)
    n, c, v = 512, 32, 256
    hidden = torch.randn(n, c)
    hidden[:, 0] = 4.0
    weight = torch.randn(v, c) * 0.3
    weight[v // 2 :, 0] = -3.0  # the upper half of the vocabulary: logits ~12 below the rest everywhere
    targets = torch.randint(v // 2, (n,))
    targets[::2] = 0
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        total, _ = head_cross_entropy_sum(h, w, targets, chunk=n)
    total.backward()
    d = torch.softmax((hidden.half() @ weight.half().t()).float(), -1)  # the fused path's own fp16 logits
    assert d[:, v // 2 :].max() < 6e-5  # every one below fp16's smallest normal number
    d[torch.arange(n), targets] -= 1
    expected_gh, expected_gw = d @ weight.half().float(), d.t() @ hidden.half().float()
    row_error = (w.grad - expected_gw).norm(dim=1) / expected_gw.norm(dim=1)
    assert row_error.max() < 2e-3, (row_error[: v // 2].max(), row_error[v // 2 :].max())
    assert float((h.grad - expected_gh).norm() / expected_gh.norm()) < 2e-3


@pytest.mark.kernels
def test_the_fused_loss_trains_bf16_weights_without_autocast():
    """``--precision bf16-pure``: weights and hidden states in bf16, no autocast; the gradients
    come back in bf16, close to the whole logits'."""
    torch.manual_seed(8)
    hidden, weight = torch.randn(2, 40, 32).bfloat16(), (torch.randn(96, 32) * 0.2).bfloat16()
    targets = torch.randint(96, (2, 40))
    (whole, _, gh_whole, gw_whole), (fused, _, gh_fused, gw_fused) = _head_and_loss_both_ways(
        hidden, weight, targets, None, 16
    )
    assert gh_fused.dtype == gw_fused.dtype == torch.bfloat16 and fused.dtype == torch.float32
    assert fused.item() == pytest.approx(whole.item(), rel=1e-5)
    for a, b in ((gh_fused, gh_whole), (gw_fused, gw_whole)):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 2e-2


def test_the_fused_loss_without_gradients_is_the_same_number():
    torch.manual_seed(6)
    hidden, weight = torch.randn(2, 10, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    targets = torch.randint(20, (2, 10))
    with torch.no_grad():
        quiet, _ = head_cross_entropy_sum(hidden, weight, targets, chunk=3)
    loud, _ = head_cross_entropy_sum(hidden, weight, targets, chunk=3)
    assert quiet.item() == loud.item() and not quiet.requires_grad


def test_a_loss_chunk_keeps_a_cpus_logits_in_cache_and_a_gpus_products_large():
    assert loss_chunk_positions(4096, "cpu") == 256  # 1 M logits, 4 MB in fp32
    assert loss_chunk_positions(64, "cpu") == 1024 and loss_chunk_positions(200_000, "cpu") == 64
    assert loss_chunk_positions(50_304, "cuda") == 667 and loss_chunk_positions(512, "cuda") == 65_536


@pytest.mark.kernels
@pytest.mark.parametrize("mask_boundary", [False, True])
def test_bits_per_byte_count_the_utf8_bytes_of_the_predicted_tokens_only(mask_boundary):
    """bpb divides the information by the bytes the *predicted* tokens spell: the targets that
    count (not the inputs, not the positions the mask leaves out, EOS spelling none), over the
    windows evaluated (a subset of a validation set counts only its own). Characters of 1, 2 and
    3 UTF-8 bytes make each of those mistakes a different number."""
    import numpy as np

    from nanolm.batches import pack_windows
    from nanolm.evaluate import estimate_loss
    from nanolm.model import GPT, GPTConfig
    from nanolm.tokenizer import train_char

    docs = ["a café at noon", "€5 for a crêpe", "naïve ünïcödé text", "plain ascii story here"] * 6
    tok = train_char(docs)
    ids = np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in docs])
    windows = [
        pack_windows(ids, np.array([s, s + 40]), 32, tok.eos_id, mask_boundary=mask_boundary) for s in (0, 90, 180)
    ]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=32, n_layer=1, n_head=2, n_embd=32))
    token_bytes = torch.from_numpy(tok.token_bytes())
    for subset in (windows, windows[1:]):
        expected = sum(
            len(tok.decode([int(t)]).encode("utf-8"))
            for b in subset
            for t, m in zip(b.targets.flatten(), b.loss_mask.flatten())
            if m and int(t) != tok.eos_id
        )
        result = estimate_loss(model, subset, token_bytes)
        assert result["bytes"] == expected
        assert result["bpb"] == pytest.approx(result["loss"] * result["tokens"] / math.log(2) / expected)
    assert any(not m for b in windows for m in b.loss_mask.flatten()) == mask_boundary
