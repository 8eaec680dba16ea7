"""Training: the loop, read top to bottom, and ``python -m nanolm.train``.

For every optimizer step, in order (this is the one place the sequence is told):

1. **draw the step's micro-batches**: ``grad_accum`` packed batches of windows per process
   (``nanolm/batches.py``); under ``--threads auto`` the thread tuner may then time the step's
   pass on them at a few thread counts and keep the fastest (``nanolm/machine/threads.py``);
2. **take one optimizer step**, :func:`~nanolm.step.train_step` (``nanolm/step.py``):

   a. set the learning rate: the schedule's rate for the step number (warmup, then a cosine
      or WSD; a pure function of the step), times the guard's scale (1 until a rollback asks
      for less);
   b. count the tokens that count in *all* the step's micro-batches (on every rank), once;
      then for each micro-batch run forward (the model and its loss, ``nanolm/model.py``),
      divide the sum of its token losses by that count, and run backward: the gradients add up;
   c. fp16 only: divide the gradients by the loss scale; then clip the global gradient norm,
      once, after the last backward pass;
   d. let the guard decide: take the update, skip it, roll back, or stop;
   e. update the weights (fp16: unless a gradient overflowed) and zero the gradients;

3. **settle the guard's event**, if any: record it with its evidence, roll back to the last
   checkpoint (keeping the data position, so the bad batches are not replayed), or stop;
4. **log the step** when due (``metrics.jsonl``, the terminal, wandb/TensorBoard), with
   per-layer statistics every ``--stats-every`` steps, and **evaluate** on the validation set
   when due (its figures join the step's row);
5. **save a checkpoint** when due, and on SIGINT/SIGTERM (then stop, resumable);
6. **end** at ``--steps``, as soon as an evaluation reaches ``--target-val-bpb``, or where
   ``--time-budget``'s clock ends the run (:class:`~nanolm.run.budget.TimeBudget` plans its steps,
   warmup and decay; with a budget, step 2a's rate is the plan's).

Then the final weights are written, with ``final.json`` that vouches for them, and a sample
is printed. Each concern other than the step itself is a component that owns its schedule:
the :class:`~nanolm.machine.threads.ThreadTuner` (``--threads auto``: when to time the step at
other thread counts), the :class:`~nanolm.run.budget.TimeBudget` (``--time-budget``: which step
is the last), the :class:`~nanolm.watch.observer.Observer` (what to log, and when), the
:class:`~nanolm.watch.validator.Validator` (when to evaluate), the
:class:`~nanolm.checkpoint.Checkpointer` (when to save, what state, how to come back), the
:class:`~nanolm.watch.guards.Guard` (take, skip, roll back or stop, and its fallbacks). Everything
else is built once, before the loop, by :func:`build_run`.

Under torchrun (``nanolm.distributed``) every process runs this loop on its share of each
batch; the step's token count and gradients are summed over every rank, and rank 0 logs and
writes the run directory: the same step, split over processes.

The course's names import from here as the week writes them: :func:`get_batch` (packing
without regard to document boundaries, in ``nanolm/batches.py``), :func:`estimate_loss`
(``nanolm/evaluate.py``), :func:`cosine_lr` (``nanolm/step.py``), :func:`get_param_groups`
(``nanolm/optim.py``) and :func:`train` itself.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .base.lock import ReadLock, RunLock
from .batches import (  # noqa: F401 (get_batch: the course's name)
    DEFAULT_EVAL_WINDOWS,
    Batch,
    TrainBatches,
    WindowSampler,
    eval_batches,
    get_batch,
    pack_windows,
)
from .checkpoint import Checkpointer, rollback_checkpoint
from .distributed import Distributed, Muted, launch
from .errors import NanolmError
from .evaluate import estimate_loss  # noqa: F401 (the course's name)
from .machine.device import is_out_of_memory, refuse_what_the_device_cannot_do, resolve_device
from .machine.hardware import peak_flops
from .machine.runtime import (
    StopAtOnce,
    StopOnSignal,
    TrainingInterrupted,
    configure_determinism,
    configure_tf32,
    configure_threads,
    seed_everything,
    settings_restored,
    stop_reason,
)
from .machine.threads import ThreadTuner
from .model import GPT, compile_blocks
from .optim import get_param_groups, optimizer_for  # noqa: F401 (get_param_groups: the course's name)
from .precision import DynamicLossScaler, Precision, cast_weights_, resolve_precision
from .run.budget import TimeBudget, measure_a_step_and_an_evaluation
from .run.config import RunConfig
from .run.directory import RunPlan, hold_prepared_data, locate_run, set_up_run_directory, use_prepared_tokenizer
from .run.final import clear_final, save_final_weights
from .sample import sample_text
from .step import StepSetup, cosine_lr, discarded_pass, learning_rate, summed_token_loss, train_step  # noqa: F401 (cosine_lr: the course's)
from .watch.guards import Guard, nan_origin
from .watch.observer import Observer, ObserverOptions
from .watch.reference import find_reference, setup_of
from .watch.sinks import missing_sink_packages, parse_sinks
from .watch.validator import Validator


@dataclass
class Progress:
    """Where the run stands: the step, the tokens trained on, the last and best evaluation.
    A checkpoint saves it; a resume and a rollback restore it."""

    step: int = 0
    tokens_seen: int = 0
    val_loss: float | None = None
    val_bpb: float | None = None
    best_val_loss: float | None = None

    def advance(self, step: int, tokens: int) -> None:
        self.step, self.tokens_seen = step, self.tokens_seen + tokens

    def evaluated(self, loss: float, bpb: float) -> None:
        self.val_loss, self.val_bpb = loss, bpb
        self.best_val_loss = loss if self.best_val_loss is None else min(self.best_val_loss, loss)

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "step"}

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            if f.name != "step" and f.name in state:
                setattr(self, f.name, state[f.name])


@dataclass
class Factories:
    """What a run builds its parts with, nanolm's own by default: ``model(GPTConfig)``,
    ``optimizer(model, cfg, precision)``, ``batches(tokens, sampler, seq_len, eos_id, grad_accum,
    ...)``, ``loss_fn(model, batch)``, ``scaler(enabled=...)``, ``checkpointer`` (a
    :class:`~nanolm.checkpoint.Checkpointer` class: ``checkpointer.for_run(cfg, ...)``). The lab
    (``nanolm.instruments.faults``) passes broken ones, to break a run the way real bugs do,
    and tests pass stand-ins; nothing else in the loop changes."""

    model: Callable = GPT
    optimizer: Callable = optimizer_for
    batches: Callable = TrainBatches
    loss_fn: Callable = summed_token_loss
    scaler: Callable = DynamicLossScaler
    checkpointer: Callable = Checkpointer


@dataclass
class Run:
    """Everything a training run needs, built once by :func:`build_run`."""

    cfg: RunConfig
    dist: Distributed
    out_dir: Path
    model: torch.nn.Module
    step_setup: StepSetup
    batches: TrainBatches
    threads: ThreadTuner  # --threads auto's trials between steps; does nothing on every other run
    budget: TimeBudget  # --time-budget: the plan and the clock's last step; ends nothing on every other run
    progress: Progress
    guard: Guard
    observer: Observer
    validator: Validator
    checkpointer: Checkpointer
    tokenizer: object
    tokens_per_step: int
    finishing: bool  # the run had already trained its steps: only its final weights are left to write


SET_UP_STOPPED = "while the run was being set up, before its first step: run the same command again to go on"
FINISH_STOPPED = (
    "while the run was finishing (its final weights, its sample): the last checkpoint is saved; run the "
    "same command again to finish"
)


def train(cfg: RunConfig, log=print, factories: Factories | None = None) -> dict:
    """Train a model as ``cfg`` says; returns the final figures. Writes the run directory.

    Running the same command again continues the run (``nanolm.run.directory``); a run that had
    already finished returns ``{"out_dir": ..., "finished": True}`` and trains nothing.
    Under torchrun every process calls this; they train one model together (``--dist``).
    """
    cfg = cfg.resolved()
    device = resolve_device(cfg.train.device)
    refuse_what_the_device_cannot_do(device, cfg.train.deterministic, cfg.train.compile, cfg.model.attention)
    resolve_precision(cfg.train.precision, device)  # an impossible format stops here, before anything is written
    missing = missing_sink_packages(parse_sinks(cfg.train.log))
    if missing:
        raise NanolmError(f"--log {missing[0]} needs the {missing[0]} package: pip install 'nanolm[{missing[0]}]'")
    if cfg.train.dist == "fsdp":
        from .base.sharded import require_sharded_storage

        require_sharded_storage()
    use_prepared_tokenizer(cfg)
    try:
        # one writer per run directory, and no prepare over the prepared data a run reads
        with settings_restored(), launch(cfg.train.dist, device) as dist, RunLock() as lock, ReadLock() as reading:
            log = log if dist.is_main else Muted()
            with StopAtOnce(SET_UP_STOPPED):  # nothing to save yet: a signal stops at once, cleaning up
                hold_prepared_data(cfg, reading)
                plan = dist.from_main(lambda: locate_run(cfg, lock, dist.world_size, log))  # rank 0 locks the directory
                if cfg.train.eval_windows is None:  # not asked for: a run continued keeps its validation set
                    cfg.train.eval_windows = plan.eval_windows or DEFAULT_EVAL_WINDOWS
                if plan.finished:
                    log(plan.message)
                    return {"out_dir": str(plan.out_dir), "finished": True}
                return run_loop(build_run(cfg, dist, plan, log=log, factories=factories or Factories()), log)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        raise NanolmError(
            f"out of memory on {device} (--batch-size {cfg.train.batch_size}, --seq-len "
            f"{cfg.model.seq_len}); lower --batch-size and raise --grad-accum for the same tokens "
            f"per step, then run the same command again: it resumes from the last checkpoint"
        ) from None


def run_loop(run: Run, log=print) -> dict:
    """The loop: the six steps of this module's docstring, then the final weights."""
    t, dist, progress, guard, observer, validator, checkpointer = (
        run.cfg.train,
        run.dist,
        run.progress,
        run.guard,
        run.observer,
        run.validator,
        run.checkpointer,
    )
    row: dict = {}
    with StopOnSignal() as stop, contextlib.closing(observer):
        run.budget.start(progress.step)  # --time-budget: a new run measures a step and plans; the clock starts
        observer.start(validator.evaluate(0) if progress.step == 0 and validator.due(0) else None)
        stop_signal = dist.first_signal(stop.requested)  # one during the first evaluation: no step to save yet
        if stop_signal:
            raise TrainingInterrupted(f"{stop_reason(stop_signal)} {SET_UP_STOPPED}", stop_signal)
        while progress.step < t.steps and not run.finishing:
            step = progress.step + 1
            # 1. the step's micro-batches (--threads auto: maybe first a trial of thread counts on them)
            batches = run.batches.next(step)
            run.threads.before_step(batches)
            # 2. one optimizer step (a-e)
            result = train_step(run.step_setup, step, batches)
            # 3. the guard's event
            if result.event is not None:
                guard.settle(result, batches)  # raises on "stop"
            if result.action == "rollback":
                progress.step = checkpointer.restore(result.rollback_to, keep_data_position=True)
                guard.rolled_back(result.event, progress.step)
                observer.rewound(progress.step)
                continue
            progress.advance(step, run.tokens_per_step)
            last = run.budget.ends_at(step)  # --time-budget: the clock says whether this step is the last
            # 4. log and evaluate when due
            row = observer.observe(result, last)  # the step's figures when it is logged, else {}
            if validator.due(step) or last:
                row.update(validator.evaluate(step))
            observer.record_step(row)
            # 5. save when due, and on SIGINT/SIGTERM
            reached = observer.target_reached(row)
            stop_signal = dist.first_signal(stop.requested)  # every rank stops after the same step
            if checkpointer.due(step, stop_signal, reached or last):
                # a signal that came during the save stops the run at this checkpoint too
                saved = checkpointer.save(step, row.get("val_loss"))
                stop_signal = dist.first_signal(stop.requested)
                if stop_signal:
                    raise TrainingInterrupted(
                        f"{stop_reason(stop_signal)} at step {step}: checkpoint saved to {saved}; "
                        f"run the same command again to resume",
                        stop_signal,
                    )
            # 6. stop early at --target-val-bpb, or where the time budget ends
            if reached or last:
                break
    with StopAtOnce(FINISH_STOPPED):  # the last checkpoint is saved: a signal stops at once
        return finish(run, row, log)


def build_run(
    cfg: RunConfig, dist: Distributed, plan: RunPlan, *, log=print, factories: Factories | None = None
) -> Run:
    """Everything the loop needs, for the run ``plan`` locates (``nanolm.run.directory.locate_run``;
    its directory is locked by the caller until the run ends): PyTorch's settings for the run
    (threads, determinism, TF32, seeds; ``train()`` restores them when it returns), the run
    directory and its data, the model and optimizer (:func:`build_model`), the batches
    (:func:`build_batches`), the components that watch, guard and save the run
    (:func:`build_components`), and the resume from a checkpoint when there is one."""
    t, factories = cfg.train, factories or Factories()
    device = dist.device
    precision = resolve_precision(t.precision, device)
    log(f"precision: {precision.describe()}")
    auto_threads = t.threads == 0 and device.type == "cpu" and not dist.active and not t.deterministic
    if auto_threads and t.compile:  # compiled code is specialised to a thread count: a trial of another compiles again
        auto_threads = False
        log(f"threads: {torch.get_num_threads()}, kept (--compile: each thread count tried would be compiled again)")
    configure_threads(t.threads, device, log, auto=auto_threads)
    if dist.active:
        log(f"distributed: {dist.describe()}")
    configure_determinism(t.deterministic)
    tf32 = configure_tf32(device, precision.name, t.tf32)
    if tf32:
        log(f"precision: {tf32}")
    seed_everything(t.seed)
    data = set_up_run_directory(cfg, dist, plan, precision.name, log)
    trainable = build_model(cfg, dist, precision, data.tokenizer.vocab_size, factories, log)
    batches, val_batches = build_batches(cfg, dist, data, factories)
    progress, model = Progress(), trainable.model
    # every rank's windows of every micro-batch: the tokens one optimizer step trains on
    tokens_per_step = t.batch_size * t.grad_accum * cfg.model.seq_len * dist.world_size
    observer, validator, guard, step_setup, checkpointer, budget = build_components(
        cfg,
        dist,
        plan.out_dir,
        data,
        precision,
        trainable,
        batches,
        val_batches,
        progress,
        tokens_per_step,
        factories,
        log,
    )

    # resume, or start
    if plan.checkpoint is not None:
        progress.step = checkpointer.restore(plan.checkpoint)
        log(f"resumed from {plan.checkpoint} at step {progress.step}")
        guard.note("resume", progress.step)
    target_met = 0 < t.target_val_bpb and progress.val_bpb is not None and progress.val_bpb <= t.target_val_bpb
    finishing = progress.step >= t.steps or target_met or budget.plan.ended
    if dist.is_main and not finishing:
        clear_final(plan.out_dir)  # this run trains on: its old final weights no longer describe it
    log(
        f"model: {model.num_params() / 1e6:.2f}M parameters | {data.tokenizer.kind} vocabulary of "
        f"{data.tokenizer.vocab_size} | {tokens_per_step} tokens per step | device {device} | "
        f"run dir {plan.out_dir}"
    )
    if not val_batches:
        log("warning: the validation split is shorter than one window; no validation loss will be reported")
    log(observer.describe_mfu())
    threads = ThreadTuner.fixed()
    if auto_threads:  # --threads auto: on a busy CPU, the thread count that is fastest now
        threads = ThreadTuner(
            partial(discarded_pass, trainable.step_model, autocast=precision.autocast), observer.write
        )
    return Run(
        cfg=cfg,
        dist=dist,
        out_dir=plan.out_dir,
        model=model,
        step_setup=step_setup,
        batches=batches,
        threads=threads,
        budget=budget,
        progress=progress,
        guard=guard,
        observer=observer,
        validator=validator,
        checkpointer=checkpointer,
        tokenizer=data.tokenizer,
        tokens_per_step=tokens_per_step,
        finishing=finishing,
    )


@dataclass
class Trainable:
    """The model and what updates it: ``model`` is the module whose weights are saved, clipped
    and updated; ``step_model`` is what runs forward (wrapped for data parallelism, maybe compiled)."""

    model: torch.nn.Module
    step_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: DynamicLossScaler


def build_model(
    cfg: RunConfig, dist: Distributed, precision: Precision, vocab_size: int, factories: Factories, log=print
) -> Trainable:
    """The model (sharded or wrapped for data parallelism before the optimizer sees it), the
    module the step runs forward (wrapped, maybe compiled), the optimizer and the loss scaler."""
    t = cfg.train
    model = factories.model(cfg.model.gpt_config(vocab_size)).to(dist.device)
    if precision.pure_bf16:
        cast_weights_(model, torch.bfloat16)
    step_model = dist.wrap(model)
    dist.seed_this_rank(t.seed)
    optimizer = factories.optimizer(model, cfg, precision)
    if hasattr(optimizer, "describe"):
        log(optimizer.describe(model))
    scaler = factories.scaler(enabled=precision.name == "fp16")
    if t.compile:
        compile_blocks(model)
    return Trainable(model, step_model, optimizer, scaler)


def build_batches(cfg: RunConfig, dist: Distributed, data, factories: Factories):
    """The training stream (this rank's share of each step's windows) and the fixed validation set."""
    t, d, seq_len, eos = cfg.train, cfg.data, cfg.model.seq_len, data.tokenizer.eos_id
    pack = dict(doc_mask=d.doc_mask, reset_positions=d.reset_positions, mask_boundary=d.mask_boundary)
    sampler = WindowSampler(
        len(data.train),
        seq_len,
        t.batch_size,
        seed=t.seed,
        random_offset=d.random_offset,
        rank=dist.rank,
        world_size=dist.world_size,
    )
    batches = factories.batches(data.train.tokens, sampler, seq_len, eos, t.grad_accum, **pack)
    val_batches = eval_batches(data.val, seq_len, t.batch_size, eos, max_windows=t.eval_windows, **pack)
    return batches, val_batches


def build_components(
    cfg: RunConfig,
    dist: Distributed,
    out_dir: Path,
    data,
    precision: Precision,
    trainable: Trainable,
    batches,
    val_batches,
    progress: Progress,
    tokens_per_step: int,
    factories: Factories,
    log=print,
):
    """The observer, the validator, the guard, the step's setup, the checkpointer and the time
    budget, each given what it needs when it is built: the validator first (the observer logs
    every step it evaluates), then the observer (the others write their lines through it, above
    the progress bar), then the guard (it rolls back to the checkpointer's latest checkpoint,
    found by :func:`~nanolm.checkpoint.rollback_checkpoint`), then the time budget (under
    ``--time-budget`` its plan sets the learning rate), then the step, then the checkpointer (it
    saves the state of every other component)."""
    t, o, g, tokenizer = cfg.train, cfg.optim, cfg.guard, data.tokenizer
    model, optimizer, scaler = trainable.model, trainable.optimizer, trainable.scaler
    peak = peak_flops(dist.device, precision.autocast_dtype or next(model.parameters()).dtype, t.peak_flops)
    setup = setup_of(cfg, data.digest, precision.name, dist.device.type, dist.world_size)
    validator = Validator.for_run(
        cfg,
        model=model,
        dist=dist,
        precision=precision,
        batches=val_batches,
        token_bytes=torch.from_numpy(tokenizer.token_bytes()),
        progress=progress,
        floor=data.meta.get("floor"),
    )
    observer = Observer(
        ObserverOptions.from_config(cfg, tokens_per_step),
        dist=dist,
        out_dir=out_dir,
        model=model,
        precision=precision,
        scaler=scaler,
        progress=progress,
        evaluates=validator.due,
        peak=peak,
        log=log,
        optimizer=optimizer,
        setup=setup,
        reference=find_reference(setup),
    )
    guard = Guard.from_options(
        g,
        out_dir=out_dir if dist.is_main else None,
        log=observer.write,
        rollback_to=lambda: rollback_checkpoint(dist, out_dir, observer.write),
        explain_nan=lambda batch: nan_origin(model, batch, precision.autocast, tokenizer.vocab_size),
    )
    budget = TimeBudget.off()
    if t.time_budget is not None:
        budget = TimeBudget(
            t.time_budget,
            o,
            eval_every=t.eval_every,
            max_steps=t.steps,
            measure=measure_a_step_and_an_evaluation(
                trainable.step_model,
                model,
                timing_batch(cfg, data),
                val_batches,
                grad_accum=t.grad_accum,
                autocast=precision.autocast,
                token_bytes=torch.from_numpy(tokenizer.token_bytes()),
                dist=dist,
            ),
            planned=observer.planned,
            dist=dist,
            log=observer.write,
            compiling=t.compile,
        )
    step_setup = StepSetup(
        model,
        optimizer,
        schedule=budget.learning_rate if budget.active else partial(learning_rate, o=o, total_steps=t.steps),
        clip=o.clip,
        step_model=trainable.step_model,
        scaler=scaler,
        autocast=precision.autocast,
        dist=dist,
        guard=guard,
        loss_fn=factories.loss_fn,
        watch=observer.gradient_watch,
    )
    checkpointer = factories.checkpointer.for_run(
        cfg,
        dist=dist,
        run_dir=out_dir,
        model=model,
        optimizer=optimizer,
        tokenizer=tokenizer,
        stateful={
            "sampler": batches,
            "scaler": scaler,
            "progress": progress,
            "guard": guard,
            "observer": observer,
            **({"budget": budget} if budget.active else {}),
        },
        data_digest=data.digest,
        log=observer.write,
    )
    return observer, validator, guard, step_setup, checkpointer, budget


def timing_batch(cfg: RunConfig, data) -> Batch:
    """A micro-batch of the training split's first windows, for the time budget to time a step's
    passes on without drawing from the training stream (a batch costs the same wherever it starts)."""
    t, d, seq_len = cfg.train, cfg.data, cfg.model.seq_len
    starts = np.minimum(np.arange(t.batch_size) * seq_len, len(data.train) - seq_len - 1)
    pack = dict(doc_mask=d.doc_mask, reset_positions=d.reset_positions, mask_boundary=d.mask_boundary)
    return pack_windows(data.train.tokens, starts, seq_len, data.tokenizer.eos_id, **pack)


def finish(run: Run, row: dict, log=print) -> dict:
    """The final weights (and ``final.json``, which says the run finished), then a sample.
    A model whose final validation loss is not finite is not a finished run: it is an error."""
    t, dist, out_dir, progress = run.cfg.train, run.dist, run.out_dir, run.progress
    if progress.val_loss is not None and not math.isfinite(progress.val_loss):  # e.g. --on-nan skip to the end
        raise NanolmError(
            f"the final model's validation loss is {progress.val_loss}: the run did not produce a "
            f"usable model (no final weights written); run `nanolm diagnose {out_dir}`"
        )
    summary = {"val_loss": progress.val_loss, "val_bpb": progress.val_bpb}
    if run.budget.plan.ended:  # a rerun of the same command then has nothing to do
        summary["time_budget_s"] = t.time_budget
        if run.budget.started is not None:  # this process trained: what the budget's clock says now
            log(
                f"time budget: {run.budget.used():.1f} s of {t.time_budget:g} s used, the final evaluation and save included"
            )
    whole = save_final_weights(dist, run.model, out_dir, progress.step, summary)
    result = {"out_dir": str(out_dir), "elapsed_s": run.observer.elapsed(), **row}
    if t.sample_tokens and dist.is_main and not dist.sharded:
        with run.step_setup.autocast():
            result["sample"] = sample_text(whole, run.tokenizer, dist.device, t.sample_tokens, seed=t.seed)
        log("sample:\n" + result["sample"])
    elif t.sample_tokens and dist.sharded:
        log(f"no sample under --dist fsdp (the whole model may not fit one device); nanolm sample --run {out_dir}")
    log(f"done in {result['elapsed_s']:.1f}s; weights, config, tokenizer, checkpoints and metrics in {out_dir}")
    return result


if __name__ == "__main__":  # ``python -m nanolm.train ...`` is ``nanolm train ...``: run through the command's one
    import runpy  # entry, nanolm/__main__.py (an import of the command line from here would run back up the house)

    sys.argv[1:1] = ["train"]
    runpy.run_module("nanolm", run_name="__main__", alter_sys=True)
