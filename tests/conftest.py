import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanolm.corpus import write_stories
from nanolm.model import GPT, GPTConfig

REPO = Path(__file__).resolve().parent.parent


def tiny_model(seed=0, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, n_embd=32)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def run_cli(*args, cwd=None, timeout=300):
    """Run ``python -m nanolm ARGS`` in a fresh process; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "nanolm", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


TINY_TRAIN = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--batch-size", "4",
              "--eval-batches", "2", "--sample-tokens", "20", "--vocab-size", "300"]


@pytest.fixture(scope="session")
def stories_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "stories.txt"
    write_stories(path, 300, seed=3)
    return path


def tiny_run_config(data, out_dir, **train):
    """A RunConfig for a few-second training run on ``data`` (char tokenizer, one small block)."""
    from nanolm.config import RunConfig

    cfg = RunConfig()
    cfg.data.data, cfg.data.tokenizer = str(data), "char"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.seq_len = 1, 2, 32, 32
    cfg.train.out_dir, cfg.train.sample_tokens, cfg.train.eval_batches = str(out_dir), 0, 2
    cfg.train.batch_size, cfg.train.log_every = 4, 1
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory, stories_file) -> Path:
    """A short run with every observation on: per-layer statistics at steps 1, 2 and 4, a clip
    threshold that clips some steps and not others, TensorBoard when it is installed."""
    import importlib.util

    from nanolm.train import train

    out = tmp_path_factory.mktemp("observed") / "run"
    cfg = tiny_run_config(stories_file, out, steps=5, stats_every=2, eval_every=3)
    cfg.model.n_layer = 2
    cfg.optim.clip = 1.25
    if importlib.util.find_spec("tensorboard") is not None:
        cfg.train.log = "tensorboard"
    train(cfg, log=lambda *_: None)
    return out
