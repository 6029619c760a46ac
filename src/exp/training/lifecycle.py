"""How a run ends, written in one place: `status.json` says `running` while a process trains it, then `completed`,
`failed` (with the error) or `preempted` (with where to continue from), and the loggers are finished accordingly.

Every front door (`exp.train`, a worker process, a sweep job, the launch of one worker per device) goes through
`RunLifecycle` or, for a run stopped before it could start, `record_refused`, `record_stop` and `close_stopped`; `exp.run.dirs.write_status` is the file
format underneath, and `exp.training.signals.ends_recorded` the safety net for a stop outside both.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import TracebackType

from exp.core.config import ConfigError
from exp.hardware.preflight import PREFLIGHT_EXIT
from exp.run.checkpoints import newest_checkpoint
from exp.run.compose import read_resume_record
from exp.run.dirs import discard_run_dir, read_status, write_status
from exp.run.logs import RECORD
from exp.run.tracking import finish_loggers
from exp.training.signals import GUARD, Preempted


class RunLifecycle:
    """`with RunLifecycle(run_dir) as run:` around a run's work. On entry the run is `running`; leaving the block
    normally makes it `completed`, an exception `failed` or, for a signal, `preempted` (the exception is raised
    on, a failure after a signal as the `Preempted` that caused it). The loggers handed to `track` are finished in
    every case, before `completed` is written: a reader who sees `completed` finds the tracking closed too.

    `owns_status=False` (the worker processes of a multi-process run, whose launching process owns status.json)
    finishes the loggers and writes nothing. `end` records an outcome the block learns itself (a worker's exit
    status): leaving the block then writes nothing more."""

    def __init__(self, run_dir: Path, *, owns_status: bool = True, resume: dict | None = None) -> None:
        self.run_dir = run_dir
        self.owns_status = owns_status
        self.resume = resume  # the continued checkpoint's record: where a stop before any new checkpoint goes on
        self.loggers: list = []
        self.outcome: str | None = None

    def __enter__(self) -> RunLifecycle:
        with GUARD.shielded():
            self._write("running")
        return self

    def track(self, loggers: list) -> None:
        self.loggers = loggers

    def end(self, status: str, error: str) -> None:
        with GUARD.shielded():
            self._write(status, error)
            self.outcome = status

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if e is None:
            with GUARD.shielded():
                finish_loggers(self.loggers, ok=self.outcome is None)
                if self.outcome is None:
                    self._write("completed")
            if GUARD.received is not None and not GUARD.acted:
                name = signal.Signals(GUARD.received).name
                print(f"exp: {name} arrived while the results were being saved; the run completed first", flush=True)
            return None
        if self.outcome is not None:  # recorded by `end`: the exit that follows is its consequence
            with GUARD.shielded():
                finish_loggers(self.loggers, ok=False, preempted=self.outcome == "preempted")
            return None
        with GUARD.shielded():
            stop = e if isinstance(e, Preempted) else None
            if stop is None and GUARD.received is not None and not isinstance(e, ConfigError):
                # Failed after a signal: a process group's signal also ends the run's DataLoader workers, and the
                # next batch then fails. The signal is what stopped the run.
                stop = Preempted(GUARD.received, phase=GUARD.phase)
            if stop is not None and stop.checkpoint is None:  # stopped outside the training loop: where to go on from
                stop.checkpoint = newest_checkpoint(self.run_dir, self.resume)
            error = f"Preempted: {stop}" if stop is not None else f"{type(e).__name__}: {e}"
            status = "preempted" if stop is not None else "failed"
            RECORD.error("run %s: %s", status, error)
            self._write(status, error)
            finish_loggers(self.loggers, ok=False, preempted=stop is not None)
        if stop is not None and stop is not e:
            raise stop from e
        return None

    def _write(self, status: str, error: str | None = None) -> None:
        if self.owns_status:
            write_status(self.run_dir, status, error=error)


def record_refused(run_dir: Path, message: str) -> None:
    """A run the preflight refused: `failed`, with the findings, before anything ran."""
    write_status(run_dir, "failed", error=message)


def record_stop(run_dir: Path, e: BaseException) -> None:
    """The status of a run that stopped before its `RunLifecycle` began: a bad config, or a signal during start-up
    or the preflight."""

    with GUARD.shielded():
        if isinstance(e, ConfigError):
            write_status(run_dir, "failed", error=str(e))
        elif isinstance(e, Preempted) and read_status(run_dir).get("status") != "preempted":
            e.checkpoint = e.checkpoint or newest_checkpoint(run_dir, read_resume_record(run_dir))
            write_status(run_dir, "preempted", error=f"Preempted: {e}")


def refused(e: BaseException) -> bool:
    """The run stopped before training: bad input (exit status 2) or a failed preflight (3)."""
    return isinstance(e, ConfigError) or (isinstance(e, SystemExit) and e.code == PREFLIGHT_EXIT)


def close_stopped(run_dir: Path, e: BaseException) -> None:
    """After a run stopped outside its `RunLifecycle`: a refused run's directory, if this process made it, is
    removed again (exp.run.dirs.discard_run_dir: the message says all there is to say); any other stop is recorded
    (`record_stop`)."""
    if not (refused(e) and discard_run_dir(run_dir)):
        record_stop(run_dir, e)
