"""Start the processes of a multi-process run (DDP / FSDP on one machine) without re-running the command line.

Lightning's own launcher re-executes `sys.argv` in each child: under Hydra that re-runs a whole multirun sweep in
every rank, and each child would compose (and name) its own run directory. Instead, the process that ran the
preflight writes the resolved config into the run directory and starts one `python -m exp.training.worker worker <run dir>`
per device with the standard torch.distributed environment; Lightning sees processes created externally and
only joins them. This process never initialises CUDA. Under torchrun or SLURM (which start the processes
themselves) nothing is launched: every process runs `exp.train` and joins.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from exp.core.config import Accelerator, TrainConfig
from exp.core.strategies import strategy_traits
from exp.training.signals import GUARD, REQUEUE_EXIT, Preempted, taken_signals


def externally_launched() -> bool:
    """True under torchrun / SLURM / a launcher that already set the process's rank (Lightning's own checks)."""
    from lightning.fabric.plugins.environments import (
        LightningEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    return (
        TorchElasticEnvironment.detect()
        or SLURMEnvironment.detect()
        or LightningEnvironment().creates_processes_externally
    )


def needs_launch(cfg: TrainConfig) -> bool:
    hw = cfg.hardware
    return strategy_traits(hw.strategy).spawns_workers and hw.devices * hw.num_nodes > 1 and not externally_launched()


# Set by a process that starts workers or sweep jobs (`child_env`): its pid, which the child checks at start.
LAUNCHER_PID_ENV = "EXP_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_command(role: str, run_dir: Path) -> list[str]:
    """The command line of a process `exp.training.worker` runs: one rank (`worker`) or one sweep job (`job`)."""
    return [sys.executable, "-m", "exp.training.worker", role, str(run_dir)]


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a worker or sweep job this process starts: it names this process as the child's launcher."""
    return dict(env, **{LAUNCHER_PID_ENV: str(os.getpid())})


def die_with_launcher() -> None:
    """End this worker or job when the process that started it dies, however it dies.

    A launcher killed outright (SIGKILL, the OOM killer, a closed terminal's process group torn down in part) would
    otherwise leave its workers training on: holding the GPUs, writing checkpoints into a run directory that a
    `trainer.resume=auto` re-launch is about to resume from, or, for DDP, waiting forever in a collective for a rank
    that is gone. Linux delivers SIGKILL to this process when its parent ends (PR_SET_PDEATHSIG), the same end as a
    killed single-process run, from which `trainer.resume=auto` goes on. Elsewhere (no prctl) nothing is set.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(launcher):  # the launcher ended before the line above: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(cfg: TrainConfig, run_dir: Path) -> int:
    """Run one worker per device on this machine; returns 0 when all succeed, else the first failure's status."""
    if cfg.hardware.num_nodes > 1:
        raise SystemExit(
            f"exp: error: hardware.num_nodes={cfg.hardware.num_nodes}: start one exp.train per node with torchrun "
            "(--nnodes, --nproc-per-node) or srun; exp launches processes itself only within one machine."
        )
    n = cfg.hardware.devices
    base = child_env(os.environ.copy())
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n), NODE_RANK="0")
    if cfg.hardware.accelerator == Accelerator.cpu:
        # CPU ranks share the machine's cores: more threads than cores in all makes every collective wait for
        # descheduled threads (measured here: 40 steps in 106 s with 2 threads per rank on 2 cores, 8 s with 1).
        share = max(1, (os.cpu_count() or 1) // n)
        base["OMP_NUM_THREADS"] = str(min(share, int(base.get("OMP_NUM_THREADS") or share)))
    procs = []
    for rank in range(n):
        env = dict(base, LOCAL_RANK=str(rank), RANK=str(rank))
        procs.append(subprocess.Popen(worker_command("worker", run_dir), env=env))
    status = 0
    passed_on: set[int] = set()

    # A scheduler's SIGTERM / SIGUSR1 (preemption) or a Ctrl-C goes to this process: pass it on, so that every
    # worker checkpoints at the same step and exits for a requeue (a worker acts on the first signal it gets).
    def pass_on(signum: int, _frame) -> None:
        passed_on.add(signum)
        for p in procs:
            p.send_signal(signum)

    forward = {sig: signal.signal(sig, pass_on) for sig in taken_signals()}
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                # A worker the passed-on signal reached while it was still starting (before its handlers were
                # installed) ends by that signal: stopped like the others, not failed.
                if rc < 0 and -rc in passed_on:
                    rc = REQUEUE_EXIT
                if rc != 0 and status == 0:
                    status = rc
                    if rc != REQUEUE_EXIT:  # one rank failed: the others would wait forever in a collective
                        for other in procs:
                            other.kill()
            time.sleep(0.2)
    finally:
        for sig, handler in forward.items():
            signal.signal(sig, handler)
    return status


def run_job_process(run_dir: Path, env: dict[str, str] | None = None) -> int:
    """Run one sweep job (config already in `run_dir/config.yaml`) in a fresh Python process.

    A fresh process per job is the isolation guarantee: no CUDA context, allocator state, W&B run, logging
    handler or module global of one job can reach the next, whatever the job did (or how it died). A signal to
    this process is passed on to the job, which stops as a single run does (checkpoint, status, REQUEUE_EXIT).
    """
    proc = subprocess.Popen(worker_command("job", run_dir), env=child_env(env or os.environ.copy()))

    def pass_on(signum: int, _frame) -> None:
        GUARD.received = GUARD.received or signum  # the sweep stops once the job has
        proc.send_signal(signum)

    forward = {sig: signal.signal(sig, pass_on) for sig in taken_signals()}
    try:
        return proc.wait()
    finally:
        for sig, handler in forward.items():
            signal.signal(sig, handler)


def close_process_group() -> None:
    """Tear the process group down before the interpreter exits.

    Left to interpreter shutdown, gloo's background threads can be destroyed while still joinable, and the C++
    runtime aborts the worker ("terminate called without an active exception", status -6) after a run that
    otherwise finished and wrote everything (a two-rank gloo script that only all-reduces: 7 of 40 runs aborted
    at exit without this, 0 of 40 with it).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_rank(main: Callable[[], object]) -> NoReturn:
    """Run one rank's `main`, then end the process without interpreter shutdown, keeping its exit status.

    Tearing the process group down (`close_process_group`) is not always enough: after an FSDP run, a gloo thread
    still aborted a finished rank at interpreter exit, once in a full CI suite ("terminate called without an active
    exception", status -6, which would also turn a preempted rank's 75 into a failure). Everything a rank writes is
    written and closed by then (checkpoints, adapter, loggers finished); stdio and logging are flushed here, and
    `os._exit` skips the C++ destructors that abort.
    """
    code = 0
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except Preempted as e:  # a signal before `main` could handle it (Hydra starting)
        print(f"exp: {e}", file=sys.stderr)
        code = REQUEUE_EXIT
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        close_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
