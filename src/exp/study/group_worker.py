"""`python -m exp.study.group_worker <run dir> <run dir> ...`: the process of one group of a study's jobs sharing
one base (started by the `gpus` launcher with `hydra.launcher.share_base=true`, on the GPU it chose). Each run
directory holds its job's config (`config.yaml`, written when the launcher claimed it); each job passes its own
preflight, and a job the preflight refuses fails alone, with the findings in its status.json. The process exits 0
once the group has run, whatever each job's outcome (each status.json says it); non-zero when the group itself
stopped (a signal: every unfinished job is `preempted`; an error: `failed`)."""

from __future__ import annotations

import copy
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil  # a dependency of peft's

from exp.core.config import Accelerator, ConfigError, TrainConfig
from exp.hardware.preflight import (
    PREFLIGHT_EXIT,
    format_findings,
    probe_environment,
    probe_wanted,
    run_preflight,
    start_probe,
)
from exp.run.compose import load_run_config, write_run_config
from exp.run.dirs import RunLayout
from exp.study.grouping import shared_config, with_micro_batch
from exp.training.launch import die_with_launcher
from exp.training.signals import GUARD

if TYPE_CHECKING:
    from exp.study.group_member import Member

log = logging.getLogger("exp.train")


def main(run_dirs: list[Path]) -> None:
    die_with_launcher()  # never train on after the launcher is gone
    GUARD.install()  # SIGTERM / SIGUSR1 / SIGINT stop every job of the group as they stop a single run
    _start_probe(run_dirs[0])
    # Torch, Lightning and the training code load only now, while the probe runs.
    import torch

    # (the training code, with torch and Lightning: after the probe started)
    from exp.run.logs import FILE_FORMAT, run_log
    from exp.study.group_fit import train_group
    from exp.training.lifecycle import record_stop
    from exp.training.pipeline import exit_on_known_error

    planning = time.perf_counter()
    with run_log(run_dirs[0]):
        shared, members = plan_group(run_dirs)
    planning = time.perf_counter() - planning
    if not members:
        sys.exit(PREFLIGHT_EXIT)
    device = torch.device("cpu" if shared.hardware.accelerator == Accelerator.cpu else "cuda")
    # Every job's train.log gets the group's lines (one process trains them all; lines about one job name it).
    files = [logging.FileHandler(RunLayout(m.run_dir).log) for m in members[1:]]
    root = logging.getLogger()
    for f in files:
        f.setFormatter(logging.Formatter(FILE_FORMAT))
        root.addHandler(f)
    try:
        with run_log(members[0].run_dir):
            log.info(
                "group of %d jobs over one base on %s: %s",
                len(members),
                device,
                ", ".join(m.run_dir.name for m in members),
            )
            # Where a group's start goes: its wall-clock counts against the study's, and no job's summary holds it.
            log.info("group process: %.1f s since it started, %.1f s of it the configs and preflights",
                     time.time() - psutil.Process().create_time(), planning)  # fmt: skip
            train_group(members, shared, device)
    except BaseException as e:
        for m in members:
            record_stop(m.run_dir, e)
        exit_on_known_error(e)
        raise
    finally:
        for f in files:
            root.removeHandler(f)
            f.close()


def _start_probe(run_dir: Path) -> None:
    """Start the preflight's CUDA probe (exp.hardware.preflight.start_probe: a fresh Python that imports torch and
    bitsandbytes and initialises CUDA, seconds) for the group's first job, in the background. A config that cannot
    be read starts none: `plan_group` reports it."""
    try:
        cfg = load_run_config(run_dir)
    except ConfigError:
        return
    start_probe(cfg.hardware.accelerator.value, cfg.quantization.quant_type.value)


def plan_group(run_dirs: list[Path]) -> tuple[TrainConfig, list[Member]]:
    """The group's resolved config and its members. The preflight runs once, on the group's shape (every job's rows
    of a step together, exp.study.grouping.shared_config): a group that cannot run here fails every job with its
    findings. Each job then trains with the resolved hardware and its own micro-batch, recorded in its config.yaml,
    and continues its checkpoint when its config asks (trainer.resume); a job whose resume cannot be used fails
    alone."""
    # The training code, with torch and Lightning: loaded after `main` started the probe.
    from exp.study.group_member import Member
    from exp.training.lifecycle import record_refused
    from exp.training.pipeline import prepare_resume

    cfgs = [load_run_config(d) for d in run_dirs]
    # One probe for both preflights: the same process sees the same devices (and nothing has been allocated since).
    need_gpus, check_bnb = probe_wanted(cfgs[0].hardware.accelerator.value, cfgs[0].quantization.quant_type.value)
    env = probe_environment(check_bitsandbytes=check_bnb, need_gpus=need_gpus)
    alone = run_preflight(cfgs[0], env)  # the micro-batch each job would take alone, and how it weights a step
    token_weighted = False
    if alone.ok:
        cfgs = with_micro_batch(cfgs, alone.cfg.hardware.micro_batch_size, alone.cfg.hardware.micro_batch_tokens)
        token_weighted = alone.cfg.hardware.padding_free and not alone.cfg.data.packing
    check = run_preflight(shared_config(cfgs), env) if alone.ok else alone
    if check.ok and check is not alone:
        # The group compiles what a job alone would (its parts without adapters, exp.model.build); its memory was
        # planned eager, an upper bound (compiled parts save less for backward).
        check.cfg.hardware.compile = alone.cfg.hardware.compile
    if not check.ok:
        message = (
            f"{format_findings(check)}\n(the preflight of a group of {len(cfgs)} jobs sharing one base: every job's "
            "micro-batch together. Fix: what the findings say, a smaller hardware.micro_batch_size, or the study "
            "without hydra.launcher.share_base.)"
        )
        for d in run_dirs:
            record_refused(d, message)
        log.error("%s", message)
        return check.cfg, []
    members = []
    for run_dir, cfg in zip(run_dirs, cfgs, strict=True):
        own = cfg.hardware
        cfg.hardware = copy.deepcopy(check.cfg.hardware)
        cfg.hardware.micro_batch_size, cfg.hardware.micro_batch_tokens = own.micro_batch_size, own.micro_batch_tokens
        cfg.hardware.memory_budget_gib = load_run_config(run_dir).hardware.memory_budget_gib
        write_run_config(cfg, run_dir)  # what the job trains with, as a single run records it
        try:
            prepare_resume(cfg, run_dir, Path.cwd(), grouped=True)
        except ConfigError as e:
            record_refused(run_dir, str(e))
            log.error("%s: %s", run_dir.name, e)
            continue
        members.append(Member(f"job{len(members)}", cfg, run_dir, token_weighted=token_weighted))
    return check.cfg, members


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
