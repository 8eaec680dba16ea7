"""Try every kind of bad input on a fresh process; each must be one line, exit 2, nothing lost.

The promise of nanolm's command line: a mistake a user can make gets one line starting with
``error:`` naming the problem and the fix, a non-zero exit status, no traceback, and nothing
already written (a finished run, a prepared corpus) changes, nor is anything left behind
(a refused ``prepare`` into a new directory makes none). This tool makes a scratch directory
with a finished run, a prepared corpus and a few odd files (crafted ones among them: a
5,000-digit integer, nesting deeper than Python's recursion limit, a table that is a number),
runs each bad command below in a new process (as a user would), and checks all five, hashing
every file before and after.

Some input is damage a reader promises to survive (docs/checkpoints.md, docs/data.md): a
crafted ``final.json`` falls back to the newest checkpoint, a crafted line of ``metrics.jsonl``
is left out, a crafted line of a ``.jsonl`` source is skipped and counted. Those commands must
succeed, each warning one line, with no traceback and nothing changed.

    python tools/bad_inputs.py            # ~140 commands, ~5 minutes on 2 cores
    python tools/bad_inputs.py --list

Exit status 1 if any command breaks the promise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = [
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
    "4",
    "--eval-every",
    "2",
    "--threads",
    "1",
]


BIG_INTEGER = "1" * 5000  # more digits than Python converts
DEEP = "[" * 5000 + "]" * 5000  # deeper than Python's recursion limit


def cases(d: Path) -> list[tuple[str, list[str]]]:
    """(what is wrong, argv) for each bad input that must be refused; ``d`` holds run/, prepared/,
    text.txt and friends."""
    text, run, new = str(d / "text.txt"), str(d / "run"), str(d / "new")

    def train(*flags):
        return ["train", "--data", text, "--out-dir", new, *TINY, *flags]

    out = [
        ("data file missing", ["train", "--data", str(d / "missing.txt"), "--out-dir", new]),
        ("data file empty", ["train", "--data", str(d / "empty.txt"), "--out-dir", new]),
        ("data file binary", ["train", "--data", str(d / "binary.bin"), "--out-dir", new]),
        ("data file not UTF-8", ["train", "--data", str(d / "latin1.txt"), "--out-dir", new]),
        ("data file name not UTF-8", ["train", "--data", os.fsdecode(bytes(d) + b"/caf\xe9.txt"), "--out-dir", new]),
        ("data is a pipe (FIFO)", ["train", "--data", str(d / "pipe.txt"), "--out-dir", new, *TINY]),
        ("out-dir name not UTF-8", ["train", "--data", text, "--out-dir", os.fsdecode(bytes(d) + b"/r\xe9"), *TINY]),
        ("text shorter than a window", ["train", "--data", str(d / "short.txt"), "--out-dir", new, *TINY]),
        ("config file missing", ["train", "--config", str(d / "nope.toml"), "--out-dir", new]),
        ("config file not TOML", ["train", "--config", str(d / "bad.toml"), "--out-dir", new]),
        ("config option unknown", ["train", "--config", str(d / "unknown.toml"), "--out-dir", new]),
        ("config value of the wrong type", ["train", "--config", str(d / "wrongtype.toml"), "--out-dir", new]),
        ("out-dir is a file", ["train", "--data", text, "--out-dir", text, *TINY]),
        ("out-dir under a file", ["train", "--data", text, "--out-dir", f"{text}/run", *TINY]),
        ("out-dir nobody may write", ["train", "--data", text, "--out-dir", "/sys/nanolm-run", *TINY]),
        ("out-dir holds another run", ["train", "--data", text, "--out-dir", run, *TINY, "--n-embd", "64"]),
        ("--resume never on a run", ["train", "--data", text, "--out-dir", run, *TINY, "--resume", "never"]),
        (".lock is a symbolic link", ["train", "--data", text, "--out-dir", str(d / "lock_symlink"), *TINY]),
        (".lock is a FIFO", ["train", "--data", text, "--out-dir", str(d / "lock_fifo"), *TINY]),
        ("--resume of a missing path", train("--resume", str(d / "nothing"))),
        ("batch too large for memory", ["train", "--data", text, "--out-dir", new, "--batch-size", "100000"]),
        ("flex attention on CPU", train("--attention", "flex", "--device", "cpu")),
        ("unknown device", train("--device", "tpu")),
        ("CUDA device that does not exist", train("--device", "cuda:7")),
        ("--dist ddp without torchrun", train("--dist", "ddp")),
        ("bf16-pure under fsdp", train("--dist", "fsdp", "--precision", "bf16-pure")),
        ("--fp32-master without bf16-pure", train("--fp32-master")),
        ("muon under fsdp", train("--optimizer", "muon", "--dist", "fsdp")),
        ("muon with bf16-pure", train("--optimizer", "muon", "--precision", "bf16-pure")),
        ("--muon-lr without muon", train("--muon-lr", "0.01")),
        ("BPE vocabulary too small", train("--tokenizer", "bpe", "--vocab-size", "100")),
        ("n_embd not divisible by n_head", train("--n-embd", "30", "--n-head", "4")),
        ("unknown --log sink", train("--log", "csv")),
    ]
    for flag, value in [
        ("--steps", "0"),
        ("--batch-size", "-2"),
        ("--grad-accum", "0"),
        ("--lr", "-1"),
        ("--lr", "nan"),
        ("--min-lr", "1"),
        ("--warmup", "-1"),
        ("--warmup", "500"),
        ("--weight-decay", "-0.1"),
        ("--beta1", "2"),
        ("--beta2", "-0.5"),
        ("--clip", "inf"),
        ("--ckpt-every", "0"),
        ("--keep", "-2"),
        ("--sample-tokens", "-1"),
        ("--rope-theta", "0"),
        ("--dropout", "1"),
        ("--seq-len", "1"),
        ("--n-layer", "0"),
        ("--n-head", "0"),
        ("--seed", "-1"),
        ("--threads", "-1"),
        ("--stats-every", "-1"),
        ("--eval-every", "0"),
        ("--log-every", "0"),
        ("--eval-batches", "0"),
        ("--val-fraction", "1"),
        ("--peak-flops", "-5"),
        ("--target-val-bpb", "-1"),
        ("--spike-threshold", "0"),
        ("--spike-window", "2"),
        ("--max-rollbacks", "-1"),
        ("--rollback-lr-scale", "0"),
        ("--stories", "0"),
        ("--vocab-size", "0"),
        ("--steps", "ten"),
        ("--muon-momentum", "1.5"),
        ("--threads", "many"),
        ("--steps", str(10**20)),
        ("--eval-windows", "0"),
        ("--keep", str(2**64)),
    ]:
        out.append((f"{flag} {value}", train(flag, value)))
    out += [
        ("sample: not a run", ["sample", "--run", str(d / "empty_dir")]),
        ("sample: --top-k -3", ["sample", "--run", run, "--top-k", "-3"]),
        ("sample: --max-new-tokens 0", ["sample", "--run", run, "--max-new-tokens", "0"]),
        ("sample: --temperature -1", ["sample", "--run", run, "--temperature", "-1"]),
        ("sample: --top-p 1.5", ["sample", "--run", run, "--top-p", "1.5"]),
        ("sample: --seed -1", ["sample", "--run", run, "--seed", "-1"]),
        ("eval: missing data", ["eval", "--run", run, "--data", str(d / "missing.txt")]),
        ("eval: --batch-size 0", ["eval", "--run", run, "--data", text, "--batch-size", "0"]),
        ("export: into a non-empty directory", ["export", run, "--out", str(d / "prepared")]),
        ("export: not a run", ["export", str(d / "empty_dir"), "--out", str(d / "hf")]),
        ("prepare: into a directory with other files", ["prepare", "--data", text, "--out", str(d)]),
        ("prepare: --out is a file", ["prepare", "--data", text, "--out", text]),
        ("prepare: .lock is a FIFO", ["prepare", "--data", text, "--out", str(d / "lock_fifo")]),
        ("prepare: --out name not UTF-8", ["prepare", "--data", text, "--out", os.fsdecode(bytes(d) + b"/p\xe9")]),
        ("prepare: --val-fraction 1", ["prepare", "--data", text, "--out", str(d / "p2"), "--val-fraction", "1"]),
        ("prepare: --vocab-size 10 for BPE", ["prepare", "--data", text, "--out", str(d / "p3"), "--vocab-size", "10"]),
        ("prepare: --seq-len 0", ["prepare", "--data", text, "--out", str(d / "p4"), "--seq-len", "0"]),
        ("diagnose: not a run", ["diagnose", str(d / "empty_dir")]),
        ("compare: not a run", ["compare", run, str(d / "empty_dir")]),
        ("compare: a prepared data directory", ["compare", str(d / "prepared"), run]),
        ("report: not a run", ["report", str(d / "empty_dir")]),
        ("doctor: --model without a class", ["doctor", "--data", text, *TINY, "--model", "json"]),
        ("doctor: --model that does not import", ["doctor", "--data", text, *TINY, "--model", "no_such_mod:X"]),
        ("plan: --gpus 0", ["plan", "--preset", "124m", "--gpus", "0"]),
        ("plan: --mfu 2", ["plan", "--preset", "124m", "--mfu", "2"]),
        ("plan: --tokens abc", ["plan", "--preset", "124m", "--tokens", "abc"]),
        ("data stories: --docs 0", ["data", "stories", "--docs", "0", "--out", str(d / "s.txt")]),
        ("lab: unknown variant", ["lab", "--out", str(d / "lab"), "--only", "nope", "--no-report"]),
        ("lab: --steps 0", ["lab", "--out", str(d / "lab"), "--steps", "0", "--no-report"]),
        (
            "sweep: a negative rate",
            ["sweep", "--lrs", "1e-3,-1", "--out", str(d / "sweep"), "--data", text, *TINY, "--no-report"],
        ),
        (
            "sweep: --tolerance -1",
            [
                "sweep",
                "--lrs",
                "1e-3",
                "--tolerance",
                "-1",
                "--out",
                str(d / "sweep"),
                "--data",
                text,
                *TINY,
                "--no-report",
            ],
        ),
        # crafted files (issue: nothing lost, one line, everywhere)
        ("config: an integer of 5,000 digits", ["train", "--config", str(d / "bigint.toml"), "--out-dir", new]),
        ("config: nesting deeper than Python parses", ["train", "--config", str(d / "deep.toml"), "--out-dir", new]),
        ("config: a hex integer of 5,000 digits", ["train", "--config", str(d / "hexint.toml"), "--out-dir", new]),
        ("config: [model] is a number", ["train", "--config", str(d / "scalar.toml"), "--out-dir", new]),
        ("config: a FIFO", ["train", "--config", str(d / "pipe.txt"), "--out-dir", new]),
        ("plan: --config with a 5,000-digit integer", ["plan", "--config", str(d / "bigint.toml")]),
        (
            "prepare: only separators, over prepared data",
            ["prepare", "--data", str(d / "separators.txt"), "--out", str(d / "prepared"), "--tokenizer", "char"],
        ),
        (
            "prepare: only whitespace, over prepared data",
            ["prepare", "--data", str(d / "blank.txt"), "--out", str(d / "prepared"), "--tokenizer", "char"],
        ),
        (
            "prepare: .jsonl without its field, over data",
            ["prepare", "--data", str(d / "nofield.jsonl"), "--out", str(d / "prepared"), "--tokenizer", "char"],
        ),
        (
            "prepare: only separators, into a new dir",
            ["prepare", "--data", str(d / "separators.txt"), "--out", str(d / "fresh" / "prep")],
        ),
        ("prepare: only crafted .jsonl lines", ["prepare", "--data", str(d / "crafted.jsonl"), "--out", str(d / "p5")]),
        (
            "prepare: --out inside a run's checkpoint",
            ["prepare", "--data", text, "--out", f"{run}/checkpoints/step_000004/prep"],
        ),
        ("prepare: --out inside a run's data", ["prepare", "--data", text, "--out", f"{run}/data/prep"]),
        ("export: --out inside a run's checkpoint", ["export", run, "--out", f"{run}/checkpoints/step_000004/hf"]),
        ("export: --out inside prepared data", ["export", run, "--out", str(d / "prepared" / "hf")]),
        ("export: --out a dangling symlink", ["export", run, "--out", str(d / "dangling")]),
        ("train: --threads past what the thread pool starts", train("--threads", "100000")),
        (
            "train: --vocab-size past what the tokenizer library reserves",
            ["train", "--data", text, "--out-dir", new, *TINY, "--tokenizer", "bpe", "--vocab-size", str(2**29)],
        ),
        (
            "prepare: --vocab-size past what the tokenizer library reserves",
            ["prepare", "--data", text, "--out", str(d / "p6"), "--vocab-size", str(2**32)],
        ),
        ("train: --grad-accum whose micro-batches fill the memory", train("--grad-accum", str(2**40))),
        ("export: --out under a dangling symlink", ["export", run, "--out", str(d / "dangling" / "hf")]),
        ("prepare: --out under a dangling symlink", ["prepare", "--data", text, "--out", str(d / "dangling" / "p")]),
        (
            "train: --out-dir under a dangling symlink",
            ["train", "--data", text, "--out-dir", str(d / "dangling" / "r"), *TINY],
        ),
        ("report: --out inside a run's checkpoint", ["report", run, "--out", f"{run}/checkpoints/step_000004/r"]),
        ("train: --out-dir inside a run's checkpoints", train("--out-dir", f"{run}/checkpoints/new")),
        ("train: --out-dir a dangling symlink", train("--out-dir", str(d / "dangling"))),
        (
            "data stories: --out inside a checkpoint",
            ["data", "stories", "--docs", "3", "--out", f"{run}/checkpoints/step_000004/s.txt"],
        ),
        ("sample: a --prompt that is not UTF-8", ["sample", "--run", run, "--prompt", os.fsdecode(b"caf\xe9")]),
        (
            "resume: data moved and changed",
            ["train", "--data", str(d / "text_changed.txt"), "--out-dir", run, *TINY, "--steps", "6"],
        ),
        (
            "train: prepared data whose meta.json names no tokenizer",
            ["train", "--data", str(d / "prepared_no_tokenizer"), "--out-dir", new, *TINY],
        ),
        (
            "resume: the prepared data the run trained on is gone",
            ["train", "--data", str(d / "gone"), "--out-dir", str(d / "run_on_gone"), *TINY, "--steps", "6"],
        ),
    ]
    return out


def tolerated(d: Path) -> list[tuple[str, list[str]]]:
    """(what is damaged, argv) for each command that must read past the damage: exit 0, every
    line on stderr a one-line warning, nothing changed. ``d/damaged_*`` are copies of the run."""
    return [
        (
            "sample: final.json with a 5,000-digit integer",
            ["sample", "--run", str(d / "damaged_final"), "--max-new-tokens", "5"],
        ),
        (
            "sample: checkpoint meta.json nested too deep",
            ["sample", "--run", str(d / "damaged_meta"), "--max-new-tokens", "5"],
        ),
        ("diagnose: crafted lines in metrics.jsonl", ["diagnose", str(d / "damaged_metrics")]),
        ("compare: crafted lines in metrics.jsonl", ["compare", str(d / "run"), str(d / "damaged_metrics")]),
        ("report: crafted lines in metrics.jsonl", ["report", str(d / "damaged_metrics"), "--out", str(d / "rep")]),
        (
            "prepare: crafted .jsonl lines, skipped",
            ["prepare", "--data", str(d / "mixed.jsonl"), "--out", str(d / "p6"), "--tokenizer", "char"],
        ),
    ]


def _digest(directory: Path) -> dict[str, str]:
    """Every file's SHA-256 and every directory (a command that leaves an empty one left something)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "directory"
        for p in sorted(directory.rglob("*"))
        if p.is_file() or (p.is_dir() and not p.is_symlink())
    }


def _nanolm(argv, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "nanolm", *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )


def setup(d: Path) -> None:
    from nanolm.data.corpus import write_stories

    write_stories(d / "text.txt", 200, seed=1)
    (d / "empty.txt").write_text("")
    (d / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" * 10)
    (d / "latin1.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 200)
    (d / "short.txt").write_text("too short")
    (d / "bad.toml").write_text("[train\nsteps = ")
    (d / "unknown.toml").write_text("[train]\nstepz = 3\n")
    (d / "wrongtype.toml").write_text('[train]\nsteps = "many"\n')
    (d / "empty_dir").mkdir()
    (d / "lock_symlink").mkdir()
    (d / "lock_symlink" / ".lock").symlink_to(d / "text.txt")  # nanolm must neither follow nor remove it
    (d / "lock_fifo").mkdir()
    os.mkfifo(d / "lock_fifo" / ".lock")
    os.mkfifo(d / "pipe.txt")  # read once, a pipe gives the shards' pass nothing
    with open(bytes(d) + b"/caf\xe9.txt", "wb") as f:  # a Latin-1 file name
        f.write((d / "text.txt").read_bytes())
    r = _nanolm(["train", "--data", str(d / "text.txt"), "--out-dir", str(d / "run"), *TINY], d)
    if r.returncode:
        raise SystemExit(f"setup: the reference run failed:\n{r.stderr}")
    r = _nanolm(["prepare", "--data", str(d / "text.txt"), "--out", str(d / "prepared"), "--tokenizer", "char"], d)
    if r.returncode:
        raise SystemExit(f"setup: prepare failed:\n{r.stderr}")
    shutil.copytree(d / "prepared", d / "gone")
    r = _nanolm(["train", "--data", str(d / "gone"), "--out-dir", str(d / "run_on_gone"), *TINY], d)
    if r.returncode:
        raise SystemExit(f"setup: the run on prepared data failed:\n{r.stderr}")
    shutil.rmtree(d / "gone")
    shutil.copytree(d / "prepared", d / "prepared_no_tokenizer")
    meta = json.loads((d / "prepared_no_tokenizer" / "meta.json").read_text())
    del meta["tokenizer"]
    (d / "prepared_no_tokenizer" / "meta.json").write_text(json.dumps(meta))
    (d / "bigint.toml").write_text(f"[train]\nsteps = {BIG_INTEGER}\n")
    (d / "deep.toml").write_text(f"[train]\nsteps = {DEEP}\n")
    (d / "hexint.toml").write_text(f"[train]\nsteps = 0x{'f' * 5000}\n")
    (d / "scalar.toml").write_text("model = 3\n")
    (d / "separators.txt").write_text("<|endoftext|>\n<|endoftext|>\n")
    (d / "blank.txt").write_text("   \n\n\t\n")
    (d / "nofield.jsonl").write_text('{"body": "a story"}\n{"body": "another"}\n')
    (d / "crafted.jsonl").write_text(f'{{"text": {BIG_INTEGER}}}\n{DEEP}\n{{"text": ["not", "text"]}}\n')
    (d / "mixed.jsonl").write_text(
        "".join(
            f'{{"text": {json.dumps(story)}}}\n' for story in (d / "text.txt").read_text().split("<|endoftext|>")[:20]
        )
        + f'{{"text": {BIG_INTEGER}}}\n{DEEP}\n'
    )
    (d / "text_changed.txt").write_text((d / "text.txt").read_text().replace("a", "e"))
    (d / "dangling").symlink_to(d / "nowhere")
    for name, rel, content in (
        ("damaged_final", "final.json", f'{{"format": 1, "step": {BIG_INTEGER}}}'),
        ("damaged_meta", "checkpoints/step_000004/meta.json", DEEP),
        ("damaged_metrics", "metrics.jsonl", None),
    ):
        shutil.copytree(d / "run", d / name)
        path = d / name / rel
        if content is None:  # a crafted line among the real ones, and a row of the wrong shape
            content = path.read_text() + f'{{"step": {BIG_INTEGER}}}\n{DEEP}\n{{"step": 5, "loss": "high"}}\n'
        path.write_text(content)
    (d / "damaged_meta" / "final.json").unlink()  # sample then reads the checkpoints, and meets the damaged one


def _check(expect: str, r: subprocess.CompletedProcess, before: dict, after: dict) -> list[str]:
    """What a command broke of its promise: refused in one line, or read past the damage."""
    lines = r.stderr.strip().splitlines()
    problems = []
    if "Traceback" in r.stderr + r.stdout or "Exception ignored" in r.stderr:
        problems.append("traceback")
    if expect == "refused":
        if r.returncode == 0:
            problems.append("exit 0")
        if len(lines) != 1 or not lines[0].startswith("error: "):
            problems.append(f"stderr is {len(lines)} line(s)")
        created = sorted(after.keys() - before.keys())
        if created:
            problems.append(f"left {created[:3]}")
    else:
        if r.returncode != 0:
            problems.append(f"exit {r.returncode}")
        if not all(line.startswith(("warning:", "note:")) for line in lines):
            problems.append(f"stderr: {lines[:3]}")
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    lost = sorted(before.keys() - after.keys())
    if changed or lost:
        problems.append(f"changed {changed + lost}")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--only", default="", help="run only the cases whose description holds this text")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="nanolm-bad-") as tmp:
        d = Path(tmp)
        every = [(what, argv, "refused") for what, argv in cases(d)] + [
            (what, argv, "tolerated") for what, argv in tolerated(d)
        ]
        every = [case for case in every if args.only in case[0]]
        if args.list:
            for what, argv, expect in every:
                print(f"{what:48s} {expect:9s} nanolm {' '.join(argv[:2])} ...")
            return 0
        sys.path.insert(0, str(ROOT))
        setup(d)
        failures, results = [], []
        for what, argv, expect in every:
            before = _digest(d)
            r = _nanolm(argv, d)
            lines = r.stderr.strip().splitlines()
            after = _digest(d)
            problems = _check(expect, r, before, after)
            results.append({"input": what, "expect": expect, "exit": r.returncode, "ok": not problems})
            shown = next((line for line in lines if line.startswith("error:")), lines[-1] if lines else "(no stderr)")
            print(
                f"{'ok ' if not problems else 'BAD'} {what:48s} {shown[:110]}"
                + (f"  <- {'; '.join(problems)}" if problems else ""),
                flush=True,
            )
            if problems:
                failures.append(what)
            for created in sorted(after.keys() - before.keys(), key=len, reverse=True):  # a clean slate for the next
                _remove(d / created)
    print(
        json.dumps({"tried": len(results), "one_line_nothing_lost": len(results) - len(failures), "failed": failures})
    )
    return 1 if failures else 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
