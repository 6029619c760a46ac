"""The embedded default run: `python -m exp.train` with nothing else, on this CPU, learns the embedded task."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    # How long it takes is a benchmark figure (README), not asserted: CI and users share busy machines.
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    first, last = summary["initial_val"], summary["final_val"]
    assert last["val/loss"] <= 0.75 * first["val/loss"], (first, last)
    # Clearly above chance: the best constant guess scores the majority-token baseline.
    assert last["val/token_accuracy"] > 3 * summary["chance_token_accuracy"]
    assert last["val/exact_match"] > 0.2 and first["val/exact_match"] == 0.0
    assert "val loss" in proc.stdout and "token accuracy" in proc.stdout  # the printed summary
    assert "train/tokens_per_s" in proc.stdout + proc.stderr  # the progress bar shows throughput
    assert (tmp_path / "run" / "wandb").is_dir()  # default logger: W&B, offline, inside the run dir
