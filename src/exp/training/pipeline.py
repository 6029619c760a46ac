"""One training job, start to end: the preflight, then the fit here or in one worker process per device, the final
evaluation, the adapter, the summary, and a true `status.json` however the job ends."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from exp.core.cache import file_sha256
from exp.core.config import ConfigError, TrainConfig
from exp.core.secrets import mask_secrets
from exp.core.strategies import strategy_traits
from exp.hardware.preflight import PREFLIGHT_EXIT, format_findings, run_preflight
from exp.model.build import quiet_third_party_logs
from exp.model.lora_init import save_adapter as save_lora_adapter
from exp.run.checkpoints import last_good_checkpoint, newest_checkpoint
from exp.run.compose import config_dict, read_resume_record, write_run_config
from exp.run.dirs import RESUME_RECORD, RunLayout, write_json
from exp.run.logs import RECORD, RecordMetrics, run_log
from exp.run.resume import resolve
from exp.run.tracking import build_loggers, log_adapter_artifact, write_manifest
from exp.training.faults import TrainingFault, oom_diagnosis
from exp.training.fit import build_fit
from exp.training.fsdp import gather_trainable, save_peft_adapter
from exp.training.launch import close_process_group, launch_workers, needs_launch
from exp.training.lifecycle import RunLifecycle, record_refused
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
    if manage_run_dir:
        with GUARD.shielded():
            write_run_config(cfg, output_dir)
    resume = read_resume_record(output_dir)
    with RunLifecycle(output_dir, owns_status=manage_run_dir, resume=resume) as run:
        GUARD.stop_now()  # a signal that arrived while the run was being recorded
        checkpoint = Path(resume["checkpoint"]) if resume else None
        run_name = cfg.logger.run_name or "-".join(filter(None, [cfg.experiment_name, cfg.model.name, output_dir.name]))

        def run_loggers(module: QLoRAModule) -> list:
            # Tracked by the lifecycle as soon as they exist, which finishes them however the run ends (also when
            # the Trainer's build fails after them).
            run.track(
                build_loggers(
                    cfg.logger,
                    output_dir,
                    run_name,
                    config_dict(cfg),
                    cfg.experiment_name,
                    module.tracking_ids,
                    steps_done=lambda: module.trainer.global_step,
                    resumed_at=resume["step"] if resume else None,
                )
            )
            return [*run.loggers, RecordMetrics(lambda: module.trainer.global_step)]

        tokenizer, datamodule, module, trainer = build_fit(
            cfg,
            output_dir,
            run_loggers,
            tracking_ids=_tracking_ids(resume),
            last_good_checkpoint=functools.partial(last_good_checkpoint, output_dir, checkpoint),
            resuming=checkpoint is not None,
        )
        if trainer.is_global_zero:
            write_manifest(output_dir, tokenizer, cfg.data)
        _fit_and_validate(cfg, trainer, module, datamodule, checkpoint)
        GUARD.phase = "saving the results"
        result = TrainResult(
            output_dir,
            RunLayout(output_dir).adapter,
            module.initial_val or {},
            module.last_val,
            datamodule.majority_token_accuracy(),
            module,
        )
        gathered = _gather_from_ranks(module)
        GUARD.stop_now()  # the last moment to stop: from here the run finishes (seconds) whatever arrives
        # The results are written whole: a signal from here on is noted, and the run completes first.
        with GUARD.shielded():
            save_adapter(module, trainer, result.adapter_dir, tokenizer)
            if trainer.is_global_zero:
                summary = _summary(module, trainer, datamodule, result, resume, started, gathered)
                write_json(RunLayout(output_dir).summary, summary)
                print_summary(summary, output_dir)
                if cfg.logger.log_adapter:
                    log_adapter_artifact(run.loggers, result.adapter_dir, run_name)
        return result


def _tracking_ids(resume: dict | None) -> dict[str, str]:
    """The run's ids in its trackers: a resumed run keeps its own (its tracker runs go on); a new run's are added
    when its loggers are built (exp.run.tracking.build_loggers)."""
    return dict(resume["tracking_ids"]) if resume else {}


def _fit_and_validate(cfg: TrainConfig, trainer, module, datamodule, checkpoint: Path | None) -> None:
    """Train, then the final evaluation at the last step, unless fit's own validation has just measured that step
    (the same weights, split and batches: a second one would record the same numbers twice)."""
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(checkpoint) if checkpoint else None)
        if module.last_val_step != trainer.global_step:
            trainer.validate(module, datamodule=datamodule, verbose=False)
    except torch.OutOfMemoryError as e:
        raise oom_diagnosis(cfg, module.device, trainer.global_step) from e


def _gather_from_ranks(module) -> dict:
    """What summary.json needs from every rank (collective: each rank calls it): whether all ranks hold the same
    adapters, where each rank's weights lived, and the throughput of all processes together."""
    return {
        "replica_adapter_checksums": module.check_replicas_agree(),
        "placement_per_rank": module.gather_placements(),
        "throughput": module.gather_throughput(),
    }


def _summary(module, trainer, datamodule, result: TrainResult, resume: dict | None, started: float, gathered: dict):
    """summary.json's record of the run (rank 0, once the adapter is saved)."""
    return {
        "steps": trainer.global_step,
        "seconds": round(time.time() - started, 1),
        "initial_val": result.initial_val,
        "final_val": result.final_val,
        "chance_token_accuracy": result.chance_token_accuracy,
        **gathered["throughput"],
        "device": str(module.device),
        "world_size": trainer.world_size,
        "replica_adapter_checksums": gathered["replica_adapter_checksums"],
        "placement_per_rank": gathered["placement_per_rank"],
        # A stream's length is unknown (data.streaming): no epoch count.
        "epochs": round(module.batches_seen * trainer.world_size / datamodule.batches_per_epoch, 3)
        if datamodule.batches_per_epoch
        else None,
        "skipped_steps": module.skipped_steps,
        "resumed_from": resume,
        "data": datamodule.stats,
        **_objective_record(module),
    }


def _objective_record(module) -> dict:
    """The adapter the run started from (its files' sha256: what it was when read), DPO / KTO's reference, and the
    precomputed reference's cache entry and cost."""
    cfg = module.cfg
    start = None
    if cfg.model.adapter:
        start = {
            "path": cfg.model.adapter,
            "sha256": file_sha256(Path(cfg.model.adapter) / "adapter_model.safetensors"),
        }
    reference = cfg.reference
    return {
        "start_adapter": start,
        "reference": reference.value if reference else None,
        "reference_precomputed": module.reference_record,
    }


def save_adapter(module, trainer, adapter_dir: Path, tokenizer=None) -> None:
    """Write the adapter in PEFT's format (and the tokenizer) from rank 0; under FSDP every rank takes part in
    gathering it first. Written into a temporary directory renamed into place: `adapter/` is whole or absent."""

    tmp = adapter_dir.with_name(f".{adapter_dir.name}.{os.getpid()}.partial")
    if strategy_traits(module.cfg.hardware.strategy).gathers_to_save:
        full = gather_trainable(trainer.strategy.model, module)
        if trainer.is_global_zero:
            save_peft_adapter(module.model, {k.removeprefix("model."): v for k, v in full.items()}, tmp)
    elif trainer.is_global_zero:
        # adapter_config.json + safetensors of the trained adapter alone (not the frozen reference copy beside it);
        # after PiSSA / OLoRA converted into a LoRA on the original base
        save_lora_adapter(module.model, module.cfg.lora, tmp, selected=[module.model.active_adapter])
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


def _quality_lines(s: dict, first: dict, last: dict) -> str:
    """What the held-out split says beyond the loss: SFT's token accuracy and exact match, or a preference
    objective's accuracy (chosen rewarded above rejected; a coin flip is 0.5) and reward margin."""
    if "val/accuracy" in last:
        return (
            f"  preference acc. {first.get('val/accuracy', float('nan')):.3f} -> {last['val/accuracy']:.3f} "
            f"(chance {s['chance_token_accuracy']:.1f})\n"
            f"  reward margin   {first.get('val/rewards/margin', float('nan')):.3f} -> {last['val/rewards/margin']:.3f}\n"
        )
    return (
        f"  token accuracy  {last['val/token_accuracy']:.3f} (majority-token baseline "
        f"{s['chance_token_accuracy']:.3f})\n"
        f"  exact match     {last['val/exact_match']:.3f} (step 0: {first.get('val/exact_match', 0):.3f})\n"
    )


def print_summary(s: dict, output_dir: Path) -> None:
    """The run's outcome on the console, and in train.log."""

    first, last = s["initial_val"], s["final_val"]
    drop = 100 * (1 - last["val/loss"] / first["val/loss"]) if first else float("nan")
    n = len(s.get("per_rank") or ())
    ranks, per_device = (f", {n} processes together", " on the fullest device") if n else ("", "")
    text = (
        f"exp: {s['steps']} steps in {s['seconds']:.0f} s -> {output_dir}\n"
        f"  val loss        {first.get('val/loss', float('nan')):.3f} -> {last['val/loss']:.3f} ({drop:.0f}% lower)\n"
        + _quality_lines(s, first, last)
        + (f"  validated on    {s['data']['validated_on']}\n" if s.get("data", {}).get("validated_on") else "")
        + f"  throughput      {s['tokens_per_s_median']} real tokens/s (median step{ranks})"
        + (f", {s['padding_fraction']:.1%} padding" if s.get("padding_fraction") is not None else "")
        + (f", peak memory {s['peak_memory_gib']} GiB{per_device}" if s.get("peak_memory_gib") else "")
        + compile_line(s)
        + f"\n  adapter         {output_dir / 'adapter'}"
    )
    print(f"\n{text}", flush=True)
    RECORD.info("summary\n%s", text)


def prepare_resume(cfg: TrainConfig, output_dir: Path, launch_dir: Path, grouped: bool = False) -> None:
    """Find the checkpoint `trainer.resume` asks for and record it in `resume.json` (every worker reads it).

    `grouped`: the run is a job of a group sharing one base (exp.study.group_fit), which continues checkpoints of
    either kind; a single run cannot continue a group's checkpoint (it holds no Lightning loop state)."""

    point = resolve(cfg, config_dict(cfg), output_dir, launch_dir)
    if point is not None and point.state["exp"].get("group") is not None and not grouped:
        raise ConfigError(
            f"trainer.resume={cfg.trainer.resume}: {point.checkpoint} was written by a group of jobs trained over one "
            "shared base (hydra.launcher.share_base=true), and only such a group continues it. Fix: launch the "
            "study again with hydra/launcher=gpus hydra.launcher.share_base=true and trainer.resume=auto, or start "
            "this job fresh without trainer.resume."
        )
    if point is not None:
        record = {
            "checkpoint": str(point.checkpoint),
            "run": str(point.run_dir),
            "step": point.step,
            "tracking_ids": point.state["exp"]["tracking_ids"],  # the tracker runs to continue
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
        record_refused(output_dir, message)
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
    summary_path = RunLayout(output_dir).summary
    with RunLifecycle(output_dir) as run:
        log.info("launching %d processes (%s) for %s", cfg.hardware.devices, cfg.hardware.strategy.value, output_dir)
        rc = launch_workers(cfg, output_dir)
        if rc == REQUEUE_EXIT:
            checkpoint = newest_checkpoint(output_dir, read_resume_record(output_dir))
            where = f"checkpoint {checkpoint}" if checkpoint else "before any checkpoint: nothing to resume"
            run.end("preempted", f"Preempted: the worker processes were stopped by a signal; {where}")
            sys.exit(rc)
        if rc != 0 or not summary_path.exists():
            run.end("failed", f"a worker process exited with status {rc}")
            sys.exit(rc or 1)
    summary = json.loads(summary_path.read_text())
    return TrainResult(
        output_dir,
        RunLayout(output_dir).adapter,
        summary["initial_val"],
        summary["final_val"],
        summary["chance_token_accuracy"],
        None,
    )


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
