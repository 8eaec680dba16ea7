"""Export to Hugging Face transformers: same logits (skipped only without transformers;
the dev extra installs it, so CI runs it)."""

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


@pytest.mark.parametrize("options, architecture", [
    ({}, "LlamaForCausalLM"),
    ({"qk_norm": True}, "Qwen3ForCausalLM"),
    ({"tie_embeddings": False, "rope_theta": 500.0}, "LlamaForCausalLM"),
])
def test_exported_model_gives_the_same_logits_in_transformers(tmp_path, options, architecture):
    run, model, tok = _fake_run(tmp_path, **options)
    out = export_run(run, tmp_path / "hf", log=lambda *_: None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    idx = torch.randint(tok.vocab_size, (2, 32))
    with torch.no_grad():
        expected, _ = model.eval()(idx)
        got = hf(idx).logits
    assert (got - expected).abs().max().item() <= 1e-4


def test_exported_tokenizer_loads_and_encodes_the_same(tmp_path):
    run, _, tok = _fake_run(tmp_path)
    out = export_run(run, tmp_path / "hf", log=lambda *_: None)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "hello world, abc."
    assert hf_tok(text)["input_ids"] == tok.encode(text).tolist()
    assert hf_tok.eos_token_id == tok.eos_id


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
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space "
                           "left on device\" }) (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_fills)
    assert main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "model.safetensors" in err[0], err
    assert not (tmp_path / "exports").exists()
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
