"""nanolm plan: every formula against a hand-worked number and against nanolm's own GPT."""

import json

import pytest
import torch
from conftest import tiny_run_config

import nanolm.model
from nanolm.instruments.cli import main
from nanolm.model import GPT, GPTConfig
from nanolm.optim import muon_available
from nanolm.precision import cast_weights_
from nanolm.run.plan import (
    PRESETS,
    activation_bytes_per_token,
    count_parameters,
    flops_per_token,
    make_plan,
    memory_per_gpu,
    parse_count,
)

SHAPES = [
    dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, n_embd=32),
    dict(vocab_size=100, seq_len=16, n_layer=3, n_head=4, n_embd=64, mlp="gelu", tie_embeddings=False),
    dict(vocab_size=70, seq_len=8, n_layer=1, n_head=2, n_embd=48, qk_norm=True, tie_embeddings=False),
]


def _on_meta(**shape) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**shape))


@pytest.mark.parametrize("shape", SHAPES + [PRESETS["nanolm"], PRESETS["124m"], PRESETS["7b"]])
def test_parameters_and_flops_equal_the_real_models(shape):
    model = _on_meta(**shape)
    assert count_parameters(model.config) == model.num_params()
    for seq_len in (None, 7):
        assert flops_per_token(model.config, seq_len) == model.flops_per_token(seq_len)


def test_hand_worked_124m():
    c = GPTConfig(**PRESETS["124m"])
    embedding = 50304 * 768  # 38,633,472 (tied with the head)
    block = 4 * 768**2 + 2 * 768 * 3072 + 2 * 768  # 2,359,296 + 4,718,592 + 1,536 = 7,079,424
    assert count_parameters(c) == embedding + 12 * block + 768 == 123_587_328
    matmuls = 12 * (4 * 768**2 + 2 * 768 * 3072) + 50304 * 768  # 123,568,128
    attention = 12 * 12 * 1024 * 768  # 113,246,208
    assert flops_per_token(c) == 6 * matmuls + attention == 854_654_976
    # bf16 activations per token: per layer 16·768+8 (norms) + 7·2·768+4·12 (attention)
    # + 2·768 + 2·2·3072 (GELU MLP) = 36,920; head 8·768+4 + 4·768 + 8 = 9,228 (the logits are
    # never whole: the fused head and loss keep only the gradient of their input)
    layer, head, residual = activation_bytes_per_token(c, "bf16")
    assert (layer, head, residual) == (36_920, 9_228, 4 * 768)
    # once per micro-batch, the fused head: its fp32 gradient 4·50304·768 = 154,533,888 and one chunk
    # of 2**25 // 50304 = 667 positions, 667·(2·2 + 4)·50304 = 268,422,144 (logits, log-softmax, gradient)
    once = 154_533_888 + 268_422_144
    m = memory_per_gpu(c, "bf16", "ddp", gpus=8, micro_batch=16)
    assert m["activations"] == 16 * 1024 * (12 * 36_920 + 9_228) + once == 7_832_914_944
    assert m["activations_checkpointed"] == 16 * 1024 * (12 * 4 * 768 + 36_920 + 9_228) + once
    assert m["weights"] == m["gradients"] == 4 * 123_587_328 and m["optimizer"] == 8 * 123_587_328


def test_hand_worked_7b_on_8_gpus_with_fsdp():
    c = GPTConfig(**PRESETS["7b"])
    assert c.mlp_hidden == 10944  # 8·4096/3 = 10922.7, rounded up to a multiple of 32
    block = 4 * 4096**2 + 3 * 4096 * 10944 + 2 * 4096  # 201,596,928
    n = 2 * 32000 * 4096 + 32 * block + 4096  # untied: embedding and head
    assert count_parameters(c) == n == 6_713_249_792
    m = memory_per_gpu(c, "bf16", "fsdp", gpus=8, micro_batch=1)
    assert m["weights"] == m["gradients"] == 4 * n / 8 and m["optimizer"] == 8 * n / 8  # 16 bytes/param ÷ 8
    assert m["autocast_weights"] == 2 * (32 * (4 * 4096**2 + 3 * 4096 * 10944) + 32000 * 4096)  # not sharded
    ddp = memory_per_gpu(c, "bf16", "ddp", gpus=8, micro_batch=1)
    assert ddp["weights"] + ddp["gradients"] + ddp["optimizer"] == 16 * n  # 107 GB: DDP cannot hold a 7B on 80 GB
    assert ddp["activations"] == m["activations"]  # activations depend on the micro-batch, not on sharding
    pure = memory_per_gpu(c, "bf16-pure", "fsdp", gpus=8, fp32_master=True)
    assert (pure["weights"], pure["optimizer"], pure["autocast_weights"]) == (2 * n / 8, 12 * n / 8, 0)


@pytest.mark.kernels
def test_time_is_flops_over_the_clusters_useful_throughput():
    c = GPTConfig(**PRESETS["124m"])
    p = make_plan(c, gpus=8, gpu="h100", micro_batch=16, tokens=10e9, mfu=0.4)
    assert p["seconds"] == pytest.approx(854_654_976 * 10e9 / (8 * 989.4e12 * 0.4))  # 2,699.4 s
    assert p["tokens_per_step"] == 16 * 1024 * 8 and p["steps"] == 76_294  # ceil(1e10 / 131,072)


def _kept_for_backward(model: GPT, batch: int, precision: str) -> int:
    """Bytes autograd keeps for backward in one forward pass of the training step (the fused head
    and loss keep their gradients, computed in the forward pass; the logits are never whole)."""
    params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    idx = torch.randint(
        model.config.vocab_size, (batch, model.config.seq_len), generator=torch.Generator().manual_seed(0)
    )
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"),
    ):
        model(idx, targets=idx, reduction="sum")
    return sum(kept.values())


@pytest.mark.filterwarnings("ignore:Mismatch dtype")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
@pytest.mark.parametrize("shape", SHAPES)
def test_activation_bytes_equal_what_autograd_keeps(shape, precision, monkeypatch):
    """Measured per token (batch 4 minus batch 2: weight copies do not grow with tokens) and
    per layer (a 2-block model minus a 1-block one), on CPU. The plan describes a GPU, where
    attention runs in the autocast dtype; on CPU nanolm keeps attention in fp32 (see
    ``nanolm.model.attention``), so the measurement uses plain SDPA as a GPU would."""
    monkeypatch.setattr(nanolm.model, "attention", torch.nn.functional.scaled_dot_product_attention)
    per_token = {}
    for n_layer in (1, 2):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**shape, "n_layer": n_layer}))
        if precision == "bf16-pure":
            cast_weights_(model, torch.bfloat16)
        T = model.config.seq_len
        per_token[n_layer] = (_kept_for_backward(model, 4, precision) - _kept_for_backward(model, 2, precision)) / (
            2 * T
        )
    layer, head, _ = activation_bytes_per_token(model.config, precision)
    assert per_token[2] - per_token[1] == layer
    assert per_token[1] - layer == head


def test_parse_count_reads_suffixes():
    assert [parse_count(s) for s in ("2e9", "300M", "20B", "1.5T", "4k")] == [2e9, 3e8, 2e10, 1.5e12, 4e3]


def test_plan_command_prints_every_figure(capsys):
    assert main(["plan", "--preset", "7b", "--gpus", "8", "--dist", "fsdp", "--tokens", "1T", "--json"]) == 0
    out = capsys.readouterr().out
    for text in ("6.71B", "FLOPs", "weights (fp32 ÷ 8 GPUs)", "AdamW state", "activations", "with AC", "days"):
        assert text in out
    figures = json.loads(out.strip().splitlines()[-1])
    assert (
        figures["parameters"] == 6_713_249_792
        and figures["gpu"]["bf16"] == 989.4e12
        and figures["peak_flops"] == 989.4e12
    )


def test_plan_reads_a_run_config(capsys, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "[model]\nn_layer = 6\nn_embd = 192\nn_head = 6\n[data]\nvocab_size = 300\n[train]\nbatch_size = 8\n"
    )
    assert main(["plan", "--config", str(path)]) == 0
    expected = GPT(GPTConfig(vocab_size=300, n_layer=6, n_embd=192, n_head=6)).num_params()
    assert f"({expected:,};" in capsys.readouterr().out


def test_plan_refuses_what_cannot_run(capsys):
    assert main(["plan", "--dist", "none", "--gpus", "2"]) == 2
    assert main(["plan", "--preset", "124m", "--n-embd", "100", "--n-head", "3"]) == 2
    assert capsys.readouterr().err.count("error:") == 2


def test_muon_state_is_counted_as_one_momentum_per_hidden_matrix_weight():
    """The memory check is a lower bound: under --optimizer muon the hidden matrices hold one
    fp32 momentum (4 bytes), not AdamW's two moments, and exactly the parameters Muon takes."""
    from nanolm.optim import split_for_muon
    from nanolm.run.plan import hidden_matrix_parameters

    c = GPTConfig(vocab_size=512, seq_len=64, n_layer=3, n_head=4, n_embd=128)
    assert hidden_matrix_parameters(c) == sum(p.numel() for p in split_for_muon(GPT(c)))
    n, hidden = count_parameters(c), hidden_matrix_parameters(c)
    adamw = memory_per_gpu(c, "fp32", "none", micro_batch=8)
    muon = memory_per_gpu(c, "fp32", "none", micro_batch=8, optimizer="muon")
    assert adamw["optimizer"] == 8 * n and muon["optimizer"] == 8 * (n - hidden) + 4 * hidden
    assert adamw["total"] - muon["total"] == 4 * hidden


@pytest.mark.skipif(not muon_available(), reason="torch.optim.Muon needs PyTorch >= 2.9")
def test_the_memory_check_of_a_muon_run_counts_muons_state(stories_file, tmp_path, monkeypatch):
    """The check before a run starts gets the run's optimizer, so a Muon run is not refused
    for AdamW's larger state (the check promises a lower bound)."""
    import nanolm.run.plan
    from nanolm.train import train

    seen = []
    monkeypatch.setattr(nanolm.run.plan, "check_memory", lambda *args, **kw: seen.append(args[5:] or kw))
    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=1, eval_every=1)
    cfg.optim.optimizer = "muon"
    train(cfg, log=lambda *_: None)
    assert seen == [("muon",)]


def test_the_memory_check_counts_the_validation_windows_the_split_holds_not_those_asked(
    stories_file, tmp_path, monkeypatch
):
    """``--eval-windows 1000000000`` was refused for ~1,856 GB of validation batches that the
    split does not have. The check counts the windows the evaluation scores, as many as asked or
    as the split holds, and the log says once that it holds fewer."""
    import nanolm.run.plan
    import nanolm.train
    from nanolm.batches import eval_window_starts
    from nanolm.data.shards import PreparedData
    from nanolm.train import train

    monkeypatch.setattr(nanolm.run.plan, "available_memory", lambda device: (2e9, "available RAM"))
    checked, scored = [], []
    check, batches = nanolm.run.plan.check_memory, nanolm.train.eval_batches

    def checking(*args, **kwargs):
        checked.append(args[4])
        return check(*args, **kwargs)

    def scoring(*args, **kwargs):
        built = batches(*args, **kwargs)
        scored.append(sum(len(b.idx) for b in built))
        return built

    monkeypatch.setattr(nanolm.run.plan, "check_memory", checking)
    monkeypatch.setattr(nanolm.train, "eval_batches", scoring)
    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=1, eval_every=1, eval_windows=10**9)
    lines = []
    train(cfg, log=lines.append)
    held = len(eval_window_starts(len(PreparedData(tmp_path / "run" / "data").val), 32)[0])
    assert checked == scored == [held] and 0 < held < 10**9
    assert [line for line in lines if "--eval-windows" in line] == [
        f"validation: the split holds {held} windows of 32 tokens, fewer than --eval-windows 1000000000; "
        f"all {held} are scored"
    ]


def test_nanolm_plan_counts_the_optimizer_of_the_config(capsys):
    """`nanolm plan --config` of a Muon config sizes Muon's state, as the run's own check does."""
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[1] / "configs" / "speedrun_cpu.toml")
    assert main(["plan", "--config", config, "--json"]) == 0
    out = capsys.readouterr().out
    assert "Muon + AdamW state" in out
    figures = json.loads(out[out.index("{") :])
    c = GPTConfig(vocab_size=8192, seq_len=64, n_layer=3, n_head=4, n_embd=128)
    assert figures["memory"]["optimizer"] == memory_per_gpu(c, "bf16", "none", optimizer="muon")["optimizer"]
    assert main(["plan", "--config", config, "--optimizer", "adamw"]) == 0
    assert "Muon" not in capsys.readouterr().out
