"""What may change when a run is continued, and what would silently mix two runs.

Running the same command again continues a run (``nanolm.run.directory``); a command that
differs from the run's own may still continue it when the difference only says how long, how
often, where or how fast it trains, or how the global batch is split: those are listed here
and logged when they change. Every other option shapes the model or the data stream, and a run
continued with another value would be half one run and half another while its logs called it
one: such a resume is refused with the list of differences. The data itself is compared by
content: a corpus moved to another path continues its run, a different one under the old name
does not.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from ..checkpoint import read_checkpoint_meta
from ..data.prepare import load_training_data
from ..data.shards import PreparedData
from ..distributed import Distributed
from ..errors import NanolmError
from ..tokenizer import Tokenizer
from .config import HIDDEN_SECTIONS, SECTIONS, GuardOptions, RunConfig, load_run_config

COMPATIBLE_ON_RESUME = {
    # what may change between a run and its resumption: how long, how often, where, and the
    # optimizer's knobs (lowering the LR for a restart is a classic); everything else shapes
    # the model or the data stream, and changing it mid-run would silently mix two runs
    "train": {
        "steps",
        "eval_every",
        "eval_at_start",
        "eval_batches",
        "eval_windows",
        "log_every",
        "sample_tokens",
        "out_dir",
        "device",
        "tf32",
        "threads",
        "process_tuning",
        "compile",
        "ckpt_every",
        "keep",
        "resume",
        "deterministic",
        "stats_every",
        "log",
        "progress",
        "peak_flops",
        "target_val_bpb",
        "dist",
    },
    "optim": {
        "lr",
        "min_lr",
        "warmup",
        "schedule",
        "decay_fraction",
        "weight_decay",
        "beta1",
        "beta2",
        "clip",
        "muon_lr",
        "muon_momentum",
    },
    "model": {"loss_chunk"},  # how the head and loss are computed, not what: the same numbers up to rounding
    "guard": {f.name for f in dataclasses.fields(GuardOptions)},
}


def resume_differences(saved: "RunConfig", new: "RunConfig", also_allowed=()) -> tuple[list[str], list[str]]:
    """(allowed changes, incompatible changes) between a run's config and a resumption's,
    each as lines like ``steps: 300 -> 600``. ``also_allowed`` names further options that
    may change this time (how the global batch is split, when the global batch stays)."""
    allowed, refused = [], []
    for section in SECTIONS:
        if section in HIDDEN_SECTIONS:
            continue
        a, b = dataclasses.asdict(getattr(saved, section)), dataclasses.asdict(getattr(new, section))
        for key in a:
            if a[key] != b[key]:
                line = f"{key}: {_shown(a[key])} -> {_shown(b[key])}"
                ok = key in COMPATIBLE_ON_RESUME.get(section, set()) or key in also_allowed
                (allowed if ok else refused).append(line)
    return allowed, refused


def _shown(value) -> str:
    """A value as a person would type it: ``0.0003``, not ``0.00030000000000000003`` (lr/10)."""
    return f"{value:.12g}" if isinstance(value, float) else repr(value)


def refused_changes(saved: RunConfig, saved_world: int, cfg: RunConfig, world_size: int) -> list[str]:
    """Differences that would mix two runs. How the global batch is split over micro-batches
    and processes may change; the global batch itself may not."""
    split, refused = resume_differences(saved, cfg, also_allowed={"batch_size", "grad_accum"})
    s, t = saved.train, cfg.train
    before, after = s.batch_size * s.grad_accum * saved_world, t.batch_size * t.grad_accum * world_size
    if before != after:
        refused += [line for line in split if line.startswith(("batch_size:", "grad_accum:"))]
        refused.append(
            f"global batch (batch_size × grad_accum × world size): {s.batch_size}×{s.grad_accum}×"
            f"{saved_world} = {before} -> {t.batch_size}×{t.grad_accum}×{world_size} = {after} windows"
        )
    return refused


def data_moved_to(cfg: RunConfig, checkpoint: Path) -> bool:
    """Whether ``--data`` (at a path other than the run's) gives exactly the data ``checkpoint``
    trained on: the data is compared by its digest, not its name, so a corpus moved or copied
    elsewhere continues the run. A raw text file is tokenized again to know (a prepared
    directory is only read); any problem with it means no."""
    digest = read_checkpoint_meta(checkpoint).get("data_digest")
    if digest is None or not cfg.data.data:
        return False
    with tempfile.TemporaryDirectory(prefix="nanolm-moved-") as scratch:
        try:
            data = load_training_data(cfg, Path(scratch), log=lambda *_: None, compressor_bounds=False)
        except NanolmError:
            return False
        return data.digest == digest


def check_resume_compatible(
    checkpoint: Path,
    cfg: RunConfig,
    tokenizer,
    log=print,
    dist: Distributed | None = None,
    data: PreparedData | None = None,
    data_moved: bool = False,
) -> None:
    """Refuse a resumption that would silently mix two different runs; log allowed changes.

    The split of the global batch (batch size, accumulation, world size) may change as long
    as the global batch itself does not (see ``nanolm.distributed``); the path of ``--data``
    may change when ``data_moved`` says it holds the same data (:func:`data_moved_to`).
    """
    saved = load_run_config(checkpoint / "config.toml")
    meta = read_checkpoint_meta(checkpoint)
    regroup, allowed_split, refused_split = (dist or Distributed()).resume_rules(meta, saved, cfg)
    allowed, refused = resume_differences(saved, cfg, also_allowed=set(regroup) | ({"data"} if data_moved else set()))
    allowed, refused = allowed + allowed_split, refused + refused_split
    if Tokenizer.load(checkpoint / "tokenizer.json").fingerprint() != tokenizer.fingerprint():
        refused.append("tokenizer: the data's tokenizer is not the one the run was trained with")
    elif data is not None and meta.get("data_digest", data.digest) != data.digest:
        # named as the user gave it: raw text is prepared in a scratch directory gone by the time this is read
        refused.append(
            f"data: {cfg.data.data or 'the built-in corpus'} is not the data the checkpoint was trained on "
            f"(its files differ)"
        )
    if refused:
        raise NanolmError(
            f"cannot resume from {checkpoint}: incompatible changes: {'; '.join(refused)}. "
            f"Keep those settings, or start a new run with another --out-dir"
        )
    for line in allowed:
        same = " by its digest: the same data" if line.startswith("data:") else ""
        log(f"resume: {line} (allowed{same})")
