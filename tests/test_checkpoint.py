"""Checkpoints: exact resume, crash safety, integrity, safe loading."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import run_cli, run_main, tiny_model
from safetensors.torch import load_file

import nanolm.checkpoint as ckpt
import nanolm.machine.runtime as runtime
from nanolm.base.files import sha256_file
from nanolm.checkpoint import (
    latest_valid_checkpoint,
    list_checkpoints,
    load_state,
    read_latest,
    save_checkpoint,
    verify_checkpoint,
)
from nanolm.errors import NanolmError
from nanolm.instruments.cli import main
from nanolm.optim import muon_available
from nanolm.run.final import load_run
from nanolm.tokenizer import train_char
from nanolm.watch.sinks import read_metrics

TINY = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--eval-batches",
    "2",
    "--sample-tokens",
    "0",
    "--tokenizer",
    "char",
    "--dropout",
    "0.1",
    "--log-every",
    "1",
]
TIMING = {"tokens_per_sec", "elapsed_s", "mfu", "eta_s", "rss_mb", "cuda_max_alloc_mb", "peak_flops", "threads"}


def _train(data, out, *flags):
    """A tiny training command: in a process of its own where it kills itself (a kill -9 after a
    checkpoint), else in this one (the same command and the same numbers, without the ~2 s of
    starting Python and PyTorch)."""
    flags = [*TINY, *map(str, flags)]
    run = run_cli if "--debug-kill-after-checkpoint" in flags else run_main
    return run("train", "--data", data, "--out-dir", out, *flags)


def _weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def _rows(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, stories_file):
    out = tmp_path_factory.mktemp("straight") / "run"
    r = _train(stories_file, out, "--steps", 8, "--eval-every", 2)
    assert r.returncode == 0, r.stderr
    return out


def test_resume_after_sigkill_is_bit_identical(straight_run, tmp_path, stories_file):
    out = tmp_path / "run"
    killed = _train(
        stories_file, out, "--steps", 8, "--eval-every", 2, "--ckpt-every", 4, "--debug-kill-after-checkpoint", 4
    )
    assert killed.returncode == -signal.SIGKILL
    assert read_latest(out).name == "step_000004" and not (out / "model.safetensors").exists()
    resumed = _train(stories_file, out, "--steps", 8, "--eval-every", 2, "--ckpt-every", 4)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    a, b = _weights(straight_run), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(out) == _rows(straight_run)  # no duplicated, missing or different row


def test_resume_is_exact_across_a_change_of_eval_every(straight_run, tmp_path, stories_file):
    out = tmp_path / "run"
    assert (
        _train(
            stories_file, out, "--steps", 8, "--eval-every", 2, "--ckpt-every", 4, "--debug-kill-after-checkpoint", 4
        ).returncode
        == -signal.SIGKILL
    )
    resumed = _train(stories_file, out, "--steps", 8, "--eval-every", 3, "--ckpt-every", 4)
    assert resumed.returncode == 0, resumed.stderr
    assert "eval_every: 2 -> 3 (allowed)" in resumed.stdout
    a, b = _weights(straight_run), _weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 8


def test_resume_without_optimizer_state_visibly_changes_the_first_step(straight_run, tmp_path, stories_file):
    """Adam's m and v carry the history that scales each update; a fresh optimizer's first
    bias-corrected update is a full-size lr·sign(g) step (see test_optim). Forgetting the
    state on resume shows up as an oversized first update."""
    normal, dropped = tmp_path / "normal", tmp_path / "dropped"
    for out, extra in ((normal, []), (dropped, ["--debug-drop-optimizer-state"])):
        assert (
            _train(
                stories_file,
                out,
                "--steps",
                8,
                "--eval-every",
                2,
                "--ckpt-every",
                1,
                "--keep",
                0,
                "--debug-kill-after-checkpoint",
                5,
            ).returncode
            == -signal.SIGKILL
        )
        assert (
            _train(
                stories_file, out, "--steps", 6, "--eval-every", 2, "--ckpt-every", 1, "--keep", 0, *extra
            ).returncode
            == 0
        )

    def update_norm(run):
        w5 = load_file(str(run / "checkpoints" / "step_000005" / "model.safetensors"))
        w6 = load_file(str(run / "checkpoints" / "step_000006" / "model.safetensors"))
        return sum(((w6[k] - w5[k]) ** 2).sum() for k in w5).sqrt().item()

    assert update_norm(dropped) > 1.5 * update_norm(normal)


@pytest.mark.exhaustive  # the same promise as SIGHUP's in test_terminal.py, and SIGTERM's in every phase in test_signal_points.py
def test_sigterm_saves_a_checkpoint_then_exits_and_the_run_resumes(tmp_path, stories_file):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nanolm",
            "train",
            "--data",
            str(stories_file),
            "--out-dir",
            str(out),
            *TINY,
            "--steps",
            "100000",
            "--eval-every",
            "1000",
            "--ckpt-every",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while read_latest(out) is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "SIGTERM at step" in err and "checkpoint saved" in err
    stopped_at = int(err.split("SIGTERM at step ")[1].split(":")[0])
    assert read_latest(out).name == f"step_{stopped_at:06d}"
    r = _train(stories_file, out, "--steps", stopped_at + 2, "--eval-every", 1000, "--ckpt-every", 5)
    assert r.returncode == 0, r.stderr
    assert f"at step {stopped_at}" in r.stdout and (out / "model.safetensors").exists()


def test_incompatible_resume_is_refused_with_a_readable_diff(straight_run, tmp_path, stories_file, capsys):
    out = tmp_path / "run"
    assert _train(stories_file, out, "--steps", 4, "--eval-every", 2).returncode == 0
    before = sorted(p.name for p in out.iterdir())
    code = main(
        [
            "train",
            "--data",
            str(stories_file),
            "--out-dir",
            str(out),
            *TINY,
            "--steps",
            "8",
            "--n-embd",
            "64",
            "--batch-size",
            "8",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "n_embd: 32 -> 64" in err and "batch_size: 4 -> 8" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == before


# ------------------------------------------------------------------ the checkpoint files
def _state(step=1):
    return {"step": step, "sampler": {"epoch": 0, "cursor": 3, "seed": 0}, "counters": {"tokens_seen": 1}}


def _save(run_dir, step, model=None, **kw):
    return save_checkpoint(run_dir, step, model or tiny_model(), _state(step), "[train]\n", train_char(["ab"]), **kw)


def test_a_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def crash(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt, "save_torch", crash)
    with pytest.raises(OSError, match="simulated"):
        _save(tmp_path, 2)
    assert read_latest(tmp_path).name == "step_000001"
    assert verify_checkpoint(read_latest(tmp_path))["step"] == 1
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the half-written one is gone


def test_a_crash_before_the_pointer_moves_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    real = ckpt.atomic_write_text

    def crash_on_pointer(path, text):
        if str(path).endswith("latest"):
            raise KeyboardInterrupt("killed between rename and pointer (simulated)")
        return real(path, text)

    monkeypatch.setattr(ckpt, "atomic_write_text", crash_on_pointer)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2)
    assert read_latest(tmp_path).name == "step_000001"
    assert latest_valid_checkpoint(tmp_path).name == "step_000001"


def test_a_corrupted_checkpoint_is_named_and_skipped(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    weights = tmp_path / "checkpoints" / "step_000002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(NanolmError, match="model.safetensors is corrupt"):
        verify_checkpoint(weights.parent)
    warnings = []
    assert latest_valid_checkpoint(tmp_path, log=warnings.append).name == "step_000001"
    assert "step_000002" in warnings[0] and "corrupt" in warnings[0]


def test_a_truncated_checkpoint_falls_back_during_auto_resume(straight_run, tmp_path, stories_file):
    out = tmp_path / "run"
    assert (
        _train(
            stories_file, out, "--steps", 8, "--eval-every", 2, "--ckpt-every", 2, "--debug-kill-after-checkpoint", 6
        ).returncode
        == -signal.SIGKILL
    )
    state = out / "checkpoints" / "step_000006" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    r = _train(stories_file, out, "--steps", 8, "--eval-every", 2, "--ckpt-every", 2)
    assert r.returncode == 0, r.stderr
    assert "state.pt is corrupt" in r.stdout and "step_000004" in r.stdout
    a, b = _weights(straight_run), _weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)  # resumed from step 4, still exact


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {_Exploit.marker}",))


def test_a_checkpoint_holding_a_malicious_pickle_is_refused_unexecuted(tmp_path):
    _Exploit.marker = tmp_path / "pwned"
    (tmp_path / "ckpt").mkdir()
    with open(tmp_path / "ckpt" / "state.pt", "wb") as f:
        pickle.dump({"step": 1, "payload": _Exploit()}, f)
    with pytest.raises(NanolmError, match="must not contain code"):
        load_state(tmp_path / "ckpt")
    assert not _Exploit.marker.exists()


def test_weights_with_nan_are_never_checkpointed(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.blocks[0].mlp.up.weight[0, 0] = float("nan")
    with pytest.raises(NanolmError, match="NaN"):
        _save(tmp_path, 1, model=model)
    assert list_checkpoints(tmp_path) == []


def test_keep_retains_the_newest_k_and_the_best(tmp_path):
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5, 5: 2.2, 6: 2.4}
    for step, loss in losses.items():
        _save(tmp_path, step, val_loss=loss, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 5, 6]
    assert read_latest(tmp_path).name == "step_000006"


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    import random

    import numpy as np

    ckpt_dir = _save(tmp_path, 1)
    state = {"rng": runtime.capture_rng("cpu")}
    torch.save(state, ckpt_dir / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    for _ in range(3):
        random.random(), np.random.rand(), torch.rand(1)
    runtime.restore_rng(torch.load(ckpt_dir / "rng.pt", weights_only=True)["rng"], "cpu")
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.mark.parametrize(
    "setting",
    [
        ["--precision", "fp16"],
        ["--precision", "bf16-pure"],
        pytest.param(
            ["--optimizer", "muon"], marks=pytest.mark.skipif(not muon_available(), reason="needs PyTorch >= 2.9")
        ),
    ],
    ids=["fp16", "bf16-pure", "muon"],
)
def test_resume_is_bit_identical_under_low_precision_and_muon(tmp_path, stories_file, setting):
    """The loss scaler's state (fp16), the bf16 optimizer's state and Muon's momentum beside
    AdamW's moments resume exactly too."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["--steps", 6, "--eval-every", 3, "--ckpt-every", 3, *setting]
    assert _train(stories_file, straight, *common).returncode == 0
    assert _train(stories_file, resumed, *common, "--debug-kill-after-checkpoint", 3).returncode == -signal.SIGKILL
    r = _train(stories_file, resumed, *common)
    assert r.returncode == 0, r.stderr
    a, b = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(resumed) == _rows(straight)


# ------------------------------------------------------------------ meta.json is checked, not trusted
def _two_checkpoints(tmp_path):
    _save(tmp_path, 1)
    return _save(tmp_path, 2)


def _reseal(path, change) -> None:
    """Edit a checkpoint's meta.json as someone who knows the format would: seal included."""
    meta = json.loads((path / "meta.json").read_text())
    meta.pop("seal")
    change(meta)
    (path / "meta.json").write_text(json.dumps(ckpt.sealed(meta)))


def _fallback_warning(run_dir) -> str:
    warnings = []
    assert latest_valid_checkpoint(run_dir, log=warnings.append).name == "step_000001"
    assert len(warnings) == 1 and "step_000002" in warnings[0]
    return warnings[0]


def test_a_meta_json_that_is_not_utf8_makes_its_checkpoint_invalid(tmp_path):
    meta = _two_checkpoints(tmp_path) / "meta.json"
    meta.write_bytes(meta.read_bytes().replace(b'"step"', b'"st\xffp"'))
    assert "not UTF-8" in _fallback_warning(tmp_path)


def test_a_flipped_byte_in_a_meta_key_makes_its_checkpoint_invalid(tmp_path):
    meta = _two_checkpoints(tmp_path) / "meta.json"
    meta.write_text(meta.read_text().replace('"step"', '"stdp"'))
    assert "meta.json is damaged" in _fallback_warning(tmp_path)
    _reseal(meta.parent, lambda m: None)  # the flipped key, now with a matching seal
    assert "has no 'step'" in _fallback_warning(tmp_path)


def test_a_meta_step_that_disagrees_with_its_directory_makes_it_invalid(tmp_path):
    path = _two_checkpoints(tmp_path)
    _reseal(path, lambda m: m.update(step=90))
    assert "says step 90" in _fallback_warning(tmp_path)


def test_an_emptied_manifest_does_not_vouch_for_corrupt_weights(tmp_path):
    path = _two_checkpoints(tmp_path)
    _reseal(path, lambda m: m.update(files={}))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)
    assert "manifest" in _fallback_warning(tmp_path)


def test_a_file_the_manifest_does_not_list_makes_a_checkpoint_invalid(tmp_path):
    path = _two_checkpoints(tmp_path)
    (path / "sharded").mkdir()
    (path / "sharded" / ".metadata").write_bytes(pickle.dumps({"anything": 1}))
    assert "not in its manifest" in _fallback_warning(tmp_path)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("format", 2, "format 2"),
        ("layout", "striped", "malformed 'layout'"),
        ("world_size", 0, "malformed 'world_size'"),
        ("val_loss", "low", "malformed 'val_loss'"),
        ("files", [], "malformed 'files'"),
    ],
)
def test_every_meta_field_is_type_checked(tmp_path, field, value, message):
    path = _two_checkpoints(tmp_path)
    _reseal(path, lambda m: m.update({field: value}))
    assert message in _fallback_warning(tmp_path)


def test_the_layout_is_read_from_the_validated_meta_never_from_the_files_present(tmp_path):
    """A single-layout checkpoint with a sharded/ directory slipped in, its manifest made to
    match: it is refused, not read as shards (whose DCP index would be unpickled)."""
    _Exploit.marker = tmp_path / "pwned"
    path = _two_checkpoints(tmp_path)
    (path / "sharded").mkdir()
    (path / "sharded" / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    _reseal(path, lambda m: m["files"].update({"sharded/.metadata": sha256_file(path / "sharded" / ".metadata")}))
    assert "layout single" in _fallback_warning(tmp_path)
    with pytest.raises(NanolmError):
        load_run(path)
    assert not _Exploit.marker.exists()


def test_every_file_of_a_checkpoint_corrupted_in_turn_is_detected_and_skipped(tmp_path):
    path = _two_checkpoints(tmp_path)
    names = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert names == ["config.toml", "meta.json", "model.safetensors", "state.pt", "tokenizer.json"]
    for name in names:
        original = (path / name).read_bytes()
        damaged = bytearray(original)
        damaged[len(damaged) // 2] ^= 0x01  # one flipped bit
        (path / name).write_bytes(bytes(damaged))
        assert name in _fallback_warning(tmp_path)
        (path / name).write_bytes(original)
        assert latest_valid_checkpoint(tmp_path).name == "step_000002"


def test_a_pointer_that_names_no_checkpoint_is_ignored(tmp_path):
    _two_checkpoints(tmp_path)
    (tmp_path / "checkpoints" / "latest").write_bytes(b"../../etc\xff\n")
    assert read_latest(tmp_path) is None
    assert latest_valid_checkpoint(tmp_path).name == "step_000002"


def test_a_training_state_lacking_what_a_resume_restores_is_refused(tmp_path):
    path = _save(tmp_path, 1)
    with pytest.raises(NanolmError, match="no valid 'scaler'"):
        ckpt.check_training_state(path, load_state(path))


def test_the_mps_random_state_is_saved_and_restored_when_there_is_an_mps_device(monkeypatch):
    """Dropout on an Apple GPU draws from the MPS generator; a resume must continue it too."""
    saved = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: saved["state"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda s: saved.update(restored=s))
    state = runtime.capture_rng("mps")
    assert torch.equal(state["mps"], saved["state"])
    runtime.restore_rng(state, "mps")
    assert torch.equal(saved["restored"], saved["state"])


def test_a_checkpointer_built_for_a_run_takes_its_schedule_and_config_from_the_train_section(tmp_path):
    """The run, the lab's broken checkpointers and a replay all build theirs from the config."""
    from nanolm.checkpoint import Checkpointer
    from nanolm.distributed import Distributed
    from nanolm.instruments.faults import ForgetfulCheckpointer
    from nanolm.run.config import RunConfig

    cfg = RunConfig()
    cfg.train.ckpt_every, cfg.train.steps, cfg.train.keep = 7, 50, 2
    for kind in (Checkpointer, ForgetfulCheckpointer):
        c = kind.for_run(
            cfg,
            dist=Distributed(),
            run_dir=tmp_path,
            model=None,
            optimizer=None,
            stateful={},
            tokenizer=None,
            data_digest="d",
            log=print,
        )
        assert type(c) is kind and (c.every, c.last_step, c.keep, c.data_digest) == (7, 50, 2, "d")
        assert c.config_toml == cfg.to_toml() and c.run_dir == tmp_path
        assert [s for s in range(1, 51) if c.due(s)] == [7, 14, 21, 28, 35, 42, 49, 50]
