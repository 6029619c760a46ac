"""Nothing lost: a run killed (SIGKILL) or preempted (SIGTERM / SIGUSR1) and resumed ends exactly where an
uninterrupted run ends; checkpoint files are written atomically, kept as configured and checked when read."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import Together
from safetensors.torch import load_file

from exp.run.checkpoints import AtomicCheckpointIO, candidates
from exp.training.signals import REQUEUE_EXIT

# 60 steps, a checkpoint every 10: long enough to interrupt after step 20 and have most of the run left.
RUN = [
    "trainer.max_steps=60",
    "trainer.warmup_steps=5",
    "trainer.val_every_n_steps=25",
    "trainer.checkpoint_every_n_steps=10",
    "trainer.keep_last_checkpoints=2",
    "trainer.log_every_n_steps=1",
    "trainer.sample_count=0",
    "data.num_examples=400",
]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="offline")


def cli(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "exp.train", *overrides],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )


def interrupted(cwd: Path, run_dir: str, sig: int, after: str, *overrides: str) -> subprocess.CompletedProcess:
    """Start a run, send `sig` once checkpoint `after` exists, wait for the process to end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "exp.train", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    marker = cwd / run_dir / "checkpoints" / after
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before {after} was written:\n{proc.communicate()[1][-3000:]}"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def whole_and_killed(cwd: Path, after: str, *overrides: str) -> tuple[subprocess.CompletedProcess, ...]:
    """The uninterrupted run (`cwd/whole`) and the same run SIGKILLed once checkpoint `after` exists (`cwd/killed`),
    side by side: neither reads the other, and each spends most of its life importing on one core. Returns once both
    have ended, so that a `trainer.resume=auto` started next finds no run still going beside it."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        whole = pool.submit(cli, cwd, *overrides, "hydra.run.dir=whole")
        killed = interrupted(cwd, "killed", signal.SIGKILL, after, *overrides)
        return whole.result(), killed


def losses(*run_dirs: Path) -> dict[int, float]:
    """train/loss per optimiser step from the runs' CSVs (a later run's row for a step wins)."""
    out: dict[int, float] = {}
    for d in run_dirs:
        with open(d / "csv" / "metrics.csv") as f:
            out.update({int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]})
    return out


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def whole_run(cwd: Path) -> tuple[Path, subprocess.CompletedProcess]:
    return cwd / "run", cli(cwd, *RUN, "logger=csv", "hydra.run.dir=run")


def killed_then_resumed(cwd: Path):
    """SIGKILL after step 20, then `trainer.resume=auto`; the killed run's files (digest) from before the resume."""
    killed = interrupted(cwd, "killed", signal.SIGKILL, "step-000020.ckpt", *RUN, "logger=csv")
    if killed.returncode != -signal.SIGKILL:
        return cwd, killed, None, None
    before = digest(cwd / "killed")
    return cwd, killed, before, cli(cwd, *RUN, "logger=csv", "trainer.resume=auto", "hydra.run.dir=resumed")


TRACKERS = "logger=[wandb,tensorboard,mlflow]"


def stopped_then_resumed(cwd: Path):
    """SIGTERM after step 20 under W&B, TensorBoard and MLflow, then `trainer.resume=auto`; the stopped run's
    status, last checkpoint step, whether it has an adapter and its MLflow run's status, read before the resume."""
    from test_trackers import mlflow_runs

    stopped = interrupted(cwd, "first", signal.SIGTERM, "step-000020.ckpt", *RUN, TRACKERS)
    if stopped.returncode != REQUEUE_EXIT:
        return cwd, stopped, None, None
    status = json.loads((cwd / "first" / "status.json").read_text())
    step = torch.load(cwd / "first" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    [mlflow_run] = mlflow_runs(cwd / "first" / "mlruns")[1]
    state = (status, step, (cwd / "first" / "adapter").exists(), mlflow_run.info.status)
    return cwd, stopped, state, cli(cwd, *RUN, TRACKERS, "trainer.resume=auto", "hydra.run.dir=second")


def warned_by_sigusr1(cwd: Path) -> tuple[Path, subprocess.CompletedProcess]:
    return cwd, interrupted(cwd, "run", signal.SIGUSR1, "step-000020.ckpt", *RUN, "logger=csv")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Together:
    """The runs of this module that depend on no other, side by side: the uninterrupted one and the interrupted
    ones with their continuations (each in a directory of its own)."""
    functions = {
        "whole": whole_run,
        "killed": killed_then_resumed,
        "stopped": stopped_then_resumed,
        "sigusr1": warned_by_sigusr1,
    }
    steps = {name: partial(f, tmp_path_factory.mktemp(name)) for name, f in functions.items()}
    killed = "test_sigkill_then_resume_auto_matches_an_uninterrupted_run"
    stopped = "test_sigterm_checkpoints_exits_for_requeue_and_resumes_under_the_same_wandb_run"
    readers = [
        "test_resume_from_a_damaged_checkpoint_names_it_and_falls_back_only_when_asked",
        "test_resume_refuses_a_run_with_a_different_config",
        "test_checkpoints_keep_the_newest_k_last_and_best",
    ]
    uses = {
        "whole": [*readers, killed, stopped],
        "killed": [killed],
        "stopped": [stopped],
        "sigusr1": ["test_sigusr1_the_slurm_warning_signal_also_checkpoints_and_exits_for_requeue"],
    }
    with Together(request, steps, uses) as together:
        yield together


@pytest.fixture
def uninterrupted(runs) -> Path:
    run_dir, proc = runs.get("whole")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def assert_same_training(reference: Path, *pieces: Path) -> None:
    ref, got = losses(reference), losses(*pieces)
    assert sorted(got) == sorted(ref) == list(range(1, 61))  # one row per optimiser step, numbered by steps done
    assert got == ref  # bitwise: the CPU run is deterministic
    a, b = adapter(reference), adapter(pieces[-1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigkill_then_resume_auto_matches_an_uninterrupted_run(uninterrupted, runs):
    tmp_path, killed, before, resumed = runs.get("killed")
    assert killed.returncode == -signal.SIGKILL
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = json.loads((tmp_path / "resumed" / "resume.json").read_text())
    assert record["run"] == str((tmp_path / "killed").resolve()) and record["step"] >= 20
    assert_same_training(uninterrupted, tmp_path / "killed", tmp_path / "resumed")
    # The continuation has the original step-0 evaluation, and the interrupted run's files are untouched.
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["initial_val"] == json.loads((uninterrupted / "summary.json").read_text())["initial_val"]
    assert digest(tmp_path / "killed") == before


@pytest.mark.slow
def test_sigterm_checkpoints_exits_for_requeue_and_resumes_under_the_same_wandb_run(uninterrupted, runs):
    tmp_path, stopped, state, resumed = runs.get("stopped")
    assert stopped.returncode == REQUEUE_EXIT, stopped.stderr[-3000:]
    assert "trainer.resume=auto" in stopped.stderr and "Traceback" not in stopped.stderr
    status, last_step, has_adapter, mlflow_status = state
    assert status["status"] == "preempted" and mlflow_status == "KILLED"
    assert 20 <= last_step < 60 and f"step {last_step}" in status["error"]
    assert not has_adapter  # an unfinished run has no "final" adapter

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_training(uninterrupted, tmp_path / "first", tmp_path / "second")
    # The continuation's bar knows its total and gives an ETA (from its own pace, not the resumed steps'); its log
    # says what it continued and holds the steps it ran.
    assert re.search(r"Training: +\d+%\|[^|]*\| [2-5]\d/60 \[\d\d:\d\d<\d\d:\d\d,", resumed.stdout), resumed.stdout[
        -2000:
    ]
    log = (tmp_path / "second" / "train.log").read_text()
    assert "resuming from" in log and f"step {last_step + 1}: train/" in log and "step 60: val/" in log
    assert "run preempted: Preempted: stopped by SIGTERM" in (tmp_path / "first" / "train.log").read_text()
    # The same W&B run continues: both offline run directories carry one run id.
    ids = {
        p.name.rsplit("-", 1)[-1] for d in ("first", "second") for p in (tmp_path / d / "wandb").glob("offline-run-*")
    }
    assert len(ids) == 1
    # So do the TensorBoard and MLflow runs, in the first directory: every step once, the continuation's values.
    from test_trackers import csv_metrics, mlflow_metrics, mlflow_runs, tensorboard_metrics

    assert not (tmp_path / "second" / "mlruns").exists() and not (tmp_path / "second" / "tensorboard").exists()
    expected = {**csv_metrics(tmp_path / "first")["train/loss"], **csv_metrics(tmp_path / "second")["train/loss"]}
    client, [run] = mlflow_runs(tmp_path / "first" / "mlruns")
    assert run.info.status == "FINISHED" and mlflow_metrics(client, run.info.run_id)["train/loss"] == sorted(
        expected.items()
    )
    assert tensorboard_metrics(tmp_path / "first" / "tensorboard")["train/loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_sigusr1_the_slurm_warning_signal_also_checkpoints_and_exits_for_requeue(runs):
    tmp_path, stopped = runs.get("sigusr1")
    assert stopped.returncode == REQUEUE_EXIT and "stopped by SIGUSR1" in stopped.stderr
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "preempted"
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] >= 20


@pytest.mark.slow
def test_resume_from_a_damaged_checkpoint_names_it_and_falls_back_only_when_asked(uninterrupted, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(uninterrupted, run)
    (run / "status.json").write_text('{"status": "failed"}')
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # truncated mid-write by something else

    refused = cli(tmp_path, *RUN, "logger=csv", f"trainer.resume={run}", "hydra.run.dir=refused")
    assert refused.returncode == 2
    assert str(last) in refused.stderr and "trainer.resume_fallback=true" in refused.stderr
    assert "Traceback" not in refused.stderr

    # With the fallback, the newest intact checkpoint (step 60, the last periodic one) is taken. The run is
    # already at max_steps, so ask for 10 more: a named run may be continued with a longer schedule.
    more = [o if not o.startswith("trainer.max_steps") else "trainer.max_steps=70" for o in RUN]
    ok = cli(tmp_path, *more, "logger=csv", f"trainer.resume={run}", "trainer.resume_fallback=true", "hydra.run.dir=fb")
    assert ok.returncode == 0, ok.stderr[-3000:]
    record = json.loads((tmp_path / "fb" / "resume.json").read_text())
    assert record["checkpoint"] == str(run / "checkpoints" / "step-000060.ckpt")
    assert json.loads((tmp_path / "fb" / "summary.json").read_text())["steps"] == 70


@pytest.mark.slow
def test_resume_refuses_a_run_with_a_different_config(uninterrupted, tmp_path):
    proc = cli(tmp_path, *RUN, "logger=csv", "lora.r=16", f"trainer.resume={uninterrupted}", "hydra.run.dir=x")
    assert proc.returncode == 2
    assert "lora.r: 8 -> 16" in proc.stderr and "Traceback" not in proc.stderr


def test_resume_auto_without_a_matching_run_starts_fresh(tmp_path):
    from exp.run.compose import compose_config, config_dict
    from exp.run.resume import find_auto

    cfg = config_dict(compose_config(["trainer.resume=auto"]))
    assert find_auto(cfg, tmp_path / "outputs" / "d" / "t") is None


@pytest.mark.slow
def test_checkpoints_keep_the_newest_k_last_and_best(uninterrupted):
    names = sorted(p.name for p in (uninterrupted / "checkpoints").iterdir())
    # keep_last_checkpoints=2 of steps 10..60; the best by val/loss (validated at 25, 50 and the end).
    assert names == ["best-step-000050.ckpt", "last.ckpt", "step-000050.ckpt", "step-000060.ckpt"]
    ckpt = torch.load(uninterrupted / "checkpoints" / "last.ckpt", weights_only=True)
    assert set(ckpt["exp"]) == {"batches_seen", "skipped_steps", "initial_val", "tracking_ids", "rng"}
    config = (uninterrupted / "config.yaml").read_text()
    assert "micro_batch_size: 8" in config and "global_batch_size: 8" in config
    assert ckpt["exp"]["batches_seen"] == 60  # one micro-batch per optimiser step, one rank
    assert all("lora_" in k for k in ckpt["state_dict"])  # adapters only, not the frozen base


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "state_dict": {"w": torch.ones(3)}, "exp": {}}, path)
    io.commit()

    def dies_mid_write(obj, f):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(OSError):
        io.save_checkpoint({"step": 2, "state_dict": {"w": torch.zeros(3)}, "exp": {}}, path)
    io.commit()
    assert io.load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no partial file left behind


def test_a_checkpoint_is_shown_only_once_its_steps_metrics_are_on_disk(tmp_path, monkeypatch):
    """Lightning writes a step's checkpoint before that step's CSV row: the checkpoint appears (renamed into place,
    the one it replaces removed) only when the next step starts, so a kill in between cannot leave a checkpoint of a
    step whose row is lost."""
    io = AtomicCheckpointIO()
    old, new = tmp_path / "step-000010.ckpt", tmp_path / "step-000020.ckpt"
    io.save_checkpoint({"state_dict": {}, "exp": {}, "global_step": 10}, old)
    io.commit()
    io.save_checkpoint({"state_dict": {}, "exp": {}, "global_step": 20}, new)
    io.remove_checkpoint(old)
    assert old.exists() and not new.exists()  # killed here: the continuation starts after step 10
    io.commit()
    assert not old.exists() and io.load_checkpoint(new)["global_step"] == 20
    assert [p.name for p in tmp_path.iterdir()] == [new.name]


@pytest.mark.slow
def test_every_checkpoint_appears_after_the_csv_rows_of_the_steps_it_holds(tmp_path, monkeypatch):
    """The race behind a SIGKILL-then-resume run missing a step's row, checked without its timing.

    Lightning saves a step's checkpoint before it hands that step's metrics to the CSV logger; a checkpoint visible
    in between (killed there, continued from it) leaves a step that neither the run nor its continuation logs. At
    the moment each checkpoint is renamed into place, the CSV on disk must already hold a row for every step it
    covers."""
    import exp.run.checkpoints
    from exp.train import run

    out = tmp_path / "run"
    rename = os.replace
    seen: list[tuple[str, int, set[int]]] = []

    def replace(src, dst):
        if str(dst).endswith(".ckpt"):
            step = torch.load(src, map_location="cpu", weights_only=True, mmap=True)["global_step"]
            metrics = out / "csv" / "metrics.csv"
            seen.append((Path(dst).name, step, set(losses(out)) if metrics.exists() else set()))
        rename(src, dst)

    monkeypatch.setattr(exp.run.checkpoints.os, "replace", replace)
    run(
        [
            "trainer.max_steps=12",
            "trainer.warmup_steps=0",
            "trainer.checkpoint_every_n_steps=4",
            "trainer.val_every_n_steps=6",
            "trainer.log_every_n_steps=1",
            "trainer.sample_count=0",
            "data.num_examples=400",
            "logger=csv",
        ],
        output_dir=out,
    )
    assert {name for name, _, _ in seen} >= {"step-000004.ckpt", "step-000008.ckpt", "step-000012.ckpt", "last.ckpt"}
    # A checkpoint of step N holds steps 1..N (metrics.csv numbers rows by the optimiser steps done).
    late = [(name, step, sorted(set(range(1, step + 1)) - rows)) for name, step, rows in seen]
    late = [entry for entry in late if entry[2]]
    assert not late, f"checkpoints visible before the rows of their steps (name, step, missing rows): {late}"


def test_a_new_csv_column_rewrites_the_record_whole_or_not_at_all(tmp_path, monkeypatch):
    """A metric seen for the first time (a continued run's first validation) makes the CSV logger rewrite
    metrics.csv under a wider header: a process dying in that rewrite leaves the previous record, not a truncated
    one whose steps a continuation (starting after the checkpoint) would never log again."""
    from exp.run.csv_record import AtomicCSVLogger

    logger = AtomicCSVLogger(save_dir=str(tmp_path), name="", version="csv")
    path = tmp_path / "csv" / "metrics.csv"
    for step, metrics in enumerate([{"train/loss": 1.0}, {"train/loss": 2.0}, {"train/loss": 3.0, "val/loss": 5.0}]):
        logger.log_metrics(metrics, step=step)
        logger.save()
    rows = list(csv.DictReader(path.open()))
    assert [(r["step"], r["train/loss"], r["val/loss"]) for r in rows] == [
        ("0", "1.0", ""),
        ("1", "2.0", ""),
        ("2", "3.0", "5.0"),
    ]
    before = path.read_text()
    logger.log_metrics({"train/loss": 4.0, "train/skipped_steps": 1.0}, step=3)

    def dies_mid_write(self, rows):
        self.writerow(next(iter(rows)))
        raise OSError("killed")

    monkeypatch.setattr(csv.DictWriter, "writerows", dies_mid_write)
    with pytest.raises(OSError):
        logger.save()
    assert path.read_text() == before and [p.name for p in path.parent.iterdir()] == ["metrics.csv"]


def test_resume_takes_the_newest_step_even_when_last_ckpt_is_older(tmp_path):
    # Lightning writes step-N.ckpt, then last.ckpt: a run killed in between has a last.ckpt one period behind.
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()

    def write(name: str, step: int) -> Path:
        torch.save({"global_step": step, "state_dict": {}, "exp": {}}, ckpts / name)
        return ckpts / name

    s10, s20, last = write("step-000010.ckpt", 10), write("step-000020.ckpt", 20), write("last.ckpt", 10)
    assert candidates(tmp_path) == [s20, last, s10]
    write("last.ckpt", 20)  # the same step: last.ckpt first
    assert candidates(tmp_path) == [last, s20, s10]
    write("last.ckpt", 23)  # a preemption checkpoint after the last periodic one
    assert candidates(tmp_path) == [last, s20, s10]
    last.write_bytes(b"garbage")  # unreadable: first, so that resuming reports it as damaged
    assert candidates(tmp_path) == [last, s20, s10]


def test_checkpointing_choices_may_differ_on_resume_but_the_math_may_not():
    # The preflight picks the recomputed layers from the free memory of the GPU a continuation lands on: that must
    # not hide the run from trainer.resume=auto (the gradients do not depend on it, tests/test_training.py).
    from exp.run.resume import config_differences

    # Where LoRA's B joins the base product follows the kept layers and the objective (hardware.fuse_lora=auto).
    recorded = {"hardware": {"gradient_checkpointing": True, "checkpoint_layers": 7, "micro_batch_size": 8,
                             "dequantized_layers": 10, "fuse_lora": True}}  # fmt: skip
    moved = {"hardware": {"gradient_checkpointing": False, "checkpoint_layers": None, "micro_batch_size": 8,
                          "dequantized_layers": 4, "fuse_lora": False}}  # fmt: skip
    assert config_differences(recorded, moved) == []
    assert config_differences(recorded, {"hardware": {**moved["hardware"], "micro_batch_size": 4}}) == [
        "hardware.micro_batch_size: 8 -> 4"
    ]
