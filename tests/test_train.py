import math

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


def test_a_compiled_step_follows_the_eager_step():
    """``--compile`` runs the same step: torch.compile's model gives eager's loss and updated
    weights (to float32 reordering; SGD, because Adam's first update is lr·sign(g) and a
    gradient element near zero may change sign when the sums are reordered). On CPU too,
    where the compile is the slow part."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from nanolm.batches import pack_windows
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
        model = tiny_model(n_layer=1)
        setup = StepSetup(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            schedule=lambda step: 1.0,
            step_model=torch.compile(model) if compile else model,
        )
        results.append((train_step(setup, 1, [batch]).loss.item(), [p.detach().clone() for p in model.parameters()]))
    (eager_loss, eager_weights), (compiled_loss, compiled_weights) = results
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    start = [p.detach() for p in tiny_model(n_layer=1).parameters()]
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
