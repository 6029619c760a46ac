"""One training job, start to end: the preflight, then the fit here or in one worker process per device, the final
evaluation, the adapter, the summary, and a true `status.json` however the job ends."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from exp.core.config import ConfigError, LoggerKind, Strategy, TrainConfig
from exp.core.secrets import mask_secrets
from exp.hardware.preflight import PREFLIGHT_EXIT, format_findings, run_preflight
from exp.model.build import quiet_third_party_logs
from exp.run.checkpoints import last_good_checkpoint, newest_checkpoint
from exp.run.compose import config_dict, read_resume_record, write_run_config
from exp.run.dirs import RESUME_RECORD, RunLayout, read_status, write_json, write_status
from exp.run.logs import RECORD, RecordMetrics, run_log
from exp.run.resume import resolve
from exp.run.tracking import (
    build_loggers,
    finish_loggers,
    log_adapter_artifact,
    new_wandb_run_id,
    write_manifest,
)
from exp.training.faults import TrainingFault, oom_diagnosis
from exp.training.fit import build_fit
from exp.training.fsdp import gather_trainable, save_peft_adapter
from exp.training.launch import close_process_group, launch_workers, needs_launch
from exp.training.module import QLoRAModule, continued_schedule_note
from exp.training.signals import GUARD, REQUEUE_EXIT, Preempted

log = logging.getLogger("exp.train")


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

    with run_log(output_dir, cfg.verbose):
        return _train(cfg, output_dir, manage_run_dir)


def _train(cfg: TrainConfig, output_dir: Path, manage_run_dir: bool) -> TrainResult:

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
        checkpoint = Path(resume["checkpoint"]) if resume else None
        tracking_ids = dict(resume["tracking_ids"]) if resume else {}
        if cfg.logger.kind == LoggerKind.wandb:
            tracking_ids.setdefault("wandb", new_wandb_run_id())
        run_name = cfg.logger.run_name or "-".join(filter(None, [cfg.experiment_name, cfg.model.name, output_dir.name]))

        def run_loggers(module: QLoRAModule) -> list:
            # Kept in `loggers`, which `finally` finishes, also when the Trainer's build fails after them.
            loggers.extend(
                build_loggers(
                    cfg.logger,
                    output_dir,
                    run_name,
                    config,
                    cfg.experiment_name,
                    module.tracking_ids.get("wandb"),
                    steps_done=lambda: module.trainer.global_step,
                )
            )
            return [*loggers, RecordMetrics(lambda: module.trainer.global_step)]

        tokenizer, datamodule, module, trainer = build_fit(
            cfg,
            output_dir,
            run_loggers,
            tracking_ids=tracking_ids,
            last_good_checkpoint=functools.partial(last_good_checkpoint, output_dir, checkpoint),
            resuming=checkpoint is not None,
        )
        if trainer.is_global_zero:
            write_manifest(output_dir, tokenizer, cfg.data)
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=str(checkpoint) if checkpoint else None)
            # The final evaluation, at the last step, unless fit's own validation has just measured that step (the
            # same weights, split and batches: a second one would record the same numbers twice).
            if module.last_val_step != trainer.global_step:
                trainer.validate(module, datamodule=datamodule, verbose=False)
        except torch.OutOfMemoryError as e:
            raise oom_diagnosis(cfg, module.device, trainer.global_step) from e
        GUARD.phase = "saving the results"
        adapter_dir = RunLayout(output_dir).adapter
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
        throughput = module.gather_throughput()
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
                    **throughput,
                    "device": str(module.device),
                    "world_size": trainer.world_size,
                    "replica_adapter_checksums": replicas_agree,
                    "placement_per_rank": placements,
                    "epochs": round(module.batches_seen * trainer.world_size / datamodule.batches_per_epoch, 3),
                    "skipped_steps": module.skipped_steps,
                    "resumed_from": resume,
                    "data": datamodule.stats,
                }
                write_json(RunLayout(output_dir).summary, summary)
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


def save_adapter(module, trainer, adapter_dir: Path, tokenizer=None) -> None:
    """Write the adapter in PEFT's format (and the tokenizer) from rank 0; under FSDP every rank takes part in
    gathering it first. Written into a temporary directory renamed into place: `adapter/` is whole or absent."""

    tmp = adapter_dir.with_name(f".{adapter_dir.name}.{os.getpid()}.partial")
    if module.cfg.hardware.strategy == Strategy.fsdp:
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


def compile_line(s: dict) -> str:
    """What compiling cost the run (compiled runs only): graphs, seconds, and the warm-up beyond two median steps
    (what a second run of the same shape saves from the compile cache)."""
    c = s.get("compile")
    if not c:
        return ""
    warmup = f"; first two steps {s['warmup_extra_s']} s over the median" if s.get("warmup_extra_s") is not None else ""
    return f"\n  compile         {c['graphs']} graphs in {c['seconds']} s{warmup}"


def print_summary(s: dict, output_dir: Path) -> None:
    """The run's outcome on the console, and in train.log."""

    first, last = s["initial_val"], s["final_val"]
    drop = 100 * (1 - last["val/loss"] / first["val/loss"]) if first else float("nan")
    n = len(s.get("per_rank") or ())
    ranks, per_device = (f", {n} processes together", " on the fullest device") if n else ("", "")
    text = (
        f"exp: {s['steps']} steps in {s['seconds']:.0f} s -> {output_dir}\n"
        f"  val loss        {first.get('val/loss', float('nan')):.3f} -> {last['val/loss']:.3f} ({drop:.0f}% lower)\n"
        f"  token accuracy  {last['val/token_accuracy']:.3f} (majority-token baseline "
        f"{s['chance_token_accuracy']:.3f})\n"
        f"  exact match     {last['val/exact_match']:.3f} (step 0: {first.get('val/exact_match', 0):.3f})\n"
        + (f"  validated on    {s['data']['validated_on']}\n" if s.get("data", {}).get("validated_on") else "")
        + f"  throughput      {s['tokens_per_s_median']} real tokens/s (median step{ranks})"
        + (f", {s['padding_fraction']:.1%} padding" if s.get("padding_fraction") is not None else "")
        + (f", peak memory {s['peak_memory_gib']} GiB{per_device}" if s.get("peak_memory_gib") else "")
        + compile_line(s)
        + f"\n  adapter         {output_dir / 'adapter'}"
    )
    print(f"\n{text}", flush=True)
    RECORD.info("summary\n%s", text)


def prepare_resume(cfg: TrainConfig, output_dir: Path, launch_dir: Path) -> None:
    """Find the checkpoint `trainer.resume` asks for and record it in `resume.json` (every worker reads it)."""

    point = resolve(cfg, config_dict(cfg), output_dir, launch_dir)
    if point is not None:
        record = {
            "checkpoint": str(point.checkpoint),
            "run": str(point.run_dir),
            "step": point.step,
            "tracking_ids": point.state["exp"]["tracking_ids"],  # the W&B run to continue
        }
        write_json(output_dir / RESUME_RECORD, record)
        if note := continued_schedule_note(cfg.trainer, _trained_max_steps(point.run_dir), point.step):
            log.info(note)


def _trained_max_steps(run_dir: Path) -> int:
    """The `trainer.max_steps` the continued run was trained with, from its config.yaml (resolve has read it)."""
    return int(OmegaConf.load(RunLayout(run_dir).config).trainer.max_steps)


def execute(cfg: TrainConfig, output_dir: Path, launch_dir: Path | None = None) -> TrainResult:
    """Preflight, then train here (one process) or in one worker per device; never leaves a run unmarked."""

    with run_log(output_dir, cfg.verbose):
        return _execute(cfg, output_dir, launch_dir)


def _execute(cfg: TrainConfig, output_dir: Path, launch_dir: Path | None) -> TrainResult:

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
    summary_path = RunLayout(output_dir).summary
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
        RunLayout(output_dir).adapter,
        summary["initial_val"],
        summary["final_val"],
        summary["chance_token_accuracy"],
        None,
    )


def refused(e: BaseException) -> bool:
    """The run stopped before training: bad input (exit status 2) or a failed preflight (3). Its directory, if this
    process made it, is removed again (exp.run.dirs.discard_run_dir): the message says all there is to say."""

    return isinstance(e, ConfigError) or (isinstance(e, SystemExit) and e.code == PREFLIGHT_EXIT)


def record_stop(run_dir: Path, e: BaseException) -> None:
    """The status of a run that stopped outside `train` (which records its own): a bad config, or a signal during
    start-up or the preflight."""

    with GUARD.shielded():
        if isinstance(e, ConfigError):
            write_status(run_dir, "failed", error=str(e))
        elif isinstance(e, Preempted) and read_status(run_dir).get("status") != "preempted":
            e.checkpoint = e.checkpoint or newest_checkpoint(run_dir, read_resume_record(run_dir))
            write_status(run_dir, "preempted", error=f"Preempted: {e}")


def exit_on_known_error(e: BaseException) -> None:
    """Bad input, a fault during training or a preemption: print its message (no traceback) and exit with its
    status (2: configuration, 1: training fault, 75: preempted, requeue). Anything else returns (and is raised)."""

    if isinstance(e, ConfigError):
        print(f"exp: error: {mask_secrets(str(e))}", file=sys.stderr)
        sys.exit(2)
    # Imported only now: a configuration error should not pay for importing torch and Lightning.

    if isinstance(e, TrainingFault):
        print(f"exp: error: {mask_secrets(str(e))}", file=sys.stderr)
        sys.exit(1)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        # The disk, not the run: every file is written atomically, so what was written before is intact. EFBIG is
        # `ulimit -f` (Python ignores SIGXFSZ, so the write fails instead of the process being killed).
        reason = "No space left (the file-size limit, ulimit -f, is reached)" if e.errno == errno.EFBIG else e.strerror
        print(
            f"exp: error: {reason} while writing {e.filename or 'the run directory'}. Nothing written before was "
            "lost (files are replaced whole). Free space (or use a writable disk: hydra.run.dir=...), then continue "
            "with trainer.resume=auto.",
            file=sys.stderr,
        )
        sys.exit(1)
    if isinstance(e, Preempted):
        print(f"exp: {e}", file=sys.stderr)
        sys.exit(REQUEUE_EXIT)
