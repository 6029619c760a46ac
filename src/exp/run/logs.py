"""What a run says, and where: a concise console, a complete `train.log`.

The console shows exp's own lines, every warning and error, the progress bar and the final summary. The INFO
lines of Lightning, transformers and W&B ("GPU available: False", ...) reach it only with `verbose=true` (or `-v`).
`train.log` in the run directory gets every INFO line, the logged metrics (training metrics every
`trainer.log_every_n_steps` steps, validation metrics at every evaluation, step 0 included), the final summary, and
how the run ended. Log lines written while a progress bar is drawn go above the bar, not onto the end of its line.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from exp.run.dirs import LOG_FILE

# Lines for train.log only: the console shows the same facts as the progress bar and the printed summary.
RECORD = logging.getLogger("exp.record")
RECORD.addHandler(logging.NullHandler())  # where no train.log is written (ranks > 0): dropped, not printed
# Hydra's file format, so that a run's train.log reads the same whoever opened it.
FILE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
THIRD_PARTY = ("lightning.pytorch", "lightning.fabric")  # they print through handlers of their own
# A bar's redraws when stdout is a file, not a terminal: a log file (or CI) shows every redraw as a line of its own.
FILE_REFRESH_S = 30.0


class ExpOrWarning(logging.Filter):
    """The console's filter: exp's own lines, and anyone's warnings and errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name == "exp" or record.name.startswith("exp.")


class AboveBars:
    """A console stream that clears the progress bars, writes, and redraws them: a log line gets a line of its own."""

    def __init__(self, stream: Any):
        self.stream = stream

    def write(self, text: str) -> int:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=self.stream):
            return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


@contextmanager
def run_log(output_dir: Path, verbose: bool = False) -> Iterator[None]:
    """`train.log` in `output_dir` and a concise console, for the duration of a run; everything is undone after.

    Nested uses (the run's preflight, then its training) share the file, as does Hydra's own handler for it
    (`python -m exp.train` opens `<run dir>/train.log` before exp runs). Only rank 0 writes the file.
    """
    root = logging.getLogger()
    undo: list[Callable[[], Any]] = []
    path = (output_dir / LOG_FILE).resolve()
    if rank_zero_only.rank == 0:
        files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
        file = next((h for h in files if Path(h.baseFilename).resolve() == path), None)
        if file is None:
            file = logging.FileHandler(path)  # appends: what Hydra or an earlier step wrote stays
            file.setFormatter(logging.Formatter(FILE_FORMAT))
            root.addHandler(file)
            undo += [file.close, lambda: root.removeHandler(file)]
        if file not in RECORD.handlers:
            RECORD.addHandler(file)
            undo.append(lambda: RECORD.removeHandler(file))
    RECORD.propagate = False
    consoles = [h for h in root.handlers if type(h) is logging.StreamHandler]
    if not consoles:  # outside Hydra: without a console handler, warnings would now go to the file only
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.INFO if verbose else logging.WARNING)
        root.addHandler(console)
        undo.append(lambda: root.removeHandler(console))
        consoles = [console]
    for handler in consoles:
        if not verbose and not any(isinstance(f, ExpOrWarning) for f in handler.filters):
            quiet = ExpOrWarning()
            handler.addFilter(quiet)
            undo.append(lambda h=handler, f=quiet: h.removeFilter(f))
        if not isinstance(handler.stream, AboveBars):
            original = handler.setStream(AboveBars(handler.stream))
            undo.append(lambda h=handler, s=original: h.setStream(s))
    for name in ("exp", *THIRD_PARTY):
        logger = logging.getLogger(name)
        level, propagate, own = logger.level, logger.propagate, list(logger.handlers)
        # exp's INFO lines reach train.log even where the root logger is at WARNING (outside Hydra); Lightning's go
        # through the root's handlers (console filter, file) instead of its own.
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        for handler in own:
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True
        undo.append(lambda lg=logger, lv=level, p=propagate, hs=own: _restore(lg, lv, p, hs))
    try:
        yield
    finally:
        for step in reversed(undo):
            step()


def _restore(logger: logging.Logger, level: int, propagate: bool, handlers: list[logging.Handler]) -> None:
    logger.setLevel(level)
    logger.propagate = propagate
    for handler in handlers:
        if handler not in logger.handlers:
            logger.addHandler(handler)


def _number(value: Any) -> str:
    value = float(value)
    return f"{value:.5g}" if math.isfinite(value) and value != int(value) else f"{value:g}"


class RecordMetrics(Logger):
    """Every metric Lightning logs (and the step-0 evaluation exp logs itself), as one line per step in train.log.

    Lines are numbered by `steps_done()`, the optimiser steps completed (what the bar and the summary count);
    Lightning's own `step` argument is one less for metrics logged during training, and not for the final
    evaluation.
    """

    def __init__(self, steps_done: Callable[[], int]):
        super().__init__()
        self.steps_done = steps_done

    @property
    def name(self) -> str:
        return LOG_FILE

    @property
    def version(self) -> None:
        return None

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        shown = {k: v for k, v in metrics.items() if k != "epoch"}
        if shown:
            metrics_text = "  ".join(f"{k}={_number(v)}" for k, v in sorted(shown.items()))
            RECORD.info("step %d: %s", self.steps_done(), metrics_text)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass  # the config is config.yaml's


def _total(batches: int | float) -> int | None:
    return None if math.isinf(batches) else int(batches)


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar, counted in steps and named for what runs.

    The training stream has no end (a run is counted in steps): the bar shows progress towards max_steps, from where
    a resumed run starts, so its ETA counts only the steps still to run. Evaluations are named: "Step-0
    evaluation" (Lightning's sanity check, which exp uses as the evaluation of the untrained adapters), "Evaluation at
    step N", "Final evaluation". An error ends the bars' line first, so its message starts on a line of its own.
    Where stdout is not a terminal, a bar is redrawn at most every FILE_REFRESH_S seconds and when it completes.
    """

    _drawn = -math.inf  # when a bar was last redrawn (monotonic seconds)

    def _should_update(self, current: int, total: int) -> bool:
        if not super()._should_update(current, total):
            return False
        if current == total or sys.stdout.isatty():
            return True
        if time.monotonic() - self._drawn < FILE_REFRESH_S:
            return False
        self._drawn = time.monotonic()
        return True

    @property
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        return trainer.max_steps * trainer.accumulate_grad_batches if trainer.max_steps > 0 else float("inf")

    @property
    def train_description(self) -> str:
        return "Training"

    @property
    def sanity_check_description(self) -> str:
        return "Step-0 evaluation"

    @property
    def validation_description(self) -> str:
        if self.trainer.state.fn == "validate":
            return "Final evaluation"
        return f"Evaluation at step {self.trainer.global_step}"

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self._start_training_bar(trainer)

    def on_train_epoch_start(self, trainer, *args: Any) -> None:
        # Lightning calls this for a fresh run only (not when resuming mid-epoch); its own version names the bar
        # "Epoch 0" (the stream has one endless epoch).
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self._start_training_bar(trainer)

    def _start_training_bar(self, trainer) -> None:
        bar = self.train_progress_bar
        done = trainer.global_step * trainer.accumulate_grad_batches
        bar.reset(total=_total(self.total_train_batches))
        # tqdm's rate (and so the ETA) counts from `initial`: the batches of this process, not of the resumed run.
        bar.initial = bar.n = bar.last_print_n = done
        bar.set_description(self.train_description)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        # Lightning's, without the " DataLoader 0" it appends to the name (exp has one validation loader).
        if not self.has_dataloader_changed(dataloader_idx):
            return
        bar = self.val_progress_bar
        bar.reset(total=_total(self.total_val_batches_current_dataloader))
        bar.initial = 0
        bar.set_description(self.sanity_check_description if trainer.sanity_checking else self.validation_description)

    def get_metrics(self, trainer, pl_module) -> dict[str, int | str | float | dict[str, float]]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # a logger's version: noise next to the loss
        return metrics

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # The validation bar clears its line when closed, the training bar ends its line.
        for bar in (self._val_progress_bar, self._train_progress_bar):
            if bar is not None and not bar.disable:
                bar.close()
        sys.stdout.flush()
