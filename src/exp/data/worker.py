"""Work that runs a process pool (datasets' `map(num_proc=n)`), done in a child process of its own.

A pool in the run's own process does not survive a signal well: exp's handler raises `Preempted` wherever the
main thread is, and unwinding through datasets' pool means `Pool.terminate()`, which joins the pool's task
thread; that thread can be waiting on the pool's queue lock, and then the join never returns (a SIGTERM during
tokenisation left a run tokenising for minutes). So the pool lives in a forked child, leader of a process group
of its own; the run's process only waits on it, and whatever ends that wait early (a signal's `Preempted`, any
exception) kills the whole group first: the child, its pool's workers and the pool's manager. The child watches
its parent as well, so a SIGKILLed run leaves no tokeniser behind either.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable

# How often the waiting parent and the child's watchdog look: small against tokenising, short for a signal.
POLL_S = 0.1


class WorkerFailed(RuntimeError):
    """The child failed with something that could not be sent back as it was (its traceback is the message)."""


def run_in_child(work: Callable[[], None], what: str) -> None:
    """`work()` in a forked child (its process group: the child and all it starts); its exception is raised here.

    Returns when the child has finished `work`. An exception here while waiting (a signal's `Preempted`) kills the
    child's process group, reaps the child and propagates.
    """
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(work, writer, os.getpid()), name=what, daemon=False)
    child.start()
    writer.close()
    with contextlib.suppress(OSError):  # the child sets it too; whoever is first wins the race harmlessly
        os.setpgid(child.pid, child.pid)
    try:
        outcome = _wait(child, reader)
    except BaseException:
        kill_group(child.pid)
        child.join()
        raise
    finally:
        reader.close()
    child.join()
    ok, error = outcome
    if not ok:
        raise error if isinstance(error, BaseException) else WorkerFailed(f"{what} failed in its process: {error}")


def _wait(child, reader) -> tuple[bool, object]:
    while True:
        if reader.poll(POLL_S):
            try:
                return reader.recv()
            except EOFError:  # the pipe closed without a word: the child died
                break
        if not child.is_alive():
            if reader.poll(0):  # what it sent just before it ended
                continue
            break
    child.join()
    return False, f"the process exited with code {child.exitcode} before it finished"


def kill_group(pgid: int) -> None:
    """SIGKILL to every process of the group (the child leads it; its pool's workers and manager are in it)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _child(work: Callable[[], None], writer, parent: int) -> None:
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        work()
        outcome: tuple[bool, object] = (True, None)
    except BaseException as e:  # sent back whole where it pickles (exp's ConfigError does), else as text
        outcome = (False, e)
        try:
            import pickle

            pickle.dumps(e)
        except Exception:
            outcome = (False, "".join(traceback.format_exception(e)))
    writer.send(outcome)
    writer.close()


def _watch_parent(parent: int) -> None:
    """The run's process is gone (SIGKILL gives it no chance to clean up): end this child's group with it."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    kill_group(os.getpgrp())
