"""A sweep's jobs end with the sweep's launcher, whichever launcher runs them.

With the basic launcher each job's training process dies with its parent, the launcher
(`exp.training.launch.die_with_launcher`). submitit's local executor runs each job under a controller process made
to outlive the Python session that submitted it: a launcher killed outright (SIGKILL, the OOM killer) would leave
its jobs training on, writing into a sweep directory that a re-launch is about to resume, with the launch's pickled
config on disk. So the launch names itself in the environment every job inherits (SWEEP_LAUNCHER_ENV: its pid and
start time, which a process that reuses the pid does not share), and a job running in another process watches it:
once it is gone the job is sent SIGTERM, which stops it as a preemption does (a checkpoint at the step boundary,
`preempted`, and `trainer.resume=auto` on a re-launch continues it). A submitit job also deletes its own submission
pickle once it has started, when the pickle holds one of the sweep's secrets: nothing needs it after the start; what
it hands back (its result pickle, which a killed launcher never reads) holds its configs masked
(exp.run.security.RunRecord.on_job_end).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger("exp.sweep")

SWEEP_LAUNCHER_ENV = "EXP_SWEEP_LAUNCHER"
POLL_S = 1.0  # how often a job looks for its launcher; a SIGTERM is sent again as long as the job runs


def identity(pid: int) -> str | None:
    """`pid:start time` of a live process (Linux /proc), None when there is none of that pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # ended, not yet reaped
        return None
    return f"{pid}:{fields[19]}"  # field 22 of stat: the start time, in clock ticks since boot


def mark_launcher() -> None:
    """Called by the process that launches a sweep, before any job starts: the jobs inherit its identity."""
    me = identity(os.getpid())
    if me is not None:
        os.environ[SWEEP_LAUNCHER_ENV] = me


def watch_launcher() -> bool:
    """In a sweep job: when the launch runs it in another process than its own, stop the job once the launcher is
    gone. Returns whether a watch started."""
    launcher = os.environ.get(SWEEP_LAUNCHER_ENV)
    if not launcher or launcher.split(":")[0] == str(os.getpid()):
        return False
    threading.Thread(target=_watch, args=(launcher,), name="exp-sweep-launcher-watch", daemon=True).start()
    return True


def _watch(launcher: str) -> None:
    pid = int(launcher.split(":")[0])
    while identity(pid) == launcher:
        time.sleep(POLL_S)
    log.warning("sweep: the launcher (pid %d) is gone; this job stops as if preempted", pid)
    # Again and again: a SIGTERM that arrives between this job's phases (submitit's own handler logs and ignores
    # it there) is followed by one that reaches the training process.
    while True:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(POLL_S)


def submitit_pickle() -> Path | None:
    """This submitit job's submission pickle (None outside a submitit job)."""
    if not os.environ.get("SUBMITIT_EXECUTOR") or not os.environ.get("SUBMITIT_FOLDER"):
        return None
    import submitit

    return Path(submitit.JobEnvironment().paths.submitted_pickle)
