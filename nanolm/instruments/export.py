"""Export a trained run as a Hugging Face ``transformers`` model.

nanolm's GPT is laid out like Llama (pre-norm RMSNorm, rotary embeddings on the two
halves of each head, SwiGLU, no biases), and like Qwen3 when QK-norm is on (an RMSNorm on
each head's queries and keys before the rotation). Export is therefore a renaming: the
fused ``qkv`` matrix is split into ``q_proj``/``k_proj``/``v_proj`` and every number is
kept as it is, so ``AutoModelForCausalLM.from_pretrained(DIR)`` computes the same logits.

A GELU MLP has no counterpart in those architectures and is refused rather than mapped
approximately.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..base import disk
from ..base.files import atomic_write_text, naming_the_file, refuse_mount_point, replace
from ..base.lock import ScratchDirectory, remove_abandoned_scratch
from ..errors import NanolmError
from ..run.directory import refuse_output_inside_a_run
from ..run.final import load_run
from ..tokenizer import EOS


def hf_config(model) -> dict:
    c = model.config
    if c.mlp != "swiglu":
        raise NanolmError(
            f"a model with mlp={c.mlp!r} maps to no standard Hugging Face architecture "
            f"(Llama and Qwen3 use SwiGLU); export supports mlp=swiglu only"
        )
    qwen3 = c.qk_norm
    config = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen3 else "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.mlp_hidden,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_head,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }
    if qwen3:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layer)
    return config


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """nanolm's weights under Llama/Qwen3 names (contiguous copies, tied head stored once)."""
    c = model.config
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for i, block in enumerate(model.blocks):
        p = f"model.layers.{i}."
        q, k, v = block.attn.qkv.weight.chunk(3, dim=0)
        out.update(
            {
                p + "input_layernorm.weight": block.attn_norm.weight,
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": block.attn.proj.weight,
                p + "post_attention_layernorm.weight": block.mlp_norm.weight,
                p + "mlp.gate_proj.weight": block.mlp.gate.weight,
                p + "mlp.up_proj.weight": block.mlp.up.weight,
                p + "mlp.down_proj.weight": block.mlp.down.weight,
            }
        )
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = block.attn.q_norm.weight
            out[p + "self_attn.k_norm.weight"] = block.attn.k_norm.weight
    return {name: t.detach().float().contiguous().clone() for name, t in out.items()}


def export_run(run_dir, out_dir, log=print) -> Path:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files into ``out_dir``.

    Everything is written into a scratch directory beside ``out_dir`` and renamed into place
    once whole: a full disk or a Ctrl-C leaves no half-exported model that a later
    ``from_pretrained`` would load, nor a non-empty ``out_dir`` that would block the rerun; what
    an export killed with ``kill -9`` left beside ``out_dir`` is removed by the next one."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    refuse_output_inside_a_run(out, "--out")
    refuse_mount_point(out, "--out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NanolmError(f"{out} exists and is not an empty directory; choose another --out")
    model, tokenizer, _ = load_run(run_dir, "cpu")
    config = hf_config(model)
    made, scratch = [], None
    try:
        disk.make_dir(out.parent, parents=True, exist_ok=True, made=made)
        remove_abandoned_scratch(out, "export")
        scratch = ScratchDirectory(out, "export")
        staging = scratch.path
        config["eos_token_id"] = tokenizer.eos_id
        config["bos_token_id"] = tokenizer.eos_id  # EOS opens every document in nanolm's data
        atomic_write_text(staging / "config.json", json.dumps(config, indent=2))
        weights = staging / "model.safetensors"
        with naming_the_file(out / "model.safetensors"):
            with disk.written_by_library(weights):
                save_file(hf_state_dict(model), str(weights), metadata={"format": "pt"})
            with open(weights, "rb") as f:
                disk.sync(f, weights)
        tokenizer.save(staging / "tokenizer.json")
        atomic_write_text(
            staging / "tokenizer_config.json",
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "eos_token": EOS,
                    "bos_token": EOS,
                    "model_max_length": model.config.seq_len,
                    "clean_up_tokenization_spaces": False,
                },
                indent=2,
            ),
        )
        atomic_write_text(
            staging / "generation_config.json",
            json.dumps({"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id}, indent=2),
        )
        disk.chmod(staging, 0o755)
        disk.sync_dir(staging)
        replace(staging, out)  # onto nothing, or onto an empty directory: one atomic rename
        disk.sync_dir(out.parent)
    except BaseException as e:
        if scratch is not None:
            disk.remove_tree(scratch.path, ignore_errors=True)
            if isinstance(e, OSError) and isinstance(e.filename, str):  # the file --out would have held
                e.filename = e.filename.replace(str(scratch.path), str(out), 1)
        for directory in reversed(made):
            try:
                disk.remove_dir(directory)
            except OSError:
                break
        raise
    finally:
        if scratch is not None:
            scratch.let_go()
    log(f"exported {run_dir} as {config['architectures'][0]} to {out}")
    return out
