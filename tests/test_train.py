import contextlib
import math
import os

import numpy as np
import pytest
import torch
from conftest import tiny_model
from torch.optim.optimizer import register_optimizer_step_pre_hook

from nanolm.batches import Batch, Split, eval_batches, get_batch
from nanolm.evaluate import estimate_loss
from nanolm.machine.runtime import configure_threads
from nanolm.model import masked_cross_entropy_sum
from nanolm.run.config import RunConfig
from nanolm.step import accumulate_gradients, cosine_lr, counted_tokens, wsd_lr
from nanolm.train import train
from nanolm.watch.sinks import read_metrics


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _uneven_batch(seed=0, B=8, T=16, V=64):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(V, (B, T), generator=g)
    targets = torch.randint(V, (B, T), generator=g)
    counted = torch.tensor([0, 0, 1, 16, 3, 16, 7, 2])  # rows 0-1: nothing counted at all
    loss_mask = torch.arange(T)[None, :] < counted[:, None]
    return Batch(idx, targets, loss_mask)


def _rows(batch, rows):
    return Batch(batch.idx[rows], batch.targets[rows], batch.loss_mask[rows])


@pytest.mark.kernels
def test_grad_accum_equals_one_big_batch_with_uneven_token_counts():
    big = _uneven_batch()
    model = tiny_model()
    count_big = counted_tokens([big])
    loss_big = accumulate_gradients(model, [big], count_big) / count_big
    grads_big = _grads(model)
    model.zero_grad()
    micro = [_rows(big, slice(i, i + 2)) for i in range(0, 8, 2)]  # the first holds no counted token
    count_acc = counted_tokens(micro)  # the step's count, taken once over every micro-batch
    loss_acc = accumulate_gradients(model, micro, count_acc) / count_acc
    grads_acc = _grads(model)
    assert count_big == count_acc == 45
    assert loss_acc.item() == pytest.approx(loss_big.item(), rel=1e-6)
    assert ((grads_acc - grads_big).abs().max() / grads_big.abs().max()).item() < 1e-6
    assert torch.isfinite(grads_acc).all()

    # the tempting alternative, a mean of per-micro-batch means, is measurably different
    model.zero_grad()
    for m in micro[1:]:
        logits, _ = model(m.idx)
        total, count = masked_cross_entropy_sum(logits, m.targets, m.loss_mask)
        (total / count / 3).backward()
    assert ((_grads(model) - grads_big).abs().max() / grads_big.abs().max()).item() > 1e-2


def _tiny_cfg(path, out_dir, **train):
    cfg = RunConfig()
    cfg.data.data, cfg.data.tokenizer = str(path), "char"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.seq_len = 1, 2, 32, 32
    cfg.train.out_dir, cfg.train.sample_tokens, cfg.train.eval_batches = str(out_dir), 0, 2
    cfg.train.log_every = 1
    cfg.train.precision = "fp32"  # these tests compare against fp32 arithmetic done by hand
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


@pytest.mark.kernels
def test_batch_times_4_equals_grad_accum_4_in_the_training_loop(tmp_path, stories_file):
    train(_tiny_cfg(stories_file, tmp_path / "big", steps=3, batch_size=8, grad_accum=1), log=lambda *_: None)
    train(_tiny_cfg(stories_file, tmp_path / "acc", steps=3, batch_size=2, grad_accum=4), log=lambda *_: None)
    rows_big = [r for r in read_metrics(tmp_path / "big" / "metrics.jsonl") if "loss" in r]
    rows_acc = [r for r in read_metrics(tmp_path / "acc" / "metrics.jsonl") if "loss" in r]
    for a, b in zip(rows_big, rows_acc):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert rows_big[0]["grad_norm"] == pytest.approx(rows_acc[0]["grad_norm"], rel=1e-5)


def test_gradients_are_clipped_once_per_step_after_every_backward_pass(tmp_path, stories_file, monkeypatch):
    events = []
    original_backward, original_clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_

    def backward(self, *a, **k):
        events.append("backward")
        return original_backward(self, *a, **k)

    def clip(*a, **k):
        events.append("clip")
        return original_clip(*a, **k)

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    handle = register_optimizer_step_pre_hook(lambda *a: events.append("step"))
    cfg = _tiny_cfg(stories_file, tmp_path / "run", steps=3, batch_size=2, grad_accum=3)
    cfg.train.threads = torch.get_num_threads()  # a fixed count: --threads auto's trial passes are not the step's
    try:
        train(cfg, log=lambda *_: None)
    finally:
        handle.remove()
    assert events == ["backward", "backward", "backward", "clip", "step"] * 3


@pytest.mark.kernels
def test_clipping_limits_the_update_to_the_clip_norm(tmp_path, stories_file):
    cfg = _tiny_cfg(stories_file, tmp_path / "run", steps=2, batch_size=2)
    cfg.optim.clip = 1e-3
    norms_seen_by_the_optimizer = []

    def record(optimizer, *_):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norms_seen_by_the_optimizer.append(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads])).item()
        )

    handle = register_optimizer_step_pre_hook(record)
    try:
        train(cfg, log=lambda *_: None)
    finally:
        handle.remove()
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "grad_norm" in r]
    assert all(r["grad_norm"] > 1e-3 for r in rows)  # logged norm is the one *before* clipping
    assert len(norms_seen_by_the_optimizer) == 2
    assert all(n == pytest.approx(1e-3, rel=1e-4) for n in norms_seen_by_the_optimizer)  # the one *after*


@pytest.mark.kernels
def test_estimate_loss_is_deterministic_and_equals_a_direct_computation():
    model = tiny_model(dropout=0.2)  # with dropout, an evaluation left in training mode is random and too high
    model.train()  # estimate_loss must switch to eval mode itself and back
    tokens = np.random.default_rng(0).integers(1, 64, size=500)
    split = Split(tokens, np.zeros(0), 0)
    batches = eval_batches(split, 32, 4, eos_id=0, doc_mask=False)
    token_bytes = torch.ones(64, dtype=torch.long)
    first = estimate_loss(model, batches, token_bytes)
    second = estimate_loss(model, batches, token_bytes)
    assert first == second and model.training
    assert first["tokens"] == 499
    model.eval()
    with torch.no_grad():
        total = sum(masked_cross_entropy_sum(model(b.idx)[0], b.targets, b.loss_mask)[0].item() for b in batches)
    assert first["loss"] == pytest.approx(total / 499, rel=1e-6)
    assert first["bpb"] == pytest.approx(first["loss"] / math.log(2), rel=1e-9)  # one byte per token here


def test_get_batch_returns_windows_and_their_next_tokens():
    tokens = np.arange(1000)
    x, y = get_batch(tokens, 6, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (6, 16)
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one token
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows


def test_training_stops_at_the_first_evaluation_that_reaches_the_target(tmp_path, stories_file):
    """--target-val-bpb ends the run at the first evaluation at or below it, like --steps would:
    the checkpoint, the final weights and the metrics all stop at that step."""
    cfg = _tiny_cfg(stories_file, tmp_path / "run", steps=12, batch_size=2, eval_every=4)
    cfg.train.target_val_bpb = 100.0  # any trained model is below 100 bits per byte
    result = train(cfg, log=lambda *_: None)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert result["step"] == 4 and rows[-1]["step"] == 4 and rows[-1]["val_bpb"] <= 100.0
    assert (tmp_path / "run" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "checkpoints" / "step_000004").is_dir()

    cfg = _tiny_cfg(stories_file, tmp_path / "unreached", steps=8, batch_size=2, eval_every=4)
    cfg.train.target_val_bpb = 1e-3
    assert train(cfg, log=lambda *_: None)["step"] == 8


def test_threads_are_set_and_a_busy_cpu_gets_a_hint_only_when_our_threads_would_wait(monkeypatch):
    import os

    before = torch.get_num_threads()
    cpu = torch.device("cpu")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    try:

        def hints(threads, load, device=cpu):
            monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
            lines = []
            configure_threads(threads, device, lines.append)
            return lines

        assert hints(1, 1.9) == [] and torch.get_num_threads() == 1  # one thread never waits on another
        busy = hints(2, 1.0)
        assert torch.get_num_threads() == 2 and len(busy) == 1 and "--threads 1" in busy[0]
        assert hints(2, 0.2) == []  # our own thread's share of the load: nobody else is there
        assert hints(2, 1.0, torch.device("meta")) == []  # not a CPU run: nothing to say
    finally:
        torch.set_num_threads(before)


@pytest.mark.kernels
def test_each_update_uses_exactly_its_own_steps_gradients(tmp_path, stories_file, monkeypatch):
    """The gradients the optimizer sees at a step are exactly those of that step's micro-batches
    at the weights before the update, with nothing of the previous steps added in: a forgotten
    ``zero_grad`` still trains (the old gradients act as a heavy, unwanted momentum), just
    worse. That the micro-batches add up to one big batch is the grad-accumulation test above."""
    import nanolm.step as step_module

    steps, original = [], step_module.accumulate_gradients

    def recording(model, micro_batches, *args, **kwargs):
        steps.append(
            {
                "model": model,
                "batches": micro_batches,
                "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            }
        )
        return original(model, micro_batches, *args, **kwargs)

    def seen_by_the_optimizer(*_):
        steps[-1]["grads"] = {n: p.grad.detach().clone() for n, p in steps[-1]["model"].named_parameters()}

    monkeypatch.setattr(step_module, "accumulate_gradients", recording)
    handle = register_optimizer_step_pre_hook(seen_by_the_optimizer)
    cfg = _tiny_cfg(
        stories_file, tmp_path / "run", steps=3, batch_size=2, grad_accum=2, stats_every=0, threads=1
    )  # a fixed count: --threads auto's trial runs (and discards) the step's pass too
    cfg.optim.clip = 0.0  # the optimizer then sees the raw accumulated gradients
    try:
        train(cfg, log=lambda *_: None)
    finally:
        handle.remove()
    assert len(steps) == 3 and all("grads" in s for s in steps)
    model = steps[0]["model"]
    for step in steps[1:]:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(step["weights"][name])
        model.zero_grad(set_to_none=True)
        original(model, step["batches"], counted_tokens(step["batches"]))
        for name, p in model.named_parameters():
            assert torch.allclose(step["grads"][name], p.grad, rtol=1e-5, atol=1e-8), name


@pytest.mark.kernels
@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_every_step_runs_at_its_scheduled_lr_with_the_configured_optimizer_settings(tmp_path, stories_file, schedule):
    """An LR one step late, swapped betas, a decay that never reaches the optimizer or a
    --schedule that is accepted and ignored all still train; only the numbers the optimizer
    actually holds at each step tell them apart."""
    held = []

    def record(optimizer, *_):
        held.append([(g["lr"], g["betas"], g["weight_decay"], len(g["params"])) for g in optimizer.param_groups])

    cfg = _tiny_cfg(stories_file, tmp_path / "run", steps=8, batch_size=2)
    cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup = 2e-3, 2e-4, 3
    cfg.optim.beta1, cfg.optim.beta2, cfg.optim.weight_decay = 0.8, 0.9, 0.05
    cfg.optim.schedule, cfg.optim.decay_fraction = schedule, 0.5
    expected = (
        [cosine_lr(step, 2e-3, 3, 8, 2e-4) for step in range(1, 9)]
        if schedule == "cosine"
        else [wsd_lr(step, 2e-3, 3, 8, 2e-4, decay_fraction=0.5) for step in range(1, 9)]
    )
    handle = register_optimizer_step_pre_hook(record)
    try:
        train(cfg, log=lambda *_: None)
    finally:
        handle.remove()
    assert len(held) == 8
    for step, groups in enumerate(held):
        assert [g[0] for g in groups] == [pytest.approx(expected[step], rel=1e-12)] * 2
        assert [g[1] for g in groups] == [(0.8, 0.9)] * 2
        assert [g[2] for g in groups] == [0.05, 0.0]  # matrices decayed; norms and the embedding not
    logged = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "lr" in r}
    assert logged and all(lr == pytest.approx(held[step - 1][0][0], rel=1e-6) for step, lr in logged.items())


def test_the_logged_tokens_are_the_tokens_the_steps_trained_on(tmp_path, stories_file, monkeypatch):
    """tokens/s, MFU and the tokens column all rest on tokens per step; counting one
    micro-batch instead of all of them makes a run look grad_accum times slower."""
    import nanolm.step as step_module

    fed, original = [], step_module.accumulate_gradients

    def counting(model, micro_batches, *args, **kwargs):
        fed.append((fed[-1] if fed else 0) + sum(b.idx.numel() for b in micro_batches))
        return original(model, micro_batches, *args, **kwargs)

    monkeypatch.setattr(step_module, "accumulate_gradients", counting)
    train(
        _tiny_cfg(stories_file, tmp_path / "run", steps=4, batch_size=2, grad_accum=3, threads=1), log=lambda *_: None
    )  # a fixed count: --threads auto's trial runs (and discards) the step's pass too
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["tokens_per_step"] == 2 * 3 * 32
    trained = [r for r in rows if "tokens_per_sec" in r]
    assert len(trained) == 4 and all(r["tokens"] == fed[r["step"] - 1] for r in trained)


def test_a_run_whose_final_model_outputs_nan_is_not_a_success(tmp_path, stories_file, capsys):
    """``--on-nan skip`` skips every non-finite step to the end; the weights stay finite, the
    model's validation loss does not. That run failed: exit 2, and no final weights claim
    otherwise (also when the same command is run again)."""
    from nanolm.instruments.cli import main

    argv = [
        "train",
        "--data",
        str(stories_file),
        "--out-dir",
        str(tmp_path / "run"),
        "--tokenizer",
        "char",
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
        "0",
        "--steps",
        "30",
        "--eval-every",
        "10",
        "--lr",
        "100",
        "--warmup",
        "0",
        "--on-nan",
        "skip",
        "--threads",
        "1",
    ]
    for _ in range(2):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "the final model's validation loss is nan" in err[0]
        assert not (tmp_path / "run" / "final.json").exists()


@pytest.mark.kernels
@pytest.mark.exhaustive  # ~20 s of compiling a fresh machine pays: CI runs it on every kernel path, -m kernels
def test_a_compiled_step_follows_the_eager_step():
    """``--compile`` runs the same step: the compiled blocks give eager's loss and updated
    weights (to float32 reordering; SGD, because Adam's first update is lr·sign(g) and a
    gradient element near zero may change sign when the sums are reordered). On CPU too,
    where the compile is the slow part."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from nanolm.batches import pack_windows
    from nanolm.model import compile_blocks
    from nanolm.step import StepSetup, train_step

    if not pick_vec_isa():
        pytest.skip(
            "torch.compile's C++ for this step does not build without a vector unit (PyTorch 2.13 writes "
            "at::vec into a reduction and leaves its header out; seen under ATEN_CPU_CAPABILITY=default)"
        )
    tokens = np.random.default_rng(0).integers(1, 64, size=2000)
    tokens[::37] = 0  # documents, so the mask path is compiled too
    batch = pack_windows(tokens, np.array([0, 100, 200, 300]), 32, eos_id=0)
    results = []
    for compile in (False, True):
        model = tiny_model(n_layer=2)
        if compile:
            compile_blocks(model)  # what --compile does
        setup = StepSetup(model, torch.optim.SGD(model.parameters(), lr=1.0), schedule=lambda step: 1.0)
        results.append((train_step(setup, 1, [batch]).loss.item(), [p.detach().clone() for p in model.parameters()]))
    (eager_loss, eager_weights), (compiled_loss, compiled_weights) = results
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    start = [p.detach() for p in tiny_model(n_layer=2).parameters()]
    for a, b, s in zip(eager_weights, compiled_weights, start):
        # the step moved the weights (PyTorch 2.11 compiled a step with the right loss and no gradient at
        # all), and the compiled step's update is eager's up to float32 reordering (measured ~1e-6 of it)
        assert (b - a).norm() <= 1e-5 * (a - s).norm() + 1e-12 and not torch.equal(b, s)


def test_a_run_says_what_it_trains_and_a_continued_one_where_it_continues(tmp_path, stories_file):
    from nanolm.data.shards import PreparedData

    out = tmp_path / "run"
    said = []
    train(_tiny_cfg(stories_file, out, steps=4, batch_size=3, eval_every=2, ckpt_every=2, threads=1), log=said.append)
    vocab = PreparedData(out / "data").tokenizer.vocab_size
    from nanolm.model import GPT

    n_params = GPT(_tiny_cfg(stories_file, out).model.gpt_config(vocab)).num_params()
    assert (
        f"model: {n_params / 1e6:.2f}M parameters | char vocabulary of {vocab} | {3 * 32} tokens per step | "
        f"device cpu | run dir {out}" in said
    )
    assert "precision: fp32 (requested)" in said and any(line.startswith("MFU: ") for line in said)
    assert not [line for line in said if line.startswith(("resumed from", "warning:"))]
    said.clear()
    train(_tiny_cfg(stories_file, out, steps=6, batch_size=3, eval_every=2, ckpt_every=2, threads=1), log=said.append)
    assert f"resumed from {out / 'checkpoints' / 'step_000004'} at step 4" in said


def test_a_validation_split_shorter_than_a_window_is_said_once_at_the_start(tmp_path):
    source = tmp_path / "docs.txt"  # every tenth document is held out: here each of them is two characters
    source.write_text(
        "\n<|endoftext|>\n".join("ab" if i % 10 == 9 else f"story {i}: " + "the cat sat. " * 12 for i in range(40))
    )
    said = []
    train(_tiny_cfg(source, tmp_path / "run", steps=2, batch_size=2, threads=1), log=said.append)
    assert (
        said.count("warning: the validation split is shorter than one window; no validation loss will be reported") == 1
    )


def _split(n_tokens: int) -> Split:
    tokens = (np.arange(n_tokens) * 7 % 50 + 1).astype(np.uint16)
    tokens[::13] = 0  # a document boundary (EOS) every 13 tokens
    return Split(tokens, np.flatnonzero(tokens == 0).astype(np.int64), n_tokens)


def test_the_training_stream_and_validation_set_are_built_with_every_data_option_of_the_run():
    """build_batches hands each option of the config to the part that acts on it, none left at
    that part's own default: a packing option dropped there trains on other windows than the run
    recorded, and nothing downstream could tell."""
    from types import SimpleNamespace

    from nanolm.distributed import Distributed
    from nanolm.train import Factories, build_batches

    cfg = RunConfig()
    cfg.model.seq_len = 8
    cfg.train.batch_size, cfg.train.grad_accum, cfg.train.seed, cfg.train.eval_windows = 2, 3, 7, 5
    cfg.data.doc_mask, cfg.data.reset_positions, cfg.data.mask_boundary, cfg.data.random_offset = (
        False,
        True,
        True,
        True,
    )
    data = SimpleNamespace(train=_split(300), val=_split(120), tokenizer=SimpleNamespace(eos_id=0))
    seen = {}

    def batches(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return "the stream"

    stream, val = build_batches(cfg, Distributed(rank=1, world_size=2), data, Factories(batches=batches))
    tokens, sampler, seq_len, eos_id, grad_accum = seen["args"]
    pack = dict(doc_mask=False, reset_positions=True, mask_boundary=True)
    assert stream == "the stream" and seen["kwargs"] == pack
    assert tokens is data.train.tokens and (seq_len, eos_id, grad_accum) == (8, 0, 3)
    assert (sampler.n_windows, sampler.seq_len, sampler.batch_size, sampler.seed) == ((300 - 1 - 8) // 8, 8, 2, 7)
    assert (sampler.random_offset, sampler.rank, sampler.world_size) == (True, 1, 2)
    expected = eval_batches(data.val, 8, 2, 0, max_windows=5, **pack)
    assert len(val) == len(expected) == 3  # five windows, two a batch
    for got, want in zip(val, expected):
        for name in ("idx", "targets", "loss_mask", "doc_ids", "positions"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure", "fp16"])
def test_the_model_is_built_with_the_runs_precision_seed_and_optimizer(precision, monkeypatch):
    """build_model: weights stored in bf16 only under pure bf16, a loss scaler only for fp16,
    every rank but the first on its own random stream after the model is built, the optimizer's
    split said once, and compiled only when asked."""
    from nanolm.distributed import Distributed
    from nanolm.machine.runtime import derived_seed, seed_everything
    from nanolm.model import _run_block
    from nanolm.precision import Precision
    from nanolm.train import Factories, build_model

    cfg = RunConfig()
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.model.seq_len = 1, 32, 2, 16
    cfg.train.seed, cfg.optim.optimizer = 11, "muon"
    said, scalers, compiled = [], [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compiled.append(fn) or fn)
    seed_everything(0)
    built = build_model(
        cfg,
        Distributed(rank=3, world_size=4),
        Precision(precision, "cpu", "asked"),
        64,
        Factories(scaler=lambda enabled: scalers.append(enabled) or f"scaler {enabled}"),
        said.append,
    )
    after = torch.rand(1)
    seed_everything(derived_seed(11, 3))
    assert torch.equal(after, torch.rand(1))  # rank 3's own stream, from the run's seed
    dtypes = {p.dtype for p in built.model.parameters()}
    assert dtypes == {torch.bfloat16 if precision == "bf16-pure" else torch.float32}
    assert scalers == [precision == "fp16"] and built.scaler == f"scaler {precision == 'fp16'}"
    assert built.step_model is built.model and compiled == []
    if precision == "bf16-pure":  # AdamW for bf16 weights: one optimizer, no split to say
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith("optimizer: Muon on ")
    on_meta = build_model(
        cfg,
        Distributed(device=torch.device("meta")),
        Precision(precision, "meta", "asked"),
        64,
        Factories(),
        said.append,
    )
    assert {p.device.type for p in on_meta.model.parameters()} == {"meta"}  # built on the run's device
    cfg.train.compile = True
    compiled_run = build_model(cfg, Distributed(), Precision(precision, "cpu", "asked"), 64, Factories(), said.append)
    # --compile: one block's function compiled, which the model's training passes run every block through
    assert compiled == [_run_block] and compiled_run.model.compiled_block is _run_block
    assert compiled_run.step_model is compiled_run.model


def test_each_component_of_a_run_is_given_the_parts_of_that_run(tmp_path, stories_file, monkeypatch):
    """build_components wires the run: each component is handed this run's model, optimizer,
    scaler, precision, guard, data and log, never a default of its own. A part left at its
    default trains on as if nothing were wrong (fp32 on one CPU process is every default), so each
    hand-over is checked here by identity, with every component recorded as it is built."""
    from types import SimpleNamespace

    from conftest import tiny_run_config

    import nanolm.train as T
    from nanolm.checkpoint import Checkpointer
    from nanolm.watch.reference import shipped_references

    seen = {}

    def recorded(name, real):
        def record(*args, **kwargs):
            seen[name] = SimpleNamespace(args=args, kwargs=kwargs, result=real(*args, **kwargs))
            return seen[name].result

        return record

    def with_floor(*args, **kwargs):
        data = real_set_up(*args, **kwargs)
        data.meta["floor"] = floor  # as `nanolm prepare` measures it (a run's own preparation skips it)
        seen["data"] = data
        return data

    floor = {"bpb": 0.5, "nats_per_token": 1.5}
    real_set_up, rolled, explained = T.set_up_run_directory, [], []
    quick = next(r for r in shipped_references() if r.name == "quick-fp32")
    monkeypatch.setattr(T, "set_up_run_directory", with_floor)
    monkeypatch.setattr(T, "setup_of", recorded("setup_of", T.setup_of))
    monkeypatch.setattr(T, "find_reference", recorded("find_reference", lambda setup: quick))
    monkeypatch.setattr(T, "peak_flops", recorded("peak_flops", T.peak_flops))
    monkeypatch.setattr(T, "rollback_checkpoint", lambda *args: rolled.append(args) or "a checkpoint")
    monkeypatch.setattr(T, "nan_origin", lambda *args: explained.append(args) or "an origin")
    monkeypatch.setattr(T, "Validator", SimpleNamespace(for_run=recorded("validator", T.Validator.for_run)))
    monkeypatch.setattr(T, "Observer", recorded("observer", T.Observer))
    monkeypatch.setattr(T, "Guard", SimpleNamespace(from_options=recorded("guard", T.Guard.from_options)))
    monkeypatch.setattr(T, "StepSetup", recorded("step", T.StepSetup))

    def loss_fn(model, batch):
        return T.summed_token_loss(model, batch)

    factories = T.Factories(
        loss_fn=loss_fn, checkpointer=SimpleNamespace(for_run=recorded("checkpointer", Checkpointer.for_run))
    )
    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=2, eval_every=2, peak_flops=3e12, precision="bf16")
    T.train(cfg, log=lambda line: None, factories=factories)

    data, observer, step = seen["data"], seen["observer"], seen["step"]
    model, optimizer = step.args
    o = observer.kwargs
    dist, precision, watcher = o["dist"], o["precision"], observer.result
    run_cfg = seen["validator"].args[0]  # the command's configuration, its defaults resolved
    assert run_cfg.train.peak_flops == 3e12
    assert seen["setup_of"].args == (run_cfg, data.digest, precision.name, "cpu", 1)
    assert seen["find_reference"].args == (seen["setup_of"].result,)
    assert seen["peak_flops"].args == (dist.device, torch.bfloat16, 3e12)  # autocast's type, not the weights'
    assert precision.autocast != contextlib.nullcontext  # bf16 autocast: a step's own, not StepSetup's default
    assert o["setup"] is seen["setup_of"].result and o["reference"] is quick and o["optimizer"] is optimizer
    assert o["model"] is model and o["peak"] == seen["peak_flops"].result
    v = seen["validator"].kwargs
    assert v["floor"] == floor and v["model"] is model and v["dist"] is dist and v["precision"] is precision
    assert o["evaluates"] == seen["validator"].result.due
    g = seen["guard"].kwargs
    assert g["out_dir"] == tmp_path / "run" and g["log"] == watcher.write
    assert g["rollback_to"]() == "a checkpoint" and rolled == [(dist, tmp_path / "run", watcher.write)]
    assert g["explain_nan"]("a batch") == "an origin"

    def autocast_of(made):  # a partial of torch.autocast, made anew at each read of precision.autocast
        return (made.func, made.args, made.keywords)

    (nan_args,) = explained
    assert nan_args[:2] == (model, "a batch") and nan_args[3] == data.tokenizer.vocab_size
    assert autocast_of(nan_args[2]) == autocast_of(precision.autocast)
    s = step.kwargs
    assert s["step_model"] is model and s["scaler"] is o["scaler"]
    assert autocast_of(s["autocast"]) == autocast_of(precision.autocast)
    assert s["dist"] is dist and s["guard"] is seen["guard"].result and s["loss_fn"] is loss_fn
    assert s["watch"] == watcher.gradient_watch and s["clip"] == run_cfg.optim.clip
    assert s["schedule"].keywords == dict(o=run_cfg.optim, total_steps=2)
    c = seen["checkpointer"].kwargs
    assert (c["dist"], c["run_dir"], c["model"], c["optimizer"]) == (dist, tmp_path / "run", model, optimizer)
    assert c["data_digest"] == data.digest and c["log"] == watcher.write and c["tokenizer"] is data.tokenizer
    assert c["stateful"]["scaler"] is o["scaler"] and c["stateful"]["guard"] is seen["guard"].result
    assert c["stateful"]["observer"] is watcher and c["stateful"]["progress"] is o["progress"]
    assert c["stateful"]["sampler"].sampler.seed == run_cfg.train.seed  # the training stream


def test_a_run_resumed_is_noted_for_diagnosis_and_a_finished_run_run_again_only_finishes(
    tmp_path, stories_file, monkeypatch
):
    """A run that trains on clears its old final weights first (they no longer describe it); one
    stopped while writing them, after its last step or its target, only writes them when run
    again. Every resume is an event diagnose reads (a loss jump there is the resume's, not the run's)."""
    import json

    import nanolm.train as T

    cleared, real_clear = [], T.clear_final
    monkeypatch.setattr(T, "clear_final", lambda out: cleared.append(out) or real_clear(out))

    def run(out, steps, **train_options):
        said = []
        cleared.clear()
        train(_tiny_cfg(stories_file, out, steps=steps, eval_every=2, ckpt_every=2, **train_options), log=said.append)
        events = out / "events.jsonl"
        notes = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
        return (
            [line for line in said if line.startswith("step ")],
            cleared[:],
            [e for e in notes if e["kind"] == "resume"],
        )

    out = tmp_path / "run"
    assert run(out, 2)[1:] == ([out], [])
    trained, clears, resumes = run(out, 4)
    assert len(trained) == 2 and clears == [out] and resumes == [{"step": 2, "kind": "resume"}]
    real_clear(out)  # as a run stopped while it wrote its final weights leaves it: the checkpoint of its last step
    trained, clears, resumes = run(out, 4)
    assert trained == [] and clears == [] and resumes[-1] == {"step": 4, "kind": "resume"}
    assert (out / "model.safetensors").exists()
    met = tmp_path / "met"
    trained, clears, _ = run(met, 6, target_val_bpb=50.0)  # met at the evaluation of step 2
    assert len(trained) == 2 and clears == [met]
    real_clear(met)
    trained, clears, _ = run(met, 6, target_val_bpb=50.0)  # the target was met: no step past it
    assert trained == [] and clears == [] and (met / "model.safetensors").exists()


def test_everything_a_run_says_goes_to_its_log_and_its_thread_count_is_the_one_asked(
    tmp_path, stories_file, monkeypatch, capsys
):
    """A run called from Python says everything through ``log`` (the command prints it above the
    progress bar; a notebook collects it): nothing on standard output. ``--threads N`` trains at N
    threads, and the busy-machine hint is said where a fixed count may crawl, never under
    ``--threads auto`` (which measures for itself, its trial passes under the run's autocast)."""
    import nanolm.train as T

    monkeypatch.setattr(os, "getloadavg", lambda: (os.cpu_count() + 5.0,) * 3, raising=False)  # a busy machine
    counts, tuners = [], []

    def loss_fn(model, batch):
        counts.append(torch.get_num_threads())
        return T.summed_token_loss(model, batch)

    real_tuner = T.ThreadTuner

    class RecordedTuner:  # the tuner --threads auto builds, recorded; it then never switches
        fixed = staticmethod(real_tuner.fixed)

        def __new__(cls, trial_pass, write):
            tuners.append(trial_pass)
            return real_tuner.fixed()

    said = []
    cfg = _tiny_cfg(stories_file, tmp_path / "fixed", steps=2, eval_every=2, threads=2, sample_tokens=8)
    cfg.optim.optimizer = "muon"
    train(cfg, log=said.append, factories=T.Factories(loss_fn=loss_fn))
    assert capsys.readouterr().out == "" and set(counts) == {2}
    for start in ("precision: fp32", "data: ", "model: ", "optimizer: Muon on ", "cpu: 2 threads on ", "sample:\n"):
        assert sum(line.startswith(start) for line in said) == 1, start
    monkeypatch.setattr(T, "ThreadTuner", RecordedTuner)
    said.clear()
    cfg = _tiny_cfg(stories_file, tmp_path / "auto", steps=2, eval_every=2, threads=0, precision="bf16")
    started_with = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count())  # as where OMP_NUM_THREADS is unset: a count the hint would be about
    try:
        train(cfg, log=said.append)
    finally:
        torch.set_num_threads(started_with)
    assert capsys.readouterr().out == "" and not [line for line in said if line.startswith("cpu: ")]
    (trial_pass,) = tuners
    said.clear()  # --deterministic keeps the count it starts with (no tuner): the hint is for it
    cfg = _tiny_cfg(stories_file, tmp_path / "kept", steps=2, eval_every=2, threads=0, deterministic=True)
    torch.set_num_threads(os.cpu_count())
    try:
        train(cfg, log=said.append)
    finally:
        torch.set_num_threads(started_with)
    assert [line for line in said if line.startswith("cpu: ")] or os.cpu_count() == 1
    assert len(tuners) == 1
    assert trial_pass.keywords["autocast"]().fast_dtype == torch.bfloat16
