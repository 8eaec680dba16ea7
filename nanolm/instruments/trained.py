"""A trained run, put to use: ``nanolm sample`` (text from its weights) and ``nanolm eval`` (its
loss on a text file). Each loads the run's final weights (``nanolm.run.final.load_run``) and
calls the course's own function: :func:`~nanolm.sample.sample_text` or
:func:`~nanolm.evaluate.estimate_loss`; what is here is the checking of the command's arguments
and the reading of the file.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..base.files import text_argument
from ..batches import Split, eval_batches
from ..data.shards import join_documents
from ..data.sources import DocumentSource
from ..errors import NanolmError
from ..evaluate import estimate_loss
from ..machine.device import resolve_device
from ..run.final import load_run
from ..sample import sample_text


def generate(
    run_dir,
    prompt: str = "",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 0,
    device: str = "auto",
) -> str:
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
    prompt = text_argument("--prompt", prompt)
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
    tokens = join_documents(tokenizer.encode_batch(texts), tokenizer.eos_id)  # EOS doc EOS: at least 2 tokens
    seq_len = min(config.model.seq_len, len(tokens) - 1)  # a file shorter than a window is one window
    split = Split(tokens, np.zeros(0, dtype=np.int64), sum(len(t.encode("utf-8")) for t in texts))
    d = config.data
    batches = eval_batches(
        split,
        seq_len,
        batch_size,
        tokenizer.eos_id,
        doc_mask=d.doc_mask,
        reset_positions=d.reset_positions,
        mask_boundary=d.mask_boundary,
    )
    result = estimate_loss(model, batches, torch.from_numpy(tokenizer.token_bytes()), dev)
    result["ppl"] = float(np.exp(min(result["loss"], 700.0)))
    return result
