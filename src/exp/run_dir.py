"""Run directories: claimed fresh (an earlier run's files are never overwritten), marked with their status."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"
# Set by `exp.train` in each rank of a torchrun / SLURM launch: the launch's id (`shared_launch_id`),
# recorded in status.json so that the ranks share one run directory and never take over an earlier launch's.
LAUNCH_ID_ENV = "EXP_LAUNCH_ID"


def write_json(path: Path, data: Any) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: the ranks of a launch share a run dir
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def write_status(run_dir: Path, status: str, error: str | None = None) -> None:
    record: dict[str, Any] = {"status": status, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if error:
        from exp.tracking import mask_secrets

        record["error"] = mask_secrets(error)
    if launch := os.environ.get(LAUNCH_ID_ENV):
        record["launch"] = launch
    write_json(run_dir / STATUS_FILE, record)


def read_status(run_dir: Path) -> dict[str, Any]:
    """The run's status record; {} when it has none (never started, or not an exp run)."""
    try:
        return json.loads((run_dir / STATUS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def next_free_run_dir(path: Path) -> Path:
    """`path`, or `path_1`, `path_2`, ... if an earlier run already wrote there (two launches in one second)."""
    candidate, n = path, 0
    while (candidate / STATUS_FILE).exists():
        n += 1
        candidate = path.with_name(f"{path.name}_{n}")
    return candidate


def claim_run_dir(path: Path) -> Path:
    """`next_free_run_dir(path)`, created."""
    candidate = next_free_run_dir(path)
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate


def new_run_dir(root: Path) -> Path:
    """A fresh `root/<date>/<time>` directory, as Hydra names them."""
    return claim_run_dir(root / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S"))


def shared_launch_id(env: dict[str, str] | None = None) -> str | None:
    """For one rank of several started by torchrun or SLURM: an id that every rank of this launch computes alike
    ("" when the launcher gives none); None for a single process (exp's own workers never get here).

    The ranks compose their configs independently, and a time-stamped run directory differs between ranks that
    start a second apart: the run directory must come from something they share.
    """
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1)
    if world <= 1:
        return None
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:  # torchrun: --standalone draws a uuid, --rdzv-id names it; the default is "none"
        restart = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
        return "" if run_id == "none" else f"torchrun-{run_id[:8]}" + (f"-restart{restart}" if restart else "")
    if job := env.get("SLURM_JOB_ID"):
        step, restart = env.get("SLURM_STEP_ID"), int(env.get("SLURM_RESTART_COUNT") or 0)
        return f"slurm-{job}" + (f".{step}" if step else "") + (f"-restart{restart}" if restart else "")
    return ""
