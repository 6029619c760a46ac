"""Signals: SIGTERM, SIGUSR1, SIGINT and SIGHUP stop a run at any moment with its status true and a message.

SLURM sends SIGUSR1 ahead of a time limit (`#SBATCH --signal=USR1@120`) and SIGTERM on preemption; Kubernetes
and most schedulers send SIGTERM; Ctrl-C sends SIGINT, a closed terminal SIGHUP (unless started with `nohup`). One
handler (`GUARD`) owns them from the moment `exp.train` starts until it ends, and acts by phase:

- before training (start-up, data preparation, model build, the step-0 validation) and after it (the final
  validation): the run stops at once, `Preempted` raised where the process is;
- during training: only a flag is set, and `PreemptionCheckpoint` writes `checkpoints/last.ckpt` at the next
  optimiser-step boundary (never mid-accumulation, never from inside the handler; `exp.training.preemption`), every
  data-parallel rank agreeing on that step, then stops;
- while results or a failure are being recorded (`GUARD.shielded()`): the signal is noted and the recording
  finishes, so status.json, summary.json and the adapter are never half written.

The run is marked `preempted` and the process exits with REQUEUE_EXIT, so a batch script can tell "preempted,
requeue me" from success and from failure; `trainer.resume=auto` then continues from the newest checkpoint.

Whatever else stops a process once it has marked a run `running` (Hydra failing to set the run up after its
directory was claimed, an error outside the pipeline's own handling, `sys.exit`), `ends_recorded` marks that run
`failed` with the reason on the way out (`preempted` for a signal): no run is left saying `running` by a process
that has ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from exp.core.config import ConfigError
from exp.run.dirs import close_unfinished

log = logging.getLogger("exp.signals")

# EX_TEMPFAIL from sysexits.h: "a temporary failure; the user is invited to retry".
REQUEUE_EXIT = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
# Left alone when the process starts with them ignored: `nohup` ignores SIGHUP, a shell's background job SIGINT.
UNLESS_IGNORED = (signal.SIGINT, signal.SIGHUP)


class Preempted(BaseException):
    """The run was stopped by a signal. A BaseException, like KeyboardInterrupt: no `except Exception` on the way
    out (a library's, or exp's own fallbacks) may swallow it."""

    def __init__(self, signum: int, step: int | None = None, checkpoint: Path | None = None, phase: str = "training"):
        super().__init__(signum)
        self.signum, self.step, self.checkpoint, self.phase = signum, step, checkpoint, phase

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        where = f"at step {self.step}" if self.phase == "training" and self.step is not None else f"during {self.phase}"
        if self.checkpoint is None:
            return (
                f"stopped by {name} {where}, before any checkpoint: nothing to resume. Run the same command again "
                "(with trainer.resume=auto it starts fresh when there is nothing to continue)"
            )
        return (
            f"stopped by {name} {where}; checkpoint {self.checkpoint}. Continue with trainer.resume=auto (same "
            "command) or trainer.resume=<this run dir>"
        )


class SignalGuard:
    """The process's handler of SIGNALS (see the module docstring); one per process, `GUARD`."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.received: int | None = None  # the first signal of this run
        self.acted = False  # a Preempted has been raised for it
        self.training = False  # flag only: PreemptionCheckpoint stops at a step boundary
        self.shields = 0
        self.phase = "start-up"

    def install(self) -> None:
        """Point SIGNALS at this guard (again: Lightning composes its own SIGTERM handler around it at each fit)."""
        if threading.current_thread() is threading.main_thread():
            for sig in taken_signals():
                signal.signal(sig, self._handle)

    def reset(self, phase: str = "start-up") -> None:
        self.received, self.acted, self.training, self.shields, self.phase = None, False, False, 0, phase

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self.owner:  # a forked child (a DataLoader worker, a datasets pool): the parent decides
            if signum == signal.SIGTERM:  # what a pool's terminate() sends: end as a child is expected to
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if self.received is None:
            self.received = signum
            log.warning("received %s during %s", signal.Signals(signum).name, self.phase)
        if not (self.training or self.shields or self.acted):
            self.acted = True
            raise Preempted(signum, phase=self.phase)

    def stop_now(self) -> None:
        """Raise for a signal that arrived while it could not be acted on (training, a shielded section)."""
        if self.received is not None and not self.acted:
            self.acted = True
            raise Preempted(self.received, phase=self.phase)

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """Recording results or a failure: a signal here is noted, not raised (the recording takes seconds)."""
        self.shields += 1
        try:
            yield
        finally:
            self.shields -= 1


GUARD = SignalGuard()


def taken_signals() -> list[int]:
    """The SIGNALS this process acts on: all but those it was started with ignored (UNLESS_IGNORED)."""
    return [sig for sig in SIGNALS if not (sig in UNLESS_IGNORED and signal.getsignal(sig) == signal.SIG_IGN)]


@contextlib.contextmanager
def guarded(phase: str = "start-up") -> Iterator[SignalGuard]:
    """SIGNALS handled by GUARD for the duration (the handlers before are restored after): `exp.train.run` from
    Python, a worker process."""
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    GUARD.reset(phase)
    GUARD.install()
    try:
        yield GUARD
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@contextlib.contextmanager
def ends_recorded() -> Iterator[list[Path]]:
    """Whatever leaves the block (an exception, a signal, `sys.exit`), every run this process marked `running` and
    that still says so is marked how it ended: `preempted` for a signal, else `failed` with `stop_reason`. Yields
    the list of the runs so marked, filled on the way out."""
    marked: list[Path] = []
    try:
        yield marked
    except BaseException as e:
        with GUARD.shielded():
            if isinstance(e, Preempted):
                marked += close_unfinished("preempted", f"Preempted: {e}")
            else:
                marked += close_unfinished("failed", stop_reason(e))
        raise


def stop_reason(e: BaseException) -> str:
    """What stopped a run, in one line: exp's own message for bad input, else the exception and what caused it."""
    if isinstance(e, ConfigError):
        return str(e)
    if isinstance(e, SystemExit):
        code = e.code if isinstance(e.code, int) or e.code is None else 1
        reason = f"the process exited with status {code or 0} before the run recorded how it ended"
        return reason + (f" ({stop_reason(e.__context__)})" if e.__context__ is not None else "")
    causes, seen = [], e
    while seen is not None and len(causes) < 4:
        causes.append(f"{type(seen).__name__}: {seen}".rstrip(": "))
        seen = seen.__cause__ or seen.__context__
    return causes[0] + "".join(f" (caused by {cause})" for cause in causes[1:])
