"""`python -m exp.train [overrides]`: fine-tune the LoRA adapters of a 4-bit Gemma.

`main` is the only Hydra-aware code: it turns the composed config into typed dataclasses and calls
`train(cfg, output_dir)`. `run([...overrides])` does the same from Python (a notebook, a test).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from exp.config import ConfigError, TrainConfig, register_configs, resolve_paths
from exp.overrides import check_cli_overrides, check_command_line
from exp.run_dir import (
    LAUNCH_ID_ENV,
    RESUME_RECORD,
    claim_run_dir,
    discard_run_dir,
    lock_run,
    new_run_dir,
    release_run,
    release_runs,
    shared_launch_id,
    write_json,
    write_status,
)
from exp.sweep import SweepConflict, earlier_result, final_metric, record_job, restore_sweep_record

log = logging.getLogger("exp.train")
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
register_configs()


@dataclass
class TrainResult:
    output_dir: Path
    adapter_dir: Path
    initial_val: dict[str, float]
    final_val: dict[str, float]
    chance_token_accuracy: float
    module: object | None  # the trained QLoRAModule (None when workers trained in other processes)


def train(cfg: TrainConfig, output_dir: Path, manage_run_dir: bool = True) -> TrainResult:
    """Fine-tune as `cfg` says, writing everything (config, metrics, checkpoints, adapter, train.log) under
    `output_dir`.

    `cfg` is expected to have passed the preflight (hardware resolved). With `manage_run_dir=False` (the workers
    of a multi-process run) the launching process owns config.yaml and status.json. A `resume.json` in
    `output_dir` (written by `execute`) names the checkpoint to continue from.
    """
    from exp.run_log import run_log

    with run_log(output_dir, cfg.verbose):
        return _train(cfg, output_dir, manage_run_dir)


def _train(cfg: TrainConfig, output_dir: Path, manage_run_dir: bool) -> TrainResult:
    import lightning as L
    import torch

    from exp.data import build_datamodule
    from exp.model import build_tokenizer, quiet_third_party_logs
    from exp.module import QLoRAModule
    from exp.run_log import RECORD, RecordMetrics
    from exp.signals import GUARD, Preempted
    from exp.tracking import build_loggers, finish_loggers, log_adapter_artifact, new_wandb_run_id, write_manifest
    from exp.trainer import build_trainer

    quiet_third_party_logs(cfg.verbose)
    started = time.time()
    config = config_dict(cfg)
    with GUARD.shielded():
        if manage_run_dir:
            write_run_config(cfg, output_dir)
            write_status(output_dir, "running")
    resume = read_resume_record(output_dir)
    loggers: list = []
    ok = preempted = False
    try:
        GUARD.stop_now()  # a signal that arrived while the run was being recorded
        L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
        GUARD.phase = "model build"
        tokenizer = build_tokenizer(cfg.model)
        GUARD.phase = "data preparation"
        hw = cfg.hardware
        step_micro_batches = cfg.accumulate_grad_batches * cfg.data_parallel_size
        datamodule = build_datamodule(cfg.data, tokenizer, hw.micro_batch_size, hw.num_workers, step_micro_batches)
        GUARD.phase = "start-up"
        module = QLoRAModule(cfg)
        checkpoint = Path(resume["checkpoint"]) if resume else None
        if resume:
            module.tracking_ids = dict(resume["tracking_ids"])
        if cfg.logger.kind.value == "wandb":
            module.tracking_ids.setdefault("wandb", new_wandb_run_id())
        module.last_good_checkpoint = functools.partial(_last_good_checkpoint, output_dir, checkpoint)
        run_name = cfg.logger.run_name or "-".join(filter(None, [cfg.experiment_name, cfg.model.name, output_dir.name]))
        loggers = build_loggers(
            cfg.logger, output_dir, run_name, config, cfg.experiment_name, module.tracking_ids.get("wandb")
        )
        trainer = build_trainer(
            cfg,
            output_dir,
            [*loggers, RecordMetrics(lambda: module.trainer.global_step)],
            resuming=checkpoint is not None,
        )
        if trainer.is_global_zero:
            write_manifest(output_dir, tokenizer, cfg.data)
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=str(checkpoint) if checkpoint else None)
            trainer.validate(module, datamodule=datamodule, verbose=False)  # the final evaluation, at the last step
        except torch.OutOfMemoryError as e:
            from exp.faults import oom_diagnosis

            raise oom_diagnosis(cfg, module.device, trainer.global_step) from e
        GUARD.phase = "saving the results"
        adapter_dir = output_dir / "adapter"
        result = TrainResult(
            output_dir,
            adapter_dir,
            module.initial_val or {},
            module.last_val,
            datamodule.majority_token_accuracy(),
            module,
        )
        replicas_agree = module.check_replicas_agree()  # every rank must hold the same adapters
        placements = module.gather_placements()
        GUARD.stop_now()  # the last moment to stop: from here the run finishes (seconds) whatever arrives
        # The results are written whole: a signal from here on is noted, and the run completes first.
        with GUARD.shielded():
            save_adapter(module, trainer, adapter_dir, tokenizer)
            if trainer.is_global_zero:
                summary = {
                    "steps": trainer.global_step,
                    "seconds": round(time.time() - started, 1),
                    "initial_val": result.initial_val,
                    "final_val": result.final_val,
                    "chance_token_accuracy": result.chance_token_accuracy,
                    **module.throughput_summary(),
                    "device": str(module.device),
                    "world_size": trainer.world_size,
                    "replica_adapter_checksums": replicas_agree,
                    "placement_per_rank": placements,
                    "epochs": round(module.batches_seen * trainer.world_size / datamodule.batches_per_epoch, 3),
                    "skipped_steps": module.skipped_steps,
                    "resumed_from": resume,
                    "data": datamodule.stats,
                }
                write_json(output_dir / "summary.json", summary)
                print_summary(summary, output_dir)
                if cfg.logger.log_adapter:
                    log_adapter_artifact(loggers, adapter_dir, run_name)
            ok = True
        return result
    except BaseException as e:
        with GUARD.shielded():
            stop = e if isinstance(e, Preempted) else None
            if stop is None and GUARD.received is not None and not isinstance(e, ConfigError):
                # Failed after a signal: a process group's signal also ends the run's DataLoader workers, and the
                # next batch then fails. The signal is what stopped the run.
                stop = Preempted(GUARD.received, phase=GUARD.phase)
            preempted = stop is not None
            if stop is not None and stop.checkpoint is None:  # stopped outside the training loop: where to go on from
                stop.checkpoint = newest_checkpoint(output_dir, resume)
            error = f"Preempted: {stop}" if stop is not None else f"{type(e).__name__}: {e}"
            RECORD.error("run %s: %s", "preempted" if preempted else "failed", error)
            if manage_run_dir:
                write_status(output_dir, "preempted" if preempted else "failed", error=error)
        if stop is not None and stop is not e:
            raise stop from e
        raise
    finally:
        with GUARD.shielded():
            finish_loggers(loggers, ok, preempted)
            if ok and manage_run_dir:
                write_status(output_dir, "completed")
        if ok and GUARD.received is not None and not GUARD.acted:
            name = signal.Signals(GUARD.received).name
            print(f"exp: {name} arrived while the results were being saved; the run completed first", flush=True)


def newest_checkpoint(output_dir: Path, resume: dict | None) -> Path | None:
    """Where a run stopped outside its training loop goes on from: its newest checkpoint, or the one it continued."""
    found = _last_good_checkpoint(output_dir, Path(resume["checkpoint"]) if resume else None)
    return Path(found) if found else None


def _last_good_checkpoint(output_dir: Path, resumed_from: Path | None) -> str | None:
    """The newest checkpoint this run (or the run it continues) has on disk: where to go back to."""
    from exp.checkpoints import candidates

    found = candidates(output_dir)
    return str(found[0]) if found else (str(resumed_from) if resumed_from else None)


def read_resume_record(run_dir: Path) -> dict | None:
    path = run_dir / RESUME_RECORD
    return json.loads(path.read_text()) if path.exists() else None


def config_dict(cfg: TrainConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def write_run_config(cfg: TrainConfig, output_dir: Path) -> None:
    (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(config_dict(cfg)))


def load_run_config(run_dir: Path) -> TrainConfig:
    """The typed config a run recorded (what its workers, and a resumed run, train with)."""
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(run_dir / "config.yaml"))
    return OmegaConf.to_object(merged)


def save_adapter(module, trainer, adapter_dir: Path, tokenizer=None) -> None:
    """Write the adapter in PEFT's format (and the tokenizer) from rank 0; under FSDP every rank takes part in
    gathering it first. Written into a temporary directory renamed into place: `adapter/` is whole or absent."""
    import shutil

    from exp.config import Strategy

    tmp = adapter_dir.with_name(f".{adapter_dir.name}.{os.getpid()}.partial")
    if module.cfg.hardware.strategy == Strategy.fsdp:
        from exp.fsdp import gather_trainable, save_peft_adapter

        full = gather_trainable(trainer.strategy.model, module)
        if trainer.is_global_zero:
            save_peft_adapter(module.model, {k.removeprefix("model."): v for k, v in full.items()}, tmp)
    elif trainer.is_global_zero:
        module.model.save_pretrained(tmp)  # adapter_config.json + safetensors
    if not trainer.is_global_zero:
        return
    try:
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        os.replace(tmp, adapter_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def print_summary(s: dict, output_dir: Path) -> None:
    """The run's outcome on the console, and in train.log."""
    from exp.run_log import RECORD

    first, last = s["initial_val"], s["final_val"]
    drop = 100 * (1 - last["val/loss"] / first["val/loss"]) if first else float("nan")
    text = (
        f"exp: {s['steps']} steps in {s['seconds']:.0f} s -> {output_dir}\n"
        f"  val loss        {first.get('val/loss', float('nan')):.3f} -> {last['val/loss']:.3f} ({drop:.0f}% lower)\n"
        f"  token accuracy  {last['val/token_accuracy']:.3f} (majority-token baseline "
        f"{s['chance_token_accuracy']:.3f})\n"
        f"  exact match     {last['val/exact_match']:.3f} (step 0: {first.get('val/exact_match', 0):.3f})\n"
        f"  throughput      {s['tokens_per_s_median']} tokens/s (median step)"
        + (f", peak memory {s['peak_memory_gib']} GiB" if s.get("peak_memory_gib") else "")
        + f"\n  adapter         {output_dir / 'adapter'}"
    )
    print(f"\n{text}", flush=True)
    RECORD.info("summary\n%s", text)


def to_typed(dcfg: DictConfig, launch_dir: Path) -> TrainConfig:
    from exp.tracking import secret_value_problems

    cfg: TrainConfig = OmegaConf.to_object(dcfg)  # runs the schema's cross-field validation
    if problems := secret_value_problems(config_dict(cfg)):
        raise ConfigError("\n".join(problems))
    return resolve_paths(cfg, launch_dir)


def prepare_resume(cfg: TrainConfig, output_dir: Path, launch_dir: Path) -> None:
    """Find the checkpoint `trainer.resume` asks for and record it in `resume.json` (every worker reads it)."""
    from exp.resume import resolve

    point = resolve(cfg, config_dict(cfg), output_dir, launch_dir)
    if point is not None:
        record = {
            "checkpoint": str(point.checkpoint),
            "run": str(point.run_dir),
            "step": point.step,
            "tracking_ids": point.state["exp"]["tracking_ids"],  # the W&B run to continue
        }
        write_json(output_dir / RESUME_RECORD, record)


def execute(cfg: TrainConfig, output_dir: Path, launch_dir: Path | None = None) -> TrainResult:
    """Preflight, then train here (one process) or in one worker per device; never leaves a run unmarked."""
    from exp.run_log import run_log

    with run_log(output_dir, cfg.verbose):
        return _execute(cfg, output_dir, launch_dir)


def _execute(cfg: TrainConfig, output_dir: Path, launch_dir: Path | None) -> TrainResult:
    from exp.launch import close_process_group, launch_workers, needs_launch
    from exp.preflight import PREFLIGHT_EXIT, format_findings, run_preflight
    from exp.run_log import RECORD
    from exp.signals import REQUEUE_EXIT

    check = run_preflight(cfg)
    for note in check.notes:
        log.info("preflight: %s", note)
    if not check.ok:
        message = format_findings(check)
        write_status(output_dir, "failed", error=message)
        RECORD.error("%s", message)
        print(message, file=sys.stderr)
        sys.exit(PREFLIGHT_EXIT)
    cfg = check.cfg
    prepare_resume(cfg, output_dir, launch_dir or Path.cwd())
    if not needs_launch(cfg):
        try:
            return train(cfg, output_dir)
        finally:
            close_process_group()  # under torchrun / SLURM this process is a rank: same exit hazard as exp's workers
    write_run_config(cfg, output_dir)
    write_status(output_dir, "running")
    log.info("launching %d processes (%s) for %s", cfg.hardware.devices, cfg.hardware.strategy.value, output_dir)
    rc = launch_workers(cfg, output_dir)
    summary_path = output_dir / "summary.json"
    if rc == REQUEUE_EXIT:
        checkpoint = newest_checkpoint(output_dir, read_resume_record(output_dir))
        where = f"checkpoint {checkpoint}" if checkpoint else "before any checkpoint: nothing to resume"
        write_status(
            output_dir, "preempted", error=f"Preempted: the worker processes were stopped by a signal; {where}"
        )
        sys.exit(rc)
    if rc != 0 or not summary_path.exists():
        write_status(output_dir, "failed", error=f"a worker process exited with status {rc}")
        sys.exit(rc or 1)
    write_status(output_dir, "completed")
    summary = json.loads(summary_path.read_text())
    return TrainResult(
        output_dir,
        output_dir / "adapter",
        summary["initial_val"],
        summary["final_val"],
        summary["chance_token_accuracy"],
        None,
    )


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(dcfg: DictConfig) -> float:
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return sweep_job(dcfg, Path(hydra_cfg.runtime.output_dir))
    output_dir = Path(hydra_cfg.runtime.output_dir)
    # The ranks of a torchrun / SLURM launch share their run directory (checked by `cli`); one process claims its own.
    if os.environ.get(LAUNCH_ID_ENV):
        lock_run(output_dir)  # rank 0 holds the launch's lock: the run is in use while it runs
    else:
        output_dir = claim_run_dir(output_dir)  # claimed by `cli` already, unless main is called another way
    launch_dir = Path(hydra.utils.get_original_cwd())
    try:
        cfg = to_typed(dcfg, launch_dir)
        result = execute(cfg, output_dir, launch_dir)
    except BaseException as e:
        if not (refused(e) and discard_run_dir(output_dir)):
            record_stop(output_dir, e)
        exit_on_known_error(e)
        raise
    return result.final_val["val/loss"]  # the value Hydra sweepers minimise


def refused(e: BaseException) -> bool:
    """The run stopped before training: bad input (exit status 2) or a failed preflight (3). Its directory, if this
    process made it, is removed again (exp.run_dir.discard_run_dir): the message says all there is to say."""
    from exp.preflight import PREFLIGHT_EXIT

    return isinstance(e, ConfigError) or (isinstance(e, SystemExit) and e.code == PREFLIGHT_EXIT)


def record_stop(run_dir: Path, e: BaseException) -> None:
    """The status of a run that stopped outside `train` (which records its own): a bad config, or a signal during
    start-up or the preflight."""
    from exp.run_dir import read_status
    from exp.signals import GUARD, Preempted

    with GUARD.shielded():
        if isinstance(e, ConfigError):
            write_status(run_dir, "failed", error=str(e))
        elif isinstance(e, Preempted) and read_status(run_dir).get("status") != "preempted":
            e.checkpoint = e.checkpoint or newest_checkpoint(run_dir, read_resume_record(run_dir))
            write_status(run_dir, "preempted", error=f"Preempted: {e}")


def exit_on_known_error(e: BaseException) -> None:
    """Bad input, a fault during training or a preemption: print its message (no traceback) and exit with its
    status (2: configuration, 1: training fault, 75: preempted, requeue). Anything else returns (and is raised)."""
    from exp.tracking import mask_secrets

    if isinstance(e, ConfigError):
        print(f"exp: error: {mask_secrets(str(e))}", file=sys.stderr)
        sys.exit(2)
    # Imported only now: a configuration error should not pay for importing torch and Lightning.
    from exp.faults import TrainingFault
    from exp.signals import REQUEUE_EXIT, Preempted

    if isinstance(e, TrainingFault):
        print(f"exp: error: {mask_secrets(str(e))}", file=sys.stderr)
        sys.exit(1)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        # The disk, not the run: every file is written atomically, so what was written before is intact.
        print(
            f"exp: error: {e.strerror} while writing {e.filename or 'the run directory'}. Nothing written before was "
            "lost (files are replaced whole). Free space (or use a writable disk: hydra.run.dir=...), then continue "
            "with trainer.resume=auto.",
            file=sys.stderr,
        )
        sys.exit(1)
    if isinstance(e, Preempted):
        print(f"exp: {e}", file=sys.stderr)
        sys.exit(REQUEUE_EXIT)


def sweep_job(dcfg: DictConfig, job_dir: Path) -> float:
    """One job of a multirun: reused if it already completed with this config, else run in a fresh process.

    A failed job is recorded in its status.json and the sweep goes on; the sweep's exit status counts the failures
    (exp.sweep.SweepStatus). Returns the final validation loss (what sweepers minimise), +inf for a failed job. A
    job directory that holds another config stops the sweep (exit status 2) before anything is written.
    """
    from exp.launch import run_job_process
    from exp.run_dir import read_status
    from exp.signals import GUARD, REQUEUE_EXIT, Preempted

    hydra_cfg = HydraConfig.get()
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
    if rc == REQUEUE_EXIT and status.get("status") == "preempted":
        # The signal that stopped the job stops the sweep: re-launching it reuses the completed jobs.
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
        from exp.tracking import mask_secrets

        restore_sweep_record(sweep_dir)
        print(f"exp: error: {mask_secrets(str(e))}", file=sys.stderr, flush=True)
        sys.exit(2)


def start_sweep_job(job: SweepJob, record: DictConfig, run_name: str, group: str) -> Path | None:
    """Claim the job's run directory and write its records (Hydra's, redacted; the job's config and fingerprint);
    None when the config failed its checks, recorded there as a failed job."""
    from exp.security import write_hydra_record

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
    write_run_config(job.cfg, run_dir)
    write_status(run_dir, "running")
    return run_dir


def sweep_job_result(run_dir: Path, rc: int) -> float:
    """The value a finished job returns to the sweeper: its final val/loss, +inf (recorded as failed) otherwise."""
    from exp.run_dir import read_status

    status = read_status(run_dir)
    if rc != 0 or status.get("status") != "completed":
        if status.get("status") != "failed":  # killed before it could say why
            write_status(run_dir, "failed", error=f"the job process exited with status {rc}")
        log.error("sweep: %s failed (exit %s): %s", run_dir.name, rc, read_status(run_dir).get("error", ""))
        return float("inf")
    return final_metric(run_dir)


def compose_config(overrides: list[str], launch_dir: Path | None = None) -> TrainConfig:
    """The typed config `python -m exp.train <overrides>` would run, composed without a run directory.

    Unknown keys, bad values and failed cross-field checks raise one ConfigError (the CLI's messages).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    problems = check_cli_overrides(overrides)
    if problems:
        raise ConfigError("\n".join(problems))
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            dcfg = compose(config_name="train", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e)) from e
    return to_typed(dcfg, launch_dir or Path.cwd())


def run(overrides: list[str] | None = None, output_dir: str | Path | None = None) -> TrainResult:
    """Compose the config as the CLI would and train; each call is a fresh run in a fresh directory."""
    cfg = compose_config(list(overrides or []))
    from exp.signals import guarded

    with guarded():
        out = claim_run_dir(Path(output_dir)) if output_dir else new_run_dir(Path.cwd() / "outputs")
        try:
            return execute(cfg, out, Path.cwd())
        except BaseException as e:
            if not (refused(e) and discard_run_dir(out)):
                record_stop(out, e)
            raise
        finally:
            release_runs()  # the run directory and any run it continued: free for the next call


def cli() -> None:
    from exp.signals import GUARD, REQUEUE_EXIT, Preempted

    GUARD.install()  # from the first moment: a signal never kills a run without a word and a true status.json
    try:
        _cli()
    except Preempted as e:  # before Hydra ran `main` (which handles its own)
        claimed = [Path(a.split("=", 1)[1][1:-1]) for a in sys.argv[1:] if a.startswith('hydra.run.dir="')]
        if claimed and (claimed[-1] / "status.json").exists():
            record_stop(claimed[-1], e)
        elif {"-m", "--multirun"} & set(sys.argv[1:]):
            e.phase = "the sweep, between jobs (the jobs' own directories say how each ended)"
        else:
            e.phase = "start-up, before a run directory was made (nothing was written)"
        print(f"exp: {e}", file=sys.stderr)
        sys.exit(REQUEUE_EXIT)


def _cli() -> None:
    from exp.cli import VERBOSE_FLAGS

    argv = ["verbose=true" if a in VERBOSE_FLAGS else a for a in sys.argv[1:]]
    launch = shared_launch_id() if not {"-m", "--multirun"} & set(argv) else None
    if launch is not None:
        # One rank of a torchrun / SLURM launch: every rank must write into one run directory.
        if not launch:
            print(
                "exp: error: this is one of several processes started by torchrun, which gives them no shared "
                "launch id (TORCHELASTIC_RUN_ID=none), so they cannot agree on a run directory. Start torchrun with "
                "--standalone (one machine) or --rdzv-id=<id> (several machines), or run under SLURM (srun).",
                file=sys.stderr,
            )
            sys.exit(2)
        os.environ[LAUNCH_ID_ENV] = launch
        if not any(a.lstrip("+").split("=", 1)[0] == "hydra.run.dir" for a in argv):
            argv = [*argv, f"hydra.run.dir=outputs/{launch}"]
    # Checked and composed before Hydra starts: Hydra instantiates callbacks and writes the run directory first.
    problems, sys.argv[1:] = check_command_line(argv, __file__, str(CONF_DIR), "train", launch)
    if problems:
        from exp.tracking import mask_secrets

        print("exp: error: " + mask_secrets("\n".join(problems)), file=sys.stderr)
        sys.exit(2)
    if launch:
        from exp.launch import end_rank

        end_rank(main)  # a rank ends as exp's own workers do: no interpreter teardown of gloo's threads
    sys.argv[1:] = claim_pinned_run_dir(sys.argv[1:])
    main()


def claim_pinned_run_dir(argv: list[str]) -> list[str]:
    """Claim the run directory `check_command_line` pinned (a sweep pins none) before Hydra writes into it: a
    directory holding a run, or being claimed by a launch started at the same moment, gives way to `<dir>_N`."""
    from exp.overrides import with_run_dir

    pinned = [a for a in argv if a.startswith('hydra.run.dir="')]
    if not pinned:
        return argv
    wanted = Path(pinned[-1].split("=", 1)[1][1:-1].replace('\\"', '"').replace("\\\\", "\\"))
    try:
        claimed = claim_run_dir(wanted)
    except ConfigError as e:
        print(f"exp: error: {e}", file=sys.stderr)
        sys.exit(2)
    if claimed != wanted:
        print(f"exp: {wanted} already holds a run; this one goes to {claimed}", file=sys.stderr)
    return with_run_dir(argv, claimed)


if __name__ == "__main__":
    cli()
