"""Mixed precision: each mechanism, and the failure it prevents.

bf16 and fp16 matrix multiplies are emulated on this CPU (slow), so every model here is tiny.
"""

import math
import warnings

import pytest
import torch
from conftest import tiny_model
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

import nanolm.precision as precision_module
import nanolm.step as step_module
from nanolm.errors import NanolmError
from nanolm.instruments.cli import main
from nanolm.optim import BF16AdamW
from nanolm.precision import (
    DynamicLossScaler,
    cpu_has_native_bf16,
    grad_subnormal_fraction,
    grad_zero_fraction,
    resolve_precision,
    rounding_seed,
    stochastic_round_to_bf16,
)
from nanolm.run.config import RunConfig
from nanolm.train import train
from nanolm.watch.sinks import read_metrics


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine run ~10x faster on one thread than on two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(path, out_dir, precision="fp32", fp32_master=False, steps=300, lr=3e-3, batch_size=16, **train_options):
    cfg = RunConfig()
    cfg.data.data, cfg.data.tokenizer = str(path), "char"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.seq_len = 1, 2, 32, 16
    cfg.optim.lr = lr
    t = cfg.train
    t.out_dir, t.sample_tokens, t.eval_batches, t.batch_size, t.steps = str(out_dir), 0, 4, batch_size, steps
    t.precision, t.fp32_master, t.log_every, t.eval_every = precision, fp32_master, steps, steps
    for k, v in train_options.items():
        setattr(t, k, v)
    return cfg


def _train_rows(out_dir):
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r]


def _round_to_nearest(x, generator=None):
    return x.to(torch.bfloat16)


# ---- bf16 weights: small updates ------------------------------------------------------------


def _thousand_updates_of_a_thousandth(master_weights=False, seed=0, n=200):
    """A bf16 weight of 1.0 under 1,000 AdamW steps of exactly +0.001 each (constant gradient -1)."""
    w = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = BF16AdamW([w], lr=1e-3, weight_decay=0.0, master_weights=master_weights, seed=seed)
    for _ in range(1000):
        w.grad = torch.full_like(w, -1.0)
        opt.step()
    return w.detach().float()


@pytest.mark.kernels
def test_a_bf16_weight_loses_small_updates_that_a_master_copy_or_stochastic_rounding_keeps():
    plain = torch.tensor(1.0, dtype=torch.bfloat16)
    for _ in range(1000):
        plain = plain + 0.001  # the next bf16 number after 1.0 is 1.0078125: every update rounds away
    assert plain.item() == 1.0

    master = _thousand_updates_of_a_thousandth(master_weights=True)
    assert torch.allclose(master, torch.full_like(master, 2.0), atol=1e-3)

    runs = torch.stack([_thousand_updates_of_a_thousandth(seed=s) for s in range(4)])
    assert runs.mean().item() == pytest.approx(2.0, abs=0.02)  # exact on average over seeds...
    assert runs.std().item() > 0.01  # ...each weight a random walk around it
    assert torch.equal(runs[0], _thousand_updates_of_a_thousandth(seed=0))  # and seeded: repeatable


def test_stochastic_rounding_picks_a_bf16_neighbour_and_is_exact_on_average():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=g) * torch.logspace(-30, 30, 64)
    x[:4] = torch.tensor([1.0, -2.5, 0.0, 3.0e38]).to(torch.bfloat16).float()  # already bf16: kept as they are
    bits = x.view(torch.int32) & -65536
    toward_zero, away = bits.view(torch.float32), (bits + 65536).view(torch.float32)
    draws = torch.stack([stochastic_round_to_bf16(x, g).float() for _ in range(4000)])
    assert ((draws == toward_zero) | (draws == away)).all()
    assert torch.equal(draws[:, :4], x[:4].expand(4000, 4))
    gap, x = (away.double() - toward_zero.double()).abs(), x.double()
    assert ((draws.double().mean(0) - x).abs() / gap).max().item() < 0.05  # unbiased, within sampling noise
    nearest = x.to(torch.bfloat16).double()
    assert ((nearest - x).abs() / gap).max().item() > 0.1  # where nearest rounding is not


def test_bf16_adamw_is_adamw_and_its_master_copy_follows_fp32_adamw_exactly():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(8, 4, generator=g).to(torch.bfloat16).float() for _ in range(5)]
    start = torch.randn(8, 4, generator=g).to(torch.bfloat16).float()
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    reference = torch.nn.Parameter(start.clone())
    ours_fp32 = torch.nn.Parameter(start.clone())
    ours_bf16 = torch.nn.Parameter(start.to(torch.bfloat16))
    ref_opt = torch.optim.AdamW([reference], **hyper)
    fp32_opt = BF16AdamW([ours_fp32], **hyper)
    bf16_opt = BF16AdamW([ours_bf16], **hyper, master_weights=True)
    for grad in grads:
        reference.grad, ours_fp32.grad, ours_bf16.grad = grad.clone(), grad.clone(), grad.to(torch.bfloat16)
        for opt in (ref_opt, fp32_opt, bf16_opt):
            opt.step()
    master = bf16_opt.state[ours_bf16]["master"]
    assert torch.equal(ours_fp32, reference)  # the same operations in the same order: bit for bit
    assert torch.equal(master, reference)
    assert torch.equal(ours_bf16.detach(), master.to(torch.bfloat16))


class _Operations(TorchDispatchMode):
    """Counts the operations dispatched that compute something (a ``_foreach_*`` call is one,
    whatever its list's length); views (reshapes, slices) launch nothing and are left out."""

    def __init__(self):
        super().__init__()
        self.count, self.names = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _operations_per_step(n_params, dtype, master_weights=False):
    params = [torch.nn.Parameter(torch.randn(3, 5).to(dtype)) for _ in range(n_params)]
    optimizer = BF16AdamW(params, lr=1e-2, weight_decay=0.1, master_weights=master_weights)
    scaler = DynamicLossScaler()
    counts = []
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(3, 5).to(dtype)
        with _Operations() as optimizer_ops:
            optimizer.step()
        with _Operations() as unscale_ops:
            scaler.unscale_(params)
        counts.append((optimizer_ops.count, unscale_ops.count))
    return counts[-1]  # the first step also creates the state


@pytest.mark.parametrize(
    "dtype, master_weights", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_an_optimizer_step_and_unscaling_cost_the_same_few_operations_for_4_or_40_parameters(dtype, master_weights):
    """``BF16AdamW`` and the loss scaler's unscaling update every parameter tensor in one
    ``torch._foreach_*`` call per operation (per device and dtype), not ~10 calls per tensor:
    on a GPU a step is a few kernel launches, not thousands for a large model."""
    few, many = _operations_per_step(4, dtype, master_weights), _operations_per_step(40, dtype, master_weights)
    assert few == many
    assert few[0] <= 20 and few[1] == 1, few  # bf16: 2 casts, 8 AdamW operations, 4 to round, 1 to copy back


def test_every_allowed_seed_seeds_the_stochastic_rounding():
    """``--seed`` goes up to 2^32 - 1. The rounding noise's generator seed was once
    ``(seed * 1_000_003 + step) * 65_537 + index``, beyond the 64 bits a generator takes for
    any seed above ~2.8e8: ``--precision bf16-pure`` failed at its first step. It is a hash now:
    it fits, it is repeatable, and it differs for every (seed, step, index)."""
    w = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    optimizer = BF16AdamW([w], lr=1e-3, seed=2**32 - 1)
    for _ in range(3):
        w.grad = torch.full_like(w, -1.0)
        optimizer.step()
    assert (w.float() > 1.0).any()
    combos = [(seed, step, index) for seed in (0, 1, 2**32 - 1) for step in (1, 2, 10**6) for index in (0, 1, 7)]
    seeds = [rounding_seed(*combo) for combo in combos]
    assert all(0 <= s < 2**63 for s in seeds) and len(set(seeds)) == len(combos)
    assert seeds == [rounding_seed(*combo) for combo in combos]


@pytest.mark.parametrize(
    "precision, fp32_master, matmul, weights, master",
    [
        ("fp32", False, torch.float32, torch.float32, None),
        ("bf16", False, torch.bfloat16, torch.float32, None),
        ("fp16", False, torch.float16, torch.float32, None),
        ("bf16-pure", False, torch.bfloat16, torch.bfloat16, None),
        ("bf16-pure", True, torch.bfloat16, torch.bfloat16, torch.float32),
    ],
)
def test_matmuls_run_in_the_chosen_format_while_optimizer_state_stays_fp32(
    tmp_path, stories_file, precision, fp32_master, matmul, weights, master
):
    seen = {"matmul": set(), "weights": set(), "state": set(), "master": set()}

    def record_linear(module, args, output):
        if isinstance(module, torch.nn.Linear) and torch.is_grad_enabled():
            seen["matmul"].add(output.dtype)

    def record_optimizer(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen["weights"].add(p.dtype)
                state = optimizer.state[p]
                seen["state"] |= {state[k].dtype for k in ("exp_avg", "exp_avg_sq")}
                seen["master"] |= {state["master"].dtype} if "master" in state else set()

    hooks = [
        torch.nn.modules.module.register_module_forward_hook(record_linear),
        register_optimizer_step_post_hook(record_optimizer),
    ]
    try:
        train(_cfg(stories_file, tmp_path / "run", precision, fp32_master, steps=2), log=lambda *_: None)
    finally:
        for h in hooks:
            h.remove()
    assert seen["matmul"] == {matmul} and seen["weights"] == {weights} and seen["state"] == {torch.float32}
    assert seen["master"] == ({master} if master else set())


# ---- fp16: loss scaling ---------------------------------------------------------------------


@pytest.mark.kernels
def test_gradients_around_1e_8_underflow_in_fp16_without_loss_scaling_and_survive_with_it():
    fp16 = resolve_precision("fp16", torch.device("cpu"))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))

    def grads(loss_scale):
        layer = torch.nn.Linear(32, 8)
        with fp16.autocast():
            y = layer(x)
        assert y.dtype == torch.float16
        (y.float().sum() * 1e-8 * loss_scale).backward()
        return layer

    expected = 1e-8 * x.sum(0)  # d(1e-8 · Σ y)/dW, the same for every output row
    unscaled = grads(1.0)
    assert grad_zero_fraction(unscaled.parameters()).item() == 1.0  # every gradient underflowed to exactly 0

    scaler = DynamicLossScaler()
    scaled = grads(scaler.loss_scale)
    scaler.unscale_(scaled.parameters())
    assert grad_zero_fraction(scaled.parameters()).item() == 0.0
    assert torch.allclose(scaled.weight.grad, expected.expand(8, 32), rtol=2e-2, atol=1e-11)
    assert torch.allclose(scaled.bias.grad, torch.full((8,), 16e-8), rtol=1e-2)


@pytest.mark.kernels
def test_the_share_below_fp16s_range_follows_from_the_format_and_the_scale_not_the_kernels():
    """The lab's and diagnose's fp16 underflow symptom: gradients as an fp32 kernel leaves them
    (no fp16 rounding at all, as on CPUs whose fp16 kernels compute in fp32) are judged by what
    fp16 would hold at the loss scale the backward pass ran at."""
    layer = torch.nn.Linear(4, 2)
    layer.weight.grad = torch.tensor([[1e-6, 3e-5, 2e-4, 0.0], [1e-9, 5e-7, 1e-3, 7e-5]])  # fp32, never rounded
    layer.bias.grad = torch.tensor([1e-2, 1e-7])
    # below 2^-14 = 6.1e-5 at scale 1: 1e-6, 3e-5, 0, 1e-9, 5e-7, 1e-7 (six of ten values)
    assert grad_subnormal_fraction(layer.parameters(), 1.0).item() == pytest.approx(0.6)
    # at nanolm's starting scale 2^16 only the exact zero stays below (1e-9 x 65536 = 6.6e-5 is just inside)
    assert grad_subnormal_fraction(layer.parameters(), 2.0**16).item() == pytest.approx(0.1)
    assert grad_zero_fraction(layer.parameters()).item() == pytest.approx(0.1)  # the old sign sees only the zero


def test_the_loss_scale_halves_on_overflow_grows_after_good_steps_and_round_trips():
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    assert [scaler.update(torch.tensor(1.0)) for _ in range(2)] == [True, True]
    assert scaler.loss_scale == 2.0**10
    assert scaler.update(torch.tensor(math.inf)) is False  # the overflow also resets the run of good steps
    assert scaler.update(torch.tensor(math.nan)) is False
    assert (scaler.loss_scale, scaler.skipped_steps) == (2.0**8, 2)
    for _ in range(3):
        scaler.update(torch.tensor(1.0))
    assert scaler.loss_scale == 2.0**9
    assert scaler.metrics() == {"loss_scale": 2.0**9, "skipped_steps": 2}

    resumed = DynamicLossScaler(growth_interval=3)
    scaler.update(torch.tensor(1.0))
    resumed.load_state_dict(scaler.state_dict())
    for s in (scaler, resumed):
        s.update(torch.tensor(1.0)), s.update(torch.tensor(1.0))
    assert resumed.state_dict() == scaler.state_dict() == {"loss_scale": 2.0**10, "good_steps": 0, "skipped_steps": 2}

    hopeless = DynamicLossScaler(init_scale=2.0)
    hopeless.update(torch.tensor(math.inf))
    with pytest.raises(NanolmError, match="overflow even without loss scaling"):
        hopeless.update(torch.tensor(math.inf))  # scale below 1: skipping forever would train nothing


def test_the_loss_scaler_is_a_no_op_outside_fp16():
    scaler = DynamicLossScaler(enabled=False)
    model = tiny_model()
    model(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(model.parameters())
    assert scaler.loss_scale == 1.0 and scaler.update(torch.tensor(math.nan)) and scaler.metrics() == {}
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


def test_an_inf_gradient_under_fp16_skips_that_step_halves_the_scale_and_training_continues(
    tmp_path, stories_file, monkeypatch
):
    real = step_module.accumulate_gradients
    calls, snapshot, unchanged = [], {}, []

    def accumulate_with_an_inf_at_step_3(model, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            unchanged.append(all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters()))
        result = real(model, *args, **kwargs)
        if len(calls) == 3:
            next(model.parameters()).grad.view(-1)[0] = math.inf
            snapshot.update({n: p.detach().clone() for n, p in model.named_parameters()})
        return result

    monkeypatch.setattr(step_module, "accumulate_gradients", accumulate_with_an_inf_at_step_3)
    out = tmp_path / "run"
    train(
        _cfg(stories_file, out, "fp16", steps=6, log_every=1, threads=1), log=lambda *_: None
    )  # a fixed count: --threads auto's trial runs (and discards) the step's pass too
    rows = _train_rows(out)
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert rows[2]["loss_scale"] == rows[1]["loss_scale"] / 2 == 2.0**15
    assert not math.isfinite(rows[2]["grad_norm"])
    assert unchanged == [True]  # the weights after step 3 are the weights before it
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows[3:])
    assert rows[-1]["loss"] < rows[0]["loss"]  # and later steps still train


@pytest.mark.kernels
def test_clipping_sees_unscaled_gradients_under_fp16(tmp_path, stories_file):
    for precision in ("fp32", "fp16"):
        cfg = _cfg(stories_file, tmp_path / precision, precision, steps=3, log_every=1)
        cfg.optim.clip = 0.05  # clipping active on every step
        train(cfg, log=lambda *_: None)
    fp32, fp16 = _train_rows(tmp_path / "fp32"), _train_rows(tmp_path / "fp16")
    assert [r["skipped_steps"] for r in fp16] == [0, 0, 0] and fp16[0]["loss_scale"] == 2.0**16
    for a, b in zip(fp32, fp16):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2)
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3)
    assert all(r["grad_norm"] > 0.05 for r in fp16)
    assert all(0.0 <= r["grad_zero_frac"] < 0.01 for r in fp16)


# ---- whole runs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, stories_file):
    out = tmp_path_factory.mktemp("fp32") / "run"
    return train(_cfg(stories_file, out), log=lambda *_: None), out


@pytest.mark.kernels
@pytest.mark.parametrize(
    "precision, fp32_master", [("bf16", False), ("fp16", False), ("bf16-pure", False), ("bf16-pure", True)]
)
def test_every_precision_trains_a_tiny_model_to_about_the_fp32_loss(
    tmp_path, stories_file, fp32_run, precision, fp32_master
):
    reference, reference_dir = fp32_run
    start = read_metrics(reference_dir / "metrics.jsonl")[0]["val_loss"]
    result = train(_cfg(stories_file, tmp_path / "run", precision, fp32_master), log=lambda *_: None)
    assert start - reference["val_loss"] > 1.5  # fp32 learned something (≈ 3.9 → 2.0 nats)
    assert result["val_loss"] == pytest.approx(reference["val_loss"], abs=0.1)


def _improvement(stories_file, out, precision="fp32", fp32_master=False):
    """How far the validation loss falls in 200 steps at a learning rate of 3e-5."""
    train(_cfg(stories_file, out, precision, fp32_master, steps=200, lr=3e-5), log=lambda *_: None)
    rows = read_metrics(out / "metrics.jsonl")
    return rows[0]["val_loss"] - rows[-1]["val_loss"]


@pytest.mark.kernels
def test_small_learning_rates_train_bf16_weights_only_with_stochastic_rounding_or_a_master_copy(
    tmp_path, stories_file, monkeypatch
):
    fp32 = _improvement(stories_file, tmp_path / "fp32")
    rounded = _improvement(stories_file, tmp_path / "sr", "bf16-pure")
    master = _improvement(stories_file, tmp_path / "master", "bf16-pure", fp32_master=True)
    monkeypatch.setattr("nanolm.optim.stochastic_round_to_bf16", _round_to_nearest)  # where BF16AdamW reads it
    nearest = _improvement(stories_file, tmp_path / "nearest", "bf16-pure")
    assert fp32 > 0.03
    assert rounded == pytest.approx(fp32, rel=0.1) and master == pytest.approx(fp32, rel=0.1)
    assert nearest < 0.5 * fp32  # updates of ~3e-5 vanish next to weights of ~0.02 (gap ~1e-4)


# ---- choosing a precision --------------------------------------------------------------------


def test_auto_is_bf16_only_where_the_hardware_multiplies_it_natively(monkeypatch):
    """bf16 on a CPU or GPU with native bf16 (measured: both speedrun targets sooner, the same
    final loss); fp16 with loss scaling on a GPU whose tensor cores are fp16 only (T4, V100);
    fp32 elsewhere: emulated bf16 is slower than fp32."""
    for native, name in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: native)
        cpu = resolve_precision("auto", torch.device("cpu"))
        assert cpu.name == name and "auto" in cpu.reason
        assert (cpu.autocast_dtype == torch.bfloat16) == native
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision("auto", torch.device("cuda")).name == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_precision("auto", torch.device("cuda")).name == "fp16"  # emulated bf16 is slow: fp16 is its format
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # so that CUDA autocast can be constructed here
    assert "only emulates bf16" in resolve_precision("bf16", torch.device("cuda")).reason
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    assert resolve_precision("auto", torch.device("cuda")).name == "fp16"
    with pytest.raises(NanolmError, match="Tesla T4.*no bf16"):
        resolve_precision("bf16-pure", torch.device("cuda"))


def test_a_precision_that_autocast_would_silently_ignore_is_an_error(monkeypatch):
    real = torch.autocast

    class IgnoringAutocast(real):
        def __init__(self, device_type, dtype=None, **kwargs):
            warnings.warn("In CPU autocast, but the target dtype is not supported. Disabling autocast.")
            super().__init__(device_type, dtype=dtype, enabled=False)

    monkeypatch.setattr(torch, "autocast", IgnoringAutocast)
    with pytest.raises(NanolmError, match="fp16 is not supported on cpu.*Disabling autocast"):
        resolve_precision("fp16", torch.device("cpu"))


TINY_CLI = [
    "--tokenizer",
    "char",
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--seq-len",
    "16",
    "--batch-size",
    "4",
    "--eval-batches",
    "2",
    "--steps",
    "4",
    "--log-every",
    "2",
    "--sample-tokens",
    "8",
]


@pytest.mark.parametrize(
    "flags, chosen",
    [
        ([], f"precision: {'bf16' if cpu_has_native_bf16() else 'fp32'} (auto: "),
        (["--precision", "fp32"], "precision: fp32 (requested)"),
        (["--precision", "bf16"], "precision: bf16 (requested"),
        (["--precision", "fp16"], "precision: fp16 (requested"),
        (["--precision", "bf16-pure"], "precision: bf16-pure (requested"),
        (["--precision", "bf16-pure", "--fp32-master"], "precision: bf16-pure (requested"),
    ],
)
def test_the_precision_flag_trains_end_to_end_and_says_what_it_chose(tmp_path, capsys, stories_file, flags, chosen):
    out = tmp_path / "run"
    assert main(["train", "--data", str(stories_file), "--out-dir", str(out), *TINY_CLI, *flags]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith(chosen)
    assert "sample:" in printed
    written = (out / "config.toml").read_text()
    assert f'precision = "{flags[1] if flags else "auto"}"' in written
    rows = _train_rows(out)
    fp16_fields = {"loss_scale", "skipped_steps", "grad_zero_frac"}
    if "fp16" in flags:
        assert all(r.keys() >= fp16_fields for r in rows) and "scale 65536, 0 skipped" in printed
    else:
        assert not any(r.keys() & fp16_fields for r in rows)
    # the saved weights load into a plain fp32 model whatever the training precision
    assert main(["sample", "--run", str(out), "--max-new-tokens", "5", "--device", "cpu"]) == 0


def test_fp32_master_without_bf16_pure_is_a_one_line_error_before_anything_is_written(tmp_path, capsys, stories_file):
    out = tmp_path / "run"
    assert main(["train", "--data", str(stories_file), "--out-dir", str(out), *TINY_CLI, "--fp32-master"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--fp32-master only applies to --precision bf16-pure" in err[0]
    assert not out.exists()
