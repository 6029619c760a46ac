"""Parallel tokenisation runs its pool in a process group of its own: a signal to the run ends it at once, a
SIGKILLed run leaves no worker behind, and the rows are those of the single-process path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import exp.data.encoding
import exp.data.worker
from exp.train import run
from exp.training.signals import Preempted

RUN = ["data.num_examples=120", "trainer.max_steps=1", "data.val_size=8"]
GONE_WITHIN_S = 60  # how long a killed process may take to disappear on a busy machine (a bound, not a timing)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def slow_encode(row, cfg, tokenizer):
    """A pool worker's row: say who runs it (pid, parent, group) and never finish."""
    marker = Path(os.environ["EXP_TEST_MARKER"])
    (marker / f"{os.getpid()}.json").write_text(json.dumps([os.getpid(), os.getppid(), os.getpgrp()]))
    time.sleep(3600)


def test_sigterm_during_parallel_tokenisation_stops_the_run_and_its_pool(tmp_path, monkeypatch):
    marker = tmp_path / "workers"
    marker.mkdir()
    monkeypatch.setenv("EXP_TEST_MARKER", str(marker))
    monkeypatch.setattr(exp.data.encoding, "PARALLEL_ROWS", 40)  # 120 rows: a pool of 3
    monkeypatch.setattr(exp.data.encoding, "encode_row", slow_encode)

    def signal_once_a_worker_runs():
        while not list(marker.glob("*.json")):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_once_a_worker_runs, daemon=True).start()
    with pytest.raises(Preempted) as info:
        run([*RUN, f"data.seed={time.time_ns() % 2**31}"], output_dir=tmp_path / "run")  # tokenised afresh
    assert str(info.value).startswith("stopped by SIGTERM during data preparation")
    workers = [json.loads(p.read_text()) for p in marker.glob("*.json")]
    # The pool is not the run's: its workers are in another process group, which the run kills whole.
    assert all(parent != os.getpid() and group != os.getpgrp() for _, parent, group in workers), workers
    assert wait_gone([pid for pid, _, _ in workers]) == []
    assert not list(Path(os.environ["EXP_CACHE"]).rglob("*.partial")), "a half-built cache entry was left behind"


def test_a_sigkilled_parent_leaves_no_worker_behind(tmp_path):
    """The child's watchdog ends its group (the child and a pool it started) once the parent is gone."""
    script = textwrap.dedent(
        f"""
        import multiprocessing, os, time
        from pathlib import Path
        from exp.data.worker import run_in_child

        def sleep(i):
            Path({str(tmp_path)!r}, f"w{{os.getpid()}}").touch()
            time.sleep(3600)

        def work():
            Path({str(tmp_path)!r}, f"c{{os.getpid()}}").touch()
            with multiprocessing.get_context("fork").Pool(2) as pool:
                pool.map(sleep, range(2))

        run_in_child(work, "a pool that never ends")
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + GONE_WITHIN_S
    while len(list(tmp_path.glob("w*"))) < 2 and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.05)
    started = [int(p.name[1:]) for p in tmp_path.glob("[cw]*")]
    assert len(started) == 3, f"the child and two workers should have started: {started}"
    parent.kill()
    parent.wait()
    assert wait_gone(started) == []


def test_an_error_in_the_child_is_raised_in_the_parent():
    from exp.core.config import ConfigError

    def fails():
        raise ConfigError("data.path: a bad row")

    with pytest.raises(ConfigError, match="data.path: a bad row"):
        exp.data.worker.run_in_child(fails, "failing work")

    def dies():
        os._exit(3)

    with pytest.raises(exp.data.worker.WorkerFailed, match="exited with code 3"):
        exp.data.worker.run_in_child(dies, "dying work")


def test_parallel_tokenisation_gives_the_rows_of_one_process(tmp_path, monkeypatch):
    from conftest import compose_typed

    from exp.data.encoding import encode_source, tokenizer_fingerprint
    from exp.data.sources import read_source
    from exp.model.build import build_tokenizer

    train = compose_typed(["data.num_examples=90"])
    cfg, tokenizer = train.data, build_tokenizer(train.model)
    source = read_source(cfg, None, "train")
    fp = tokenizer_fingerprint(tokenizer)
    serial = encode_source(cfg, source, tokenizer, fp)
    monkeypatch.setenv("EXP_CACHE", str(tmp_path / "other-cache"))  # tokenised again, not read from the cache
    monkeypatch.setattr(exp.data.encoding, "PARALLEL_ROWS", 30)  # a pool of 3
    parallel = encode_source(cfg, source, tokenizer, fp)
    assert len(list((tmp_path / "other-cache").rglob("rows_*_of_00003.arrow"))) == 3
    assert parallel.to_list() == serial.to_list()
