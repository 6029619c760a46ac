"""Run directories: claimed fresh (an earlier run's files are never overwritten), marked with their status."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"


def write_json(path: Path, data: Any) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def write_status(run_dir: Path, status: str, error: str | None = None) -> None:
    record: dict[str, Any] = {"status": status, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if error:
        record["error"] = error
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
