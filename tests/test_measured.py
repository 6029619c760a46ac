"""What the user asked for is what is measured (issue 25, class 3), and the CSV record holds each step once (class 7).

- `data.val_path` is the validation split for every data source (the generated default included: its file holds
  Alpaca rows), and the log, summary.json and `exp.report` say what validation ran on.
- `exp.evaluate data.path=<file>` (like `data=<file>`) scores that file, or refuses before any model loads; its
  report names the file it scored.
- `csv/metrics.csv` has one row per optimiser step, numbered by the steps done; the last step's training metrics
  are recorded whatever `trainer.log_every_n_steps` is; a validation that fit has just run at the last step is not
  run again; an empty loss plot says why.

One short run (`measured`, a module fixture) serves the slow tests.
"""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import compose_typed
from test_splits import CASES, COMMON, write_rows

from exp.core.config import ConfigError, DataFormat
from exp.data.datamodule import InstructionDataModule
from exp.data.splits import all_examples
from exp.model.build import build_tokenizer

WORDS = ["red", "fox", "owl", "bee", "sun", "moon", "leaf"]


def alpaca_rows(path: Path, n: int, offset: int = 0) -> Path:
    """n rows of the generated task's shape (Alpaca rows), distinct from any the generator draws by their words."""
    lines = []
    for i in range(n):
        words = " ".join(WORDS[(i + offset + k) % len(WORDS)] for k in range(3 + i % 3))
        lines.append(json.dumps({"instruction": "Repeat the words exactly.", "input": words, "output": words}))
    path.write_text("\n".join(lines) + "\n")
    return path


def ids(examples) -> list[list[int]]:
    return [e.input_ids for e in examples]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(compose_typed([]).model)


# ---------------------------------------------------------------------------------------------------- data.val_path


@pytest.mark.parametrize("case", list(CASES))
def test_val_path_is_the_validation_split_of_every_data_source(case, tmp_path, tokenizer):
    """Every option of conf/data: with data.val_path the held-out examples are that file's rows (all of them, in
    order) and training keeps every row of its own source."""
    val = tmp_path / "val.jsonl"
    if case == "synthetic":
        alpaca_rows(val, 5)
        overrides = [*CASES[case], *COMMON]
    else:
        write_rows(val, case, range(30, 35))
        overrides = [*CASES[case], f"data.path={write_rows(tmp_path / 'train.jsonl', case, range(24))}", *COMMON]
    cfg = compose_typed([*overrides, f"data.val_path={val}"]).data
    dm = InstructionDataModule(cfg, tokenizer, micro_batch_size=4)
    as_file = replace(cfg, format=DataFormat.alpaca if case == "synthetic" else cfg.format, path=str(val))
    assert ids(dm.val_set) == ids(all_examples(as_file, tokenizer))
    assert len(dm.train_set) == 24  # nothing carved from the training source
    assert dm.stats["validated_on"] == f"data.val_path={val} (every usable row)"


def test_without_val_path_the_summary_says_what_was_held_out(tokenizer):
    cfg = compose_typed(["data.num_examples=40", "data.val_size=4"]).data
    dm = InstructionDataModule(cfg, tokenizer, micro_batch_size=4)
    assert len(dm.val_set) == 4
    assert dm.stats["validated_on"] == (
        "data.val_size=4 of the generated task (data.num_examples=40), drawn with data.seed=0"
    )


@pytest.mark.parametrize("key", ["data.path", "data.hub_id"])
def test_a_dataset_named_with_the_generated_default_is_refused(key):
    """`data.path=` without `data=<format>` would train on generated rows while the user named a file."""
    with pytest.raises(ConfigError, match=rf"{key}=x.*data.format=synthetic.*data=alpaca"):
        compose_typed([f"{key}=x"])


# ---------------------------------------------------------------------------------------------------- evaluate


def test_evaluate_source_arguments(tmp_path, monkeypatch):
    """data=, data.path= and data.val_path= name a file to score whole (made absolute); two different ones, a
    missing file, or a split field that a whole file ignores are refused with the key, the value and the fix."""
    from exp.evaluate import EvalSource, eval_source

    monkeypatch.chdir(tmp_path)
    f = alpaca_rows(tmp_path / "eval.jsonl", 3)
    assert eval_source(None, {}) is None
    for key in ("data", "data.path", "data.val_path"):
        args = ("eval.jsonl", {}) if key == "data" else (None, {key: "eval.jsonl"})
        assert eval_source(*args) == EvalSource(key, str(f))
    assert eval_source("eval.jsonl", {"data.path": "eval.jsonl"}) == EvalSource("data", str(f))
    assert eval_source(None, {"data.hub_id": "org/set"}) == EvalSource("data.hub_id", "org/set")
    with pytest.raises(ConfigError, match=r"data.path=missing.jsonl: no such file.*drop data.path= to score"):
        eval_source(None, {"data.path": "missing.jsonl"})
    with pytest.raises(ConfigError, match=r"data=eval.jsonl and data.path=other.jsonl: two datasets"):
        eval_source("eval.jsonl", {"data.path": "other.jsonl"})
    with pytest.raises(ConfigError, match=r"data.val_size=0.5 with data.path=eval.jsonl: .*would change nothing"):
        eval_source(None, {"data.path": "eval.jsonl", "data.val_size": "0.5"})


def test_evaluate_data_path_on_a_generated_run_reads_the_file(tmp_path, tokenizer):
    """A run on the generated default scored with data.path=<file>: the file's rows as Alpaca rows, not generated
    ones (which a synthetic config with a path would otherwise draw)."""
    from exp.evaluate import eval_data_config, eval_examples

    f = alpaca_rows(tmp_path / "eval.jsonl", 6)
    run = compose_typed(["data.num_examples=40"]).data
    cfg = eval_data_config(run, None, {"data.path": str(f), "data.max_seq_len": "64"})
    assert (cfg.format, cfg.path, cfg.max_seq_len) == (DataFormat.alpaca, str(f), 64)
    assert ids(eval_examples(cfg, tokenizer, whole=True)) == ids(all_examples(cfg, tokenizer))
    assert len(eval_examples(cfg, tokenizer, whole=True)) == 6


# ---------------------------------------------------------------------------------------------------- metrics.csv


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_csv_rows_are_numbered_by_steps_done_one_per_step(tmp_path, monkeypatch):
    """Lightning's call pattern for a 4-step run validating every 2 steps: the step-0 evaluation (exp's, step 0),
    training metrics and fit's validations at the steps done less one, the final `validate` at the steps done.
    The record holds each step once, training and validation metrics of a step in one row, no epoch column."""
    from exp.run.csv_record import AtomicCSVLogger

    done = [0]
    logger = AtomicCSVLogger(save_dir=str(tmp_path), name="", version="csv", steps_done=lambda: done[0])
    path = tmp_path / "csv" / "metrics.csv"

    def log(metrics, step):
        logger.log_metrics({**metrics, "epoch": 0}, step=step)
        logger.save()

    log({"val/loss": 9.0}, 0)
    for n in range(1, 5):
        done[0] = n
        log({"train/loss": 10.0 - n}, n - 1)
        if n % 2 == 0:
            log({"val/loss": 9.0 - n}, n - 1)
    log({"train/loss": 5.5}, 3)  # the last step's training metrics again: the later value stands
    before = path.read_text()
    log({"val/loss": 4.5}, 4)  # a final validation of the same step
    rows = read_csv(path)
    assert "epoch" not in rows[0]
    assert [(r["step"], r["train/loss"], r["val/loss"]) for r in rows] == [
        ("0", "", "9.0"),
        ("1", "9.0", ""),
        ("2", "8.0", "7.0"),
        ("3", "7.0", ""),
        ("4", "5.5", "4.5"),
    ]
    assert before.splitlines()[:-1] == path.read_text().splitlines()[:-1]

    # Completing the last row rewrites the file whole or not at all.
    done[0] = 5
    log({"train/loss": 1.0}, 4)
    before = path.read_text()

    def dies_mid_write(self, rows):
        self.writerow(next(iter(rows)))
        raise OSError("killed")

    monkeypatch.setattr(csv.DictWriter, "writerows", dies_mid_write)
    with pytest.raises(OSError):
        log({"val/loss": 0.5}, 5)
    assert path.read_text() == before and [p.name for p in path.parent.iterdir()] == ["metrics.csv"]


def test_an_empty_loss_plot_says_why(tmp_path):
    """A run shorter than its logging interval, recorded without a final-step row: the report and the plot say so."""
    from exp.report import main

    run = tmp_path / "run"
    (run / "csv").mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"status": "completed"}))
    (run / "config.yaml").write_text("trainer:\n  log_every_n_steps: 25\n")
    (run / "csv" / "metrics.csv").write_text("step,val/loss\n0,6.6\n5,6.5\n")
    final = {"val/loss": 6.5}
    summary = {"steps": 5, "seconds": 3.0, "final_val": final, "data": {"validated_on": "data.val_path=v.jsonl"}}
    (run / "summary.json").write_text(json.dumps(summary))
    assert main([str(run)]) == 0
    report = (run / "report.md").read_text()
    assert "- val/* measured on: data.val_path=v.jsonl" in report
    assert "no loss curve for run: no train/loss row in csv/metrics.csv: 5 steps, fewer than " in report
    assert "trainer.log_every_n_steps=25" in report


# ---------------------------------------------------------------------------------------------------- one short run

# 4 steps of two micro-batches each, validating every 2 steps and logging training metrics every 3: the last step
# (4) is no logging step, and fit's own validation falls on it.
RUN = [
    "trainer.max_steps=4",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=2",
    "trainer.log_every_n_steps=3",
    "trainer.sample_count=1",
    "trainer.sample_max_new_tokens=4",
    "hardware.micro_batch_size=4",
    "data.num_examples=64",
    "logger=csv",
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from exp.train import run

    root = tmp_path_factory.mktemp("measured")
    val = alpaca_rows(root / "val.jsonl", 5)
    result = run([*RUN, f"data.val_path={val}"], output_dir=root / "run")
    return result, val


@pytest.mark.slow
def test_the_run_validates_on_val_path_and_says_so(measured):
    result, val = measured
    dm = result.module.trainer.datamodule
    assert len(dm.val_set) == 5 and len(dm.train_set) == 64
    summary = json.loads((result.output_dir / "summary.json").read_text())
    assert summary["data"]["validated_on"] == f"data.val_path={val} (every usable row)"
    assert f"validated on    data.val_path={val}" in (result.output_dir / "train.log").read_text()
    manifest = json.loads((result.output_dir / "manifest.json").read_text())
    assert manifest["val_data_fingerprint"].startswith("sha256:")


@pytest.mark.slow
def test_metrics_csv_holds_each_step_once_with_the_last_steps_training_row(measured):
    result, _ = measured
    rows = read_csv(result.output_dir / "csv" / "metrics.csv")
    steps = [int(r["step"]) for r in rows]
    assert steps == [0, 2, 3, 4], "one row per step, numbered by the optimiser steps done"
    assert [int(r["step"]) for r in rows if r["train/loss"]] == [3, 4], "the last step is recorded"
    assert [int(r["step"]) for r in rows if r["train/lr"]] == [3, 4]
    assert [int(r["step"]) for r in rows if r["val/loss"]] == [0, 2, 4]
    assert float(rows[-1]["val/loss"]) == pytest.approx(result.final_val["val/loss"], rel=1e-6)  # logged as float32
    assert result.module.last_val_step == 4
    # Fit validated at step 4, so no second (final) validation ran: train.log records each logging call once.
    log = (result.output_dir / "train.log").read_text()
    validations = [
        line.split(" - ", 1)[1].split(":")[0]
        for line in log.splitlines()
        if "[exp.record]" in line and "val/loss=" in line
    ]
    assert validations == ["step 0", "step 2", "step 4"]


@pytest.mark.slow
def test_report_labels_what_was_scored_and_plots_the_short_curve(measured):
    from exp.report import main, read_run

    result, val = measured
    assert [s for s, _ in read_run(result.output_dir, "val/loss").curve] == [3, 4]
    assert main([str(result.output_dir)]) == 0
    report = (result.output_dir / "report.md").read_text()
    assert f"- val/* measured on: data.val_path={val} (every usable row)" in report
    assert "no loss curve" not in report


@pytest.mark.slow
def test_evaluate_scores_the_held_out_file_and_names_it(measured):
    from exp.evaluate import evaluate

    result, val = measured
    report = evaluate([f"run={result.output_dir}"])
    assert report["data"]["path"] == str(val)
    assert report["data"]["split"] == f"data.val_path={val} (every usable row)"
    assert report["examples"] == 5
    assert report["loss"] == pytest.approx(result.final_val["val/loss"], abs=1e-5)


@pytest.mark.slow
def test_evaluate_data_path_scores_that_file(measured, tmp_path):
    from exp.evaluate import evaluate

    result, _ = measured
    other = alpaca_rows(tmp_path / "other.jsonl", 7, offset=3)
    report = evaluate([f"run={result.output_dir}", f"data.path={other}"])
    assert report["data"] == {
        "format": "alpaca",
        "path": str(other),
        "hub_id": None,
        "split": f"all usable rows of {other}",
    }
    assert report["examples"] == 7
    assert json.loads((result.output_dir / "eval_other.json").read_text())["data"]["path"] == str(other)


@pytest.mark.slow
def test_evaluate_refuses_a_missing_file_before_loading(measured, capsys):
    from exp.evaluate import main

    result, _ = measured
    with pytest.raises(SystemExit) as stop:
        main([f"run={result.output_dir}", "data.path=/nonexistent/eval.jsonl"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "data.path=/nonexistent/eval.jsonl: no such file or directory" in err and "Traceback" not in err
