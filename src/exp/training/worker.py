"""`python -m exp.training.worker worker|job <run dir>`: the process entry of one rank of a multi-process run
(`worker`, started by `exp.training.launch.launch_workers`) or of one sweep job (`job`, started by
`run_job_process`, or by the `gpus` launcher on a GPU of its choosing); `launch.worker_command` is its command line.
The run directory holds the resolved config (`config.yaml`) the process trains with."""

from __future__ import annotations

import sys
from pathlib import Path

from exp.run.compose import load_run_config
from exp.training.launch import die_with_launcher, end_rank
from exp.training.lifecycle import record_stop
from exp.training.pipeline import execute, exit_on_known_error, train
from exp.training.signals import GUARD


def main(argv: list[str]) -> None:
    role, run_dir = argv[0], Path(argv[1])
    die_with_launcher()  # never train on after the launcher is gone (a re-launch may be resuming this run)
    GUARD.install()  # SIGTERM / SIGUSR1 / SIGINT stop this process as they stop a single run
    cfg = load_run_config(run_dir)
    try:
        if role == "job":
            execute(cfg, run_dir, Path.cwd())
        else:
            train(cfg, run_dir, manage_run_dir=False)  # run under end_rank, which tears the process group down
    except BaseException as e:
        if role == "job":  # a worker's status is its launcher's to write
            record_stop(run_dir, e)
        exit_on_known_error(e)
        raise


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        end_rank(lambda: main(sys.argv[1:]))
    main(sys.argv[1:])
