"""The ``nanolm`` command: train, sample, eval, report, prepare, doctor, diagnose, compare, lab, sweep, export, data, plan.

User errors (:class:`NanolmError`) print one line, ``error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import signal
import sys

from ..errors import NanolmError


def _train(args) -> None:
    from ..machine.device import resolve_device
    from ..run.config import DebugOptions, config_from_args
    from ..train import train

    cfg = config_from_args(args)
    if args.process_tuning_of_entry is not None:  # only the command's own process: never main() called in-process
        args.process_tuning_of_entry.before_training(cfg.train.process_tuning, resolve_device(cfg.train.device))
    factories = None
    if cfg.debug != DebugOptions():  # the hidden --debug-* options: the lab's faults, imported only then
        from .faults import factories as faults

        factories = faults(cfg)
    train(cfg, factories=factories)


def _sample(args) -> None:
    from .trained import generate

    print(
        generate(
            args.run,
            args.prompt,
            args.max_new_tokens,
            args.temperature,
            args.top_k if args.top_k else None,
            args.top_p,
            args.seed,
            args.device,
        )
    )


def _eval(args) -> None:
    from .trained import evaluate_file

    r = evaluate_file(args.run, args.data, args.batch_size, args.device)
    print(
        f"{args.data}: loss {r['loss']:.4f} nats/token | perplexity {r['ppl']:.2f} | "
        f"{r['bpb']:.4f} bits/byte | {r['tokens']} tokens, {r['bytes']} bytes"
    )
    if args.json:
        print(json.dumps(r))


def _prepare(args) -> None:
    from ..base.files import refuse_mount_point, require_utf8
    from ..base.lock import RunLock
    from ..data.prepare import prepare
    from ..tokenizer import MAX_BPE_VOCAB

    if not 0 <= args.val_fraction < 1:
        raise NanolmError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.seq_len < 2:
        raise NanolmError(f"--seq-len must be at least 2, got {args.seq_len}")
    if not 0 < args.vocab_size <= MAX_BPE_VOCAB:
        raise NanolmError(f"--vocab-size must be positive and at most {MAX_BPE_VOCAB}, got {args.vocab_size}")
    if args.workers < 0:
        raise NanolmError(f"--workers must be 0 (every core) or a positive number of processes, got {args.workers}")
    require_utf8("--out", str(args.out), "the tokenizer library can only open UTF-8 paths")
    check_output(args.out, "--out")
    refuse_mount_point(args.out, "--out")

    with RunLock() as lock:  # one writer: two prepares into one directory would interleave their shards
        lock.take(args.out, flag="--out")
        data = prepare(
            args.data,
            args.out,
            args.tokenizer,
            args.vocab_size,
            args.val_fraction,
            args.separator,
            args.text_field,
            seq_len=args.seq_len,
            progress=args.progress,
            workers=args.workers,
        )
    m = data.meta
    s = m["splits"]
    print(f"prepared {args.data} -> {args.out} in {m['seconds']:.1f}s ({m['mb_per_s']:.1f} MB/s)")
    print(f"tokenizer: {m['tokenizer']}, {m['vocab_size']} tokens, shards {m['dtype']}")
    for name in ("train", "val"):
        print(f"{name}: {s[name]['documents']} documents, {s[name]['tokens']} tokens, {s[name]['bytes']} bytes")
    print(
        f"mean document length: {m['mean_doc_tokens']} tokens; empty documents skipped: "
        f"{m['empty_documents_skipped']}; bad records skipped: {m['bad_records']}"
    )
    if m["windows"]:
        print(
            f"windows of {m['seq_len_for_stats']} tokens crossing a document boundary: "
            f"{m['windows_crossing_a_boundary']} of {m['windows']} "
            f"({100 * m['windows_crossing_a_boundary'] / m['windows']:.1f}%)"
        )
    if m["compressor_bpb"]:
        bounds = ", ".join(f"{k} {v:.3f}" for k, v in m["compressor_bpb"].items())
        print(f"compressor bits per byte on the validation text (a model must beat these): {bounds}")
    if "floor" in m:
        print(
            f"entropy floor of the validation text: {m['floor']['bpb']:.4f} bits/byte, "
            f"{m['floor']['nats_per_token']:.4f} nats/token"
        )


def _report(args) -> None:
    from .report import render

    if args.out is not None:  # the default, FIRST_RUN/report, is in a directory that exists
        check_output(args.out, "--out")
    result = render(args.runs, args.out, args.x)
    print(f"{len(result['panels'])} panels ({', '.join(result['panels'])}) in {result['out_dir']}/panels")
    print(f"dashboard: {result['dashboard']}")
    print(f"report: {result['html']}")


def _data_stories(args) -> None:
    from ..data.corpus import entropy_path, write_stories

    if args.docs <= 0:
        raise NanolmError(f"--docs must be positive, got {args.docs}")
    check_output(args.out, "--out", file=True)
    summary = write_stories(args.out, args.docs, args.seed)
    print(
        f"wrote {args.docs} stories ({summary['bytes']} bytes) to {args.out}; "
        f"entropy {summary['nats']:.1f} nats = {summary['bits_per_byte']:.4f} bits/byte "
        f"(per document: {entropy_path(args.out)})"
    )


def _data_download(args) -> None:
    from ..data.download import CORPORA, fetch

    if args.dir is not None:
        check_output(args.dir, "--dir")
    path = fetch(args.name, args.dir, progress=sys.stderr.isatty())
    print(f"{path}  ({CORPORA[args.name].about})")


def _doctor(args) -> int:
    from ..run.config import config_from_args
    from .doctor import run_doctor

    results = run_doctor(config_from_args(args), args.model)
    return 0 if all(c.passed for c in results) else 1


def _plan(args) -> None:
    import dataclasses

    from ..model import GPTConfig
    from ..run.config import DataOptions, ModelOptions, load_toml
    from ..run.plan import PRESETS, format_plan, make_plan, parse_count

    if args.preset and args.config:
        raise NanolmError("give --preset or --config, not both")
    model = dataclasses.asdict(ModelOptions())
    model.update(vocab_size=DataOptions().vocab_size)
    train = {"batch_size": 1, "grad_accum": 1, "precision": "bf16", "dist": "auto", "fp32_master": False}
    optimizer = "adamw"
    if args.preset:
        model.update(PRESETS[args.preset])
    if args.config:
        sections = load_toml(args.config)
        model.update(sections.get("model", {}))
        if "vocab_size" in sections.get("data", {}):
            model["vocab_size"] = sections["data"]["vocab_size"]
        train.update({k: v for k, v in sections.get("train", {}).items() if k in train})
        optimizer = sections.get("optim", {}).get("optimizer", optimizer)
    for key in ("n_layer", "n_head", "n_embd", "mlp", "vocab_size", "seq_len", "qk_norm", "tie_embeddings"):
        if getattr(args, key) is not None:
            model[key] = getattr(args, key)
    for key in train:
        if getattr(args, key) is not None:
            train[key] = getattr(args, key)
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    config = GPTConfig(**{k: v for k, v in model.items() if k in known})
    precision = "bf16" if train["precision"] == "auto" else train["precision"]
    dist = train["dist"] if train["dist"] != "auto" else ("ddp" if args.gpus > 1 else "none")
    tokens = parse_count(args.tokens) if args.tokens else 0
    optimizer = args.optimizer or optimizer
    plan = make_plan(
        config,
        precision,
        dist,
        args.gpus,
        args.gpu,
        train["batch_size"],
        train["grad_accum"],
        config.seq_len,
        tokens,
        args.mfu,
        train["fp32_master"],
        optimizer,
    )
    if not args.tokens:
        plan = make_plan(
            config,
            precision,
            dist,
            args.gpus,
            args.gpu,
            train["batch_size"],
            train["grad_accum"],
            config.seq_len,
            20 * plan["parameters"],
            args.mfu,
            train["fp32_master"],
            optimizer,
        )
    print(format_plan(plan, config, args.preset or ""))
    if not args.tokens:
        print(
            "           (--tokens not given: 20 tokens per parameter, the compute-optimal ratio of Hoffmann et al. 2022)"
        )
    if args.json:
        out = {k: v for k, v in plan.items() if k != "gpu"}
        out["gpu"] = dataclasses.asdict(plan["gpu"])
        print(json.dumps(out))


def _diagnose(args) -> int:
    from .diagnose import diagnose, format_findings

    any_found = False
    reports = []
    for run in args.runs:
        findings = diagnose(run)
        any_found = any_found or bool(findings)
        reports.append({"run": run, "findings": [f.to_dict() for f in findings]})
        if not args.json:
            print(format_findings(run, findings))
    if args.json:
        print(json.dumps(reports, indent=2))
    return 1 if args.strict and any_found else 0


def _compare(args) -> int:
    from .compare import compare_runs, format_comparison

    result = compare_runs(args.run_a, args.run_b)
    print(format_comparison(args.run_a, args.run_b, result))
    return result.exit_code()


def _replay(args) -> None:
    from .replay import format_replay, replay

    report = replay(args.run, args.step, args.device, log=lambda line: print(line, file=sys.stderr))
    print(json.dumps(report, indent=2) if args.json else format_replay(report))


def _lab(args) -> int:
    from .lab import run_lab

    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    check_output(args.out, "--out")
    results = run_lab(args.out, only, args.steps, args.quick, args.seed, report=not args.no_report)
    return 0 if all(r.matched for r in results) else 1


def _sweep(args) -> None:
    from .sweep import parse_lrs, run_sweep

    check_output(args.out, "--out")
    run_sweep(args, parse_lrs(args.lrs), args.out, args.tolerance, report=not args.no_report)


def _export(args) -> None:
    from .export import export_run

    check_output(args.out, "--out")
    export_run(args.run, args.out)


def check_output(path, flag: str, file: bool = False) -> None:
    """The check every command that writes makes of its output before it writes anything
    (``train`` makes the same in ``nanolm.run.directory``): not among a run's own files, and a
    path that can be made (not under a symbolic link to nothing or a regular file). Each refusal
    is one line naming the path and the fix; what a command meets when it writes (a read-only
    directory, a full disk, a mount point it cannot rename onto) is an ``OSError`` that
    :func:`_run` says in one line too. ``file``: the output is a file, not a directory."""
    from ..base.files import refuse_unmakeable
    from ..run.directory import refuse_output_inside_a_run

    refuse_output_inside_a_run(path, flag)
    refuse_unmakeable(path, flag, file=file)


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistyped flag or value reported like every other user error: one
    line (argparse's default prints the whole usage first, dozens of lines for ``train``)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nanolm", description="Train small GPTs you can trust.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_training_commands(sub)
    _add_health_commands(sub)
    _add_other_commands(sub)
    return parser


def _add_training_commands(sub) -> None:
    """train, sample, eval, prepare."""
    from ..run.config import add_run_arguments

    fmt = argparse.ArgumentDefaultsHelpFormatter

    p = sub.add_parser(
        "train",
        help="train a model",
        description="Train a GPT. Every option can also be set in "
        "a TOML file passed with --config (sections [model], [data], [optim], [train]); flags win.",
    )
    add_run_arguments(p)
    p.set_defaults(func=_train)

    p = sub.add_parser("sample", help="generate text from a trained run", formatter_class=fmt)
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="run directory written by `nanolm train`")
    p.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: smallest set with probability >= p")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same text)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.set_defaults(func=_sample)

    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a run on a text file", formatter_class=fmt)
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="run directory written by `nanolm train`")
    p.add_argument(
        "--data", required=True, metavar="FILE", help="text to score (.txt, .jsonl, .parquet or a directory)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="windows per forward pass")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    p.set_defaults(func=_eval)

    from ..tokenizer import EOS, KINDS
    from ..watch.sinks import PROGRESS_MODES

    p = sub.add_parser("prepare", help="tokenize a corpus once into token shards", formatter_class=fmt)
    p.add_argument(
        "--data",
        required=True,
        metavar="SRC",
        help="a .txt, .jsonl or .parquet file (the text forms also .gz, .bz2, .xz or .zst), a directory or quoted "
        "glob of such shards (read in sorted order), or a Hugging Face save_to_disk directory",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the shards, tokenizer.json and meta.json")
    p.add_argument("--tokenizer", choices=KINDS, default="bpe", help="tokenizer to train")
    p.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size (EOS included)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of documents held out for validation")
    p.add_argument("--separator", default=EOS, help="line separating documents in a .txt file")
    p.add_argument("--text-field", default="text", help="jsonl field / parquet column with the text")
    p.add_argument("--seq-len", type=int, default=256, help="window length used for the boundary statistics")
    p.add_argument(
        "--progress",
        choices=PROGRESS_MODES,
        default="auto",
        help="progress of a long preparation (10 MB and more): a bar, plain lines, or auto (a bar on a terminal)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="processes that encode a large corpus (16 MB of text and more), one core each; 0: every core "
        "this process may use",
    )
    p.set_defaults(func=_prepare)


def _add_health_commands(sub) -> None:
    """doctor, diagnose, compare, lab, sweep."""
    from ..run.config import add_run_arguments

    p = sub.add_parser(
        "doctor",
        help="check the setup before a long run (PASS/FAIL per invariant)",
        description="Run health checks on a training configuration (the same options as "
        "`nanolm train`): initial loss = ln V, memorising one batch, causality, no cross-document "
        "leak, grad accumulation = big batch, weight-decay groups, LR schedule, decoded data, "
        "token ids, the loss floor. Exit status 1 if any check fails.",
    )
    p.add_argument(
        "--model",
        metavar="PKG.MODULE:CLASS",
        default=None,
        help="check your own model class instead: imports PKG.MODULE (which runs its code, as any import "
        "does: pass only a module you trust) from the current directory or the Python path, builds "
        "CLASS(GPTConfig(...)) and calls its forward(idx, ...), which must return the logits of every "
        "position, (batch, seq_len, vocab), or (logits, loss); runs the model invariants only",
    )
    add_run_arguments(p)
    p.set_defaults(func=_doctor)

    p = sub.add_parser(
        "diagnose",
        help="say in plain words what went wrong in a run, with the evidence",
        description="Read a run's metrics.jsonl and events.jsonl (nothing else) and print every "
        "finding: what was seen, what it usually means, what to do, and the steps and values it rests "
        "on. Rules: non-finite values, guard rollbacks, a loss stuck at ln V, a loss below the data's "
        "floor (a leak), a loss spike after a gradient-norm spike (LR too high), isolated spikes without "
        "a gradient warning (bad data), most steps clipped, validation rising while training falls, a "
        "training loss climbing back, a jolt after a resume (optimizer state missing), fp16 overflow "
        "and underflow, runaway attention logits, dead MLP units, a run of a shipped recipe that left its reference band. "
        "A healthy run gets 'no findings'. "
        "See docs/health.md.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories written by `nanolm train`")
    p.add_argument("--strict", action="store_true", help="exit with status 1 when there is any finding")
    p.add_argument("--json", action="store_true", help="print the findings as JSON (name, title, message, evidence)")
    p.set_defaults(func=_diagnose)

    p = sub.add_parser(
        "compare",
        help="did two runs train the same thing? (exit 0 yes, 1 no, as diff)",
        description="Compare two runs' curves step by step. The same seed and data with only the batch "
        "split differently (batch 32 against batch 8 with --grad-accum 4, or more ranks): the curves "
        "must agree to floating-point rounding, and the verdict names the first step where they part. "
        "Different seeds of the same setup: they must agree within seed noise (the width of the "
        "shipped reference band when the runs are recognised, else estimated from the runs). Any "
        "other difference in setup is named. Exit status 0 when they agree, 1 when they differ, 2 for "
        "bad input. See docs/course.md.",
    )
    p.add_argument("run_a", metavar="RUN_A", help="a run directory written by `nanolm train`")
    p.add_argument("run_b", metavar="RUN_B", help="another one")
    p.set_defaults(func=_compare)

    p = sub.add_parser(
        "replay",
        help="replay one step of a run from its checkpoint, with every instrument on",
        description="Load the newest valid checkpoint before --step, re-train the steps in between "
        "exactly as the run did, then take step --step again and show its loss, gradient norm, "
        "per-layer gradient norms and update/weight ratios, max attention logit and dead MLP units "
        "per block, where a NaN was born, and the text of its first window; the replayed loss is "
        "compared with the logged one. Writes nothing. See docs/runbooks.md.",
    )
    p.add_argument("run", metavar="RUN_DIR", help="run directory written by `nanolm train`")
    p.add_argument("--step", type=int, required=True, help="the optimizer step to replay (1 for the first)")
    p.add_argument("--device", default=None, help="replay on another device (default: the run's own)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=_replay)

    from .lab import VARIANTS

    p = sub.add_parser(
        "lab",
        help="a healthy run and the same run broken on purpose, each diagnosed",
        description="Train a healthy baseline and deliberately broken variants on the built-in story "
        "corpus (the real training code with one component swapped for a broken one), draw each one's "
        "dashboard next to the baseline, run `nanolm diagnose` on it, and print a table: what was "
        "broken, the expected symptom, the diagnosis, matched or not. About half a minute per variant "
        "on 2 CPU cores. Exit status 1 if a variant is not matched. Variants: "
        + "; ".join(f"{v.name}: {v.broken}" for v in VARIANTS)
        + ". See docs/health.md.",
    )
    p.add_argument(
        "--out",
        default="runs/lab",
        metavar="DIR",
        help="directory for the runs, lab.md and lab.json (default: runs/lab)",
    )
    p.add_argument("--only", default=None, metavar="NAME,...", help="run only these variants (comma-separated)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model and corpus: seconds per variant; leaves out the variants whose symptom "
        "needs the full size, and lists them with the reason",
    )
    p.add_argument("--steps", type=int, default=None, help="steps per variant (default: 500, or 200 with --quick)")
    p.add_argument("--seed", type=int, default=1337, help="seed of every run (default: 1337)")
    p.add_argument("--no-report", action="store_true", help="skip the dashboards (no matplotlib needed)")
    p.set_defaults(func=_lab)

    p = sub.add_parser(
        "sweep",
        help="short runs at several learning rates; recommends the largest stable one",
        description="Train the same configuration for ~200 steps at each learning rate of --lrs "
        "(into OUT/lr_<value>), overlay the curves (OUT/report), and recommend the largest stable rate. "
        "A rate is stable when its run finished with finite losses and no guard skip or rollback; "
        "`nanolm diagnose` finds no non_finite, guard_actions, loss_stuck, loss_spike, "
        "train_loss_rising or fp16_overflow; and its final loss (last validation loss) is within "
        "--tolerance of the best stable run's. Takes every `nanolm train` option except --lr and "
        "--out-dir; --steps defaults to 200 here.",
    )
    p.add_argument("--lrs", required=True, metavar="LR,LR,...", help="learning rates to try, e.g. 1e-3,3e-3,1e-2")
    p.add_argument(
        "--out", default="runs/sweep", metavar="DIR", help="directory for the runs and the plots (default: runs/sweep)"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.1,
        help="a stable rate must end within this fraction of the best final loss (default: 0.1)",
    )
    p.add_argument("--no-report", action="store_true", help="skip the plots (no matplotlib needed)")
    add_run_arguments(p)
    p.set_defaults(func=_sweep)


def _add_other_commands(sub) -> None:
    """export, report, plan, data."""
    fmt = argparse.ArgumentDefaultsHelpFormatter

    p = sub.add_parser(
        "export",
        help="write a run as a Hugging Face transformers model",
        formatter_class=fmt,
        description="Export a trained run so that transformers' AutoModelForCausalLM.from_pretrained(OUT) "
        "loads it (Llama, or Qwen3 with --qk-norm) with the same logits.",
    )
    p.add_argument("run", metavar="RUN_DIR", help="run directory (its final weights, else its newest checkpoint)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (must be new or empty)")
    p.set_defaults(func=_export)
    p = sub.add_parser(
        "report",
        help="plot runs: PNG panels, a dashboard and a self-contained HTML page",
        description="Plot one run, or overlay several on the same axes.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories written by `nanolm train`")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default: FIRST_RUN_DIR/report)")
    p.add_argument(
        "--x",
        choices=("step", "tokens", "time"),
        default="step",
        help="horizontal axis: optimizer steps, training tokens, or seconds (default: step)",
    )
    p.set_defaults(func=_report)

    from ..model import MLP_KINDS
    from ..run.plan import GPUS, PRECISIONS, PRESETS

    p = sub.add_parser(
        "plan",
        help="parameters, FLOPs, memory per GPU and time to train, before launching",
        description="Size a run: parameters, training FLOPs per token, memory per GPU (weights, "
        "gradients, optimizer state, activations with and without activation checkpointing) and the "
        "time to train a number of tokens. The model comes from --preset or --config (a nanolm TOML), "
        "then any flag below; formulas in docs/distributed.md.",
    )
    p.add_argument("--preset", choices=list(PRESETS), help="a model shape: " + ", ".join(PRESETS))
    p.add_argument("--config", metavar="FILE.toml", help="a nanolm config ([model], [data] vocab_size, [train])")
    for flag, kind, text in (
        ("--n-layer", int, "transformer blocks"),
        ("--n-head", int, "attention heads"),
        ("--n-embd", int, "width of the residual stream"),
        ("--vocab-size", int, "vocabulary"),
        ("--seq-len", int, "sequence length"),
        ("--batch-size", int, "sequences per GPU micro-batch (default 1)"),
        ("--grad-accum", int, "micro-batches per step (default 1)"),
    ):
        p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument("--mlp", choices=MLP_KINDS, default=None, help="MLP kind")
    p.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=None, help="QK-norm")
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None, help="tied output head")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="number format (default bf16)")
    p.add_argument(
        "--fp32-master",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with bf16-pure: an fp32 master copy in the optimizer",
    )
    p.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default=None,
        help="optimizer state to count (default adamw: two fp32 moments a weight; muon: one momentum "
        "for the hidden matrices)",
    )
    p.add_argument(
        "--dist",
        choices=["auto", "none", "ddp", "fsdp"],
        default=None,
        help="data parallelism (default: ddp with --gpus > 1, else none)",
    )
    p.add_argument("--gpus", type=int, default=1, help="number of GPUs")
    p.add_argument(
        "--gpu",
        choices=list(GPUS),
        default="h100",
        help="GPU model: its peak FLOP/s for the precision (nanolm.machine.hardware) and its memory",
    )
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation to assume")
    p.add_argument("--tokens", default=None, help="tokens to train, e.g. 2e9, 300M, 20B (default 20 per parameter)")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    p.set_defaults(func=_plan)

    p = sub.add_parser("data", help="built-in and downloadable corpora")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="CORPUS")
    q = data_sub.add_parser(
        "stories", help="write the built-in story corpus with its exact entropy", formatter_class=fmt
    )
    q.add_argument("--docs", type=int, default=4000, help="number of stories")
    q.add_argument("--seed", type=int, default=0, help="random seed")
    q.add_argument("--out", required=True, metavar="FILE", help="output text file (entropy goes to FILE.entropy.json)")
    q.set_defaults(func=_data_stories)
    from ..data.download import CORPORA

    q = data_sub.add_parser(
        "download",
        help="fetch a public corpus (verified, cached)",
        description="Download a public corpus once, verify its size and SHA-256, and cache it. "
        "Known: " + "; ".join(f"{k}: {v.about}" for k, v in CORPORA.items()),
    )
    q.add_argument("name", choices=list(CORPORA), help="corpus to fetch")
    q.add_argument("--dir", default=None, help="cache directory (default: $NANOLM_CACHE or ~/.cache/nanolm)")
    q.set_defaults(func=_data_download)


OUTPUT_FLAGS = {"train": "--out-dir", "doctor": "--out-dir", "data download": "--dir"}
"""The option that chose where a command writes, for the one-line error of a full or read-only
disk; every other command's is --out."""


class OutputClosed(Exception):
    """The command's output went away (``nanolm diagnose RUN | head``, a closed terminal)."""


class ClosableOutput:
    """``sys.stdout`` or ``sys.stderr`` of a command, for a reader that may go away.

    Unix pipelines expect a writer whose reader left (``| head``) to end quietly; Python instead
    raises ``BrokenPipeError`` from whichever ``print`` meets it (or ``OSError: EIO`` on a
    terminal that was closed), and again while exiting. Here the first failed write points the
    file descriptor at /dev/null, so nothing fails twice; then a training run is asked to stop
    after its step and save, as on SIGTERM (:class:`~nanolm.machine.runtime.StopOnSignal`),
    and any other command ends with :class:`OutputClosed`."""

    GONE = {errno.EPIPE, errno.EIO, errno.ECONNRESET}

    def __init__(self, stream):
        self._stream = stream
        self.gone = False

    def _went_away(self) -> None:
        """Said once: a training run is asked to stop, any other command ends; later writes
        (the interpreter's own flush at exit among them) vanish quietly."""
        from ..machine.runtime import OUTPUT_CLOSED, StopOnSignal

        if self.gone:
            return
        self.gone = True
        self.discard()
        if StopOnSignal.active is not None:
            StopOnSignal.active.request(OUTPUT_CLOSED)
        else:
            raise OutputClosed

    def discard(self) -> None:
        """Point the file descriptor at /dev/null: what is still buffered, and anything written
        later, goes nowhere instead of failing again (at the interpreter's exit among others)."""
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            pass

    def write(self, text):
        if not self.gone:
            try:
                return self._stream.write(text)
            except OSError as e:
                if e.errno not in self.GONE:
                    raise
        self._went_away()
        return len(text)

    def flush(self):
        if not self.gone:
            try:
                return self._stream.flush()
            except OSError as e:
                if e.errno not in self.GONE:
                    raise
        self._went_away()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _tell(line: str) -> None:
    """The command's last word on stderr, if anyone is still there to read it."""
    try:
        print(line, file=sys.stderr)
    except OutputClosed:
        pass


def main(argv=None, process_tuning=None) -> int:
    """The ``nanolm`` command line, in this process. ``process_tuning`` (a
    :class:`~nanolm.instruments.process.ProcessTuning`, from :func:`entry` only) lets a training
    run tune the process as ``--process-tuning`` says; without it the process is left alone."""
    try:
        args = build_parser().parse_args(argv)  # imports PyTorch: a Ctrl-C here is one line too
        args.process_tuning_of_entry = process_tuning
        return _run(args)
    except KeyboardInterrupt as e:  # also one raised while a handler below was printing its line
        return _interrupted(e)


def _interrupted(e: KeyboardInterrupt) -> int:
    """Ctrl-C outside a run's loop (``interrupted``, 130), or a second one that stopped a run at
    once: its own line, and the status of the signal that first asked the run to stop."""
    _tell(str(e) or "interrupted")
    return getattr(e, "exit_code", 130)


def _run(args) -> int:
    try:
        code = args.func(args)
    except NanolmError as e:
        _tell(f"error: {_one_line(str(e))}")
        return 2
    except OutputClosed:  # a reader closed the pipe: end quietly, as Unix pipelines expect
        return 128 + 13
    except OSError as e:  # a full disk, a read-only or foreign directory: the machine's state, not a bug
        from ..base.files import ENVIRONMENT_ERRNOS, describe_os_error

        if e.errno not in ENVIRONMENT_ERRNOS:
            raise
        command = args.command if args.command != "data" else f"data {args.data_command}"
        _tell(
            f"error: {describe_os_error(e, OUTPUT_FLAGS.get(command, '--out'))}; whatever was saved before is "
            f"intact: run the same command again once that is fixed"
        )
        return 2
    except Exception as e:
        from ..machine.runtime import TrainingInterrupted

        if not isinstance(e, TrainingInterrupted):
            raise
        _tell(str(e))
        return e.exit_code
    return code or 0


def _one_line(message: str) -> str:
    """A user error is one line: messages that quote a library's multi-line error are folded."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def entry(argv: list[str] | None = None) -> None:
    """The one entry of every nanolm command: ``nanolm``, ``python -m nanolm``, and ``python -m
    nanolm.train`` / ``python -m nanolm.sample`` (which pass their subcommand). It runs
    :func:`main` in a process it may tune for a training run (``--process-tuning``,
    ``nanolm.instruments.process``) and exits with its status. Tests call :func:`main`
    in-process instead, and leave their process alone.

    What belongs to the process is set here, not in :func:`main`: output that cannot be
    encoded (a sample under ``LC_ALL=C``) is printed with replacement characters rather than
    ending the command; standard output goes out a line at a time even into a pipe or a file
    (``nanolm train | tee log`` shows each step as it ends, and a reader that left is noticed
    at the next line, not when a buffer fills); a reader that goes away ends it quietly
    (:class:`ClosableOutput`), what was still buffered at exit included (:func:`_flushed`);
    and once a run was asked to stop, a further Ctrl-C while the process saves and exits
    changes nothing (:class:`~nanolm.machine.runtime.StopSignals`)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:  # pythonw, a service: no console at all
            continue
        if hasattr(stream, "reconfigure") and name == "stdout":
            stream.reconfigure(errors="replace", line_buffering=True)
        setattr(sys, name, ClosableOutput(stream))
    try:
        from ..machine.runtime import StopSignals  # PyTorch loads here: a Ctrl-C meanwhile is one line
        from .process import ProcessTuning

        StopSignals.quiet_after_stop = True
        tuning = ProcessTuning()
        code = main(argv, process_tuning=tuning)
        tuning.before_exit()
    except KeyboardInterrupt as e:
        code = _interrupted(e)
    except OutputClosed:
        code = 128 + 13
    except SystemExit as e:  # argparse's --help and usage errors: its line is printed, the flush below is still due
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            _tell(str(e.code))
            code = 1
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):  # the process is ending: nothing is left to interrupt
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    sys.exit(_flushed(code))


def _flushed(code: int) -> int:
    """The exit status once what is still buffered is written out. Text without a line end waits
    in the buffer until exit; a reader gone by then would meet the interpreter's own flush
    instead, which can only print "Exception ignored" and exit 120. Flushed here, the end is the
    quiet one of any closed pipe."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            if stream is not None:
                stream.flush()
        except OutputClosed:
            code = code or 128 + 13
        except OSError as e:  # `nanolm ... > log` on a full disk: the output is lost; said once, not as a traceback
            if isinstance(stream, ClosableOutput):
                stream.discard()
            if not code:
                _tell(
                    f"error: the command's {name} could not be written ({e.strerror}); free some space or write "
                    f"it elsewhere"
                )
                code = 2
    return code


if __name__ == "__main__":
    entry()
