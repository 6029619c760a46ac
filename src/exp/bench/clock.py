"""The clock of exp's side: a Lightning callback that times each optimiser step as the hand-written loop times its
steps, and keeps what the bench compares (losses, real tokens, LoRA fingerprint and B norm, peak memory)."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from exp.bench.baseline_loop import lora_b_norm, lora_fingerprint
from exp.bench.profile import PROFILED_STEPS, start_profiler, stop_profiler


class StepClock(L.Callback):
    """Times each optimiser step between device synchronisations, as the baseline does.

    An optimiser step of `accumulate` micro-batches is timed from the start of its first to the end of its last;
    its real (non-padding) input tokens are counted on the host (QLoRAModule counts them before the transfer) and
    its loss is the mean of its micro-batches' losses. With `profile`, the first two timed steps run under
    torch.profiler (their times are kept, but the profiler slows them: profile in a separate run from timing).

    Started before the module's own `on_train_batch_start` and stopped after the optimiser step (and Lightning's
    progress bar / logging of that step), so exp's per-step bookkeeping is inside the measured time. It keeps the
    losses as tensors (read once, after training), the LoRA fingerprint at the start of training, the LoRA B norm at
    the end, and the peak memory at the end of the last step (before Lightning's end-of-training checkpoint).
    """

    def __init__(self, warmup: int, cuda: bool, accumulate: int = 1, profile: bool = False) -> None:
        self.warmup, self.cuda, self.accumulate, self.profiled = warmup, cuda, accumulate, profile
        self.step_s: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.fingerprint: str | None = None
        self.b_norm: float | None = None
        self.peak: int | None = None  # max_memory_allocated at the end of the last step (CUDA)
        self.real_tokens: list[int] = []
        self._t0 = 0.0
        self._tokens = 0
        self._step_losses: list[torch.Tensor] = []
        self.profile: dict[str, Any] | None = None
        self._profiler = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_start(self, trainer, pl_module) -> None:
        self.fingerprint = lora_fingerprint(pl_module.model)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._tokens += pl_module._batch_tokens
        if batch_idx % self.accumulate:
            return  # mid-step
        if batch_idx == self.warmup * self.accumulate and self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._sync()
        if self.profiled and batch_idx == self.warmup * self.accumulate:
            self._profiler = start_profiler(self.cuda)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning divides the returned loss by `accumulate`; the micro-batch's own loss is logged unscaled.
        self._step_losses.append(outputs["loss"].detach() * self.accumulate)
        if (batch_idx + 1) % self.accumulate:
            return
        self._sync()
        self.step_s.append(time.perf_counter() - self._t0)
        self.losses.append(torch.stack(self._step_losses).mean())
        self.real_tokens.append(self._tokens)
        # Into the worker's log (outside the timed span): how far a run stopped by a time limit got.
        print(f"exp.bench: step {len(self.step_s)}: {self.step_s[-1]:.3f} s, {self._tokens} real tokens", flush=True)
        self._step_losses, self._tokens = [], 0
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated()
        if self._profiler is not None and batch_idx + 1 == (self.warmup + PROFILED_STEPS) * self.accumulate:
            self.profile = stop_profiler(self._profiler, self.cuda, self.step_s[-PROFILED_STEPS:])
            self._profiler = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.b_norm = lora_b_norm(pl_module.model)
