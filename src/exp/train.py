"""`python -m exp.train [overrides]`: fine-tune the LoRA adapters of a 4-bit Gemma.

The front door: check the command line, claim the run (or sweep) directory, let Hydra compose the config, hand over to
`exp.training.pipeline` (one run) or `exp.study.job` (one job of a multirun). `run([...overrides])` does
the same from Python (a notebook, a test).
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from exp.core.cli import VERBOSE_FLAGS, os_error_message
from exp.core.config import ConfigError
from exp.core.constants import LAUNCH_ID_ENV
from exp.core.secrets import mask_secrets
from exp.hardware.preflight import start_probe
from exp.run.compose import CONF_DIR, compose_config, to_typed
from exp.run.dirs import (
    RunLayout,
    claim_run_dir,
    lock_run,
    new_run_dir,
    release_runs,
    shared_launch_id,
)
from exp.run.overrides import check_command_line, claim_pinned_run_dir, expand_seeds, join_launch
from exp.run.security import run_record_failure
from exp.study.claim import claim_study, release_studies
from exp.study.launcher_watch import mark_launcher
from exp.training.signals import GUARD, REQUEUE_EXIT, Preempted, ends_recorded, guarded, stop_reason

if TYPE_CHECKING:
    from exp.training.pipeline import TrainResult


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(dcfg: DictConfig) -> float:
    try:
        return _task(dcfg)
    except BaseException as e:
        _raised_by_main.append(e)  # exp's own failure (a sweep job's too), not Hydra's: run_hydra tells them apart
        raise


def check_run_record(output_dir: Path) -> None:
    """Refuse a job whose redacted record (`.hydra/`) was not written or whose command line still holds its
    secrets (exp.run.security.RunRecord failed: Hydra warns and goes on). A full disk reads as one."""
    if (e := run_record_failure()) is None:
        return
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        raise e
    from exp.training.faults import TrainingFault  # the pipeline's fault type, loaded with the pipeline

    # An OSError's own text names the file, whose name may hold an override's value: its reason alone.
    reason = e.strerror if isinstance(e, OSError) and e.strerror else mask_secrets(str(e))
    raise TrainingFault(
        f"the run's redacted record could not be written to {output_dir / '.hydra'} ({type(e).__name__}: "
        f"{reason}), so nothing was trained: a run without it would keep its secrets on the command "
        "line, where W&B and the manifest record them. Fix: make the run directory writable (or choose another, "
        "hydra.run.dir=...), then launch again."
    )


def _task(dcfg: DictConfig) -> float:
    """One run, or one job of a multirun: what Hydra calls `main` for."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        # The preflight's CUDA probe (a subprocess) runs while this process imports torch and Lightning.
        accelerator, quant_type = dcfg.hardware.accelerator, dcfg.quantization.quant_type  # enums of the schema
        start_probe(getattr(accelerator, "value", str(accelerator)), getattr(quant_type, "value", str(quant_type)))
    # Torch and Lightning load only here, once the command line has passed its checks.
    from exp.study.job import sweep_job
    from exp.training import lifecycle, pipeline

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
        check_run_record(output_dir)
        cfg = to_typed(dcfg, launch_dir)
        result = pipeline.execute(cfg, output_dir, launch_dir)
    except BaseException as e:
        lifecycle.close_stopped(output_dir, e)
        pipeline.exit_on_known_error(e)
        raise
    return result.final_val["val/loss"]  # the value Hydra sweepers minimise


# What left `main` (a fault exp does not know, reported with its traceback); anything else that leaves Hydra is
# Hydra's own failure to set a run up or wind it down (`run_hydra`).
_raised_by_main: list[BaseException] = []


def run_hydra() -> None:
    """Hydra's `main`, with what Hydra itself fails on reported as exp reports bad input.

    Hydra sets a run up from its config after exp has claimed the run directory (status `running`): it composes
    the config again, makes the callbacks, configures logging (a handler's level or arguments), sets
    `hydra.job.env_set`. A failure there would leave that status behind and print a traceback; here the run is
    marked failed with the reason (`ends_recorded`) and the reason is one paragraph, exit status 2 (1 for a disk
    or permission error).
    """
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra's switch: raise what failed (exp words it) instead of printing it
    try:
        with ends_recorded() as marked:
            main()
    except Exception as e:
        if any(e is raised for raised in _raised_by_main):
            raise
        marked_note = f" The run directory {', '.join(map(str, marked))} is marked failed (status.json)." * bool(marked)
        if isinstance(e, OSError) and (message := os_error_message("exp.train", e)):
            print(f"exp: error: {message}{marked_note}", file=sys.stderr)
            sys.exit(1)
        print(
            f"exp: error: Hydra failed outside exp's code, setting the run up from its config (or, in a sweep, "
            f"between jobs): {mask_secrets(stop_reason(e))}.{marked_note} Fix: correct the setting this names, most "
            "often a hydra.* one (hydra.job_logging / hydra.hydra_logging for a logging handler, formatter or level; "
            "hydra.callbacks; hydra.job.env_set), or drop that override, then launch again.",
            file=sys.stderr,
        )
        sys.exit(2)
    finally:
        if full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full_error


def run(overrides: list[str] | None = None, output_dir: str | Path | None = None) -> TrainResult:
    """Compose the config as the CLI would and train; each call is a fresh run in a fresh directory."""
    from exp.training import lifecycle, pipeline  # torch and Lightning, once the config composed

    cfg = compose_config(list(overrides or []))
    with guarded():
        try:
            with ends_recorded():  # what record_stop does not know still leaves the run saying how it ended
                out = claim_run_dir(Path(output_dir)) if output_dir else new_run_dir(Path.cwd() / "outputs")
                try:
                    return pipeline.execute(cfg, out, Path.cwd())
                except BaseException as e:
                    lifecycle.close_stopped(out, e)
                    raise
        finally:
            release_runs()  # the run directory and any run it continued: free for the next call


def cli() -> None:
    GUARD.install()  # from the first moment: a signal never kills a run without a word and a true status.json
    try:
        _cli()
    except Preempted as e:  # before Hydra ran `main` (which handles its own)
        claimed = [Path(a.split("=", 1)[1][1:-1]) for a in sys.argv[1:] if a.startswith('hydra.run.dir="')]
        if claimed and RunLayout(claimed[-1]).status.exists():
            from exp.training.lifecycle import record_stop  # torch, on this rare path only

            record_stop(claimed[-1], e)
        elif {"-m", "--multirun"} & set(sys.argv[1:]):
            e.phase = "the sweep, between jobs (the jobs' own directories say how each ended)"
        else:
            e.phase = "start-up, before a run directory was made (nothing was written)"
        print(f"exp: {e}", file=sys.stderr)
        sys.exit(REQUEUE_EXIT)


def _cli() -> None:
    argv = ["verbose=true" if a in VERBOSE_FLAGS else a for a in sys.argv[1:]]
    launch = shared_launch_id() if not {"-m", "--multirun"} & set(argv) else None
    try:
        if launch is not None:  # one rank of a torchrun / SLURM launch: every rank writes into one run directory
            argv = join_launch(argv, launch)
    except ConfigError as e:
        print(f"exp: error: {e}", file=sys.stderr)
        sys.exit(2)
    plan = "--plan" in argv  # the study's jobs, memory, placement and time; nothing runs
    argv = [a for a in argv if a != "--plan"]
    argv, problems = expand_seeds(argv)
    if not problems:
        # Checked and composed before Hydra starts: Hydra instantiates callbacks and writes the run directory first.
        problems, sys.argv[1:] = check_command_line(argv, __file__, str(CONF_DIR), "train", launch)
    if problems:
        print("exp: error: " + mask_secrets("\n".join(problems)), file=sys.stderr)
        sys.exit(2)
    if plan:
        from exp.study.plan import print_plan  # composes every job: only for --plan

        sys.exit(print_plan(argv, __file__, str(CONF_DIR), "train"))
    if launch:
        from exp.training.launch import end_rank  # Lightning, for the ranks of torchrun / SLURM only

        end_rank(run_hydra)  # a rank ends as exp's own workers do: no interpreter teardown of gloo's threads
    try:
        sys.argv[1:] = claim_pinned_run_dir(sys.argv[1:])
        if not any(a.startswith('hydra.run.dir="') for a in sys.argv[1:]):  # a sweep pins no run directory
            sys.argv[1:] = claim_study(sys.argv[1:], __file__, str(CONF_DIR), "train")
    except ConfigError as e:
        print(f"exp: error: {e}", file=sys.stderr)
        sys.exit(2)
    if {"-m", "--multirun"} & set(sys.argv[1:]):
        mark_launcher()  # the sweep's jobs, in whatever process a launcher starts them, end with this one
    try:
        run_hydra()
    finally:
        release_studies()


if __name__ == "__main__":
    cli()
