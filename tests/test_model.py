"""The model and its loss: causal, blind across packed documents, initialised to predict
uniformly, able to memorise a batch, and a loss that counts the positions that count and only
those. With tests/test_optim.py these are the course week's checks:
``pytest tests/test_model.py tests/test_optim.py -v``."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from nanolm.batches import pack_windows
from nanolm.errors import NanolmError
from nanolm.model import (
    GPT,
    GPTConfig,
    apply_rope,
    attention,
    document_causal_mask,
    masked_cross_entropy,
    masked_cross_entropy_sum,
    reference_attention,
    rope_tables,
    sample_next_token,
)

E = 0  # EOS id


@pytest.mark.kernels
def test_model_is_causal():
    """Logits at position t must not change when tokens after t change."""
    model = tiny_model().eval()
    idx = torch.randint(64, (2, 20))
    changed = idx.clone()
    changed[:, 12:] = torch.randint(64, (2, 8))
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_model_can_overfit_one_batch():
    model = tiny_model(n_layer=2)
    idx = torch.randint(64, (4, 32))
    targets = torch.roll(idx, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        _, loss = model(idx, targets=targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


@pytest.mark.kernels
def test_initial_loss_is_close_to_ln_vocab():
    for vocab in (64, 512, 2048):
        model = tiny_model(vocab_size=vocab)
        idx = torch.randint(vocab, (8, 32))
        _, loss = model(idx, targets=torch.randint(vocab, (8, 32)))
        assert abs(loss.item() - math.log(vocab)) < 0.1 * math.log(vocab)
        assert abs(loss.item() - math.log(vocab)) < 0.05  # small-std init: near-uniform predictions


@pytest.mark.kernels
def test_fast_attention_matches_reference_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8) for _ in range(3))
    doc_ids = torch.tensor([[0] * 4 + [1] * 6, [0] * 10])
    mask = document_causal_mask(doc_ids)
    expected = reference_attention(q, k, v, mask)
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(causal, reference_attention(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.kernels
def test_model_attention_equals_reference_implementation(monkeypatch):
    """The whole model with SDPA gives the same logits as with hand-written attention."""
    import nanolm.model as m

    model = tiny_model().eval()
    idx = torch.randint(64, (2, 16))
    doc_ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    with torch.no_grad():
        fast_plain, _ = model(idx)
        fast_docs, _ = model(idx, doc_ids=doc_ids)

    def slow(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0):
        return reference_attention(q, k, v, attn_mask)

    monkeypatch.setattr(m.F, "scaled_dot_product_attention", slow)
    with torch.no_grad():
        slow_plain, _ = model(idx)
        slow_docs, _ = model(idx, doc_ids=doc_ids)
    torch.testing.assert_close(fast_plain, slow_plain, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast_docs, slow_docs, rtol=1e-4, atol=1e-5)


@pytest.mark.kernels
def test_kv_cache_gives_the_same_logits_as_a_full_forward():
    model = tiny_model(qk_norm=True).eval()
    idx = torch.randint(64, (2, 20))
    from nanolm.model import KVCache

    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(model.config, 2, "cpu", torch.float32)
        prefix = model.forward_cached(idx[:, :12], cache)
        steps = [model.forward_cached(idx[:, t : t + 1], cache) for t in range(12, 20)]
    incremental = torch.cat([prefix] + steps, dim=1)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-5)


def test_greedy_generation_follows_the_argmax_of_full_forwards():
    model = tiny_model().eval()
    prompt = torch.randint(64, (1, 5))
    out = model.generate(prompt, 40, temperature=0)  # runs past seq_len=32: exercises the cache refill
    assert out.shape == (1, 45) and torch.equal(out[:, :5], prompt)
    with torch.no_grad():
        for t in range(5, 25):
            logits, _ = model(out[:, :t])
            assert logits[0, -1].argmax().item() == out[0, t].item()


def test_generation_is_seeded_and_stops_at_eos():
    model = tiny_model().eval()
    prompt = torch.randint(64, (3, 4))
    a = model.generate(prompt, 30, temperature=1.0, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 30, temperature=1.0, generator=torch.Generator().manual_seed(1))
    c = model.generate(prompt, 30, temperature=1.0, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # an untied head that makes token 7 overwhelmingly likely: generation must stop at it
    eos_model = tiny_model(tie_embeddings=False).eval()
    with torch.no_grad():
        eos_model.lm_head.weight.zero_()
        eos_model.lm_head.weight[7] = 50.0 * eos_model.lm_head.weight.new_ones(32)
    out = eos_model.generate(prompt, 30, temperature=1.0, eos_id=7, generator=torch.Generator().manual_seed(0))
    assert out.shape[1] < 4 + 30  # stopped early
    assert (out[:, 4:] == 7).any(dim=1).all()


def test_top_k_and_top_p_only_sample_allowed_tokens():
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]]).repeat(200, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next_token(logits, 1.0, top_k=2, generator=g).tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # 0.665, 0.245, 0.090, ...
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert set(sample_next_token(logits, 1.0, top_p=0.7, generator=g).tolist()) == {0, 1}
    assert set(sample_next_token(logits, 0.0).tolist()) == {0}


@pytest.mark.kernels
def test_samples_follow_the_softmax_of_the_logits_over_the_temperature_within_the_top_k():
    """Sampling that is merely 'random enough' hides an inverted temperature or a top-k that
    keeps too few tokens: the text still reads, only blander or wilder than asked."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    g, n = torch.Generator().manual_seed(0), 20_000
    for temperature, top_k in [(0.5, None), (2.0, None), (1.0, 2)]:
        expected = logits / temperature
        if top_k:
            expected[top_k:] = float("-inf")
        draws = sample_next_token(logits.repeat(n, 1), temperature, top_k=top_k, generator=g)
        frequencies = torch.bincount(draws, minlength=4).float() / n
        assert torch.allclose(frequencies, expected.softmax(-1), atol=0.015), (temperature, top_k, frequencies)


def test_gpt_config_rejects_impossible_shapes():
    with pytest.raises(NanolmError, match="divisible"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(NanolmError, match="even"):
        GPTConfig(n_embd=12, n_head=4)
    with pytest.raises(NanolmError, match="mlp"):
        GPTConfig(mlp="relu")


def test_num_params_and_flops_per_token_match_hand_counts():
    c = GPTConfig(vocab_size=100, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(c)
    hidden = c.mlp_hidden  # 96
    per_block = 3 * 32 * 32 + 32 * 32 + 3 * 32 * hidden + 2 * 32
    assert model.num_params() == 100 * 32 + 2 * per_block + 32  # tied head counted once
    matmul = 2 * (4 * 32 * 32 + 3 * 32 * hidden) + 100 * 32
    assert model.flops_per_token() == 6 * matmul + 12 * 2 * 16 * 32
    untied = GPT(GPTConfig(vocab_size=100, seq_len=16, n_layer=2, n_head=2, n_embd=32, tie_embeddings=False))
    assert untied.num_params() == model.num_params() + 100 * 32


@pytest.mark.kernels
def test_flex_attention_document_mask_matches_the_sdpa_reference():
    """FlexAttention (the CUDA path) gives the logits of the SDPA boolean-mask path.

    On CPU FlexAttention runs forward only (no backward), which is enough to compare."""
    import warnings

    sdpa = tiny_model(attention="sdpa").eval()
    flex = tiny_model(attention="flex").eval()
    flex.load_state_dict(sdpa.state_dict())
    idx = torch.randint(64, (2, 32))
    doc_ids = torch.tensor([[0] * 7 + [1] * 20 + [2] * 5, [0] * 32])
    positions = torch.cat([torch.arange(7), torch.arange(20), torch.arange(5)]).expand(2, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        expected, _ = sdpa(idx, doc_ids=doc_ids, positions=positions)
        got, _ = flex(idx, doc_ids=doc_ids, positions=positions)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert flex.uses_flex_attention("cpu") and not sdpa.uses_flex_attention("cuda")
    with pytest.MonkeyPatch.context() as mp:  # auto: FlexAttention on CUDA where Triton builds its kernel
        mp.setattr("nanolm.machine.device.has_triton", lambda: True)
        assert tiny_model().uses_flex_attention("cuda") and not tiny_model().uses_flex_attention("cpu")
        mp.setattr("nanolm.machine.device.has_triton", lambda: False)
        assert not tiny_model().uses_flex_attention("cuda")


def test_a_first_flex_call_inside_torch_compile_leaves_later_eager_calls_fused(monkeypatch):
    """With ``--compile`` (or a benchmark that warms its compiled runner first) the first use of
    FlexAttention and its block mask comes from inside the traced model. A compiled wrapper
    made there is the raw function; kept, every later eager call would run FlexAttention
    unfused (the whole B x H x T x T score matrix) with the same numbers. Played on the CPU
    with CUDA's path forced, up to the wrappers themselves (their kernels need a GPU)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    import nanolm.model

    monkeypatch.setattr(nanolm.model, "fused_on", lambda t: True)
    monkeypatch.setattr(nanolm.model, "_compiled", {})

    def attend(q, doc_ids):
        return nanolm.model.flex_attention(q, q, q, nanolm.model.flex_document_mask(doc_ids))

    q, doc_ids = torch.randn(1, 2, 128, 16), torch.tensor([[0] * 50 + [1] * 78])
    try:
        torch.compile(attend, backend="eager")(q, doc_ids)
    finally:
        torch._dynamo.reset()
    for fn in (flex, create_block_mask):
        wrapper = nanolm.model.compiled_once(fn)
        assert wrapper is not fn and getattr(wrapper, "_torchdynamo_orig_callable", None) is fn, fn.__name__
        assert nanolm.model.compiled_once(fn) is wrapper  # made once per process


def test_rope_equals_the_textbook_rotate_half_formula_bit_for_bit():
    """apply_rope rolls x and keeps the sign in the sin table; the numbers must be exactly
    those of x·cos + rotate_half(x)·sin with the plain tables (what Llama and HF compute)."""
    T, D, theta = 16, 8, 10000.0
    cos, sin = rope_tables(T, D, theta)
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq).repeat(1, 2)
    assert torch.equal(cos, angles.cos().float())
    x = torch.randn(2, 3, T, D)
    rotate_half = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1)
    assert torch.equal(apply_rope(x, cos, sin), x * angles.cos().float() + rotate_half * angles.sin().float())


@pytest.mark.kernels
def test_attention_runs_in_fp32_under_cpu_autocast():
    """On CPU under bf16 autocast only the Linear layers use bf16: attention gets fp32 inputs
    (its bf16 backward is several times slower on CPU) and returns exactly fp32 SDPA."""
    q, k, v = (torch.randn(2, 2, 8, 16).bfloat16() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attention(q, k, v, is_causal=True)
    assert y.dtype == torch.float32
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert torch.equal(y, expected)
    model = tiny_model()
    idx = torch.randint(64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(idx)
        _, loss = model(idx, targets=idx)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    torch.testing.assert_close(logits.float(), model(idx)[0], rtol=0.05, atol=0.05)


@pytest.mark.kernels
def test_the_models_loss_in_chunks_is_the_loss_of_its_logits():
    """Given targets, the model computes its head and loss a chunk of positions at a time; the
    mean, the sum and every gradient are those of the loss over its whole logits."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32, loss_chunk=5)
    model = GPT(config)
    idx, targets = torch.randint(64, (3, 16)), torch.randint(64, (3, 16))
    mask = torch.rand(3, 16) > 0.25
    logits, _ = model(idx)
    whole = masked_cross_entropy_sum(logits, targets, mask)[0]
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    no_logits, total = model(idx, targets=targets, loss_mask=mask, reduction="sum")
    total.backward()
    assert no_logits is None
    torch.testing.assert_close(total, whole, rtol=1e-6, atol=1e-5)
    for name, p in model.named_parameters():
        scale = float(expected[name].abs().max())  # the same up to rounding: the order of the sums differs
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
    _, mean = model(idx, targets=targets, loss_mask=mask)
    torch.testing.assert_close(mean, whole / mask.sum())


def test_qk_norm_under_bf16_autocast_takes_the_fused_norm_with_the_same_numbers():
    """Under autocast q and k arrive in bf16 while the norm's gain is fp32; PyTorch's fused
    rms_norm needs one dtype and otherwise falls back to a slower composite (with a warning).
    The norm runs in fp32 and rounds back instead: the same numbers as normalising the fp32
    values, and no fallback."""
    import warnings

    from nanolm.model import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.mul_(1 + 0.1 * torch.randn(32))
    q = (3 * torch.randn(2, 4, 16, 32)).bfloat16()
    expected = torch.nn.functional.rms_norm(q.float(), (32,), norm.weight, 1e-6).bfloat16()
    fused, calls = torch.nn.functional.rms_norm, []

    def one_dtype_only(x, shape, weight=None, eps=None):  # PyTorch warns only once per process: check the call
        calls.append((x.dtype, None if weight is None else weight.dtype))
        return fused(x, shape, weight, eps)

    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "rms_norm", one_dtype_only)
        warnings.simplefilter("error")  # the composite path warns "Mismatch dtype between input and weight"
        out = norm(q)
        model = tiny_model(qk_norm=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(torch.randint(64, (2, 20)), targets=torch.randint(64, (2, 20)))
        loss.backward()
    assert calls and all(weight in (None, x) for x, weight in calls), calls
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert model.blocks[0].attn.q_norm.weight.grad is not None


@pytest.mark.kernels
def test_projections_into_the_residual_stream_start_smaller_by_sqrt_of_twice_the_depth():
    """Each block adds two branches to the residual stream; with every matrix at N(0, 0.02) its
    variance would grow with depth. The attention output and MLP down projections start at
    0.02 / sqrt(2 · n_layer), the rest at 0.02 (GPT-2's scheme)."""
    model = tiny_model(n_layer=8, n_embd=128, n_head=4)
    residual = [p for n, p in model.named_parameters() if n.endswith(("attn.proj.weight", "mlp.down.weight"))]
    others = [
        p
        for n, p in model.named_parameters()
        if p.dim() == 2 and not n.endswith(("attn.proj.weight", "mlp.down.weight"))
    ]
    assert len(residual) == 16
    assert torch.cat([p.flatten() for p in residual]).std().item() == pytest.approx(0.02 / 4, rel=0.02)
    assert torch.cat([p.flatten() for p in others]).std().item() == pytest.approx(0.02, rel=0.02)


# ------------------------------------------------------------------ the loss: masked cross-entropy


@pytest.mark.kernels
def test_masked_cross_entropy_ignores_masked_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(7, (2, 5))
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 0, 1]], dtype=torch.bool)
    clean = masked_cross_entropy(logits, targets, mask)
    absurd = logits.clone()
    absurd[~mask] = torch.tensor([1e30, -1e30, float("inf"), float("nan"), 0.0, 3e4, -7.0])
    assert masked_cross_entropy(absurd, targets, mask).item() == pytest.approx(clean.item(), abs=0)
    absurd_targets = targets.clone()
    absurd_targets[~mask] = 3  # the targets of masked positions do not matter either
    assert masked_cross_entropy(logits, absurd_targets, mask).item() == pytest.approx(clean.item(), abs=0)


@pytest.mark.kernels
def test_masked_cross_entropy_is_mean_over_counted_positions():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 11)
    targets = torch.randint(11, (3, 4))
    mask = torch.rand(3, 4) > 0.4
    per_token = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), reduction="none")
    expected = per_token[mask.reshape(-1)].mean()
    torch.testing.assert_close(masked_cross_entropy(logits, targets, mask), expected)
    total, count = masked_cross_entropy_sum(logits, targets, mask)
    assert count.item() == mask.sum().item()
    torch.testing.assert_close(total, per_token[mask.reshape(-1)].sum())


def test_masked_cross_entropy_is_zero_not_nan_when_nothing_counts():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.zeros(2, 3, dtype=torch.long)
    loss = masked_cross_entropy(logits, targets, torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logits.grad).all()


@pytest.mark.kernels
def test_masked_cross_entropy_runs_in_fp32_for_low_precision_logits():
    torch.manual_seed(2)
    logits = torch.randn(1, 8, 50) * 4
    targets = torch.randint(50, (1, 8))
    low = masked_cross_entropy(logits.bfloat16(), targets)
    assert low.dtype == torch.float32
    assert low.item() == pytest.approx(masked_cross_entropy(logits.bfloat16().float(), targets).item(), rel=1e-6)


@pytest.mark.kernels
def test_negative_targets_are_not_counted_without_a_mask():
    logits = torch.zeros(1, 4, 3)
    targets = torch.tensor([[0, -100, 1, -1]])
    total, count = masked_cross_entropy_sum(logits, targets)
    assert count.item() == 2 and total.item() == pytest.approx(2 * math.log(3))


# ------------------------------------------------------------------ packed documents: the mask keeps them apart


def _two_document_window():
    doc_a = [E, 11, 12, 13, 14, 15, 16]
    doc_b = [E, 21, 22, 23, 24, 25, 26, 27, 28]
    tokens = np.array(doc_a + doc_b + [E])
    return tokens, len(doc_a), len(tokens) - 1


@pytest.mark.kernels
def test_no_cross_document_leak_with_the_mask_on():
    """Change a token of document A: no logit of document B in the same window moves."""
    model = tiny_model().eval()
    tokens, len_a, T = _two_document_window()
    changed = tokens.copy()
    changed[3] = 40  # inside document A
    for reset in (False, True):
        a = pack_windows(tokens, np.array([0]), T, E, doc_mask=True, reset_positions=reset)
        b = pack_windows(changed, np.array([0]), T, E, doc_mask=True, reset_positions=reset)
        with torch.no_grad():
            la, _ = model(a.idx, doc_ids=a.doc_ids, positions=a.positions)
            lb, _ = model(b.idx, doc_ids=b.doc_ids, positions=b.positions)
        assert torch.equal(la[:, len_a:], lb[:, len_a:])  # bitwise on CPU fp32
        assert not torch.equal(la[:, 3:len_a], lb[:, 3:len_a])
    # the same change leaks into document B when the mask is off: the test can fail
    a = pack_windows(tokens, np.array([0]), T, E, doc_mask=False)
    b = pack_windows(changed, np.array([0]), T, E, doc_mask=False)
    with torch.no_grad():
        assert not torch.allclose(model(a.idx)[0][:, len_a:], model(b.idx)[0][:, len_a:])


@pytest.mark.kernels
def test_masked_window_equals_each_document_run_alone():
    model = tiny_model().eval()
    tokens, len_a, T = _two_document_window()
    packed = pack_windows(tokens, np.array([0]), T, E, doc_mask=True, reset_positions=True)
    with torch.no_grad():
        together, _ = model(packed.idx, doc_ids=packed.doc_ids, positions=packed.positions)
        alone_a, _ = model(torch.from_numpy(tokens[None, :len_a]).long())
        alone_b, _ = model(torch.from_numpy(tokens[None, len_a:T]).long())
    torch.testing.assert_close(together[:, :len_a], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[:, len_a:], alone_b, rtol=1e-5, atol=1e-5)


@pytest.mark.kernels
def test_rotary_attention_makes_the_position_reset_redundant_under_the_mask():
    """RoPE scores depend only on the distance between query and key. Inside a masked
    document every distance is the same wherever the document starts, so resetting the
    positions changes nothing but rounding; without the mask it does change the logits."""
    model = tiny_model().eval()
    tokens, len_a, T = _two_document_window()
    kw = dict(seq_len=T, eos_id=E)
    with torch.no_grad():
        outs = {}
        for mask in (True, False):
            for reset in (True, False):
                b = pack_windows(tokens, np.array([0]), doc_mask=mask, reset_positions=reset, **kw)
                outs[mask, reset] = model(b.idx, doc_ids=b.doc_ids, positions=b.positions)[0][:, len_a:]
    torch.testing.assert_close(outs[True, True], outs[True, False], rtol=1e-5, atol=1e-5)
    assert (outs[False, True] - outs[False, False]).abs().max() > 1e-5


@pytest.mark.kernels
def test_relu2_mlp_is_the_square_of_relu_over_the_gelu_width():
    """ReLU² (modded-nanogpt's MLP) has GELU's two matrices at 4x the width: the same parameters
    and FLOPs, another nonlinearity; negative pre-activations give exactly 0, as ReLU's do."""
    from nanolm.model import MLP

    relu2, gelu = GPTConfig(n_embd=32, n_head=2, mlp="relu2"), GPTConfig(n_embd=32, n_head=2, mlp="gelu")
    assert relu2.mlp_hidden == gelu.mlp_hidden == 128
    assert GPT(relu2).num_params() == GPT(gelu).num_params()
    assert GPT(relu2).flops_per_token() == GPT(gelu).flops_per_token()
    mlp = MLP(relu2)
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(mlp(x), mlp.down(torch.relu(mlp.up(x)) ** 2), rtol=0, atol=0)
    assert not hasattr(mlp, "gate")


def test_compiled_blocks_are_one_graph_for_every_block_and_only_for_passes_with_gradients():
    """``--compile`` traces one block and reuses it for all: a deeper model traces no more (a model
    compiled whole traces every block again, and its loss), and only the training passes take it:
    an evaluation or a sample under no_grad, compiled, would be a second compile for a few forward
    passes (and one more per length while sampling). Dynamo's own backend: the graphs, not the
    kernels, are what this counts."""
    from torch._dynamo.utils import counters

    from nanolm.model import compile_blocks

    idx = torch.randint(0, 64, (2, 16))
    doc_ids = torch.zeros(2, 16, dtype=torch.long)
    traced = {}
    for depth in (1, 3):
        torch._dynamo.reset()
        counters.clear()
        model = tiny_model(n_layer=depth)
        compile_blocks(model, backend="eager")
        _, loss = model(idx, targets=idx, doc_ids=doc_ids)
        loss.backward()
        traced[depth] = dict(counters["stats"])
    assert traced[3] == traced[1] and traced[3]["unique_graphs"] == 1, traced
    with torch.no_grad():
        model(idx, targets=idx, doc_ids=doc_ids)
        model.generate(idx[:1, :4], max_new_tokens=3)
    assert dict(counters["stats"]) == traced[3], "a pass without gradients was compiled"
    torch._dynamo.reset()
