"""The observer's decisions, on an observer built by hand (no training): which steps are logged and
which get per-layer statistics, what the step-0 row records of the recipe, what a logged row
holds, when a non-finite loss stops a run, what a resume and a rollback continue, and the lines it
says. ``test_sinks.py`` and ``test_train.py`` watch the same decisions through whole runs."""

import math
import time

import pytest
import torch
from conftest import tiny_model

from nanolm.batches import Batch
from nanolm.distributed import Distributed
from nanolm.errors import NanolmError
from nanolm.precision import DynamicLossScaler, resolve_precision
from nanolm.run.config import RunConfig
from nanolm.step import StepResult, wsd_decay_start
from nanolm.train import Progress
from nanolm.watch.observer import Observer, ObserverOptions, is_stats_step
from nanolm.watch.sinks import read_metrics


def _observer(
    tmp_path,
    precision="fp32",
    peak=(2.5e12, "measured"),
    optimizer=None,
    evaluates=lambda s: s % 8 == 0,
    cfg=None,
    dist=None,
    setup=None,
    reference=None,
    **train,
) -> Observer:
    cfg = cfg or RunConfig()
    cfg.train.steps, cfg.train.log_every, cfg.train.stats_every, cfg.train.batch_size = 40, 10, 0, 3
    cfg.model.seq_len = 32
    tmp_path.mkdir(parents=True, exist_ok=True)
    for k, v in train.items():
        setattr(cfg.train, k, v)
    cfg = cfg.resolved()  # as a run hands it on
    said = []
    model = tiny_model()
    observer = Observer(
        ObserverOptions.from_config(cfg, tokens_per_step=3 * 32),
        dist=dist or Distributed(),
        out_dir=tmp_path,
        model=model,
        precision=resolve_precision(precision, torch.device("cpu")),
        scaler=DynamicLossScaler(enabled=precision == "fp16"),
        progress=Progress(),
        evaluates=evaluates,
        peak=peak,
        log=said.append,
        optimizer=optimizer,
        setup=setup,
        reference=reference,
    )
    observer.said = said
    return observer


@pytest.mark.parametrize(
    "step, every, due",
    [(1, 5, True), (5, 5, True), (10, 5, True), (4, 5, False), (1, 0, False), (5, 0, False), (2, 1, True)],
)
def test_per_layer_statistics_come_after_the_first_update_and_every_stats_every_steps(step, every, due):
    assert is_stats_step(step, every) is due


def test_a_step_is_logged_at_its_period_the_first_steps_after_a_start_evaluations_statistics_and_the_end(tmp_path):
    observer = _observer(tmp_path, stats_every=7)
    logged = [step for step in range(1, 41) if observer.logs(step)]
    assert logged == [1, 2, 3, 7, 8, 10, 14, 16, 20, 21, 24, 28, 30, 32, 35, 40]
    last = _observer(tmp_path / "43", steps=43)  # the last step, off every period
    assert last.logs(43) and not last.logs(42)
    observer.restarted_at = 22  # a resume (or a rollback) at step 22: its next three steps are shown
    assert [step for step in range(21, 28) if observer.logs(step)] == [21, 22, 23, 24, 25]


def test_mfu_is_measured_against_a_named_peak_and_said_once(tmp_path):
    observer = _observer(tmp_path)
    flops = observer.model.flops_per_token() / 1e6
    assert observer.describe_mfu() == f"MFU: {flops:.2f} MFLOP per token, against 2.5 TFLOP/s (measured)"
    assert _observer(tmp_path, peak=(None, "unknown CPU")).describe_mfu() == (
        f"MFU: {flops:.2f} MFLOP per token, against no peak (unknown CPU)"
    )
    assert observer.options.tokens_per_step == 3 * 32 and observer.peak == 2.5e12


def test_the_step_0_row_records_the_recipe_as_run(tmp_path):
    from nanolm.optim import build_optimizer

    cfg = RunConfig()
    o = cfg.optim
    o.schedule, o.warmup, o.decay_fraction, o.weight_decay = "wsd", 4, 0.25, 0.1
    recipe = _observer(tmp_path, cfg=cfg).recipe()
    assert recipe == {
        "peak_lr": o.lr,
        "min_lr": o.lr / 10,  # resolved: --min-lr left at its default
        "warmup_steps": 4,
        "beta1": o.beta1,
        "beta2": o.beta2,
        "weight_decay": 0.1,
        "clip": o.clip,
        "optimizer": o.optimizer,
        "schedule": "wsd",
        "decay_start_step": wsd_decay_start(4, 40, 0.25) + 1,
        "decay_end_step": 41,
    }
    o.schedule, o.optimizer, o.muon_lr, o.muon_momentum = "cosine", "muon", 0.02, 0.9
    observer = _observer(tmp_path, cfg=cfg)
    recipe = observer.recipe()
    assert "decay_start_step" not in recipe and (recipe["muon_lr"], recipe["muon_momentum"]) == (
        o.muon_lr,
        o.muon_momentum,
    )
    model = observer.model
    decayed_everything = torch.optim.AdamW([{"params": list(model.parameters()), "weight_decay": 0.1}])
    observer.optimizer = decayed_everything
    small = sum(1 for p in model.parameters() if p.dim() < 2) + 1  # the norms, and the embedding (tied to the head)
    assert observer.recipe()["decayed_norms_biases_embeddings"] == small
    observer.optimizer = build_optimizer(model, 1e-3, 0.1)  # nanolm's own groups decay none of them
    assert observer.recipe()["decayed_norms_biases_embeddings"] == 0


def _result(step, loss=2.0, updated=True, read=None):
    return StepResult(
        step=step, lr=1e-3, loss=torch.tensor(loss), grad_norm=torch.tensor(0.5), updated=updated, read=read
    )


def test_a_logged_step_reads_its_figures_once_and_a_quiet_step_returns_nothing(tmp_path):
    observer = _observer(tmp_path)
    observer.start()
    observer.progress.tokens_seen = 96
    row = observer.observe(_result(1))
    assert (row["step"], row["loss"], row["lr"], row["grad_norm"], row["tokens"]) == (1, 2.0, 1e-3, 0.5, 96)
    assert row["threads"] == torch.get_num_threads()
    assert observer.observe(_result(5)) == {}


def test_a_non_finite_loss_stops_a_run_whose_guard_reads_no_step(tmp_path):
    cfg = RunConfig()
    cfg.guard.on_nan, cfg.guard.on_spike = "stop", "off"  # the guard reads nothing
    observer = _observer(tmp_path, cfg=cfg)
    assert observer.options.loss_read_every_step is False
    observer.start()
    with pytest.raises(NanolmError, match=r"^the loss became nan at step 1; lower --lr or raise --warmup$"):
        observer.observe(_result(1, loss=math.nan))
    cfg.guard.on_spike = "warn"  # a guard that reads each step decides instead (skip, roll back)
    (tmp_path / "reads").mkdir()
    observer = _observer(tmp_path / "reads", cfg=cfg)
    assert observer.options.loss_read_every_step is True
    observer.start()
    assert math.isnan(observer.observe(_result(1, loss=math.nan))["loss"])


@pytest.mark.parametrize(
    "target, val_bpb, reached",
    [(0.0, 0.5, False), (0.0, 0.0, False), (1.0, 1.0, True), (1.0, 1.01, False), (1.0, None, False)],
)
def test_the_target_is_reached_at_an_evaluation_at_or_below_it(tmp_path, target, val_bpb, reached):
    observer = _observer(tmp_path, target_val_bpb=target)
    row = {"step": 8} if val_bpb is None else {"step": 8, "val_bpb": val_bpb}
    assert observer.target_reached(row) is reached
    assert observer.said == ([f"val bpb {val_bpb:.4f} <= --target-val-bpb {target} at step 8: done"] if reached else [])


def test_a_resume_continues_the_clipped_steps_and_the_training_time(tmp_path):
    observer = _observer(tmp_path)
    assert observer.elapsed() == 0.0
    observer.load_state_dict({"clipped_steps": 3, "elapsed_s": 12.5})
    assert observer.elapsed() == 12.5
    observer.progress.step = 10
    observer.start()
    state = observer.state_dict()
    assert state["clipped_steps"] == 3 and 12.5 <= state["elapsed_s"] < 60 and observer.restarted_at == 10
    time.sleep(0.01)
    assert observer.elapsed() > 12.5  # the clock runs from the resumed time on
    observer.load_state_dict({"clipped_steps": 1, "elapsed_s": 0.0})  # a rollback: the checkpoint's count, the clock on
    assert observer.state_dict()["clipped_steps"] == 1 and observer.elapsed() >= 12.5


def test_gradients_are_watched_on_statistics_steps_and_for_fp16_underflow_on_logged_steps(tmp_path):
    batch = [None]
    assert _observer(tmp_path).gradient_watch(5, batch) is None
    fp16 = _observer(tmp_path, precision="fp16")
    assert fp16.gradient_watch(10, batch).underflow and fp16.gradient_watch(5, batch) is None


def test_the_observers_options_are_the_configurations_once():
    cfg = RunConfig()
    t = cfg.train
    t.steps, t.log_every, t.stats_every, t.log, t.progress, t.seed, t.target_val_bpb = (
        77,
        7,
        11,
        "tensorboard, wandb,tensorboard",
        "bar",
        5,
        1.25,
    )
    options = ObserverOptions.from_config(cfg, tokens_per_step=1234)
    assert (
        options.steps,
        options.tokens_per_step,
        options.log_every,
        options.stats_every,
        options.sinks,
        options.progress,
        options.seed,
        options.target_val_bpb,
    ) == (77, 1234, 7, 11, ("tensorboard", "wandb"), "bar", 5, 1.25)
    assert options.config == cfg.to_dict() and options.loss_read_every_step is True  # the default guard rolls back


def _result_with(watch):
    return StepResult(
        step=10, lr=1e-3, loss=torch.tensor(2.0), grad_norm=torch.tensor(0.5), updated=True, read=None, watch=watch
    )


def test_fp16s_underflow_is_read_from_the_gradients_at_the_scale_backward_ran_at(tmp_path):
    from nanolm.precision import grad_subnormal_fraction, grad_zero_fraction
    from nanolm.watch.observer import GradientWatch

    model = tiny_model()
    for i, p in enumerate(model.parameters()):
        # 4e-5: below fp16's normal range as it is, within it when doubled (the scale backward ran at)
        p.grad = torch.zeros_like(p) if i % 3 == 0 else torch.full_like(p, 1e-6 if i % 3 == 1 else 4e-5)
    scaler = DynamicLossScaler(enabled=True)
    watch = GradientWatch(model, None, underflow=True, scaler=scaler)
    watch.capture()
    figures = watch.after_update()
    assert figures == {
        "grad_zero_frac": grad_zero_fraction(model.parameters()).item(),
        "grad_subnormal_frac": grad_subnormal_fraction(model.parameters(), scaler.loss_scale).item(),
    }
    assert 0 < figures["grad_zero_frac"] < 1 and figures["grad_subnormal_frac"] > 0
    assert all(type(v) is float for v in figures.values())  # read from the device, once
    unscaled = GradientWatch(model, None, underflow=True, scaler=None)  # no scaler: a scale of 1
    unscaled.capture()
    assert unscaled.after_update()["grad_subnormal_frac"] == grad_subnormal_fraction(model.parameters(), 1.0).item()
    assert grad_subnormal_fraction(model.parameters(), 1.0) != grad_subnormal_fraction(model.parameters(), 2.0)
    quiet = GradientWatch(model, None, underflow=False)
    quiet.capture()
    assert quiet.after_update() == {}


def test_a_shipped_recipes_run_is_announced_judged_and_recorded_with_its_reference(tmp_path):
    from nanolm.watch.reference import no_reference_line, setup_digest, shipped_references

    reference = next(r for r in shipped_references() if r.bands.get("val_loss") is not None)
    observer = _observer(tmp_path, setup=reference.setup, reference=reference, seed=7)
    assert observer.band.reference is reference and observer.band.seed == 7
    observer.start(evaluation={"val_loss": 99.0, "val_bpb": 9.0})
    assert observer.said[0] == (
        f"reference: this is {reference.describe()}; each evaluation says whether the "
        f"validation loss is inside its band"
    )
    observer.close()
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    keys = {k: v for k, v in reference.setup["run"].items() if k != "val_windows"}
    assert row["setup_digest"] == setup_digest(reference.setup) and row["reference"] == reference.name
    assert row["seed"] == observer.options.seed and all(row[k] == v for k, v in keys.items())
    assert row["elapsed_s"] == 0.0 and observer.elapsed() < 1.0  # a new run's clock starts at 0
    assert row["step"] == 0 and row["val_loss"] == 99.0 and row["n_params"] == observer.model.num_params()
    lo, hi = reference.bands["val_loss"].at(0)  # judged against the band at step 0: far above it
    assert (row["val_band_lo"], row["val_band_hi"], row["val_band_side"], row["val_band_since"]) == (lo, hi, 1, 0)
    assert row["tokens_per_step"] == 96 and row["peak_flops"] == 2.5e12 and row["peak_lr"] == RunConfig().optim.lr

    plain = _observer(tmp_path / "plain")  # no setup: nothing said, nothing of a reference recorded
    (tmp_path / "plain").mkdir(exist_ok=True)
    plain.start()
    assert plain.said == [] and plain.reference_keys() == {}
    plain.close()
    unknown = _observer(tmp_path / "unknown")
    (tmp_path / "unknown").mkdir(exist_ok=True)
    unknown.setup = {**reference.setup, "run": {**reference.setup["run"], "steps": 3}}
    unknown.start()
    assert unknown.said == [no_reference_line(unknown.setup)]
    assert unknown.reference_keys() == {
        "setup_digest": setup_digest(unknown.setup),
        **{k: v for k, v in unknown.setup["run"].items() if k != "val_windows"},
    }
    unknown.close()


def test_a_rollback_discards_the_rows_after_its_checkpoint_and_shows_the_next_steps(tmp_path):
    observer = _observer(tmp_path)
    observer.start()
    for step in (1, 2, 3, 10, 20):
        observer.record_step(observer.observe(_result(step)))
    observer.record_step({})  # a step not logged records nothing
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 10, 20]
    observer.rewound(10)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 10]
    assert observer.restarted_at == 10 and observer.logs(13) and not observer.logs(14)
    written = []
    observer.monitor.write = written.append  # above the progress bar, when there is one
    observer.write("a line for the person watching")
    assert written == ["a line for the person watching"] and "a line for the person watching" not in observer.said
    row = observer.observe(_result(11))  # the next step's throughput is measured from the rollback's step
    assert row["step"] == 11 and row["tokens_per_sec"] > 0
    observer.close()
    assert observer.monitor.metrics.file.closed
    lone = _observer(tmp_path / "lone")  # not started (no monitor): its lines go to the log
    lone.write("said")
    assert lone.said == ["said"]
    lone.close()  # nothing opened, nothing to close


def test_fp16s_watch_reads_the_gradients_of_the_model_at_the_scalers_scale(tmp_path):
    """On a logged fp16 step the observer's watch reads the run's own model, at the scale the
    scaler ran backward at (a gradient of 1e-8 was normal at 65536x, below fp16's range at 1x)."""
    from nanolm.precision import grad_subnormal_fraction, grad_zero_fraction

    observer = _observer(tmp_path, precision="fp16")
    for i, p in enumerate(observer.model.parameters()):
        p.grad = torch.zeros_like(p) if i % 2 else torch.full_like(p, 1e-8)
    watch = observer.gradient_watch(10, [None])
    watch.capture()
    params = observer.model.parameters
    assert watch.after_update() == {
        "grad_zero_frac": grad_zero_fraction(params()).item(),
        "grad_subnormal_frac": grad_subnormal_fraction(params(), observer.scaler.loss_scale).item(),
    }
    assert grad_subnormal_fraction(params(), observer.scaler.loss_scale) != grad_subnormal_fraction(params(), 1.0)


@pytest.mark.kernels
def test_an_fp16_steps_per_layer_gradient_figures_are_read_after_unscaling(tmp_path):
    """During backward every gradient is multiplied by the loss scale (65536 at the start): read
    before unscaling, each layer's gradient norm would be that much too large, and diagnose would
    see every layer exploding. The step runs without autocast and the scale is a power of two,
    so its unscaled gradients are exactly those of a run without a scale: so must its figures be."""
    from nanolm.optim import build_optimizer
    from nanolm.precision import grad_subnormal_fraction
    from nanolm.step import StepSetup, accumulate_gradients, train_step

    batch = Batch(torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32)), torch.ones(2, 32, dtype=torch.bool))
    figures, scales = {}, {}
    for precision in ("fp16", "fp32"):
        observer = _observer(tmp_path / precision, precision=precision, stats_every=1)
        model, scales[precision] = observer.model, observer.scaler.loss_scale
        setup = StepSetup(model, build_optimizer(model, 1e-3, 0.1), lambda step: 1e-3, scaler=observer.scaler)
        setup.watch = observer.gradient_watch
        figures[precision] = train_step(setup, 1, [batch]).watch.after_update()
    assert scales == {"fp16": 65536.0, "fp32": 1.0}
    layers = [k for k in figures["fp32"] if k.startswith("grad_norm/")]
    assert layers and all(figures["fp16"][k] == pytest.approx(figures["fp32"][k], rel=1e-5) for k in layers)
    model = tiny_model()  # the step's true gradients, for the underflow share at the scale backward ran at
    accumulate_gradients(model, [batch], 64)
    assert figures["fp16"]["grad_subnormal_frac"] == grad_subnormal_fraction(model.parameters(), 65536.0).item()


def test_statistics_steps_probe_under_the_runs_autocast(tmp_path):
    observer = _observer(tmp_path, precision="bf16", stats_every=5)
    watch = observer.gradient_watch(5, [None])
    used, runs = watch.layer_stats.autocast, observer.precision.autocast
    assert (used.func, used.args, used.keywords) == (runs.func, runs.args, runs.keywords)


def test_a_rollback_judges_the_band_again_from_the_rows_it_keeps(tmp_path):
    from nanolm.watch.reference import shipped_references

    reference = next(r for r in shipped_references() if r.bands.get("val_loss") is not None)
    observer = _observer(tmp_path, setup=reference.setup, reference=reference)
    observer.start(evaluation={"val_loss": 99.0, "val_bpb": 9.0})  # far above the band at step 0
    assert observer.band.side == 1 and observer.band.since == 0
    observer.rewound(0)  # the rows kept: step 0's only
    assert observer.band.side == 1 and observer.band.since == 0 and observer.band.values == {0: 99.0}
    observer.close()


def test_the_peak_counts_every_process_and_a_resume_cuts_the_log_back_to_its_checkpoint(tmp_path):
    from nanolm.distributed import Distributed as World

    assert _observer(tmp_path / "two", dist=World(world_size=2)).peak == 2 * 2.5e12  # MFU against every rank's
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 2.0}}\n' for s in (0, 5, 10, 15, 20)))
    observer = _observer(tmp_path)
    observer.progress.step = 10  # resumed from the checkpoint of step 10: the rows after it are a lost trajectory
    observer.start()
    observer.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 5, 10]


def test_a_resumed_recipe_run_rebuilds_its_band_from_the_rows_it_kept(tmp_path):
    """Since when a run is outside its band is read back from metrics.jsonl on a resume: the
    evaluation line goes on saying 'above since step 0', not 'since' the resume."""
    from nanolm.watch.reference import shipped_references

    reference = next(r for r in shipped_references() if r.bands.get("val_loss") is not None)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 9.0, "val_loss": 99.0}\n{"step": 5, "loss": 8.0}\n')
    observer = _observer(tmp_path, setup=reference.setup, reference=reference)
    observer.progress.step = 5
    observer.start()
    assert observer.band.values == {0: 99.0} and (observer.band.side, observer.band.since) == (1, 0)
    observer.close()
