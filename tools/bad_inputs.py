"""Try every kind of bad input on a fresh process; each must be one line, exit 2, nothing lost.

The promise of nanolm's command line: a mistake a user can make gets one line starting with
``error:`` naming the problem and the fix, a non-zero exit status, no traceback, and nothing
already written (a finished run, a prepared corpus) changes. This tool makes a scratch
directory with a finished run, a prepared corpus and a few odd files, runs each bad command
below in a new process (as a user would), and checks all four, hashing every file before and
after.

    python tools/bad_inputs.py            # ~100 commands, ~4 minutes on 2 cores
    python tools/bad_inputs.py --list

Exit status 1 if any command breaks the promise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--tokenizer", "char", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32",
        "--batch-size", "4", "--eval-batches", "2", "--sample-tokens", "0", "--steps", "4", "--eval-every", "2",
        "--threads", "1"]


def cases(d: Path) -> list[tuple[str, list[str]]]:
    """(what is wrong, argv) for each bad input; ``d`` holds run/, prepared/, text.txt and friends."""
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
    for flag, value in [("--steps", "0"), ("--batch-size", "-2"), ("--grad-accum", "0"), ("--lr", "-1"),
                        ("--lr", "nan"), ("--min-lr", "1"), ("--warmup", "-1"), ("--warmup", "500"),
                        ("--weight-decay", "-0.1"), ("--beta1", "2"), ("--beta2", "-0.5"), ("--clip", "inf"),
                        ("--ckpt-every", "0"), ("--keep", "-2"), ("--sample-tokens", "-1"), ("--rope-theta", "0"),
                        ("--dropout", "1"), ("--seq-len", "1"), ("--n-layer", "0"), ("--n-head", "0"),
                        ("--seed", "-1"), ("--threads", "-1"), ("--stats-every", "-1"), ("--eval-every", "0"),
                        ("--log-every", "0"), ("--eval-batches", "0"), ("--val-fraction", "1"),
                        ("--peak-flops", "-5"), ("--target-val-bpb", "-1"), ("--spike-threshold", "0"),
                        ("--spike-window", "2"), ("--max-rollbacks", "-1"), ("--rollback-lr-scale", "0"),
                        ("--stories", "0"), ("--vocab-size", "0"), ("--steps", "ten"),
                        ("--muon-momentum", "1.5"), ("--threads", "many")]:
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
        ("sweep: a negative rate", ["sweep", "--lrs", "1e-3,-1", "--out", str(d / "sweep"), "--data", text,
                                    *TINY, "--no-report"]),
        ("sweep: --tolerance -1", ["sweep", "--lrs", "1e-3", "--tolerance", "-1", "--out", str(d / "sweep"),
                                   "--data", text, *TINY, "--no-report"]),
    ]
    return out


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _nanolm(argv, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "nanolm", *argv], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)


def setup(d: Path) -> None:
    from nanolm.data.corpus import write_stories

    write_stories(d / "text.txt", 200, seed=1)
    (d / "empty.txt").write_text("")
    (d / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" * 10)
    (d / "latin1.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 200)
    (d / "short.txt").write_text("too short")
    (d / "bad.toml").write_text("[train\nsteps = ")
    (d / "unknown.toml").write_text("[train]\nstepz = 3\n")
    (d / "wrongtype.toml").write_text("[train]\nsteps = \"many\"\n")
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="nanolm-bad-") as tmp:
        d = Path(tmp)
        if args.list:
            for what, argv in cases(d):
                print(f"{what:45s} nanolm {' '.join(argv[:2])} ...")
            return 0
        sys.path.insert(0, str(ROOT))
        setup(d)
        failures, results = [], []
        for what, argv in cases(d):
            before = _digest(d)
            r = _nanolm(argv, d)
            lines = r.stderr.strip().splitlines()
            after = _digest(d)
            problems = []
            if r.returncode == 0:
                problems.append("exit 0")
            if "Traceback" in r.stderr + r.stdout:
                problems.append("traceback")
            if len(lines) != 1 or not lines[0].startswith("error: "):
                problems.append(f"stderr is {len(lines)} line(s)")
            changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
            lost = sorted(before.keys() - after.keys())
            if changed or lost:
                problems.append(f"changed {changed + lost}")
            results.append({"input": what, "exit": r.returncode, "ok": not problems})
            print(f"{'ok ' if not problems else 'BAD'} {what:45s} {lines[-1][:110] if lines else '(no stderr)'}"
                  + (f"  <- {'; '.join(problems)}" if problems else ""), flush=True)
            if problems:
                failures.append(what)
            for created in sorted(after.keys() - before.keys()):  # leave the next case a clean slate
                (d / created).unlink()
    print(json.dumps({"tried": len(results), "one_line_nothing_lost": len(results) - len(failures),
                      "failed": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
