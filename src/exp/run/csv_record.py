"""The CSV record of a run (`csv/metrics.csv`): Lightning's CSVLogger, with its header rewrites made atomic.

Lightning appends each step's row, but when a metric appears for the first time (a continued run's first
validation, the first skipped step) it rewrites the whole file under the wider header, in place: a run killed during
that rewrite would be left with an empty or half-written record, and the steps it held would be missing from the run
and from its continuation (which starts after the run's checkpoint). Here the rewrite goes to a temporary file that
then replaces metrics.csv whole. (Rows reach the file before the checkpoint of their step appears:
exp.run.checkpoints.AtomicCheckpointIO.)
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class AtomicRewriteWriter(ExperimentWriter):
    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        path = Path(self.metrics_file_path)
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with tmp.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fieldnames)
                writer.writeheader()
                writer.writerows(rows)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


class AtomicCSVLogger(CSVLogger):
    """CSVLogger writing through AtomicRewriteWriter (Lightning builds its writer in this property)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AtomicRewriteWriter(log_dir=self.log_dir)
        return self._experiment
