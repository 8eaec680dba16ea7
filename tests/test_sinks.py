"""metrics.jsonl (schema, resume), the optional sinks, and the terminal."""

import io
import math
import re
import sys
import time

import pytest
import torch
from conftest import REPO, TINY_TRAIN, tiny_run_config
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from nanolm.instruments.cli import main
from nanolm.train import train
from nanolm.watch import sinks
from nanolm.watch.sinks import MetricsFile, Terminal, choose_progress, read_metrics

STEP0_KEYS = {
    "step",
    "elapsed_s",
    "n_params",
    "tokens_per_step",
    "flops_per_token",
    "peak_flops",
    "val_loss",
    "val_bpb",
    "val_ppl",
    "floor_bpb",
    "floor_loss",
    "peak_lr",
    "min_lr",
    "warmup_steps",
    "beta1",
    "beta2",
    "weight_decay",
    "clip",
    "optimizer",
    "schedule",
    "decayed_norms_biases_embeddings",
    "setup_digest",
    "data_digest",
    "precision",
    "device_type",
    "world_size",
}  # no "reference": not a shipped recipe
TRAIN_KEYS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "clipped",
    "clipped_steps",
    "clipped_frac",
    "tokens_per_sec",
    "threads",
    "mfu",
    "elapsed_s",
    "eta_s",
    "rss_mb",
}
LAYER_KEYS = {"weight_norm", "grad_norm", "update_ratio"}
BLOCK_KEYS = {"attn_logit_max", "mlp_dead_frac", "act_rms"}


@pytest.mark.kernels
def test_metrics_rows_follow_the_documented_schema(observed_run):
    rows = read_metrics(observed_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[0].keys() == STEP0_KEYS  # the generated stories come with their entropy: a floor
    assert rows[0]["flops_per_token"] > 0 and rows[0]["peak_flops"] > 0
    assert rows[0]["clip"] == 1.25 and rows[0]["decayed_norms_biases_embeddings"] == 0  # the recipe, as run
    clip = 1.25  # the fixture's threshold
    for r in rows[1:]:
        assert r.keys() >= TRAIN_KEYS
        assert isinstance(r["clipped"], bool) and isinstance(r["clipped_steps"], int)
        assert r["clipped"] == (r["grad_norm"] > clip)
        assert r["clipped_frac"] == pytest.approx(r["clipped_steps"] / r["step"])
        assert r["mfu"] == pytest.approx(r["tokens_per_sec"] * rows[0]["flops_per_token"] / rows[0]["peak_flops"])
        assert r["eta_s"] >= 0 and r["rss_mb"] > 0
    # logged every step here, so the running count is the sum of the per-step flags
    assert [r["clipped_steps"] for r in rows[1:]] == [sum(x["clipped"] for x in rows[1 : i + 1]) for i in range(1, 6)]
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 3, 5]
    stats_rows = [r["step"] for r in rows if "update_ratio/0" in r]
    assert stats_rows == [1, 2, 4]
    for r in rows:
        if r["step"] in stats_rows:
            layer = {k for k in r if k.split("/")[0] in LAYER_KEYS and "/" in k}
            assert layer == {f"{s}/{g}" for s in LAYER_KEYS for g in ("embed", "0", "1", "final_norm")}
            block = {k for k in r if k.split("/")[0] in BLOCK_KEYS}
            assert block == {f"{s}/{i}" for s in BLOCK_KEYS for i in (0, 1)}
            assert all(math.isfinite(r[k]) for k in layer | block)
        else:
            assert not any("/" in k for k in r)


def test_every_logged_key_is_documented(observed_run):
    """Every number in metrics.jsonl has a stated meaning in docs/observability.md."""
    doc = (REPO / "docs" / "observability.md").read_text(encoding="utf-8")
    keys = {
        re.sub(r"/(\d+|embed|final_norm|head)$", "/", k)
        for r in read_metrics(observed_run / "metrics.jsonl")
        for k in r
    }
    keys |= {"cuda_max_alloc_mb", "floor_bpb", "floor_loss", "loss_scale"}
    undocumented = sorted(k for k in keys if f"`{k.rstrip('/')}" not in doc)
    assert not undocumented


def _rows(steps):
    return [{"step": s, "loss": 1.0 / (s + 1)} for s in steps]


def test_a_resumed_metrics_file_has_every_step_exactly_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = MetricsFile(path)
    for row in _rows(range(0, 11)):
        first.write(row)
    first.close()
    with open(path, "a") as f:
        f.write('{"step": 11, "lo')  # the crash came mid-line
    kept_bytes = b"".join(path.read_bytes().splitlines(keepends=True)[:7])

    resumed = MetricsFile(path, resume_step=6)  # the last checkpoint was at step 6
    assert [r["step"] for r in resumed.rows] == list(range(7))
    for row in _rows(range(7, 13)):
        resumed.write(row)
    resumed.close()
    assert [r["step"] for r in read_metrics(path)] == list(range(13))
    assert path.read_bytes().startswith(kept_bytes)  # the rows before the checkpoint are untouched


def test_resuming_between_logged_steps_keeps_the_rows_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    m = MetricsFile(path)
    for row in _rows([0, 10, 20, 30]):
        m.write(row)
    m.close()
    resumed = MetricsFile(path, resume_step=25)
    resumed.write({"step": 30, "loss": 0.0})
    resumed.close()
    assert [r["step"] for r in read_metrics(path)] == [0, 10, 20, 30]


def test_metrics_file_refuses_a_step_that_does_not_increase(tmp_path):
    m = MetricsFile(tmp_path / "metrics.jsonl")
    m.write({"step": 3})
    with pytest.raises(ValueError, match="must increase"):
        m.write({"step": 3})
    m.close()


class _BrokenOnWrite:
    name = "tensorboard"
    writes = 0

    def __init__(self, out_dir, config, resume_step=None):
        pass

    def write(self, row):
        type(self).writes += 1
        raise OSError("disk full")

    def close(self):
        raise AssertionError("a sink switched off is not closed")


class _BrokenOnStart:
    name = "wandb"

    def __init__(self, out_dir, config, resume_step=None):
        raise ConnectionError("no network")


def test_a_failing_sink_warns_once_and_the_run_continues(tmp_path, stories_file, monkeypatch):
    monkeypatch.setitem(sinks.SINKS, "tensorboard", _BrokenOnWrite)
    monkeypatch.setitem(sinks.SINKS, "wandb", _BrokenOnStart)
    monkeypatch.setattr(sinks, "SINK_PACKAGES", {})
    lines = []
    out = tmp_path / "run"
    train(tiny_run_config(stories_file, out, steps=4, stats_every=2, log="tensorboard,wandb"), log=lines.append)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 2
    assert "tensorboard logger failed (OSError: disk full)" in warnings[1]
    assert "wandb logger could not start (ConnectionError: no network)" in warnings[0]
    assert _BrokenOnWrite.writes == 1
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert (out / "model.safetensors").is_file()


def test_a_sink_that_is_not_installed_is_a_one_line_error_before_anything_is_written(
    tmp_path, capsys, stories_file, monkeypatch
):
    monkeypatch.setitem(sinks.SINK_PACKAGES, "tensorboard", "no_such_package_for_nanolm")
    out = tmp_path / "run"
    code = main(["train", "--data", str(stories_file), "--out-dir", str(out), "--log", "tensorboard", *TINY_TRAIN])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'nanolm[tensorboard]'" in err[0]
    assert not out.exists()
    assert main(["train", "--data", str(stories_file), "--out-dir", str(out), "--log", "mlflow"]) == 2
    assert "unknown --log sink 'mlflow'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.kernels
def test_tensorboard_receives_the_rows_of_metrics_jsonl(observed_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(observed_run / "tensorboard"))
    events.Reload()
    rows = read_metrics(observed_run / "metrics.jsonl")
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"])) for r in rows if "loss" in r]
    assert [e.step for e in events.Scalars("update_ratio/1")] == [1, 2, 4]
    assert [e.step for e in events.Scalars("val_bpb")] == [0, 3, 5]


def test_wandb_logs_offline_without_network(tmp_path, stories_file, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    lines = []
    out = tmp_path / "run"
    train(tiny_run_config(stories_file, out, steps=2, stats_every=2, log="wandb"), log=lines.append)
    assert not [line for line in lines if line.startswith("warning:")]
    logs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    for _ in range(100):  # wandb's service process writes the file in the background
        data = logs[0].read_bytes()
        if b"attn_logit_max/0" in data:
            break
        time.sleep(0.1)
    assert b"val_bpb" in data and b"update_ratio/0" in data and b"attn_logit_max/0" in data


def test_the_loop_reads_the_device_once_per_step_with_guards_and_only_when_logging_without(
    tmp_path, stories_file, monkeypatch
):
    """The loss and the gradient norm live on the accelerator; every read waits for it."""
    events = []
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            events.append("sync")
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    # the optimizer's own reads of its step counters (kept on the host) are not the loop's
    handles = [
        register_optimizer_step_pre_hook(lambda *a: events.append("step")),
        register_optimizer_step_post_hook(lambda *a: events.append("done")),
    ]

    def syncs_between_updates(**guard):
        events.clear()
        cfg = tiny_run_config(
            stories_file, tmp_path / f"run{len(guard)}", steps=6, log_every=2, eval_every=100, stats_every=0
        )
        for k, v in guard.items():
            setattr(cfg.guard, k, v)
        train(cfg, log=lambda *_: None)
        # from one update to the next: logging, then the next step's forward, backward and clipping
        return [chunk.split("step")[0].count("sync") for chunk in " ".join(events).split("done")[1:]][:5]

    try:
        # a guard that can skip or roll back reads each step's loss and norm once, before the
        # update; a logged step reuses that read
        assert syncs_between_updates() == [1, 1, 1, 1, 1]
        # with no such guard, only logged steps read: 1-3 (the first steps after a start), 4; not 5
        assert syncs_between_updates(on_nan="stop", on_spike="off") == [1, 1, 1, 1, 0]
    finally:
        for handle in handles:
            handle.remove()


def test_plain_lines_when_output_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert choose_progress("auto", print) == "lines"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert choose_progress("auto", print) == "bar"
    assert choose_progress("auto", lambda *_: None) == "lines"  # the caller collects the lines itself
    assert choose_progress("lines", print) == "lines"


ROW = {
    "step": 20,
    "loss": 2.5,
    "lr": 1e-3,
    "grad_norm": 0.4,
    "clipped": False,
    "tokens_per_sec": 12345.0,
    "mfu": 0.25,
    "elapsed_s": 10.0,
    "eta_s": 90.0,
}


def test_the_progress_bar_shows_loss_lr_throughput_and_eta(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    terminal = Terminal(100, mode="bar")
    terminal.show(ROW)
    terminal.show({**ROW, "step": 40, "val_loss": 2.4, "val_bpb": 3.1})
    terminal.close()
    text = out.getvalue()
    assert "loss 2.5000" in text and "lr 1.00e-03" in text and "12.3k tok/s" in text
    assert "40/100" in text and "<" in text  # tqdm's elapsed<remaining
    assert "eval step 40 | val loss 2.4000" in text


def test_plain_lines_carry_every_step_figure():
    lines = []
    terminal = Terminal(100, log=lines.append, mode="lines")
    terminal.show(
        {
            **ROW,
            "clipped": True,
            "update_ratio/0": 1e-3,
            "attn_logit_max/0": 3.0,
            "mlp_dead_frac/0": 0.0,
            "act_rms/0": 1.0,
        }
    )
    assert lines[0] == (
        "step  20/100 | loss 2.5000 | lr 1.00e-03 | grad norm 0.400 (clipped) | 12.3k tok/s | "
        "mfu 25.0% | 10.0s | eta 1m30s"
    )
    assert lines[1].startswith("layers step 20 | update/weight 1.0e-03..1.0e-03 | attn logit max 3.00 (block 0)")


def test_a_resumed_run_continues_tensorboard_without_duplicates(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = sinks.TensorBoardSink(tmp_path, {})
    for row in _rows(range(0, 11)):
        first.write(row)
    first.close()
    resumed = sinks.TensorBoardSink(tmp_path, {}, resume_step=6)
    for row in _rows(range(7, 13)):
        resumed.write(row)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(13))


def test_a_damaged_line_in_metrics_does_not_stop_a_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    m = MetricsFile(path)
    for row in _rows(range(0, 8)):
        m.write(row)
    m.close()
    lines = path.read_bytes().splitlines(keepends=True)
    lines[3] = b'{"step": 3, "lo\xffss": \n'  # a flipped byte, mid-file
    path.write_bytes(b"".join(lines))
    warnings = []
    resumed = MetricsFile(path, resume_step=5, log=warnings.append)
    assert [r["step"] for r in resumed.rows] == [0, 1, 2, 4, 5]
    assert len(warnings) == 1 and "1 damaged line(s) dropped" in warnings[0]
    resumed.write({"step": 6, "loss": 0.1})
    resumed.close()
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 4, 5, 6]


def test_readers_leave_damaged_lines_out_and_say_how_many(tmp_path):
    from nanolm.watch.guards import read_events

    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 0}\nnot json\n{"step": "one"}\n{"step": 2}\n')
    (tmp_path / "events.jsonl").write_bytes(b'{"step": 1, "kind": "nan"}\n\xff\xfe\n')
    heard = []
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", heard.append)] == [0, 2]
    assert [e["step"] for e in read_events(tmp_path, heard.append)] == [1]
    assert [h.split(": ")[-1] for h in heard] == ["2 damaged line(s) left out", "1 damaged line(s) left out"]


def test_the_recorded_recipe_counts_what_the_optimizer_really_decays(tmp_path, stories_file):
    """The step-0 recipe reads the optimizer's groups, not the options: an optimizer that decays
    the norms and the embedding (the lab's fault) must be recorded as doing so, or
    `nanolm diagnose` cannot name it."""
    from nanolm.instruments.faults import factories

    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=1, eval_every=1)
    cfg.debug.decay_everything = True
    train(cfg, log=lambda *_: None, factories=factories(cfg))
    recipe = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    # one block: two norm gains, the final norm, the (tied) embedding; the model has no biases
    assert recipe["decayed_norms_biases_embeddings"] == 4
    assert recipe["weight_decay"] == cfg.optim.weight_decay > 0


def test_a_run_that_skips_the_step_0_evaluation_still_records_its_recipe_there(tmp_path, stories_file):
    """--no-eval-at-start (a speedrun's second saved) drops the untrained model's validation
    figures, and nothing else: the step-0 row still says how the run was set up."""
    cfg = tiny_run_config(stories_file, tmp_path / "run", steps=2, eval_every=2)
    cfg.train.eval_at_start = False
    train(cfg, log=lambda *_: None)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["step"] == 0 and "val_loss" not in rows[0]
    assert STEP0_KEYS - rows[0].keys() == {"val_loss", "val_bpb", "val_ppl", "floor_bpb", "floor_loss"}
    assert "val_loss" in rows[-1]  # the evaluations of the run itself are all there
