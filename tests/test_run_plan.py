"""Where a command's run lives and what it may write: the decisions of ``nanolm/run/directory.py``
taken on directories made by hand, without training (``test_run_directory.py`` makes them by
training and interrupting real runs).

Each test names a state a user's disk can be in and the one answer nanolm must give there: an
output refused (naming the flag, what it would break and what to do instead) or allowed, a run
called finished or not, the directory a command without ``--out-dir`` picks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_model

import nanolm.run.directory as directory
from nanolm.errors import NanolmError
from nanolm.run.config import RunConfig
from nanolm.run.directory import (
    RunPlan,
    default_name,
    hold_prepared_data,
    locate_run,
    refuse_output_inside_a_run,
    resume_checkpoint_at,
    use_prepared_tokenizer,
)


def _run_dir(path: Path, *files: str) -> Path:
    """A directory holding a run's config.toml and the other run files named."""
    path.mkdir(parents=True)
    (path / "config.toml").write_text(RunConfig().to_toml())
    for name in files:
        if name in ("checkpoints", "data"):
            (path / name).mkdir()
        else:
            (path / name).write_text("")
    return path


def _refusal(path, flag="--out") -> str:
    with pytest.raises(NanolmError) as e:
        refuse_output_inside_a_run(path, flag)
    return str(e.value)


# ------------------------------------------------------------------ outputs among a run's files
def test_an_output_inside_a_runs_checkpoints_is_refused_naming_the_flag_and_a_path_beside_it(tmp_path):
    run = _run_dir(tmp_path / "run", "checkpoints")
    assert _refusal(run / "checkpoints" / "hf", "--report-out") == (
        f"--report-out {run / 'checkpoints' / 'hf'} is inside {run / 'checkpoints'}, which the run in {run} writes; "
        f"choose a path beside it, such as {run / 'export'}, or another --report-out"
    )
    assert _refusal(run / "metrics.jsonl") == (  # a run's file itself: "is", not "is inside"
        f"--out {run / 'metrics.jsonl'} is {run / 'metrics.jsonl'}, which the run in {run} writes; choose a path "
        f"beside it, such as {run / 'export'}, or another --out"
    )


def test_a_directory_with_a_config_toml_and_nothing_else_of_a_run_is_not_a_run(tmp_path):
    """config.toml alone is a user's file (nanolm writes it first, then the rest): beside it is free."""
    lone = _run_dir(tmp_path / "mine")
    refuse_output_inside_a_run(lone / "checkpoints", "--out")
    refuse_output_inside_a_run(lone / "config.toml" / "x", "--out")
    with_other = _run_dir(tmp_path / "run", "tokenizer.json")
    assert "which the run in" in _refusal(with_other / "data")


def test_a_directory_a_manifest_checks_is_named_as_what_it_is(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    prepared = tmp_path / "prepared"
    for where in (checkpoint, prepared):
        where.mkdir(parents=True)
        (where / "meta.json").write_text(json.dumps({"files": {}}))
    assert _refusal(checkpoint / "hf") == (
        f"--out {checkpoint / 'hf'} is inside {checkpoint}, a checkpoint whose files nanolm checks against its "
        f"manifest: anything written there makes it invalid; choose another --out"
    )
    assert _refusal(prepared / "x", "--out-dir") == (
        f"--out-dir {prepared / 'x'} is inside {prepared}, prepared data whose files nanolm checks against its "
        f"manifest: anything written there makes it invalid; choose another --out-dir"
    )


@pytest.mark.parametrize(
    "meta, checked",
    [
        ({"files": {}}, True),
        ({"source": "a.txt"}, False),  # a meta.json of someone else's: a dict, but no manifest
        (["files"], False),  # "files" in a list is not a manifest either
        ("{damaged", True),  # nanolm's, damaged: still nothing of another command belongs there
    ],
)
def test_only_a_meta_json_that_lists_files_or_is_damaged_makes_a_directory_nanolms(tmp_path, meta, checked):
    where = tmp_path / "d"
    where.mkdir()
    (where / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    if checked:
        assert "checks against its manifest" in _refusal(where / "out")
    else:
        refuse_output_inside_a_run(where / "out", "--out")


def test_an_output_that_is_a_dangling_link_is_refused_naming_its_target(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    assert _refusal(link, "--out-dir") == (
        f"--out-dir {link} is a symbolic link to {tmp_path / 'nowhere'}, which does "
        f"not exist; remove the link or choose another --out-dir"
    )


def test_an_output_inside_a_live_run_names_the_process_writing_it(tmp_path, monkeypatch):
    run = _run_dir(tmp_path / "run", "checkpoints")
    monkeypatch.setattr(directory, "held_by_another", lambda d: "4242@host" if d == run else None)
    assert _refusal(run / "checkpoints" / "hf") == (
        f"{run / 'checkpoints' / 'hf'} is inside {run}, which is being written by process 4242 on host: writing "
        f"there would change that run under it; wait for it to end, or choose another --out"
    )


# ------------------------------------------------------------------ which directory, and is it done
@pytest.mark.parametrize(
    "data, name",
    [
        ("data/toy.txt", "toy"),
        ("prepared/", "prepared"),
        ("a/b.c.txt", "b.c"),
        ("", "stories"),
        ("corpusX", "corpusX"),
        ("notes ", "notes "),
    ],
)
def test_a_run_without_out_dir_is_named_after_its_data(data, name):
    cfg = RunConfig()
    cfg.data.data = data
    assert default_name(cfg) == name


@pytest.mark.parametrize(
    "final, steps, target, finished",
    [
        (None, 10, 0.0, False),
        ({"step": 10, "val_bpb": 2.0}, 10, 0.0, True),  # reached its steps
        ({"step": 9, "val_bpb": 2.0}, 10, 0.0, False),
        ({"step": 4, "val_bpb": 1.5}, 10, 1.5, True),  # reached --target-val-bpb (at it counts)
        ({"step": 4, "val_bpb": 0.8}, 10, 0.9, True),  # a target under one bit per byte is a target too
        ({"step": 4, "val_bpb": 1.6}, 10, 1.5, False),
        ({"step": 4, "val_bpb": None}, 10, 1.5, False),  # no validation figure: not reached
        ({"step": 4, "val_bpb": -1.0}, 10, 0.0, False),  # no target (0): only the steps count
    ],
)
def test_final_weights_say_a_run_is_finished_only_at_its_steps_or_its_target(final, steps, target, finished):
    cfg = RunConfig()
    cfg.train.steps, cfg.train.target_val_bpb = steps, target
    assert directory._finished(final, cfg) is finished


def test_a_run_past_its_steps_says_it_only_writes_its_final_weights(tmp_path):
    assert directory._past_steps(tmp_path, 6, 6) == ""
    assert directory._past_steps(tmp_path, 7, 6) == (
        f"{tmp_path} is at step 7, past --steps 6: nothing to train; its final weights are from step 7"
    )


class _Lock:
    """Stands for RunLock: records what was taken and let go."""

    def __init__(self):
        self.taken, self.released = [], 0

    def take(self, path, log=print):
        self.taken.append(Path(path))

    def release(self):
        self.released += 1


def test_a_command_without_out_dir_takes_the_first_directory_holding_no_other_run_and_says_which(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    differences = {Path("runs/toy"): ["model.n_layer: 4 -> 2", "b", "c", "d"], Path("runs/toy-2"): ["x"]}

    def plan_for(out_dir, cfg, world_size, log, quiet_mismatch, lock):
        lock.take(out_dir)
        return differences.get(out_dir) or RunPlan(out_dir)

    monkeypatch.setattr(directory, "_plan_for", plan_for)
    cfg, lock, said = RunConfig(), _Lock(), []
    cfg.data.data = "data/toy.txt"
    assert locate_run(cfg, lock, 1, log=said.append).out_dir == Path("runs/toy-3")
    assert lock.taken == [Path("runs/toy"), Path("runs/toy-2"), Path("runs/toy-3")] and lock.released == 2
    assert said == [
        "runs/toy holds a different run (model.n_layer: 4 -> 2; b; c ...); this one is runs/toy-3 "
        "(pass --out-dir to choose)"
    ]
    differences[Path("runs/toy")] = ["model.n_layer: 4 -> 2", "b", "c"]  # three are shown whole
    said.clear()
    locate_run(cfg, _Lock(), 1, log=said.append)
    assert said[0].startswith("runs/toy holds a different run (model.n_layer: 4 -> 2; b; c); ")


def test_when_every_numbered_directory_holds_another_run_the_command_asks_for_out_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tried = []

    def always_other(out_dir, *_, **__):
        tried.append(out_dir)
        return ["other"]

    monkeypatch.setattr(directory, "_plan_for", always_other)
    cfg = RunConfig()
    cfg.data.data = "toy.txt"
    with pytest.raises(NanolmError, match=r"^runs/toy \.\.\. runs/toy-9999 all hold other runs; pass --out-dir$"):
        locate_run(cfg, _Lock(), 1)
    assert len(tried) == 9999 and tried[-1] == Path("runs/toy-9999")


def test_a_live_run_of_this_very_command_is_refused_as_busy_and_one_of_another_is_skipped(tmp_path, monkeypatch):
    """Without --out-dir, a directory another process writes is skipped when its run differs from
    this command's (its config.toml says so) and refused, naming the writer, when it is the same run."""
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig()
    cfg.data.data = "toy.txt"
    live = _run_dir(tmp_path / "runs" / "toy")

    def plan_for(out_dir, *_, **__):
        if out_dir == Path("runs/toy"):
            raise directory.DirectoryBusy("runs/toy is being written by process 1 on h")
        return RunPlan(out_dir)

    monkeypatch.setattr(directory, "_plan_for", plan_for)
    other = RunConfig()
    other.data.data, other.model.n_layer = "toy.txt", cfg.model.n_layer + 1
    (live / "config.toml").write_text(other.to_toml())
    assert locate_run(cfg, _Lock(), 1, log=lambda *_: None).out_dir == Path("runs/toy-2")
    (live / "config.toml").write_text(cfg.to_toml())
    with pytest.raises(directory.DirectoryBusy):
        locate_run(cfg, _Lock(), 1)
    (live / "config.toml").write_text("[model\n")  # not written whole yet: treated as this command's
    with pytest.raises(directory.DirectoryBusy):
        locate_run(cfg, _Lock(), 1)


# ------------------------------------------------------------------ the directory's state
def test_a_directory_holding_run_files_but_no_config_toml_is_refused_listing_them(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    (out / "checkpoints").mkdir()
    (out / "notes.txt").write_text("mine")
    cfg = RunConfig()
    cfg.train.out_dir = str(out)
    with pytest.raises(NanolmError) as e:
        locate_run(cfg, _Lock(), 1)
    assert str(e.value) == (
        f"{out} holds checkpoints, metrics.jsonl but no config.toml: it is not a nanolm run this "
        f"command can continue; choose another --out-dir"
    )


def test_an_empty_or_foreign_directory_is_a_new_run_there(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cfg = RunConfig()
    cfg.train.out_dir = str(out)
    lock = _Lock()
    plan = locate_run(cfg, lock, 1)
    assert plan == RunPlan(out) and lock.taken == [out]


def test_a_run_whose_config_cannot_be_read_is_refused_or_skipped(tmp_path, monkeypatch):
    out = _run_dir(tmp_path / "out", "metrics.jsonl")
    (out / "config.toml").write_text("[model\n")
    cfg = RunConfig()
    cfg.train.out_dir = str(out)
    with pytest.raises(
        NanolmError,
        match=rf"^{out} holds a run whose configuration cannot be read \(.+\); choose "
        r"another --out-dir$",
    ):
        locate_run(cfg, _Lock(), 1)
    found = directory._plan_for(out, cfg, 1, print, quiet_mismatch=True, lock=_Lock())
    assert isinstance(found, list) and len(found) == 1 and found[0].startswith("its config.toml is unreadable (")


def _this_commands_run(tmp_path, run_file, **train) -> tuple[Path, RunConfig]:
    """A directory holding this command's own config.toml and ``run_file``, and the command."""
    out = _run_dir(tmp_path / "out", run_file)
    cfg = RunConfig()
    cfg.train.out_dir = str(out)
    for k, v in train.items():
        setattr(cfg.train, k, v)
    cfg = cfg.resolved()  # as train() hands it on
    (out / "config.toml").write_text(cfg.to_toml())
    return out, cfg


def test_resume_never_refuses_a_directory_with_final_weights(tmp_path):
    out, cfg = _this_commands_run(tmp_path, "model.safetensors", resume="never")
    with pytest.raises(
        NanolmError,
        match="already holds a run with checkpoints; --resume never does not train over it: choose another --out-dir",
    ):
        locate_run(cfg, _Lock(), 1)


def test_final_weights_without_a_checkpoint_are_not_trained_over(tmp_path):
    out, cfg = _this_commands_run(tmp_path, "model.safetensors")
    with pytest.raises(
        NanolmError,
        match=f"^{out} holds final weights but no checkpoint to continue from; start a new run with another --out-dir$",
    ):
        locate_run(cfg, _Lock(), 1)


def test_a_run_stopped_before_its_first_checkpoint_is_started_again_and_says_so(tmp_path):
    out, cfg = _this_commands_run(tmp_path, "metrics.jsonl")
    said = []
    assert locate_run(cfg, _Lock(), 1, log=said.append) == RunPlan(out, restart=True)
    assert said == [
        f"{out} holds a run that stopped before its first checkpoint was saved; starting it again from step 0"
    ]


def test_resume_from_a_path_without_a_checkpoint_is_one_line(tmp_path):
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(NanolmError, match=f"^--resume {empty}: no valid checkpoint there$"):
        resume_checkpoint_at(empty, print)


# ------------------------------------------------------------------ prepared data as --data
def _prepared(path: Path, meta) -> Path:
    path.mkdir()
    (path / "meta.json").write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("meta", [{"tokenizer": "char", "vocab_size": 70}, {"tokenizer": "bpe", "vocab_size": 4096}])
def test_prepared_data_decides_the_tokenizer(tmp_path, meta):
    cfg = RunConfig()
    cfg.data.data = str(_prepared(tmp_path / "p", meta))
    cfg.data.tokenizer, cfg.data.vocab_size = "bpe" if meta["tokenizer"] == "char" else "char", 3
    use_prepared_tokenizer(cfg)
    assert (cfg.data.tokenizer, cfg.data.vocab_size) == (meta["tokenizer"], meta["vocab_size"])


@pytest.mark.parametrize(
    "meta",
    [
        {"tokenizer": "word", "vocab_size": 70},
        {"tokenizer": "char"},
        {"tokenizer": "char", "vocab_size": True},
        {"tokenizer": "char", "vocab_size": "70"},
        ["char", 70],
    ],
)
def test_prepared_data_whose_meta_json_names_no_tokenizer_is_refused(tmp_path, meta):
    cfg = RunConfig()
    cfg.data.data = str(_prepared(tmp_path / "p", meta))
    before = (cfg.data.tokenizer, cfg.data.vocab_size)
    with pytest.raises(NanolmError) as e:
        use_prepared_tokenizer(cfg)
    assert str(e.value) == (
        f"prepared data {tmp_path / 'p'}: its meta.json does not say which tokenizer the shards "
        f"use (damaged, or not written by nanolm prepare); prepare the data again"
    )
    assert (cfg.data.tokenizer, cfg.data.vocab_size) == before


def test_raw_text_or_no_data_leaves_the_tokenizer_options_and_takes_no_lock(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello")
    taken = []

    class Reading:
        def take(self, path, flag):
            taken.append((path, flag))

    for data in ("", str(text), str(tmp_path)):
        cfg = RunConfig()
        cfg.data.data = data
        use_prepared_tokenizer(cfg)
        hold_prepared_data(cfg, Reading())
        assert (cfg.data.tokenizer, cfg.data.vocab_size) == (RunConfig().data.tokenizer, RunConfig().data.vocab_size)
    assert taken == []
    cfg.data.data = str(_prepared(tmp_path / "p", {"tokenizer": "char", "vocab_size": 5}))
    hold_prepared_data(cfg, Reading())
    assert taken == [(cfg.data.data, "--data")]


def test_a_run_inside_another_runs_checkpoint_is_refused_naming_out_dir(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text(json.dumps({"files": {}}))
    cfg = RunConfig()
    cfg.train.out_dir = str(checkpoint / "again")
    lock = _Lock()
    with pytest.raises(NanolmError, match=rf"^--out-dir {checkpoint / 'again'} is inside {checkpoint}, a checkpoint "):
        locate_run(cfg, lock, 1)
    assert lock.taken == [] and not (checkpoint / "again").exists()  # refused before anything is locked or made


def test_a_directory_written_without_a_lock_says_so_through_the_commands_log(tmp_path, monkeypatch):
    from nanolm.base.lock import NO_LOCK, RunLock

    monkeypatch.setenv(NO_LOCK, "1")
    cfg = RunConfig()
    cfg.train.out_dir = str(tmp_path / "out")
    said = []
    with RunLock() as lock:
        assert locate_run(cfg, lock, 1, log=said.append) == RunPlan(tmp_path / "out")
    assert said == [
        f"warning: {tmp_path / 'out'} is written without a lock ({NO_LOCK}=1): make sure no other process writes there"
    ]


def test_incompatible_changes_are_listed_together_and_gone_data_named_only_when_the_run_kept_no_copy(tmp_path):
    """A run on prepared data reads it where it is: when that is gone, its absence (not the
    tokenizer options it changed) is the thing to say. A run that keeps its own copy of its data
    (raw text, tokenized into RUN/data) is told its real differences."""
    out, cfg = _this_commands_run(tmp_path, "metrics.jsonl")
    cfg.data.data = str(tmp_path / "gone.txt")
    (out / "config.toml").write_text(cfg.to_toml())
    cfg.model.n_layer, cfg.model.n_embd = cfg.model.n_layer + 1, cfg.model.n_embd * 2
    with pytest.raises(NanolmError) as e:
        locate_run(cfg, _Lock(), 1)
    assert str(e.value) == (
        f"data path {tmp_path / 'gone.txt'} does not exist: the run in {out} trained on it; "
        f"restore it, or start a new run with another --out-dir"
    )
    (out / "data").mkdir()
    with pytest.raises(NanolmError) as e:
        locate_run(cfg, _Lock(), 1)
    differences = str(e.value).removeprefix(f"cannot continue the run in {out}: incompatible changes: ").split("; ")
    assert [line.split(":")[0] for line in differences] == ["n_layer", "n_embd"], str(e.value)
    assert str(e.value).endswith(". Keep those settings, or start a new run with another --out-dir")


def test_a_run_that_finished_with_no_checkpoint_left_is_done(tmp_path):
    """Final weights that verify, at the command's steps, with every checkpoint pruned (--keep 0):
    nothing to do, said in one line."""
    from nanolm.run.final import write_final
    from nanolm.tokenizer import train_char

    out, cfg = _this_commands_run(tmp_path, "metrics.jsonl", steps=5)
    train_char(["abc"]).save(out / "tokenizer.json")
    write_final(out, tiny_model(), step=5)
    plan = locate_run(cfg, _Lock(), 1)
    assert plan.finished and plan.checkpoint is None and plan.out_dir == out
    assert plan.message == (
        f"{out} finished at step 5 of 5; nothing to do (raise --steps to train longer, or choose "
        f"another --out-dir for a new run)"
    )


def test_resume_never_starts_a_new_run_in_an_empty_directory(tmp_path):
    cfg = RunConfig()
    cfg.train.out_dir, cfg.train.resume = str(tmp_path / "new"), "never"
    assert locate_run(cfg, _Lock(), 1) == RunPlan(tmp_path / "new")


def test_resume_path_into_an_attempt_that_never_saved_restarts_it_and_keeps_the_checkpoints_validation_set(
    tmp_path, monkeypatch
):
    """--resume PATH into a directory whose attempt stopped before its first checkpoint: the
    attempt's logs are replaced (restart), and the run continues with the validation windows the
    checkpoint's run evaluated on (``--eval-windows`` not given)."""
    out, cfg = _this_commands_run(tmp_path, "metrics.jsonl")
    checkpoint = tmp_path / "other" / "checkpoints" / "step_000004"
    checkpoint.mkdir(parents=True)
    saved = RunConfig()
    saved.train.eval_windows = 12
    (checkpoint / "config.toml").write_text(saved.to_toml())
    monkeypatch.setattr(directory, "resume_checkpoint_at", lambda path, log: checkpoint)
    cfg.train.resume = str(checkpoint)
    said = []
    assert locate_run(cfg, _Lock(), 1, log=said.append) == RunPlan(
        out, checkpoint=checkpoint, restart=True, eval_windows=12
    )
    assert said == [
        f"{out} holds a run that stopped before its first checkpoint was saved; its files give way to "
        f"the run continued from {checkpoint}"
    ]


def test_a_run_named_after_its_data_says_what_it_found_there(tmp_path, monkeypatch):
    """Without --out-dir the run lives in runs/NAME: an attempt there that never saved is started
    again, said in the same line as with --out-dir."""
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig()
    cfg.data.data = "data/toy.txt"
    out = _run_dir(Path("runs") / "toy", "metrics.jsonl")
    (out / "config.toml").write_text(cfg.to_toml())
    said = []
    assert locate_run(cfg, _Lock(), 1, log=said.append) == RunPlan(out, restart=True)
    assert said == [
        f"{out} holds a run that stopped before its first checkpoint was saved; starting it again from step 0"
    ]


@pytest.mark.parametrize("removed_before_exit", [False, True])
def test_a_private_copy_of_a_checkpoint_goes_when_its_process_ends_and_the_end_stays_quiet(
    tmp_path, removed_before_exit
):
    """The copy a resume of a live run continues from is this process's own: removed at its exit,
    quietly even when something removed it first; a leftover (after a SIGKILL) says what it is."""
    checkpoint = tmp_path / "step_000004"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    code = (
        "import shutil, sys; from pathlib import Path; from nanolm.run.directory import _private_copy\n"
        "copy = _private_copy(Path(sys.argv[1])); print(copy, flush=True)\n"
        "assert (copy / 'model.safetensors').read_bytes() == b'weights'\n"
        "if sys.argv[2] == 'removed': shutil.rmtree(copy.parent)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint), "removed" if removed_before_exit else "kept"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    copy = Path(done.stdout.strip())
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert copy.name == checkpoint.name and copy.parent.name.startswith("nanolm-resume-") and not copy.parent.exists()


@pytest.mark.parametrize("source, named", [("", "the built-in corpus"), ("corpus.txt", "corpus.txt")])
def test_damaged_run_data_whose_source_gives_other_data_is_refused_naming_the_source(
    tmp_path, monkeypatch, source, named
):
    cfg = RunConfig()
    cfg.data.data = source
    damaged = tmp_path / "run" / "data"
    damaged.mkdir(parents=True)
    (damaged / "meta.json").write_text("{damaged")
    monkeypatch.setattr(
        directory,
        "load_training_data",
        lambda cfg, scratch, log, compressor_bounds: type("Prepared", (), {"digest": "1" * 64})(),
    )
    monkeypatch.setattr(directory, "read_checkpoint_meta", lambda checkpoint: {"data_digest": "0" * 64})
    with pytest.raises(NanolmError) as refused:
        directory.open_run_data(
            damaged, tmp_path / "run" / "checkpoints" / "step_000004", cfg, tmp_path / "scratch", log=lambda *_: None
        )
    assert str(refused.value) == (
        f"{damaged} is damaged, and its source ({named}) no longer gives the data the run "
        f"was trained on; restore the source, or start a new run with another --out-dir"
    )


def test_the_built_in_corpus_reads_no_meta_json_of_the_directory_it_runs_in(tmp_path, monkeypatch):
    """Without --data there is no prepared directory to take a tokenizer from, whatever the
    current directory holds (a prepared directory's meta.json among them)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": "bpe", "vocab_size": 300}))
    cfg = RunConfig()
    cfg.data.data = ""
    before = (cfg.data.tokenizer, cfg.data.vocab_size)
    use_prepared_tokenizer(cfg)
    assert (cfg.data.tokenizer, cfg.data.vocab_size) == before


def test_a_training_split_of_exactly_one_window_is_enough_and_one_token_less_is_refused(tmp_path):
    """A window is --seq-len + 1 tokens (its inputs and, shifted by one, its targets): a split of
    exactly that many trains; one token fewer is refused before the run directory is written."""
    from nanolm.distributed import Distributed
    from nanolm.run.directory import set_up_run_directory

    text = tmp_path / "text.txt"
    text.write_text("a short document, the whole of the training split\n")
    cfg = RunConfig()
    cfg.data.data, cfg.data.tokenizer, cfg.data.val_fraction = str(text), "char", 0.0
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.seq_len = 1, 2, 32, 8
    cfg.train.eval_windows = 1

    said = []

    def set_up(out):
        return set_up_run_directory(cfg, Distributed(), RunPlan(out), "fp32", log=said.append)

    n = len(set_up(tmp_path / "first").train)
    assert said == [f"data: {text}"]  # the run's own lines go where the run logs
    cfg.model.seq_len = n - 1  # seq_len + 1 == n: one window
    assert len(set_up(tmp_path / "fits").train) == n
    cfg.model.seq_len = n
    with pytest.raises(NanolmError) as refused:
        set_up(tmp_path / "refused")
    assert str(refused.value) == (
        f"the training split holds {n} tokens, fewer than one window of --seq-len + 1 = "
        f"{n + 1}; use more text or a smaller --seq-len"
    )
    assert not (tmp_path / "refused").exists()


def test_a_run_directory_is_made_with_its_parents_or_taken_as_the_lock_left_it_and_this_runs_memory_checked(
    tmp_path, monkeypatch
):
    import nanolm.run.plan
    from nanolm.distributed import Distributed
    from nanolm.run.directory import set_up_run_directory

    text = tmp_path / "text.txt"
    text.write_text("a short document, the whole of the training split\n")
    cfg = RunConfig()
    cfg.data.data, cfg.data.tokenizer, cfg.data.val_fraction = str(text), "char", 0.0
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.seq_len = 1, 2, 32, 8
    cfg.train.eval_windows, cfg.train.batch_size, cfg.train.grad_accum = 3, 2, 5
    checked = []
    monkeypatch.setattr(nanolm.run.plan, "check_memory", lambda *args, **kwargs: checked.append((args, kwargs)))
    existing = tmp_path / "existing"  # what the lock leaves: the directory, empty
    existing.mkdir()
    for out in (tmp_path / "new" / "deeper" / "run", existing):
        data = set_up_run_directory(cfg, Distributed(), RunPlan(out), "fp32", log=lambda *_: None)
        assert (out / "config.toml").read_text() == cfg.to_toml() and (out / "data" / "meta.json").is_file()
    args, kwargs = checked[0]
    assert args[0] == cfg.model.gpt_config(data.tokenizer.vocab_size) and args[1] == "fp32"
    # the validation windows the split holds (none: --val-fraction 0), not the 3 asked for
    assert args[3:] == (2, 0, cfg.optim.optimizer) and kwargs == {"grad_accum": 5}


def test_setting_up_a_run_removes_its_killed_writes_and_a_restarted_attempts_logs(tmp_path):
    """A ``kill -9`` between an atomic write's temporary file and its rename leaves ``.NAME.xxxxxxxx``
    (config.toml, tokenizer.json, metrics.jsonl); an attempt that never saved left its logs and
    maybe final.json: the set-up removes all of them before the run writes anything."""
    from nanolm.distributed import Distributed
    from nanolm.run.directory import set_up_run_directory

    text = tmp_path / "text.txt"
    text.write_text("a short document, the whole of the training split\n")
    cfg = RunConfig()
    cfg.data.data, cfg.data.tokenizer, cfg.data.val_fraction = str(text), "char", 0.0
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.seq_len = 1, 2, 32, 8
    cfg.train.eval_windows = 1
    out = tmp_path / "run"
    out.mkdir()
    killed = [f".{name}.a1b2c3d4" for name in ("config.toml", "tokenizer.json", "metrics.jsonl")]
    stale = ["metrics.jsonl", "events.jsonl", "final.json"]
    for name in [*killed, *stale, ".notes.a1b2c3d4", "notes.txt"]:
        (out / name).write_text("left")
    set_up_run_directory(cfg, Distributed(), RunPlan(out, restart=True), "fp32", log=lambda *_: None)
    assert sorted(p.name for p in out.iterdir()) == [
        ".notes.a1b2c3d4",
        "config.toml",
        "data",
        "notes.txt",
        "tokenizer.json",
    ]
