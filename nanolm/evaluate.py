"""Evaluation: the validation loss and bits per byte of a model.

:func:`estimate_loss` is what a run reports every ``--eval-every`` steps, on its fixed
validation set; ``nanolm eval`` (``nanolm/instruments/trained.py``) runs the same computation
on every token of a text file, for a trained run. It lives apart from the training loop so that
the commands and the benchmarks need nothing of it.
"""

from __future__ import annotations

import math

import torch

from .batches import Batch
from .model import GPT


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
    with torch.no_grad():  # a with block, not a decorator: mutation testing reaches the body
        was_training = model.training
        model.eval()
        batch_nats = []
        tokens = torch.zeros((), dtype=torch.int64, device=device)
        n_bytes = torch.zeros((), dtype=torch.int64, device=device)
        token_bytes = token_bytes.to(device)
        for batch in batches:
            batch = batch.to(device)
            _, total = model(
                batch.idx,
                targets=batch.targets,
                loss_mask=batch.loss_mask,
                doc_ids=batch.doc_ids,
                positions=batch.positions,
                reduction="sum",
            )
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
