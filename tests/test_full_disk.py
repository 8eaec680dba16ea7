"""A disk that fills up during a run: one line naming the file, nothing lost, and the same
command, once there is room, ends bit-identical to a run that never met a full disk.

Disks fill up in real training runs, most often at a save, the largest write. The writers
there do not say so in Python's terms: safetensors raises its own exception with the OS error
in words, ``torch.save`` to a real file a ``RuntimeError`` about an "unexpected pos". Here the
disk really fills: the run directory is a small RAM file system (tmpfs, mounted by root; the
tests skip where mounting is not allowed) with a filler file leaving exactly the room under
test, and "freeing some space" is deleting the filler.
"""

import math
import os
import subprocess
import uuid

import pytest
import torch
from safetensors.torch import load_file

from nanolm.instruments.cli import main
from nanolm.watch.sinks import read_metrics

PAGE = 4096
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
    "20",
    "--eval-every",
    "10",
    "--ckpt-every",
    "10",
    "--threads",
    "1",
]
SAME = ("step", "loss", "lr", "grad_norm", "val_loss")


def _command(data, out):
    return ["train", "--data", str(data), "--out-dir", str(out), *TINY]


def _pages(path) -> int:
    return math.ceil(path.stat().st_size / PAGE)


def _same_run(a, b) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    rows = [[{k: r.get(k) for k in SAME} for r in read_metrics(d / "metrics.jsonl")] for d in (a, b)]
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa) and rows[0] == rows[1]


@pytest.fixture(scope="module")
def alone(tmp_path_factory, stories_file):
    out = tmp_path_factory.mktemp("alone") / "run"
    assert main(_command(stories_file, out)) == 0
    return out


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(free_bytes)``: a 16 MiB tmpfs at ``tmp_path / "disk"`` with only
    ``free_bytes`` free (the rest a filler file); returns the filler, to delete for room."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", f"nanolm-test-{uuid.uuid4().hex[:8]}", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small file system here ({done.stderr.strip() or 'not root'})")

    def leave(free_bytes: int):
        filler = mount / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (16 * 2**20 - free_bytes))
        return filler

    try:
        yield mount, leave
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _room(alone, *, without: tuple[str, ...] = ()) -> int:
    """The bytes the run's files take in pages, but for the files named in ``without`` (paths
    relative to the run), plus two pages for the temporary copies of atomic writes."""
    files = [p for p in alone.rglob("*") if p.is_file() and str(p.relative_to(alone)) not in without]
    return (sum(_pages(p) for p in files) + 2) * PAGE


@pytest.mark.parametrize("fails_at", ["run data", "final weights", "checkpoint weights", "checkpoint state"])
def test_a_full_disk_is_one_line_naming_the_file_and_the_rerun_ends_bit_identical(
    fails_at, small_disk, alone, stories_file, capsys
):
    """The disk fills as the prepared data moves into the run (from a scratch directory on
    another file system), at the final weights (safetensors' own error), at the last
    checkpoint's weights, or at its optimizer state (``torch.save``'s short write): one line
    naming the file and the fix, exit 2; the previous checkpoint intact; the same command, once the space is
    freed, finishes the run bit-identical to one that never met a full disk."""
    mount, leave = small_disk
    out = mount / "run"
    last = alone / "checkpoints" / "step_000020"
    without = {
        "run data": tuple(
            str(p.relative_to(alone))
            for p in alone.rglob("*")
            if p.is_file() and p.name not in ("config.toml", "tokenizer.json")
        ),
        "final weights": ("model.safetensors", "final.json"),
        "checkpoint weights": tuple(str(p.relative_to(alone)) for p in last.iterdir())
        + ("model.safetensors", "final.json", "checkpoints/latest"),
        "checkpoint state": tuple(str(p.relative_to(alone)) for p in last.iterdir() if p.name != "model.safetensors")
        + ("model.safetensors", "final.json", "checkpoints/latest"),
    }[fails_at]
    filler = leave(_room(alone, without=without))
    assert main(_command(stories_file, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    named = {
        "run data": f"cannot write {out / 'data'}/",
        "final weights": f"cannot write {out / 'model.safetensors'}: No space left on device (free some space)",
        "checkpoint weights": "could not save the checkpoint of step 20: cannot write ",
        "checkpoint state": "could not save the checkpoint of step 20: cannot write ",
    }[fails_at]
    assert named in err[0], err[0]
    if fails_at == "run data":
        assert "No space left on device" in err[0] and not (out / "data").exists()
    elif fails_at != "final weights":
        file = "model.safetensors" if fails_at == "checkpoint weights" else "state.pt"
        assert f"/{file}: No space left on device (free some space); the previous checkpoint is intact" in err[0]
        assert (out / "checkpoints" / "latest").read_text().strip() == "step_000010"
    assert "Traceback" not in err[0] and not list(out.rglob(".*.tmp")) and not list(out.rglob(".tmp-*"))
    filler.unlink()  # room again
    assert main(_command(stories_file, out)) == 0
    assert _same_run(out, alone)


def test_a_write_error_without_a_file_name_gets_the_name_of_the_file_written():
    """Python's own writes raise OSError without the file's name, and safetensors raises its own
    exception type with the OS error in words: both become an OSError naming the file."""
    import errno

    from safetensors import SafetensorError

    from nanolm.base.files import naming_the_file

    with pytest.raises(OSError) as caught, naming_the_file("runs/x/metrics.jsonl"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.filename == "runs/x/metrics.jsonl" and caught.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as caught, naming_the_file("runs/x/model.safetensors"):
        raise SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)")
    assert (caught.value.errno, caught.value.filename) == (122, "runs/x/model.safetensors")
    with pytest.raises(ValueError), naming_the_file("x"):  # anything else passes unchanged
        raise ValueError("not a disk")
    assert os.strerror(122) == caught.value.strerror


def test_torch_save_on_a_disk_that_fills_at_any_point_is_an_oserror_naming_the_file(small_disk):
    """``torch.save`` swallows the disk's refusal on some of its writes (the record's, the zip
    directory's at the end) and reports only "unexpected pos": the file runs out of room at the
    start, in the middle and at the very end here, and each time the error is ENOSPC, named."""
    import errno
    import io

    from nanolm.base.files import save_torch

    mount, leave = small_disk
    state = {"moments": torch.arange(300_000, dtype=torch.float32), "step": 7}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    size = len(buffer.getvalue())
    for room in (PAGE, size // 2 // PAGE * PAGE, (size // PAGE) * PAGE):
        filler = leave(room)
        path = mount / "state.pt"
        with pytest.raises(OSError) as caught:
            save_torch(state, path)
        assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(path)), room
        path.unlink()
        filler.unlink()
    save_torch(state, mount / "state.pt")  # with room, the same call writes a file that loads
    assert torch.equal(torch.load(mount / "state.pt")["moments"], state["moments"])


def test_prepare_on_a_full_disk_is_one_line_naming_the_file_and_the_rerun_prepares_the_same(
    small_disk, stories_file, tmp_path, capsys
):
    """``nanolm prepare`` writes its shards as it tokenizes: a disk that fills there says which
    file, and the same command, once there is room, prepares exactly what it would have."""
    mount, leave = small_disk
    argv = ["prepare", "--data", str(stories_file), "--tokenizer", "char", "--out"]
    assert main([*argv, str(tmp_path / "roomy")]) == 0
    capsys.readouterr()
    filler = leave(2 * PAGE)
    assert main([*argv, str(mount / "prepared")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # the file that did not fit: in --out's place, or among the pieces kept beside it for the rerun
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert (
        f"cannot write {mount / 'prepared'}/" in err[0] or f"cannot write {mount / '.prepared.prepare-'}" in err[0]
    ), err
    filler.unlink()
    assert main([*argv, str(mount / "prepared")]) == 0
    for name in ("train.bin", "val.bin", "train_docs.npy", "val_docs.npy", "tokenizer.json"):
        assert (mount / "prepared" / name).read_bytes() == (tmp_path / "roomy" / name).read_bytes(), name
