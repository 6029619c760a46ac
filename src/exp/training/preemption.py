"""Preemption during training: on a signal (`exp.training.signals.GUARD`), checkpoint at the next optimiser-step boundary and
stop for a requeue.

The checkpoint is written between two optimiser steps (never mid-accumulation, never from inside a signal
handler), and every data-parallel rank agrees on that step. `trainer.resume=auto` then continues from it.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from exp.run.dirs import CHECKPOINT_DIR, LAST_CHECKPOINT
from exp.training.signals import GUARD, Preempted

log = logging.getLogger("exp.preemption")


class PreemptionCheckpoint(Callback):
    """The training phase of the signal guard: checkpoint at the next optimiser-step boundary, then stop. Also
    names the phases of `trainer.fit` for the guard's messages, and leaves `last.ckpt` at the final step when
    training ends, so a run stopped in its final validation continues from there."""

    def __init__(self, output_dir: Path, checkpoint_every_n_steps: int):
        self.output_dir = output_dir
        self.every = checkpoint_every_n_steps
        self.stopping: Preempted | None = None  # set once the checkpoint is written

    def setup(self, trainer, pl_module, stage: str) -> None:
        # configure_model follows (it builds the model once; the final validation finds it built)
        GUARD.phase = "model build" if stage == "fit" else "the final validation"

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        # Lightning has just put its own SIGTERM handler around the guard's: the guard alone decides.
        GUARD.install()
        GUARD.phase = "the step-0 validation"

    def on_train_start(self, trainer, pl_module) -> None:
        GUARD.install()
        GUARD.phase, GUARD.training = "training", True

    def _agreed_signal(self, trainer, pl_module) -> int:
        """The signal any rank received (0: none); every data-parallel rank must stop at the same step."""
        flag = torch.tensor(float(GUARD.received or 0), device=pl_module.device)
        if trainer.world_size > 1:
            flag = trainer.strategy.reduce(flag, reduce_op="max")
        return int(flag.item())

    def _checkpoint(self, trainer, signum: int) -> None:
        path = self.output_dir / CHECKPOINT_DIR / LAST_CHECKPOINT
        trainer.save_checkpoint(path)
        log.warning("received %s: saved %s at step %d", signal.Signals(signum).name, path, trainer.global_step)
        GUARD.received = GUARD.received or signum  # a rank that learnt of it from another
        self.stopping = Preempted(signum, trainer.global_step, path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # At the end of an optimiser step (never mid-accumulation), where Lightning's own periodic checkpoints
        # are written: the checkpoint is exactly "after step N".
        if (batch_idx + 1) % trainer.accumulate_grad_batches or self.stopping:
            return
        if signum := self._agreed_signal(trainer, pl_module):
            self._checkpoint(trainer, signum)

    @staticmethod
    def _commit(trainer) -> None:
        """Show the checkpoints saved so far (exp.run.checkpoints.AtomicCheckpointIO): their steps' metrics are logged."""
        commit = getattr(trainer.strategy.checkpoint_io, "commit", None)
        if commit is not None:
            commit()

    def on_validation_start(self, trainer, pl_module) -> None:
        GUARD.install()
        self._commit(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        GUARD.training = False
        self._commit(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._commit(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._commit(trainer)
        # Stop before the next step starts, once step N's metrics have gone to the loggers.
        if self.stopping:
            GUARD.acted = True
            raise self.stopping

    def on_train_end(self, trainer, pl_module) -> None:
        GUARD.training = False
        GUARD.phase = "the final validation"
        if self.stopping is None and (signum := self._agreed_signal(trainer, pl_module)):
            self._checkpoint(trainer, signum)  # received during the last step, after its boundary
        elif self.stopping is None and trainer.global_step % self.every:
            trainer.save_checkpoint(self.output_dir / CHECKPOINT_DIR / LAST_CHECKPOINT)  # the final step, for a resume
        self._commit(trainer)
        if self.stopping is not None:
            GUARD.acted = True
            raise self.stopping
