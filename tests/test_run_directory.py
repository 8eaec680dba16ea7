"""Running the same command again continues the run, whenever and however it stopped.

Each test puts a run directory in a state a real failure leaves (killed mid-run, before the
first checkpoint, after the last checkpoint, a full disk during a save) and checks that the
same command, run again, ends bit-identical to a run that was never interrupted, writes
nothing over a finished run, and deletes nothing a user made.
"""

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file

import nanolm.checkpoint as ckpt
from nanolm.base.lock import LOCK_FILE
from nanolm.checkpoint import list_checkpoints
from nanolm.instruments.cli import main
from nanolm.run.final import read_final
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
    "--log-every",
    "1",
    "--steps",
    "6",
    "--eval-every",
    "2",
    "--threads",
    "1",
]


def _command(data, *extra):
    return ["train", "--data", str(data), *TINY, *map(str, extra)]


def _weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def _same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _files(run_dir):
    """The run's files; not the lock file, which only names the process writing there now (a
    ``kill -9`` leaves it behind, and the next command to take the lock removes it)."""
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != LOCK_FILE}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, stories_file):
    """The same command, never interrupted."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert main(_command(stories_file, "--out-dir", out)) == 0
    return out


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_the_same_command_without_out_dir_continues_its_run_in_the_same_directory(tmp_path, stories_file, straight):
    killed = run_cli(*_command(stories_file, "--ckpt-every", 2, "--debug-kill-after-checkpoint", 4), cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL
    rerun = run_cli(*_command(stories_file, "--ckpt-every", 2), cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    run = tmp_path / "runs" / stories_file.stem
    assert f"resumed from {os.path.join('runs', stories_file.stem, 'checkpoints', 'step_000004')}" in rerun.stdout
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [stories_file.stem]  # no runs/<name>-2
    assert _same_weights(run, straight)


def test_a_different_run_without_out_dir_goes_to_the_next_numbered_directory_and_says_so(
    tmp_path, stories_file, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert main(_command(stories_file)) == 0
    capsys.readouterr()
    assert main(_command(stories_file, "--n-embd", 64)) == 0
    out = capsys.readouterr().out
    name = stories_file.stem
    assert f"holds a different run (n_embd: 32 -> 64); this one is {os.path.join('runs', name + '-2')}" in out
    assert main(_command(stories_file, "--n-embd", 64)) == 0  # and that command finds its own run again
    assert "finished at step 6 of 6; nothing to do" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [name, f"{name}-2"]


def test_a_finished_run_is_not_trained_over(straight, stories_file, capsys):
    before = _files(straight)
    assert main(_command(stories_file, "--out-dir", straight)) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(_command(stories_file, "--out-dir", straight, "--resume", "never")) == 2
    assert "--resume never does not train over it" in _one_error_line(capsys)
    assert _files(straight) == before


def test_a_run_stopped_before_its_first_checkpoint_restarts_on_rerun_and_keeps_the_users_files(
    tmp_path, stories_file, straight, capsys, monkeypatch
):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.md").write_text("my notes")

    def disk_full(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    with monkeypatch.context() as m:  # the first save fails: the directory holds a run but no checkpoint
        m.setattr(ckpt, "save_torch", disk_full)
        assert main(_command(stories_file, "--out-dir", out)) == 2
    line = _one_error_line(capsys)
    assert "could not save the checkpoint of step 2" in line and "No space left on device" in line
    assert list_checkpoints(out) == [] and (out / "config.toml").is_file()
    assert main(_command(stories_file, "--out-dir", out)) == 0  # the same command, once there is room
    assert "stopped before its first checkpoint was saved; starting it again from step 0" in capsys.readouterr().out
    assert _same_weights(out, straight)
    assert (out / "notes.md").read_text() == "my notes"
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[0] == 0  # the abandoned attempt's rows are gone


def test_a_full_disk_during_a_later_save_is_one_line_and_the_rerun_resumes_exactly(
    tmp_path, stories_file, straight, capsys, monkeypatch
):
    out = tmp_path / "run"
    real = ckpt.save_torch

    def full_at_step_4(obj, path):
        if obj.get("step") == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(obj, path)

    with monkeypatch.context() as m:
        m.setattr(ckpt, "save_torch", full_at_step_4)
        assert main(_command(stories_file, "--out-dir", out)) == 2
    line = _one_error_line(capsys)
    assert "step 4" in line and "the previous checkpoint is intact" in line
    assert [s for s, _ in list_checkpoints(out)] == [2]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert main(_command(stories_file, "--out-dir", out)) == 0
    assert "resumed from" in capsys.readouterr().out
    assert _same_weights(out, straight)


def test_killed_after_the_last_checkpoint_the_rerun_writes_the_final_weights(tmp_path, stories_file, straight, capsys):
    out = tmp_path / "run"
    assert main(_command(stories_file, "--out-dir", out)) == 0
    (out / "final.json").unlink()  # as if killed between the last checkpoint and the final weights
    (out / "model.safetensors").unlink()
    capsys.readouterr()
    assert main(_command(stories_file, "--out-dir", out)) == 0
    assert "nothing to do" not in capsys.readouterr().out
    assert read_final(out)["step"] == 6 and _same_weights(out, straight)


def test_killed_while_writing_the_final_weights_the_rerun_writes_them_again(tmp_path, stories_file, straight):
    out = tmp_path / "run"
    assert main(_command(stories_file, "--out-dir", out)) == 0
    (out / "final.json").unlink()
    (out / "model.safetensors").write_bytes(b"half a file")
    assert main(_command(stories_file, "--out-dir", out)) == 0
    assert read_final(out) is not None and _same_weights(out, straight)


def test_continuing_a_finished_run_clears_its_claim_of_being_finished(tmp_path, stories_file, capsys, monkeypatch):
    """While a run trains on past its old end, its old final weights must not pass for the new ones."""
    out = tmp_path / "run"
    assert main(_command(stories_file, "--out-dir", out)) == 0
    seen = []
    real = ckpt.save_checkpoint

    def watch(run_dir, step, *a, **k):
        seen.append((out / "final.json").exists())
        return real(run_dir, step, *a, **k)

    monkeypatch.setattr(ckpt, "save_checkpoint", watch)
    assert main(_command(stories_file, "--out-dir", out, "--steps", 8)) == 0
    assert seen and not any(seen) and read_final(out)["step"] == 8


def test_an_out_dir_that_is_a_file_is_one_line_and_left_alone(tmp_path, stories_file, capsys):
    target = tmp_path / "results.txt"
    target.write_text("not a directory")
    assert main(_command(stories_file, "--out-dir", target)) == 2
    assert "is a file, not a directory" in _one_error_line(capsys)
    assert target.read_text() == "not a directory"


def test_a_directory_that_cannot_be_written_is_one_line_before_anything_is_written(
    tmp_path, stories_file, capsys, monkeypatch
):
    import tempfile

    real = tempfile.mkstemp

    def read_only(*a, dir=None, **k):
        if str(dir).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*a, dir=dir, **k)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr("tempfile.mkstemp", read_only)
    assert main(_command(stories_file, "--out-dir", tmp_path / "ro" / "run")) == 2
    assert "Read-only file system" in _one_error_line(capsys)
    assert list((tmp_path / "ro").iterdir()) == []


def _unwritable_directory():
    import tempfile

    for candidate in ("/sys", "/proc"):
        try:
            fd, probe = tempfile.mkstemp(dir=candidate)
        except OSError:
            return candidate
        os.close(fd)
        os.unlink(probe)
    return None


def test_a_directory_the_user_may_not_write_is_one_line(stories_file, capsys):
    forbidden = _unwritable_directory()
    if forbidden is None:
        pytest.skip("no system directory here that refuses writes")
    assert main(_command(stories_file, "--out-dir", f"{forbidden}/nanolm-run")) == 2
    assert f"cannot write in {forbidden}" in _one_error_line(capsys)


def test_damaged_run_data_is_prepared_again_and_the_resume_stays_exact(tmp_path, stories_file, straight, capsys):
    out = tmp_path / "run"
    killed = run_cli(*_command(stories_file, "--out-dir", out, "--ckpt-every", 2, "--debug-kill-after-checkpoint", 4))
    assert killed.returncode == -signal.SIGKILL
    train_bin = out / "data" / "train.bin"
    damaged = bytearray(train_bin.read_bytes())
    damaged[100] ^= 0x01  # a token id changed, still inside the vocabulary
    train_bin.write_bytes(bytes(damaged))
    assert main(_command(stories_file, "--out-dir", out, "--ckpt-every", 2)) == 0
    log = capsys.readouterr().out
    assert "train.bin is corrupt" in log and "preparing the run's data again" in log
    assert _same_weights(out, straight)


def test_damaged_run_data_whose_source_changed_stops_the_resume(tmp_path, stories_file, capsys):
    source = tmp_path / "stories.txt"
    source.write_bytes(stories_file.read_bytes())
    out = tmp_path / "run"
    killed = run_cli(*_command(source, "--out-dir", out, "--ckpt-every", 2, "--debug-kill-after-checkpoint", 4))
    assert killed.returncode == -signal.SIGKILL
    (out / "data" / "val.bin").write_bytes(b"\x00\x01")
    source.write_text(source.read_text().replace("cat", "dog"))
    before = _files(out)
    assert main(_command(source, "--out-dir", out, "--ckpt-every", 2)) == 2
    assert "no longer gives the data the run was trained on" in _one_error_line(capsys)
    assert _files(out) == before


# ------------------------------------------------------------------ what a run's numbers may not depend on
def test_the_built_in_corpus_and_its_validation_set_are_the_same_whatever_the_seed(tmp_path):
    """``--seed`` changes initialisation, data order and sampling; never the data. Were the
    built-in corpus drawn from the run's seed, two seeds would be scored on different
    validation sets and their curves could not be compared."""
    runs = {}
    for seed in (1, 2):
        out = tmp_path / f"seed{seed}"
        assert (
            main(
                [
                    "train",
                    "--out-dir",
                    str(out),
                    "--stories",
                    "40",
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
                    "--batch-size",
                    "4",
                    "--eval-batches",
                    "2",
                    "--sample-tokens",
                    "0",
                    "--steps",
                    "1",
                    "--threads",
                    "1",
                    "--seed",
                    str(seed),
                ]
            )
            == 0
        )
        runs[seed] = {p.name: p.read_bytes() for p in (out / "data").iterdir() if p.suffix in (".bin", ".npy")}
    assert set(runs[1]) >= {"train.bin", "val.bin"} and runs[1] == runs[2]


def test_every_option_outside_the_documented_set_is_refused_on_resume_with_its_diff_line():
    """What may change between a run and its resumption is the list docs/checkpoints.md gives
    (how long, how often, where, the optimizer's knobs...), and the code's
    ``COMPATIBLE_ON_RESUME`` must be exactly that list; every other option shapes the model or
    the data stream, and a change would continue the run as a mix of two. Each option is changed
    alone here, and each outside the list must be refused with its own line."""
    import dataclasses
    import re

    from nanolm.run.config import HIDDEN_SECTIONS, SECTIONS, RunConfig
    from nanolm.run.resume import COMPATIBLE_ON_RESUME, resume_differences

    doc = (Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md").read_text(encoding="utf-8")
    paragraph = doc[
        doc.index("Some settings may change between a run and its resumption") : doc.index(
            "Every other setting shapes the model"
        )
    ]
    documented = {flag.replace("-", "_") for flag in re.findall(r"`--([a-z0-9-]+)`", paragraph)}
    in_code = {name for names in COMPATIBLE_ON_RESUME.values() for name in names}
    assert in_code == documented - {"batch_size", "grad_accum"}  # those two: while the global batch stays

    def changed(value):
        if isinstance(value, bool):
            return not value
        if isinstance(value, (int, float)):
            return value + 1
        return f"{value}-other" if value is not None else "other"

    checked = 0
    for section in SECTIONS:
        if section in HIDDEN_SECTIONS:
            continue
        for f in dataclasses.fields(SECTIONS[section]):
            saved, new = RunConfig(), RunConfig()
            before = getattr(getattr(saved, section), f.name)
            setattr(getattr(new, section), f.name, changed(before))
            allowed, refused = resume_differences(saved, new)
            line = f"{f.name}: "
            if f.name in COMPATIBLE_ON_RESUME.get(section, set()):
                assert [a for a in allowed if a.startswith(line)] and not refused, f.name
            else:
                assert [r for r in refused if r.startswith(line)] and not allowed, f.name
                checked += 1
    assert checked >= 20  # the model's shape, the data, the tokenizer, the seed...


@pytest.mark.parametrize("flag", ["--data", "--out-dir", "prepare --out"])
def test_a_path_that_is_not_utf8_is_refused_in_one_line_before_anything_is_written(
    flag, tmp_path, stories_file, capsys
):
    """A file name with a byte such as 0xE9 (Latin-1's é) is legal on Linux, but config.toml
    (UTF-8 text) cannot hold it, nor can the tokenizer library open it: one line naming the
    option, nothing written."""
    odd = os.fsdecode(bytes(tmp_path) + b"/caf\xe9")
    if flag == "--data":
        with open(os.fsencode(odd) + b".txt", "wb") as f:
            f.write(stories_file.read_bytes())
        argv = ["train", "--data", odd + ".txt", "--out-dir", str(tmp_path / "run"), "--steps", "1"]
    elif flag == "--out-dir":
        argv = ["train", "--data", str(stories_file), "--out-dir", odd, "--steps", "1"]
    else:
        argv = ["prepare", "--data", str(stories_file), "--out", odd, "--tokenizer", "char"]
    before = sorted(os.listdir(os.fsencode(tmp_path)))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "caf\\xe9" in err[0] and "is not valid UTF-8 text" in err[0], err
    assert err[0].startswith(f"error: {flag.split()[-1]} b'") and "rename it" in err[0]
    assert sorted(os.listdir(os.fsencode(tmp_path))) == before


def test_a_pipe_as_data_is_refused_in_one_line_saying_why(tmp_path, stories_file):
    """``--data <(cat stories.txt)`` is a pipe: the tokenizer's pass would read it all and the
    shards' pass nothing, which used to end in "holds no document with text". Say what is wrong."""
    done = subprocess.run(
        [
            "bash",
            "-c",
            '"$0" -m nanolm train --data <(cat "$1") --out-dir "$2" --steps 1',
            sys.executable,
            str(stories_file),
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert "is a pipe or a device, which can be read only once" in err[0] and "save it to a file first" in err[0]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ the data compared by content, not by name
@pytest.mark.parametrize("resume", ["in place", "--resume PATH"])
def test_a_resume_whose_data_moved_is_accepted_by_its_digest_and_stays_exact(
    tmp_path, stories_file, straight, capsys, resume
):
    """docs/checkpoints.md: the data is compared by its digest, not by its name; a corpus
    moved (or copied) to another path continues its run, bit for bit."""
    first, moved = tmp_path / "a" / "stories.txt", tmp_path / "b" / "stories.txt"
    first.parent.mkdir()
    first.write_bytes(stories_file.read_bytes())
    out = tmp_path / "run"
    killed = run_cli(*_command(first, "--out-dir", out, "--ckpt-every", 2, "--debug-kill-after-checkpoint", 4))
    assert killed.returncode == -signal.SIGKILL
    moved.parent.mkdir()
    first.rename(moved)
    if resume == "in place":
        assert main(_command(moved, "--out-dir", out, "--ckpt-every", 2)) == 0
        finished = out
    else:
        finished = tmp_path / "continued"
        assert (
            main(
                _command(
                    moved, "--out-dir", finished, "--ckpt-every", 2, "--resume", out / "checkpoints" / "step_000004"
                )
            )
            == 0
        )
    log = capsys.readouterr().out
    assert "by its digest: the same data" in log and "resumed from" in log
    assert _same_weights(finished, straight)


def test_a_resume_whose_data_changed_under_another_name_is_refused_naming_it(tmp_path, stories_file, capsys):
    out = tmp_path / "run"
    killed = run_cli(*_command(stories_file, "--out-dir", out, "--ckpt-every", 2, "--debug-kill-after-checkpoint", 4))
    assert killed.returncode == -signal.SIGKILL
    other = tmp_path / "other.txt"
    other.write_text(stories_file.read_text().replace("cat", "dog"))
    before = _files(out)
    assert main(_command(other, "--out-dir", out, "--ckpt-every", 2)) == 2
    assert "not the data the run trained on" in _one_error_line(capsys)
    assert _files(out) == before


# ------------------------------------------------------------------ no output lands among a run's own files
@pytest.mark.parametrize(
    "where", ["checkpoints/step_000006/out", "checkpoints/new", "data/out", "checkpoints", "metrics.jsonl"]
)
@pytest.mark.parametrize("command", ["export", "report", "prepare", "train", "data stories"])
def test_no_command_writes_inside_a_runs_checkpoints_or_data(straight, stories_file, tmp_path, capsys, command, where):
    """``export --out RUN/checkpoints/step_N/hf`` used to succeed, and the run then fell back
    past its newest checkpoint ("hf/config.json is not in its manifest")."""
    target = straight / where
    argv = {
        "export": ["export", straight, "--out", target],
        "report": ["report", straight, "--out", target],
        "prepare": ["prepare", "--data", stories_file, "--out", target, "--tokenizer", "char"],
        "train": _command(stories_file, "--out-dir", target),
        "data stories": ["data", "stories", "--docs", "3", "--out", target],
    }[command]
    before = _files(straight)
    assert main([str(a) for a in argv]) == 2
    line = _one_error_line(capsys)
    assert "choose" in line and ("manifest" in line or "which the run" in line), line
    assert _files(straight) == before


def test_outputs_beside_a_runs_files_are_allowed(straight, tmp_path, capsys):
    assert main(["export", str(straight), "--out", str(straight / "export")]) == 0
    try:
        assert ckpt.latest_valid_checkpoint(straight).name == "step_000006"
    finally:
        import shutil

        shutil.rmtree(straight / "export")


@pytest.mark.parametrize("command", ["export", "train", "prepare"])
def test_a_dangling_symlink_as_an_output_is_one_line(straight, stories_file, tmp_path, capsys, command):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    argv = {
        "export": ["export", straight, "--out", link],
        "train": _command(stories_file, "--out-dir", link),
        "prepare": ["prepare", "--data", stories_file, "--out", link],
    }[command]
    assert main([str(a) for a in argv]) == 2
    assert "is a symbolic link to" in _one_error_line(capsys)
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("command", ["export", "report", "train"])
def test_no_command_writes_inside_prepared_data(straight, stories_file, tmp_path, capsys, command):
    """Prepared data is checked against its manifest like a checkpoint: a file added there
    makes every run on it refuse it."""
    prepared = tmp_path / "prepared"
    assert main(["prepare", "--data", str(stories_file), "--out", str(prepared), "--tokenizer", "char"]) == 0
    capsys.readouterr()
    target = prepared / "inside"
    argv = {
        "export": ["export", straight, "--out", target],
        "report": ["report", straight, "--out", target],
        "train": _command(stories_file, "--out-dir", target),
    }[command]
    assert main([str(a) for a in argv]) == 2
    assert "checks against its manifest" in _one_error_line(capsys)
    from nanolm.data.shards import PreparedData

    PreparedData(prepared)


# ------------------------------------------------------------------ the validation set a run keeps
def test_a_continued_run_keeps_its_validation_set_when_the_command_does_not_name_one(tmp_path, stories_file, capsys):
    """The validation set is counted in windows (320 by default); a run made with another size,
    by ``--eval-windows`` or by an earlier nanolm's ``--eval-batches``, keeps its own on resume
    rather than switching sets mid-curve."""
    straight, out = tmp_path / "straight", tmp_path / "run"
    i = TINY.index("--eval-batches")
    command = ["train", "--data", str(stories_file), *TINY[:i], *TINY[i + 2 :], "--ckpt-every", "2"]
    assert main([*command, "--out-dir", str(straight), "--eval-windows", "24"]) == 0
    killed = run_cli(*command, "--out-dir", out, "--eval-windows", 24, "--debug-kill-after-checkpoint", 4)
    assert killed.returncode == -signal.SIGKILL
    assert main([*command, "--out-dir", str(out)]) == 0
    assert "eval_windows" not in capsys.readouterr().out  # nothing changed, nothing to report
    val = [[r["val_loss"] for r in read_metrics(d / "metrics.jsonl") if "val_loss" in r] for d in (straight, out)]
    assert val[0] == val[1] and len(val[0]) == 4
    assert "eval_windows = 24" in (out / "config.toml").read_text()


def test_an_earlier_runs_eval_batches_means_the_same_windows_as_before(tmp_path):
    from nanolm.run.config import load_run_config

    (tmp_path / "config.toml").write_text("[train]\nbatch_size = 4\neval_batches = 20\n")
    assert load_run_config(tmp_path / "config.toml").train.eval_windows == 80
    (tmp_path / "config.toml").write_text("[train]\nbatch_size = 4\n")
    assert load_run_config(tmp_path / "config.toml").train.eval_windows == 320


# ------------------------------------------------------------------ the resume rules, one at a time (nanolm/run/resume.py)
def _saved(straight):
    from nanolm.run.config import load_run_config

    checkpoint = list_checkpoints(straight)[-1][1]
    return checkpoint, load_run_config(checkpoint / "config.toml")


def load_config_copy(cfg):
    import copy

    return copy.deepcopy(cfg)


def test_a_changed_value_is_shown_as_a_person_would_type_it(straight):
    from nanolm.run.resume import resume_differences

    checkpoint, saved = _saved(straight)
    changed = load_config_copy(saved)
    changed.optim.lr = saved.optim.lr / 10
    changed.train.steps = 600
    allowed, refused = resume_differences(saved, changed)
    assert f"lr: {saved.optim.lr:.12g} -> {saved.optim.lr / 10:.12g}" in allowed and refused == []
    assert "steps: 6 -> 600" in allowed and "00000" not in " ".join(allowed)


def test_data_counts_as_moved_only_when_it_gives_the_checkpoints_data(straight, stories_file, tmp_path, capsys):
    """Raw text is tokenized again to know, silently; a source that cannot be read, the built-in
    corpus, and a checkpoint that recorded no digest are never the same data."""
    import json
    import shutil

    from nanolm.base.files import sealed
    from nanolm.run.resume import data_moved_to

    checkpoint, saved = _saved(straight)
    moved = load_config_copy(saved)
    copy_of_data = tmp_path / "elsewhere.txt"
    copy_of_data.write_bytes(stories_file.read_bytes())
    moved.data.data = str(copy_of_data)
    capsys.readouterr()
    assert data_moved_to(moved, checkpoint) is True
    assert capsys.readouterr() == ("", "")  # the check is not a preparation the user sees
    unreadable = tmp_path / "binary.bin"
    unreadable.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" * 10)
    moved.data.data = str(unreadable)
    assert data_moved_to(moved, checkpoint) is False
    moved.data.data = None  # the built-in corpus
    assert data_moved_to(moved, checkpoint) is False
    moved.data.data = str(copy_of_data)
    no_digest = tmp_path / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, no_digest)
    meta = ckpt.read_checkpoint_meta(no_digest)
    meta.pop("data_digest")
    (no_digest / "meta.json").write_text(json.dumps(sealed(meta)))
    assert ckpt.read_checkpoint_meta(no_digest).get("data_digest") is None
    assert data_moved_to(moved, no_digest) is False


def test_a_resume_is_refused_for_another_tokenizer_or_other_data_and_a_path_only_when_not_moved(
    straight, stories_file, tmp_path
):
    from nanolm.data.prepare import load_training_data
    from nanolm.errors import NanolmError
    from nanolm.run.resume import check_resume_compatible
    from nanolm.tokenizer import Tokenizer, train_char

    checkpoint, saved = _saved(straight)
    tokenizer = Tokenizer.load(checkpoint / "tokenizer.json")
    check_resume_compatible(checkpoint, load_config_copy(saved), tokenizer, log=lambda *_: None)  # no dist: one process
    moved = load_config_copy(saved)
    moved.data.data, moved.train.seed = str(tmp_path / "elsewhere.txt"), 7
    with pytest.raises(NanolmError, match=r"incompatible changes: data: .*elsewhere.txt'; seed: 1337 -> 7\. Keep"):
        check_resume_compatible(checkpoint, moved, tokenizer, log=lambda *_: None)
    moved.train.seed = saved.train.seed
    said = []
    check_resume_compatible(checkpoint, moved, tokenizer, log=said.append, data_moved=True)
    assert said == [f"resume: data: {saved.data.data!r} -> {moved.data.data!r} (allowed by its digest: the same data)"]
    other = tmp_path / "other.txt"
    other.write_text("Another text altogether, with other letters: zqxj.\n" * 50)
    with pytest.raises(
        NanolmError,
        match=r"incompatible changes: tokenizer: the data's tokenizer is not the one the "
        r"run was trained with\. Keep those settings",
    ):
        check_resume_compatible(
            checkpoint, load_config_copy(saved), train_char([other.read_text()]), log=lambda *_: None
        )
    cfg = load_config_copy(saved)
    cfg.data.data = str(other)
    data = load_training_data(cfg, tmp_path / "scratch", log=lambda *_: None, compressor_bounds=False)
    with pytest.raises(
        NanolmError, match=r"data: .* is not the data the checkpoint was trained on \(its files differ\)"
    ):
        check_resume_compatible(checkpoint, load_config_copy(saved), tokenizer, log=lambda *_: None, data=data)


def test_the_global_batch_may_be_split_otherwise_but_not_changed(straight):
    """How the global batch is split over micro-batches and processes may change on resume (a
    smaller GPU, another number of them); the global batch itself may not: the data order and
    every step's gradient would change. Other refusals are kept beside it."""
    from nanolm.run.resume import refused_changes

    _, saved = _saved(straight)  # batch 4, accumulation 1, one process
    split = load_config_copy(saved)
    split.train.batch_size, split.train.grad_accum = 2, 2
    assert refused_changes(saved, 1, split, 1) == []
    assert refused_changes(saved, 2, load_config_copy(saved), 2) == []
    fewer = load_config_copy(saved)
    fewer.train.batch_size = 2
    assert refused_changes(saved, 2, fewer, 4) == []  # 4×1×2 = 2×1×4
    grown = load_config_copy(saved)
    grown.train.batch_size, grown.train.seed = 8, 7
    assert refused_changes(saved, 1, grown, 1) == [
        "seed: 1337 -> 7",
        "batch_size: 4 -> 8",
        "global batch (batch_size × grad_accum × world size): 4×1×1 = 4 -> 8×1×1 = 8 windows",
    ]
    accumulated = load_config_copy(saved)
    accumulated.train.grad_accum = 3
    assert refused_changes(saved, 1, accumulated, 1)[0] == "grad_accum: 1 -> 3"


def test_allowed_changes_are_logged_and_a_checkpoint_without_a_data_digest_is_not_refused_for_it(
    straight, tmp_path, stories_file
):
    import json
    import shutil

    from nanolm.base.files import sealed
    from nanolm.data.prepare import load_training_data
    from nanolm.run.resume import check_resume_compatible
    from nanolm.tokenizer import Tokenizer

    checkpoint, saved = _saved(straight)
    longer = load_config_copy(saved)
    longer.train.steps = 600
    said = []
    check_resume_compatible(checkpoint, longer, Tokenizer.load(checkpoint / "tokenizer.json"), log=said.append)
    assert said == ["resume: steps: 6 -> 600 (allowed)"]
    older = tmp_path / "checkpoints" / checkpoint.name  # a checkpoint from before data digests
    shutil.copytree(checkpoint, older)
    meta = ckpt.read_checkpoint_meta(older)
    meta.pop("data_digest")
    (older / "meta.json").write_text(json.dumps(sealed(meta)))
    data = load_training_data(
        load_config_copy(saved), tmp_path / "scratch", log=lambda *_: None, compressor_bounds=False
    )
    check_resume_compatible(older, load_config_copy(saved), data.tokenizer, log=lambda *_: None, data=data)


# ------------------------------------------------------------------ states a run directory can be left in
def _copy_of(run, tmp_path, name="copy"):
    import shutil

    target = tmp_path / name
    shutil.copytree(run, target)
    (target / LOCK_FILE).unlink(missing_ok=True)
    return target


def test_damaged_final_weights_are_written_again_by_the_same_command(straight, stories_file, tmp_path, capsys):
    out = _copy_of(straight, tmp_path)
    (out / "final.json").write_text("{damaged")
    assert main(_command(stories_file, "--out-dir", out)) == 0
    printed = capsys.readouterr().out
    assert "; the final weights will be written again" in printed and "warning: " in printed
    assert read_final(out)["step"] == 6 and _same_weights(out, straight)


def test_checkpoints_of_which_none_verifies_are_never_trained_over(straight, stories_file, tmp_path, capsys):
    out = _copy_of(straight, tmp_path)
    for name in ("final.json", "model.safetensors"):
        (out / name).unlink()
    for _, checkpoint in list_checkpoints(out):
        (checkpoint / "model.safetensors").write_bytes(b"\0" * 64)
    before = _files(out)
    assert main(_command(stories_file, "--out-dir", out)) == 2
    assert _one_error_line(capsys) == (
        f"error: {out} has checkpoints but none is valid (see the warnings above); "
        f"starting over would discard the run: move the directory aside to start "
        f"again, or --resume PATH"
    )
    assert _files(out) == before


def test_resume_path_into_a_directory_with_checkpoints_of_its_own_is_refused(straight, stories_file, tmp_path, capsys):
    out = _copy_of(straight, tmp_path, "own")
    for name in ("final.json", "model.safetensors"):
        (out / name).unlink()
    other = straight / "checkpoints" / "step_000004"
    before = _files(out)
    assert main(_command(stories_file, "--out-dir", out, "--resume", other)) == 2
    assert _one_error_line(capsys) == (
        f"error: {out} holds checkpoints of its own; --resume {other} continues another run into a new --out-dir"
    )
    assert _files(out) == before
    assert main(_command(stories_file, "--out-dir", out, "--resume", out / "checkpoints" / "step_000004")) == 0
    assert _same_weights(out, straight)  # its own checkpoint: that is a resume like any other


def test_data_found_elsewhere_by_its_content_excuses_only_the_path_not_the_other_changes(
    straight, stories_file, tmp_path, capsys
):
    import shutil

    out = _copy_of(straight, tmp_path)
    moved = tmp_path / "elsewhere.txt"
    shutil.copy(stories_file, moved)
    before = _files(out)
    assert main(_command(moved, "--out-dir", out, "--seed", "7")) == 2
    assert _one_error_line(capsys) == (
        f"error: cannot continue the run in {out}: incompatible changes: seed: 1337 -> "
        f"7. Keep those settings, or start a new run with another --out-dir"
    )
    other = tmp_path / "other.txt"
    other.write_text(stories_file.read_text()[: len(stories_file.read_text()) // 2])
    assert main(_command(other, "--out-dir", out, "--seed", "7")) == 2
    line = _one_error_line(capsys)
    assert (
        f"-> {str(other)!r} (not the data the run trained on: compared by content, not by name); seed: 1337 -> 7. "
        f"Keep" in line
    ), line
    assert _files(out) == before


def test_the_global_batch_counts_the_processes_that_wrote_the_checkpoint(straight, stories_file, tmp_path, capsys):
    """A checkpoint written by two processes trained on twice the windows per step: one process
    with the same --batch-size would be another run (``torchrun --nproc-per-node 2`` continues it)."""
    import json

    from nanolm.base.files import SEAL, sealed

    out = _copy_of(straight, tmp_path)
    for name in ("final.json", "model.safetensors"):
        (out / name).unlink()
    for _, checkpoint in list_checkpoints(out):
        meta = json.loads((checkpoint / "meta.json").read_text())
        meta.pop(SEAL)
        (checkpoint / "meta.json").write_text(json.dumps(sealed({**meta, "world_size": 2}), indent=2))
    assert main(_command(stories_file, "--out-dir", out)) == 2
    assert "global batch (batch_size × grad_accum × world size): 4×1×2 = 8 -> 4×1×1 = 4 windows" in _one_error_line(
        capsys
    )


def test_resume_path_with_other_data_is_refused_and_with_the_same_data_elsewhere_continues(
    straight, stories_file, tmp_path, capsys
):
    import shutil

    checkpoint = straight / "checkpoints" / "step_000004"
    other = tmp_path / "other.txt"
    other.write_text(stories_file.read_text()[: len(stories_file.read_text()) // 2])
    assert main(_command(other, "--out-dir", tmp_path / "mixed", "--resume", checkpoint)) == 2
    line = _one_error_line(capsys)
    assert (
        f"incompatible changes: data: {str(stories_file)!r} -> {str(other)!r}; data: {other} is not the data the "
        f"checkpoint was trained on (its files differ)." in line
    ), line
    assert not (tmp_path / "mixed" / "checkpoints").exists()
    moved = tmp_path / "moved.txt"
    shutil.copy(stories_file, moved)
    assert main(_command(moved, "--out-dir", tmp_path / "continued", "--resume", checkpoint)) == 0
    assert "(allowed by its digest: the same data)" in capsys.readouterr().out
    assert _same_weights(tmp_path / "continued", straight)
