"""A study's job records: which earlier attempt a re-launched job may reuse, and, after a Hydra multirun, which jobs
completed or failed, with the failure count as exit status.

A job that completed is reused by a re-launch only when the config it was asked to run (recorded in its
`sweep_job.json`) has the same fingerprint as the new job's; a job directory that holds another config stops the
launch with `SweepConflict` before anything is written (see docs/sweeps.md for why it refuses instead of running the
job again beside the old one). Whose the sweep directory is, is `exp.study.claim`'s to say.

`SweepStatus` is registered in conf/train.yaml under `hydra.callbacks` (Hydra's only hook for the start and end of
a multirun). It reads each job's `status.json`, so it works for every launcher (sequential, submitit, SLURM) as
long as the jobs share the file system with the parent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from exp.core.config import ConfigError
from exp.run.dirs import JOB_RECORD, RunLayout, read_status, runs_under, write_json

log = logging.getLogger("exp.sweep")

# Left out of a job's fingerprint: what names or labels a run, never what it computes. The W&B run name and group
# are derived from the job's overrides and the sweep directory's name, so a renamed or moved sweep directory is still
# the same study; a continued run (trainer.resume) reaches the result the uninterrupted one would. Everything else,
# hardware included, stays in: the micro-batch size changes how the loss is averaged, the precision the numbers.
NOT_IN_FINGERPRINT = ("logger", "experiment_name", "trainer.resume", "trainer.resume_fallback")
# multirun.yaml as it was before this launch, by sweep directory: Hydra's basic sweeper rewrites it before the
# first job starts, and a launch refused at a job puts the study's own record back. Kept in memory (the refusal is
# decided in this process, also under the `gpus` launcher), so a launch refused earlier leaves no copy behind.
_previous_records: dict[Path, tuple[bytes, os.stat_result]] = {}


class SweepConflict(ConfigError):
    """A job directory of this sweep holds a job that was asked to run another config."""


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def fingerprinted(config: dict) -> dict[str, Any]:
    """The flat `key: value` pairs of a typed config (as `exp.run.compose.config_dict` writes it) that decide results."""
    return {
        k: v for k, v in _flat(config).items() if not any(k == n or k.startswith(n + ".") for n in NOT_IN_FINGERPRINT)
    }


def fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprinted(config), sort_keys=True, default=str).encode()).hexdigest()


def record_job(run_dir: Path, config: dict) -> None:
    write_json(run_dir / JOB_RECORD, {"fingerprint": fingerprint(config), "config": config})


def read_job_record(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / JOB_RECORD).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def attempts(job_dir: Path) -> list[Path]:
    """A job's run directories: `<job>`, then the re-launched attempts `<job>_1`, `<job>_2`, ... that exist."""
    found, n = [], 0
    while (d := job_dir if n == 0 else job_dir.with_name(f"{job_dir.name}_{n}")).is_dir():
        found.append(d)
        n += 1
    return found


def earlier_result(job_dir: Path, config: dict, sweep_dir: Path) -> Path | None:
    """The attempt of this job that completed with the same config, to be reused instead of run again; None when
    the job is to run (never ran, or failed). Raises SweepConflict when an attempt was asked to run another config,
    or completed without a record of it: its results would be paired with this config's parameters."""
    mine = fingerprint(config)
    done = None
    for run in attempts(job_dir):
        record, status = read_job_record(run), read_status(run).get("status")
        if record is None:
            if status == "completed":
                raise SweepConflict(conflict_message(sweep_dir, run, None, config))
            continue  # failed before its config was recorded (a bad value): nothing to compare, nothing to reuse
        if record["fingerprint"] != mine:
            raise SweepConflict(conflict_message(sweep_dir, run, record["config"], config))
        if status == "completed":
            done = run
    return done


def conflict_message(sweep_dir: Path, run: Path, recorded: dict | None, config: dict) -> str:
    if recorded is None:
        differs = "that completed without a record of its config (no sweep_job.json), so it cannot be shown to match"
    else:
        old, new = fingerprinted(recorded), fingerprinted(config)
        keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        shown = "; ".join(f"{k}: {shown_value(old.get(k))} there, {shown_value(new.get(k))} now" for k in keys[:6])
        more = f"; and {len(keys) - 6} more" if len(keys) > 6 else ""
        differs = f"that was asked to run another config than this launch's job {run.name} ({shown}{more})"
    free = free_sweep_dir(sweep_dir)
    return (
        f"hydra.sweep.dir={sweep_dir} already holds a job {run.name} {differs}. A sweep directory holds one study: "
        "reusing that job would pair its results with these settings, and replacing it would lose them, so this "
        f"launch stops here and changes nothing that was in {sweep_dir}. Fix: give this study its own directory, "
        f"hydra.sweep.dir={free}, or re-launch with the settings {sweep_dir} was made with to resume or extend its "
        "study."
    )


def free_sweep_dir(sweep_dir: Path) -> Path:
    """The first `<dir>_2`, `<dir>_3`, ... that does not exist: a directory to suggest for another study."""
    return next(p for n in range(2, 10_000) if not (p := sweep_dir.with_name(f"{sweep_dir.name}_{n}")).exists())


def shown_value(v: Any) -> str:
    """A config value as the refusals show it: `(unset)` for none, JSON for a list or mapping."""
    return "(unset)" if v is None else json.dumps(v) if isinstance(v, list | dict) else str(v)


def keep_sweep_record(sweep_dir: Path) -> None:
    """Before the sweeper rewrites multirun.yaml: the one there, for `restore_sweep_record`."""
    path = sweep_dir / "multirun.yaml"
    if path.is_file():
        _previous_records[sweep_dir.resolve()] = (path.read_bytes(), path.stat())


def restore_sweep_record(sweep_dir: Path) -> None:
    """A launch refused: multirun.yaml back as the study left it."""
    if (previous := _previous_records.pop(sweep_dir.resolve(), None)) is not None:
        content, stat = previous
        tmp = sweep_dir / f".multirun.yaml.{os.getpid()}.tmp"
        tmp.write_bytes(content)
        os.utime(tmp, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        os.replace(tmp, sweep_dir / "multirun.yaml")


def final_metric(run_dir: Path) -> float:
    """A job's final validation loss (what sweepers minimise), +inf when it has none."""
    try:
        return json.loads(RunLayout(run_dir).summary.read_text())["final_val"]["val/loss"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return float("inf")


def ran_out_of_memory(run_dir: Path) -> bool:
    """The job failed for memory: CUDA ran out during the run, or its preflight found less free memory than its
    estimate (another process held what the launcher had planned for)."""
    error = read_status(run_dir).get("error", "")
    return bool(re.search(r"out of memory|OutOfMemory|\[memory\]", error, re.IGNORECASE))


def job_name(job_dir: Path, sweep_dir: Path) -> str:
    """A sweep job's (or attempt's) name: its directory's path under the sweep directory. A job whose overrides hold a
    path nests (`0_data.path=data/a.json`), and the last part alone would name jobs of other paths alike."""
    try:
        return job_dir.relative_to(sweep_dir).as_posix()
    except ValueError:  # not under it (a directory given elsewhere)
        return job_dir.name


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Every run directory of a sweep (a job's retries included, nested ones too: exp.run.dirs.runs_under), in path
    order."""
    return runs_under(sweep_dir)


def job_groups(sweep_dir: Path) -> dict[str, list[Path]]:
    """Run directories grouped by job, each job named by its path under the sweep directory: a re-launched job that
    failed before has its attempts in `<job>_1`, ..."""
    dirs = {job_name(d, sweep_dir): d for d in job_dirs(sweep_dir)}
    groups: dict[str, list[Path]] = {}
    for name, d in dirs.items():
        base = re.sub(r"_\d+$", "", name)
        groups.setdefault(base if base in dirs else name, []).append(d)
    return groups


class SweepStatus(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        keep_sweep_record(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        _previous_records.pop(sweep_dir.resolve(), None)  # the launch went through: its record stands
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
