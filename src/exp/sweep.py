"""Sweep bookkeeping: after a Hydra multirun, say which jobs completed or failed, and exit with the failure count.

Registered in conf/train.yaml under `hydra.callbacks` (Hydra's only hook for the end of a multirun; this is the
one `_target_` the project uses, and it points at this class). It reads each job's `status.json`, so it works
for every launcher (sequential, submitit, SLURM) as long as the jobs share the file system with the parent.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from exp.run_dir import read_status

log = logging.getLogger("exp.sweep")


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Every run directory of a sweep (a job's retries included), in name order."""
    return sorted(
        p for p in sweep_dir.iterdir() if p.is_dir() and ((p / "status.json").exists() or (p / ".hydra").exists())
    )


def job_groups(sweep_dir: Path) -> dict[str, list[Path]]:
    """Run directories grouped by job: a re-launched job that failed before has its attempts in `<job>_1`, ..."""
    dirs = job_dirs(sweep_dir)
    names = {d.name for d in dirs}
    groups: dict[str, list[Path]] = {}
    for d in dirs:
        base = re.sub(r"_\d+$", "", d.name)
        groups.setdefault(base if base in names else d.name, []).append(d)
    return groups


class SweepStatus(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        groups = job_groups(sweep_dir)
        failed = {}
        for job, attempts in groups.items():
            records = [read_status(d) for d in attempts]
            if not any(r.get("status") == "completed" for r in records):
                failed[job] = records[-1].get("error", "no error recorded")
        log.info(
            "sweep %s: %d job(s), %d completed, %d failed",
            sweep_dir,
            len(groups),
            len(groups) - len(failed),
            len(failed),
        )
        for job, error in failed.items():
            log.error("  failed: %s: %s", job, error.splitlines()[0] if error else "")
        log.info("table and plots: python -m exp.report %s", sweep_dir)
        if failed:
            raise SystemExit(min(len(failed), 100))  # the exit status says how many jobs failed
