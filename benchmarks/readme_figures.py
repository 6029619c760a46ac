"""Regenerate the README's measured figures from real runs, instead of editing them by hand.

    python benchmarks/readme_figures.py                # the default run's example output (minutes on 2 cores)
    python benchmarks/readme_figures.py tests          # the test suite's count and time (one full pytest run)
    python benchmarks/readme_figures.py default-run tests

Each figure sits in README.md between `<!-- readme_figures:<name> -->` and `<!-- /readme_figures:<name> -->`, and
only those lines are replaced:

- `default-run`: `python -m exp.train`, exactly as the README says, in a fresh temporary directory (its own model
  cache too, unless EXP_CACHE is set); the block shows the progress bar's last line and the summary the run
  prints, with the temporary directory left out of the run's path (`-> outputs/<date>/<time>`), under a caption
  giving the machine's mean load while it ran (other processes on the cores slow the run down).
- `tests`: `python -m pytest` from the repository root; the sentence gives its summary line (passed / skipped) and
  wall time, with the machine's core count.

The raw output of each run is kept in `benchmarks/results/readme_<name>.txt`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"


def replace_block(text: str, name: str, body: str) -> str:
    """`text` with the lines between the `name` markers replaced by `body`."""
    start, end = f"<!-- readme_figures:{name} -->", f"<!-- /readme_figures:{name} -->"
    pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"readme_figures: README.md has no '{start}' ... '{end}' block to replace")
    return pattern.sub(lambda _: f"{start}\n{body.rstrip()}\n{end}", text, count=1)


def last_bar_line(stderr: str) -> str:
    """The progress bar's final state: the last complete `Training: 100%|...|` frame (frames end with \\r)."""
    frames = [f.strip() for f in re.split(r"[\r\n]", stderr)]
    epochs = [f for f in frames if f.startswith("Training") and "100%" in f and "val/loss" in f]
    if not epochs:
        raise SystemExit("readme_figures: no final progress bar line in the run's output")
    return epochs[-1]


def default_run() -> str:
    """Run the default job as the README shows it; return the example-output block."""
    with tempfile.TemporaryDirectory(prefix="readme-figures-") as tmp:
        env = dict(os.environ)
        env.setdefault("EXP_CACHE", str(Path(tmp) / "cache"))  # a fresh machine builds the tiny model first
        env.pop("WANDB_API_KEY", None)  # offline W&B, as on a machine without credentials
        started = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-m", "exp.train"],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # The machine's load while it runs (other processes slow the run down: the caption says how busy it was).
        loads = []
        with ThreadPoolExecutor(1) as pool:
            output = pool.submit(proc.communicate)
            while not output.done():
                loads.append(os.getloadavg()[0])
                time.sleep(5)
            stdout, stderr = output.result()
        wall = time.time() - started
        (RESULTS / "readme_default-run.txt").write_text(
            f"$ python -m exp.train   # in {tmp}, {wall:.0f} s wall, exit {proc.returncode}, "
            f"mean 1-minute load average {statistics.mean(loads):.1f} on {os.cpu_count()} cores\n"
            f"--- stdout\n{stdout}\n--- stderr\n{stderr}"
        )
        if proc.returncode != 0:
            raise SystemExit(f"readme_figures: the default run failed (exit {proc.returncode}):\n{stderr[-3000:]}")
        summary = stdout[stdout.index("exp: ") :].rstrip()
        summary = summary.replace(f"{Path(tmp).resolve()}/", "").replace(f"{tmp}/", "")
    caption = (
        f"Example (`python -m exp.train` on this machine: {os.cpu_count()} CPU cores, mean load average "
        f"{statistics.mean(loads):.1f} during the run; the bar shows loss, tokens/s and validation loss; written by "
        "`python benchmarks/readme_figures.py` from the run's output):"
    )
    # exp draws its bar on the console (stdout); warnings go to stderr: look in both.
    return f"{caption}\n\n```\n{last_bar_line(stdout + chr(10) + stderr)}\n\n{summary}\n```"


def test_suite() -> str:
    """Run the whole test suite; return the README sentence with its summary and time."""
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    minutes = (time.time() - started) / 60
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    commit = commit.strip() or "unknown"
    (RESULTS / "readme_tests.txt").write_text(
        f"$ python -m pytest -q   # {minutes:.1f} min wall\n{proc.stdout[-20000:]}"
    )
    line = proc.stdout.strip().splitlines()[-1].strip("= ")
    if proc.returncode != 0 or "failed" in line or "error" in line:
        raise SystemExit(f"readme_figures: the test suite did not pass: {line}")
    counts = re.sub(r" in [\d.]+s.*$", "", line)  # "536 passed, 15 skipped, 3 warnings"
    counts = ", ".join(part for part in counts.split(", ") if "warning" not in part)
    return (
        f"Measured at commit {commit}: {counts} in {minutes:.0f} minutes on {os.cpu_count()} CPU cores "
        "(`python benchmarks/readme_figures.py tests`)."
    )


FIGURES = {"default-run": default_run, "tests": test_suite}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Checked here, not with `choices`: argparse tests an empty nargs="*" positional against its choices.
    p.add_argument("figures", nargs="*", help=f"which to regenerate: {', '.join(FIGURES)} (default: default-run)")
    args = p.parse_args(argv)
    if unknown := [f for f in args.figures if f not in FIGURES]:
        p.error(f"unknown figure(s) {', '.join(unknown)}: choose from {', '.join(FIGURES)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in dict.fromkeys(args.figures or ["default-run"]):
        README.write_text(replace_block(README.read_text(), name, FIGURES[name]()))
    print(f"readme_figures: {README} updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
