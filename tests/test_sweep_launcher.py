"""A sweep's jobs end with its launcher: a SIGKILLed `submitit_local` sweep leaves no job process training on and
no submission pickle holding a secret behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exp.run.sweep_launcher import identity

GONE_WITHIN_S = 120  # how long the jobs may take to stop on a busy 2-core machine (a bound, not a timing)
STARTED_WITHIN_S = 300


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def test_identity_tells_a_live_process_from_a_gone_one():
    me = identity(os.getpid())
    assert me is not None and me.startswith(f"{os.getpid()}:")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert identity(proc.pid) is None


@pytest.mark.slow
def test_a_sigkilled_submitit_sweep_stops_its_jobs_and_leaves_no_secret_pickle(tmp_path):
    secret = "pw_FAKEkilledLAUNCHER31"
    sweep = tmp_path / "sweep"
    argv = [sys.executable, "-m", "exp.train", "-m", "hydra/launcher=submitit_local", "lora.r=4"]
    argv += [f"+hydra.job.env_set.DB_PASSWORD={secret}", "trainer.max_steps=100000", f"hydra.sweep.dir={sweep}"]
    with open(tmp_path / "launcher.log", "w") as out:
        launcher = subprocess.Popen(
            argv, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=out, stderr=out
        )
    jobs: list[int] = []
    try:
        status = _started_job(sweep, launcher, tmp_path / "launcher.log")
        jobs = descendants(launcher.pid)  # submitit's controller, the job, its training process
        assert len(jobs) >= 3, jobs
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while time.monotonic() < deadline and any(identity(p) for p in jobs):
            time.sleep(0.5)
        assert [p for p in jobs if identity(p)] == [], "a job process outlived its launcher"
        assert json.loads(status.read_text())["status"] == "preempted"
        leaked = [p for p in sweep.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
        assert leaked == []
    finally:  # whatever failed, nothing of this test trains on
        for pid in [launcher.pid, *jobs, *descendants(launcher.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


def _started_job(sweep: Path, launcher: subprocess.Popen, log: Path) -> Path:
    """The status.json of the sweep's job once its training process runs."""
    deadline = time.monotonic() + STARTED_WITHIN_S
    while time.monotonic() < deadline and launcher.poll() is None:
        for status in sweep.glob("0_*/status.json"):
            if json.loads(status.read_text() or "{}").get("status") == "running":
                return status
        time.sleep(0.5)
    raise AssertionError(f"the job did not start: {log.read_text()[-3000:]}")
