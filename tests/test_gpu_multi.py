"""Placement on several GPUs (skipped without 2 CUDA devices): DDP, FSDP, model parallelism, and the preflight
catching the motivating failures (more devices asked than visible; CUDA_VISIBLE_DEVICES changed after CUDA init).

Set EXP_RESULTS_DIR to keep each run's summary (benchmarks/results/ records them)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
BASE = [
    "model=gemma_2b",
    "model.random_init=true",
    "trainer.max_steps=10",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=5",
    "trainer.checkpoint_every_n_steps=5",
    "data.num_examples=800",
    "logger=csv",
]


def train(
    tmp_path: Path, name: str, overrides: list[str], env: dict | None = None
) -> tuple[subprocess.CompletedProcess, dict]:
    run_dir = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", *BASE, *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env or os.environ.copy(),
    )
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    keep = os.environ.get("EXP_RESULTS_DIR")
    if keep:
        record = {
            "command": "python -m exp.train " + " ".join(BASE + overrides),
            "returncode": proc.returncode,
            "summary": summary,
            "stderr_tail": proc.stderr[-1500:] if proc.returncode else "",
        }
        Path(keep, f"hardware_{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return proc, summary


@pytest.mark.slow
def test_ddp_two_gpus_one_replica_per_device(tmp_path):
    proc, s = train(tmp_path, "ddp", ["hardware=ddp", "trainer.global_batch_size=8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["world_size"] == 2 and math.isfinite(s["final_val"]["val/loss"])
    a, b = s["placement_per_rank"]
    assert a == {"root_device": "cuda:0", "frozen": ["cuda:0"], "trainable": ["cuda:0"]}
    assert b == {"root_device": "cuda:1", "frozen": ["cuda:1"], "trainable": ["cuda:1"]}
    assert s["replica_adapter_checksums"][0] == s["replica_adapter_checksums"][1]


@pytest.mark.slow
def test_fsdp_two_gpus(tmp_path):
    proc, s = train(tmp_path, "fsdp", ["hardware=fsdp", "trainer.global_batch_size=8"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert s["world_size"] == 2 and math.isfinite(s["final_val"]["val/loss"])
    assert s["final_val"]["val/loss"] < s["initial_val"]["val/loss"]
    assert (tmp_path / "fsdp" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_model_parallel_spans_both_gpus(tmp_path):
    proc, s = train(tmp_path, "model_parallel", ["hardware=model_parallel"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (placement,) = s["placement_per_rank"]
    assert placement["frozen"] == ["cuda:0", "cuda:1"]  # one process, layers on both GPUs
    assert math.isfinite(s["final_val"]["val/loss"])


def test_more_devices_than_visible_gets_the_diagnosis(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    proc, _ = train(tmp_path, "too_many_devices", ["hardware=ddp", "hardware.devices=2"], env=env)
    assert proc.returncode == 3
    assert "hardware.devices=2" in proc.stderr and "sees 1 GPU" in proc.stderr
    assert "Traceback" not in proc.stderr


STALE_SCRIPT = r"""
import os, sys
os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
import torch
torch.zeros(1, device="cuda")          # CUDA initialised with two devices (a notebook's first cell)
os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # ... then a later cell narrows it
from exp.train import run
try:
    run(sys.argv[2:], output_dir=sys.argv[1])
except SystemExit as e:
    print("EXIT", e.code)
"""


def test_stale_cuda_visible_devices_in_process_gets_the_diagnosis(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", STALE_SCRIPT, str(tmp_path / "stale"), *BASE, "hardware=gpu"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "EXIT 3" in proc.stdout, proc.stderr[-3000:]
    assert "CUDA_VISIBLE_DEVICES" in proc.stderr and "restart" in proc.stderr
    keep = os.environ.get("EXP_RESULTS_DIR")
    if keep:
        Path(keep, "hardware_stale_cvd.txt").write_text(
            proc.stdout[-2000:] + "\n--- stderr ---\n" + proc.stderr[-3000:]
        )


def tiny_two() -> list[str]:
    """The tiny Gemma on both GPUs, what the preflight would choose by memory pinned (the runs compared train the
    same steps), 20 steps with a checkpoint every 5."""
    from test_distributed import RESUME_STEPS, SAME_LAUNCH

    return ["hardware.devices=2", *SAME_LAUNCH["cuda"], *RESUME_STEPS]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_killed_launcher_then_resume_auto_reaches_the_uninterrupted_adapters(tmp_path, strategy):
    """SIGKILL to the launcher of a 2-GPU run after step 10; its workers end with it; `trainer.resume=auto` continues
    to the adapters of the uninterrupted run: bitwise, or within 1e-6 relative (the figure is recorded)."""
    from test_distributed import killed_launcher_then_resumed
    from test_resume import adapter, cli

    args = [f"hardware={strategy}", *tiny_two()]
    whole = cli(tmp_path, *args, "hydra.run.dir=whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed = killed_launcher_then_resumed(tmp_path, args)
    a, b = adapter(tmp_path / "whole"), adapter(resumed)
    assert a.keys() == b.keys()
    bitwise = all(torch.equal(a[k], b[k]) for k in a)
    worst = max(((a[k].float() - b[k].float()).norm() / a[k].float().norm().clamp_min(1e-30)).item() for k in a)
    keep = os.environ.get("EXP_RESULTS_DIR")
    if keep:
        record = {"strategy": strategy, "overrides": args, "bitwise": bitwise, "max_relative_difference": worst}
        Path(keep, f"resume_killed_{strategy}.json").write_text(json.dumps(record, indent=2) + "\n")
    assert bitwise or worst <= 1e-6, worst


@pytest.mark.slow
def test_packed_sweep_spreads_jobs_over_both_gpus(tmp_path):
    """The `gpus` launcher packing by memory: four small jobs fit on either GPU, and it starts them on both."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", "-m", "hydra/launcher=gpus", "hydra.launcher.pack=true",
         "hydra.launcher.devices=[0,1]", "hardware=gpu", "hardware.compile=false", "trainer.max_steps=4",
         "trainer.val_every_n_steps=4", "trainer.sample_count=0", "logger=csv", "lora.r=4,8", "seeds=2",
         f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (sweep / "placements.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    ends = [e for e in events if e["event"] == "end"]
    assert len(starts) == 4 and {str(e["gpu"]) for e in starts} == {"0", "1"}
    assert [e["status"] for e in ends] == ["completed"] * 4
