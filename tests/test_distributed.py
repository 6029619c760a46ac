"""Data parallelism on the CPU (gloo): exp starts one process per device itself, and the replicas agree."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import SHORT

from exp.run.dirs import shared_launch_id
from exp.train import run
from exp.training.signals import REQUEUE_EXIT


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_trains_identical_replicas(tmp_path):
    overrides = SHORT + [
        "hardware=ddp",
        "hardware.accelerator=cpu",
        "hardware.devices=2",  # precision auto -> 32-true on the CPU
        "hardware.micro_batch_size=4",
        "trainer.global_batch_size=8",
        "trainer.max_steps=6",
        "trainer.val_every_n_steps=3",
        "trainer.checkpoint_every_n_steps=3",
    ]
    result = run(overrides, output_dir=tmp_path / "run")
    out = tmp_path / "run"
    assert json.loads((out / "status.json").read_text())["status"] == "completed"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    prints = summary["replica_adapter_checksums"]
    assert len(prints) == 2 and prints[0] == prints[1]  # both ranks hold the same adapters after training
    assert prints[0][1] > 0  # ... and they are not the untrained zeros of lora_B alone
    # Throughput is the run's: both ranks' tokens/s summed, the slowest rank's step time; each rank's own beside it.
    ranks = summary["per_rank"]
    assert len(ranks) == 2 and all(r["tokens_per_s_median"] > 0 for r in ranks)
    assert summary["tokens_per_s_median"] == pytest.approx(sum(r["tokens_per_s_median"] for r in ranks), abs=1e-3)
    assert summary["step_seconds_median"] == max(r["step_seconds_median"] for r in ranks)
    assert summary["peak_memory_gib"] is None  # CUDA's figure; none on the CPU
    config = (out / "config.yaml").read_text()
    assert "strategy: ddp" in config and "precision: 32-true" in config and "devices: 2" in config
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert result.final_val["val/loss"] < result.initial_val["val/loss"]
    # One run directory: the workers joined the launcher's, they did not compose their own.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# 20 steps of 2 micro-batches of 4, a checkpoint every 5: long enough to interrupt after step 10.
RESUME_STEPS = [
    "trainer.global_batch_size=8",
    "trainer.max_steps=20",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=10",
    "trainer.checkpoint_every_n_steps=5",
    "trainer.sample_count=0",
    "data.num_examples=400",
    "logger=csv",
]
DDP_RESUME = ["hardware=ddp", "hardware.accelerator=cpu", "hardware.devices=2", "hardware.micro_batch_size=4",
              *RESUME_STEPS]  # fmt: skip


@pytest.fixture(scope="module")
def ddp_whole(tmp_path_factory):
    """The uninterrupted 2-process run the interrupted ones must reproduce."""
    from test_resume import cli

    cwd = tmp_path_factory.mktemp("ddp_whole")
    whole = cli(cwd, *DDP_RESUME, "hydra.run.dir=whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    return cwd / "whole"


@pytest.mark.slow
def test_ddp_preempted_by_sigterm_resumes_to_the_uninterrupted_result(tmp_path, ddp_whole):
    """The launcher passes SIGTERM on to its workers; all ranks checkpoint at one step and exit for a requeue."""
    from test_resume import adapter, cli, interrupted

    stopped = interrupted(tmp_path, "first", signal.SIGTERM, "step-000010.ckpt", *DDP_RESUME)
    assert stopped.returncode == REQUEUE_EXIT, stopped.stderr[-3000:]
    assert json.loads((tmp_path / "first" / "status.json").read_text())["status"] == "preempted"
    resumed = cli(tmp_path, *DDP_RESUME, "trainer.resume=auto", "hydra.run.dir=second")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resumed_from"]["step"] >= 10
    a, b = adapter(ddp_whole), adapter(tmp_path / "second")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same adapters as the uninterrupted 2-process run


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def killed_launcher_then_resumed(cwd: Path, overrides: list[str], after: str = "step-000010.ckpt") -> Path:
    """Start a multi-process run in `cwd/killed`; once checkpoint `after` exists, SIGKILL its launcher alone (no
    process group) and check that every worker ends with it, before the run's last step; then continue it with
    `trainer.resume=auto` into `cwd/resumed`, which is returned."""
    import psutil
    from test_resume import _env, cli

    proc = subprocess.Popen(
        [sys.executable, "-m", "exp.train", *overrides, "hydra.run.dir=killed"],
        cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    marker = cwd / "killed" / "checkpoints" / after
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    workers = [c.pid for c in psutil.Process(proc.pid).children() if "exp.training.worker" in " ".join(c.cmdline())]
    assert len(workers) == 2
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.time() + 10
    while not all(_gone(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in workers), "a worker outlived its killed launcher"
    status = json.loads((cwd / "killed" / "status.json").read_text())
    assert status["status"] == "running"  # nobody wrote an end: the run was killed
    assert not (cwd / "killed" / "adapter").exists()  # ended mid-run, not after finishing it
    resumed = cli(cwd, *overrides, "trainer.resume=auto", "hydra.run.dir=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((cwd / "resumed" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resumed_from"]["run"].endswith("killed")
    return cwd / "resumed"


@pytest.mark.slow
def test_ddp_workers_end_with_a_killed_launcher_and_resume_to_the_uninterrupted_result(tmp_path, ddp_whole):
    """SIGKILL to the launcher alone: its workers end with it, as a killed single run does, and
    `trainer.resume=auto` goes on from their last checkpoint to the uninterrupted run's adapters."""
    from test_resume import adapter

    resumed = killed_launcher_then_resumed(tmp_path, DDP_RESUME)
    assert json.loads((resumed / "summary.json").read_text())["resumed_from"]["step"] >= 10
    a, b = adapter(ddp_whole), adapter(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_signal_while_the_workers_start_stops_the_run_as_preempted(tmp_path):
    """SIGTERM to the launcher as soon as its workers exist (they are still importing, their handlers not yet
    installed): the run is stopped for a requeue (status preempted, exit 75), not failed."""
    import psutil
    from test_resume import _env

    proc = subprocess.Popen(
        [sys.executable, "-m", "exp.train", *DDP_RESUME, "hydra.run.dir=run"],
        cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        if len(psutil.Process(proc.pid).children()) == 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == REQUEUE_EXIT, err[-3000:]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "preempted" and "nothing to resume" in status["error"]


CHILD = "from exp.training.launch import die_with_launcher; die_with_launcher(); import time; time.sleep(60)"
PARENT = f"""
import os, subprocess, sys, time
from exp.training.launch import child_env
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=child_env(os.environ.copy()))
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_child_ends_with_its_killed_launcher():
    import psutil

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(1.0)  # the child is past die_with_launcher
    assert not _gone(child)
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while not _gone(child) and time.time() < deadline:
        time.sleep(0.05)
    assert _gone(child)
    # A child whose launcher is already gone when it starts (the pid it was given is not its parent's) ends at once.
    late = subprocess.run(
        [sys.executable, "-c", CHILD], env=dict(os.environ, EXP_LAUNCHER_PID=str(psutil.Process().pid + 10**6))
    )
    assert late.returncode == -signal.SIGKILL
    # Started by anything else (no launcher named), nothing is set: a plain run is not tied to its shell.
    env = {k: v for k, v in os.environ.items() if k != "EXP_LAUNCHER_PID"}
    plain = subprocess.run([sys.executable, "-c", CHILD.replace("60", "0")], env=env)
    assert plain.returncode == 0


TORCHRUN_ARGS = [
    "hardware=ddp",
    "hardware.accelerator=cpu",
    "hardware.devices=2",
    "trainer.global_batch_size=16",
    "trainer.max_steps=2",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=2",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.sample_count=0",
    "logger=csv",
]


def torchrun(cwd, *args: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=2 <launcher flags> -m exp.train <TORCHRUN_ARGS> <overrides>`: flags before `--`."""
    flags, overrides = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, ())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *flags, "-m", "exp.train"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [*cmd, *TORCHRUN_ARGS, *overrides], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_torchrun_ranks_share_one_run_dir_and_never_take_over_an_earlier_one(tmp_path):
    # Each rank composes its own config: a time-stamped run dir differed between ranks a second apart (two run
    # dirs, one of them a stray copy). The launch's id names the one they share.
    first = torchrun(tmp_path, "--standalone")
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").iterdir()
    status = json.loads((run_dir / "status.json").read_text())
    assert run_dir.name.startswith("torchrun-") and (status["status"], status["launch"]) == ("completed", run_dir.name)
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    # A new launch pointed at that run dir is refused by every rank before Hydra writes anything.
    refused = torchrun(tmp_path, "--standalone", "--", f"hydra.run.dir={run_dir}")
    assert refused.returncode != 0 and "already holds a run (completed" in refused.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # torchrun without --standalone or --rdzv-id gives its processes nothing to agree on: a clear error.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bare = torchrun(tmp_path, f"--master_port={port}")
    assert bare.returncode != 0 and "--standalone (one machine) or --rdzv-id" in bare.stderr
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == [run_dir.name]


def test_shared_launch_id_from_the_launchers_environment():
    assert shared_launch_id({}) is None and shared_launch_id({"WORLD_SIZE": "1"}) is None
    assert shared_launch_id({"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "0faad671-aa18"}) == "torchrun-0faad671"
    elastic = {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert shared_launch_id(elastic) == "torchrun-job7-restart1"
    assert shared_launch_id({"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}) == ""
    slurm = {"SLURM_NTASKS": "4", "SLURM_JOB_ID": "123", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2"}
    assert shared_launch_id(slurm) == "slurm-123.0-restart2"


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
# The same per-process settings on either kind of device; on GPUs what the preflight would choose by memory is
# pinned, so both launches train the same steps.
SAME_LAUNCH = {
    "cpu": ["hardware.accelerator=cpu"],
    "cuda": ["hardware.auto_micro_batch=false", "hardware.micro_batch_size=4", "hardware.auto_checkpoint_layers=false",
             "hardware.auto_dequantized_layers=false", "hardware.compile=false"],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
def test_torchrun_and_exps_own_launcher_train_the_same_adapters(tmp_path, device):
    """`torchrun --standalone --nproc_per_node=2 -m exp.train ...` and `python -m exp.train hardware=ddp ...` (exp
    starts the two processes) are the same run: the same adapters, bitwise."""
    from test_resume import adapter

    args = ["hardware=ddp", "hardware.devices=2", *SAME_LAUNCH[device], "trainer.global_batch_size=16",
            "trainer.max_steps=6", "trainer.warmup_steps=0", "trainer.val_every_n_steps=3",
            "trainer.checkpoint_every_n_steps=3", "trainer.sample_count=0", "logger=csv"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")  # torchrun's default per process; exp's launcher keeps it
    own = subprocess.run(
        [sys.executable, "-m", "exp.train", *args, "hydra.run.dir=own"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert own.returncode == 0, own.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "exp.train"]
    launched = subprocess.run(
        [*cmd, *args, "hydra.run.dir=torchrun"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("own", "torchrun")]
    assert [(s["world_size"], s["steps"]) for s in summaries] == [(2, 6), (2, 6)]
    assert summaries[0]["placement_per_rank"] == summaries[1]["placement_per_rank"]
    a, b = adapter(tmp_path / "own"), adapter(tmp_path / "torchrun")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
