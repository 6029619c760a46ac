"""Continuing a finished run with a larger trainer.max_steps: the learning-rate schedule is stretched to the new
length and picked up at the checkpoint's step, and the log says so (docs/resume.md)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import compose_typed

from exp.training.module import continued_schedule_note, lr_lambda


def _scheduler(max_steps: int, warmup: int, schedule, lr: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Built as QLoRAModule.configure_optimizers builds it."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup, max_steps, schedule))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_note_names_the_learning_rate_the_restored_scheduler_gives(schedule):
    t = compose_typed(["trainer.max_steps=8", f"trainer.lr_schedule={schedule}"]).trainer
    old = _scheduler(
        4, compose_typed(["trainer.max_steps=4"]).trainer.warmup_step_count, t.lr_schedule, t.learning_rate
    )
    for _ in range(4):
        old.optimizer.step()
        old.step()
    ended_at = old.optimizer.param_groups[0]["lr"]  # what the finished run's next step would have had
    new = _scheduler(8, t.warmup_step_count, t.lr_schedule, t.learning_rate)
    new.load_state_dict(old.state_dict())  # what Lightning does with the checkpoint's scheduler state
    new.optimizer.param_groups[0]["lr"] = new.get_last_lr()[0]
    continued = lr_lambda(new.last_epoch, t.warmup_step_count, 8, t.lr_schedule) * t.learning_rate
    assert new.last_epoch == 4 and continued > ended_at  # stretched: a cosine / linear decay rises again

    note = continued_schedule_note(t, 4, 4)
    assert note.startswith(f"trainer.max_steps 4 -> 8: the {schedule} learning-rate schedule is stretched to 8 steps")
    last, now = (float(x) for x in re.search(r"goes from (\S+) \(step 3\) to (\S+)$", note).groups())
    assert last == pytest.approx(lr_lambda(3, 1, 4, t.lr_schedule) * t.learning_rate, rel=1e-2)
    assert now == pytest.approx(continued, rel=1e-2)


def test_the_same_length_needs_no_note():
    assert continued_schedule_note(compose_typed(["trainer.max_steps=8"]).trainer, 8, 4) is None
