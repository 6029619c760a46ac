"""Map the typed config onto a Lightning Trainer: placement from `hardware`, the algorithm from `trainer`."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

from exp.config import TrainConfig


def build_trainer(cfg: TrainConfig, output_dir: Path, loggers: list) -> L.Trainer:
    hw, t = cfg.hardware, cfg.trainer
    accumulate = cfg.accumulate_grad_batches
    checkpoints = ModelCheckpoint(
        dirpath=output_dir / "checkpoints",
        filename="step-{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=t.checkpoint_every_n_steps,
        save_top_k=-1,  # keep every periodic checkpoint: they hold only the adapters, so they are small
        save_last=True,
    )
    return L.Trainer(
        accelerator=hw.accelerator.value,
        devices=hw.devices,
        num_nodes=hw.num_nodes,
        precision=hw.precision,
        max_steps=t.max_steps,
        max_epochs=-1,  # max_steps decides; the loader simply restarts (reshuffled) at each epoch end
        accumulate_grad_batches=accumulate,
        gradient_clip_val=t.max_grad_norm or None,
        # Lightning counts validation intervals in micro-batches, the config in optimiser steps.
        val_check_interval=t.val_every_n_steps * accumulate,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches if t.limit_val_batches is not None else 1.0,
        # The sanity check runs the whole validation split on the untrained adapters: it is the step-0 evaluation.
        num_sanity_val_steps=-1,
        log_every_n_steps=t.log_every_n_steps,
        logger=loggers or False,
        callbacks=[checkpoints, TQDMProgressBar(refresh_rate=10)],
        default_root_dir=str(output_dir),
        enable_model_summary=False,
    )
