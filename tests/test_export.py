"""Export to Hugging Face transformers: same logits (skipped only without transformers;
the dev extra installs it, so CI runs it)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from nanolm.instruments.cli import main
from nanolm.instruments.export import export_run
from nanolm.run.config import RunConfig
from nanolm.run.final import write_final
from nanolm.tokenizer import train_char

transformers = pytest.importorskip("transformers")


def _fake_run(tmp_path, **model_options):
    """A run directory holding a randomly initialised (not trained) model."""
    cfg = RunConfig()
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.seq_len = 2, 2, 32, 32
    for k, v in model_options.items():
        setattr(cfg.model, k, v)
    tok = train_char(["abcdefghijklmnopqrstuvwxyz .,\n"])
    model = tiny_model(seed=3, vocab_size=tok.vocab_size, **{k: v for k, v in model_options.items()})
    with torch.no_grad():  # move the norm gains away from 1 so a mix-up of them would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(cfg.resolved().to_toml())
    tok.save(run / "tokenizer.json")
    write_final(run, model, step=0)
    return run, model, tok


@pytest.mark.parametrize(
    "options, architecture",
    [
        ({}, "LlamaForCausalLM"),
        ({"qk_norm": True}, "Qwen3ForCausalLM"),
        ({"tie_embeddings": False, "rope_theta": 500.0}, "LlamaForCausalLM"),
    ],
)
def test_exported_model_gives_the_same_logits_in_transformers(tmp_path, options, architecture):
    run, model, tok = _fake_run(tmp_path, **options)
    out = export_run(run, tmp_path / "hf", log=lambda *_: None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture  # (transformers 5 picks it by model_type; older ones and hubs read:)
    assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
    idx = torch.randint(tok.vocab_size, (2, 32))
    with torch.no_grad():
        expected, _ = model.eval()(idx)
        got = hf(idx).logits
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qk_norm", [False, True])
def test_what_transformers_reads_from_an_export_describes_the_model_and_its_tokenizer(tmp_path, qk_norm):
    """The same logits prove the weights; these are what a pipeline reads beside them: the context
    length, the document token that opens and ends each text, the precision, the tokenizer's class
    and Qwen3's sliding window (off: nanolm attends to the whole window)."""
    run, model, tok = _fake_run(tmp_path, qk_norm=qk_norm)
    out = export_run(run, tmp_path / "hf", log=lambda *_: None)
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.max_position_embeddings == model.config.seq_len and config.eos_token_id == tok.eos_id
    assert config.bos_token_id == tok.eos_id and str(
        config.dtype if hasattr(config, "dtype") else config.torch_dtype
    ) in ("float32", "torch.float32")
    if qk_norm:
        assert config.use_sliding_window is False and config.sliding_window is None
        assert config.max_window_layers == model.config.n_layer
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.model_max_length == model.config.seq_len  # the class: PreTrainedTokenizerFast before transformers 5
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert hf_tok.bos_token == hf_tok.eos_token == "<|endoftext|>" and hf_tok.bos_token_id == tok.eos_id
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.bos_token_id == generation.eos_token_id == tok.eos_id
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_text().startswith('{\n  "'), name  # indented: a person reads these too


def test_an_export_goes_into_a_new_or_empty_directory_readable_by_all_and_nothing_else(tmp_path, capsys):
    run, _, _ = _fake_run(tmp_path)
    (tmp_path / "empty").mkdir()
    out = export_run(run, tmp_path / "empty", log=lambda *_: None)  # an empty directory is replaced in one rename
    assert sorted(p.name for p in out.iterdir())[0] == "config.json" and (out.stat().st_mode & 0o777) == 0o755
    (tmp_path / "file").write_text("mine")
    taken = tmp_path / "empty"
    assert main(["export", str(run), "--out", str(taken)]) == 2
    assert (
        capsys.readouterr().err.strip() == f"error: {taken} exists and is not an empty directory; choose another --out"
    )
    file = tmp_path / "file"
    assert main(["export", str(run), "--out", str(file)]) == 2
    assert capsys.readouterr().err.strip() == f"error: --out {file} is a file, not a directory; choose another --out"
    assert (tmp_path / "file").read_text() == "mine"


def test_exported_tokenizer_loads_and_encodes_the_same(tmp_path):
    run, _, tok = _fake_run(tmp_path)
    out = export_run(run, tmp_path / "hf", log=lambda *_: None)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "hello world, abc."
    assert hf_tok(text)["input_ids"] == tok.encode(text).tolist()
    assert hf_tok.eos_token_id == tok.eos_id
    spaced = "a , b . c"  # decoded as nanolm decodes: no "clean-up" that glues punctuation to the word before it
    assert hf_tok.decode(hf_tok(spaced)["input_ids"]) == tok.decode(tok.encode(spaced).tolist()) == spaced
    assert json.loads((out / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is False


def test_gelu_models_are_refused_with_a_clear_message(tmp_path, capsys):
    run, _, _ = _fake_run(tmp_path, mlp="gelu")
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "mlp='gelu' maps to no standard" in err and not (tmp_path / "hf").exists()


def test_an_export_that_meets_a_full_disk_is_one_line_leaves_nothing_and_the_rerun_works(tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own exception type with the OS error in words; it
    was a traceback, and the half-written directory then blocked the rerun ("exists and is not
    empty")."""
    import safetensors.torch

    run, _, _ = _fake_run(tmp_path)
    out = tmp_path / "exports" / "hf"
    real_save = safetensors.torch.save_file

    def disk_fills(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise RuntimeError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
            'left on device" }) (os error 28)'
        )

    monkeypatch.setattr(safetensors.torch, "save_file", disk_fills)
    assert main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and str(out / "model.safetensors") in err[0], err
    assert not (tmp_path / "exports").exists()
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_an_export_onto_a_mount_point_is_refused_in_one_line_naming_its_flag(tmp_path, capsys, monkeypatch):
    import os

    import nanolm.base.files as files

    run, _, _ = _fake_run(tmp_path)
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(files.os.path, "ismount", lambda p: Path(p) == mounted or real(p))
    assert main(["export", str(run), "--out", str(mounted)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --out {mounted} is a mount point, which nanolm cannot replace in "
        f"one step; choose a directory inside it (--out {mounted / 'out'})"
    )
    assert list(mounted.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["mounted", "run"]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_config_json_states_every_architectural_choice_by_the_names_other_readers_look_up(tmp_path, qk_norm):
    """transformers fills a missing key with its own default, and so do other readers of an export
    (vLLM, llama.cpp's converter), not always the same one: config.json names every choice the
    model made, under the key Llama's and Qwen3's configurations document, even where today's
    transformers default agrees (no biases, no dropout, SiLU, no RoPE scaling, no sliding window)."""
    run, model, _ = _fake_run(tmp_path, qk_norm=qk_norm)
    export_run(run, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    c = model.config
    expected = {
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "num_key_value_heads": c.n_head,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.seq_len,
    }
    if qk_norm:
        expected.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layer)
    assert {k: written.get(k, "missing") for k in expected} == expected
    named = {
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
        *expected,
    }
    assert set(written) == named  # no key a reader does not know (a misspelt one leaves the real one at its default)


def test_an_export_makes_the_directories_its_out_needs_names_each_disk_step_and_says_where_it_went(tmp_path):
    """``--out a/b/hf`` with neither a nor b there yet works as it does for ``train``; each disk step
    names the file it touches (a fault's error and the crash-point report name it); the weights carry
    the safetensors ``format`` older readers refuse a file without; the last line says what went where."""
    from safetensors import safe_open

    from nanolm.base import disk

    run, _, _ = _fake_run(tmp_path)
    out, said = tmp_path / "a" / "b" / "hf", []
    with disk.faults(disk.FaultPlan()) as plan:
        export_run(run, out, log=said.append)
    assert said == [f"exported {run} as LlamaForCausalLM to {out}"]
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert all(path.startswith(str(tmp_path)) for _, path in plan.steps), plan.steps
    weights = [path for kind, path in plan.steps if kind == "write" and path.endswith("model.safetensors")]
    assert len(weights) == 1 and Path(weights[0]).parent.name.startswith(".hf.export-"), plan.steps  # in the scratch
    assert {"tokenizer.json", "config.json"} <= {Path(path).name for _, path in plan.steps}, plan.steps
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_an_export_that_fails_says_why_even_when_its_cleanup_fails_too(tmp_path, monkeypatch):
    """The cleanup of a failed export removes the directories it made; one it cannot remove (another
    process put a file there) ends the cleanup, not the error: the user still learns the disk is full."""
    import errno

    import safetensors.torch

    from nanolm.base import disk

    run, _, _ = _fake_run(tmp_path)

    def disk_full(*_, **__):
        raise OSError(errno.ENOSPC, "No space left on device")

    def not_empty(path):
        raise OSError(errno.ENOTEMPTY, "Directory not empty", str(path))

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    monkeypatch.setattr(disk, "remove_dir", not_empty)
    with pytest.raises(OSError) as raised:
        export_run(run, tmp_path / "made" / "hf", log=lambda *_: None)
    assert raised.value.errno == errno.ENOSPC


def test_an_export_into_a_run_is_refused_naming_the_flag(tmp_path, capsys):
    run, _, _ = _fake_run(tmp_path)
    (run / "checkpoints").mkdir()
    assert main(["export", str(run), "--out", str(run / "checkpoints" / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out {run / 'checkpoints' / 'hf'} is inside ") and err.endswith("another --out")
