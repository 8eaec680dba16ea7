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
