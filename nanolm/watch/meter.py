"""The step meter: the figures of every logged step, read from the device in one transfer.

Loss, learning rate, gradient norm, whether the step was clipped, throughput, MFU, elapsed time
and ETA, memory. The loss and the gradient norm live on the accelerator; reading them waits for
it to finish its queued work (a host sync). The meter reads everything it needs in *one*
transfer, on logged steps only; between logs it only adds to a counter that stays on the device.
MFU is measured against ``nanolm.machine.hardware``'s peak for the device and the arithmetic in use.
"""

from __future__ import annotations

import os
import sys
import time

import torch


def process_rss_mb() -> float:
    """Resident memory of this process in MiB (current on Linux and Windows; the peak on a Mac)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource  # POSIX only
    except ImportError:  # Windows: psutil, a dependency there only
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


class StepMeter:
    """The figures of every logged step, read from the device in one transfer.

    ``count_clipped`` runs every step and stays on the device; ``row`` runs on logged
    steps: one ``tolist()`` brings back the loss, the gradient norm and the number of clipped
    steps together. Throughput is measured over the window since the previous :meth:`lap`,
    which the loop calls after logging (and evaluating), so evaluation time is not counted
    as training time. Elapsed time and ETA include everything.
    """

    def __init__(
        self,
        total_steps: int,
        tokens_per_step: int,
        flops_per_token: int,
        peak: float | None,
        clip: float,
        device: torch.device,
        start_step: int = 0,
        clipped_steps: int = 0,
        elapsed_s: float = 0.0,
        host_values: bool = False,
    ):
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.flops_per_token, self.peak, self.clip = flops_per_token, peak, clip
        self.device = torch.device(device)
        # With a guard that reads every step's loss and norm (``host_values``), the count lives
        # on the host; otherwise on the device, so that counting needs no read.
        self.host_values = host_values
        self.set_clipped_steps(clipped_steps)
        self.started = time.perf_counter()
        self.elapsed_before = elapsed_s  # time spent by the processes this run resumed from
        self.start_step = start_step
        self.last_time, self.last_step = self.started, start_step
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def set_clipped_steps(self, count: int) -> None:
        """Start counting from ``count`` clipped steps (a resume, or a rollback to a checkpoint)."""
        self.clipped_steps = float(count) if self.host_values else torch.tensor(float(count), device=self.device)

    def count_clipped(self, grad_norm: torch.Tensor) -> None:
        """Add this step to the count of clipped steps (no host sync)."""
        if self.clip > 0 and self.host_values:
            self.clipped_steps += float(grad_norm > self.clip)
        elif self.clip > 0:
            self.clipped_steps += (grad_norm > self.clip).to(self.clipped_steps.dtype)

    def row(self, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor) -> dict:
        if self.host_values:
            loss_v, norm_v, clipped_v = float(loss), float(grad_norm), self.clipped_steps
        else:
            loss_v, norm_v, clipped_v = torch.stack(
                [loss.detach().float(), grad_norm.detach().float().to(loss.device), self.clipped_steps.to(loss.device)]
            ).tolist()
        now = time.perf_counter()
        tokens_per_sec = (step - self.last_step) * self.tokens_per_step / max(now - self.last_time, 1e-9)
        this_process = now - self.started
        row = {
            "step": step,
            "loss": loss_v,
            "lr": lr,
            "grad_norm": norm_v,
            "clipped": self.clip > 0 and norm_v > self.clip,
            "clipped_steps": int(clipped_v),
            "clipped_frac": clipped_v / max(step, 1),
            "tokens_per_sec": tokens_per_sec,
        }
        if self.peak:
            achieved = tokens_per_sec * self.flops_per_token
            if achieved > self.peak:  # the peak was measured low (a busy CPU at start-up): it is the
                self.peak = achieved  # most this machine has been seen to do, so it rises to this
                row["peak_flops"] = achieved
            row["mfu"] = achieved / self.peak
        row["elapsed_s"] = self.elapsed_before + this_process
        row["eta_s"] = this_process / max(step - self.start_step, 1) * (self.total_steps - step)
        row["rss_mb"] = process_rss_mb()
        if self.device.type == "cuda":
            row["cuda_max_alloc_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return row

    def elapsed(self) -> float:
        """Seconds of training so far, over every process of a resumed run."""
        return self.elapsed_before + time.perf_counter() - self.started

    def lap(self, step: int) -> None:
        """Start the next throughput window here."""
        self.last_time, self.last_step = time.perf_counter(), step

    def constants(self) -> dict:
        """The run's fixed figures, recorded once in the step-0 row."""
        return {
            "tokens_per_step": self.tokens_per_step,
            "flops_per_token": self.flops_per_token,
            "peak_flops": self.peak,
        }
