"""Faults during training: NaN/Inf steps stop (or are skipped, up to a limit) with a message naming the step and
the last good checkpoint; running out of GPU memory gives the estimate's breakdown and concrete fixes. In every case
the run is marked failed and no adapter is saved as final."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import SHORT
from safetensors.torch import load_file

from exp.train import run
from exp.training.faults import NonFiniteError, OutOfMemory
from exp.training.module import QLoRAModule

pytestmark = pytest.mark.slow  # every test here trains


def poison_step(monkeypatch, steps: set[int], make) -> None:
    """Make the training loss of the given optimiser steps (1-based) `make(loss)`, e.g. NaN."""
    real = QLoRAModule.training_step

    def training_step(self, batch, batch_idx):
        loss = real(self, batch, batch_idx)
        if self.trainer.global_step + 1 in steps:
            loss = make(loss)
        return loss

    monkeypatch.setattr(QLoRAModule, "training_step", training_step)


def test_nan_loss_stops_naming_the_step_and_the_last_good_checkpoint(tmp_path, monkeypatch):
    poison_step(monkeypatch, {20}, lambda loss: loss * float("nan"))
    with pytest.raises(NonFiniteError) as e:
        run(SHORT, output_dir=tmp_path / "run")
    message = str(e.value)
    assert "step 20" in message and str(tmp_path / "run" / "checkpoints" / "last.ckpt") in message
    assert (
        "trainer.on_nonfinite=skip" in message
        and f"trainer.resume={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}" in message
    )
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and "step 20" in status["error"]
    assert not (tmp_path / "run" / "adapter").exists()
    # The last checkpoint (step 15) holds finite weights: the bad update never happened.
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 15 and all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())


def test_nan_steps_are_skipped_up_to_the_limit(tmp_path, monkeypatch):
    poison_step(monkeypatch, {5, 9}, lambda loss: loss * float("inf"))
    result = run(
        [*SHORT, "trainer.on_nonfinite=skip", "trainer.max_skipped_steps=2"],
        output_dir=tmp_path / "run",
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_steps"] == 2 and summary["steps"] == 30
    assert math.isfinite(result.final_val["val/loss"]) and result.final_val["val/loss"] < result.initial_val["val/loss"]
    weights = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_nan_steps_beyond_the_limit_stop(tmp_path, monkeypatch, capsys):
    poison_step(monkeypatch, {3, 4}, lambda loss: loss * float("nan"))
    with pytest.raises(NonFiniteError, match=r"step 4.*after 1 skipped steps \(trainer.max_skipped_steps=1\)"):
        run([*SHORT, "trainer.on_nonfinite=skip", "trainer.max_skipped_steps=1"], output_dir=tmp_path / "run")
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "failed"
    # The progress bar's line is ended before the error propagates: the message starts on a line of its own.
    assert capsys.readouterr().out.endswith("\n")
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step 3: NaN/Inf loss or gradients, update skipped" in log
    assert "run failed: NonFiniteError: step 4" in log


def test_out_of_memory_explains_the_estimate_and_what_to_change(tmp_path, monkeypatch):
    def oom(loss):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    poison_step(monkeypatch, {3}, oom)
    with pytest.raises(OutOfMemory) as e:
        run(SHORT, output_dir=tmp_path / "run")
    message = str(e.value)
    assert "out of memory at step 2" in message  # two steps completed before the failing third
    assert "quantized_weights" in message and "total" in message  # the estimator's breakdown
    assert "hardware.micro_batch_size=4" in message and "trainer.global_batch_size=8 stays" in message
    assert "hardware.gradient_checkpointing=true" in message and "data.max_seq_len" in message
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "failed"
    assert not (tmp_path / "run" / "adapter").exists()
