"""The parts of one fit, put together from the config: seed, tokenizer and data module, the LightningModule, its
loggers and the Trainer. `python -m exp.train` (exp.training.pipeline) and `python -m exp.bench`'s exp side
(exp.bench.run_exp) both train what `build_fit` returns, so the bench measures the fit exp runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L

from exp.core.config import TrainConfig
from exp.data.datamodule import InstructionDataModule, build_run_datamodule
from exp.model.build import build_tokenizer
from exp.training.module import QLoRAModule
from exp.training.signals import GUARD
from exp.training.trainer import build_trainer


class Fit(NamedTuple):
    """What `trainer.fit(module, datamodule=datamodule)` trains."""

    tokenizer: Any  # None without a data module
    datamodule: InstructionDataModule | None  # None: the caller feeds its own batches
    module: QLoRAModule
    trainer: L.Trainer


def build_fit(
    cfg: TrainConfig,
    output_dir: Path,
    loggers: Callable[[QLoRAModule], list],
    *,
    with_data: bool = True,
    num_workers: int | None = None,
    tracking_ids: dict[str, str] | None = None,
    last_good_checkpoint: Callable[[], str | None] | None = None,
    resuming: bool = False,
) -> Fit:
    """Seed every random source, then build the fit's parts in the order a run takes (each stage is the signal
    guard's phase, which a stopping signal's message names).

    `loggers(module)`: the Trainer's loggers, which may read the module (its tracking ids, its trainer's step).
    `with_data=False`: no tokenizer or data module (the caller feeds the batches); `num_workers` replaces
    `hardware.num_workers`. `tracking_ids` and `last_good_checkpoint` are the module's (exp.training.module).
    `resuming`: no step-0 evaluation (a resumed run has it in its checkpoint).
    """
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    tokenizer = datamodule = None
    if with_data:
        GUARD.phase = "model build"
        tokenizer = build_tokenizer(cfg.model)
        GUARD.phase = "data preparation"
        datamodule = build_run_datamodule(cfg, tokenizer, num_workers)
    GUARD.phase = "start-up"
    # The module holds no model yet: `trainer.fit` calls its `configure_model` hook on the device the strategy
    # chose, which builds the 4-bit model there once (exp.model.build.build_model).
    module = QLoRAModule(cfg, tracking_ids=tracking_ids, last_good_checkpoint=last_good_checkpoint)
    trainer = build_trainer(
        cfg,
        output_dir,
        loggers(module),
        resuming=resuming,
        accumulate=datamodule.flat_accumulation if datamodule is not None else None,
    )
    return Fit(tokenizer, datamodule, module, trainer)
