"""The command line end to end, and every kind of bad input getting one clear line."""

import json
import os
from pathlib import Path

import pytest
from conftest import TINY_TRAIN, run_cli, run_main

from nanolm.instruments.cli import main
from nanolm.watch.sinks import read_metrics

TRAIN_ROW_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "elapsed_s"}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, stories_file):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    result = run_main(
        "train",
        "--data",
        stories_file,
        "--steps",
        6,
        "--eval-every",
        3,
        "--log-every",
        2,
        "--out-dir",
        out,
        *TINY_TRAIN,
    )
    assert result.returncode == 0, result.stderr
    return out, result


def test_training_writes_a_complete_run_directory(trained_run):
    out, result = trained_run
    for name in ("config.toml", "tokenizer.json", "metrics.jsonl", "model.safetensors"):
        assert (out / name).is_file(), name
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 6]
    assert rows[0].keys() >= {"step", "val_loss", "val_bpb"} and "loss" not in rows[0]
    for r in rows[1:]:
        assert r.keys() >= TRAIN_ROW_KEYS
    evals = [r["step"] for r in rows if "val_loss" in r]
    assert evals == [0, 3, 6] and all(rows[i].keys() >= TRAIN_ROW_KEYS for i in (3, 5))
    assert "val bpb" in result.stdout and "sample:" in result.stdout and "tok/s" in result.stdout


@pytest.mark.kernels
def test_sample_and_eval_read_the_run_directory(trained_run, stories_file):
    out, _ = trained_run
    a = run_cli("sample", "--run", out, "--prompt", "Once upon", "--max-new-tokens", 20, "--seed", 1)
    b = run_main("sample", "--run", out, "--prompt", "Once upon", "--max-new-tokens", 20, "--seed", 1)  # and in-process
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("Once upon")
    r = run_main("eval", "--run", out, "--data", stories_file, "--json")
    assert r.returncode == 0, r.stderr
    figures = json.loads(r.stdout.splitlines()[-1])
    assert figures["ppl"] == pytest.approx(2.718281828 ** figures["loss"], rel=1e-6)
    separators = 299 * len("\n<|endoftext|>\n")
    assert figures["bytes"] == stories_file.stat().st_size - separators  # every byte of text counted once
    again = run_cli("eval", "--run", out, "--data", stories_file, "--json")
    assert again.stdout == r.stdout  # deterministic


def test_module_entry_points_match_the_cli(trained_run, tmp_path, stories_file):
    out, _ = trained_run
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "nanolm.sample", "--run", str(out), "--max-new-tokens", "5"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "nanolm.train", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--grad-accum" in r.stdout


def test_help_documents_every_flag_with_its_default():
    r = run_main("train", "--help")
    flags = [
        "--data",
        "--tokenizer",
        "--vocab-size",
        "--steps",
        "--lr",
        "--min-lr",
        "--warmup",
        "--batch-size",
        "--grad-accum",
        "--seq-len",
        "--n-layer",
        "--n-head",
        "--n-embd",
        "--weight-decay",
        "--clip",
        "--seed",
        "--device",
        "--compile",
        "--eval-every",
        "--eval-batches",
        "--out-dir",
        "--config",
    ]
    for flag in flags:
        assert flag in r.stdout, flag
    assert r.stdout.count("(default:") >= len(flags) - 1


def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    return err[0]


@pytest.mark.parametrize(
    "content, flags, message",
    [
        (None, [], "does not exist"),
        (b"", [], "is empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00", [], "binary"),
        ("caf\u00e9".encode("latin-1") * 100, [], "not valid UTF-8"),
        (b"too short", [], "fewer than one window"),
        (b"plenty of text " * 500, ["--vocab-size", "100"], "at least 257"),
        (b"plenty of text " * 500, ["--n-embd", "30", "--n-head", "4"], "divisible"),
        (b"plenty of text " * 500, ["--device", "tpu"], "device"),
        (b"plenty of text " * 500, ["--device", "cuda:7"], "device"),
        (b"plenty of text " * 500, ["--steps", "0"], "--steps must be positive"),
        (b"plenty of text " * 500, ["--batch-size", "-2"], "--batch-size must be positive"),
        (b"plenty of text " * 500, ["--lr", "-1"], "--lr"),
        (b"plenty of text " * 500, ["--attention", "flex", "--device", "cpu"], "FlexAttention has no backward"),
        (b"plenty of text " * 500, ["--stats-every", "-1"], "--stats-every must be >= 0"),
        (
            b"plenty of text " * 500,
            ["--threads", "-1"],
            "--threads must be auto, or a number of threads from 1 to 1024",
        ),
        (
            b"plenty of text " * 500,
            ["--threads", "100000"],
            "--threads must be auto, or a number of threads from 1 to 1024",
        ),
        (b"plenty of text " * 500, ["--vocab-size", str(2**29)], "--vocab-size must be positive and at most 16777216"),
        (b"plenty of text " * 500, ["--grad-accum", str(2**40)], "micro-batches of --batch-size"),
        (b"plenty of text " * 500, ["--peak-flops", "-5"], "--peak-flops"),
        (b"plenty of text " * 500, ["--log", "tensorboard,csv"], "unknown --log sink 'csv'"),
        (b"plenty of text " * 500, ["--ckpt-every", "0"], "--ckpt-every must be positive"),
        (b"plenty of text " * 500, ["--beta1", "2"], "--beta1 must be in [0, 1)"),
        (b"plenty of text " * 500, ["--beta2", "-0.5"], "--beta2 must be in [0, 1)"),
        (b"plenty of text " * 500, ["--keep", "-2"], "--keep must be >= 0"),
        (b"plenty of text " * 500, ["--sample-tokens", "-1"], "--sample-tokens must be >= 0"),
        (b"plenty of text " * 500, ["--rope-theta", "0"], "--rope-theta must be a positive number"),
        (b"plenty of text " * 500, ["--warmup", "500"], "--warmup must be at most --steps (2)"),
        (b"plenty of text " * 500, ["--dropout", "1"], "--dropout must be in [0, 1)"),
        (b"plenty of text " * 500, ["--lr", "nan"], "--lr must be a positive number"),
        (b"plenty of text " * 500, ["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
        (b"plenty of text " * 500, ["--seed", "-1"], "--seed must be in [0, 2^32)"),
        (b"plenty of text " * 500, ["--n-layer", "0"], "--n-layer must be positive"),
        (b"plenty of text " * 500, ["--clip", "inf"], "--clip must be >= 0"),
        (b"plenty of text " * 500, ["--val-fraction", "1"], "--val-fraction must be in [0, 1)"),
        (b"plenty of text " * 500, ["--spike-window", "2"], "--spike-window must be >= 5"),
        (b"plenty of text " * 500, ["--rollback-lr-scale", "0"], "--rollback-lr-scale must be in (0, 1]"),
        (b"plenty of text " * 500, ["--target-val-bpb", "-1"], "--target-val-bpb must be >= 0"),
        (b"plenty of text " * 500, ["--resume", "no/such/run"], "no valid checkpoint there"),
        (
            b"plenty of text " * 500,
            ["--optimizer", "muon", "--dist", "fsdp"],
            "--optimizer muon does not combine with --dist fsdp",
        ),
        (b"plenty of text " * 500, ["--optimizer", "muon", "--precision", "bf16-pure"], "use --precision bf16"),
        (b"plenty of text " * 500, ["--muon-lr", "0.01"], "--muon-lr only applies to --optimizer muon"),
        (b"plenty of text " * 500, ["--optimizer", "muon", "--muon-lr", "0"], "--muon-lr must be a positive number"),
        (
            b"plenty of text " * 500,
            ["--optimizer", "muon", "--muon-momentum", "1"],
            "--muon-momentum must be in [0, 1)",
        ),
        (
            b"plenty of text " * 2000,
            [
                "--batch-size",
                "100000",
                "--tokenizer",
                "char",
                "--n-layer",
                "4",
                "--n-head",
                "4",
                "--n-embd",
                "128",
                "--seq-len",
                "128",
            ],
            "lower --batch-size",
        ),  # ~700 GB
    ],
)
def test_bad_input_gets_one_line_exit_2_and_writes_nothing(tmp_path, capsys, content, flags, message):
    data = tmp_path / "data.txt"
    if content is not None:
        data.write_bytes(content)
    out = tmp_path / "run"
    code = main(["train", "--data", str(data), "--out-dir", str(out), "--steps", "2", *TINY_TRAIN[:-2], *flags])
    assert code == 2
    assert message in _error_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sample", "--top-k", "-3"], "--top-k must be >= 0"),
        (["sample", "--max-new-tokens", "0"], "--max-new-tokens must be positive"),
        (["sample", "--temperature", "nan"], "--temperature must be >= 0"),
        (["sample", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["eval", "--batch-size", "0", "--data", "x.txt"], "--batch-size must be positive"),
    ],
)
def test_bad_sampling_and_evaluation_options_get_one_line(trained_run, capsys, argv, message):
    out, _ = trained_run
    assert main([argv[0], "--run", str(out), *argv[1:]]) == 2
    assert message in _error_line(capsys)


def test_sample_prints_only_the_text_on_stdout_and_its_warnings_on_stderr(trained_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run[0], run)
    (run / "model.safetensors").write_bytes(b"damaged")
    r = run_cli("sample", "--run", run, "--prompt", "Once upon", "--max-new-tokens", 10, "--seed", 1)
    assert r.returncode == 0 and r.stdout.startswith("Once upon") and "warning" not in r.stdout
    assert "model.safetensors is missing or corrupt" in r.stderr and "newest valid checkpoint" in r.stderr


def test_bad_input_from_a_fresh_process_has_no_traceback(tmp_path):
    r = run_cli("train", "--data", tmp_path / "missing.txt", "--out-dir", tmp_path / "run")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: data path {tmp_path / 'missing.txt'} does not exist"]
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


def test_an_existing_run_is_never_overwritten(trained_run, capsys, stories_file):
    out, _ = trained_run
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["train", "--data", str(stories_file), "--out-dir", str(out), "--resume", "never", *TINY_TRAIN]) == 2
    assert "already holds a run" in _error_line(capsys)
    # the same command again resumes the finished run: nothing to do, nothing rewritten
    assert main(["train", "--data", str(stories_file), "--out-dir", str(out), "--steps", "6", *TINY_TRAIN]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


def test_config_file_sets_options_and_flags_win(tmp_path, capsys, stories_file):
    toml = tmp_path / "c.toml"
    toml.write_text(
        f'[data]\ndata = "{stories_file}"\ntokenizer = "char"\n[train]\nsteps = 2\nsample_tokens = 0\n'
        f"[model]\nn_layer = 1\nn_embd = 32\nseq_len = 16\n"
    )
    out = tmp_path / "run"
    assert main(["train", "--config", str(toml), "--steps", "3", "--out-dir", str(out)]) == 0
    written = (out / "config.toml").read_text()
    assert "steps = 3" in written and 'tokenizer = "char"' in written and "n_layer = 1" in written
    assert "min_lr = " in written and "warmup = " in written  # derived values are resolved and recorded
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")][-1] == 3
    # the written config repeats the run
    again = tmp_path / "again"
    assert main(["train", "--config", str(out / "config.toml"), "--out-dir", str(again)]) == 0
    rows = [r for r in read_metrics(again / "metrics.jsonl") if "loss" in r]
    assert [r["loss"] for r in rows] == [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize(
    "text, message",
    [
        ("[train]\nstep = 3\n", "unknown option 'step'"),
        ("[train]\nlr = 0.1\n", "belongs in [optim]"),
        ("[training]\n", "unknown section"),
        ("[train]\nsteps = 'many'\n", "must be a int"),
        ("[data]\ntokenizer = 'word'\n", "must be one of"),
        ("[train\n", "not valid TOML"),
        ("model = 3\n", "model in"),  # was "unknown section [model] ... known: [model], ..."
        ("[train]\nsteps = " + "1" * 5000 + "\n", "holds a value Python cannot read"),
        ("[train]\nsteps = 0x" + "f" * 5000 + "\n", "holds an integer of 20001 bits"),
        ("[train]\nsteps = " + "[" * 3000 + "]" * 3000 + "\n", "deeper than Python can parse"),
        ("[train]\nsteps = '" + "x" * 5000 + "'\n", "(5002 characters)"),  # the value quoted, not a page of it
    ],
)
def test_bad_config_files_get_one_line(tmp_path, capsys, text, message):
    toml = tmp_path / "c.toml"
    toml.write_text(text)
    assert main(["train", "--config", str(toml), "--out-dir", str(tmp_path / "run")]) == 2
    assert message in _error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_a_directory_holding_files_a_run_would_write_is_refused(tmp_path, capsys, stories_file):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.txt").write_text("the user's own file")
    assert main(["train", "--data", str(stories_file), "--out-dir", str(tmp_path), *TINY_TRAIN]) == 2
    assert "holds data but no config.toml" in _error_line(capsys)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["data", "mine.txt"]


def test_a_fifo_as_config_is_named_as_a_pipe_not_as_missing(tmp_path, capsys):
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    assert main(["train", "--config", str(fifo), "--out-dir", str(tmp_path / "run")]) == 2
    assert "is a pipe or a device, not a file" in _error_line(capsys)


@pytest.mark.parametrize("command, flag", [("report", "--out"), ("export", "--out"), ("prepare", "--out")])
def test_a_read_only_destination_names_the_commands_own_flag(trained_run, tmp_path, capsys, monkeypatch, command, flag):
    """A full or read-only disk is one line ending in what to do; "choose another --out-dir"
    sent a user of ``nanolm report`` looking for a flag it does not have."""
    import errno

    import nanolm.instruments.cli as cli

    def read_only(args):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "x"))

    monkeypatch.setattr(cli, f"_{command}", read_only)
    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser, command, read_only))
    argv = {
        "report": ["report", str(trained_run)],
        "export": ["export", str(trained_run), "--out", str(tmp_path / "h")],
        "prepare": ["prepare", "--data", str(tmp_path), "--out", str(tmp_path / "p")],
    }[command]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert f"choose another {flag}" in line and "--out-dir" not in line


def _with_func(parser, command, func):
    """``parser`` with ``command``'s handler replaced (set_defaults on its subparser)."""
    for action in parser._subparsers._group_actions:
        action.choices[command].set_defaults(func=func)
    return parser


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--val-fraction", "1"], "--val-fraction must be in [0, 1), got 1.0"),
        (["--val-fraction", "-0.01"], "--val-fraction must be in [0, 1), got -0.01"),
        (["--seq-len", "1"], "--seq-len must be at least 2, got 1"),
        (["--vocab-size", "0"], "--vocab-size must be positive and at most 16777216, got 0"),
        (["--vocab-size", str(2**24 + 1)], f"--vocab-size must be positive and at most 16777216, got {2**24 + 1}"),
    ],
)
def test_prepare_refuses_numbers_past_their_bounds_in_one_line_and_writes_nothing(tmp_path, capsys, flags, message):
    data = tmp_path / "data.txt"
    data.write_text("plenty of text " * 50)
    assert main(["prepare", "--data", str(data), "--out", str(tmp_path / "p"), *flags]) == 2
    assert _error_line(capsys) == f"error: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.txt"]


def test_prepare_refuses_an_output_path_that_is_not_utf8_naming_its_flag_and_why(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("plenty of text " * 50)
    out = str(tmp_path / "caf\udce9")  # the byte 0xE9 of a Latin-1 name, as Python keeps it
    assert main(["prepare", "--data", str(data), "--out", out]) == 2
    assert _error_line(capsys) == (
        f"error: --out {out.encode('utf-8', 'surrogateescape')!r} is not valid UTF-8 text, and the tokenizer "
        "library can only open UTF-8 paths; rename it (or link to it) with a UTF-8 name"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.txt"]


def test_prepare_names_its_out_flag_in_each_refusal_of_where_it_writes(tmp_path, capsys):
    """Every refusal of prepare's output names the option to change: --out (not train's --out-dir)."""
    from nanolm.base.lock import RunLock

    data = tmp_path / "data.txt"
    data.write_text("plenty of text " * 50)
    prepared = tmp_path / "prepared"
    assert main(["prepare", "--data", str(data), "--out", str(prepared), "--tokenizer", "char"]) == 0
    stories = prepared / "stories.txt"
    for argv, out in (
        (["prepare", "--data", str(data), "--out", str(prepared / "p")], prepared / "p"),  # inside prepared data
        (["prepare", "--data", str(data), "--out", "/"], Path("/")),  # a mount point
        (["data", "stories", "--docs", "3", "--out", str(stories)], stories),  # `data stories` alike
    ):
        capsys.readouterr()
        assert main(argv) == 2
        line = _error_line(capsys)
        assert line.startswith(f"error: --out {out} ") and line.count("--out") == 2, line  # the fix names it too
    with RunLock() as held:  # another writer holds the directory
        held.take(tmp_path / "busy")
        assert main(["prepare", "--data", str(data), "--out", str(tmp_path / "busy")]) == 2
        assert _error_line(capsys).endswith("; wait for it to end, or choose another --out")


def test_prepare_passes_its_text_field_and_progress_on(tmp_path, capsys, monkeypatch):
    import nanolm.data.prepare as preparing

    records = tmp_path / "stories.jsonl"
    records.write_text("".join(f'{{"story": "story number {i} is short"}}\n' for i in range(40)))
    asked = []
    real = preparing.prepare
    monkeypatch.setattr(preparing, "prepare", lambda *a, **k: asked.append((a, k)) or real(*a, **k))
    out = tmp_path / "p"
    flags = ["--text-field", "story", "--tokenizer", "char", "--progress", "lines"]
    assert main(["prepare", "--data", str(records), "--out", str(out), *flags]) == 0
    ((args, kwargs),) = asked
    assert args[6] == "story" and kwargs["progress"] == "lines"
    assert "train: 36 documents" in capsys.readouterr().out


def test_prepare_accepts_its_bounds_and_sums_up_what_it_wrote_from_its_meta_json(tmp_path, capsys):
    """The lines ``nanolm prepare`` ends with are its meta.json in words: each figure the file's own."""
    from nanolm.data.shards import PreparedData

    stories = tmp_path / "stories.txt"
    assert main(["data", "stories", "--docs", "60", "--out", str(stories)]) == 0
    for flags in (
        ["--val-fraction", "0", "--seq-len", "2", "--tokenizer", "char"],
        ["--vocab-size", str(2**24), "--seq-len", "16"],  # the largest vocabulary: BPE learns what it can
        ["--tokenizer", "char", "--seq-len", "16", "--vocab-size", "1"],  # the least vocabulary asked (char ignores it)
    ):
        out = tmp_path / f"p{len(list(tmp_path.iterdir()))}"
        capsys.readouterr()
        assert main(["prepare", "--data", str(stories), "--out", str(out), *flags]) == 0
        m = PreparedData(out).meta
        s = m["splits"]
        expected = [
            f"prepared {stories} -> {out} in {m['seconds']:.1f}s ({m['mb_per_s']:.1f} MB/s)",
            f"tokenizer: {m['tokenizer']}, {m['vocab_size']} tokens, shards {m['dtype']}",
            *(
                f"{n}: {s[n]['documents']} documents, {s[n]['tokens']} tokens, {s[n]['bytes']} bytes"
                for n in ("train", "val")
            ),
            f"mean document length: {m['mean_doc_tokens']} tokens; empty documents skipped: 0; bad records skipped: 0",
            f"windows of {m['seq_len_for_stats']} tokens crossing a document boundary: "
            f"{m['windows_crossing_a_boundary']} of {m['windows']} "
            f"({100 * m['windows_crossing_a_boundary'] / m['windows']:.1f}%)",
        ]
        if m["compressor_bpb"]:
            expected.append(
                "compressor bits per byte on the validation text (a model must beat these): "
                f"zlib {m['compressor_bpb']['zlib']:.3f}, xz {m['compressor_bpb']['xz']:.3f}"
            )
        if "floor" in m:
            expected.append(
                f"entropy floor of the validation text: {m['floor']['bpb']:.4f} bits/byte, "
                f"{m['floor']['nats_per_token']:.4f} nats/token"
            )
        assert capsys.readouterr().out.splitlines() == expected
        assert m["seq_len_for_stats"] == int(flags[flags.index("--seq-len") + 1])
        assert ("floor" in m) == (s["val"]["documents"] > 0) and s["val"]["documents"] == (0 if "0" in flags else 6)


# ------------------------------------------------------------------ how a command ends: its status and last line
def _ended(capsys, failure, command="prepare", **more):
    """The status and stderr of a command whose work ends with ``failure`` (raised, or returned)."""
    import argparse

    from nanolm.instruments.cli import _run

    def work(args):
        if isinstance(failure, BaseException):
            raise failure
        return failure

    code = _run(argparse.Namespace(func=work, command=command, **more))
    return code, capsys.readouterr().err


def test_each_way_a_command_can_end_has_its_status_and_one_line(capsys):
    import errno

    from nanolm.base.files import describe_os_error
    from nanolm.errors import NanolmError
    from nanolm.instruments.cli import OutputClosed
    from nanolm.machine.runtime import TrainingInterrupted

    assert _ended(capsys, None) == (0, "") and _ended(capsys, 3) == (3, "")
    assert _ended(capsys, NanolmError("a library's\n   two-line message\n")) == (
        2,
        "error: a library's two-line message\n",
    )
    assert _ended(capsys, OutputClosed()) == (141, "")
    assert _ended(capsys, TrainingInterrupted("SIGTERM: stopped after step 3", 15)) == (
        143,
        "SIGTERM: stopped after step 3\n",
    )
    for command, flag, more in (
        ("train", "--out-dir", {}),
        ("data", "--dir", {"data_command": "download"}),
        ("data", "--out", {"data_command": "stories"}),
        ("export", "--out", {}),
    ):
        for full in (  # the disk full, and a read-only one: its line names the flag to change
            OSError(errno.ENOSPC, "No space left on device", "/disk/file"),
            OSError(errno.EROFS, "Read-only file system", "/disk/file"),
        ):
            assert _ended(capsys, full, command, **more) == (
                2,
                f"error: {describe_os_error(full, flag)}; whatever was saved before is intact: run the same "
                f"command again once that is fixed\n",
            )
    for bug in (OSError(errno.EBADF, "Bad file descriptor"), ValueError("a bug"), KeyError("x")):
        with pytest.raises(type(bug)):  # not the machine's state: a traceback, which a bug report needs
            _ended(capsys, bug)


def test_a_ctrl_c_outside_a_runs_loop_is_one_line_and_the_status_of_the_signal_that_stopped_it(capsys, monkeypatch):
    import nanolm.instruments.cli as cli
    from nanolm.machine.runtime import StoppedAtOnce

    def parser_interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", parser_interrupted)
    assert main(["prepare"]) == 130 and capsys.readouterr().err == "interrupted\n"

    def stopped_at_once(args):
        raise StoppedAtOnce("SIGINT after SIGTERM: stopped at once", 15)

    monkeypatch.undo()
    monkeypatch.setattr(cli, "_run", stopped_at_once)
    assert main(["plan"]) == 143 and capsys.readouterr().err == "SIGINT after SIGTERM: stopped at once\n"


class _Stream:
    """A standard stream whose flush meets what the test says."""

    def __init__(self, fails=None):
        self.fails = fails

    def flush(self):
        if self.fails is not None:
            raise self.fails

    def write(self, text):
        return len(text)

    def fileno(self):
        raise OSError("no descriptor")


def test_what_is_still_buffered_at_exit_is_flushed_and_a_reader_gone_or_a_full_disk_said_once(monkeypatch, capsys):
    import errno
    import sys

    from nanolm.instruments.cli import ClosableOutput, OutputClosed, _flushed

    monkeypatch.setattr(sys, "stdout", _Stream())
    assert _flushed(0) == 0 and _flushed(7) == 7
    monkeypatch.setattr(sys, "stdout", _Stream(OutputClosed()))
    assert _flushed(0) == 141 and _flushed(2) == 2  # a reader that left: the quiet end of a pipe, unless it failed
    monkeypatch.setattr(sys, "stdout", ClosableOutput(_Stream(OSError(errno.ENOSPC, "No space left on device"))))
    assert _flushed(0) == 2
    assert capsys.readouterr().err == (
        "error: the command's stdout could not be written (No space left on device); "
        "free some space or write it elsewhere\n"
    )
    assert _flushed(3) == 3 and capsys.readouterr().err == ""  # an earlier failure's status and line stand
    monkeypatch.setattr(sys, "stdout", None)  # no console at all
    assert _flushed(0) == 0


def test_a_training_command_tunes_its_process_only_through_the_tuning_its_entry_gives(tmp_path, stories_file):
    """`nanolm train` (through `entry`) hands main() the process tuning it may apply; main() called
    from Python is given none, and leaves the process alone."""

    class Tuning:
        def __init__(self):
            self.asked = []

        def before_training(self, mode, device):
            self.asked.append((mode, device.type))

    tuning = Tuning()
    flags = ["--steps", "2", "--process-tuning", "off", "--device", "cpu", *TINY_TRAIN[:-2]]
    assert main(["train", "--data", str(stories_file), "--out-dir", str(tmp_path / "run"), *flags], tuning) == 0
    assert tuning.asked == [("off", "cpu")]
