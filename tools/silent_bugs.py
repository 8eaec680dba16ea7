"""Plant each known silent bug in a copy of nanolm and check that the test suite catches it.

A model with a bug in its data, loss or optimizer usually still trains, just worse, so
"the tests pass" proves little unless each of those bugs, planted on purpose, makes a test
fail. This script keeps that promise checkable: every entry of ``BUGS`` is a one-line
change that a real training codebase has shipped at some point (targets not shifted, a
forgotten ``zero_grad``, an LR one step late, ...). For each, it copies the package, plants
the bug, runs the tests on the copy and reports which test caught it, or that none did.
The working tree is never modified.

Each bug meets its concern's test files first (``CONCERN_TESTS``: a bug in the batches meets
tests/test_data.py before the rest; a bug whose symptom shows elsewhere names its own ``tests``,
met before those), then the other fast test files, stopping at the first
failure: the test that names a bug is the one closest to it, and a bug its own concern's tests
miss is still caught, and reported with the file that caught it, wherever that is.

    python tools/silent_bugs.py                     # every bug, the fast test files (once per bug: far longer than the suite)
    python tools/silent_bugs.py --only lr_one_step_late,missing_zero_grad
    python tools/silent_bugs.py --list
    python tools/silent_bugs.py --only targets_not_shifted --reformat   # the package reformatted first

Exit status 1 if a bug survives. ``tests/test_silent_bugs.py`` checks, in the normal suite,
that every planted line still exists in the code, so this list cannot rot unnoticed.

A bug is found in a Python file by its tokens, not its text (:func:`planted`): spaces, line
breaks, comments, quotes, a formatter's parentheses and trailing commas do not matter, so a file
reformatted by black (or by hand) keeps every bug plantable; what must stay is the code itself.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    name: str
    effect: str  # what a run with this bug looks like: why nobody would notice
    file: str
    correct: str  # the exact text in nanolm, found exactly once
    broken: str
    # test files that guard the bug ahead of its file's concern, because the symptom shows
    # elsewhere: on a GPU or a Mac only the device tests play, on Windows only the platform
    # tests, in a resume only the checkpoint tests (see the bugs that name them)
    tests: tuple[str, ...] = ()


BUGS = [
    # data
    Bug(
        "targets_not_shifted",
        "the loss falls fast to ~0: the model copies its input",
        "nanolm/batches.py",
        "idx, targets = window[:, :-1], window[:, 1:]",
        "idx, targets = window[:, :-1], window[:, :-1]",
    ),
    Bug(
        "no_eos_between_documents",
        "documents run into each other; the model learns false continuations",
        "nanolm/data/shards.py",
        "            parts += [ids, np.array([eos_id])]",
        "            parts += [ids]",
    ),
    Bug(
        "doc_mask_is_plain_causal",
        "attention reads the previous, unrelated document",
        "nanolm/batches.py",
        "doc_ids = new_doc.cumsum(1, dtype=torch.int32)",
        "doc_ids = torch.zeros_like(new_doc, dtype=torch.int32)",
    ),
    Bug(
        "positions_off_by_one",
        "RoPE positions restart at 1 instead of 0 in each document",
        "nanolm/batches.py",
        "positions = ar - doc_start",
        "positions = ar - doc_start + 1",
    ),
    Bug(
        "boundary_not_masked",
        "--mask-boundary still trains on predicting a document's first token",
        "nanolm/batches.py",
        "loss_mask = ~is_eos if mask_boundary else",
        "loss_mask = torch.ones_like(idx, dtype=torch.bool) if mask_boundary else",
    ),
    Bug(
        "windows_overlap",
        "some text is seen twice an epoch and some never",
        "nanolm/batches.py",
        "self._order = (self.epoch, perm * self.seq_len + offset)",
        "self._order = (self.epoch, perm * (self.seq_len - 1) + offset)",
    ),
    Bug(
        "same_order_every_epoch",
        "every epoch replays the same batch sequence",
        "nanolm/batches.py",
        "manual_seed(self.seed * 1_000_003 + self.epoch)",
        "manual_seed(self.seed * 1_000_003)",
    ),
    Bug(
        "ranks_share_windows",
        "under torchrun every rank trains on the same batch: N GPUs, one GPU's data",
        "nanolm/batches.py",
        "return starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]",
        "return starts[: self.batch_size]",
    ),
    Bug(
        "device_batch_pinned",
        "a batch already on the GPU is pinned again on its way there: CUDA refuses, and a "
        "benchmark or a user calling train_step with device batches crashes",
        "nanolm/batches.py",
        'if device.type == "cuda" and not t.is_cuda:',
        'if device.type == "cuda":',
        tests=("test_devices",),
    ),
    Bug(
        "eval_tail_counted_twice",
        "validation counts some tokens twice: a slightly wrong val loss",
        "nanolm/batches.py",
        "        tail_from = covered - last",
        "        tail_from = 0",
    ),
    Bug(
        "bpe_cut_at_any_newline",
        "a long document encodes to slightly different tokens than the tokenizer's own",
        "nanolm/tokenizer.py",
        'SAFE_CUT = re.compile(r"(?<=[!-~]\\n)(?=[!-~])")',
        'SAFE_CUT = re.compile(r"(?<=\\n)")',
    ),
    Bug(
        "progress_consumes_the_tokenizer_texts",
        "a long prepare's bar counts the tokenizer's documents for an exact "
        "total and so leaves it none: a byte-level BPE of 257 tokens, which still trains, worse",
        "nanolm/data/progress.py",
        "        self.begin(what, total)\n        for text in texts:",
        "        self.begin(what, sum(len(t.encode('utf-8')) for t in texts))\n        for text in texts:",
    ),
    Bug(
        "tokenizer_sees_validation",
        "BPE merges learnt from the held-out text: validation compresses better than unseen text, a flattered loss",
        "nanolm/data/prepare.py",
        'if kind == "char" or split == "train":',
        "if True:",
    ),
    # model
    Bug(
        "flex_compiled_while_tracing",
        "FlexAttention's compiled wrapper is made inside a --compile trace: the raw "
        "function is kept, and every later eager call attends unfused, same numbers, slower and larger",
        "nanolm/model.py",
        "    if torch.compiler.is_compiling():\n        return fn\n",
        "    if False:  # made even while traced\n        return fn\n",
    ),
    Bug(
        "rope_off",
        "the model loses word order beyond what the causal mask gives; trains, worse",
        "nanolm/model.py",
        "return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v",
        "return q, k, v",
    ),
    Bug(
        "final_norm_skipped",
        "the head reads an unnormalised residual stream; trains, less stably",
        "nanolm/model.py",
        "        x = self.norm(x)\n        if targets is None:",
        "        x = x\n        if targets is None:",
    ),
    Bug(
        "untied_head",
        "twice the embedding parameters, different learning dynamics",
        "nanolm/model.py",
        "            self.lm_head.weight = self.embed.weight\n",
        "            pass\n",
    ),
    Bug(
        "kv_cache_positions_restart",
        "generation with the cache sees wrong positions: worse samples only",
        "nanolm/model.py",
        "cos, sin = self.rope(T, None, offset=cache.length)",
        "cos, sin = self.rope(T, None, offset=0)",
    ),
    Bug(
        "temperature_inverted",
        "samples get wilder when asked to be calmer",
        "nanolm/model.py",
        "    logits = logits / temperature",
        "    logits = logits * temperature",
    ),
    Bug(
        "top_k_keeps_one",
        "top-k sampling becomes greedy",
        "nanolm/model.py",
        "kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]",
        "kth = torch.topk(logits, top_k, dim=-1).values[:, :1]",
    ),
    Bug(
        "residual_init_not_scaled",
        "the residual stream's variance grows with depth from the first step: a deep model starts unstable",
        "nanolm/model.py",
        "residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)",
        "residual_std = 0.02 / 1.0",
    ),
    # loss
    Bug(
        "loss_over_all_positions",
        "masked positions dilute the mean: the loss reads low",
        "nanolm/model.py",
        "    return total, mask.sum()",
        "    return total, torch.ones_like(mask).sum()",
    ),
    Bug(
        "loss_in_low_precision",
        "under bf16 the cross-entropy is computed in bf16: noisy loss and gradients",
        "nanolm/model.py",
        "        logits.reshape(-1, logits.shape[-1]).float(),",
        "        logits.reshape(-1, logits.shape[-1]),",
    ),
    Bug(
        "loss_chunk_tail_dropped",
        "the fused head and loss skip the positions of a short last chunk: fewer tokens train",
        "nanolm/fused_loss.py",
        "for start in range(0, hidden.shape[0], chunk):",
        "for start in range(0, hidden.shape[0] - chunk + 1, chunk):",
    ),
    Bug(
        "masked_positions_get_gradient",
        "padding and prompt positions still push the weights though their loss is not counted",
        "nanolm/fused_loss.py",
        "h_counted = torch.where(counted, h, torch.zeros_like(h))",
        "h_counted = h",
    ),
    Bug(
        "fused_loss_in_low_precision",
        "under bf16 the fused loss takes its log-softmax in bf16: noisy loss and gradients",
        "nanolm/fused_loss.py",
        "torch.log_softmax(logits.float(), dim=-1)",
        "torch.log_softmax(logits, dim=-1)",
    ),
    Bug(
        "fused_loss_ignores_the_backward_factor",
        "the step's 1/token count never reaches the gradients: all are count times too large, clipping hides it",
        "nanolm/fused_loss.py",
        "        hidden_dtype, weight_dtype = ctx.dtypes\n        return (\n"
        "            (grad_hidden * grad_total).to(hidden_dtype),\n            (grad_weight * grad_total).to(weight_dtype),\n",
        "        hidden_dtype, weight_dtype = ctx.dtypes\n        return (\n"
        "            grad_hidden.to(hidden_dtype),\n            grad_weight.to(weight_dtype),\n",
    ),
    Bug(
        "fused_loss_fp16_gradients_unscaled",
        "under fp16 the head's weight gradient overflows before the loss scale can help: the scaler shrinks until the run stops",
        "nanolm/fused_loss.py",
        "token_scale = _fp16_scale((probs.t() @ largest).index_add_(0, safe_t[:, 0], largest))",
        "token_scale = torch.ones(probs.shape[1], device=probs.device)",
    ),
    Bug(
        "fused_loss_fp16_one_scale_for_every_token",
        "under fp16 the head's gradient rows of rare tokens lose their digits below fp16's normal range: those rows train on rounding noise",
        "nanolm/fused_loss.py",
        ".index_add_(0, safe_t[:, 0], largest))",
        ".index_add_(0, safe_t[:, 0], largest).amax().expand(probs.shape[1]))",
    ),
    # optimizer and schedule
    Bug(
        "decay_on_everything",
        "norm gains and embeddings are pulled toward zero",
        "nanolm/optim.py",
        "if p.dim() >= 2 and id(p) not in embedding_params:",
        "if True:",
    ),
    Bug(
        "weight_decay_ignored",
        "--weight-decay has no effect",
        "nanolm/optim.py",
        "get_param_groups(model, weight_decay), lr=lr",
        "get_param_groups(model, 0.0), lr=lr",
    ),
    Bug(
        "warmup_starts_at_zero",
        "the first step is wasted at LR 0",
        "nanolm/step.py",
        "return max_lr * step / warmup_steps",
        "return max_lr * (step - 1) / warmup_steps",
    ),
    Bug(
        "lr_one_step_late",
        "every step runs at the previous step's learning rate",
        "nanolm/step.py",
        "lr = setup.schedule(step) *",
        "lr = setup.schedule(max(1, step - 1)) *",
    ),
    Bug(
        "freed_buffers_given_back",
        "a CPU run lets glibc unmap each step's freed buffers: 6-10 % slower steps, same numbers",
        "nanolm/instruments/process.py",
        "        self.kept_freed_memory = keep_freed_memory_for_reuse(device)",
        "        self.kept_freed_memory = device.type == 'never'",
    ),
    Bug(
        "train_tunes_the_process",
        "train() called from a notebook or a sweep freezes the caller's garbage collector: "
        "its objects are never collected again",
        "nanolm/train.py",
        "    seed_everything(t.seed)\n",
        "    seed_everything(t.seed)\n    __import__('gc').freeze()\n",
        tests=("test_process_tuning",),
    ),
    Bug(
        "process_tuning_off_ignored",
        "--process-tuning off still tunes the process: a benchmark against it measures nothing",
        "nanolm/instruments/process.py",
        '        if option != "auto":\n            return\n',
        '        if option not in ("auto", "off"):\n            return\n',
    ),
    Bug(
        "qk_norm_on_the_slow_path",
        "QK-norm under bf16 autocast falls back to PyTorch's composite norm: 4-5 % slower steps",
        "nanolm/model.py",
        "        if x.dtype != self.weight.dtype:\n",
        "        if False:\n",
    ),
    Bug(
        "wsd_schedule_ignored",
        "--schedule wsd is accepted and the run follows the cosine anyway",
        "nanolm/step.py",
        '    if o.schedule == "wsd":\n        return wsd_lr(',
        "    if False:\n        return wsd_lr(",
    ),
    Bug(
        "betas_swapped",
        "AdamW with beta1 = 0.95, beta2 = 0.9: trains, differently",
        "nanolm/optim.py",
        "    betas = (o.beta1, o.beta2)\n",
        "    betas = (o.beta2, o.beta1)\n",
    ),
    Bug(
        "missing_zero_grad",
        "old gradients keep adding up: a heavy, unwanted momentum",
        "nanolm/step.py",
        "    setup.optimizer.zero_grad(set_to_none=True)\n",
        "    pass\n",
    ),
    Bug(
        "clipping_ignored",
        "--clip has no effect",
        "nanolm/step.py",
        "max_norm = setup.clip if setup.clip > 0 else math.inf",
        "max_norm = math.inf",
    ),
    Bug(
        "micro_batch_loss_is_its_own_mean",
        "under --grad-accum k each micro-batch backpropagates its own mean loss: "
        "gradients k times too large, the logged loss right; clipping and Adam hide most of it",
        "nanolm/step.py",
        "(micro_sum / denominator * loss_scale).backward()",
        "(micro_sum / at_least_one(counted_tokens([batch])) * loss_scale).backward()",
    ),
    Bug(
        "fp16_share_ignores_the_loss_scale",
        "the fp16 underflow share judges unscaled gradients: a healthy scaled fp16 run "
        "reads as underflowing, and diagnose cries wolf",
        "nanolm/precision.py",
        "limit = FP16_SMALLEST_NORMAL / loss_scale",
        "limit = FP16_SMALLEST_NORMAL * 1.0",
    ),
    Bug(
        "local_token_count",
        "under torchrun each rank averages over its own tokens: short documents weigh more",
        "nanolm/step.py",
        "        count = dist.sum_async(count)\n",
        "        count = PendingSum(torch.tensor(count, device=dist.device))\n",
        tests=("test_distributed",),
    ),
    Bug(
        "host_read_per_micro_batch",
        "the loss is summed on the host: a GPU waits for every micro-batch's forward pass, same numbers",
        "nanolm/step.py",
        "        loss_sum += micro_sum.detach()",
        "        loss_sum += micro_sum.item()",
        tests=("test_host_reads", "test_sinks"),
    ),
    # evaluation and metrics
    Bug(
        "eval_in_training_mode",
        "with dropout, validation loss is noisy and too high",
        "nanolm/evaluate.py",
        "    model.eval()\n",
        "    pass\n",
    ),
    Bug(
        "bpb_counts_eos_as_a_byte",
        "bits per byte read low: EOS spells no text",
        "nanolm/evaluate.py",
        "n_bytes += (token_bytes[batch.targets] * batch.loss_mask).sum()",
        "n_bytes += (token_bytes[batch.targets].clamp(min=1) * batch.loss_mask).sum()",
    ),
    Bug(
        "bpb_counts_the_input_tokens",
        "bits per byte divide by the bytes of the input tokens, not the predicted ones: "
        "off wherever characters of several bytes or masked positions are",
        "nanolm/evaluate.py",
        "n_bytes += (token_bytes[batch.targets] * batch.loss_mask)",
        "n_bytes += (token_bytes[batch.idx] * batch.loss_mask)",
    ),
    Bug(
        "corpus_follows_the_seed",
        "the built-in corpus is drawn from --seed: two seeds are scored on different "
        "validation sets, and their curves cannot be compared",
        "nanolm/data/prepare.py",
        "write_stories(source, d.stories, seed=0)",
        "write_stories(source, d.stories, seed=cfg.train.seed)",
        tests=("test_run_directory",),
    ),
    Bug(
        "dropout_may_change_on_resume",
        "a changed --dropout is accepted on resume: the run continues as a mix of two",
        "nanolm/run/resume.py",
        '"model": {"loss_chunk"},',
        '"model": {"loss_chunk", "dropout"},',
        tests=("test_run_directory",),
    ),
    Bug(
        "tokens_per_step_ignores_accumulation",
        "tokens/s and MFU read grad_accum times too low",
        "nanolm/train.py",
        "tokens_per_step = t.batch_size * t.grad_accum * cfg.model.seq_len * dist.world_size",
        "tokens_per_step = t.batch_size * cfg.model.seq_len * dist.world_size",
    ),
    # precision
    Bug(
        "fp16_not_unscaled",
        "fp16 gradients reach clipping and Adam multiplied by the loss scale",
        "nanolm/precision.py",
        "            torch._foreach_mul_(grads, inv)",
        "            pass",
    ),
    Bug(
        "gradient_figures_read_before_unscaling",
        "fp16's per-layer gradient norms are logged times the loss scale (65536 at the start) and its "
        "underflow share judged on scaled gradients: every layer reads as exploding, underflow as absent",
        "nanolm/step.py",
        "    if setup.scaler.enabled:\n        setup.scaler.unscale_(setup.model.parameters())\n"
        "    if watch is not None:\n        watch.capture()\n",
        "    if watch is not None:\n        watch.capture()\n"
        "    if setup.scaler.enabled:\n        setup.scaler.unscale_(setup.model.parameters())\n",
        tests=("test_observer",),
    ),
    Bug(
        "loss_scale_never_grows",
        "after one overflow fp16 keeps a needlessly small scale: underflow",
        "nanolm/precision.py",
        "                self.loss_scale *= self.growth_factor",
        "                pass",
    ),
    Bug(
        "stochastic_rounding_rounds_to_nearest",
        "bf16 weights silently drop small updates",
        "nanolm/precision.py",
        "    noise = torch.randint(0, 1 << 16, x.shape,",
        "    noise = 32768 + 0 * torch.randint(0, 1 << 16, x.shape,",
    ),
    # devices (tests/test_devices.py runs them on the CPU: FlexAttention's forward, a simulated GPU and MPS)
    Bug(
        "rope_promotes_q_and_k",
        "under autocast q and k leave RoPE in fp32 beside a 16-bit v: FlexAttention refuses, SDPA runs slow",
        "nanolm/model.py",
        "return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)",
        "return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin",
        tests=("test_devices",),
    ),
    Bug(
        "stats_slice_a_block_mask",
        "the first statistics step on a GPU slices FlexAttention's BlockMask like a tensor: TypeError",
        "nanolm/watch/stats.py",
        "logit_max[i] = max_attention_logit(module, x, cos, sin, allowed)",
        "logit_max[i] = max_attention_logit(module, x, cos, sin, args[3])",
        tests=("test_devices",),
    ),
    Bug(
        "float64_sums_on_the_device",
        "evaluation sums in float64 on the device: an Apple GPU has none, nanolm eval dies on a Mac",
        "nanolm/evaluate.py",
        "batch_nats.append(total.float())",
        "batch_nats.append(total.double())",
        tests=("test_devices",),
    ),
    Bug(
        "nan_explained_on_the_host_batch",
        "the guard's NaN explanation feeds host tensors to a GPU model: a device error instead of the rollback",
        "nanolm/watch/guards.py",
        "    batch = batch.to(next(model.parameters()).device)\n",
        "    batch = batch.to(batch.idx.device)\n",
        tests=("test_devices",),
    ),
    Bug(
        "rng_of_every_visible_gpu",
        "a CPU run starts a CUDA context; a checkpoint from a 2-GPU machine refuses to resume on one",
        "nanolm/machine/runtime.py",
        '    if device.type == "cuda":\n        state["cuda"] = torch.cuda.get_rng_state(device)',
        '    if torch.cuda.is_available():\n        state["cuda"] = torch.cuda.get_rng_state_all()',
    ),
    Bug(
        "settings_leak_out_of_train",
        "train() from a notebook leaves deterministic kernels and its thread count to everything after it",
        "nanolm/train.py",
        "with settings_restored(), launch(",
        "with launch(",
        tests=("test_devices",),
    ),
    Bug(
        "train_leaves_its_seed_behind",
        "a notebook's random draws after train() repeat the run's seed instead of continuing its own stream",
        "nanolm/machine/runtime.py",
        "        torch.set_rng_state(torch_rng)\n",
        "        pass  # the run's generator state stays\n",
    ),
    Bug(
        "barrier_after_a_failed_rank",
        "a rank out of memory waits at a barrier while the others wait in its all-reduce: the job hangs",
        "nanolm/distributed.py",
        "            if not failed:\n                dist.barrier()",
        "            if True:\n                dist.barrier()",
        tests=("test_devices",),
    ),
    Bug(
        "single_process_reduce_in_float64",
        "every evaluation builds a float64 tensor on the device for a reduction only torchrun needs: MPS fails",
        "nanolm/watch/validator.py",
        "            result = estimate_loss(\n                self.model,\n                self.dist.share_of(self.batches),\n                self.token_bytes,\n                self.dist.device,\n                reduce=self.dist.sum_tensors if self.dist.active else None,\n            )\n",
        "            result = estimate_loss(\n                self.model,\n                self.dist.share_of(self.batches),\n                self.token_bytes,\n                self.dist.device,\n                reduce=self.dist.sum_tensors)\n",
        tests=("test_devices",),
    ),
    # checkpoints and guards
    Bug(
        "checksum_ignored",
        "a corrupted checkpoint or data shard is loaded as if whole",
        "nanolm/base/files.py",
        "        if digest != files[name]:",
        "        if False:",
        tests=("test_checkpoint",),
    ),
    Bug(
        "unlisted_files_accepted",
        "a file slipped into a checkpoint (a pickle, a stray shard) is read unchecked",
        "nanolm/base/files.py",
        "    if unlisted:\n",
        "    if False:\n",
        tests=("test_checkpoint",),
    ),
    Bug(
        "meta_step_trusted",
        "a meta.json that claims another step makes a resume skip or repeat steps",
        "nanolm/checkpoint.py",
        '    if meta["step"] != step_of(path):',
        "    if False:",
    ),
    Bug(
        "data_not_verified",
        "a changed token in the run's data/ resumes silently on different data",
        "nanolm/data/shards.py",
        "        if verify:\n",
        "        if False:\n",
    ),
    Bug(
        "rerun_starts_a_new_directory",
        "the same command, run again, starts over in runs/<name>-2",
        "nanolm/run/directory.py",
        "        if isinstance(plan, RunPlan):",
        "        if isinstance(plan, RunPlan) and not out_dir.exists():",
    ),
    Bug(
        "dead_directory_blocks_reruns",
        "a run killed before its first checkpoint can never be rerun",
        "nanolm/run/directory.py",
        "    return RunPlan(out_dir, restart=True)",
        '    raise NanolmError(f"{out_dir} already holds a run without a checkpoint")',
    ),
    Bug(
        "final_weights_never_written",
        "killed after its last checkpoint, a rerun says 'nothing to do' without final weights",
        "nanolm/run/directory.py",
        '    finished_at = final["step"] if _finished(final, cfg) else None',
        "    finished_at = _step(checkpoint) if checkpoint is not None and _step(checkpoint) >= t.steps else None",
    ),
    Bug(
        "lock_taken_but_not_checked",
        "a second train on a live run trains over it: both exit 0, the run is a mix of two",
        "nanolm/base/lock.py",
        "                raise _refusal(e, directory, holder, flag) from None",
        "                return  # refused or not, go ahead",
        tests=("test_platforms",),
    ),
    Bug(
        "nan_model_exits_0",
        "a run whose final model outputs NaN is reported as a success",
        "nanolm/train.py",
        "    if progress.val_loss is not None and not math.isfinite(progress.val_loss):",
        "    if False:",
    ),
    Bug(
        "mfu_above_100",
        "a peak measured on a busy CPU makes MFU read above 100 %",
        "nanolm/watch/meter.py",
        "            if achieved > self.peak:",
        "            if False:",
    ),
    Bug(
        "skipped_check_shown_as_pass",
        "nanolm doctor prints PASS for a check that never ran",
        "nanolm/instruments/doctor.py",
        'return Check("no cross-document leak", True, "not run: forward() takes no doc_ids", skipped=True)',
        'return Check("no cross-document leak", True, "not run: forward() takes no doc_ids")',
    ),
    Bug(
        "step_unscales_every_precision",
        "an fp32 or bf16 step calls the fp16 scaler to divide by a scale of 1: the same "
        "numbers, and one more file on the path a reader follows through one step",
        "nanolm/step.py",
        "    if setup.scaler.enabled:\n        setup.scaler.unscale_(",
        "    if True:\n        setup.scaler.unscale_(",
        tests=("test_layout",),
    ),
    Bug(
        "step_asks_the_observer_twice",
        "each step asks the observer for its gradient watch twice: on a statistics "
        "step two probes hook the model and the first is never read, the same numbers for twice the cost",
        "nanolm/step.py",
        "    watch = setup.watch(step, micro_batches) if setup.watch is not None else None\n",
        "    watch = setup.watch(step, micro_batches) if setup.watch is not None else None\n"
        "    watch = setup.watch(step, micro_batches) if setup.watch is not None else watch\n",
        tests=("test_layout",),
    ),
    Bug(
        "skipped_step_still_updates",
        "a NaN or spike the guard skipped is trained on anyway",
        "nanolm/step.py",
        '    updated = action == "take" and (\n        not setup.scaler.enabled or setup.scaler.update(grad_norm if read is None else read[1])\n    )\n',
        "    updated = (\n        not setup.scaler.enabled or setup.scaler.update(grad_norm if read is None else read[1])\n    )\n",
    ),
    Bug(
        "rollback_lr_scale_ignored",
        "--rollback-lr-scale does nothing: after a rollback the run meets the same instability at the same rate",
        "nanolm/step.py",
        "lr = setup.schedule(step) * (setup.guard.lr_scale if setup.guard is not None else 1.0)",
        "lr = setup.schedule(step) * (1.0 if setup.guard is not None else 1.0)",
        tests=("test_guards",),
    ),
    Bug(
        "rollback_replays_the_bad_batch",
        "after a rollback the run meets the same bad batches again",
        "nanolm/train.py",
        "checkpointer.restore(result.rollback_to, keep_data_position=True)",
        "checkpointer.restore(result.rollback_to, keep_data_position=False)",
        tests=("test_guards",),
    ),
    Bug(
        "spike_on_the_raw_scale",
        "gradient-norm spikes judged by differences, not ratios: false alarms late in a run",
        "nanolm/watch/guards.py",
        "        return (self._scaled(value) - median) / scale",
        "        return (value - median) / scale",
    ),
    Bug(
        "skipped_spikes_join_the_history",
        "a spike the guard skipped or rolled back still joins the detector's history: a stretch "
        "of bad batches raises the median to its own level, and the rest of the stretch is trained on",
        "nanolm/watch/guards.py",
        '            if action == "take":  # a warned spike still belongs to the history\n                self.loss.add(loss)',
        "            if True:  # a warned spike still belongs to the history\n                self.loss.add(loss)",
    ),
    # instruments
    Bug(
        "recipe_reads_the_options",
        "weight decay on norms and embeddings is logged as 0: diagnose cannot name it",
        "nanolm/watch/observer.py",
        'if group.get("weight_decay", 0) > 0',
        'if group.get("weight_decay", 0) < 0',
    ),
    Bug(
        "replay_skips_the_steps_between",
        "a replayed step starts from the checkpoint's weights: not the step the run took",
        "nanolm/instruments/replay.py",
        "    for s in range(start + 1, step):",
        "    for s in range(start + 1, start + 1):",
    ),
    Bug(
        "full_disk_in_safetensors_words",
        "a full disk while saving weights ends in a traceback (safetensors' own "
        "error type) instead of one line naming the file",
        "nanolm/base/files.py",
        "found = _OS_ERROR_IN_WORDS.search(str(e))",
        "found = None",
    ),
    Bug(
        "full_disk_at_the_state_is_a_traceback",
        "a disk that fills while the optimizer state is saved ends in torch's "
        "'unexpected pos' traceback instead of one line naming the file",
        "nanolm/base/files.py",
        "            if writer.error is not None:\n                raise writer.error from None\n",
        "            if False:  # the disk's refusal forgotten\n                raise writer.error from None\n",
    ),
    Bug(
        "run_data_moved_half",
        "a disk that fills while the prepared data moves into the run directory ends in "
        "shutil's traceback listing every file, with half a data directory left behind",
        "nanolm/run/directory.py",
        "move_directory(data.dir, run_data)",
        "shutil.move(str(data.dir), run_data)",
        tests=("test_full_disk",),
    ),
    Bug(
        "lock_on_the_file_only",
        "the run's lock is held on RUN/.lock: deleting that leftover-looking file lets a "
        "second writer train beside the first, both exit 0",
        "nanolm/base/lock.py",
        "    if fcntl is None:\n        return None\n    return os.open(directory",
        "    if True:\n        return None\n    return os.open(directory",
    ),
    Bug(
        "prepare_into_a_live_run",
        "nanolm prepare --out RUN/data rewrites the shards under a training run: it ends "
        "having trained on other data than it recorded",
        "nanolm/base/lock.py",
        "            if (\n                holder is not None and holder not in _this_process_or_its_parent()\n            ):  # a run (or its child) writing into its own directory\n",
        "            if ( False):  # a run (or its child) writing into its own directory\n",
    ),
    Bug(
        "resume_reads_a_live_checkpoint_in_place",
        "--resume of a live run reads its checkpoint in place: pruned under it, the command fails half-way",
        "nanolm/run/directory.py",
        "holder = held_by_another(run_dir)",
        "holder = None",
    ),
    Bug(
        "muon_takes_the_embedding",
        "Muon orthogonalises the embedding table's (and tied head's) update too",
        "nanolm/optim.py",
        "    return [\n        p\n        for p in dict.fromkeys(model.parameters())  # a tied matrix once\n        if p.requires_grad and p.dim() == 2 and id(p) not in excluded\n    ]\n",
        "    return [\n        p\n        for p in dict.fromkeys(model.parameters())  # a tied matrix once\n        if p.requires_grad and p.dim() == 2]\n",
    ),
    Bug(
        "muon_at_adamws_rate",
        "--muon-lr is ignored: the matrices run at --lr",
        "nanolm/step.py",
        'group["lr"] = lr * group.get("lr_ratio", 1.0)',
        'group["lr"] = lr * 1.0',
    ),
    Bug(
        "muon_momentum_ignored",
        "--muon-momentum is ignored: Muon keeps PyTorch's 0.95 (the speedruns need 0.9)",
        "nanolm/optim.py",
        "muon_lr=o.muon_lr, momentum=o.muon_momentum)",
        "muon_lr=o.muon_lr)",
    ),
    Bug(
        "muon_state_counted_as_adamws",
        "the memory check refuses a Muon run that fits: it counts AdamW's two moments",
        "nanolm/run/directory.py",
        "        check_memory(\n            cfg.model.gpt_config(data.tokenizer.vocab_size),\n            precision,\n            dist,\n            t.batch_size,\n            windows,\n            cfg.optim.optimizer,\n            grad_accum=t.grad_accum,\n        )\n",
        "        check_memory(\n            cfg.model.gpt_config(data.tokenizer.vocab_size),\n            precision,\n            dist,\n            t.batch_size,\n            windows, grad_accum=t.grad_accum,\n        )\n",
        tests=("test_plan",),
    ),
    Bug(
        "muon_momentum_not_restored",
        "a resumed Muon run restarts its momentum from zero",
        "nanolm/optim.py",
        '        self.muon.load_state_dict(state["muon"])\n',
        "        pass\n",
        tests=("test_checkpoint",),
    ),
    Bug(
        "grouped_muon_one_norm_for_all",
        "Muon's batched iteration scales all matrices of a shape by one norm: each update is mis-sized",
        "nanolm/optim.py",
        "torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)",
        "torch.linalg.vector_norm(x)",
    ),
    Bug(
        "grouped_muon_newton_schulz_step_short",
        "GroupedMuon's iteration stops one step early: updates less orthogonal than "
        "PyTorch's Muon, a run that trains a little worse",
        "nanolm/optim.py",
        "    for _ in range(steps):\n",
        "    for _ in range(steps - 1):\n",
    ),
    Bug(
        "posix_only_import_in_the_meter",
        "nanolm cannot even be imported on Windows: the step meter imports "
        "``resource`` at module level, which only POSIX has; nothing on Linux notices",
        "nanolm/watch/meter.py",
        "import os\nimport sys\n",
        "import os\nimport resource  # noqa: F401\nimport sys\n",
    ),
    Bug(
        "muon_in_bf16_without_bf16_units",
        "Muon's iteration runs in bf16 on a CPU that emulates it: seconds per step",
        "nanolm/optim.py",
        'return torch.float32 if device.type == "cpu" and not cpu_has_native_bf16() else torch.bfloat16',
        "return torch.bfloat16",
    ),
    Bug(
        "doctor_without_compressor_bounds",
        "nanolm doctor stops reporting the xz bound a trained model must beat",
        "nanolm/data/prepare.py",
        "log=print, compressor_bounds: bool = True)",
        "log=print, compressor_bounds: bool = False)",
    ),
    Bug(
        "quick_exit_skips_finalizers",
        "the command ends without finalizing garbage in reference cycles: whatever "
        "their __del__ would flush or close is lost",
        "nanolm/instruments/process.py",
        "    gc.collect()\n    gc.freeze()\n",
        "    gc.freeze()  # nothing collected first\n",
    ),
    Bug(
        "thread_trial_draws_the_steps_dropout",
        "--threads auto's trial passes consume the random state: the step's dropout differs",
        "nanolm/machine/threads.py",
        "        torch.set_rng_state(rng)  #",
        "        pass  #",
    ),
    Bug(
        "bf16_on_every_cpu",
        "--precision auto picks bf16 on CPUs without bf16 units, where it is emulated and far slower",
        "nanolm/precision.py",
        '        if kind == "cpu" and cpu_has_native_bf16():\n            return Precision(\n                "bf16",\n                kind,\n                "auto: this CPU multiplies bf16 natively, where bf16 reached both speedrun "\n                "targets sooner than fp32 with the same final loss "\n                "(docs/precision.md); weights stay fp32; --precision fp32 to override",\n            )\n',
        '        if kind == "cpu":\n            return Precision(\n                "bf16",\n                kind,\n                "auto: this CPU multiplies bf16 natively, where bf16 reached both speedrun "\n                "targets sooner than fp32 with the same final loss "\n                "(docs/precision.md); weights stay fp32; --precision fp32 to override",\n            )\n',
    ),
    Bug(
        "no_step0_row_without_its_evaluation",
        "--no-eval-at-start also drops the step-0 recipe: diagnose can no longer read the run's setup",
        "nanolm/watch/observer.py",
        "self.record(self.judged({**row, **evaluation}) if evaluation else row)",
        'self.record(self.judged({**row, **evaluation}) if evaluation else {"step": 0})',
    ),
    Bug(
        "seed_counts_in_the_setup",
        "the seed counts as part of a run's setup: no run of another seed is recognised "
        "as its recipe, and every band check is silently skipped",
        "nanolm/watch/reference.py",
        'NOT_COUNTED = {\n    # what does not change the numbers a run trains through: the seed (the band is over seeds),\n    # where it writes and reads from (the data itself is counted, by its digest), what it logs\n    # and when, how fast it runs, and when it stops early\n    "train": {\n        "seed",\n        "out_dir",\n        "log",\n        "log_every",\n        "stats_every",\n        "progress",\n        "threads",\n        "process_tuning",\n        "resume",\n        "keep",\n        "ckpt_every",\n        "eval_every",\n        "eval_at_start",\n        "sample_tokens",\n        "peak_flops",\n        "target_val_bpb",\n        "device",\n        "deterministic",\n        "tf32",\n        "dist",\n        "eval_batches",\n        "eval_windows",  # as run.val_windows\n        "precision",\n    },  # as run.precision, what it resolved to: "auto" and "fp32" are one format on such a CPU\n    "data": {"data"},\n    "model": {"loss_chunk"},  # how the head and loss are computed, not what\n}\n',
        'NOT_COUNTED = {\n    # what does not change the numbers a run trains through: the seed (the band is over seeds),\n    # where it writes and reads from (the data itself is counted, by its digest), what it logs\n    # and when, how fast it runs, and when it stops early\n    "train": {"out_dir",\n        "log",\n        "log_every",\n        "stats_every",\n        "progress",\n        "threads",\n        "process_tuning",\n        "resume",\n        "keep",\n        "ckpt_every",\n        "eval_every",\n        "eval_at_start",\n        "sample_tokens",\n        "peak_flops",\n        "target_val_bpb",\n        "device",\n        "deterministic",\n        "tf32",\n        "dist",\n        "eval_batches",\n        "eval_windows",  # as run.val_windows\n        "precision",\n    },  # as run.precision, what it resolved to: "auto" and "fp32" are one format on such a CPU\n    "data": {"data"},\n    "model": {"loss_chunk"},  # how the head and loss are computed, not what\n}\n',
    ),
    Bug(
        "band_is_the_seeds_extremes",
        "a band is the seeds' lowest and highest values only: a new healthy seed is "
        "outside at one point in three, and nanolm cries wolf on healthy runs",
        "nanolm/watch/reference.py",
        "widen = max(WIDEN * spread, floor, ABSOLUTE_FLOOR.get(key, 0.0))",
        "widen = 0.0",
    ),
    Bug(
        "band_floor_of_the_median",
        "a band's least width is a share of the seeds' median: a seed added below the others "
        "narrows the band, and a run inside the band of five seeds is outside that of six",
        "nanolm/watch/reference.py",
        "size = max(abs(values[0]), abs(values[-1]))",
        "size = abs(median)",
    ),
    Bug(
        "debug_switches_count_in_the_setup",
        "a run broken by a lab switch is not recognised as its recipe: the band never sees the bugs it exists to catch",
        "nanolm/watch/reference.py",
        'NOT_COUNTED = {\n    # what does not change the numbers a run trains through: the seed (the band is over seeds),\n    # where it writes and reads from (the data itself is counted, by its digest), what it logs\n    # and when, how fast it runs, and when it stops early\n    "train": {\n        "seed",\n        "out_dir",\n        "log",\n        "log_every",\n        "stats_every",\n        "progress",\n        "threads",\n        "process_tuning",\n        "resume",\n        "keep",\n        "ckpt_every",\n        "eval_every",\n        "eval_at_start",\n        "sample_tokens",\n        "peak_flops",\n        "target_val_bpb",\n        "device",\n        "deterministic",\n        "tf32",\n        "dist",\n        "eval_batches",\n        "eval_windows",  # as run.val_windows\n        "precision",\n    },  # as run.precision, what it resolved to: "auto" and "fp32" are one format on such a CPU\n    "data": {"data"},\n    "model": {"loss_chunk"},  # how the head and loss are computed, not what\n}\nSECTIONS_NOT_COUNTED = (\n    "guard",\n    "debug",\n)  # the guard acts only on trouble; debug switches are bugs, which bands exist to catch\n',
        'NOT_COUNTED = {\n    # what does not change the numbers a run trains through: the seed (the band is over seeds),\n    # where it writes and reads from (the data itself is counted, by its digest), what it logs\n    # and when, how fast it runs, and when it stops early\n    "train": {\n        "seed",\n        "out_dir",\n        "log",\n        "log_every",\n        "stats_every",\n        "progress",\n        "threads",\n        "process_tuning",\n        "resume",\n        "keep",\n        "ckpt_every",\n        "eval_every",\n        "eval_at_start",\n        "sample_tokens",\n        "peak_flops",\n        "target_val_bpb",\n        "device",\n        "deterministic",\n        "tf32",\n        "dist",\n        "eval_batches",\n        "eval_windows",  # as run.val_windows\n        "precision",\n    },  # as run.precision, what it resolved to: "auto" and "fp32" are one format on such a CPU\n    "data": {"data"},\n    "model": {"loss_chunk"},  # how the head and loss are computed, not what\n}\nSECTIONS_NOT_COUNTED = (\n    "guard",)  # the guard acts only on trouble; debug switches are bugs, which bands exist to catch\n',
    ),
    Bug(
        "compare_takes_drift_for_a_parting",
        "nanolm compare calls two splits of one batch different once rounding "
        "has grown: the course's accumulation exercise fails on correct code",
        "nanolm/instruments/compare.py",
        "if previous >= DRIFT:",
        "if False:",
    ),
    Bug(
        "lab_child_refused_inside_the_lab",
        "a process the lock's holder started is refused inside the holder's "
        "directory: nanolm lab's resume variant dies in its first part, and the lab reports a variant it never ran",
        "nanolm/base/lock.py",
        "holder not in _this_process_or_its_parent()",
        "holder != _this_process()",
    ),
    Bug(
        "threads_switch_on_noise",
        "--threads auto switches for any gain, so an idle run's count (and arithmetic) wanders",
        "nanolm/machine/threads.py",
        "times[best] < (1 - SWITCH_GAIN) * base",
        "times[best] < base",
    ),
    # crash points: a multi-step file operation stopped (or failed) at any one of its disk steps
    Bug(
        "checkpoint_discarded_in_place",
        "an old checkpoint is deleted where it lies: a kill half-way leaves a "
        "committed-looking checkpoint with files missing, which a resume or `nanolm sample` then meets",
        "nanolm/checkpoint.py",
        '        aside = disk.make_scratch_dir(path.parent, f".tmp-discarded-{path.name}-")\n        replace(path, aside)',
        "        aside = path",
        tests=("test_crash_points",),
    ),
    Bug(
        "prepared_data_swapped_by_deleting_first",
        "prepare removes the old data before it renames the new in: a "
        "kill between the two leaves neither, and every run on --out stops",
        "nanolm/base/files.py",
        "    if not target.exists():\n        replace(staging, target)",
        "    if not target.exists() or disk.remove_tree(target) is None:\n        replace(staging, target)",
        tests=("test_crash_points",),
    ),
    Bug(
        "scratch_of_another_output_removed",
        "prepare --out data removes the scratch directory of a prepare into "
        "data.prepare-v2 running beside it (its name starts the same way): that one fails half-way",
        "nanolm/base/lock.py",
        "        if not (entry.name.startswith(prefix) and _SCRATCH_TOKEN.fullmatch(entry.name[len(prefix) :])):\n",
        "        if not (entry.name.startswith(prefix) and True):\n",
        tests=("test_crash_points",),
    ),
    Bug(
        "abandoned_export_kept",
        "an export killed half-way leaves a copy of the model beside --out that no rerun "
        "removes: every killed export costs a model's size of disk",
        "nanolm/instruments/export.py",
        '        remove_abandoned_scratch(out, "export")\n',
        "        pass\n",
        tests=("test_crash_points",),
    ),
    Bug(
        "live_scratch_taken_for_abandoned",
        "a second export into the same --out removes the first one's scratch "
        "directory while it writes: the first fails half-way",
        "nanolm/base/lock.py",
        "if entry.is_symlink() or not entry.is_dir() or _held(path):",
        "if entry.is_symlink() or not entry.is_dir():",
        tests=("test_crash_points",),
    ),
    Bug(
        "prepare_without_its_lock",
        "a second prepare into the --out a live prepare writes is not refused: it removes the live "
        "one's scratch directory (not flock-held where a directory cannot be locked: NFS, Windows) as "
        "abandoned, and the live prepare fails half-way",
        "nanolm/instruments/cli.py",
        '        lock.take(args.out, flag="--out")\n',
        "        pass\n",
        tests=("test_run_lock",),
    ),
    Bug(
        "killed_pointer_writes_kept",
        "every run killed while it moved checkpoints/latest leaves a temporary file there for ever",
        "nanolm/checkpoint.py",
        "    remove_abandoned_writes(Path(run_dir) / CHECKPOINTS, [LATEST])\n",
        "    pass\n",
        tests=("test_crash_points",),
    ),
    Bug(
        "final_claim_kept_while_weights_change",
        "a finished run continued for more steps keeps its final.json "
        "while the new final weights are written: killed then, it claims weights it no longer has",
        "nanolm/run/final.py",
        "    disk.remove(run_dir / FINAL, missing_ok=True)\n    remove_abandoned_writes(",
        "    remove_abandoned_writes(",
        tests=("test_crash_points",),
    ),
    Bug(
        "step_around_the_ground_floor",
        "a file operation changes the disk around nanolm.base.disk: none of the "
        "crash-point tests can stop it there, so a crash at that step is never examined",
        "nanolm/instruments/export.py",
        "        disk.chmod(staging, 0o755)",
        "        staging.chmod(0o755)",
        tests=("test_crash_points",),
    ),
    Bug(
        "compare_blind_to_nan",
        "nanolm compare of a run that went NaN and a healthy one compares the finite steps "
        "before it and calls the two runs equal (exit 0)",
        "nanolm/instruments/compare.py",
        '    broken = first_non_finite_difference(a.rows, b.rows, ("loss", "val_loss", "grad_norm"))',
        "    broken = None",
        tests=("test_compare",),
    ),
    Bug(
        "large_entropy_file_dropped",
        "the loss floor of a large stories corpus silently disappears: its entropy "
        "file (one number per story) passes the size a metadata file may have",
        "nanolm/data/prepare.py",
        "max_bytes=max(MAX_METADATA_BYTES, source.stat().st_size)",
        "max_bytes=MAX_METADATA_BYTES",
        tests=("test_data",),
    ),
    Bug(
        "other_data_named_by_its_scratch_directory",
        "`--resume CKPT` with other data says that a temporary "
        "directory, gone by the time it is read, is not the checkpoint's data, instead of naming --data",
        "nanolm/run/resume.py",
        '        refused.append(\n            f"data: {cfg.data.data or \'the built-in corpus\'} is not the data the checkpoint was trained on "\n            f"(its files differ)"\n        )\n',
        '        refused.append(f"data: {data.dir} is not the data the checkpoint was trained on "\n            f"(its files differ)"\n        )\n',
        tests=("test_run_directory",),
    ),
    Bug(
        "own_lock_taken_for_another",
        "`--resume RUN/checkpoints/step_N --out-dir RUN` (going back to an earlier "
        "checkpoint of the same run) is refused as another run's, because the command's own lock on RUN looks like "
        "another process's",
        "nanolm/base/lock.py",
        "        return None if holder == _this_process() else holder",
        "        return holder",
        tests=("test_run_directory",),
    ),
    Bug(
        "token_ids_past_16_bits_wrap",
        "a vocabulary of 65,537 to 131,072 tokens is stored in 16-bit shards: its "
        "highest ids wrap around to other tokens, and the model trains on the wrong text",
        "nanolm/data/prepare.py",
        "dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32",
        "dtype = np.uint16 if tokenizer.vocab_size <= 1 << 17 else np.uint32",
        tests=("test_data",),
    ),
    Bug(
        "stories_without_validation_called_mismatched",
        "a corpus prepared with no validation stories "
        "(--val-fraction 0) says its entropy file does not match its stories, which it does",
        "nanolm/data/prepare.py",
        "    elif doc_nats is not None and len(doc_nats) != sum(n_docs.values()):",
        "    elif doc_nats is not None:",
        tests=("test_data",),
    ),
    Bug(
        "signal_kills_a_run_preparing_its_data",
        "`kill` or a closed terminal while a run tokenizes its data ends "
        "the process on the spot: a half-prepared corpus stays in the system's temporary directory for ever",
        "nanolm/train.py",
        "            with StopAtOnce(SET_UP_STOPPED):",
        "            with contextlib.nullcontext():",
        tests=("test_terminal",),
    ),
    Bug(
        "killed_prepare_leaves_data_unusable",
        "a prepare killed with kill -9 over prepared data leaves its lock "
        "file there, and every run on that data then refuses it as damaged (a file its manifest does not list)",
        "nanolm/data/shards.py",
        "skip=(META_FILE, LOCK_FILE),",
        "skip=(META_FILE,),",
        tests=("test_crash_points",),
    ),
    Bug(
        "signal_kills_a_finishing_run",
        "`kill` while a run writes its final weights or its sample ends it on the "
        "spot, with no line saying what happened, and a temporary file of the weights left in the run",
        "nanolm/train.py",
        "    with StopAtOnce(FINISH_STOPPED):",
        "    with contextlib.nullcontext():",
        tests=("test_terminal",),
    ),
    Bug(
        "signal_during_a_save_trains_on",
        "a SIGTERM that arrives while a checkpoint is being saved is seen only "
        "after the next step: the run trains a step more and saves again (or, during the last save, finishes and "
        "exits 0 as if no signal came)",
        "nanolm/train.py",
        '                saved = checkpointer.save(step, row.get("val_loss"))\n'
        "                stop_signal = dist.first_signal(stop.requested)",
        '                saved = checkpointer.save(step, row.get("val_loss"))',
        tests=("test_signal_points",),
    ),
    Bug(
        "signal_in_the_first_evaluation_trains_a_step",
        "a stop signal during the first evaluation trains a step and saves it before stopping",
        "nanolm/train.py",
        '        if stop_signal:\n            raise TrainingInterrupted(f"{stop_reason(stop_signal)} {SET_UP_STOPPED}"',
        '        if False:\n            raise TrainingInterrupted(f"{stop_reason(stop_signal)} {SET_UP_STOPPED}"',
        tests=("test_signal_points",),
    ),
    Bug(
        "second_signal_interrupts_the_cleanup",
        "a second signal while a run being set up cleans up after the "
        "first (a launcher forwarding the terminal's Ctrl-C) interrupts that cleanup: a half-made scratch "
        "directory stays, and the status is the second signal's",
        "nanolm/machine/runtime.py",
        "        if self.requested is not None:\n            return\n        self.requested = signum",
        "        self.requested = signum",
        tests=("test_signal_points",),
    ),
    Bug(
        "second_ctrl_c_in_a_burst_abandons_the_save",
        "a Ctrl-C forwarded by a launcher a millisecond after the "
        "terminal's own (or a SIGTERM then a Ctrl-C) stops the run at once, without the checkpoint the first asked "
        "for",
        "nanolm/machine/runtime.py",
        "and self._clock() - self._requested_at > SAME_REQUEST_SECONDS",
        "and True",
        tests=("test_signal_points",),
    ),
    Bug(
        "late_sighup_taken_for_a_second_ctrl_c",
        "a terminal closed while a stopped run saves (after a Ctrl-C, or a scheduler's SIGTERM) "
        "counts as the second Ctrl-C: the run stops at once, without the checkpoint the first asked for",
        "nanolm/machine/runtime.py",
        "            and signum == signal.SIGINT\n",
        "            and signum in (signal.SIGINT, signal.SIGHUP)\n",
        tests=("test_signal_points",),
    ),
    Bug(
        "signal_after_a_stop_kills_the_process",
        "once a stopped run leaves its phase, a further SIGTERM or SIGHUP "
        "gets its default action back and kills the process on the spot: its cleanup and its line are lost, and the "
        "status is the second signal's",
        "nanolm/machine/runtime.py",
        "        quiet = StopSignals.quiet_after_stop and stopping",
        "        quiet = False",
        tests=("test_signal_points",),
    ),
    Bug(
        "outer_phase_forgets_the_stop",
        "a stop raised in the finishing phase (or the first evaluation) leaves the "
        "set-up phase around it, which puts the default handlers back: a second SIGTERM while the process exits "
        "kills it on the spot, with the second signal's status and no line",
        "nanolm/machine/runtime.py",
        "        stopping = self.requested is not None or isinstance(passing, (TrainingInterrupted, StoppedAtOnce))",
        "        stopping = self.requested is not None",
        tests=("test_signal_points",),
    ),
    Bug(
        "stopped_at_once_with_the_second_signals_status",
        "a run stopped at once by a late Ctrl-C after a "
        "scheduler's SIGTERM exits 130: the scheduler reads that the user interrupted it",
        "nanolm/machine/runtime.py",
        '            raise StoppedAtOnce(\n                f"{stop_reason(signum)} after {stop_reason(self.requested)}: stopped at once, without "\n                f"saving this step; run the same command again to resume from the last checkpoint",\n                self.requested,\n            )\n',
        '            raise StoppedAtOnce(\n                f"{stop_reason(signum)} after {stop_reason(self.requested)}: stopped at once, without "\n                f"saving this step; run the same command again to resume from the last checkpoint",\n                signum)\n',
        tests=("test_signal_points",),
    ),
    Bug(
        "tuner_runs_under_deterministic",
        "--threads auto's tuner also runs under --deterministic: on a busy "
        "machine it switches the thread count, and a kernel whose reduction splits by thread gives other bits than "
        "on an idle one",
        "nanolm/train.py",
        'auto_threads = t.threads == 0 and device.type == "cpu" and not dist.active and not t.deterministic',
        'auto_threads = t.threads == 0 and device.type == "cpu" and not dist.active',
        tests=("test_threads",),
    ),
    Bug(
        "missing_prepared_data_named_as_a_vocabulary_change",
        "a run on prepared data continued after that data "
        "was removed is refused for a changed vocabulary size (the default the missing meta.json leaves), which "
        "sends the user after the wrong option",
        "nanolm/run/directory.py",
        'if refused and cfg.data.data and not Path(cfg.data.data).exists() and not (out_dir / "data").is_dir():',
        "if False:",
        tests=("test_continued_runs",),
    ),
    Bug(
        "damaged_prepared_meta_ignored",
        "prepared data whose meta.json no longer names its tokenizer is read with "
        "the command's tokenizer options: a continued run is refused for a vocabulary size it never asked for",
        "nanolm/run/directory.py",
        '        raise NanolmError(\n            f"prepared data {meta.parent}: its meta.json does not say which tokenizer the shards use "\n            f"(damaged, or not written by nanolm prepare); prepare the data again"\n        )\n',
        "        return\n",
        tests=("test_continued_runs",),
    ),
    Bug(
        "prepare_over_data_a_run_reads",
        "a prepare into the prepared data a live run trains on is accepted: the "
        "run's checkpoints record the old data's digest, and the same command can no longer continue it",
        "nanolm/run/directory.py",
        '        reading.take(cfg.data.data, "--data")',
        "        pass",
        tests=("test_run_lock",),
    ),
    # calibration: a threshold derived by simulation, with a wrong parameter
    Bug(
        "threshold_simulated_for_one_seed_more",
        "the curve test's threshold is simulated as if the reference had one "
        "seed more than it has: with five seeds a healthy run is flagged 3 % of the time, not the 1 % stated",
        "nanolm/watch/curve.py",
        "    threshold = max_t_threshold(cov, len(per_seed), false_alarm, seed, samples)",
        "    threshold = max_t_threshold(cov, len(per_seed) + 1, false_alarm, seed, samples)",
        tests=("test_curve",),
    ),
    Bug(
        "own_seed_threshold_with_one_rerun_more",
        "the own-seed test's threshold is simulated for one rerun more than "
        "measured (the degrees of freedom of a plain t, n + 1 samples for n): healthy reruns flagged too often",
        "nanolm/watch/curve.py",
        "max_t_threshold(cov, len(paired), false_alarm, seed, samples, paired=True",
        "max_t_threshold(cov, len(paired) + 1, false_alarm, seed, samples, paired=True",
        tests=("test_curve",),
    ),
    # hostile input: files nanolm did not write itself, a terminal's signals and pipes, where outputs land
    Bug(
        "refused_prepare_writes_in_place",
        "a prepare refused for a source with no text (or interrupted) has already "
        "emptied the prepared data the user had; training on it then calls its tokenizer corrupt",
        "nanolm/data/prepare.py",
        "_prepare_into(scratch.path, docs, source, request, record,",
        "_prepare_into(out if out.is_dir() else scratch.path, docs, source, request, record,",
    ),
    Bug(
        "prepare_takes_hidden_files_for_its_own",
        "prepare --out DIR, where DIR holds only hidden files (a `git init` made for the data, a "
        ".DS_Store), takes DIR for an empty one and swaps it away for the shards: its repository is gone",
        "nanolm/data/prepare.py",
        "sorted(p.name for p in out.iterdir() if p.name not in (*DATA_FILES, META_FILE, LOCK_FILE))",
        'sorted(p.name for p in out.iterdir() if p.name not in (*DATA_FILES, META_FILE, LOCK_FILE) and not p.name.startswith("."))',
    ),
    Bug(
        "output_inside_prepared_data",
        "an export or a report inside prepared data is accepted, and every run on that data "
        "then refuses it as damaged (a file its manifest does not list)",
        "nanolm/run/directory.py",
        "        if _checked_by_manifest(ancestor):",
        "        if False:",
    ),
    Bug(
        "output_among_a_runs_files",
        "an export into a run's checkpoints/ is accepted, and the run falls back past its newest checkpoint",
        "nanolm/run/directory.py",
        "        if child.name in RUN_FILES and _is_run_directory(ancestor):",
        "        if False:",
    ),
    Bug(
        "closed_output_ends_the_run_unsaved",
        "`nanolm train | head` ends the run at the reader's exit without a checkpoint: "
        "everything since the last one is lost",
        "nanolm/instruments/cli.py",
        "        if StopOnSignal.active is not None:\n            StopOnSignal.active.request(OUTPUT_CLOSED)",
        "        if False:\n            StopOnSignal.active.request(OUTPUT_CLOSED)",
        tests=("test_terminal",),
    ),
    Bug(
        "hung_up_terminal_ends_the_run_unsaved",
        "a run whose SSH session dropped dies on its next line (the terminal's write fails with EIO, "
        "not EPIPE) instead of saving the checkpoint SIGHUP asked for: everything since the last one is lost",
        "nanolm/instruments/cli.py",
        "GONE = {errno.EPIPE, errno.EIO, errno.ECONNRESET}",
        "GONE = {errno.EPIPE, errno.ECONNRESET}",
        tests=("test_terminal",),
    ),
    Bug(
        "sighup_ends_the_run_unsaved",
        "closing the terminal or losing the SSH session ends the run on the spot: everything "
        "since the last checkpoint is lost",
        "nanolm/machine/runtime.py",
        '("SIGINT", "SIGTERM", "SIGHUP")',
        '("SIGINT", "SIGTERM")',
        tests=("test_terminal",),
    ),
    Bug(
        "metrics_rows_trusted",
        "a damaged or crafted row of metrics.jsonl (text where a number goes) reaches diagnose, "
        "compare and a resume, which end in a traceback",
        "nanolm/watch/sinks.py",
        "            ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))",
        "            ok = True",
        tests=("test_hostile_files",),
    ),
    Bug(
        "long_integers_unguarded",
        "a metadata file holding an integer of 5,000 digits (a crafted final.json, a damaged "
        "meta.json) is a ValueError traceback instead of one line and a fallback",
        "nanolm/base/documents.py",
        "    except ValueError as e:  # an integer of more than 4,300 digits",
        "    except MemoryError as e:  # an integer of more than 4,300 digits",
        tests=("test_hostile_files",),
    ),
    Bug(
        "moved_data_refused",
        "a corpus moved to another path cannot continue its run, though the data is compared by content",
        "nanolm/run/resume.py",
        "        return data.digest == digest",
        "        return data.digest == digest[::-1]",
    ),
    Bug(
        "step_trains_without_the_runs_autocast",
        "the training step is built without the run's autocast: a run that says bf16 (what auto picks on a CPU with "
        "bf16 units) trains in fp32, slower, and off the band measured in bf16",
        "nanolm/train.py",
        "        scaler=scaler,\n        autocast=precision.autocast,\n        dist=dist,\n",
        "        scaler=scaler,\n        dist=dist,\n",
        tests=("test_train",),
    ),
    Bug(
        "lock_let_go_before_its_file_is_removed",
        "a run's lock is let go before its lock file is removed: a second writer locking that file in between "
        "believes it holds the directory, its lock file then removed under it, and a third writer passes too",
        "nanolm/base/lock.py",
        "            if fd is not None and (fcntl is not None or dir_fd is not None):",
        "            if fd is not None and (fcntl is not None and dir_fd is not None):",
        tests=("test_run_lock",),
    ),
    Bug(
        "lock_file_of_another_removed",
        "a run directory whose .lock an older nanolm holds: the refusal's cleanup took "
        "the file as its own and removed it (and was a traceback), so the next writer could pass",
        "nanolm/base/lock.py",
        "                fd = _open_lock_file(path)\n                try:  # the file too",
        "                fd = self._fd = _open_lock_file(path)\n                try:  # the file too",
    ),
    Bug(
        "validation_set_counted_in_batches",
        "the validation set is --eval-windows batches of --batch-size: batch 8 "
        "and batch 4 x grad_accum 2 score different windows, and compare cannot put their validation curves side by side",
        "nanolm/train.py",
        "max_windows=t.eval_windows, **pack)",
        "max_windows=t.eval_windows * t.batch_size // 16, **pack)",
    ),
    Bug(
        "curve_threshold_for_one_look",
        "the curve test's threshold is that of one evaluation, yet a run is judged at "
        "every one: healthy runs are flagged more often than the stated 1 %",
        "nanolm/watch/curve.py",
        "largest.append(np.abs(excess / np.sqrt(np.maximum(variance, 1e-30))).max(axis=1))",
        "largest.append(np.abs(excess / np.sqrt(np.maximum(variance, 1e-30)))[:, -1])",
        tests=("test_curve",),
    ),
    Bug(
        "curve_evaluations_taken_as_independent",
        "the curve test averages correlated evaluations as if independent: "
        "its noise looks three times smaller than it is, and a third of healthy runs are called broken",
        "nanolm/watch/curve.py",
        "sd = math.sqrt(max(float(w @ cov[: i + 1, : i + 1] @ w), 1e-30)",
        "sd = math.sqrt(max(float(w**2 @ np.diag(cov[: i + 1, : i + 1])), 1e-30)",
        tests=("test_curve",),
    ),
    Bug(
        "curve_evaluations_weighed_alike",
        "the curve test averages a run's evaluations alike: a departure where healthy "
        "seeds agree within 0.3 % (the end of the default run) is drowned by the middle, where they wander by 5 %, and "
        "a 3 % regression passes among seeds",
        "nanolm/watch/curve.py",
        "    rows = np.tril(np.ones(cov.shape)) / np.maximum(np.sqrt(np.diag(cov)), SPREAD_FLOOR)",
        "    rows = np.tril(np.ones(cov.shape))",
        tests=("test_curve",),
    ),
    Bug(
        "own_seed_curve_ignored",
        "a run of the reference's own seed is judged among the seeds only: a regression of "
        "2 % that its own curve would show hides in the seeds' spread",
        "nanolm/watch/reference.py",
        "        own = reference.seed_curves.looks(seed, values)",
        "        own = []",
        tests=("test_reference",),
    ),
    # edges found by property tests
    Bug(
        "lone_carriage_return_kept_in_documents",
        "a .txt file with old Mac line breaks (\\r): each document keeps "
        "the break before its separator line, so the same text prepares to other tokens than with \\n or \\r\\n",
        "nanolm/data/sources.py",
        '    return text[:-1] if text.endswith(("\\n", "\\r")) else text',
        '    return text[:-1] if text.endswith("\\n") else text',
        tests=("test_data",),
    ),
    Bug(
        "text_read_in_the_locale_encoding",
        "data files opened in the system's encoding (cp1252 on Windows, ASCII "
        "under a C locale): the same corpus prepares to other characters, or is refused, depending on the machine",
        "nanolm/data/sources.py",
        'io.TextIOWrapper(f, encoding="utf-8", newline="")',
        'io.TextIOWrapper(f, newline="")',
        tests=("test_sources",),
    ),
    Bug(
        "single_document_cut_at_its_end_raises",
        "a one-document corpus with a tiny --val-fraction cuts at its last "
        "byte and reads one past it: an IndexError traceback instead of a prepared corpus",
        "nanolm/data/sources.py",
        "    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:",
        "    while cut > 0 and (data[cut] & 0xC0) == 0x80:",
        tests=("test_sources",),
    ),
    Bug(
        "tiny_val_fraction_overflows",
        "--val-fraction 1e-320 (or any share whose inverse overflows a float) "
        "raises OverflowError: a traceback instead of a corpus with its last document held out",
        "nanolm/data/sources.py",
        "    k = max(2, round(min(1 / val_fraction, 2**62))) if val_fraction > 0 else 0",
        "    k = max(2, round(1 / val_fraction)) if val_fraction > 0 else 0",
        tests=("test_sources",),
    ),
    Bug(
        "nul_past_the_head_read_as_text",
        "a text file damaged past its first 8 KiB (NUL bytes from a broken download) trains on the NULs as characters",
        "nanolm/data/sources.py",
        '                if "\\x00" in line:',
        "                if False:",
        tests=("test_sources",),
    ),
    Bug(
        "control_character_written_raw_into_config",
        "a separator or path holding a carriage return is written raw "
        "into config.toml, which TOML forbids: the run cannot be continued (its configuration cannot be read)",
        "nanolm/run/config.py",
        """f"\\\\u{ord(ch):04x}" if (ord(ch) < 0x20 and ch != "\\t") or ord(ch) == 0x7F else ch""",
        """f"\\\\u{ord(ch):04x}" if ch == "\\n" else ch""",
        tests=("test_config",),
    ),
    Bug(
        "integer_past_64_bits_accepted",
        "--steps 10**20 is accepted and written to config.toml, which holds 64-bit "
        "integers: the run's own configuration is then refused as damage on resume",
        "nanolm/run/config.py",
        '                    need(\n                        -LARGEST_INTEGER <= value < LARGEST_INTEGER,\n                        f.name,\n                        value,\n                        "below 2^63 (the run\'s config.toml holds 64-bit integers)",\n                    )\n',
        '                    need(True,\n                        f.name,\n                        value,\n                        "below 2^63 (the run\'s config.toml holds 64-bit integers)",\n                    )\n',
        tests=("test_config",),
    ),
    Bug(
        "compare_pairs_follow_the_first_run",
        "a step logged twice in one run: compare pairs the other run with its "
        "first row when that run is named first and with its last otherwise, so compare A B and compare B A can "
        "disagree",
        "nanolm/instruments/compare.py",
        '    by_step = [{r["step"]: float(r[key]) for r in rows if _number(r.get(key))} for rows in (a, b)]',
        '    by_step = [{r["step"]: float(r[key]) for r in rows if _number(r.get(key))} for rows in (a[::-1], b)]',
        tests=("test_compare",),
    ),
    Bug(
        "band_edge_rounded_inward",
        "a band's edges rounded to nine figures toward its middle: with no spread to "
        "widen it, a seed the band was built from (and a healthy run equal to it) lands outside by rounding",
        "nanolm/watch/reference.py",
        "        lo.append(_round(values[0] - widen, -1))",
        "        lo.append(_round(values[0] - widen))",
        tests=("test_reference",),
    ),
    # edges found by mutation testing (tools/mutation_score.py)
    Bug(
        "guard_scale_forgotten_on_resume",
        "a resumed run's guard starts again at the full learning rate: the "
        "scale that earlier rollbacks lowered (--rollback-lr-scale) is lost with each restart",
        "nanolm/watch/guards.py",
        '        self.rollbacks, self.lr_scale = int(state["rollbacks"]), float(state["lr_scale"])',
        '        self.rollbacks, self.lr_scale = int(state["rollbacks"]), 1.0',
        tests=("test_guards",),
    ),
    Bug(
        "layer_norms_summed_in_bf16",
        "per-layer weight and gradient norms of bf16 weights summed in bf16: off by "
        "parts in a thousand, and the update ratio with them",
        "nanolm/watch/stats.py",
        "    squares = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square()",
        "    squares = torch.stack(torch._foreach_norm(tensors, 2)).square()",
        tests=("test_stats",),
    ),
    Bug(
        "resume_into_an_attempt_said_to_start_at_step_0",
        "--resume PATH into a directory whose attempt never saved "
        "says the run starts again from step 0 while it continues from the checkpoint: the log contradicts the run",
        "nanolm/run/directory.py",
        '        log(\n            f"{plan.out_dir} holds a run that stopped before its first checkpoint was saved; "\n            + (\n                f"its files give way to the run continued from {plan.checkpoint}"\n                if plan.checkpoint is not None\n                else "starting it again from step 0"\n            )\n        )\n',
        '        log(\n            f"{plan.out_dir} holds a run that stopped before its first checkpoint was saved; "\n            + (\n                f"its files give way to the run continued from {plan.checkpoint}"\n                if False\n             else "starting it again from step 0"\n            )\n        )\n',
    ),
    Bug(
        "second_lab_mixes_into_the_first",
        "a second lab or sweep on the same --out trains into the first one's "
        "directories: the report compares runs of two commands as one",
        "nanolm/base/files.py",
        "    taken = [name for name in names if (Path(out) / name).exists()]",
        "    taken = [name for name in names if (Path(out) / name).exists() and False]",
    ),
    # the layout: what a reader (and a plain run) meets
    Bug(
        "faults_imported_by_a_plain_train",
        "every plain nanolm train imports the lab's broken components: the "
        "production path carries the fault models, and their imports, for nothing",
        "nanolm/instruments/cli.py",
        "    if cfg.debug != DebugOptions():",
        "    if True:",
    ),
    Bug(
        "course_name_left_where_it_lives",
        "`from nanolm.train import estimate_loss`, as the course week writes it, "
        "fails: the student's first command is an ImportError",
        "nanolm/train.py",
        "from .evaluate import estimate_loss  # noqa: F401 (the course's name)\n",
        "from .evaluate import estimate_loss as _estimate_loss  # noqa: F401\n",
    ),
    Bug(
        "weights_drawn_in_another_order",
        "a refactor that reorders the model's parameters draws the same "
        "initial distribution in another order: other numbers and a run as good; only numbers compared with before show it",
        "nanolm/model.py",
        "        for name, p in self.named_parameters():\n            if p.dim() < 2:",
        "        for name, p in sorted(self.named_parameters()):\n            if p.dim() < 2:",
        tests=("test_golden",),
    ),
    Bug(
        "norm_epsilon_changed",
        "RMSNorm's epsilon 1e-5 instead of 1e-6 (another library's default, brought in "
        "with a refactor): a run as good, other numbers; only numbers compared with before show it, on any CPU",
        "nanolm/model.py",
        "    norm_eps: float = 1e-6",
        "    norm_eps: float = 1e-5",
        tests=("test_golden",),
    ),
    Bug(
        "output_block_buffered_into_a_pipe",
        "`nanolm train | tee log` shows nothing for minutes, a reader that left "
        "is noticed a buffer later, and the speedrun times each line when a buffer filled: green only where the "
        "shell sets PYTHONUNBUFFERED",
        "nanolm/instruments/cli.py",
        '            stream.reconfigure(errors="replace", line_buffering=True)',
        '            stream.reconfigure(errors="replace")',
        tests=("test_terminal",),
    ),
    Bug(
        "exit_flush_left_to_the_interpreter",
        "text still buffered when a command ends, its reader gone: the "
        'interpreter\'s own flush prints "Exception ignored" and a traceback, exit status 120',
        "nanolm/instruments/cli.py",
        "    sys.exit(_flushed(code))",
        "    sys.exit(code)",
        tests=("test_terminal",),
    ),
    Bug(
        "rerun_floor_ignored",
        "a reference seed's run is held to its reruns' noise on one machine alone: on "
        "another CPU's kernels a healthy run of the default seed is called a regression",
        "nanolm/watch/curve.py",
        "    at_least = np.maximum(sd, floor)",
        "    at_least = sd",
        tests=("test_curve",),
    ),
    Bug(
        "curve_widened_by_the_square_root",
        "a reference widened for other CPUs is widened by the square root of "
        "the measured factor: healthy default runs on a laptop's kernels are still called regressions",
        "nanolm/watch/curve.py",
        "        cov = np.asarray(self.cov_log, dtype=np.float64) * factor**2",
        "        cov = np.asarray(self.cov_log, dtype=np.float64) * factor",
        tests=("test_curve",),
    ),
    Bug(
        "thread_tuner_imports_the_step_again",
        "the machine's room imports the course's step above it: it works, "
        "until the step needs the machine and the two cannot be read, tested or moved apart",
        "nanolm/machine/threads.py",
        "from typing import Callable\n",
        "from typing import Callable\n\nfrom ..step import discarded_pass  # noqa: F401\n",
        tests=("test_layout",),
    ),
    Bug(
        "stuck_loss_without_a_learning_rate_raises",
        "diagnose of a run that logged no learning rate (another "
        "tool's, a trimmed log) whose loss never moved ends in a ValueError traceback instead of naming the stuck loss",
        "nanolm/instruments/diagnose.py",
        """        + (f"the learning rate was {min(lrs):.2e}..{max(lrs):.2e}" if lrs else "no learning rate was logged: check it")""",
        '''        + f"the learning rate was {min(lrs):.2e}..{max(lrs):.2e}"''',
        tests=("test_diagnose",),
    ),
    Bug(
        "spike_in_warmup_called_near_its_end",
        "a loss spike at step 60 of a 200-step warmup is said to come "
        '"near the end of warmup": the reader looks at the wrong part of the schedule',
        "nanolm/instruments/diagnose.py",
        '    elif s["step"] < warm:',
        "    elif False:",
        tests=("test_diagnose",),
    ),
    Bug(
        "readme_tree_names_a_moved_file",
        "the README's map of the files names a module that is not there: the newcomer's first search finds nothing",
        "README.md",
        "    shards.py       the prepared data on disk",
        "    shard.py        the prepared data on disk",
    ),
    Bug(
        "budget_plans_no_final_evaluation",
        "a time-budgeted run plans its steps as if the final evaluation took no time: every run ends "
        "past its budget by one evaluation, and a 60 s record is a 63 s one",
        "nanolm/run/budget.py",
        "fit = math.floor((left - p.eval_s - p.step_s) / per_step)",
        "fit = math.floor((left - p.step_s) / per_step)",
    ),
    Bug(
        "budget_continued_with_its_whole_time",
        "a time-budgeted run stopped and continued forgets the time it had spent: the continued run "
        "gets its whole budget again and ends far past it",
        "nanolm/run/budget.py",
        'state["spent_s"] = self.plan.spent_s + self.clock() - self.started',
        'state["spent_s"] = self.plan.spent_s',
    ),
    Bug(
        "budget_decay_never_drawn_again",
        "once the clock started the decay, a machine that slows down (another job takes a core) keeps "
        "the old line: the run ends past its budget, or is cut off before its rate reached the floor",
        "nanolm/run/budget.py",
        "if end < p.last_step or end > p.last_step",
        "if end > p.last_step",
    ),
    Bug(
        "budget_decay_redrawn_from_the_peak",
        "a decay drawn again mid-way starts from the peak, not from where the rate is: the rate jumps "
        "back up for a few steps, and the loss with it",
        "nanolm/run/budget.py",
        "rate = self.learning_rate(step + 1)",
        "rate = o.lr",
    ),
    Bug(
        "budget_of_zero_taken",
        "--time-budget 0 is taken for a budget: the run measures, then says it is too short, instead "
        "of naming the value as wrong",
        "nanolm/run/config.py",
        "t.time_budget is None or (finite(t.time_budget) and t.time_budget > 0)",
        "t.time_budget is None or (finite(t.time_budget) and t.time_budget >= 0)",
        tests=("test_budget",),
    ),
    Bug(
        "budgeted_run_never_finished",
        "the same command run again after a time-budgeted run ended does not see it finished: it "
        "loads the last checkpoint and writes the final weights again",
        "nanolm/run/directory.py",
        'return final["step"] >= t.steps or reached or spent',
        'return final["step"] >= t.steps or reached',
        tests=("test_budget",),
    ),
    Bug(
        "optimizer_imports_the_compiler",
        "AdamW is PyTorch's own class again: its first call imports torch._dynamo, a compiler the run "
        "never uses, and every command's first step comes about a second later",
        "nanolm/optim.py",
        "class AdamW(WithoutCompileGuards, torch.optim.AdamW):",
        "class AdamW(torch.optim.AdamW):",
        tests=("test_layout",),
    ),
    Bug(
        "cpu_peak_kept_for_every_thread_count",
        "the kept matmul peak ignores the thread count: a run at --threads 1 reads the peak two "
        "threads measured, and its MFU is half what it is",
        "nanolm/machine/hardware.py",
        'key = f"{cpu_model()} | {kernels} | {threads} threads | {dtype} | torch {torch.__version__}"',
        'key = f"{cpu_model()} | {kernels} | {dtype} | torch {torch.__version__}"',
        tests=("test_devices",),
    ),
    Bug(
        "data_cache_ignores_settings",
        "the cache of prepared data keys on the text alone: a run with another vocabulary size (or "
        "tokenizer, or validation share) silently trains on the tokens an earlier run prepared",
        "nanolm/data/cache.py",
        "h.update(json.dumps(settings, sort_keys=True).encode())",
        "pass",
    ),
    Bug(
        "data_cache_trusts_kept_copies",
        "a prepared copy kept in the cache is used unchecked: a flipped bit in its shards trains, "
        "silently, on other tokens",
        "nanolm/data/cache.py",
        "data = PreparedData(out)",
        "data = PreparedData(out, verify=False)",
    ),
    Bug(
        "shard_pages_kept_mapped",
        "the windows' pages of the memory-mapped shard stay mapped: a run's resident memory grows "
        "with its corpus (1.9 GB after 200 steps on a 2 GB shard, against 0.5 GB on 20 MB), and "
        "a machine that should train on a corpus larger than memory swaps or is killed",
        "nanolm/batches.py",
        "let_go_of_pages(self.tokens)",
        "pass",
        tests=("test_data",),
    ),
    Bug(
        "prepare_resumes_in_append_mode",
        "an interrupted prepare continues by appending to its shards, after the piece it wrote but "
        "never recorded: those documents are in the data twice, and the model trains on them twice",
        "nanolm/data/shards.py",
        "self.f = _opened_at(path, self.n_tokens * self.dtype.itemsize)",
        'self.f = disk.create(path, "ab")',
        tests=("test_prepare_resume",),
    ),
    Bug(
        "prepare_resumes_whatever_changed",
        "a prepare continues the pieces of an interrupted one even though the source was edited "
        "meanwhile: the shards hold the old text's first half and the new text's second",
        "nanolm/data/pieces.py",
        "reason = None if progress is None else why_not_the_same(progress, settings, source, code)",
        "reason = None",
        tests=("test_prepare_resume",),
    ),
    Bug(
        "shards_read_in_directory_order",
        "a directory's shards are read in the order the file system lists them: the same corpus "
        "gives another split and other tokens on another machine",
        "nanolm/data/published.py",
        "shards.sort(key=lambda s: s.name)",
        "pass",
        tests=("test_corpus_forms",),
    ),
    Bug(
        "damaged_archive_not_named",
        "a damaged .zst or .gz shard ends the prepare in the decompressor's own exception, a "
        "traceback that names neither the shard nor the fix",
        "nanolm/data/sources.py",
        "if shard.compression and is_damage(e):",
        "if False:",
        tests=("test_corpus_forms",),
    ),
    Bug(
        "busy_output_is_a_traceback",
        "nanolm export or prepare onto a bind mount (a container's volume) ends in EBUSY and a "
        "traceback after all its work, instead of one line naming the mount point and the fix",
        "nanolm/base/files.py",
        "    errno.ENAMETOOLONG,\n    errno.EBUSY,\n}",
        "    errno.ENAMETOOLONG,\n}",
        tests=("test_hostile_outputs",),
    ),
    Bug(
        "stories_written_in_place",
        "nanolm data stories truncates the old corpus before it writes the new: a full disk "
        "leaves half a corpus, or a new corpus beside the old one's entropy (a wrong loss floor)",
        "nanolm/data/corpus.py",
        "atomic_write_all({path: text, entropy_path(path): json.dumps(summary)})",
        "path.write_text(text) and entropy_path(path).write_text(json.dumps(summary))",
        tests=("test_hostile_outputs",),
    ),
    Bug(
        "eval_windows_counted_as_asked",
        "--eval-windows above what the validation split holds is refused for memory the "
        "evaluation never uses (a billion windows: ~1,856 GB)",
        "nanolm/run/directory.py",
        "            t.batch_size,\n            windows,\n",
        "            t.batch_size,\n            t.eval_windows,\n",
        tests=("test_plan",),
    ),
    Bug(
        "evaluation_compiled_too",
        "with --compile the evaluations and samples run the compiled block as well: each is compiled "
        "again for its batch size and every sampled length, tens of seconds of a time budget spent "
        "compiling forward passes that run a few times, and the run trains fewer steps",
        "nanolm/model.py",
        "compiled = self.compiled_block if torch.is_grad_enabled() else None",
        "compiled = self.compiled_block",
    ),
    Bug(
        "model_compiled_whole",
        "--compile compiles the whole model: every block traced and its code generated again, and "
        "the head's loss unrolled chunk by chunk; the same steps, after a compile ~2.3x as long "
        "at the 60 s record's shape, all of it out of a time budget",
        "nanolm/model.py",
        "model.compiled_block = torch.compile(_run_block, dynamic=False, backend=backend)",
        "model.forward = torch.compile(model.forward, dynamic=False, backend=backend)",
    ),
    Bug(
        "early_step_alone_plans_the_run",
        "a time budget prices a step by the recent steps alone from the first: one slow early step "
        "(a compile, another job's burst) is the whole estimate, the decay is drawn to end a step "
        "later, and the run stops at step 3 with an untrained model, inside its budget",
        "nanolm/run/budget.py",
        "self.recent.extend([p.step_s] * ESTIMATE_VOTES)",
        "self.recent.extend([])",
        tests=("test_budget",),
    ),
    Bug(
        "compiled_run_tries_thread_counts",
        "--threads auto tries other thread counts on a --compile run: each count compiles the blocks "
        "again (seconds, tens of seconds on a cold cache), out of a time budget, at every trial",
        "nanolm/train.py",
        "if auto_threads and t.compile:",
        "if False:",
        tests=("test_threads",),
    ),
]

FAST_TESTS = (
    "test_model test_fused_loss test_optim test_data test_train test_tokenizer test_checkpoint test_run_directory test_run_lock "
    "test_untrusted_files test_export test_doctor test_precision test_stats test_sinks test_cli "
    "test_corpus test_guards test_distributed test_replay test_threads test_plan test_devices test_host_reads test_process_tuning "
    "test_layout test_platforms test_full_disk test_reference test_compare test_hostile_files test_terminal test_curve test_config test_sources test_documents test_files test_evaluate test_golden test_diagnose test_crash_points test_signal_points test_continued_runs test_run_plan test_observer test_budget test_data_cache test_corpus_forms test_prepare_resume test_hostile_outputs"
).split()


# where each bug's file belongs, by the start of its path: the test files of that concern, run
# first (the first prefix that matches; every fast test file still runs after them)
CONCERN_TESTS = {
    "nanolm/batches.py": ("test_data", "test_model"),
    "nanolm/model.py": ("test_model", "test_fused_loss"),
    "nanolm/fused_loss.py": ("test_fused_loss", "test_model"),
    "nanolm/step.py": ("test_train", "test_optim"),
    "nanolm/train.py": ("test_train", "test_layout"),
    "nanolm/optim.py": ("test_optim", "test_precision"),
    "nanolm/precision.py": ("test_precision",),
    "nanolm/evaluate.py": ("test_evaluate", "test_train", "test_data"),
    "nanolm/tokenizer.py": ("test_tokenizer",),
    "nanolm/checkpoint.py": ("test_checkpoint", "test_untrusted_files"),
    "nanolm/distributed.py": ("test_distributed",),
    "nanolm/data/sources.py": ("test_sources", "test_data"),
    "nanolm/data/cache.py": ("test_data_cache",),
    "nanolm/data/": ("test_data", "test_corpus", "test_corpus_forms", "test_prepare_resume"),
    "nanolm/run/directory.py": ("test_run_plan", "test_run_directory", "test_run_lock"),
    "nanolm/run/resume.py": ("test_run_directory", "test_checkpoint"),
    "nanolm/base/lock.py": ("test_run_lock", "test_run_directory"),
    "nanolm/base/disk.py": ("test_crash_points", "test_files"),
    "nanolm/base/files.py": ("test_files", "test_full_disk", "test_untrusted_files", "test_checkpoint"),
    "nanolm/base/documents.py": ("test_documents", "test_hostile_files", "test_untrusted_files", "test_checkpoint"),
    "nanolm/run/config.py": ("test_config", "test_cli"),
    "nanolm/run/plan.py": ("test_plan",),
    "nanolm/run/budget.py": ("test_budget",),
    "nanolm/run/": ("test_checkpoint", "test_cli"),
    "nanolm/machine/threads.py": ("test_threads",),
    "nanolm/machine/": ("test_devices",),
    "nanolm/watch/reference.py": ("test_reference", "test_compare"),
    "nanolm/watch/curve.py": ("test_curve", "test_reference"),
    "nanolm/watch/guards.py": ("test_guards",),
    "nanolm/watch/observer.py": ("test_observer", "test_sinks", "test_train"),
    "nanolm/watch/": ("test_stats", "test_sinks", "test_host_reads", "test_platforms"),
    "nanolm/instruments/compare.py": ("test_compare",),
    "nanolm/instruments/diagnose.py": ("test_diagnose",),
    "nanolm/instruments/trained.py": ("test_evaluate", "test_cli"),
    "nanolm/instruments/doctor.py": ("test_doctor",),
    "nanolm/instruments/replay.py": ("test_replay",),
    "nanolm/instruments/process.py": ("test_process_tuning",),
    "nanolm/instruments/": ("test_cli", "test_layout"),
    "README.md": ("test_layout",),
}


def tests_for(bug: Bug, tests: list[str]) -> list[str]:
    """``tests`` in the order a bug meets them: its own, then its concern's (those of them in
    ``tests``), then the rest."""
    concern = next((t for prefix, t in CONCERN_TESTS.items() if bug.file.startswith(prefix)), ())
    first = [t for t in dict.fromkeys(bug.tests + concern) if t in tests]
    return first + [t for t in tests if t not in first]


@functools.lru_cache(maxsize=256)  # each file is read for many bugs
def _tokens(text: str) -> tuple[tuple[str, int, int], ...]:
    """``text``'s Python tokens as (what, start, end) character offsets, without what a formatter
    changes: layout (spaces, line breaks, indentation), comments, a trailing comma before a
    closing bracket, and the quotes of a string (strings and numbers compare by value). A
    fragment that ends inside brackets is read up to where it ends."""
    import ast
    import io
    import tokenize

    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    found = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (
                tokenize.NL,
                tokenize.NEWLINE,
                tokenize.INDENT,
                tokenize.DEDENT,
                tokenize.COMMENT,
                tokenize.ENDMARKER,
            ):
                continue
            what = tok.string
            if tok.type in (tokenize.STRING, tokenize.NUMBER):
                try:
                    what = repr(ast.literal_eval(tok.string))
                except (ValueError, SyntaxError):  # an f-string: its quotes as the file has them
                    what = tok.string.replace("'", '"')
            found.append((what, starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1]))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # a fragment: its tokens up to where it stops
    closing = (")", "]", "}")
    return tuple(
        t for i, t in enumerate(found) if not (t[0] == "," and i + 1 < len(found) and found[i + 1][0] in closing)
    )


PARENS = ("(", ")")  # a formatter adds or drops them around an expression it wraps: not compared


def _matches(text: str, anchor: str) -> list[list[int]]:
    """Every place ``anchor``'s tokens are in ``text``'s: for each, the index of each of the
    anchor's tokens among the text's. The text may have more parentheses than the anchor (a
    formatter wrapped a long line in them; they are skipped), never other tokens."""
    want, every = [t[0] for t in _tokens(anchor)], _tokens(text)
    if not [w for w in want if w not in PARENS]:
        return []
    found = []
    for start in (k for k, t in enumerate(every) if t[0] == want[0]):
        at, i, j = [], 0, start
        while i < len(want) and j < len(every):
            if want[i] == every[j][0]:
                at.append(j)
                i, j = i + 1, j + 1
            elif every[j][0] in PARENS:  # a parenthesis the formatter added
                j += 1
            else:
                break
        if i == len(want):
            found.append(at)
    return found


def locate(text: str, anchor: str, python: bool = True) -> list[tuple[int, int]]:
    """Where ``anchor`` is in ``text``, as (start, end) character offsets: every place. For a
    Python file, by its tokens (:func:`_tokens`), so that reformatting the file (a formatter's
    quotes, line breaks, parentheses, trailing commas) does not lose it. Elsewhere (the README),
    by its exact text."""
    if not python:
        spans, at = [], text.find(anchor)
        while at >= 0:
            spans.append((at, at + len(anchor)))
            at = text.find(anchor, at + 1)
        return spans
    every = _tokens(text)
    return [(every[at[0]][1], every[at[-1]][2]) for at in _matches(text, anchor)]


def planted(text: str, bug: Bug) -> str:
    """``text`` (the file ``bug.file``) with the bug planted. In a Python file, the tokens that
    ``bug.broken`` changes of ``bug.correct`` (what lies between the tokens the two share at their
    start and at their end) are found by their tokens and replaced, whatever the file's layout
    around them; elsewhere the exact text."""
    python = bug.file.endswith(".py")
    spans = locate(text, bug.correct, python)
    if len(spans) != 1:
        raise SystemExit(
            f"error: {bug.name}: the code to break is found {len(spans)} times in {bug.file}, not "
            f"once; update BUGS in {Path(__file__).name}"
        )
    if not python:
        start, end = spans[0]
        return text[:start] + bug.broken + text[end:]
    (at,), a, b, every = _matches(text, bug.correct), _tokens(bug.correct), _tokens(bug.broken), _tokens(text)
    shared = min(len(a), len(b))
    head = 0
    while head < shared and a[head][0] == b[head][0]:
        head += 1
    tail = 0
    while tail < shared - head and a[-1 - tail][0] == b[-1 - tail][0]:
        tail += 1
    changed = at[head : len(a) - tail]
    # the file's text from the end of the last shared token (or the first changed one) to the
    # start of the first shared token after (or the end of the last changed one), replaced by
    # the broken text between the same tokens
    added = {j for j, t in enumerate(every) if t[0] in PARENS} - set(at)  # the formatter's own: kept
    if head:
        last = at[head - 1]
        while last + 1 in added:
            last += 1
        start = every[last][2]
    else:
        start = every[changed[0]][1] if changed else every[at[0]][1]
    if tail:
        first = at[len(a) - tail]
        while first - 1 in added and every[first - 1][1] >= start:
            first -= 1
        end = every[first][1]
    else:
        end = every[changed[-1]][2] if changed else start
    new_start = b[head - 1][2] if head else b[0][1]
    new_end = b[len(b) - tail][1] if tail else b[-1][2]
    return text[:start] + bug.broken[new_start:new_end] + text[end:]


def plant(copy: Path, bug: Bug) -> str:
    """Write the broken code into the copy; returns the original file text."""
    path = copy / bug.file
    text = path.read_text()
    path.write_text(planted(text, bug))
    return text


def caught_by(copy: Path, tests: list[str], timeout: int) -> tuple[str | None, float]:
    """The first failing test on the copy (None: the bug survived or the run timed out), and
    the seconds it took."""
    env = {**os.environ, "PYTHONPATH": str(copy)}  # ahead of an editable install of the real tree
    start = time.perf_counter()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *[f"tests/{t}.py" for t in tests]],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:  # not a catch: a test that hangs names nothing
        return None, time.perf_counter() - start
    seconds = time.perf_counter() - start
    if result.returncode == 0:
        return None, seconds
    failed = [line.split(" ")[1] for line in result.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return (failed[0] if failed else f"(pytest exit {result.returncode})"), seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated bug names (default: all)")
    p.add_argument("--tests", default=",".join(FAST_TESTS), help="test files to run, without .py")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per planted bug")
    p.add_argument("--list", action="store_true", help="list the bugs and exit")
    p.add_argument(
        "--reformat",
        action="store_true",
        help="reformat the copy's package with black before planting: a bug is found by its tokens, not its layout",
    )
    args = p.parse_args()
    if args.list:
        for bug in BUGS:
            print(f"{bug.name:40s} {bug.file:22s} {bug.effect}")
        return 0
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - {b.name for b in BUGS})
    if unknown:
        raise SystemExit(f"error: unknown bug {unknown[0]!r}; see --list")
    tests = [t for t in args.tests.split(",") if t]
    missing = [t for t in tests if not (ROOT / "tests" / f"{t}.py").is_file()]
    if not tests:
        raise SystemExit("error: --tests is empty; give test file names like test_train,test_data")
    if missing:  # else pytest's "file not found" would count as every bug caught
        raise SystemExit(f"error: no test file tests/{missing[0]}.py; --tests takes names like test_train")
    chosen = [b for b in BUGS if not only or b.name in only]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "nanolm"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "runs", "*.egg-info", "__pycache__"))
        if args.reformat:
            subprocess.run([sys.executable, "-m", "black", "-q", str(copy / "nanolm")], check=True)
        for bug in chosen:
            original = plant(copy, bug)
            try:
                test, seconds = caught_by(copy, tests_for(bug, tests), args.timeout)
            finally:
                (copy / bug.file).write_text(original)
            results.append({"bug": bug.name, "caught_by": test, "seconds": round(seconds)})
            print(f"{bug.name:40s} {'caught by ' + test if test else 'SURVIVED':60s} {seconds:5.0f} s", flush=True)
    survivors = [r["bug"] for r in results if r["caught_by"] is None]
    print(json.dumps({"planted": len(results), "survived": survivors}))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
