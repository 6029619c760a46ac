"""Jobs sharing one base on a CUDA GPU (`hardware=gpu`): bf16 autocast, the fused or chunked loss per job, kept
dequantized weights. Each grouped job's losses against the same job run alone (compiled, padding-free, as
`hardware=gpu` runs it)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from exp.run.compose import compose_config, write_run_config
from exp.run.dirs import claim_run_dir, release_run

pytestmark = pytest.mark.gpu

COMMON = [
    "hardware=gpu",
    "trainer.max_steps=30",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=30",
    "trainer.log_every_n_steps=1",
    "trainer.checkpoint_every_n_steps=1000",
    "trainer.sample_count=0",
    "trainer.global_batch_size=8",
    "hardware.micro_batch_size=8",
    "hardware.auto_micro_batch=false",
    "data.num_examples=600",
    "logger=csv",
    "lora.dropout=0",
]
JOBS = [
    ["lora.r=4", "trainer.learning_rate=2e-3"],
    ["lora.r=16", "trainer.learning_rate=5e-3", "trainer.seed=1", "data.seed=1"],
]


def _losses(run_dir: Path) -> dict[int, float]:
    with (run_dir / "csv" / "metrics.csv").open() as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def test_a_group_on_the_gpu_trains_each_job_as_alone(tmp_path):
    """Per-step losses within 1% over 30 steps and the final validation loss within 1e-3 of each job run alone
    (bf16: the group compiles the parts of its layers without adapters, the single run its whole layers, so the
    roundings differ)."""
    from exp.train import run

    dirs = []
    for i, job in enumerate(JOBS):
        run(COMMON + job, output_dir=tmp_path / f"alone{i}")
        d = claim_run_dir(tmp_path / f"group{i}")
        write_run_config(compose_config(COMMON + job), d)
        release_run(d)
        dirs.append(str(d))
    proc = subprocess.run([sys.executable, "-m", "exp.study.group_worker", *dirs], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i in range(len(JOBS)):
        alone, grouped = tmp_path / f"alone{i}", tmp_path / f"group{i}"
        a, g = _losses(alone), _losses(grouped)
        assert sorted(a) == sorted(g)
        worst = max(abs(g[s] - a[s]) / abs(a[s]) for s in a)
        sa = json.loads((alone / "summary.json").read_text())
        sg = json.loads((grouped / "summary.json").read_text())
        final = abs(sg["final_val"]["val/loss"] / sa["final_val"]["val/loss"] - 1)
        print(
            f"job {i}: per-step loss within {worst:.2e}, final val/loss within {final:.2e}; peak {sg['peak_memory_gib']} GiB"
        )
        assert worst < 0.01
        assert final < 1e-3
        assert sg["device"].startswith("cuda")
        assert sg["compile"]["graphs"] >= 1  # hardware=gpu compiles: the group its parts without adapters
