"""`placements.jsonl`, the `gpus` launcher's journal in the sweep directory: one JSON line per decision, appended per
launch (earlier launches' lines are kept).

The events: `plan` (each job's estimate, reservation, budget, resolved choices and estimated time; the estimated
wall-clock: exp.study.plan.plan_record), `start` (job, GPU, the GPU's room then, jobs already there), `end`
(status, seconds, the job's measured peak), `reserve_raised`, `backoff`, `rejected` and `launch_end` (the
wall-clock); each names its launch. The scheduler writes them; the time estimate reads a job's measured seconds
back (`launcher_seconds`), and the report compares the last launch's plan with what happened (`last_launch`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLACEMENTS = "placements.jsonl"
_lock = threading.Lock()  # whole lines, should two threads of a launch append at once


def append_event(sweep_dir: Path, event: dict[str, Any]) -> None:
    """One decision, appended to the sweep's placements.jsonl."""
    with _lock, (sweep_dir / PLACEMENTS).open("a") as f:
        f.write(json.dumps(event, default=str) + "\n")


def launcher_seconds(run: Path) -> float | None:
    """The job's wall-clock as the `gpus` launcher measured it (its last `end` line), None without one."""
    path = run.parent / PLACEMENTS
    if not path.is_file():
        return None
    seconds = None
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "end" and event.get("job") == run.name and event.get("status") == "completed":
            seconds = event.get("seconds")
    return float(seconds) if seconds else None


@dataclass
class Launch:
    """The last launch a sweep's placements.jsonl holds: its plan and what became of each job."""

    plan: dict[str, Any]  # its `plan` event
    starts: dict[str, dict[str, Any]]  # job -> its `start` event
    ends: dict[str, dict[str, Any]]  # job -> its `end` event
    wall_clock_s: float | None  # its `launch_end` event's; None while it runs (or after it was killed)
    backoffs: list[dict[str, Any]]  # its `backoff` events


def last_launch(sweep_dir: Path) -> Launch | None:
    """The launch of the last plan recorded in `sweep_dir` (None: no placements.jsonl, or no plan in it)."""
    path = sweep_dir / PLACEMENTS
    if not path.is_file():
        return None
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    plans = [e for e in events if e.get("event") == "plan"]
    if not plans:
        return None
    plan = plans[-1]
    mine = [e for e in events if e.get("launch") == plan.get("launch")]
    starts = {}
    for e in mine:
        if e.get("event") == "start":
            # A group sharing one base starts once for all its jobs (its `group` lists them).
            for job in e.get("group") or [e["job"]]:
                starts[job] = e
    return Launch(
        plan,
        starts=starts,
        ends={e["job"]: e for e in mine if e.get("event") == "end"},
        wall_clock_s=next((e["wall_clock_s"] for e in mine if e.get("event") == "launch_end"), None),
        backoffs=[e for e in mine if e.get("event") == "backoff"],
    )
