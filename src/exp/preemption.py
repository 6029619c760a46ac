"""Preemption: on SIGTERM or SIGUSR1, checkpoint at the next optimiser-step boundary and exit for a requeue.

SLURM sends SIGUSR1 ahead of a time limit (`#SBATCH --signal=USR1@120`) and SIGTERM on preemption; Kubernetes
and most schedulers send SIGTERM. The handler only sets a flag: the checkpoint is written between two optimiser
steps (never mid-accumulation, never from inside a signal handler), every data-parallel rank agrees on that step,
and the process exits with REQUEUE_EXIT so a batch script can tell "preempted, requeue me" from success and from
failure. `trainer.resume=auto` then continues from that checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from exp.checkpoints import CHECKPOINT_DIR, LAST

log = logging.getLogger("exp.preemption")

# EX_TEMPFAIL from sysexits.h: "a temporary failure; the user is invited to retry".
REQUEUE_EXIT = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised out of `trainer.fit` once the preemption checkpoint is on disk."""

    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint {checkpoint}. Continue with "
            "trainer.resume=auto (same command) or trainer.resume=<this run dir>"
        )


class PreemptionCheckpoint(Callback):
    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.received: int | None = None
        self.stopping: Preempted | None = None  # set once the checkpoint is written
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        self.received = signum  # act at the next step boundary, outside the handler

    def on_train_start(self, trainer, pl_module) -> None:
        # Installed after Lightning's own handlers (registered before training starts) and replacing them:
        # Lightning would stop at an epoch end that an endless step-counted stream never reaches.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_handlers()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_handlers()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # At the end of an optimiser step (never mid-accumulation), where Lightning's own periodic checkpoints
        # are written: the checkpoint is exactly "after step N".
        if (batch_idx + 1) % trainer.accumulate_grad_batches or self.stopping:
            return
        flag = torch.tensor(float(self.received or 0), device=pl_module.device)
        if trainer.world_size > 1:  # every rank must stop at the same step, whichever got the signal
            flag = trainer.strategy.reduce(flag, reduce_op="max")
        signum = int(flag.item())
        if not signum:
            return
        path = self.output_dir / CHECKPOINT_DIR / LAST
        trainer.save_checkpoint(path)
        log.warning("received %s: saved %s at step %d", signal.Signals(signum).name, path, trainer.global_step)
        self.stopping = Preempted(signum, trainer.global_step, path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        # Stop before the next step starts, once step N's metrics have gone to the loggers.
        if self.stopping:
            raise self.stopping
