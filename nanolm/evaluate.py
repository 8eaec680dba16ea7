"""Evaluation: the validation loss and bits per byte of a model, and text sampled from it.

Both are used during training (an evaluation every ``--eval-every`` steps, a sample at the
end) and after it (``nanolm eval``, ``nanolm sample``); they live apart from the training
loop so that those commands and the benchmarks need nothing of it.
"""

from __future__ import annotations

import math

import torch

from .batches import Batch
from .model import GPT


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


def sample_text(model: GPT, tokenizer, device, max_new_tokens: int, prompt: str = "",
                temperature: float = 0.8, top_k: int | None = 50, top_p: float | None = None, seed: int = 0) -> str:
    """Generate text: a new document (it starts after EOS) continuing ``prompt``."""
    ids = [tokenizer.eos_id] + list(tokenizer.encode(prompt)) if prompt else [tokenizer.eos_id]
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, top_p,
                         eos_id=tokenizer.eos_id, generator=generator)
    new = out[0, len(ids):].tolist()
    if tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
    return prompt + tokenizer.decode(new)
