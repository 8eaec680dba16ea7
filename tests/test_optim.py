import pytest
import torch
import torch.nn as nn
from conftest import tiny_model

from nanolm.batches import Batch
from nanolm.optim import (
    GroupedMuon,
    MuonWithAdamW,
    build_optimizer,
    get_param_groups,
    muon_available,
)
from nanolm.precision import resolve_precision
from nanolm.step import StepSetup, cosine_lr, set_learning_rate, train_step, wsd_lr


def _names(model, params):
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_param_groups_exclude_norms_and_biases():
    model = tiny_model()
    decay_group, no_decay_group = get_param_groups(model, weight_decay=0.1)
    decayed, not_decayed = _names(model, decay_group["params"]), _names(model, no_decay_group["params"])
    assert decay_group["weight_decay"] == 0.1 and no_decay_group["weight_decay"] == 0.0
    assert all("norm" not in n for n in decayed)
    assert {n for n, _ in model.named_parameters() if "norm" in n} <= not_decayed
    assert "embed.weight" in not_decayed  # the documented choice: embeddings are not decayed
    assert "blocks.0.attn.qkv.weight" in decayed and "blocks.0.mlp.down.weight" in decayed
    n_params = sum(p.numel() for g in (decay_group, no_decay_group) for p in g["params"])
    assert n_params == model.num_params()  # every parameter once, the tied head included once

    with_bias = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(3, 4))
    decay_group, no_decay_group = get_param_groups(with_bias, 0.1)
    assert _names(with_bias, decay_group["params"]) == {"0.weight"}
    assert _names(with_bias, no_decay_group["params"]) == {"0.bias", "1.weight", "1.bias", "2.weight"}


@pytest.mark.kernels
def test_bias_correction_makes_first_step_full_size():
    """Adam's moments start at zero; without bias correction the first update would be
    (1-β1)/sqrt(1-β2) ≈ 0.45 of lr. With it, every element moves by ≈ lr on step one,
    whatever the gradient's scale."""
    lr = 1e-2
    for scale in (1e-6, 1.0, 1e4):
        w = nn.Parameter(torch.zeros(100))
        opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        w.grad = scale * torch.randn(100).sign()
        opt.step()
        torch.testing.assert_close(w.detach().abs(), torch.full((100,), lr), rtol=1e-4, atol=0)
    # the optimizer nanolm builds behaves the same
    model = tiny_model()
    before = model.blocks[0].attn.qkv.weight.detach().clone()
    opt = build_optimizer(model, lr=lr, weight_decay=0.0)
    _, loss = model(torch.randint(64, (2, 8)), targets=torch.randint(64, (2, 8)))
    loss.backward()
    opt.step()
    moved = (model.blocks[0].attn.qkv.weight.detach() - before).abs()
    moving = model.blocks[0].attn.qkv.weight.grad.abs() > 1e-6
    assert moved[moving].mean().item() == pytest.approx(lr, rel=0.02)


@pytest.mark.kernels
def test_cosine_lr_warms_up_linearly_then_decays_to_min_lr():
    lrs = [cosine_lr(s, max_lr=1.0, warmup_steps=10, total_steps=110) for s in range(1, 131)]  # lrs[i]: step i + 1
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(b > a for a, b in zip(lrs[:10], lrs[1:10]))  # strictly rising warmup
    assert lrs[10] == pytest.approx(1.0)
    assert all(b <= a for a, b in zip(lrs[10:110], lrs[11:111]))  # then never rising
    assert lrs[60] == pytest.approx(0.55)  # half-way through the cosine: midpoint of 1.0 and 0.1
    assert lrs[110] == pytest.approx(0.1) and lrs[129] == pytest.approx(0.1)  # the floor
    assert cosine_lr(200, 1.0, 10, 110, min_lr=0.0) == 0.0
    assert cosine_lr(1, 3e-3, 0, 100) == pytest.approx(3e-3)  # no warmup: full rate at once


@pytest.mark.kernels
def test_wsd_lr_holds_the_peak_then_decays_in_a_straight_line_to_min_lr_over_the_last_fraction():
    lrs = [
        wsd_lr(s, max_lr=1.0, warmup_steps=10, total_steps=100, min_lr=0.1, decay_fraction=0.3) for s in range(1, 121)
    ]  # lrs[i]: step i + 1
    assert lrs[:10] == [cosine_lr(s, 1.0, 10, 100, 0.1) for s in range(1, 11)]  # the same warmup as the cosine
    assert lrs[10:71] == [1.0] * 61  # stable: the peak until the decay starts at step 100 - 30
    assert lrs[85] == pytest.approx(0.55)  # half-way down the line: the midpoint of 1.0 and 0.1
    steps_down = [a - b for a, b in zip(lrs[70:100], lrs[71:101])]
    assert steps_down == pytest.approx([0.9 / 30] * 30)  # a straight line, equal steps
    assert lrs[100] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)  # the floor, and it stays
    assert wsd_lr(51, 1.0, 10, 100, min_lr=0.0, decay_fraction=1.0) == pytest.approx(5 / 9)  # all decay: linear
    assert wsd_lr(11, 1.0, 10, 100, min_lr=0.0, decay_fraction=0.99) == 1.0  # a decay longer than the rest starts
    assert wsd_lr(56, 1.0, 10, 100, min_lr=0.0, decay_fraction=0.99) == pytest.approx(0.5)  # at the peak, after warmup


@pytest.mark.kernels
def test_the_fused_adamw_nanolm_builds_on_cpu_follows_the_textbook_update():
    """build_optimizer uses the fused AdamW kernel on CPU (one pass per tensor instead of ~10
    operations); it must be the same algorithm as PyTorch's reference loop over tensors."""
    fused_model, loop_model = tiny_model(), tiny_model()
    fused = build_optimizer(fused_model, lr=1e-2, weight_decay=0.1)
    assert all(group["fused"] for group in fused.param_groups)
    loop = torch.optim.AdamW(get_param_groups(loop_model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        idx, targets = torch.randint(64, (4, 16), generator=g), torch.randint(64, (4, 16), generator=g)
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            model(idx, targets=targets)[1].backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ Muon beside AdamW
muon = pytest.mark.skipif(not muon_available(), reason="torch.optim.Muon needs PyTorch >= 2.9")
HIDDEN = ("attn.qkv.weight", "attn.proj.weight", "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight")


@muon
@pytest.mark.parametrize("tied", [True, False])
def test_muon_takes_the_hidden_matrices_and_adamw_everything_else(tied):
    """Every parameter in exactly one group; Muon gets no vector, no embedding, no output head
    (orthogonalising a lookup table's or the vocabulary's update makes no sense)."""
    model = tiny_model(tie_embeddings=tied)
    opt = MuonWithAdamW(model, lr=1e-3, weight_decay=0.1)
    in_muon = [p for g in opt.muon.param_groups for p in g["params"]]
    everything = [p for g in opt.param_groups for p in g["params"]]
    assert len({id(p) for p in everything}) == len(everything)  # nothing in two groups
    assert {id(p) for p in everything} == {id(p) for p in model.parameters()}  # nothing left out
    assert _names(model, in_muon) == {n for n, _ in model.named_parameters() if n.endswith(HIDDEN)}
    assert all(p.dim() == 2 for p in in_muon)
    assert id(model.embed.weight) not in {id(p) for p in in_muon}
    assert id(model.lm_head.weight) not in {id(p) for p in in_muon}
    decayed = _names(model, opt.adamw.param_groups[0]["params"])
    assert opt.adamw.param_groups[0]["weight_decay"] == 0.1 and opt.adamw.param_groups[1]["weight_decay"] == 0.0
    assert decayed == (set() if tied else {"lm_head.weight"})  # an untied head is decayed, as under AdamW
    assert "optimizer: Muon on 10 hidden matrices" in opt.describe(model)


@muon
def test_a_muon_update_is_orthogonal_and_the_size_of_an_adamw_update_at_the_same_rate():
    """Muon's step on a matrix is (close to) an orthogonal matrix, whatever the gradient's size,
    scaled so that its RMS is about AdamW's (0.2 lr): the same --lr means a step of the same size."""
    model, lr = tiny_model(), 1e-2
    opt = MuonWithAdamW(model, lr=lr, weight_decay=0.0)
    w = model.blocks[0].mlp.up.weight  # 64 x 32
    before = w.detach().clone()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-4  # a tiny gradient: Adam and Muon both ignore its scale
    opt.step()
    update = (w.detach() - before) / lr
    rms = update.pow(2).mean().sqrt().item()
    assert 0.12 < rms < 0.25, rms
    singular = torch.linalg.svdvals(update.double())
    assert singular.max() / singular.min() < 2  # all directions move alike (measured 1.6; the gradient itself: 3.2)


@pytest.mark.kernels
@muon
@pytest.mark.parametrize(
    "options",
    [
        dict(adjust_lr_fn="match_rms_adamw"),
        dict(adjust_lr_fn="original", nesterov=False, momentum=0.9),
        dict(adjust_lr_fn=None, weight_decay=0.0),
    ],
    ids=["match_rms_adamw", "original_no_nesterov", "default_no_decay"],
)
@pytest.mark.parametrize("small_batches", [False, True])
def test_grouped_muon_takes_the_steps_of_torch_muon(options, small_batches, monkeypatch):
    """Orthogonalising the matrices of one shape together is the same algorithm as PyTorch's
    Muon, one matrix at a time: the same parameters after several steps (tall, wide, square
    and one-of-a-kind shapes; two groups with their own rates, decay and momentum; a matrix
    without a gradient; the rate changed between steps as the schedule does; batches split
    when a shape holds many elements), and a state that loads into either optimizer."""
    monkeypatch.setattr("nanolm.precision.cpu_has_native_bf16", lambda: True)  # bf16, as PyTorch's
    if small_batches:
        monkeypatch.setattr(GroupedMuon, "BATCH_ELEMENTS", 700)  # 1 or 2 matrices a batch
    shapes = [(48, 16), (16, 16), (40, 16), (40, 16), (16, 40), (48, 16), (24, 40), (40, 16)]

    def groups():
        torch.manual_seed(0)
        matrices = [nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
        return [
            {"params": matrices[:5]},
            {"params": matrices[5:], "lr": 1e-2, "weight_decay": 0.05, "momentum": 0.8, "nesterov": True},
        ]

    defaults = dict(lr=3e-2, weight_decay=0.1) | options
    ours, theirs = groups(), groups()
    grouped, reference = GroupedMuon(ours, **defaults), torch.optim.Muon(theirs, **defaults)
    mine = [p for g in ours for p in g["params"]]
    torchs = [p for g in theirs for p in g["params"]]
    for step in range(4):
        for i, (a, b) in enumerate(zip(mine, torchs)):
            a.grad = None if (i == 2 and step == 1) else torch.randn(a.shape)
            b.grad = None if a.grad is None else a.grad.clone()
        for optimizer in (grouped, reference):
            optimizer.param_groups[0]["lr"] = 3e-2 * (1 - step / 8)
        start = [p.detach().clone() for p in torchs]
        grouped.step()
        reference.step()
        for a, b, s in zip(mine, torchs, start):
            # bf16 products: allow their rounding (measured: identical to the bit on this CPU)
            assert (a - b).norm() <= 1e-3 * (b - s).norm() + 1e-12
    ours_state, theirs_state = grouped.state_dict(), reference.state_dict()
    assert ours_state["param_groups"] == theirs_state["param_groups"]
    for i in range(len(shapes)):
        torch.testing.assert_close(
            ours_state["state"][i]["momentum_buffer"], theirs_state["state"][i]["momentum_buffer"], rtol=1e-3, atol=1e-5
        )
    resumed = GroupedMuon(groups(), **defaults)  # a checkpoint of PyTorch's Muon resumes here
    resumed.load_state_dict(theirs_state)
    for i in range(len(shapes)):
        assert torch.equal(
            resumed.state_dict()["state"][i]["momentum_buffer"], theirs_state["state"][i]["momentum_buffer"]
        )


@muon
def test_muon_orthogonalises_in_fp32_on_a_cpu_without_native_bf16(monkeypatch):
    """Where bf16 products are emulated (~1 GFLOP/s), Newton-Schulz in bf16 would cost seconds
    a step: it runs in fp32 there, and gives PyTorch's bf16 update up to bf16's rounding."""
    import nanolm.optim

    seen = []
    iteration = nanolm.optim.newton_schulz_batched
    monkeypatch.setattr(
        nanolm.optim, "newton_schulz_batched", lambda x, *args: seen.append(args[-1]) or iteration(x, *args)
    )
    monkeypatch.setattr("nanolm.precision.cpu_has_native_bf16", lambda: False)
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(40, 16) * 0.02), nn.Parameter(torch.randn(16, 16) * 0.02)]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape)
        b.grad = a.grad.clone()
    GroupedMuon(ours, lr=3e-2, weight_decay=0.0, adjust_lr_fn="match_rms_adamw").step()
    torch.optim.Muon(theirs, lr=3e-2, weight_decay=0.0, adjust_lr_fn="match_rms_adamw").step()
    assert seen == [torch.float32, torch.float32]  # one batch per shape
    for a, b, s in zip(ours, theirs, start):
        assert (a - b).norm() <= 5e-2 * (b - s).norm()  # measured 2.2 %: five iterations of bf16 rounding


@muon
def test_the_run_options_momentum_and_betas_reach_both_optimizers():
    """The speedrun configs set Muon's momentum (0.9) and AdamW's beta2 (0.99) away from their
    defaults; an optimizer built with the defaults instead would still train, just slower to the
    target, and nothing else would say so."""
    from pathlib import Path

    from nanolm.optim import optimizer_for
    from nanolm.run.config import load_run_config

    configs = Path(__file__).resolve().parents[1] / "configs"
    for name in ("speedrun_tinystories.toml", "speedrun_cpu.toml", "tinystories_60s.toml", "tinystories_5min.toml"):
        cfg = load_run_config(configs / name)
        options = cfg.optim
        opt = optimizer_for(tiny_model(), cfg, resolve_precision("fp32", torch.device("cpu")))
        assert [g["momentum"] for g in opt.muon.param_groups] == [options.muon_momentum] == [0.9]
        assert {g["betas"] for g in opt.adamw.param_groups} == {(options.beta1, options.beta2)} == {(0.9, 0.99)}


@pytest.mark.kernels
@muon
def test_each_group_runs_at_its_own_peak_on_the_shared_schedule():
    """The schedule's rate times the group's own ratio: Muon's matrices at --muon-lr's share,
    AdamW's groups at --lr's; the ratio is the current run's even after loading an older state."""
    model = tiny_model()
    opt = MuonWithAdamW(model, lr=1e-3, weight_decay=0.1, muon_lr=3e-3)
    setup = StepSetup(model=model, optimizer=opt, schedule=lambda step: 5e-4)
    batch = Batch(torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32)), torch.ones(2, 32, dtype=torch.bool))
    train_step(setup, 1, [batch])
    assert [g["lr"] for g in opt.muon.param_groups] == [pytest.approx(1.5e-3)]
    assert [g["lr"] for g in opt.adamw.param_groups] == [5e-4, 5e-4]
    resumed = MuonWithAdamW(tiny_model(), lr=1e-3, weight_decay=0.1, muon_lr=2e-3)  # --muon-lr changed on resume
    resumed.load_state_dict(opt.state_dict())
    set_learning_rate(resumed, 5e-4)
    assert [g["lr"] for g in resumed.muon.param_groups] == [pytest.approx(1e-3)]


@pytest.mark.kernels
def test_the_schedule_counts_steps_from_one_like_the_loop_and_refuses_step_zero():
    """The loop's first step is step 1 and the schedule's too: its rate is the first of the
    warmup, not 0. A caller still counting from 0 gets an error, not a silent step at rate 0."""
    assert cosine_lr(1, 1.0, 10, 100) == pytest.approx(0.1) and wsd_lr(1, 1.0, 10, 100) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="count from 1"):
        cosine_lr(0, 1.0, 10, 100)


def test_adamw_without_compile_guards_takes_torchs_adamw_steps_to_the_bit():
    """nanolm's AdamW calls PyTorch's own step, zero_grad and state functions without the wrappers
    that import the compiler (``WithoutCompileGuards``): the same updates, to the bit, under the
    same gradient mode (none recorded), and a state that loads into either."""
    from nanolm.optim import AdamW

    torch.manual_seed(0)
    models = [tiny_model(), tiny_model()]
    models[1].load_state_dict(models[0].state_dict())
    opts = [
        cls(m.parameters(), lr=1e-2, weight_decay=0.1, fused=True) for cls, m in zip((AdamW, torch.optim.AdamW), models)
    ]
    x = torch.randint(0, 64, (2, 16))
    for step in range(3):
        for model, opt in zip(models, opts):
            model(x, targets=x)[1].backward()
            opt.step()
            opt.zero_grad()
        if step == 1:  # each loads the other's state
            states = [o.state_dict() for o in opts]
            opts[0].load_state_dict(states[1])
            opts[1].load_state_dict(states[0])
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b) and a.grad_fn is None
    assert all(p.grad is None for p in models[0].parameters())
