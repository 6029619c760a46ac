"""The embedded default run: `python -m exp.train` with nothing else, on this CPU, learns the embedded task."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_default_run_learns(default_run):
    # How long it takes is a benchmark figure (README), not asserted: CI and users share busy machines.
    # The run is conftest's `default_run` (test_tracking reads how it tracks): one default run for both.
    proc, run_dir, _ = default_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    first, last = summary["initial_val"], summary["final_val"]
    assert last["val/loss"] <= 0.75 * first["val/loss"], (first, last)
    # Clearly above chance: the best constant guess scores the majority-token baseline.
    assert last["val/token_accuracy"] > 3 * summary["chance_token_accuracy"]
    assert last["val/exact_match"] > 0.2 and first["val/exact_match"] == 0.0
    assert "val loss" in proc.stdout and "token accuracy" in proc.stdout  # the printed summary
    assert "train/tokens_per_s" in proc.stdout + proc.stderr  # the progress bar shows throughput
    # The warm-up's cost beyond two median steps (what a compile cache saves a second run), in seconds.
    assert summary["warmup_extra_s"] is not None and summary["step_seconds_median"] > 0
    assert (run_dir / "wandb").is_dir()  # default logger: W&B, offline, inside the run dir
