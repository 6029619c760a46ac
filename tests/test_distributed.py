"""Data parallelism on the CPU (gloo): exp starts one process per device itself, and the replicas agree."""

from __future__ import annotations

import json
import signal

import torch
from conftest import SHORT

from exp.preemption import REQUEUE_EXIT
from exp.train import run


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
    config = (out / "config.yaml").read_text()
    assert "strategy: ddp" in config and "precision: 32-true" in config and "devices: 2" in config
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert result.final_val["val/loss"] < result.initial_val["val/loss"]
    # One run directory: the workers joined the launcher's, they did not compose their own.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_ddp_preempted_by_sigterm_resumes_to_the_uninterrupted_result(tmp_path):
    """The launcher passes SIGTERM on to its workers; all ranks checkpoint at one step and exit for a requeue."""
    from test_resume import adapter, cli, interrupted

    ddp = [
        "hardware=ddp",
        "hardware.accelerator=cpu",
        "hardware.devices=2",
        "hardware.micro_batch_size=4",
        "trainer.global_batch_size=8",
        "trainer.max_steps=40",
        "trainer.warmup_steps=0",
        "trainer.val_every_n_steps=20",
        "trainer.checkpoint_every_n_steps=5",
        "trainer.sample_count=0",
        "data.num_examples=400",
        "logger=csv",
    ]
    whole = cli(tmp_path, *ddp, "hydra.run.dir=whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped = interrupted(tmp_path, "first", signal.SIGTERM, "step-000010.ckpt", *ddp)
    assert stopped.returncode == REQUEUE_EXIT, stopped.stderr[-3000:]
    assert json.loads((tmp_path / "first" / "status.json").read_text())["status"] == "preempted"
    resumed = cli(tmp_path, *ddp, "trainer.resume=auto", "hydra.run.dir=second")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resumed_from"]["step"] >= 10
    a, b = adapter(tmp_path / "whole"), adapter(tmp_path / "second")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same adapters as the uninterrupted 2-process run
