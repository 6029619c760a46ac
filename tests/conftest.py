"""Shared test setup: a private model cache, GPU tests skipped without CUDA, the signal state restored around each
test, one short tiny run (the tests that read it are marked slow here) and the README's default run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Real public data files some tests read (alpaca_en_demo.json, alpaca_zh_demo.json), from the directory that
# $EXP_SHARED_DATA names; the tests marked `shared_data("<file>")` skip without it.
SHARED_DATA = Path(os.environ["EXP_SHARED_DATA"]).resolve() if os.environ.get("EXP_SHARED_DATA") else None


def pytest_configure(config: pytest.Config) -> None:
    # The cache holds the random-weight tiny model + tokenizer the project builds; a per-run cache proves the
    # build works from nothing (as on a fresh machine) and keeps tests off the user's ~/.cache.
    if "EXP_CACHE" not in os.environ:
        import tempfile

        os.environ["EXP_CACHE"] = tempfile.mkdtemp(prefix="exp-test-cache-")
    os.environ.pop("WANDB_API_KEY", None)  # tests never talk to a W&B server
    # The suite runs several training processes at once (`Together`, `DefaultRun`, launchers' jobs) on few cores.
    # libgomp lets an idle intra-op thread spin for 300,000 rounds before it sleeps, holding a core that another
    # process waits for: on two cores, test_group's runs (this process and two group workers) took 120 s of CPU and
    # 63 s wall; with 1,000 rounds, 57 s and 33 s, while one run alone keeps its speed (a 4-step run: 1.0 s against
    # 0.95 s; no spin at all, OMP_WAIT_POLICY=PASSIVE, makes it 1.6 s). Spinning decides only how a thread idles,
    # never what it computes. Set before torch loads here (libgomp reads it then), inherited by every process the
    # tests start.
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    # `Together`'s threads start processes while this thread's tests change the environment (monkeypatch.setenv,
    # exp setting its cache variables). A vfork()ed child shares the parent's memory until it executes, and reads
    # the environment array there: when another thread grows that array meanwhile, the old one is freed under the
    # child, whose exec then fails with EFAULT ("[Errno 14] Bad address", seen under load). fork() gives the child
    # a copy instead.
    subprocess._USE_VFORK = False


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker (`-m "not slow"`)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that reads the shared short run trains it, unless an earlier test has: slow, whatever it checks.
    for item in items:
        if "short_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if (marker := item.get_closest_marker("shared_data")) is not None:
            name = marker.args[0]
            if SHARED_DATA is None or not (SHARED_DATA / name).is_file():
                item.add_marker(pytest.mark.skip(reason=f"needs $EXP_SHARED_DATA/{name} (a real public data file)"))


@pytest.fixture(autouse=True)
def signal_state_restored():
    """Each test starts with a fresh `GUARD` and leaves the process's signal handlers and `GUARD` as it found them.

    `GUARD` is one per process and keeps what a run saw (the signal received, whether it acted, the phase), and
    Lightning and `GUARD.install()` point the signal handlers at themselves: a test that signals a run, or stops one
    mid-way, would otherwise hand a pending SIGUSR1 or a stale handler to the next test that trains.
    """
    from exp.training.signals import GUARD, SIGNALS

    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
    state = dict(vars(GUARD))
    GUARD.reset()
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            # None: a handler not installed from Python, which cannot be reinstated; the default stands for it.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        vars(GUARD).update(state)


class Together:
    """Independent slow steps of a module's tests, run side by side instead of one after another.

    Each step is a function that starts processes (`python -m exp.train`, a sweep and its re-launches) and waits for
    them. Such a process spends most of its life importing torch, transformers and Lightning on one core, so as many
    steps run at once as the machine has cores. Only the steps that a selected test reads are started (`uses` names
    the tests of each step, by name or with its parameters, `test_x[id]`): `pytest -k` on one test starts what that
    test needs. `get(name)` waits for a step and returns what it returned (or raises what it raised); `close()` (or
    leaving a `with` block) waits for them all.
    """

    def __init__(
        self, request: pytest.FixtureRequest, steps: dict[str, Callable[[], Any]], uses: dict[str, Iterable[str]]
    ):
        items = [item for item in request.session.items if getattr(item, "module", None) is request.module]
        selected = {item.originalname for item in items} | {item.name for item in items}
        self.pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
        self.futures: dict[str, Future] = {
            name: self.pool.submit(step) for name, step in steps.items() if selected & set(uses[name])
        }

    def get(self, name: str) -> Any:
        return self.futures[name].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Together:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Overrides for short CPU runs: few steps, no warmup, W&B off unless a test asks for it.
SHORT = [
    "trainer.max_steps=30",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=15",
    "trainer.checkpoint_every_n_steps=15",
    "trainer.log_every_n_steps=1",
    "data.num_examples=400",
    "logger=csv",
]


def compose_typed(overrides: list[str]):
    """The typed config the CLI would build from these overrides (paths resolved against the repo root)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from exp.run.compose import CONF_DIR, to_typed

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_typed(compose("train", overrides=overrides), ROOT)


def dynamic_from_the_first_shape():
    """Within: Dynamo compiles every size dynamic from a frame's first call, one graph where a GPU run compiles a
    static graph at the first length and a dynamic one from the second (exp.model.compile_cache). On the CPU each
    Inductor graph costs tens of seconds of C++ compilation (a 4-step run of the GPU twin: 6 graphs, 110 s; 3, 81 s),
    and what the tests that use it check (no graph break, the compiled layers' results) is the dynamic graph's, the
    one a GPU run trains with from its second length on."""
    import torch

    return torch._dynamo.config.patch(assume_static_by_default=False)


def encode(tokenizer, row: dict[str, str], max_seq_len: int = 128, train_on_prompt: bool = False):
    """An Alpaca row {instruction, input, output} encoded as `build_splits` encodes each row of its source: rendered
    for `data.format` (`render_row`), then tokenised with its loss mask (`encode_rendered`). (Encoded, truncated);
    (None, True) when truncation leaves no response token."""
    from exp.core.config import DataConfig, DataFormat
    from exp.data.encoding import encode_rendered
    from exp.data.formats import render_row

    cfg = DataConfig(format=DataFormat.alpaca, max_seq_len=max_seq_len, train_on_prompt=train_on_prompt)
    return encode_rendered(tokenizer, render_row(cfg, row, tokenizer), cfg.max_seq_len, cfg.train_on_prompt)


@pytest.fixture(scope="session")
def short_run(tmp_path_factory: pytest.TempPathFactory):
    """One 30-step run of the default config on the real NF4 CPU path, shared by the tests that inspect it (slow
    tests: `pytest_collection_modifyitems` marks them)."""
    from exp.train import run

    out = tmp_path_factory.mktemp("short_run") / "run"
    return run(SHORT, output_dir=out)


class DefaultRun:
    """The README's default run, `python -m exp.train` with no override but the run directory, as a user on a
    fresh machine that never ran `wandb login` launches it: no WANDB_* variable, a HOME with no ~/.netrc, an empty
    launch directory, an empty cache of its own.

    It reads nothing the other tests make: it starts in the background as soon as the tests are collected, and the
    tests that read it run last (`pytest_collection_finish`). It runs on one intra-op thread, at a CPU priority a
    little below the tests' (nice `NICE`), so that it goes on beside them and ends before its readers start. The
    other tests keep both cores busy, where a second thread of its own would mostly wait for a core: alone on two
    cores here, one thread ran its 3000 steps in 163 s wall and 163 s of CPU, two threads in 147 s wall and 277 s of
    CPU. At the lowest priority (nice 19) it would get almost no CPU until the other tests end, and its readers would
    wait for all of it. Thread count and priority change neither its config nor what it learns. Its output goes to
    files, which never fill up as an unread pipe would. Its own cache keeps it from building entries in the one the
    other tests share (some check that no half-built entry is left there).
    """

    NICE = 5

    def __init__(self, root: Path):
        self.launch, self.run_dir, home, cache = root / "launch", root / "run", root / "home", root / "cache"
        for d in (self.launch, home, cache):
            d.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
        env.update(HOME=str(home), EXP_CACHE=str(cache), OMP_NUM_THREADS="1")
        self.out, self.err = root / "stdout.txt", root / "stderr.txt"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "exp.train", f"hydra.run.dir={self.run_dir}"],
                cwd=self.launch,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                text=True,
                preexec_fn=lambda: os.nice(self.NICE),
            )

    def result(self) -> tuple[subprocess.CompletedProcess, Path, Path]:
        """(The process, its run directory, the directory it was launched from), once it has ended."""
        # A hang guard, not a speed check: the run takes minutes, longer on a busy machine.
        returncode = self.proc.wait(timeout=1800)
        proc = subprocess.CompletedProcess(
            self.proc.args, returncode, self.out.read_text(errors="replace"), self.err.read_text(errors="replace")
        )
        return proc, self.run_dir, self.launch

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_default_run: DefaultRun | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    global _default_run
    readers = [item for item in session.items if "default_run" in getattr(item, "fixturenames", ())]
    if not readers or session.config.option.collectonly:
        return
    # Stable: every other test keeps its place, the readers keep theirs among themselves.
    session.items.sort(key=lambda item: "default_run" in getattr(item, "fixturenames", ()))
    _default_run = DefaultRun(session.config._tmp_path_factory.mktemp("default_run"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _default_run is not None:  # the session stopped before its readers ran (-x, Ctrl-C)
        _default_run.stop()


@pytest.fixture(scope="session")
def default_run() -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The README's default run (`DefaultRun`), started when the tests were collected: (the process, its run
    directory, the directory it was launched from), for the tests that check what it learns and how it tracks."""
    assert _default_run is not None, "started by pytest_collection_finish for every session that selects a reader"
    return _default_run.result()
