"""exp.report's plots read on their own: legends name the swept values, learning rates on a log axis, and the
validation loss over steps has a plot of its own."""

from __future__ import annotations

from pathlib import Path

from exp.report import JobRow, curve_label, log_axis, plot
from exp.study.stats import swept_keys


def _rows() -> list[JobRow]:
    return [
        JobRow(
            f"{i}_trainer.learning_rate={lr}",
            Path(f"/sweep/{i}"),
            "completed",
            overrides={"trainer.learning_rate": lr, "lora.r": "8"},
            final=1.0 + i,
            curve=[(1, 3.0), (2, 2.5), (3, 2.0)],
            val_curve=[(0, 3.1), (3, 2.1)],
        )
        for i, lr in enumerate(["1e-4", "1e-3", "1e-2"])
    ]


def test_a_curve_is_named_by_its_swept_values():
    rows = _rows()
    assert curve_label(rows[1], swept_keys(rows)) == "1 trainer.learning_rate=1e-3 (completed)"


def test_learning_rates_are_plotted_on_a_log_axis():
    assert log_axis("trainer.learning_rate", [1e-4, 1e-3])
    assert not log_axis("lora.r", [8.0, 16.0])
    assert not log_axis("data.format", [0, 1])  # categorical positions


def test_the_report_plots_validation_loss_over_steps(tmp_path):
    written = plot(_rows(), "val/loss", tmp_path)
    assert tmp_path / "val_loss_curves.png" in written and (tmp_path / "val_loss_curves.png").stat().st_size > 0
    assert tmp_path / "val_loss_vs_trainer.learning_rate.png" in written
