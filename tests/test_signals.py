"""A signal at any moment of a run leaves status.json true and says so: before the run directory exists, while
Hydra starts, during data preparation (tokenisation half done), the model build, the step-0 validation, training,
the final validation, and while the results are saved.

Each run is held at its moment by tests/signal_run.py, which touches a marker file there and waits; the signal is
sent once the marker appears (no timing guesses), then the run is let go. Training itself is tested in
tests/test_resume.py (SIGTERM, SIGUSR1, SIGKILL) and tests/test_distributed.py (DDP); SIGINT is tested here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from exp.signals import REQUEUE_EXIT

RUNNER = Path(__file__).with_name("signal_run.py")
# Few steps, checkpoints every 2 (so that the last step, 5, is not one of them), no W&B.
RUN = [
    "trainer.max_steps=5",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=5",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.sample_count=0",
    "data.num_examples=120",
    "logger=csv",
]


def held_run(tmp_path: Path, point: str, sig: int, *args: str) -> subprocess.CompletedProcess:
    """Run exp.train held at `point`, send `sig` when it gets there, let it go, wait for the end."""
    marker = tmp_path / "marker"
    marker.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER), point, str(marker), *RUN, *args],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    while not (marker / "reached").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before {point}:\n{proc.communicate()[1][-3000:]}"
    proc.send_signal(sig)
    (marker / "go").touch()
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


# point, signal, the phase the message names
BEFORE_TRAINING = [
    ("hydra-start", signal.SIGTERM, "during start-up"),
    ("data", signal.SIGINT, "during data preparation"),  # Ctrl-C: preempted too, not a failure
    ("tokenising", signal.SIGTERM, "during data preparation"),
    ("model", signal.SIGHUP, "during model build"),  # a closed terminal
    ("step-0-validation", signal.SIGTERM, "during the step-0 validation"),
]


@pytest.mark.parametrize(
    ("point", "sig", "phase"), BEFORE_TRAINING, ids=[f"{p}-{signal.Signals(s).name}" for p, s, _ in BEFORE_TRAINING]
)
def test_a_signal_before_training_marks_the_run_preempted(tmp_path, point: str, sig: int, phase: str):
    # tokenising: a data.seed no other run uses, so that the rows are tokenised (not read from the cache)
    seed = f"data.seed={time.time_ns() % 2**31}" if point == "tokenising" else "data.seed=0"
    proc = held_run(tmp_path, point, sig, "hydra.run.dir=run", seed)
    name = signal.Signals(sig).name
    assert proc.returncode == REQUEUE_EXIT, proc.stderr[-3000:]
    message = f"exp: stopped by {name} {phase}, before any checkpoint: nothing to resume"
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    record = status(tmp_path / "run")
    assert record["status"] == "preempted" and f"stopped by {name} {phase}" in record["error"]
    assert not (tmp_path / "run" / "adapter").exists()
    cache = Path(os.environ["EXP_CACHE"])
    assert not [p for p in cache.rglob("*.partial")], "a half-built cache entry was left behind"


def test_a_signal_before_the_run_directory_exists_writes_nothing(tmp_path):
    proc = held_run(tmp_path, "before-run-dir", signal.SIGTERM)
    assert proc.returncode == REQUEUE_EXIT
    assert "exp: stopped by SIGTERM during start-up, before a run directory was made (nothing was written)" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "outputs").exists()


def test_ctrl_c_during_training_checkpoints_and_exits_for_requeue(tmp_path):
    """SIGINT (Ctrl-C) is a preemption like SIGTERM: a checkpoint at the next step, status preempted, exit 75."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "exp.train", *RUN, "trainer.max_steps=40", "hydra.run.dir=run"],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    first = tmp_path / "run" / "checkpoints" / "step-000002.ckpt"
    deadline = time.time() + 240
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == REQUEUE_EXIT and "stopped by SIGINT at step" in err and "Traceback" not in err, err
    assert status(tmp_path / "run")["status"] == "preempted"
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] >= 2


def test_a_signal_in_the_final_validation_leaves_a_checkpoint_of_the_last_step_to_finish_from(tmp_path):
    proc = held_run(tmp_path, "final-validation", signal.SIGTERM, "hydra.run.dir=first")
    assert proc.returncode == REQUEUE_EXIT, proc.stderr[-3000:]
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert f"stopped by SIGTERM during the final validation; checkpoint {last}" in proc.stderr
    assert status(tmp_path / "first")["status"] == "preempted" and not (tmp_path / "first" / "adapter").exists()
    assert torch.load(last, weights_only=True)["global_step"] == 5  # the final step, not the periodic step 4
    resumed = subprocess.run(
        [sys.executable, "-m", "exp.train", *RUN, "trainer.resume=auto", "hydra.run.dir=second"],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["resumed_from"]["checkpoint"] == str(last.resolve())
    assert (tmp_path / "second" / "adapter" / "adapter_model.safetensors").exists()


def test_a_signal_while_the_results_are_saved_lets_the_run_complete(tmp_path):
    proc = held_run(tmp_path, "saving", signal.SIGTERM, "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exp: SIGTERM arrived while the results were being saved; the run completed first" in proc.stdout
    assert status(tmp_path / "run")["status"] == "completed"
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()
    assert not list((tmp_path / "run").glob(".adapter*"))  # written to a temporary directory, renamed into place


def test_a_failure_after_a_signal_is_a_preemption(tmp_path, monkeypatch):
    """A signal sent to the whole process group also ends the DataLoader workers, and the next batch fails: the run
    is marked preempted (the signal stopped it), not failed."""
    from conftest import SHORT

    from exp.module import QLoRAModule
    from exp.signals import GUARD, Preempted
    from exp.train import run

    real = QLoRAModule.training_step

    def worker_killed(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            GUARD.received = signal.SIGTERM  # as the handler notes it during training
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Terminated.")
        return real(self, batch, batch_idx)

    monkeypatch.setattr(QLoRAModule, "training_step", worker_killed)
    with pytest.raises(Preempted) as info:
        run([*SHORT, "trainer.max_steps=5"], output_dir=tmp_path / "run")
    assert "stopped by SIGTERM at step" not in str(info.value) and "during training" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    record = status(tmp_path / "run")
    assert record["status"] == "preempted" and "before any checkpoint" in record["error"]
