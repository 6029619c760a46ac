"""Regenerate the example outputs of README.md and docs/*.md from real runs, instead of editing them by hand.

    python benchmarks/readme_figures.py                      # the default run's example output (minutes on 2 cores)
    python benchmarks/readme_figures.py preview-chat doctor  # these blocks
    python benchmarks/readme_figures.py all-cpu              # every block this CPU machine reproduces (21 min on 2 busy cores)
    python benchmarks/readme_figures.py tests                # the test suite's count and time (one full pytest run)
    python benchmarks/readme_figures.py --list               # every block, its file and its group

Each figure sits in a Markdown file between `<!-- readme_figures:<name> -->` and `<!-- /readme_figures:<name> -->`
(indented as the list item holding it), and only those lines are replaced. A block's function runs the commands it
shows as a user types them (`bash -c`, `python` the interpreter running this script, exp from this checkout's
`src/`), each block in a fresh temporary directory of its own, and renders what they printed; paths inside that
directory are shown relative to it (`-> outputs/<date>/<time>`). The blocks that read the Alpaca demo file take it
from `$EXP_SHARED_DATA/alpaca_en_demo.json` (as the tests do), checked against the SHA-256 the README gives.
Runs share one model cache (`$EXP_CACHE`, else a temporary one), except the default run, which builds its own as
on a fresh machine. Two groups: `cpu` (`all-cpu`: every block this machine reproduces) and `tests` (a test-suite
run each, named explicitly). The figures measured on GPUs are not generated here: they cite their files in
`benchmarks/results/`.

Blocks that show one run share it (the default run: `default-run`, `default-run-console`, `default-run-train-log`).
Each run's commands, exit statuses, wall times and whole output are kept in `benchmarks/results/readme_<run>.txt`.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"^( *)<!-- readme_figures:([\w-]+) -->\n(.*?)^\1<!-- /readme_figures:\2 -->$", re.M | re.S)
ERROR_TIMEOUT = 300  # a command shown for its refusal: far more than a refusal takes, far less than a run
BAR = re.compile(r"^(Step-0 evaluation|Training|Evaluation at step \d+|Final evaluation):")
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[[\w.]+\]\[\w+\] - ")


# --- the blocks in the Markdown files ----------------------------------------------------------------------------


def replace_block(text: str, name: str, body: str, where: str = "README.md") -> str:
    """`text` with the lines between the `name` markers replaced by `body`, indented as the markers are."""
    for block in MARKER.finditer(text):
        if block.group(2) == name:
            indent = block.group(1)
            lines = [f"{indent}{line}" if line.strip() else "" for line in body.rstrip().splitlines()]
            start, end = f"{indent}<!-- readme_figures:{name} -->", f"{indent}<!-- /readme_figures:{name} -->"
            return text[: block.start()] + "\n".join([start, *lines, end]) + text[block.end() :]
    raise SystemExit(f"readme_figures: {where} has no '<!-- readme_figures:{name} -->' ... block to replace")


def blocks_in(text: str) -> list[str]:
    """The names of the marker blocks in a Markdown text, in order."""
    return [block.group(2) for block in MARKER.finditer(text)]


@dataclass(frozen=True)
class Figure:
    doc: str  # the Markdown file holding the block, relative to the repository root
    make: Callable[[], str]
    group: str = "cpu"


FIGURES: dict[str, Figure] = {}


def figure(name: str, doc: str, group: str = "cpu"):
    """Register the decorated function as the generator of block `name` of `doc`."""

    def register(make: Callable[[], str]) -> Callable[[], str]:
        FIGURES[name] = Figure(doc, make, group)
        return make

    return register


# --- running commands as a user types them ------------------------------------------------------------------------


@dataclass
class Done:
    command: str
    output: str  # stdout and stderr together, as a terminal shows them; paths in the run's directory made relative
    code: int
    seconds: float
    load: float  # the mean 1-minute load average while it ran

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.output.splitlines()]  # a terminal shows no trailing blanks

    def shown(self) -> str:
        """`$ command` and what it printed, as a transcript."""
        return f"$ {self.command}\n" + "\n".join(self.lines()).rstrip()


@functools.cache
def shared_cache() -> str:
    """The model and tokenisation cache every run but the default one shares: `$EXP_CACHE`, else a temporary one."""
    if os.environ.get("EXP_CACHE"):
        return os.environ["EXP_CACHE"]
    path = tempfile.mkdtemp(prefix="readme-figures-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def environment(cache: str) -> dict[str, str]:
    env = dict(os.environ, EXP_CACHE=cache)
    env.pop("WANDB_API_KEY", None)  # offline W&B, as on a machine without credentials
    # `python` and `torchrun` are this interpreter's; exp is this checkout's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


class Session:
    """The commands of one run of a figure, in a fresh temporary directory; the record kept under `name`."""

    def __init__(self, name: str, cache: str | None = None):
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"readme-{name}-")).resolve()
        atexit.register(shutil.rmtree, self.dir, ignore_errors=True)
        self.env = environment(cache or shared_cache())
        self.done: list[Done] = []

    def run(self, command: str, *, timeout: float = 1800, expect: int | None = 0, cwd: Path | None = None) -> Done:
        """Run `command` with bash in the session's directory (or `cwd`); fail unless it exits with `expect`."""
        started = time.time()
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=cwd or self.dir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        loads = []  # other processes on the cores slow a run down: the captions say how busy the machine was
        with ThreadPoolExecutor(1) as pool:
            output = pool.submit(proc.communicate)
            while not output.done():
                loads.append(os.getloadavg()[0])
                if time.time() - started > timeout:
                    os.killpg(proc.pid, 9)
                time.sleep(1 if time.time() - started < 10 else 5)
            out, _ = output.result()
        done = Done(command, self.relative(out), proc.returncode, time.time() - started, statistics.mean(loads))
        self.done.append(done)
        self.save()
        if expect is not None and done.code != expect:
            raise SystemExit(
                f"readme_figures: {self.name}: `{command}` exited {done.code}, not {expect}:\n{done.output[-3000:]}"
            )
        return done

    def relative(self, text: str) -> str:
        return text.replace(f"{self.dir}/", "").replace(str(self.dir), ".")

    def save(self) -> None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        record = [
            f"$ {d.command}   # in {self.dir}, {d.seconds:.1f} s wall, exit {d.code}, mean 1-minute load average "
            f"{d.load:.1f} on {os.cpu_count()} cores\n{d.output}"
            for d in self.done
        ]
        (RESULTS / f"readme_{self.name}.txt").write_text(f"commit {commit()}\n\n" + "\n".join(record))


@functools.cache
def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return out.strip() or "unknown"


def transcript(session: Session, *commands: str, expect: int | None = 2) -> str:
    """A fenced transcript of `commands`, each `$ command` and its whole output (refusals: exit status `expect`)."""
    shown = [session.run(c, timeout=ERROR_TIMEOUT, expect=expect).shown() for c in commands]
    return "```\n" + "\n\n".join(shown) + "\n```"


def refusals(name: str, doc: str, *commands: str, expect: int = 2, setup: Callable[[Path], None] | None = None):
    """Register block `name`: the transcript of commands that are refused (exit status `expect`)."""

    def make() -> str:
        session = Session(name)
        if setup:
            setup(session.dir)
        return transcript(session, *commands, expect=expect)

    FIGURES[name] = Figure(doc, make)


def doc_block(doc: str, after: str) -> str:
    """The body of the first code block of `doc` after the text `after` (the marker naming a file it shows)."""
    text = (ROOT / doc).read_text()
    fence = re.compile(r"^```\w*\n(.*?)^```", re.M | re.S)
    return fence.search(text, text.index(after)).group(1)


def alpaca_demo(into: Path) -> None:
    """Copy `alpaca_en_demo.json` into `into`, as the README's `curl -LO` leaves it; the README's SHA-256 checked."""
    sha = re.search(r"SHA-256\s+`([0-9a-f]{64})`", (ROOT / "README.md").read_text()).group(1)
    shared = os.environ.get("EXP_SHARED_DATA")
    source = Path(shared) / "alpaca_en_demo.json" if shared else None
    if source is None or not source.is_file():
        raise SystemExit(
            "readme_figures: this block trains on alpaca_en_demo.json: set EXP_SHARED_DATA to the directory holding "
            "it (the README's `curl -LO` command downloads it)"
        )
    if hashlib.sha256(source.read_bytes()).hexdigest() != sha:
        raise SystemExit(f"readme_figures: {source} is not the file the README names (SHA-256 {sha})")
    shutil.copy(source, into / "alpaca_en_demo.json")


# --- reading a training run's console -----------------------------------------------------------------------------


def final_bar(done: Done) -> str:
    """The progress bar's final state: the last complete `Training: 100%|...|` frame with its metrics."""
    frames = [line.strip() for line in done.lines() if line.startswith("Training:") and "100%" in line]
    frames = [f for f in frames if "train/loss" in f] or frames
    if not frames:
        raise SystemExit(f"readme_figures: no final progress bar line in the output of `{done.command}`")
    return frames[-1]


def summary(done: Done) -> str:
    """The summary a run prints at its end (`exp: N steps in ...` and its lines)."""
    return done.output[done.output.rindex("\nexp: ") + 1 :].rstrip()


def console(done: Done) -> str:
    """What a terminal shows once a run ended: its log lines, the training bar's final state, the summary (the
    evaluation bars erase themselves)."""
    head = done.output[: done.output.rindex("\nexp: ")]
    logs = [line for line in head.splitlines() if line.strip() and not BAR.match(line) and "\x1b[A" not in line]
    return "\n".join([*logs, final_bar(done), "", summary(done)])


def bar_seconds(bar: str) -> int:
    """The elapsed time a tqdm bar shows (`[02:42<00:00, ...`), in seconds."""
    parts = [int(p) for p in re.search(r"\[([\d:]+)<", bar).group(1).split(":")]
    return sum(p * 60**i for i, p in enumerate(reversed(parts)))


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {round(seconds % 60)} s" if seconds >= 60 else f"{seconds:.0f} s"


def run_dir(session: Session, pattern: str = "outputs/*/*") -> Path:
    (found,) = [p for p in session.dir.glob(pattern) if (p / "status.json").exists()]
    return found


def prose(text: str) -> str:
    """A paragraph wrapped as the docs wrap theirs."""
    return textwrap.fill(text, width=118, break_long_words=False, break_on_hyphens=False)


def caption_machine(done: Done) -> str:
    return f"{os.cpu_count()} CPU cores, mean load average {done.load:.1f} during the run"


# --- README.md ----------------------------------------------------------------------------------------------------


@functools.cache
def default_run() -> tuple[Done, str]:
    """`python -m exp.train` in a fresh directory with a fresh model cache; its output and its train.log."""
    cache = os.environ.get("EXP_CACHE")
    session = Session("default-run", cache=cache or tempfile.mkdtemp(prefix="readme-figures-fresh-cache-"))
    if not cache:
        atexit.register(shutil.rmtree, session.env["EXP_CACHE"], ignore_errors=True)
    done = session.run("python -m exp.train")
    return done, session.relative((run_dir(session) / "train.log").read_text())


@figure("default-run", "README.md")
def default_run_block() -> str:
    done, _ = default_run()
    caption = prose(
        f"Example (`python -m exp.train` on this machine: {caption_machine(done)}; the bar shows loss, tokens/s and "
        "validation loss; written by `python benchmarks/readme_figures.py` from the run's output):"
    )
    return f"{caption}\n\n```\n{final_bar(done)}\n\n{summary(done)}\n```"


@figure("install", "README.md")
def install() -> str:
    """What `make train` installs on a fresh machine, timed: a new virtualenv, then the Makefile's install."""
    session = Session("install")
    session.run(f"{shlex.quote(sys.executable)} -m venv venv")
    # The Makefile's own command (without an NVIDIA driver: the CPU build of torch), into the fresh environment.
    done = session.run(f"venv/bin/python -m pip install -q -e {shlex.quote(str(ROOT))} -c {ROOT}/constraints/cpu.txt")
    return prose(
        f"`make train` trains for a few minutes on two CPU cores (the [example](#what-the-default-run-does) gives the "
        f"time and the machine's load); on a fresh machine its install comes first: {done.seconds:.0f} s here into a "
        f"new virtualenv, from the local package index (mean load {done.load:.1f} on {os.cpu_count()} cores). Pass extra "
        'arguments with `make train ARGS="lora.r=16"`, or, once installed, call `python -m exp.train lora.r=16` directly.'
    )


refusals(
    "bad-input",
    "README.md",
    "python -m exp.train lora.rank=16",
    "python -m exp.train lora.r=abc",
    "python -m exp.train model=gemma_tny",
    "python -m exp.train quantization.compute_dtype=float32",
    "python -m exp.train trainer.global_batch_size=12",
)
refusals("allow-list", "README.md", "python -m exp.train +hydra.callbacks.notify._target_=exp.train.os.system")
refusals("preflight-cpu", "README.md", "python -m exp.train hardware=gpu          # on this CPU-only machine", expect=3)

ALPACA_RUN = "python -m exp.train data=alpaca data.path=alpaca_en_demo.json data.max_seq_len=512 trainer.max_steps=100"


@figure("alpaca-run", "README.md")
def alpaca_run() -> str:
    session = Session("alpaca-run")
    alpaca_demo(session.dir)
    done = session.run(ALPACA_RUN)
    bar = final_bar(done)
    per_step = bar_seconds(bar) / 100
    text = prose(
        f"On this machine ({caption_machine(done)}) the tiny model took {per_step:.2f} s per step at 512 tokens (the "
        f"bar's time over its 100 steps): `trainer.max_steps=100` as above ran for {minutes(done.seconds)}, the "
        f"start-up and both validations included; at that pace the 3,000 steps of `trainer=tiny` (no "
        f"`trainer.max_steps`) would train for about {round(per_step * 3000 / 60)} min. Its bar and summary:"
    )
    return f"{text}\n\n```\n{bar}\n\n{summary(done)}\n```"


def pytest_run(name: str, *args: str) -> tuple[str, float]:
    """Run pytest with `args` from the repository root; its summary counts (`536 passed, 15 skipped`, warnings left
    out) and wall time. Fails unless the run passed. The output is kept in readme_<name>.txt."""
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    wall = time.time() - started
    (RESULTS / f"readme_{name}.txt").write_text(
        f"$ python -m pytest {shlex.join(args)} -q   # {wall / 60:.1f} min wall\n{proc.stdout[-20000:]}"
    )
    line = proc.stdout.strip().splitlines()[-1].strip("= ")
    if proc.returncode != 0 or "failed" in line or "error" in line:
        raise SystemExit(f"readme_figures: the test suite did not pass: {line}")
    counts = re.sub(r" in [\d.]+s.*$", "", line)
    return ", ".join(part for part in counts.split(", ") if "warning" not in part), wall


@figure("tests", "README.md", group="tests")
def test_suite() -> str:
    """Run the whole test suite; return the README sentence with its summary and time."""
    counts, wall = pytest_run("tests")
    return (
        f"Measured at commit {commit()}: {counts} in {minutes(wall)} on {os.cpu_count()} CPU cores "
        "(`python benchmarks/readme_figures.py tests`)."
    )


@figure("tests-fast", "README.md", group="tests")
def fast_tier() -> str:
    """Run the fast tier (`-m "not slow"`); return the README sentence with what it selects and its time."""
    counts, wall = pytest_run("tests-fast", "-m", "not slow")
    numbers = {k: int(v) for v, k in re.findall(r"(\d+) (passed|skipped|deselected)", counts)}
    selected = numbers.get("passed", 0) + numbers.get("skipped", 0)
    return (
        f'Measured at commit {commit()} on {os.cpu_count()} CPU cores: `time python -m pytest -m "not slow" -q -p '
        f"no:cacheprovider` selects {selected} of the {selected + numbers.get('deselected', 0)} tests "
        f"({numbers.get('skipped', 0)} of them skipped here) and takes {minutes(wall)}."
    )


# --- docs/cli.md --------------------------------------------------------------------------------------------------

refusals(
    "cli-errors",
    "docs/cli.md",
    "python -m exp.train --max-steps 200",
    "python -m exp.evaluate run=outputs/x btach_size=4",
    "python -m exp.merge --out merged",
)


@figure("default-run-console", "docs/cli.md")
def default_run_console() -> str:
    done, _ = default_run()
    caption = prose(
        f"The default run (`python -m exp.train`) on this machine ({caption_machine(done)}; the bar is redrawn in "
        "place on a terminal, here its final state):"
    )
    return f"{caption}\n\n```\n{console(done)}\n```"


@figure("default-run-train-log", "docs/cli.md")
def default_run_train_log() -> str:
    _, log = default_run()
    lines = log.rstrip().splitlines()
    steps = [i for i, line in enumerate(lines) if re.search(r" - step \d+: train/", line)]
    head, tail = lines[: steps[4] + 1], lines[steps[-4] :]
    every = re.search(r" - step (\d+): train/", lines[steps[0]]).group(1)
    return (
        f"Its `train.log` (every {every}th step logged, `trainer=tiny`'s `log_every_n_steps`; the middle cut):\n\n"
        "```\n" + "\n".join([*head, "...", *tail]) + "\n```"
    )


# --- docs/data.md -------------------------------------------------------------------------------------------------

PADDING_FREE = (
    "python -m exp.train hardware=gpu hardware.accelerator=cpu data=alpaca data.path=alpaca_en_demo.json "
    "data.max_seq_len=256 trainer.max_steps=6"
)


@figure("padding-free-cpu", "docs/data.md")
def padding_free_cpu() -> str:
    session = Session("padding-free-cpu")
    alpaca_demo(session.dir)
    done = session.run(PADDING_FREE)
    data = [line for line in done.lines() if LOG_LINE.match(line) and "] - data: " in line and " train / " in line]
    return f"```\n$ {PADDING_FREE}\n...\n{data[0]}\n...\n{final_bar(done)}\n```"


@figure("preview-chat", "docs/data.md")
def preview_chat() -> str:
    session = Session("preview-chat")
    (session.dir / "chat.jsonl").write_text(doc_block("docs/data.md", "<!-- file: chat.jsonl -->"))
    return transcript(session, "python -m exp.preview data=chat data.path=chat.jsonl data.val_size=1 n=1", expect=0)


@figure("preview-alpaca", "docs/data.md")
def preview_alpaca() -> str:
    session = Session("preview-alpaca")
    alpaca_demo(session.dir)
    shown = transcript(
        session, "python -m exp.preview data=alpaca data.path=alpaca_en_demo.json data.max_seq_len=256 n=1", expect=0
    )
    packed = session.run(
        "python -m exp.preview data=alpaca data.path=alpaca_en_demo.json data.max_seq_len=256 n=1 data.packing=true"
    )
    truncated = re.search(r"truncated\s+\d+ \(([\d.]+)%\) at max_seq_len=256", session.done[0].output).group(1)
    packing = next(line for line in packed.lines() if line.strip().startswith("packing "))
    note = prose(
        f"({float(truncated):.0f}% truncated at 256 tokens with the tiny model's 512-entry tokenizer: raise "
        "`data.max_seq_len` for real runs.) With `data.packing=true` the last line becomes:"
    )
    return f"{shown}\n\n{note}\n\n```\n{packing}\n```"


def alpaca_demo_file(into: Path) -> None:
    (into / "alpaca_demo.jsonl").write_text(
        json.dumps({"instruction": "Name a colour.", "input": "", "output": "Blue."}) + "\n"
    )


@figure("missing-file", "docs/data.md")
def missing_file() -> str:
    session = Session("missing-file")
    alpaca_demo_file(session.dir)
    done = session.run("python -m exp.train data=alpaca data.path=alpaca_dmo.jsonl", timeout=ERROR_TIMEOUT, expect=2)
    caption = prose(
        f"For `{done.command}` next to `alpaca_demo.jsonl` (refused in {done.seconds:.1f} s on this machine):"
    )
    return f"{caption}\n\n```\n{done.output.rstrip()}\n```"


@figure("small-split", "docs/data.md")
def small_split() -> str:
    session = Session("small-split")
    alpaca_demo(session.dir)
    rows = json.loads((session.dir / "alpaca_en_demo.json").read_text())[:20]
    (session.dir / "small.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = session.run("python -m exp.preview data=alpaca data.path=small.jsonl n=1")
    caption = prose(
        "`exp.preview` warns when a split holds fewer examples than one batch (`trainer.global_batch_size`); for a "
        f"file of 20 rows (`{done.command}`; the first 20 of `alpaca_en_demo.json`), the last line of its statistics:"
    )
    return f"{caption}\n\n```\n{done.lines()[-1]}\n```"


# --- docs/hardware.md ---------------------------------------------------------------------------------------------


@figure("auto-note", "docs/hardware.md")
def auto_note() -> str:
    done = Session("auto-note").run("python -m exp.doctor hardware=auto")
    (note,) = [line for line in done.lines() if line.startswith("note: hardware=auto:")]
    return f"```\n{note}\n```"


TORCHRUN_ARGS = (
    "hardware=ddp hardware.accelerator=cpu hardware.devices=2 trainer.global_batch_size=16 trainer.max_steps=2 "
    "trainer.warmup_steps=0 trainer.val_every_n_steps=2 trainer.sample_count=0 logger=csv"
)


@figure("torchrun", "docs/hardware.md")
def torchrun() -> str:
    session = Session("torchrun")
    ran = session.run(f"torchrun --standalone --nproc_per_node=2 -m exp.train {TORCHRUN_ARGS}")
    # A static rendezvous (a master port, no --standalone / --rdzv-id): torchrun gives the ranks no shared id. (On one
    # machine with neither a port nor an endpoint, torchrun picks a rendezvous id itself, as --standalone does.)
    bare = session.run(f"torchrun --nproc_per_node=2 --master_port=29533 -m exp.train {TORCHRUN_ARGS}", expect=None)
    if bare.code == 0:
        raise SystemExit("readme_figures: torchrun without a shared id trained instead of being refused")
    refused = sorted({line for line in bare.lines() if line.startswith("exp: error:")})
    return (
        f"```\n$ {ran.command}\n...\n{summary(ran)}\n$ {bare.command}      # no --standalone / --rdzv-id\n"
        + "\n".join(refused)
        + f"\n$ echo $?        # after torchrun's own report of the failed ranks\n{bare.code}\n```"
    )


@figure("doctor", "docs/hardware.md")
def doctor() -> str:
    done = Session("doctor").run("python -m exp.doctor hardware=gpu model=gemma_7b", expect=3)
    # The interpreter's path is this machine's, not exp's.
    lines = ["..." if line.startswith("python ") else line for line in done.lines()]
    return "```\n$ " + done.command + "\n" + "\n".join(lines) + "\n```"


@figure("multi-gpu-cpu", "docs/hardware.md")
def multi_gpu_cpu() -> str:
    session = Session("multi-gpu-cpu")
    done = session.run(f"python benchmarks/multi_gpu.py --out {session.dir}/multi --cpu", cwd=ROOT)
    table = [line for line in (session.dir / "multi" / "multi_gpu.md").read_text().splitlines() if line.startswith("|")]
    return "```\n" + "\n".join(table) + f"\n```\n\n({minutes(done.seconds)} on {caption_machine(done)}.)"


PREFLIGHT_TABLE = """
import json
from exp.hardware.memory import GiB, estimate_for_config
from exp.hardware.preflight import Environment, Gpu, check
from exp.run.compose import compose_config

h200 = Gpu("NVIDIA H200", 143 * 2**30, 140 * 2**30, (9, 0))
machine = Environment(gpus=[h200], torch_cuda="13.0", driver_version="580.159", driver_cuda="13.0")
for micro_batch, loss in {rows}:
    cfg = compose_config([*{overrides}, f"hardware.micro_batch_size={{micro_batch}}",
                          f"trainer.global_batch_size={{micro_batch}}", f"hardware.loss_impl={{loss}}"])
    result = check(cfg, machine)
    hw = result.cfg.hardware
    recomputed = (hw.checkpoint_layers or 28) if hw.gradient_checkpointing else 0
    print(json.dumps(dict(micro_batch=micro_batch, loss=loss, ok=result.ok, recomputed=recomputed,
                          kept=hw.dequantized_layers, peak=estimate_for_config(result.cfg).total / GiB)))
"""
PREFLIGHT_OVERRIDES = [
    "model=gemma_7b",
    "hardware=gpu",
    "data.max_seq_len=2048",
    "lora=all_linear",
    "hardware.auto_micro_batch=false",
    "hardware.compile=false",
]


@figure("preflight-table", "docs/hardware.md")
def preflight_table() -> str:
    rows = [(4, "chunked"), (8, "chunked"), (16, "chunked"), (32, "chunked"), (64, "chunked"), (8, "hf"), (32, "hf")]
    session = Session("preflight-table")
    code = PREFLIGHT_TABLE.format(rows=rows, overrides=PREFLIGHT_OVERRIDES)
    done = session.run(f"python -c {shlex.quote(code)}")
    table = [
        "| micro-batch | loss | layers recomputed (of 28) | layers kept dequantized | estimated peak |",
        "|---|---|---|---|---|",
    ]
    for r in map(json.loads, done.lines()):
        loss = "chunked" if r["loss"] == "chunked" else "transformers (`loss_impl=hf`)"
        if r["ok"]:
            table.append(f"| {r['micro_batch']} | {loss} | {r['recomputed']} | {r['kept']} | {r['peak']:.1f} GiB |")
        else:
            table.append(
                f"| {r['micro_batch']} | {loss} | does not fit ({r['peak']:.0f} GiB with all 28): refused with a "
                "smaller micro-batch suggested | | |"
            )
    return (
        "What the preflight picks on an H200 with 140 GiB free (a simulated environment as in "
        "`tests/test_preflight.py`; Gemma-7B shape, seq 2048, LoRA on all 7 projections, bf16, eager layers: "
        f"`{' '.join(PREFLIGHT_OVERRIDES)}` and the micro-batch and loss of each row; written by "
        "`python benchmarks/readme_figures.py preflight-table`):\n\n" + "\n".join(table)
    )


# --- docs/after-training.md ---------------------------------------------------------------------------------------


@functools.cache
def dev_run() -> Session:
    """A 300-step run of the tiny default, evaluated and merged (into merge outputs, and refused over the run)."""
    session = Session("dev-run")
    session.run("python -m exp.train trainer.max_steps=300 hydra.run.dir=run")
    session.run("python -m exp.evaluate run=run")
    session.run("python -m exp.merge run=run out=run overwrite=true", timeout=ERROR_TIMEOUT, expect=2)
    session.run("python -m exp.merge run=run out=merged")
    session.run("python -m exp.merge run=run out=merged-original base=original")
    return session


def dev_command(prefix: str) -> Done:
    return next(d for d in dev_run().done if d.command.startswith(prefix))


@figure("evaluate", "docs/after-training.md")
def evaluate() -> str:
    done = dev_command("python -m exp.evaluate")
    train = dev_run().done[0]
    report = json.loads((dev_run().dir / "run" / "eval.json").read_text())
    final = json.loads((dev_run().dir / "run" / "summary.json").read_text())["final_val"]["val/loss"]
    same = "the same number" if final == report["loss"] else f"{abs(final - report['loss']):.1e} apart"
    caption = prose(f"Example (the run of `{train.command}`, {os.cpu_count()} CPU cores, {done.seconds:.1f} s wall):")
    return f"{caption}\n\n```\n{done.shown()}\n```\n\n(the run's `summary.json` says `val/loss {final!r}`: {same}.)"


@figure("samples", "docs/after-training.md")
def samples() -> str:
    text = (dev_run().dir / "run" / "samples.txt").read_text()
    first = text.split("\n[2]")[0].rstrip()
    return f"```\n{first}\n```"


@figure("merge-refusal", "docs/after-training.md")
def merge_refusal() -> str:
    return f"```\n{dev_command('python -m exp.merge run=run out=run').shown()}\n```"


@figure("merge", "docs/after-training.md")
def merge() -> str:
    done = dev_command("python -m exp.merge run=run out=merged")
    original = json.loads((dev_run().dir / "merged-original" / "parity.json").read_text())
    original = prose(
        "With `base=original` (`python -m exp.merge run=run out=merged-original base=original`) the same run gives "
        + original_parity(original)
    )
    return (
        f"Measured on the same 300-step run (CPU, {done.seconds:.0f} s wall):\n\n```\n{done.shown()}\n```\n\n{original}"
    )


def original_parity(parity: dict) -> str:
    """The sentence on a merge into the original weights, from its parity.json."""
    q = parity["quantized_vs_merged"]
    return (
        f"merge exactness {parity['merge']['max_abs_logit_diff_vs_unmerged']:.2e}, but KL {q['kl_mean']:.2e} per "
        f"token, top-1 agreement {q['top1_agreement']:.3f} and perplexity {q['perplexity_reference']:.2f} -> "
        f"{q['perplexity_other']:.2f} ({q['perplexity_gap_relative']:+.0%}): the tiny model's random weights "
        "(initializer_range 0.1) quantize coarsely, and the adapter was fitted to the quantized ones. Check "
        "`parity.json` before choosing `original`."
    )


# --- docs/resume.md -----------------------------------------------------------------------------------------------


@functools.cache
def resume_runs() -> Session:
    """A finished 4-step run; continued with another config (refused) and with more steps."""
    session = Session("resume")
    session.run("python -m exp.train trainer.max_steps=4 hydra.run.dir=run4")
    session.run("python -m exp.train lora.r=16 trainer.resume=run4", expect=2)
    session.run("python -m exp.train trainer.max_steps=8 trainer.resume=run4")
    return session


@figure("resume-config-diff", "docs/resume.md")
def resume_config_diff() -> str:
    first, refused, _ = resume_runs().done
    message = refused.output[refused.output.index("exp: error:") :].rstrip()
    return f"{prose(f'`{refused.command}`, after `{first.command}`:')}\n\n```\n{message}\n```"


@figure("resume-stretch", "docs/resume.md")
def resume_stretch() -> str:
    first, _, stretched = resume_runs().done
    lines = [line for line in stretched.lines() if "resuming from" in line or "trainer.max_steps 4 -> 8" in line]
    return f"```\n$ {stretched.command}        # {first.command} ran first\n" + "\n".join(lines) + "\n```"


NONFINITE = "python -m exp.train trainer.learning_rate=1e4 trainer.warmup_steps=0 trainer.max_grad_norm=0"


@figure("nonfinite", "docs/resume.md")
def nonfinite() -> str:
    done = Session("nonfinite").run(NONFINITE, expect=1)
    (message,) = [line for line in done.lines() if line.startswith("exp: error: step")]
    caption = prose(
        f"A real divergence on this machine, with an absurd learning rate (`{done.command}`; exit status {done.code}):"
    )
    return f"{caption}\n\n```\n{message}\n```"


DAMAGED_RUN = "python -m exp.train trainer.max_steps=60 trainer.checkpoint_every_n_steps=10"
CUT_SHORT = (
    "python -c \"import pathlib; p = pathlib.Path('copy/checkpoints/last.ckpt'); "
    'p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])"'
)
# One bit of a LoRA tensor's stored bytes flipped (the zip holds tensors uncompressed): torch.load reads it.
FLIP_A_BIT = (
    "python -c \"import pathlib, torch; p = pathlib.Path('copy/checkpoints/last.ckpt'); "
    "t = next(v for k, v in torch.load(p, weights_only=True)['state_dict'].items() if 'lora_A' in k); "
    "d = p.read_bytes(); i = d.index(t.contiguous().view(torch.uint8).numpy().tobytes()[:64]) + 5; "
    'p.write_bytes(d[:i] + bytes([d[i] ^ 1]) + d[i + 1 :])"'
)


@figure("damaged-checkpoint", "docs/resume.md")
def damaged_checkpoint() -> str:
    session = Session("damaged-checkpoint")
    session.run(f"{DAMAGED_RUN} hydra.run.dir=rt")
    messages = []
    for damage in (CUT_SHORT, FLIP_A_BIT):
        session.run("rm -rf copy && cp -r rt copy")
        session.run(damage)
        refused = session.run(f"{DAMAGED_RUN} trainer.resume=copy", expect=2)
        messages += [line for line in refused.lines() if line.startswith("exp: error:")]
    caption = prose(
        f"After `{DAMAGED_RUN} hydra.run.dir=rt` and a copy of that run (`cp -r rt copy`), `{DAMAGED_RUN} "
        "trainer.resume=copy` with the copy's `last.ckpt` cut to half its length, then with one bit of a LoRA "
        "tensor in it flipped:"
    )
    return f"{caption}\n\n```\n" + "\n\n".join(messages) + "\n```"


def foreign_directory(into: Path) -> None:
    (into / "proj" / "data").mkdir(parents=True)
    (into / "proj" / "notes.txt").write_text("my notes\n")


def stopped_by(session: Session, command: str, sig: int, ready: Callable[[str], bool]) -> str:
    """Start `command` in the session's directory, send `sig` once `ready(output so far)` holds, and return the
    run's last line (exp's message of how it stopped); exit status 75 expected."""
    log = session.dir / f"signal-{len(session.done)}.out"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=session.dir, env=session.env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        started = time.time()
        while proc.poll() is None and not ready(log.read_text(errors="replace")):
            if time.time() - started > 1800:
                proc.kill()
                raise SystemExit(f"readme_figures: `{command}` never reached the moment to signal")
            time.sleep(0.2)
        proc.send_signal(sig)
        code = proc.wait(timeout=600)
    output = log.read_text(errors="replace")
    session.done.append(Done(command, session.relative(output), code, time.time() - started, os.getloadavg()[0]))
    session.save()
    if code != 75:
        raise SystemExit(f"readme_figures: `{command}` exited {code} after the signal, not 75:\n{output[-3000:]}")
    return next(line for line in reversed(session.relative(output).splitlines()) if line.startswith("exp: stopped by"))


@figure("signal-messages", "docs/resume.md")
def signal_messages() -> str:
    session = Session("signal-messages")

    def logged(run: str, text: str) -> Callable[[str], bool]:
        """Once the run's train.log holds `text` (the console's bar is redrawn only every 30 s into a file)."""
        path = session.dir / run / "train.log"
        return lambda out: path.exists() and text in path.read_text(errors="replace")

    training = stopped_by(
        session, "python -m exp.train trainer.max_steps=400 logger=csv hydra.run.dir=runD", signal.SIGTERM,
        logged("runD", "step 50:"),
    )  # fmt: skip
    starting = stopped_by(
        session, "python -m exp.train logger=csv hydra.run.dir=runS", signal.SIGINT,
        lambda out: (session.dir / "runS" / "status.json").exists(),  # claimed, still loading torch and Lightning
    )  # fmt: skip
    final = stopped_by(
        session,
        "python -m exp.train trainer.max_steps=20 trainer.val_every_n_steps=100 logger=csv hydra.run.dir=first",
        signal.SIGTERM,
        logged("first", "`Trainer.fit` stopped"),
    )
    return "```\n" + "\n".join((training, starting, final)) + "\n```"


refusals("foreign-run-dir", "docs/resume.md", "python -m exp.train hydra.run.dir=proj", setup=foreign_directory)

# --- docs/security.md ---------------------------------------------------------------------------------------------

refusals("secret-override", "docs/security.md", "python -m exp.train +wandb.api_key=0123abcd")
refusals(
    "secret-by-value",
    "docs/security.md",
    # A value of 6 characters or more is a secret exp looks for (`...` would be too short to count).
    "WANDB_API_KEY=fake-secret-0123456789 python -m exp.train 'logger.project=${oc.env:WANDB_API_KEY}'",
)
refusals(
    "resolver-target",
    "docs/security.md",
    """python -m exp.train '+hydra.callbacks.x="${oc.create:{_target_: os.makedirs, name: made}}"'""",
    "python -m exp.train 'lora.r=${oc.env:LORA_RANK}'",
)
refusals(
    "allow-list-nested",
    "docs/security.md",
    "python -m exp.train +hydra.callbacks.notify._target_=exp.train.os.system",
    "python -m exp.train +hydra.callbacks.sweep_status.inner._target_=exp.run.dirs.RunLayout",
)
refusals(
    "log-file",
    "docs/security.md",
    "UP=../../.. python -m exp.train hydra.run.dir=outputs/logs-demo "
    "'hydra.job_logging.handlers.file.filename=${hydra.runtime.output_dir}/${oc.env:UP}/x.log'",
)
SECRET_RECORD = (
    "MY_SERVICE_PASSWORD=fake-pass-0123456789 python -m exp.train +hydra.job.env_set.DB_PASSWORD=fake-db-0123456789 "
    "+hydra.job.env_set.SOME_API_KEY=fake-key-0123456789 'hydra.job.env_copy=[MY_SERVICE_PASSWORD]' "
    "hydra.run.dir=run "
    + "trainer.max_steps=3 trainer.warmup_steps=0 trainer.val_every_n_steps=3 data.num_examples=120 "
    "trainer.sample_count=0 logger=csv"
)


@figure("hydra-record", "docs/security.md")
def hydra_record() -> str:
    """The run's .hydra/hydra.yaml, the lines that name the secrets: the overrides and env_set."""
    session = Session("hydra-record")
    done = session.run(SECRET_RECORD)
    if "0123456789" in (session.dir / "run" / ".hydra" / "hydra.yaml").read_text():
        raise SystemExit("readme_figures: hydra-record: a secret is in .hydra/hydra.yaml")
    lines = (session.dir / "run" / ".hydra" / "hydra.yaml").read_text().splitlines()
    shown, previous = [], -2
    for i, line in enumerate(lines):
        wanted = "PASSWORD" in line or "API_KEY" in line or line.strip() in ("overrides:", "hydra:", "env_set:")
        if wanted and (line.strip() != "hydra:" or i + 1 < len(lines) and "env_set.DB_PASSWORD" in lines[i + 1]):
            if shown and i != previous + 1:
                shown.append("  ...")
            shown.append(line)
            previous = i
    intro = f"`$ {done.command}`, then `.hydra/hydra.yaml` of the run, the lines naming the secrets:"
    return f"{intro}\n\n```yaml\n" + "\n".join(shown) + "\n```"


refusals("run-record", "docs/security.md", "python -m exp.train '~hydra.callbacks.run_record'")
refusals(
    "invalid-config",
    "docs/security.md",
    "python -m exp.train hardware.micro_batch_size=16",
    "python -m exp.train quantization=int8 hardware=fsdp",
)

# --- docs/sweeps.md -----------------------------------------------------------------------------------------------

SHORT = (
    "trainer.max_steps=3 trainer.warmup_steps=0 trainer.val_every_n_steps=3 trainer.log_every_n_steps=1 "
    "data.num_examples=120 trainer.sample_count=0 logger=csv"
)
FAILING_SWEEP = (
    "python -m exp.train -m 'lora.target_modules=[q_proj,v_proj],[v_proj],[q_proj,nope_proj]' "
    f"{SHORT} hydra.sweep.dir=multirun/s1 'hydra.job.config.override_dirname.exclude_keys=["
    + ",".join(kv.split("=")[0] for kv in SHORT.split())
    + "]'"
)


@functools.cache
def failing_sweep() -> Session:
    """Three jobs, the third failing (a LoRA target the model lacks); launched again; reported."""
    session = Session("sweep-failed")
    session.run(FAILING_SWEEP, expect=1)
    session.run(FAILING_SWEEP, expect=1)
    session.run("python -m exp.report multirun/s1")
    return session


@figure("sweep-failed", "docs/sweeps.md")
def sweep_failed() -> str:
    first = failing_sweep().done[0]
    lines = first.lines()
    last = max(i for i, line in enumerate(lines) if "[HYDRA] sweep multirun/s1" in line)
    tail = "\n".join(lines[last:]).rstrip()
    return f"```\n$ {first.command}\n...\n{tail}\n$ echo $?\n{first.code}\n```"


@figure("sweep-report", "docs/sweeps.md")
def sweep_report() -> str:
    return f"```\n{failing_sweep().done[2].shown()}\n```"


refusals(
    "gpus-no-gpu",
    "docs/sweeps.md",
    "python -m exp.train -m hydra/launcher=gpus lora.r=4,8      # this CPU-only machine",
    expect=3,
)

OPTUNA = (
    "python -m exp.train -m --config-dir sweeps --config-name optuna_lr_rank hydra.sweeper.n_trials={trials} "
    "trainer.max_steps={steps} trainer.warmup_steps=0 trainer.val_every_n_steps=3 data.num_examples=120 "
    "trainer.sample_count=0 logger=csv hydra.sweep.dir=opt"
)


def lock_held(path: Path) -> bool:
    """Whether another process holds `path`'s flock (a launch writing its sweep directory)."""
    import fcntl

    if not path.exists():
        return False
    with path.open() as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


@functools.cache
def optuna_study() -> Session:
    """The shipped Optuna study run once (2 trials), launched again with other settings (refused), launched with a
    third trial while that launch runs in another process (refused), and launched again with its own settings."""
    session = Session("optuna-study")
    (session.dir / "sweeps").symlink_to(ROOT / "sweeps")
    first = OPTUNA.format(trials=2, steps=3)
    session.run(first)
    session.run(OPTUNA.format(trials=2, steps=40) + " lora.alpha=16", timeout=ERROR_TIMEOUT, expect=2)
    third = OPTUNA.format(trials=3, steps=3)
    other = subprocess.Popen(["bash", "-c", third], cwd=session.dir, env=session.env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.time() + ERROR_TIMEOUT
    while not lock_held(session.dir / "opt" / ".lock") and other.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    if not lock_held(session.dir / "opt" / ".lock"):
        other.kill()
        raise SystemExit("readme_figures: optuna-study: the launch in the other process never held opt/.lock")
    session.run(third + "      # while the same command runs in another process", timeout=ERROR_TIMEOUT, expect=2)
    if other.wait(timeout=1800) != 0:
        raise SystemExit(f"readme_figures: optuna-study: the launch with a third trial exited {other.returncode}")
    session.run(first)
    return session


@figure("optuna-refusals", "docs/sweeps.md")
def optuna_refusals() -> str:
    _, other_settings, concurrent, _ = optuna_study().done
    shown = [other_settings.shown(), f"$ echo $?\n{other_settings.code}", concurrent.shown()]
    return "```\n" + "\n".join(shown) + "\n```"


@figure("optuna-reuse", "docs/sweeps.md")
def optuna_reuse() -> str:
    again = optuna_study().done[-1]
    keep = re.compile(r"already completed with this config|\[HYDRA\] (Best parameters|Best value|sweep opt)")
    lines = [re.sub(r"^\[[\d-]+ [\d:,]+\]", "", line) for line in again.lines() if keep.search(line)]
    return f"```\n$ {again.command}\n" + "\n".join(lines) + "\n```"


PACKED = (
    "python -m exp.train -m hydra/launcher=gpus hydra.launcher.pack=true 'hydra.launcher.devices=[0]' "
    "'hydra.launcher.memory_gib=[1.25]' seeds={seeds} trainer.learning_rate={lrs} trainer.max_steps=30 "
    "trainer.warmup_steps=0 trainer.val_every_n_steps=15 trainer.log_every_n_steps=1 trainer.sample_count=0 "
    "data.num_examples=400 logger=csv 'hydra.job.config.override_dirname.exclude_keys=[trainer.max_steps,"
    "trainer.warmup_steps,trainer.val_every_n_steps,trainer.log_every_n_steps,trainer.sample_count,data.num_examples,"
    "logger]' hydra.sweep.dir={dir}"
)


@functools.cache
def packed_study() -> Session:
    """The packed study on one simulated GPU of 1.25 GiB, its report, and the plan of a second study."""
    session = Session("packed-study")
    session.run(PACKED.format(seeds=2, lrs="2e-3,5e-3", dir="multirun/lr"))
    session.run("python -m exp.report multirun/lr")
    session.run(PACKED.format(seeds=3, lrs="1e-3,3e-3,1e-2", dir="multirun/lr2") + " --plan")
    shutil.copy(session.dir / "multirun/lr/loss_curves_by_config.png", ROOT / "docs/sweeps_loss_curves_by_config.png")
    return session


def elide_rows(lines: list[str], row: re.Pattern) -> list[str]:
    """`lines` with the rows matching `row` after the first of each run cut to its last, `...` between."""
    out: list[str] = []
    for i, line in enumerate(lines):
        first = not (i and row.match(lines[i - 1]))
        last = not (i + 1 < len(lines) and row.match(lines[i + 1]))
        if not row.match(line) or first or last:
            out.append(line)
        elif out[-1] != "...":
            out.append("...")
    return out


@figure("packed-study", "docs/sweeps.md")
def packed_study_block() -> str:
    launch, report, _ = packed_study().done
    hydra = re.compile(r"^(\[[\d-]+ [\d:,]+\])?\[HYDRA\]")  # the launcher's lines (with the time when logged)
    shown = [line for line in launch.lines() if hydra.match(line) or line.startswith("exp: ")]
    shown = elide_rows(shown, re.compile(hydra.pattern + r" plan: \d+_"))
    return f"```\n$ {launch.command}\n" + "\n".join(shown) + f"\n\n{report.shown()}\n```"


@figure("packed-plan", "docs/sweeps.md")
def packed_plan() -> str:
    plan = packed_study().done[2]
    row = re.compile(r"^\d+_trainer")
    first = next(line for line in plan.lines() if row.match(line))
    # The s/step and job s columns, before the run the times come from.
    step, job = re.search(r"\s([\d.]+)\s+([\d.]+)\s+multirun/\S+$", first).groups()
    jobs = re.search(r"study plan: (\d+) job", plan.output).group(1)
    together = re.search(r"at most (\d+) at once", plan.output).group(1)
    intro = prose(
        f"The first study had no throughput to plan with. The next one does: its plan takes the step time ({step} s) "
        f"and the job's wall-clock as the launcher measured it ({job} s: the process's start included) from the study "
        f"above, and places {jobs} jobs, at most {together} at a time:"
    )
    note = prose(
        f"(The CPU jobs report no peak GiB: `peak_memory_gib` is CUDA's. The {job} s record was measured with jobs "
        f"sharing this machine's {os.cpu_count()} cores, so here the lower bound already holds that sharing.)"
    )
    shown = "\n".join(elide_rows(plan.lines(), row))
    return f"{intro}\n\n```\n$ {plan.command}\n{shown}\n```\n\n{note}"


GROUPED = PACKED.replace("hydra.launcher.pack=true ", "hydra.launcher.share_base=true ").replace(
    "'hydra.launcher.memory_gib=[1.25]' ", ""
)


@functools.cache
def grouped_study() -> Session:
    """The packed study's jobs sharing one base: the plan, the study, its report."""
    session = Session("grouped-study")
    session.run(GROUPED.format(seeds=2, lrs="2e-3,5e-3", dir="multirun/grouped") + " --plan")
    session.run(GROUPED.format(seeds=2, lrs="2e-3,5e-3", dir="multirun/grouped"))
    session.run("python -m exp.report multirun/grouped")
    return session


@figure("grouped-study", "docs/sweeps.md")
def grouped_study_block() -> str:
    plan, launch, report = grouped_study().done
    hydra = re.compile(r"^(\[[\d-]+ [\d:,]+\])?\[HYDRA\]")
    shown = [line for line in launch.lines() if hydra.match(line) and " plan: " not in line]
    plan_lines = elide_rows(plan.lines(), re.compile(r"^\d+_trainer"))
    return (
        f"```\n$ {plan.command}\n"
        + "\n".join(plan_lines)
        + f"\n\n$ {launch.command}\n"
        + "\n".join(shown)
        + f"\n\n{report.shown()}\n```"
    )


# --- docs/bench.md ------------------------------------------------------------------------------------------------

BENCH = (
    "python -m exp.bench model=gemma_tiny seq=64 micro_batch=2 steps=6 warmup=2 ablate=true "
    'variant="exp hardware.loss_impl=chunked" out_dir=bench-doc'
)


@figure("bench-cpu", "docs/bench.md")
def bench_cpu() -> str:
    session = Session("bench-cpu")
    done = session.run(BENCH)
    head = [line for line in done.lines() if line.startswith(("exp.bench:", "  "))][:3]
    (md,) = (session.dir / "bench-doc").glob("*.md")
    lines = md.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| variant |"))
    table = [line for line in lines[start:] if line.startswith("|")]
    table = table[: next((i for i, line in enumerate(table) if line.startswith("| step |")), len(table))]
    (result,) = (session.dir / "bench-doc").glob("*.json")
    report = json.loads(result.read_text())
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v and k in VERSIONS)
    diffs = [r["parity"]["max_rel_loss_diff"] for r in report["rows"] if r.get("parity")]
    note = prose(
        f"({versions}; git {(report['git'].get('commit') or 'unknown')[:7]}; {minutes(done.seconds)} on "
        f"{caption_machine(done)}.) What it shows: both sides ran on the same tokens from the same adapters and took "
        f"the same steps: in float32 exp's losses are within {max(diffs):.1e} of the baseline's (relative, every "
        "variant)."
    )
    return f"```\n$ {BENCH}\n" + "\n".join([*head, "  ..."]) + "\n```\n\n" + "\n".join(table) + f"\n\n{note}"


VERSIONS = ("torch", "transformers", "peft", "bitsandbytes", "lightning")


# --- the command line ---------------------------------------------------------------------------------------------

GROUPS = {"all-cpu": "cpu"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Checked here, not with `choices`: argparse tests an empty nargs="*" positional against its choices.
    p.add_argument("figures", nargs="*", help="block names, or all-cpu (default: default-run)")
    p.add_argument("--list", action="store_true", help="list the blocks and exit")
    args = p.parse_args(argv)
    if args.list:
        for name, fig in FIGURES.items():
            print(f"{name:24} {fig.group:6} {fig.doc}")
        return 0
    if unknown := [f for f in args.figures if f not in FIGURES and f not in GROUPS]:
        p.error(f"unknown figure(s) {', '.join(unknown)}: choose from all-cpu, {', '.join(FIGURES)}")
    names = []
    for f in args.figures or ["default-run"]:
        names += [n for n, fig in FIGURES.items() if fig.group == GROUPS[f]] if f in GROUPS else [f]
    for name in dict.fromkeys(names):
        fig = FIGURES[name]
        started = time.time()
        body = fig.make()
        doc = ROOT / fig.doc
        doc.write_text(replace_block(doc.read_text(), name, body, fig.doc))
        print(f"readme_figures: {name} -> {fig.doc} ({time.time() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
