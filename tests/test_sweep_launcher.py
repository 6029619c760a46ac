"""A sweep's jobs end with its launcher: a SIGKILLed `submitit_local` sweep leaves no job process training on and
no pickle holding a secret behind (a job's submission pickle, nor the result pickle of a job that completed)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from exp.study.launcher_watch import identity

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


@contextlib.contextmanager
def submitit_sweep(tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """`python -m exp.train -m hydra/launcher=submitit_local <args>` into `tmp_path/sweep`, running, and the list its
    job processes are put in (`kill`); whatever the test does, nothing of it trains on afterwards."""
    argv = [sys.executable, "-m", "exp.train", "-m", "hydra/launcher=submitit_local", *args]
    with open(tmp_path / "launcher.log", "w") as out:
        launcher = subprocess.Popen(
            [*argv, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
            cwd=tmp_path,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdout=out,
            stderr=out,
        )
    jobs: list[int] = []
    try:
        yield launcher, jobs
    finally:
        for pid in [launcher.pid, *jobs, *descendants(launcher.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


def kill(launcher: subprocess.Popen, jobs: list[int]) -> None:
    """SIGKILL the launcher, then wait for its job processes (submitit's controller, the jobs, their training
    processes; put in `jobs`), which must stop on their own."""
    deadline = time.monotonic() + STARTED_WITHIN_S
    # The job's status says running a moment before its training process starts.
    while len(found := descendants(launcher.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    jobs += found
    assert len(jobs) >= 3, jobs
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline and any(identity(p) for p in jobs):
        time.sleep(0.5)
    assert [p for p in jobs if identity(p)] == [], "a job process outlived its launcher"


def holding(root: Path, secret: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.slow
def test_a_sigkilled_submitit_sweep_stops_its_jobs_and_leaves_no_secret_pickle(tmp_path):
    secret = "pw_FAKEkilledLAUNCHER31"
    args = ["lora.r=4", f"+hydra.job.env_set.DB_PASSWORD={secret}", "trainer.max_steps=100000"]
    with submitit_sweep(tmp_path, *args) as (launcher, jobs):
        status = _started_job(tmp_path / "sweep", launcher, tmp_path / "launcher.log")
        kill(launcher, jobs)
        assert json.loads(status.read_text())["status"] == "preempted"
        assert holding(tmp_path / "sweep", secret) == []


@pytest.mark.slow
def test_the_result_a_completed_job_leaves_to_a_sigkilled_launcher_holds_no_secret(tmp_path):
    """submitit writes what a job returns (Hydra's JobReturn: its configs, env_set values included) into the job's
    result pickle; a launcher killed before it reads it never deletes it. The job hands back its configs masked."""
    secret = "pw_FAKEcompletedJOB47"
    args = ["trainer.max_steps=2,100000", "trainer.val_every_n_steps=2", f"+hydra.job.env_set.DB_PASSWORD={secret}"]
    with submitit_sweep(tmp_path, *args) as (launcher, jobs):
        sweep = tmp_path / "sweep"
        _started_job(sweep, launcher, tmp_path / "launcher.log", "1_*")
        deadline = time.monotonic() + STARTED_WITHIN_S
        while time.monotonic() < deadline and not (results := list(sweep.glob(".submitit/*/*_result.pkl"))):
            time.sleep(0.5)
        (done,) = sweep.glob("0_*/status.json")
        assert len(results) == 1 and json.loads(done.read_text())["status"] == "completed"
        kill(launcher, jobs)
        assert results[0].exists() and holding(sweep, secret) == []


def _started_job(sweep: Path, launcher: subprocess.Popen, log: Path, job: str = "0_*") -> Path:
    """The status.json of the sweep's `job` once its training process runs."""
    deadline = time.monotonic() + STARTED_WITHIN_S
    while time.monotonic() < deadline and launcher.poll() is None:
        for status in sweep.glob(f"{job}/status.json"):
            if json.loads(status.read_text() or "{}").get("status") == "running":
                return status
        time.sleep(0.5)
    raise AssertionError(f"the job did not start: {log.read_text()[-3000:]}")
