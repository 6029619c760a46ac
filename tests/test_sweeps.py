"""Multirun studies on the CPU: failures recorded and counted, re-launch skips, isolated jobs, Optuna, submitit,
the report, and the manifest every run leaves."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exp.sweep import job_groups

ROOT = Path(__file__).resolve().parents[1]
FAST = [
    "trainer.max_steps=3",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=3",
    "trainer.log_every_n_steps=1",
    "data.num_examples=120",
    "logger=csv",
]


def exp(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Three jobs, the third made to fail (a target module that does not exist), then the same sweep again."""
    cwd = tmp_path_factory.mktemp("sweep")
    args = [
        "exp.train",
        "-m",
        "lora.target_modules=[q_proj,v_proj],[v_proj],[q_proj,nope_proj]",
        *FAST,
        "hydra.sweep.dir=study",
        "hydra.job.config.override_dirname.exclude_keys=[" + ",".join(a.split("=")[0] for a in FAST) + "]",
    ]
    first = exp(args, cwd)
    adapters = sorted((cwd / "study").glob("*/adapter/adapter_model.safetensors"))
    stamps = {p: p.stat().st_mtime_ns for p in adapters}
    second = exp(args, cwd)
    return cwd / "study", first, second, stamps


def test_failed_job_is_recorded_and_counted_and_the_sweep_goes_on(sweep):
    study, first, _, _ = sweep
    assert first.returncode == 1, first.stderr[-3000:]  # one job failed
    groups = job_groups(study)
    status = {job.split("_", 1)[0]: json.loads((dirs[0] / "status.json").read_text()) for job, dirs in groups.items()}
    assert [status[k]["status"] for k in ("0", "1", "2")] == ["completed", "completed", "failed"]
    assert "nope_proj" in status["2"]["error"] and "Available" in status["2"]["error"]
    assert "1 failed" in first.stdout + first.stderr


def test_relaunch_skips_completed_jobs_and_keeps_their_files(sweep):
    study, _, second, stamps = sweep
    assert second.returncode == 1
    assert (second.stdout + second.stderr).count("already completed, skipped") == 2
    assert stamps and all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    failed_job = next(dirs for job, dirs in job_groups(study).items() if job.startswith("2_"))
    assert len(failed_job) == 2  # the retry ran in its own directory; the first attempt's files are kept


def test_report_matches_the_jobs_own_files(sweep):
    study, _, _, _ = sweep
    proc = exp(["exp.report", str(study)], study.parent)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader((study / "report.csv").open()))
    assert [r["status"] for r in rows] == ["completed", "completed", "failed", "failed"]
    for r in rows[:2]:
        job = next(d for d in study.iterdir() if d.name.startswith(r["job"] + "_"))
        summary = json.loads((job / "summary.json").read_text())
        assert float(r["final val/loss"]) == pytest.approx(summary["final_val"]["val/loss"], rel=1e-3)
        assert int(r["steps"]) == summary["steps"] == 3
    assert rows[0]["final val/loss"] <= rows[1]["final val/loss"]  # sorted by the metric
    png = study / "loss_curves.png"
    assert png.exists() and png.stat().st_size > 5000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (study / "val_loss_vs_lora.target_modules.png").exists()
    assert "lora.target_modules" in (study / "report.md").read_text()


def test_report_shows_a_running_job(tmp_path, sweep):
    study, _, _, _ = sweep
    running = tmp_path / "study"
    (running / "0_x").mkdir(parents=True)
    (running / "0_x" / ".hydra").mkdir()
    proc = exp(["exp.report", str(running)], tmp_path)
    assert proc.returncode == 0 and "running" in proc.stdout


def test_jobs_are_isolated(tmp_path):
    """Two identical jobs: a leak of any state from the first (RNG, W&B run, model, globals) would change the second."""
    proc = exp(["exp.train", "-m", "trainer.seed=0,0", *FAST[:-1], "logger=wandb", "hydra.sweep.dir=iso"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted((tmp_path / "iso").glob("*/summary.json"))
    assert len(jobs) == 2
    a, b = (json.loads(p.read_text()) for p in jobs)
    assert a["final_val"] == b["final_val"] and a["initial_val"] == b["initial_val"]
    runs = [next((p.parent / "wandb").glob("offline-run-*")).name for p in jobs]
    assert runs[0] != runs[1]  # each job its own W&B run
    first_log = (jobs[0].parent / "train.log").read_text()
    assert str(jobs[1].parent) not in first_log


def test_optuna_sweep_minimises_the_returned_metric(tmp_path):
    proc = exp(
        [
            "exp.train",
            "-m",
            "--config-dir",
            str(ROOT / "sweeps"),
            "--config-name",
            "optuna_lr_rank",
            "hydra.sweeper.n_trials=2",
            *FAST,
            "hydra.sweep.dir=opt",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from omegaconf import OmegaConf

    result = OmegaConf.load(tmp_path / "opt" / "optimization_results.yaml")
    finals = [json.loads(p.read_text())["final_val"]["val/loss"] for p in (tmp_path / "opt").glob("*/summary.json")]
    assert len(finals) == 2 and result.best_value == pytest.approx(min(finals))
    assert set(result.best_params) == {"trainer.learning_rate", "lora.r", "lora.alpha", "lora.dropout"}


def test_grid_sweep_file_composes_and_runs(tmp_path):
    proc = exp(
        [
            "exp.train",
            "-m",
            "--config-dir",
            str(ROOT / "sweeps"),
            "--config-name",
            "lora_rank_grid",
            "lora.r=4",
            "trainer.learning_rate=5e-3",
            *FAST,
            "hydra.sweep.dir=grid",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((tmp_path / "grid").glob("*/summary.json"))) == 1


def test_submitit_local_launcher_runs_jobs(tmp_path):
    proc = exp(
        [
            "exp.train",
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=10",
            "lora.r=4,8",
            *FAST,
            "hydra.sweep.dir=sub",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = [json.loads(p.read_text())["status"] for p in (tmp_path / "sub").glob("*/status.json")]
    assert statuses == ["completed", "completed"]


def test_slurm_launcher_config_composes(tmp_path):
    proc = exp(
        [
            "exp.train",
            "hydra/launcher=slurm",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.timeout_min=30",
            "--cfg",
            "hydra",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for expected in ("SlurmLauncher", "partition: gpu", "gpus_per_node: 1", "timeout_min: 30", "tasks_per_node: 1"):
        assert expected in proc.stdout


def test_gpu_launcher_gives_each_parallel_job_its_own_device(tmp_path):
    """Devices named explicitly so the test runs without GPUs: each job must see exactly its own one."""
    env_threads = {"OMP_NUM_THREADS": "1"}  # two jobs share this machine's cores
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "exp.train",
            "-m",
            "hydra/launcher=gpus",
            "hydra.launcher.devices=[0,1]",
            "lora.r=4,8",
            *FAST,
            "hydra.sweep.dir=gp",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, **env_threads),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifests = [json.loads(p.read_text()) for p in sorted((tmp_path / "gp").glob("*/manifest.json"))]
    assert sorted(m["hardware"]["cuda_visible_devices"] for m in manifests) == ["0", "1"]
    assert "Launching 2 jobs on 2 GPU(s)" in proc.stdout + proc.stderr


def test_manifest_records_how_the_run_was_made(short_run):
    m = json.loads((short_run.output_dir / "manifest.json").read_text())
    assert m["packages"]["torch"] and m["packages"]["bitsandbytes"] and m["python"]
    assert m["data_fingerprint"].startswith("generated:") and len(m["tokenizer_sha256"]) == 64
    assert m["hardware"]["cpus"] >= 1 and "git" in m and m["command"]


def test_per_step_lr_and_grad_norm_are_logged(short_run):
    rows = list(csv.DictReader((short_run.output_dir / "csv" / "metrics.csv").open()))
    lrs = [float(r["train/lr"]) for r in rows if r.get("train/lr")]
    norms = [float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")]
    assert len(lrs) == 30 and len(norms) == 30 and all(n > 0 for n in norms)
