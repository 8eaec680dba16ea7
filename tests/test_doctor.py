"""`nanolm doctor`: every check passes on a sound setup and fails when its invariant is broken."""

import textwrap

import numpy as np
import pytest
import torch

import nanolm.instruments.doctor as doctor
import nanolm.step as step_mod
from nanolm.data.prepare import prepare
from nanolm.instruments.cli import main
from nanolm.model import masked_cross_entropy_sum
from nanolm.run.config import RunConfig

STUDENT = textwrap.dedent('''
    import math
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class StudentGPT(nn.Module):
        """A transformer written from an empty file, with switches for the classic bugs."""
        causal = True
        use_doc_ids = True
        init_std = 0.02
        ignore_input = False

        def __init__(self, config):
            super().__init__()
            C, self.H = config.n_embd, config.n_head
            self.tok = nn.Embedding(config.vocab_size, C)
            self.pos = nn.Embedding(config.seq_len, C)
            self.qkv = nn.Linear(C, 3 * C)
            self.proj = nn.Linear(C, C)
            self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))
            self.ln1, self.ln2, self.ln_f = nn.LayerNorm(C), nn.LayerNorm(C), nn.LayerNorm(C)
            self.head = nn.Linear(C, config.vocab_size, bias=False)
            for p in self.parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=self.init_std)

        def forward(self, idx, targets=None, doc_ids=None):
            B, T = idx.shape
            x = self.tok(idx) + self.pos(torch.arange(T))
            if self.ignore_input:
                x = torch.zeros_like(x) + self.pos.weight[0]
            h = self.ln1(x)
            q, k, v = self.qkv(h).view(B, T, 3, self.H, -1).permute(2, 0, 3, 1, 4)
            mask = torch.ones(T, T, dtype=torch.bool).tril() if self.causal else torch.ones(T, T, dtype=torch.bool)
            if doc_ids is not None and self.use_doc_ids:
                mask = mask & (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
            x = x + self.mlp(self.ln2(x))
            logits = self.head(self.ln_f(x))
            loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            return logits, loss

    class NonCausal(StudentGPT):
        causal = False

    class IgnoresDocIds(StudentGPT):
        use_doc_ids = False

    class HugeInit(StudentGPT):
        init_std = 1.0

    class IgnoresInput(StudentGPT):
        ignore_input = True
''')


@pytest.fixture
def student(tmp_path, monkeypatch):
    (tmp_path / "student_gpt.py").write_text(STUDENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "student_gpt"


@pytest.fixture
def tiny_cfg(stories_file):
    cfg = RunConfig()
    cfg.data.data, cfg.data.tokenizer = str(stories_file), "char"
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.seq_len = 1, 2, 32, 32
    cfg.train.steps = 100
    return cfg


def _results(cfg, model=None):
    return {c.name: c for c in doctor.run_doctor(cfg, model, log=lambda *_: None)}


def test_a_sound_setup_passes_every_check(tiny_cfg):
    results = _results(tiny_cfg)
    assert len(results) == 10 and all(c.passed for c in results.values()), [c.line() for c in results.values()]


def test_a_correct_student_model_passes_the_model_checks(tiny_cfg, student):
    results = _results(tiny_cfg, f"{student}:StudentGPT")
    assert set(results) == {"initial loss", "causality", "no cross-document leak", "memorise one batch"}
    assert all(c.passed for c in results.values()), [c.line() for c in results.values()]


@pytest.mark.parametrize(
    "cls, failing",
    [
        ("NonCausal", "causality"),
        ("IgnoresDocIds", "no cross-document leak"),
        ("HugeInit", "initial loss"),
        ("IgnoresInput", "memorise one batch"),
    ],
)
def test_each_model_bug_fails_its_check_and_only_its_check(tiny_cfg, student, cls, failing):
    results = _results(tiny_cfg, f"{student}:{cls}")
    failed = {name for name, c in results.items() if not c.passed}
    assert failing in failed
    assert results[failing].meaning  # a failure says what it usually means
    if cls != "HugeInit":  # a huge init can also slow memorisation; the others are isolated
        assert failed == {failing}


def test_grad_accum_check_fails_with_a_mean_of_micro_batch_means(tiny_cfg, monkeypatch):
    def mean_of_means(model, micro_batches, count, *a, **k):
        for b in micro_batches:
            logits, _ = model(b.idx)
            total, count = masked_cross_entropy_sum(logits, b.targets, b.loss_mask)
            (total / count.clamp(min=1) / len(micro_batches)).backward()
        return torch.zeros(())

    monkeypatch.setattr(step_mod, "accumulate_gradients", mean_of_means)
    assert not _results(tiny_cfg)["batch x4 == grad_accum=4"].passed


def test_weight_decay_check_fails_when_norms_are_decayed(tiny_cfg, monkeypatch):
    monkeypatch.setattr(
        doctor,
        "get_param_groups",
        lambda model, wd: [
            {"params": list(model.parameters()), "weight_decay": wd},
            {"params": [], "weight_decay": 0.0},
        ],
    )
    assert not _results(tiny_cfg)["weight decay groups"].passed


def test_lr_schedule_check_fails_without_warmup(tiny_cfg):
    tiny_cfg.optim.warmup = 0
    assert not _results(tiny_cfg)["LR schedule"].passed


def test_lr_schedule_check_fails_when_the_schedule_undershoots(tiny_cfg, monkeypatch):
    monkeypatch.setattr(doctor, "learning_rate", lambda step, o, total: o.lr * (1 - step / total))
    assert not _results(tiny_cfg)["LR schedule"].passed


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_data_checks_fail_on_shards_read_with_the_wrong_dtype_or_offset(tmp_path, stories_file, kind):
    data = prepare(stories_file, tmp_path / "d", kind, 300, progress=False)
    good = np.asarray(data.train.tokens)
    assert doctor.check_sample_window(good, data.tokenizer, 64).passed
    as_bytes = good.view(np.uint8).astype(np.int64)  # uint16 shards read as uint8
    assert not doctor.check_sample_window(as_bytes, data.tokenizer, 64).passed
    shifted = np.memmap(data.dir / "train.bin", dtype=np.uint16, mode="r", offset=1, shape=(len(good) - 1,))
    data.splits["train"].tokens = np.asarray(shifted)  # read one byte off: ids beyond the vocabulary
    assert not doctor.check_token_ids(data, data.tokenizer.vocab_size).passed


def test_doctor_command_exits_1_on_failure_and_0_when_sound(tiny_cfg, stories_file, student, capsys):
    flags = [
        "--data",
        str(stories_file),
        "--tokenizer",
        "char",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--seq-len",
        "32",
        "--steps",
        "100",
    ]
    assert main(["doctor", *flags]) == 0
    assert main(["doctor", *flags, "--model", f"{student}:NonCausal"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  causality" in out and "reads the future" in out
    assert main(["doctor", *flags, "--model", "no_such_module:X"]) == 2


NANOGPT_SHORTCUT = textwrap.dedent('''
    from student_gpt import StudentGPT

    class LastPositionOnly(StudentGPT):
        """nanoGPT's inference shortcut: without targets, only the last position's logits."""

        def forward(self, idx, targets=None, doc_ids=None):
            logits, loss = super().forward(idx, targets, doc_ids)
            return (logits, loss) if targets is not None else (logits[:, [-1], :], None)

    class NoDocIds(StudentGPT):
        def forward(self, idx, targets=None):
            return super().forward(idx, targets)
''')


def test_a_check_that_could_not_run_is_shown_as_skip_never_pass(tiny_cfg, student, tmp_path, capsys):
    (tmp_path / "shortcuts.py").write_text(NANOGPT_SHORTCUT)
    results = _results(tiny_cfg, "shortcuts:NoDocIds")
    check = results["no cross-document leak"]
    assert check.skipped and check.status == "SKIP" and check.line().startswith("SKIP")
    assert (
        main(
            [
                "doctor",
                "--data",
                tiny_cfg.data.data,
                "--tokenizer",
                "char",
                "--n-layer",
                "1",
                "--n-head",
                "2",
                "--n-embd",
                "32",
                "--seq-len",
                "32",
                "--model",
                "shortcuts:NoDocIds",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "SKIP  no cross-document leak" in out and "PASS  no cross-document leak" not in out
    assert "1 skipped, 0 failed" in out


def test_a_model_returning_only_the_last_position_gets_one_line_saying_what_doctor_needs(
    tiny_cfg, student, tmp_path, capsys
):
    (tmp_path / "shortcuts.py").write_text(NANOGPT_SHORTCUT)
    code = main(
        [
            "doctor",
            "--data",
            tiny_cfg.data.data,
            "--tokenizer",
            "char",
            "--n-layer",
            "1",
            "--n-head",
            "2",
            "--n-embd",
            "32",
            "--seq-len",
            "32",
            "--model",
            "shortcuts:LastPositionOnly",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "shortcuts:LastPositionOnly" in err[0] and "logits for every position" in err[0]


def test_doctor_help_says_that_model_imports_and_runs_the_module():
    from conftest import run_main

    help_text = " ".join(run_main("doctor", "--help").stdout.split())
    assert "runs its code" in help_text and "only a module you trust" in help_text
