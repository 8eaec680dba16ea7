"""Generation and evaluation of a trained run: ``nanolm sample`` / ``nanolm eval``.

``python -m nanolm.sample --run RUN_DIR --prompt "Once upon a time"`` is the same as
``nanolm sample ...``.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from .batches import Split, eval_batches
from .device import resolve_device
from .errors import NanolmError
from .evaluate import estimate_loss, sample_text
from .final import load_run
from .prepare import join_documents
from .sources import DocumentSource


def generate(run_dir, prompt: str = "", max_new_tokens: int = 200, temperature: float = 0.8,
             top_k: int | None = 50, top_p: float | None = None, seed: int = 0, device: str = "auto") -> str:
    """Text continuing ``prompt`` from the weights of ``run_dir`` (repeatable for a seed)."""
    if max_new_tokens <= 0:
        raise NanolmError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise NanolmError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise NanolmError(f"--top-k must be >= 0 (0 = every token), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise NanolmError(f"--top-p must be in (0, 1], got {top_p}")
    if not 0 <= seed < 2**63:
        raise NanolmError(f"--seed must be in [0, 2^63), got {seed}")
    dev = resolve_device(device)
    model, tokenizer, _ = load_run(run_dir, dev)
    return sample_text(model, tokenizer, dev, max_new_tokens, prompt, temperature, top_k, top_p, seed)


def evaluate_file(run_dir, path, batch_size: int = 16, device: str = "auto") -> dict:
    """Loss, perplexity and bits per byte of a trained run on every token of a text file.

    The file's documents are encoded with the run's tokenizer and joined with EOS, then
    scored with the training code's ``estimate_loss`` on windows that tile the stream
    back to back: each token is predicted exactly once. Deterministic.
    """
    if batch_size <= 0:
        raise NanolmError(f"--batch-size must be positive, got {batch_size}")
    dev = resolve_device(device)
    model, tokenizer, config = load_run(run_dir, dev)
    texts = list(DocumentSource(path, config.data.separator, config.data.text_field))
    if not texts:
        raise NanolmError(f"{path} holds no text")
    tokens = join_documents(tokenizer.encode_batch(texts), tokenizer.eos_id)
    seq_len = config.model.seq_len
    if len(tokens) < seq_len + 1:
        seq_len = len(tokens) - 1
    if seq_len < 1:
        raise NanolmError(f"{path} is too short to evaluate")
    split = Split(tokens, np.zeros(0, dtype=np.int64), sum(len(t.encode("utf-8")) for t in texts))
    d = config.data
    batches = eval_batches(split, seq_len, batch_size, tokenizer.eos_id, doc_mask=d.doc_mask,
                           reset_positions=d.reset_positions, mask_boundary=d.mask_boundary)
    result = estimate_loss(model, batches, torch.from_numpy(tokenizer.token_bytes()), dev)
    result["ppl"] = float(np.exp(min(result["loss"], 700.0)))
    return result


if __name__ == "__main__":  # ``python -m nanolm.sample ...`` is ``nanolm sample ...``, through the same entry
    from nanolm.instruments.cli import entry

    entry(["sample", *sys.argv[1:]])
