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


@pytest.mark.kernels
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


@pytest.mark.kernels
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


@pytest.mark.kernels
def test_the_combined_sums_keep_tokens_and_bytes_apart():
    model, batches = tiny_model(), _batches()
    token_bytes = 1 + torch.arange(64) % 3  # tokens of 1 to 3 bytes: the two counts differ
    alone = estimate_loss(model, batches, token_bytes)
    both = estimate_loss(
        model,
        batches,
        token_bytes,
        reduce=lambda nats, tokens, n_bytes: torch.stack([nats, tokens.double(), n_bytes.double()]),
    )
    assert alone["tokens"] != alone["bytes"]
    assert (both["tokens"], both["bytes"], both["loss"], both["bpb"]) == (
        alone["tokens"],
        alone["bytes"],
        pytest.approx(alone["loss"]),
        pytest.approx(alone["bpb"]),
    )


@pytest.mark.kernels
def test_one_counted_token_of_one_byte_divides_by_one():
    model = tiny_model()
    idx = torch.tensor([[5, 6, 7, 8]])
    targets = torch.tensor([[6, 7, 8, 9]])
    mask = torch.tensor([[False, False, True, False]])
    token_bytes = torch.zeros(64, dtype=torch.long)
    token_bytes[8] = 1
    result = estimate_loss(model, [Batch(idx, targets, mask)], token_bytes)
    with torch.no_grad():
        nats = masked_cross_entropy_sum(model(idx)[0], targets, mask)[0].item()
    assert (result["tokens"], result["bytes"]) == (1, 1)
    assert result["loss"] == pytest.approx(nats) and result["bpb"] == pytest.approx(nats / math.log(2))


@pytest.mark.kernels
def test_the_rotary_positions_of_a_batch_are_the_ones_scored():
    """A batch whose positions restart at a document (``--reset-positions``) is scored at those
    positions, as the model trained on it."""
    model, (batch, _) = tiny_model(), _batches()
    positions = torch.cat([torch.arange(6), torch.arange(10)]).repeat(2, 1)
    with_positions = Batch(batch.idx, batch.targets, batch.loss_mask, positions=positions)
    result = estimate_loss(model, [with_positions], torch.ones(64, dtype=torch.long))
    with torch.no_grad():
        nats = masked_cross_entropy_sum(model(batch.idx, positions=positions)[0], batch.targets, batch.loss_mask)[0]
        plain = masked_cross_entropy_sum(model(batch.idx)[0], batch.targets, batch.loss_mask)[0]
    assert result["loss"] * result["tokens"] == pytest.approx(nats.item(), rel=1e-6)
    assert not math.isclose(nats.item(), plain.item(), rel_tol=1e-6)  # the positions do change the loss


def test_no_batches_give_zeros_not_a_division_by_zero():
    assert estimate_loss(tiny_model(), [], torch.ones(64, dtype=torch.long)) == {
        "loss": 0.0,
        "bpb": 0.0,
        "tokens": 0,
        "bytes": 0,
    }


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, stories_file):
    out = tmp_path_factory.mktemp("eval") / "run"
    train(tiny_run_config(stories_file, out, steps=3, eval_every=3, threads=1), log=lambda *_: None)
    return out


@pytest.mark.kernels
def test_a_file_shorter_than_a_window_is_scored_on_every_token_once(tiny_run, tmp_path):
    (tmp_path / "short.txt").write_text("the cat")
    result = evaluate_file(tiny_run, tmp_path / "short.txt", device="cpu")
    assert result["tokens"] == len("the cat") + 1  # EOS t h e _ c a t EOS: every token after the first EOS
    assert result["bytes"] == len("the cat")  # the closing EOS spells no byte
    assert result["ppl"] == pytest.approx(math.exp(result["loss"]))
    (tmp_path / "one.txt").write_text("a")
    assert evaluate_file(tiny_run, tmp_path / "one.txt", device="cpu")["tokens"] == 2


@pytest.mark.kernels
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


@pytest.mark.kernels
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


@pytest.mark.kernels
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


# ------------------------------------------------------------------ the validator: when, and what it keeps


def _validator(batches, **schedule):
    from nanolm.distributed import Distributed
    from nanolm.precision import resolve_precision
    from nanolm.train import Progress
    from nanolm.watch.validator import Validator

    progress = Progress()
    options = {"every": 50, "last_step": 120, "at_start": True, "floor": None} | schedule
    validator = Validator(
        model=tiny_model(),
        dist=Distributed(),
        precision=resolve_precision("fp32", torch.device("cpu")),
        batches=batches,
        token_bytes=torch.ones(64, dtype=torch.int64),
        progress=progress,
        **options,
    )
    return validator, progress


def test_the_validator_evaluates_every_eval_every_steps_at_the_last_and_at_step_0_only_when_asked():
    validator, _ = _validator(_batches())
    assert [s for s in range(0, 130) if validator.due(s)] == [0, 50, 100, 120]
    late, _ = _validator(_batches(), at_start=False, every=60, last_step=120)
    assert [s for s in range(0, 130) if late.due(s)] == [60, 120]


@pytest.mark.kernels
def test_an_evaluation_gives_the_rows_figures_and_is_kept_in_the_runs_progress():
    validator, progress = _validator(_batches(), floor={"bpb": 0.5, "nats_per_token": 0.3})
    first = validator.evaluate(50)
    assert list(first) == ["step", "val_loss", "val_bpb", "val_ppl", "floor_bpb", "floor_loss"]
    assert first["step"] == 50 and first["val_ppl"] == pytest.approx(math.exp(first["val_loss"]))
    assert (first["floor_bpb"], first["floor_loss"]) == (0.5, 0.3)
    assert (progress.val_loss, progress.val_bpb, progress.best_val_loss) == (
        first["val_loss"],
        first["val_bpb"],
        first["val_loss"],
    )


def test_a_validation_split_without_a_window_gives_no_figures_and_leaves_the_progress_alone():
    validator, progress = _validator([])
    assert validator.due(50) and validator.evaluate(50) == {}
    assert progress.val_loss is None and progress.best_val_loss is None


# ------------------------------------------------------------------ nanolm sample: a trained run's text


@pytest.mark.parametrize(
    "options, refusal",
    [
        ({"max_new_tokens": 0}, "--max-new-tokens must be positive, got 0"),
        ({"temperature": -0.01}, "--temperature must be >= 0 (0 = greedy), got -0.01"),
        ({"temperature": math.nan}, "--temperature must be >= 0 (0 = greedy), got nan"),
        ({"temperature": math.inf}, "--temperature must be >= 0 (0 = greedy), got inf"),
        ({"top_k": -1}, "--top-k must be >= 0 (0 = every token), got -1"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1], got 0.0"),
        ({"top_p": 1.0000001}, "--top-p must be in (0, 1], got 1.0000001"),
        ({"seed": -1}, "--seed must be in [0, 2^63), got -1"),
        ({"seed": 2**63}, "--seed must be in [0, 2^63), got 9223372036854775808"),
    ],
)
def test_sample_refuses_each_option_just_past_its_range_in_one_line(tiny_run, options, refusal):
    import re

    from nanolm.instruments.trained import generate

    with pytest.raises(NanolmError, match=f"^{re.escape(refusal)}$"):
        generate(tiny_run, "a", **{"max_new_tokens": 3, "device": "cpu", **options})


def test_sample_takes_each_option_at_its_edge_and_is_repeatable_for_a_seed(tiny_run):
    from nanolm.instruments.trained import generate

    edges = [
        {"max_new_tokens": 1},
        {"temperature": 0.0},
        {"top_k": 0},
        {"top_k": None},
        {"top_p": 1.0},
        {"top_p": None},
        {"seed": 0},
        {"seed": 2**63 - 1},
    ]
    for options in edges:
        text = generate(tiny_run, "the", **{"max_new_tokens": 4, "device": "cpu", **options})
        assert text.startswith("the"), options
    one = generate(tiny_run, "the", max_new_tokens=20, seed=5, device="cpu")
    assert one == generate(tiny_run, "the", max_new_tokens=20, seed=5, device="cpu")


def test_sample_continues_the_prompt_with_the_runs_weights_as_sample_text_does(tiny_run):
    """``nanolm sample`` is the course's ``sample_text`` on the run's final weights, with every
    option passed through (temperature, top-k, top-p, seed, the number of tokens)."""
    from nanolm.instruments.trained import generate
    from nanolm.run.final import load_run
    from nanolm.sample import sample_text

    model, tokenizer, _ = load_run(tiny_run, torch.device("cpu"))
    for options in ({"temperature": 1.3, "top_k": 7, "top_p": 0.9, "seed": 11}, {"temperature": 0.0, "top_k": None}):
        expected = sample_text(model, tokenizer, torch.device("cpu"), 12, "the cat", **options)
        assert generate(tiny_run, "the cat", max_new_tokens=12, device="cpu", **options) == expected
    assert generate(tiny_run, max_new_tokens=12, device="cpu", seed=3) == sample_text(
        model, tokenizer, torch.device("cpu"), 12, "", 0.8, 50, None, 3
    )  # the defaults: 0.8, top-k 50, no top-p


def test_sample_refuses_a_prompt_that_is_not_text(tiny_run):
    from nanolm.instruments.trained import generate

    with pytest.raises(NanolmError, match="^--prompt b'a\\\\xffb' is not UTF-8 text"):
        generate(tiny_run, "a\udcffb", max_new_tokens=2, device="cpu")


def test_sample_passes_every_option_on_to_sample_text(tiny_run, monkeypatch):
    import nanolm.instruments.trained as trained

    seen = []
    monkeypatch.setattr(trained, "sample_text", lambda *args: seen.append(args[3:]) or "")
    trained.generate(tiny_run, "the", max_new_tokens=7, temperature=1.5, top_k=3, top_p=0.75, seed=9, device="cpu")
    assert seen == [(7, "the", 1.5, 3, 0.75, 9)]


def test_sample_from_python_has_the_commands_defaults():
    """``generate`` called from Python samples as ``nanolm sample`` with no options does."""
    import inspect

    from nanolm.instruments.cli import build_parser
    from nanolm.instruments.trained import generate

    command = vars(build_parser().parse_args(["sample", "--run", "r"]))
    defaults = {k: v.default for k, v in inspect.signature(generate).parameters.items() if k != "run_dir"}
    assert defaults == {k: command[k] for k in defaults}


def test_sample_from_python_with_no_options_samples_with_the_commands_defaults(tiny_run, monkeypatch):
    import nanolm.instruments.trained as trained
    from nanolm.instruments.cli import build_parser
    from nanolm.machine.device import resolve_device

    seen = []
    monkeypatch.setattr(trained, "sample_text", lambda *args: seen.append(args[2:]) or "")
    trained.generate(tiny_run)
    c = build_parser().parse_args(["sample", "--run", "r"])
    assert seen == [(resolve_device(c.device), c.max_new_tokens, c.prompt, c.temperature, c.top_k, c.top_p, c.seed)]


def test_a_validator_built_for_a_run_takes_its_schedule_from_the_train_section():
    from nanolm.distributed import Distributed
    from nanolm.precision import resolve_precision
    from nanolm.run.config import RunConfig
    from nanolm.train import Progress
    from nanolm.watch.validator import Validator

    cfg = RunConfig()
    cfg.train.eval_every, cfg.train.steps, cfg.train.eval_at_start = 40, 90, False
    validator = Validator.for_run(
        cfg,
        model=tiny_model(),
        dist=Distributed(),
        batches=_batches(),
        progress=Progress(),
        precision=resolve_precision("fp32", torch.device("cpu")),
        token_bytes=torch.ones(64, dtype=torch.int64),
        floor={"bpb": 1.0, "nats_per_token": 2.0},
    )
    assert [s for s in range(0, 100) if validator.due(s)] == [40, 80, 90]
    assert validator.evaluate(40)["floor_loss"] == 2.0
    cfg.train.eval_at_start = True  # the default: the untrained model's loss, diagnose's reference
    validator = Validator.for_run(
        cfg,
        model=tiny_model(),
        dist=Distributed(),
        batches=_batches(),
        progress=Progress(),
        precision=resolve_precision("fp32", torch.device("cpu")),
        token_bytes=torch.ones(64, dtype=torch.int64),
    )
    assert [s for s in range(0, 100) if validator.due(s)] == [0, 40, 80, 90] and validator.due(0) is True
