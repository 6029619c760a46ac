"""One job of a Hydra multirun: reused when it already completed with the same config, else run in a fresh process
(its own run directory, W&B run and CUDA context), its outcome recorded whatever it is."""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from exp.core.config import ConfigError, TrainConfig
from exp.core.secrets import mask_secrets
from exp.run.compose import config_dict, read_resume_record, to_typed, write_run_config
from exp.run.dirs import claim_run_dir, read_status, release_run, write_status
from exp.run.security import remove_secret_pickles, write_hydra_record
from exp.study.launcher_watch import submitit_pickle, watch_launcher
from exp.study.records import SweepConflict, earlier_result, final_metric, record_job, restore_sweep_record
from exp.training.launch import run_job_process
from exp.training.signals import GUARD, REQUEUE_EXIT, Preempted, ends_recorded

log = logging.getLogger("exp.train")


def sweep_job(dcfg: DictConfig, job_dir: Path) -> float:
    """One job of a multirun: reused if it already completed with this config, else run in a fresh process.

    A failed job is recorded in its status.json and the sweep goes on; the sweep's exit status counts the failures
    (exp.study.records.SweepStatus). Returns the final validation loss (what sweepers minimise), +inf for a failed job. A
    job directory that holds another config stops the sweep (exit status 2) before anything is written.
    """

    with ends_recorded():  # a job process of a launcher (submitit) has no exp.train.cli around it
        return _sweep_job(dcfg, job_dir)


def _sweep_job(dcfg: DictConfig, job_dir: Path) -> float:
    hydra_cfg = HydraConfig.get()
    watch_launcher()  # a job in a process of its own (submitit) ends with the sweep's launcher
    if (submitted := submitit_pickle()) is not None:  # read at the job's start, not needed after it
        config = OmegaConf.create({**OmegaConf.to_container(dcfg, resolve=False), "hydra": hydra_cfg})
        remove_secret_pickles(Path(hydra_cfg.sweep.dir), config, [submitted])
    job = plan_sweep_job(dcfg, job_dir, Path(hydra_cfg.sweep.dir), Path(hydra.utils.get_original_cwd()))
    if job.reuse is not None:
        log.info("sweep: %s already completed with this config, skipped", job.reuse.name)
        return final_metric(job.reuse)
    record = OmegaConf.create(
        {**OmegaConf.to_container(dcfg, resolve=False), "hydra": OmegaConf.to_container(hydra_cfg, resolve=False)}
    )
    run_dir = start_sweep_job(job, record, hydra_cfg.job.override_dirname, Path(hydra_cfg.sweep.dir).name)
    if run_dir is None:
        return float("inf")
    try:
        rc = run_job_process(run_dir)
    finally:
        release_run(run_dir)
    status = read_status(run_dir)
    if GUARD.received is not None and rc == -GUARD.received:  # passed on before the job's own handler was in place
        name = signal.Signals(GUARD.received).name
        write_status(run_dir, "preempted", error=f"Preempted: stopped by {name} while the job process started")
        rc, status = REQUEUE_EXIT, read_status(run_dir)
    if rc == REQUEUE_EXIT and status.get("status") == "preempted":
        # The signal that stopped the job stops the sweep: re-launching it reuses the completed jobs.
        from exp.run.checkpoints import newest_checkpoint  # torch: the `gpus` launcher's process never loads it

        checkpoint = newest_checkpoint(run_dir, read_resume_record(run_dir))
        raise Preempted(GUARD.received or signal.SIGTERM, checkpoint=checkpoint, phase=f"sweep job {run_dir.name}")
    return sweep_job_result(run_dir, rc)


@dataclass
class SweepJob:
    """What one sweep job is to do, decided before anything is written."""

    job_dir: Path  # the job's directory as the sweep names it; a new attempt runs in `<job>_N` beside failed ones
    cfg: TrainConfig | None  # None: the config failed its checks (`error`)
    error: str = ""
    reuse: Path | None = None  # an attempt that completed with this config: its result stands


def plan_sweep_job(dcfg: DictConfig, job_dir: Path, sweep_dir: Path, launch_dir: Path) -> SweepJob:
    """Compose the job's typed config and find an attempt to reuse. Exits with status 2 (SweepConflict's message,
    multirun.yaml put back) when the job directory holds a job that was asked to run another config."""
    try:
        cfg = to_typed(dcfg, launch_dir)
    except ConfigError as e:
        return SweepJob(job_dir, None, error=str(e))
    try:
        return SweepJob(job_dir, cfg, reuse=earlier_result(job_dir, config_dict(cfg), sweep_dir))
    except SweepConflict as e:
        restore_sweep_record(sweep_dir)
        print(f"exp: error: {mask_secrets(str(e))}", file=sys.stderr, flush=True)
        sys.exit(2)


def start_sweep_job(
    job: SweepJob, record: DictConfig, run_name: str, group: str, memory_budget_gib: float | None = None
) -> Path | None:
    """Claim the job's run directory and write its records (Hydra's, redacted; the job's config and fingerprint);
    None when the config failed its checks, recorded there as a failed job.

    `memory_budget_gib`: the GPU memory a packing launcher gave the job (hardware.memory_budget_gib of the config it
    runs, when the config sets none). A placement, like CUDA_VISIBLE_DEVICES: the fingerprint is of the config the
    job was asked to run, so a re-launch placed otherwise still reuses it."""

    run_dir = claim_run_dir(job.job_dir)  # an earlier failed attempt keeps its files
    write_hydra_record(record, run_dir)
    if job.cfg is None:
        write_status(run_dir, "failed", error=job.error)
        release_run(run_dir)
        log.error("sweep: %s failed: %s", run_dir.name, job.error)
        return None
    # W&B: one run per job, named by its overrides, grouped by the sweep.
    job.cfg.logger.run_name = job.cfg.logger.run_name or run_name or run_dir.name
    job.cfg.logger.group = job.cfg.logger.group or group
    record_job(run_dir, config_dict(job.cfg))
    if memory_budget_gib is not None and job.cfg.hardware.memory_budget_gib is None:
        job.cfg.hardware.memory_budget_gib = memory_budget_gib
    write_run_config(job.cfg, run_dir)
    write_status(run_dir, "running")
    return run_dir


def sweep_job_result(run_dir: Path, rc: int) -> float:
    """The value a finished job returns to the sweeper: its final val/loss, +inf (recorded as failed) otherwise."""

    status = read_status(run_dir)
    if rc != 0 or status.get("status") != "completed":
        if status.get("status") != "failed":  # killed before it could say why
            write_status(run_dir, "failed", error=f"the job process exited with status {rc}")
        log.error("sweep: %s failed (exit %s): %s", run_dir.name, rc, read_status(run_dir).get("error", ""))
        return float("inf")
    return final_metric(run_dir)
