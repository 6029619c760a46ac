"""`RunLifecycle`, the one writer of how a run ends: `running` inside the block, then `completed`, `failed` with the
error, or `preempted` with where to go on; the loggers are finished in every case, before `completed` is written.
Whole runs under signals are tests/test_signals.py's; these check the rules on their own."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

import exp.training.lifecycle as lifecycle
from exp.core.config import ConfigError
from exp.training.lifecycle import RunLifecycle, close_stopped, record_stop
from exp.training.signals import GUARD, Preempted


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


class Finished(list):
    """Each `finish_loggers` call as (loggers, ok, preempted, what status.json said then)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self.run_dir = run_dir

    def __call__(self, loggers, ok, preempted=False) -> None:
        path = self.run_dir / "status.json"
        self.append((loggers, ok, preempted, status(self.run_dir)["status"] if path.exists() else None))


@pytest.fixture
def finished(monkeypatch, tmp_path) -> Finished:
    calls = Finished(tmp_path)
    monkeypatch.setattr(lifecycle, "finish_loggers", calls)
    return calls


@pytest.fixture(autouse=True)
def quiet_guard():
    GUARD.reset("start-up")
    yield
    GUARD.reset("start-up")


def test_a_run_that_ends_normally_is_completed_after_its_loggers_finish(tmp_path, finished):
    with RunLifecycle(tmp_path) as run:
        assert status(tmp_path)["status"] == "running"
        run.track(["logger"])
    assert status(tmp_path)["status"] == "completed"
    assert finished == [(["logger"], True, False, "running")]


def test_an_error_fails_the_run_with_its_message(tmp_path, finished):
    with pytest.raises(ValueError):
        with RunLifecycle(tmp_path) as run:
            run.track(["logger"])
            raise ValueError("the data ran out")
    assert status(tmp_path) | {"time": None} == {
        "status": "failed",
        "error": "ValueError: the data ran out",
        "time": None,
    }
    assert finished == [(["logger"], False, False, "failed")]


def test_a_signal_preempts_the_run_and_names_the_checkpoint_to_continue_from(tmp_path, finished):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    with pytest.raises(Preempted):
        with RunLifecycle(tmp_path, resume={"checkpoint": str(tmp_path / "older.ckpt")}):
            raise Preempted(signal.SIGTERM, phase="data preparation")
    record = status(tmp_path)
    assert record["status"] == "preempted"
    assert record["error"].startswith("Preempted: stopped by SIGTERM during data preparation")
    assert str(tmp_path / "older.ckpt") in record["error"]  # nothing newer: the continued checkpoint
    assert finished[-1][1:3] == (False, True)


def test_a_failure_after_a_signal_is_the_signal(tmp_path, finished):
    """A process group's signal also ends the DataLoader workers; the next batch fails. The signal stopped it."""
    GUARD.received = signal.SIGUSR1
    with pytest.raises(Preempted) as raised:
        with RunLifecycle(tmp_path):
            raise RuntimeError("DataLoader worker exited unexpectedly")
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert status(tmp_path)["status"] == "preempted"


def test_a_worker_process_writes_no_status(tmp_path, finished):
    """The ranks of a multi-process run: the launching process owns status.json."""
    with pytest.raises(ValueError):
        with RunLifecycle(tmp_path, owns_status=False) as run:
            run.track(["logger"])
            raise ValueError("boom")
    assert not (tmp_path / "status.json").exists()
    assert finished == [(["logger"], False, False, None)]


def test_an_outcome_the_block_records_itself_is_kept(tmp_path, finished):
    with pytest.raises(SystemExit):
        with RunLifecycle(tmp_path) as run:
            run.end("failed", "a worker process exited with status 3")
            raise SystemExit(3)
    assert status(tmp_path)["error"] == "a worker process exited with status 3"
    assert finished[-1][1:3] == (False, False)


def test_a_run_stopped_before_its_lifecycle(tmp_path):
    made = tmp_path / "made"
    made.mkdir()
    record_stop(made, ConfigError("lora.r: -1 must be positive"))
    assert status(made) | {"time": None} == {"status": "failed", "error": "lora.r: -1 must be positive", "time": None}
    record_stop(made, Preempted(signal.SIGINT, phase="start-up"))
    assert status(made)["status"] == "preempted"


def test_a_refused_run_keeps_a_directory_this_process_did_not_make(tmp_path):
    """close_stopped removes only what this process created (exp.run.dirs.discard_run_dir); a directory that was
    there before records the refusal instead."""
    close_stopped(tmp_path, ConfigError("data.path: missing.json does not exist"))
    assert tmp_path.exists()
    assert status(tmp_path)["status"] == "failed"
