"""A signal at any moment of a run leaves status.json true and says so: before the run directory exists, while
Hydra starts, during data preparation (tokenisation half done), the model build, the step-0 validation, training,
the final validation, and while the results are saved.

Most runs here are `exp.train.run` in this process, which signals itself (`os.kill(os.getpid(), sig)`) at the
moment under test, from a patched function: the handler runs before the next line, so nothing depends on timing.
The CLI's own part (exit status 75, the message, a signal before the run directory exists or while Hydra starts)
runs `python -m exp.train` held at its moment by tests/signal_run.py, which touches a marker file there and waits;
the signal is sent once the marker appears. Training under SIGTERM, SIGUSR1 and SIGKILL through the CLI is tested in
tests/test_resume.py, DDP in tests/test_distributed.py.
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
from conftest import SHORT

import exp.data.encoding
import exp.train
import exp.training.fit
import exp.training.module
import exp.training.pipeline
from exp.train import run
from exp.training.module import QLoRAModule
from exp.training.signals import REQUEUE_EXIT, Preempted

RUNNER = Path(__file__).with_name("signal_run.py")
# Few steps, checkpoints every 2 (so that the last step, 5, is not one of them), no W&B.
RUN = [*SHORT, "trainer.max_steps=5", "trainer.checkpoint_every_n_steps=2", "trainer.val_every_n_steps=5"]
RUN += ["trainer.sample_count=0", "data.num_examples=120"]


@pytest.fixture(autouse=True)
def signals_at_their_defaults():
    """`nohup` and a non-interactive shell's `&` start pytest with SIGHUP / SIGINT ignored, and exp rightly leaves
    signals it was started without alone; these tests send them, so they start from the defaults."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def signal_at(monkeypatch, owner, name: str, sig: int, when=lambda *a, **k: True) -> None:
    """`owner.name` sends `sig` to this process when `when(...)` holds, then goes on as before (if still running)."""
    original = getattr(owner, name)

    def signalled(*args, **kwargs):
        if when(*args, **kwargs):
            os.kill(os.getpid(), sig)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)


def fiftieth_row():
    calls = []
    return lambda *a, **k: len(calls.append(1) or calls) == 50


# where, the signal, the phase the message names (and, for tokenising: the rows are new, not read from the cache)
BEFORE_TRAINING = [
    (
        "data",
        exp.training.fit,
        "build_run_datamodule",
        signal.SIGINT,
        "data preparation",
    ),  # Ctrl-C: preempted, not failed
    ("tokenising", exp.data.encoding, "encode_row", signal.SIGTERM, "data preparation"),
    ("model", exp.training.module, "build_model", signal.SIGHUP, "model build"),  # a closed terminal
    ("step-0", QLoRAModule, "validation_step", signal.SIGUSR1, "the step-0 validation"),
]


@pytest.mark.parametrize(
    ("owner", "name", "sig", "phase"), [c[1:] for c in BEFORE_TRAINING], ids=[c[0] for c in BEFORE_TRAINING]
)
def test_a_signal_before_training_marks_the_run_preempted(tmp_path, monkeypatch, owner, name, sig, phase: str):
    when = fiftieth_row() if name == "encode_row" else lambda *a, **k: True
    signal_at(monkeypatch, owner, name, sig, when)
    seed = f"data.seed={time.time_ns() % 2**31}" if name == "encode_row" else "data.seed=0"  # tokenised afresh
    with pytest.raises(Preempted) as info:
        run([*RUN, seed], output_dir=tmp_path / "run")
    name = signal.Signals(sig).name
    assert str(info.value).startswith(f"stopped by {name} during {phase}, before any checkpoint: nothing to resume")
    record = status(tmp_path / "run")
    assert record["status"] == "preempted" and f"stopped by {name} during {phase}" in record["error"]
    assert not (tmp_path / "run" / "adapter").exists()
    assert not list(Path(os.environ["EXP_CACHE"]).rglob("*.partial")), "a half-built cache entry was left behind"
    assert signal.getsignal(signal.SIGINT) != exp.training.signals.GUARD._handle  # run() restored the handlers


@pytest.mark.slow
def test_ctrl_c_during_training_checkpoints_at_the_next_step(tmp_path, monkeypatch):
    signal_at(monkeypatch, QLoRAModule, "training_step", signal.SIGINT, lambda self, *a: self.trainer.global_step == 2)
    with pytest.raises(Preempted) as info:
        run([*RUN, "trainer.max_steps=20"], output_dir=tmp_path / "run")
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert str(info.value).startswith(f"stopped by SIGINT at step 3; checkpoint {last}")
    assert status(tmp_path / "run")["status"] == "preempted"
    assert torch.load(last, weights_only=True)["global_step"] == 3  # the step in flight finished


@pytest.mark.slow
def test_a_signal_in_the_final_validation_leaves_a_checkpoint_of_the_last_step_to_finish_from(tmp_path, monkeypatch):
    # The last step (5) is not a validation step of fit (4), so the final validation runs after fit.
    ends_between_validations = [*RUN, "trainer.val_every_n_steps=4"]
    with monkeypatch.context() as m:
        final = lambda self, *a: self.trainer.state.fn == "validate"  # noqa: E731
        signal_at(m, QLoRAModule, "validation_step", signal.SIGTERM, final)
        with pytest.raises(Preempted) as info:
            run(ends_between_validations, output_dir=tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert str(info.value).startswith(f"stopped by SIGTERM during the final validation; checkpoint {last}")
    assert status(tmp_path / "first")["status"] == "preempted" and not (tmp_path / "first" / "adapter").exists()
    assert torch.load(last, weights_only=True)["global_step"] == 5  # the final step, not the periodic step 4
    result = run([*ends_between_validations, f"trainer.resume={tmp_path / 'first'}"], output_dir=tmp_path / "second")
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["resumed_from"]["checkpoint"] == str(last)
    assert (result.adapter_dir / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_a_signal_while_the_results_are_saved_lets_the_run_complete(tmp_path, monkeypatch, capsys):
    signal_at(monkeypatch, exp.training.pipeline, "save_adapter", signal.SIGTERM)
    result = run(RUN, output_dir=tmp_path / "run")
    assert "exp: SIGTERM arrived while the results were being saved; the run completed first" in capsys.readouterr().out
    assert status(tmp_path / "run")["status"] == "completed"
    assert (result.adapter_dir / "adapter_model.safetensors").exists()
    assert not list((tmp_path / "run").glob(".adapter*"))  # written to a temporary directory, renamed into place


@pytest.mark.slow
def test_a_failure_after_a_signal_is_a_preemption(tmp_path, monkeypatch):
    """A signal sent to the whole process group also ends the DataLoader workers, and the next batch fails: the run
    is marked preempted (the signal stopped it), not failed."""
    from exp.training.signals import GUARD

    real = QLoRAModule.training_step

    def worker_killed(self, batch, batch_idx):
        if self.trainer.global_step == 1:
            GUARD.received = signal.SIGTERM  # as the handler notes it during training
            raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Terminated.")
        return real(self, batch, batch_idx)

    monkeypatch.setattr(QLoRAModule, "training_step", worker_killed)
    with pytest.raises(Preempted) as info:
        run(RUN, output_dir=tmp_path / "run")
    assert "during training" in str(info.value) and isinstance(info.value.__cause__, RuntimeError)
    record = status(tmp_path / "run")
    assert record["status"] == "preempted" and "before any checkpoint" in record["error"]


# --- through the CLI -----------------------------------------------------------------------------------------------


def held_cli(tmp_path: Path, point: str, sig: int, *args: str) -> subprocess.CompletedProcess:
    """`python -m exp.train` held at `point` (tests/signal_run.py); `sig` is sent when it gets there."""
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


@pytest.mark.slow
def test_a_signal_while_hydra_starts_marks_the_run_and_exits_for_requeue(tmp_path):
    proc = held_cli(tmp_path, "hydra-start", signal.SIGTERM, "hydra.run.dir=run")
    assert proc.returncode == REQUEUE_EXIT, proc.stderr[-3000:]
    message = "exp: stopped by SIGTERM during start-up, before any checkpoint: nothing to resume. Run the same command"
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert status(tmp_path / "run")["status"] == "preempted"


def test_a_signal_before_the_run_directory_exists_writes_nothing(tmp_path):
    proc = held_cli(tmp_path, "before-run-dir", signal.SIGTERM)
    assert proc.returncode == REQUEUE_EXIT
    assert "exp: stopped by SIGTERM during start-up, before a run directory was made (nothing was written)" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "outputs").exists()
