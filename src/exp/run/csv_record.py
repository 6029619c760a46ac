"""The CSV record of a run (`csv/metrics.csv`): one row per optimiser step, written so that no step is lost.

Lightning's CSVLogger appends one row per call to the loggers, numbered by Lightning's own step, which for metrics
logged during training (and the validations inside `fit`) is one less than the optimiser steps done, and for the
final `trainer.validate` is not: the training row after the first step says 0, like the step-0 evaluation, and a
step's training metrics and its validation land in separate rows. Here rows are numbered by the optimiser steps
done (`steps_done`, what train.log, the checkpoints' names and summary.json count), and the metrics logged at one
step form one row: a validation of the step whose training row is already on disk completes that row.

Rows reach the file when the loggers are told to save, which Lightning does after every call (and before the
checkpoint of their step appears: exp.run.checkpoints.AtomicCheckpointIO). A row is appended; the file is
rewritten whole, through a temporary file renamed over it, when its last row gains metrics or when a metric
appears for the first time (a wider header: a continued run's first validation, the first skipped step), so a run
killed during a rewrite keeps the previous record, never an empty or half-written one.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

# Lightning adds the epoch to every row; exp's training stream never ends an epoch (a run is counted in steps), so
# it would read 0 for every step and 1 for the final evaluation (summary.json has the epochs trained).
DROPPED = ("epoch",)


class StepRowWriter(ExperimentWriter):
    """metrics.csv with one row per step: metrics logged for the step of the last row join that row."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        self.written: dict[str, Any] | None = None  # the file's last row, as written

    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        super().log_metrics({k: v for k, v in metrics_dict.items() if k not in DROPPED}, step)
        if len(self.metrics) > 1 and self.metrics[-2]["step"] == self.metrics[-1]["step"]:
            self.metrics[-2].update(self.metrics.pop())

    def save(self) -> None:
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        rows, exists = self.metrics, path.is_file()
        new_keys = self._record_new_keys()
        amend = exists and self.written is not None and rows[0]["step"] == self.written["step"]
        if amend:
            rows[0] = {**self.written, **rows[0]}
        if exists and (new_keys or amend):
            self._rewrite(path, rows, drop_last=amend)
        else:
            with path.open("a" if exists else "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                if not exists:
                    writer.writeheader()
                writer.writerows(rows)
        self.written = rows[-1]
        self.metrics = []

    def _rewrite(self, path: Path, rows: list[dict[str, Any]], drop_last: bool) -> None:
        """The file's rows (less its last, which `rows` replaces) and `rows`, under the current header, in one
        rename."""
        with path.open(newline="") as f:
            kept = list(csv.DictReader(f))
        if drop_last:
            kept = kept[:-1]
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with tmp.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(kept)
                writer.writerows(rows)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


class StepNumbered:
    """Mixed into a Lightning logger: its metrics numbered by `steps_done()` (optimiser steps completed) when given,
    else by the step Lightning passes, and without Lightning's epoch. metrics.csv's rows are numbered so, and the
    other trackers (exp.run.trackers) follow it: every tracker has the same metric at the same step."""

    steps_done: Callable[[], int] | None = None

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        metrics = {k: v for k, v in metrics.items() if k not in DROPPED}
        super().log_metrics(metrics, self.steps_done() if self.steps_done is not None else step)  # type: ignore[misc]


class AtomicCSVLogger(StepNumbered, CSVLogger):
    """CSVLogger writing through StepRowWriter (Lightning builds its writer in this property), its rows numbered by
    optimiser steps (StepNumbered)."""

    def __init__(self, *args: Any, steps_done: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps_done = steps_done

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = StepRowWriter(log_dir=self.log_dir)
        return self._experiment
