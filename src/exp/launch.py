"""Start the processes of a multi-process run (DDP / FSDP on one machine) without re-running the command line.

Lightning's own launcher re-executes `sys.argv` in each child: under Hydra that re-runs a whole multirun sweep in
every rank, and each child would compose (and name) its own run directory. Instead, the process that ran the
preflight writes the resolved config into the run directory and starts one `python -m exp.launch <run dir>` worker
per device with the standard torch.distributed environment; Lightning sees processes created externally and
only joins them. This process never initialises CUDA. Under torchrun or SLURM (which start the processes
themselves) nothing is launched: every process runs `exp.train` and joins.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from exp.config import Strategy, TrainConfig


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
    return hw.strategy in (Strategy.ddp, Strategy.fsdp) and hw.devices * hw.num_nodes > 1 and not externally_launched()


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
    base = os.environ.copy()
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n), NODE_RANK="0")
    procs = []
    for rank in range(n):
        env = dict(base, LOCAL_RANK=str(rank), RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-m", "exp.launch", str(run_dir)], env=env))
    status = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0 and status == 0:
                    status = rc
                    for other in procs:  # one rank failed: the others would wait forever in a collective
                        other.send_signal(signal.SIGTERM)
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        raise
    return status


def _worker(run_dir: Path) -> None:
    from exp.config import ConfigError
    from exp.train import load_run_config, train

    cfg = load_run_config(run_dir)
    try:
        train(cfg, run_dir, manage_run_dir=False)
    except ConfigError as e:
        print(f"exp: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
