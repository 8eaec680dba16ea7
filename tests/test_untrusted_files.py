"""No file nanolm loads can run code, and every file it loads is checked before it is trusted.

A pickle runs code when it is loaded. Each test here puts a crafted pickle (it creates a
marker file when unpickled) in place of one file of a real run directory, then drives every
command that loads a run: ``sample``, ``eval``, ``export``, ``train`` resuming the run and
``train --resume PATH``. The marker must never appear, no command may end in a traceback,
and a command that cannot go on says why in one line. Each file is tried twice: as damage
(the manifests no longer match) and as an attack (the manifests and seals recomputed to
vouch for the crafted file), so that the loaders themselves, not only the checksums, refuse
to execute anything.
"""

import json
import os
import pickle
import shutil
import sys

import pytest
from conftest import tiny_run_config

from nanolm.base.files import sealed, sha256_file
from nanolm.instruments.cli import main

MARKER_NAME = "code-ran"


class _Exploit:
    marker = None

    def __reduce__(self):
        return (os.system, (f"touch {_Exploit.marker}",))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, stories_file):
    from nanolm.train import train

    out = tmp_path_factory.mktemp("target") / "run"
    cfg = tiny_run_config(stories_file, out, steps=4, eval_every=2, ckpt_every=2, keep=0, threads=1)
    train(cfg, log=lambda *_: None)
    return out


def _manifest_owner(rel: str) -> str | None:
    """The metadata file whose manifest lists ``rel``, relative to the run directory."""
    parts = rel.split("/")
    if parts[0] == "checkpoints" and len(parts) > 2 and parts[-1] != "meta.json":
        return "/".join(parts[:2]) + "/meta.json"
    if parts[0] == "data" and parts[-1] != "meta.json":
        return "data/meta.json"
    if rel in ("model.safetensors", "config.toml", "tokenizer.json"):
        return "final.json"
    return None


def _vouch_for(run: "os.PathLike", rel: str) -> None:
    """Recompute the manifest entry and seal that cover ``rel``, as an attacker would."""
    owner = _manifest_owner(rel)
    if owner is None:
        return
    meta_path = run / owner
    meta = json.loads(meta_path.read_text())
    meta.pop("seal", None)
    key = os.path.relpath(run / rel, meta_path.parent)
    meta["files"][key] = sha256_file(run / rel)
    meta_path.write_text(json.dumps(sealed(meta)))


def _few_stories(stories_file, scratch) -> str:
    """The first stories of the corpus: what ``eval`` reads of the run is the same whatever text it
    scores, and scoring all 300 stories for every file and attack would be most of this test's time."""
    separator = "\n<|endoftext|>\n"
    path = scratch.parent / "few_stories.txt"
    if not path.exists():
        path.write_text(separator.join(stories_file.read_text().split(separator)[:8]))
    return path


def _commands(run, stories_file, scratch):
    checkpoint = run / "checkpoints" / "step_000004"
    train = [
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
        "--batch-size",
        "4",
        "--eval-batches",
        "2",
        "--sample-tokens",
        "0",
        "--log-every",
        "1",
        "--eval-every",
        "2",
        "--ckpt-every",
        "2",
        "--keep",
        "0",
        "--threads",
        "1",
        "--steps",
        "6",
    ]
    return {  # read-only commands first; resuming in place writes into the run
        "sample": ["sample", "--run", str(run), "--max-new-tokens", "4"],
        "eval": ["eval", "--run", str(run), "--data", str(_few_stories(stories_file, scratch))],
        "export": ["export", str(run), "--out", str(scratch / "hf")],
        "resume PATH": ["train", *train, "--out-dir", str(scratch / "continued"), "--resume", str(checkpoint)],
        "resume": ["train", *train, "--out-dir", str(run)],
    }


def _every_file(run) -> list[str]:
    return sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())


def test_the_run_holds_every_kind_of_file_a_load_path_reads(run_dir):
    files = _every_file(run_dir)
    for expected in (
        "config.toml",
        "tokenizer.json",
        "model.safetensors",
        "final.json",
        "metrics.jsonl",
        "checkpoints/latest",
        "checkpoints/step_000004/state.pt",
        "checkpoints/step_000004/meta.json",
        "data/train.bin",
        "data/train_docs.npy",
        "data/meta.json",
        "data/tokenizer.json",
    ):
        assert expected in files


@pytest.mark.parametrize("vouched", [False, True], ids=["damaged", "attacked"])
def test_a_crafted_pickle_in_any_file_runs_nothing_and_is_refused_in_one_line(
    run_dir, stories_file, tmp_path, capsys, vouched
):
    _Exploit.marker = tmp_path / MARKER_NAME
    payload = pickle.dumps({"step": 4, "payload": _Exploit()}, protocol=2)
    outcomes = {}
    for rel in _every_file(run_dir):
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(run_dir, work / "run")
        (work / "run" / rel).write_bytes(payload)
        if vouched:
            _vouch_for(work / "run", rel)
        for name, argv in _commands(work / "run", stories_file, work).items():
            code = main(argv)
            out, err = capsys.readouterr()
            lines = err.strip().splitlines()
            where = f"{rel} / {name}"
            assert not _Exploit.marker.exists(), f"{where}: the pickle ran"
            assert code in (0, 2), f"{where}: exit {code}"
            assert all(line.startswith(("warning:", "error:")) for line in lines), f"{where}: {lines}"
            assert "Traceback" not in out + err
            if code == 2:
                assert lines and lines[-1].startswith("error: ") and sum(x.startswith("error:") for x in lines) == 1
            outcomes[(rel, name)] = code
            if os.environ.get("NANOLM_SHOW_OUTCOMES"):
                print(f"{'attacked' if vouched else 'damaged'} {where}: exit {code}: {lines}", file=sys.__stdout__)
    refused = {key for key, code in outcomes.items() if code == 2}
    # damaged final weights fall back to the newest valid checkpoint and the run's damaged
    # data is prepared again from its source; a file vouched for that cannot be parsed stops
    assert (("config.toml", "sample") in refused) == vouched
    assert ("checkpoints/step_000004/state.pt", "resume PATH") in refused  # it names that very checkpoint
    assert ("checkpoints/step_000004/state.pt", "resume") not in refused  # it falls back to step 2
