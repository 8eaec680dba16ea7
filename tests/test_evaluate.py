"""Evaluation at its edges: what the loss and bits per byte divide by (counted tokens, the bytes
they spell), the model's mode left as found, the sums combined across ranks before dividing, and
``nanolm eval`` on files shorter than a window, of one character, or of no text at all."""

import math

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_run_config

from nanolm.batches import Batch
from nanolm.errors import NanolmError
from nanolm.evaluate import estimate_loss
from nanolm.instruments.trained import evaluate_file
from nanolm.model import masked_cross_entropy_sum
from nanolm.train import train


def _batches():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(1, 64, (2, 16), generator=g)
    targets = torch.randint(0, 64, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[0, :5] = False  # the first tokens of a document nothing predicts
    return [Batch(idx, targets, mask), Batch(idx.flip(1), targets.flip(1), torch.ones(2, 16, dtype=torch.bool))]


def test_the_loss_divides_by_counted_tokens_and_bits_per_byte_by_the_bytes_they_spell():
    model, batches = tiny_model(), _batches()
    token_bytes = torch.arange(64) % 4  # EOS (0) spells no byte, others 1 to 3
    model.eval()
    result = estimate_loss(model, batches, token_bytes)
    assert not model.training  # left in the mode it was found in
    with torch.no_grad():
        nats = sum(masked_cross_entropy_sum(model(b.idx)[0], b.targets, b.loss_mask)[0].item() for b in batches)
    counted = sum(int(b.loss_mask.sum()) for b in batches)
    spelled = sum(int((token_bytes[b.targets] * b.loss_mask).sum()) for b in batches)
    assert (result["tokens"], result["bytes"]) == (counted, spelled) == (59, int(spelled))
    assert result["loss"] == pytest.approx(nats / counted, rel=1e-6)
    assert result["bpb"] == pytest.approx(nats / math.log(2) / spelled, rel=1e-6)
    assert isinstance(result["tokens"], int) and isinstance(result["bytes"], int)


def test_the_sums_are_combined_across_ranks_before_dividing():
    model, batches = tiny_model(), _batches()
    alone = estimate_loss(model, batches, torch.ones(64, dtype=torch.long))
    seen = []

    def two_ranks(nats, tokens, n_bytes):  # another rank with the same sums
        seen.append((nats.dtype, tokens.dtype, n_bytes.dtype))
        return torch.stack([2 * nats, 2 * tokens.double(), 2 * n_bytes.double()]).double()

    both = estimate_loss(model, batches, torch.ones(64, dtype=torch.long), reduce=two_ranks)
    assert seen == [(torch.float64, torch.int64, torch.int64)]
    assert both["tokens"] == 2 * alone["tokens"] and both["bytes"] == 2 * alone["bytes"]
    assert both["loss"] == pytest.approx(alone["loss"], rel=1e-12) and both["bpb"] == pytest.approx(alone["bpb"])


def test_no_batches_give_zeros_not_a_division_by_zero():
    assert estimate_loss(tiny_model(), [], torch.ones(64, dtype=torch.long)) == {"loss": 0.0, "bpb": 0.0, "tokens": 0,
                                                                                 "bytes": 0}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, stories_file):
    out = tmp_path_factory.mktemp("eval") / "run"
    train(tiny_run_config(stories_file, out, steps=3, eval_every=3, threads=1), log=lambda *_: None)
    return out


def test_a_file_shorter_than_a_window_is_scored_on_every_token_once(tiny_run, tmp_path):
    (tmp_path / "short.txt").write_text("the cat")
    result = evaluate_file(tiny_run, tmp_path / "short.txt", device="cpu")
    assert result["tokens"] == len("the cat") + 1  # EOS t h e _ c a t EOS: every token after the first EOS
    assert result["bytes"] == len("the cat")  # the closing EOS spells no byte
    assert result["ppl"] == pytest.approx(math.exp(result["loss"]))
    (tmp_path / "one.txt").write_text("a")
    assert evaluate_file(tiny_run, tmp_path / "one.txt", device="cpu")["tokens"] == 2


def test_a_file_is_scored_the_same_whatever_the_batch_size(tiny_run, stories_file, tmp_path):
    (tmp_path / "few.txt").write_text(stories_file.read_text()[:3000])
    one, many = (evaluate_file(tiny_run, tmp_path / "few.txt", batch_size=b, device="cpu") for b in (1, 7))
    assert one["tokens"] == many["tokens"] and one["loss"] == pytest.approx(many["loss"], rel=1e-6)


@pytest.mark.parametrize("batch_size", [0, -3])
def test_a_batch_size_below_one_is_one_line(tiny_run, stories_file, batch_size):
    with pytest.raises(NanolmError) as e:
        evaluate_file(tiny_run, stories_file, batch_size=batch_size)
    assert str(e.value) == f"--batch-size must be positive, got {batch_size}"


def test_a_file_of_blank_documents_holds_no_text(tiny_run, tmp_path):
    (tmp_path / "blank.txt").write_text(" \n\n<|endoftext|>\n\t\n")
    with pytest.raises(NanolmError) as e:
        evaluate_file(tiny_run, tmp_path / "blank.txt", device="cpu")
    assert str(e.value) == f"{tmp_path / 'blank.txt'} holds no text"


def test_a_file_shorter_than_a_window_is_one_window_of_the_whole_file(tiny_run, tmp_path):
    from nanolm.data.shards import join_documents
    from nanolm.run.final import load_run

    (tmp_path / "short.txt").write_text("the cat sat")
    result = evaluate_file(tiny_run, tmp_path / "short.txt")  # the default device: this machine's
    model, tokenizer, _ = load_run(tiny_run, torch.device("cpu"))
    tokens = torch.from_numpy(join_documents([tokenizer.encode("the cat sat")], tokenizer.eos_id).astype(np.int64))
    model.eval()
    with torch.no_grad():
        _, loss = model(tokens[None, :-1], targets=tokens[None, 1:])
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-5)  # every token with all the context before it


def test_a_jsonl_file_is_read_by_the_text_field_the_run_was_prepared_with(tmp_path, stories_file):
    import json

    stories = stories_file.read_text().split("<|endoftext|>")[:60]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": s.strip()}) + "\n" for s in stories if s.strip()))
    cfg = tiny_run_config(tmp_path / "d.jsonl", tmp_path / "run", steps=2, eval_every=2, threads=1)
    cfg.data.text_field = "body"
    train(cfg, log=lambda *_: None)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"body": "a story"}) + "\n" + json.dumps({"text": "other"}) + "\n")
    assert evaluate_file(tmp_path / "run", tmp_path / "eval.jsonl", device="cpu")["tokens"] == len("a story") + 1


def test_with_the_document_mask_each_document_of_a_file_is_scored_as_if_alone(tiny_run, tmp_path):
    """The run's document mask holds in ``nanolm eval`` too: a story is not predicted from the one
    before it (RoPE sees only distances, so where the story sits in the stream changes nothing)."""
    (tmp_path / "a.txt").write_text("the cat sat on the mat")
    (tmp_path / "b.txt").write_text("a dog ran")
    (tmp_path / "ab.txt").write_text("the cat sat on the mat\n<|endoftext|>\na dog ran")
    a, b, ab = (evaluate_file(tiny_run, tmp_path / f"{n}.txt", device="cpu") for n in ("a", "b", "ab"))
    assert ab["tokens"] == a["tokens"] + b["tokens"]
    nats = a["loss"] * a["tokens"] + b["loss"] * b["tokens"]
    assert ab["loss"] * ab["tokens"] == pytest.approx(nats, rel=1e-5)


def test_a_run_that_leaves_each_documents_first_token_uncounted_is_scored_so(tmp_path, stories_file):
    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=2, eval_every=2, threads=1)
    cfg.data.mask_boundary = True
    train(cfg, log=lambda *_: None)
    (tmp_path / "ab.txt").write_text("the cat\n<|endoftext|>\na dog")
    result = evaluate_file(tmp_path / "run", tmp_path / "ab.txt", device="cpu")
    assert result["tokens"] == len("the cat") + len("a dog")  # EOS t h e _ c a t EOS a _ d o g EOS, less 2 firsts
