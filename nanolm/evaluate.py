"""Evaluation: the validation loss and bits per byte of a model, during training and after it.

:func:`estimate_loss` is what a run reports every ``--eval-every`` steps, on its fixed
validation set; :func:`evaluate_file` is ``nanolm eval``, the same computation on every token
of a text file, for a trained run. Both live apart from the training loop so that the
commands and the benchmarks need nothing of it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .batches import Batch, Split, eval_batches
from .data.shards import join_documents
from .data.sources import DocumentSource
from .errors import NanolmError
from .machine.device import resolve_device
from .model import GPT
from .run.final import load_run


@torch.no_grad()
def estimate_loss(model: GPT, batches: list[Batch], token_bytes: torch.Tensor, device="cpu", reduce=None) -> dict:
    """Loss (nats per counted token) and bits per byte over a fixed list of batches.

    Deterministic: the same batches, the model in eval mode (no dropout). Each batch's sum
    of token losses (fp32, on the device) is added up in float64 on the host: a long
    validation set in fp32 would lose digits, and an Apple GPU has no float64 at all.
    Bits per byte divides the total information by the bytes of text the predicted tokens
    spell (EOS spells none), so it compares across tokenizers. ``reduce`` combines the three
    sums (nats, tokens, bytes) with other processes' before the division: each rank
    evaluates its share of the batches (torchrun runs on CUDA or CPU, never on MPS).
    """
    was_training = model.training
    model.eval()
    batch_nats = []
    tokens = torch.zeros((), dtype=torch.int64, device=device)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    token_bytes = token_bytes.to(device)
    for batch in batches:
        batch = batch.to(device)
        _, total = model(batch.idx, targets=batch.targets, loss_mask=batch.loss_mask, doc_ids=batch.doc_ids,
                         positions=batch.positions, reduction="sum")
        batch_nats.append(total.float())
        tokens += batch.loss_mask.sum()
        n_bytes += (token_bytes[batch.targets] * batch.loss_mask).sum()
    model.train(was_training)
    nats = sum(torch.stack(batch_nats).tolist()) if batch_nats else 0.0  # Python floats: float64
    if reduce is not None:
        summed = reduce(torch.tensor(nats, dtype=torch.float64, device=device), tokens, n_bytes)
        nats, tokens, n_bytes = summed[0].item(), summed[1], summed[2]
    tokens, n_bytes = torch.stack([tokens, n_bytes]).tolist()
    return {
        "loss": nats / max(tokens, 1),
        "bpb": nats / math.log(2) / max(n_bytes, 1),
        "tokens": tokens,
        "bytes": n_bytes,
    }


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
    batches = eval_batches(split, seq_len, batch_size, tokenizer.eos_id, doc_mask=d.doc_mask,
                           reset_positions=d.reset_positions, mask_boundary=d.mask_boundary)
    result = estimate_loss(model, batches, torch.from_numpy(tokenizer.token_bytes()), dev)
    result["ppl"] = float(np.exp(min(result["loss"], 700.0)))
    return result
