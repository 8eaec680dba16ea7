"""Per-step and per-layer statistics against values computed by hand."""

import math

import pytest
import torch
from conftest import tiny_model, tiny_run_config

from nanolm.batches import Batch
from nanolm.machine.hardware import gpu_peak_flops, peak_flops
from nanolm.model import Attention, GPTConfig, apply_rope, document_causal_mask
from nanolm.train import train
from nanolm.watch.meter import StepMeter
from nanolm.watch.sinks import read_metrics
from nanolm.watch.stats import LayerStats, layer_groups, max_attention_logit, probe


def _random_batch(B=3, T=16, V=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(V, (B, T), generator=g)
    return Batch(idx, torch.randint(V, (B, T), generator=g), torch.ones(B, T, dtype=torch.bool))


def _norm(tensors):
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


@pytest.mark.kernels
@pytest.mark.parametrize("tie", [True, False])
def test_layer_statistics_match_hand_computed_norms_and_update_ratios(tie):
    model = tiny_model(tie_embeddings=tie)
    batch = _random_batch()
    model(batch.idx, batch.targets)[1].backward()
    stats = LayerStats(model).capture()
    lr = 0.05
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=lr).step()  # Δw = -lr·g exactly
    row = stats.after_update()

    params = dict(model.named_parameters())  # a tied matrix appears once, as embed.weight
    by_hand = {
        "embed": ["embed.weight"],
        "0": [n for n in params if n.startswith("blocks.0.")],
        "1": [n for n in params if n.startswith("blocks.1.")],
        "final_norm": ["norm.weight"],
    }
    if not tie:
        by_hand["head"] = ["lm_head.weight"]
    assert {k.split("/")[1] for k in row if k.startswith("weight_norm/")} == set(by_hand)
    for group, names in by_hand.items():
        w = _norm(before[n] for n in names)
        g = _norm(params[n].grad for n in names)
        assert row[f"weight_norm/{group}"] == pytest.approx(w, rel=1e-5)
        assert row[f"grad_norm/{group}"] == pytest.approx(g, rel=1e-5)
        assert row[f"update_ratio/{group}"] == pytest.approx(lr * g / w, rel=1e-4)
    # the groups partition the parameters: their norms combine to the global norm
    global_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item()
    assert math.sqrt(sum(row[f"grad_norm/{g}"] ** 2 for g in by_hand)) == pytest.approx(global_norm, rel=1e-5)
    assert sum(len(ps) for ps in layer_groups(model).values()) == len(list(model.parameters()))


def test_a_parameter_without_a_gradient_counts_as_a_zero_gradient():
    """Statistics taken before any backward pass (or of a layer no loss reached) read 0, not an error."""
    model = tiny_model()
    row = LayerStats(model).capture().after_update()
    grads = {k: v for k, v in row.items() if k.startswith("grad_norm/")}
    assert grads and all(v == 0.0 for v in grads.values())
    assert all(v > 0 for k, v in row.items() if k.startswith("weight_norm/"))


@pytest.mark.kernels
def test_the_statistics_of_bf16_weights_are_taken_in_fp32():
    """Norms of bf16 weights summed in bf16 would be off by a few parts in a thousand, and an
    update, the difference of two nearly equal weights, rounded away: both are taken in fp32."""
    model = tiny_model().to(torch.bfloat16)
    batch = _random_batch()
    model(batch.idx, batch.targets)[1].backward()
    stats = LayerStats(model).capture()
    before = {n: p.detach().double() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.05).step()
    row = stats.after_update()
    blocks = [n for n in before if n.startswith("blocks.0.")]
    w = _norm(before[n] for n in blocks)
    g = _norm(dict(model.named_parameters())[n].grad for n in blocks)
    moved = _norm(dict(model.named_parameters())[n].detach().double() - before[n] for n in blocks)
    assert row["weight_norm/0"] == pytest.approx(w, rel=1e-6)
    assert row["grad_norm/0"] == pytest.approx(g, rel=1e-6)
    assert row["update_ratio/0"] == pytest.approx(moved / w, rel=1e-5)


@pytest.mark.kernels
def test_per_layer_gradient_norms_are_taken_before_clipping(observed_run):
    """With a clip threshold, the groups' norms still add up to the unclipped global norm logged beside them."""
    rows = [r for r in read_metrics(observed_run / "metrics.jsonl") if "grad_norm/0" in r]
    assert rows and any(r["clipped"] for r in rows)
    for r in rows:
        total = math.sqrt(sum(v**2 for k, v in r.items() if k.startswith("grad_norm/")))
        assert total == pytest.approx(r["grad_norm"], rel=1e-4)


def _constructed_attention(u, v):
    """One head of size 4 whose logit between query t and key s is u[t]·v[s]/2 (no rotation)."""
    attn = Attention(GPTConfig(vocab_size=8, seq_len=len(u), n_layer=1, n_head=1, n_embd=4), layer=0)
    with torch.no_grad():
        attn.qkv.weight.zero_()
        attn.qkv.weight[0, 0] = 1.0  # q = (u_t, 0, 0, 0)
        attn.qkv.weight[4, 1] = 1.0  # k = (v_s, 0, 0, 0)
    x = torch.zeros(1, len(u), 4)
    x[0, :, 0], x[0, :, 1] = torch.tensor(u), torch.tensor(v)
    T = len(u)
    return attn, x, torch.ones(T, 4), torch.zeros(T, 4)


@pytest.mark.kernels
def test_attention_logit_max_counts_only_the_pairs_attention_allows():
    u = [1, 0, 1, 1, 1, 1, 1, 0]
    v = [1, 9, 1, 1, 1, 1, 1, 20]
    attn, x, cos, sin = _constructed_attention(u, v)
    # by hand: query t may read key s <= t; the 20 at s=7 is only visible to t=7, whose query is 0;
    # the 9 at s=1 is visible to t=2..6 (query 1): 9/2
    assert max_attention_logit(attn, x, cos, sin).item() == pytest.approx(4.5)
    # with documents [0 0 | 1 1 1 1 1 1], queries from t=2 on cannot read s=1 any more
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    assert max_attention_logit(attn, x, cos, sin, document_causal_mask(doc_ids)).item() == pytest.approx(0.5)


@pytest.mark.kernels
def test_attention_logit_max_is_the_scaled_dot_product_with_rope_and_qk_norm():
    """The whole model: the probe's maximum equals q·k/√d recomputed by hand, layer by layer."""
    model = tiny_model(qk_norm=True)
    with torch.no_grad():  # gains away from 1 so that forgetting QK-norm would show
        for block in model.blocks:
            block.attn.q_norm.weight.uniform_(0.5, 3.0)
            block.attn.k_norm.weight.uniform_(0.5, 3.0)
    batch = _random_batch()
    found = probe(model, batch)["attn_logit_max"]

    cfg = model.config
    B, T = batch.idx.shape
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.embed(batch.idx)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            h = block.attn_norm(x)
            q, k, _ = block.attn.qkv(h).split(cfg.n_embd, dim=-1)
            q = q.view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)
            k = k.view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)
            q = apply_rope(block.attn.q_norm(q), cos, sin)
            k = apply_rope(block.attn.k_norm(k), cos, sin)
            logits = q @ k.transpose(-2, -1) / math.sqrt(cfg.head_dim)
            future = torch.ones(T, T, dtype=torch.bool).triu(1)
            assert found[i].item() == pytest.approx(logits.masked_fill(future, -math.inf).max().item(), rel=1e-5)
            one_at_a_time = max_attention_logit(block.attn, h, cos, sin, max_scores=1)  # chunked over the batch
            assert one_at_a_time.item() == pytest.approx(found[i].item(), rel=1e-6)
            x = block(x, cos, sin)


@pytest.mark.kernels
@pytest.mark.parametrize("mlp", ["swiglu", "gelu", "relu2"])
def test_dead_units_are_those_never_open_on_any_token_of_the_batch(mlp):
    """One block whose MLP input is ±√C along two directions A, B; units wired by hand."""
    model = tiny_model(n_layer=1, mlp=mlp)
    hidden = model.config.mlp_hidden
    A, B = 3, 5
    with torch.no_grad():
        model.blocks[0].attn.proj.weight.zero_()  # attention adds nothing: the MLP sees the embedding
        model.embed.weight.zero_()
        model.embed.weight[A, 0] = 1.0
        model.embed.weight[B, 1] = 1.0
        pre = model.blocks[0].mlp.gate if mlp == "swiglu" else model.blocks[0].mlp.up
        pre.weight.zero_()
        pre.weight[:, :2] = 1.0  # open on A and on B
        pre.weight[0, :2] = 0.0  # never open: pre-activation exactly 0
        pre.weight[1, :2] = torch.tensor([1.0, -1.0])  # open on A only
        pre.weight[2, :2] = torch.tensor([-1.0, 1.0])  # open on B only
        pre.weight[3, :2] = -1.0  # never open
    T = 16
    idx = torch.full((3, T), A)
    idx[1, T // 2] = B  # B appears once, mid-sequence in the middle sequence
    batch = Batch(idx, idx, torch.ones(3, T, dtype=torch.bool))
    dead = probe(model, batch)["mlp_dead_frac"]
    assert dead[0].item() == pytest.approx(2 / hidden)  # units 0 and 3; unit 2 lives on one token of 48


@pytest.mark.kernels
def test_activation_rms_is_the_rms_of_each_block_output():
    model = tiny_model()
    batch = _random_batch()
    rms = probe(model, batch)["act_rms"]
    T = batch.idx.shape[1]
    x = model.embed(batch.idx)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            x = block(x, model.rope_cos[:T], model.rope_sin[:T])
            assert rms[i].item() == pytest.approx(x.square().mean().sqrt().item(), rel=1e-5)


def test_watching_a_run_does_not_change_it(tmp_path, stories_file):
    """The probe runs in eval mode: no dropout, so no random numbers drawn, so the same run."""
    runs = {}
    for every in (0, 1):
        cfg = tiny_run_config(stories_file, tmp_path / f"every{every}", steps=3, stats_every=every)
        cfg.model.dropout = 0.2
        train(cfg, log=lambda *_: None)
        runs[every] = [
            (r["loss"], r["grad_norm"])
            for r in read_metrics(tmp_path / f"every{every}" / "metrics.jsonl")
            if "loss" in r
        ]
    assert runs[0] == runs[1]


def test_gpu_peak_table_matches_the_data_sheets_and_never_mistakes_a_neighbour():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", bf16) == 989.4e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", bf16) == 756e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", fp32) == 66.9e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", fp32, tf32=True) == 494.7e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", bf16) == 312e12
    assert gpu_peak_flops("NVIDIA L40S", bf16) == 362.05e12  # not the L4
    assert gpu_peak_flops("NVIDIA L4", bf16) == 121e12
    assert gpu_peak_flops("NVIDIA GH200 480GB", bf16) == 989.4e12
    assert gpu_peak_flops("NVIDIA A10G", bf16) == 70e12  # not the A10's 125
    assert gpu_peak_flops("NVIDIA A10", bf16) == 125e12
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", fp32, tf32=True) is None  # V100 has no TF32
    assert gpu_peak_flops("Tesla T4", bf16) is None  # 65 TFLOP/s is its fp16 figure: no bf16 tensor cores
    assert gpu_peak_flops("Tesla T4", torch.float16) == 65e12
    assert gpu_peak_flops("NVIDIA H200 NVL", bf16) == 835.5e12  # not the SXM's 989.4
    assert gpu_peak_flops("NVIDIA H200", bf16) == 989.4e12
    assert gpu_peak_flops("NVIDIA B200", bf16) == 2250e12
    assert peak_flops(torch.device("cpu"), declared=1e12) == (1e12, "declared (--peak-flops)")
    measured, source = peak_flops(torch.device("cpu"))
    assert measured > 1e8 and "measured" in source


@pytest.mark.kernels
def test_step_meter_counts_clipped_steps_and_derives_mfu():
    meter = StepMeter(total_steps=10, tokens_per_step=1000, flops_per_token=6000, peak=1e9, clip=1.0, device="cpu")
    for norm in (2.0, 0.5, 1.5, 1.0):  # clipped when above the threshold
        meter.count_clipped(torch.tensor(norm))
    meter.last_time -= 2.0  # pretend the 4 steps took 2 s
    row = meter.row(4, torch.tensor(3.0), 1e-3, torch.tensor(1.0))
    assert (row["clipped"], row["clipped_steps"], row["clipped_frac"]) == (False, 2, 0.5)
    assert row["tokens_per_sec"] == pytest.approx(2000, rel=0.01)
    assert row["mfu"] == pytest.approx(2000 * 6000 / 1e9, rel=0.01)
    assert row["eta_s"] == pytest.approx(row["elapsed_s"] / 4 * 6)


@pytest.mark.kernels
def test_mfu_never_reads_above_100_percent_when_the_peak_was_measured_low():
    """A CPU peak measured while another process held a core is too low; the run's own
    throughput proves it, and the peak rises to it instead of MFU exceeding 100 %."""
    meter = StepMeter(total_steps=10, tokens_per_step=1000, flops_per_token=6000, peak=1e6, clip=1.0, device="cpu")
    meter.last_time -= 1.0
    row = meter.row(1, torch.tensor(3.0), 1e-3, torch.tensor(1.0))
    assert row["mfu"] == pytest.approx(1.0) and row["peak_flops"] == pytest.approx(1000 * 6000, rel=0.01)
    meter.last_time -= 4.0  # a slower window: measured against the raised peak
    row = meter.row(2, torch.tensor(3.0), 1e-3, torch.tensor(1.0))
    assert 0 < row["mfu"] < 0.5 and "peak_flops" not in row
