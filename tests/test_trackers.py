"""TensorBoard and MLflow beside the CSV (and W&B): `logger=[...]` composes several trackers, each gets the same
metrics at the same steps as csv/metrics.csv and the same redacted config, and a continued run goes on in the same
tracker runs. Everything is read back from the files the trackers wrote: TensorBoard's event files with
tensorboard's EventAccumulator, MLflow's file store with MlflowClient."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch
import yaml
from conftest import compose_typed

from exp.core.config import ConfigError, LoggerConfig, LoggerKind
from exp.core.secrets import REDACTED, redact

TRACKED = [
    "trainer.max_steps=4",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=2",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.sample_count=0",
    "data.num_examples=100",
    "logger=[csv,tensorboard,mlflow]",
]


# --- reading what the trackers wrote -----------------------------------------------------------------------------


def csv_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} of a run's csv/metrics.csv."""
    out: dict[str, dict[int, float]] = {}
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k != "step" and v:
                    out.setdefault(k, {})[int(row["step"])] = float(v)
    return out


def tensorboard_events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))  # purge_orphaned_data: a continued run's replaced points are dropped
    events.Reload()
    return events


def tensorboard_metrics(log_dir: Path) -> dict[str, dict[int, float]]:
    events = tensorboard_events(log_dir)
    return {tag: {s.step: s.value for s in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def mlflow_client(store: Path):
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(store.resolve().as_uri())


def mlflow_runs(store: Path, experiment: str = "exp"):
    client = mlflow_client(store)
    return client, client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def mlflow_metrics(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] in the order logged."""
    keys = client.get_run(run_id).data.metrics
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in keys}


# --- one run, then its continuation --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory):
    """A 4-step run with the CSV, TensorBoard and MLflow, launched from an empty directory; then the same run named
    with trainer.resume and continued to 8 steps."""
    from exp.train import run

    launch, root = tmp_path_factory.mktemp("launch"), tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(launch)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        first = run(TRACKED, output_dir=root / "first")
        second = run([*TRACKED[1:], "trainer.max_steps=8", f"trainer.resume={first.output_dir}"], root / "second")
    return first.output_dir, second.output_dir, launch


@pytest.mark.slow
def test_every_tracker_has_the_csv_metrics_at_the_same_steps(tracked):
    first, _, launch = tracked
    expected = csv_metrics(first)
    assert {"train/loss", "val/loss", "val/token_accuracy"} <= set(expected) and max(expected["train/loss"]) == 4
    assert "epoch" not in expected
    tb = tensorboard_metrics(first / "tensorboard")
    client, [run] = mlflow_runs(first / "mlruns")
    ml = mlflow_metrics(client, run.info.run_id)
    assert set(tb) == set(ml) == set(expected)
    for name, points in expected.items():  # the steps of this run (its continuation's follow, from step 5)
        assert {s: v for s, v in tb[name].items() if s <= 4} == pytest.approx(points, rel=1e-6), name  # float32
        assert {s: v for s, v in ml[name] if s <= 4} == points, name
    assert list(launch.iterdir()) == []  # no mlruns/ or runs/ where the run was launched


@pytest.mark.slow
def test_every_tracker_gets_the_resolved_config(tracked):
    first, _, _ = tracked
    on_disk = yaml.safe_load((first / "config.yaml").read_text())
    client, [run] = mlflow_runs(first / "mlruns")
    params = run.data.params
    assert params["lora.r"] == "8" and params["trainer.max_steps"] == "4" and params["logger.mlflow"] == "True"
    assert params["lora.target_modules"] == "['q_proj', 'v_proj']"
    artifact = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(first.parent)))
    assert yaml.safe_load(artifact.read_text()) == redact(on_disk) == on_disk
    assert run.info.run_name == "gemma_tiny-first" and run.info.status == "FINISHED"
    assert yaml.safe_load((first / "tensorboard" / "hparams.yaml").read_text()) == on_disk
    text = tensorboard_events(first / "tensorboard").Tensors("config/text_summary")
    assert text[0].step == 0 and "target_modules:" in text[0].tensor_proto.string_val[0].decode()


@pytest.mark.slow
def test_a_continued_run_goes_on_in_the_same_tracker_runs(tracked):
    first, second, _ = tracked
    # Nothing of TensorBoard's or MLflow's in the continuation's directory: it writes into the first run's.
    assert not (second / "mlruns").exists() and not (second / "tensorboard").exists()
    ids = torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)["exp"]["tracking_ids"]
    assert ids["tensorboard"] == str(first / "tensorboard") and ids["mlflow_uri"] == (first / "mlruns").as_uri()
    client, runs = mlflow_runs(first / "mlruns")
    assert [r.info.run_id for r in runs] == [ids["mlflow"]] and runs[0].info.status == "FINISHED"
    ml = mlflow_metrics(client, ids["mlflow"])
    assert [step for step, _ in ml["train/loss"]] == list(range(1, 9))  # steps 1-4, then the continuation's 5-8
    later = csv_metrics(second)
    assert dict(ml["train/loss"])[7] == later["train/loss"][7]
    tb = tensorboard_metrics(first / "tensorboard")
    assert sorted(tb["train/loss"]) == list(range(1, 9))
    assert tb["val/loss"][8] == pytest.approx(later["val/loss"][8], rel=1e-6)
    # The continuation's config: as text at the step it started from; MLflow keeps the first params.
    text = tensorboard_events(first / "tensorboard").Tensors("config/text_summary")
    assert [t.step for t in text] == [0, 4]
    assert runs[0].data.params["trainer.max_steps"] == "4"
    artifact = Path(client.download_artifacts(ids["mlflow"], "config-step-4.yaml", str(second.parent)))
    assert yaml.safe_load(artifact.read_text()) == yaml.safe_load((second / "config.yaml").read_text())
    assert yaml.safe_load(artifact.read_text())["trainer"]["max_steps"] == 8


# --- the loggers by themselves -------------------------------------------------------------------------------------


def build(tmp_path: Path, config: dict, tracking_ids: dict | None = None, resumed_at: int | None = None, **on):
    from exp.run.tracking import build_loggers

    cfg = LoggerConfig(**{"wandb": False, **on}, tags=["ablation"], group="g1")
    return build_loggers(cfg, tmp_path, "run-a", config, "exp1", tracking_ids, resumed_at=resumed_at)


def test_secrets_are_redacted_in_tensorboard_and_mlflow(tmp_path, monkeypatch):
    """The redaction W&B's config gets: secret-looking keys masked, and values of secret environment variables
    masked wherever they appear. Every byte of every file the two trackers wrote is searched."""
    from exp.run.tracking import finish_loggers

    monkeypatch.setenv("MY_SERVICE_API_KEY", "sk-FAKE-env-secret-42")
    config = {
        "model": {"name": "gemma_tiny", "hf_token": "hf_FAKE_token_77"},
        "note": "uses sk-FAKE-env-secret-42 inside",
        "lora": {"r": 8},
    }
    loggers = build(tmp_path, config, tensorboard=True, mlflow=True)
    for logger in loggers:
        logger.log_metrics({"train/loss": 1.5}, step=1)
    finish_loggers(loggers, ok=True)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any("tfevents" in p.name for p in files) and any(p.name == "config.yaml" for p in files)
    for path in files:
        for secret in (b"hf_FAKE_token_77", b"sk-FAKE-env-secret-42"):
            assert secret not in path.read_bytes(), f"{secret} leaked into {path}"
    client, [run] = mlflow_runs(tmp_path / "mlruns")
    assert run.data.params["model.hf_token"] == REDACTED and REDACTED in run.data.params["note"]
    assert run.data.params["lora.r"] == "8"
    assert run.data.tags["experiment"] == "exp1" and run.data.tags["group"] == "g1" and "ablation" in run.data.tags
    hparams = yaml.safe_load((tmp_path / "tensorboard" / "hparams.yaml").read_text())
    assert hparams["model"]["hf_token"] == REDACTED and hparams["lora"] == {"r": 8}


def test_a_continued_tensorboard_run_replaces_the_points_after_its_checkpoint(tmp_path):
    """A run killed after step 5 with its checkpoint at step 3: the continuation trains steps 4 and 5 again, and
    TensorBoard shows its values, each step once."""
    from exp.run.tracking import finish_loggers

    ids: dict = {}
    [_, tb] = build(tmp_path / "a", {}, ids, tensorboard=True)
    for step in range(1, 6):
        tb.log_metrics({"train/loss": float(step)}, step=step)
    finish_loggers([tb], ok=False)
    [_, again] = build(tmp_path / "b", {}, dict(ids), resumed_at=3, tensorboard=True)
    for step in (4, 5, 6):
        again.log_metrics({"train/loss": 10.0 * step}, step=step)
    finish_loggers([again], ok=True)
    assert tensorboard_metrics(tmp_path / "a" / "tensorboard")["train/loss"] == {
        1: 1.0,
        2: 2.0,
        3: 3.0,
        4: 40.0,
        5: 50.0,
        6: 60.0,
    }
    assert not (tmp_path / "b" / "tensorboard").exists()


def test_a_preempted_mlflow_run_is_killed_then_continued_and_finished(tmp_path):
    from exp.run.tracking import finish_loggers

    ids: dict = {}
    [_, ml] = build(tmp_path / "a", {"lora": {"r": 8}}, ids, mlflow=True)
    finish_loggers([ml], ok=False, preempted=True)
    client, [run] = mlflow_runs(tmp_path / "a" / "mlruns")
    assert run.info.status == "KILLED" and ids["mlflow"] == run.info.run_id
    config = {"lora": {"r": 8}, "trainer": {"resume": "auto"}}
    [_, again] = build(tmp_path / "b", config, dict(ids), resumed_at=2, mlflow=True)
    assert again.run_id == run.info.run_id
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    finish_loggers([again], ok=True)
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and run.data.params["trainer.resume"] == "auto"  # a key the first lacked
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "config-step-2.yaml"}
    assert not (tmp_path / "b" / "mlruns").exists()


def test_a_continued_run_whose_store_is_gone_starts_new_tracker_runs(tmp_path, caplog):
    gone = {"mlflow": "0123abcd", "mlflow_uri": (tmp_path / "moved" / "mlruns").as_uri()}
    gone["tensorboard"] = str(tmp_path / "moved" / "tensorboard")
    ids = dict(gone)
    with caplog.at_level("WARNING", logger="exp.run.trackers"):
        build(tmp_path / "here", {}, ids, resumed_at=3, tensorboard=True, mlflow=True)
    assert "is gone; logging to a new run" in caplog.text
    assert ids["tensorboard"] == str(tmp_path / "here" / "tensorboard") and ids["mlflow"] != "0123abcd"
    assert not (tmp_path / "moved").exists()


def test_runs_share_the_mlflow_store_logger_tracking_uri_names(tmp_path):
    """One store for many runs (a sweep's jobs in one `mlflow ui`): one experiment, a run each."""
    from exp.run.tracking import finish_loggers

    shared = tmp_path / "shared"
    for name in ("a", "b"):
        finish_loggers(build(tmp_path / name, {"lora": {"r": 8}}, mlflow=True, tracking_uri=str(shared)), ok=True)
    _, runs = mlflow_runs(shared)
    assert len(runs) == 2 and not (tmp_path / "a" / "mlruns").exists()


def test_a_tracker_that_is_not_installed_is_refused_before_the_run(tmp_path, monkeypatch):
    from exp.run import trackers

    monkeypatch.setattr(trackers, "_installed", lambda module: module != "mlflow")
    with pytest.raises(ConfigError, match=r"logger.mlflow=true: the mlflow \(or mlflow-skinny\) package is not"):
        build(tmp_path, {}, tensorboard=True, mlflow=True)
    assert list(tmp_path.iterdir()) == []


def test_an_mlflow_server_that_does_not_answer_is_refused_at_once(tmp_path):
    from exp.run.tracking import build_loggers

    cfg = LoggerConfig(wandb=False, mlflow=True, tracking_uri="http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(ConfigError, match="logger.tracking_uri=http://127.0.0.1:9: the MLflow server does not"):
        build_loggers(cfg, tmp_path, "run", {})


# --- choosing trackers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "trackers"),
    [
        ([], ["wandb", "csv"]),  # the default
        (["logger=tensorboard"], ["tensorboard", "csv"]),
        (["logger=mlflow"], ["mlflow", "csv"]),
        (["logger=[wandb,tensorboard]"], ["wandb", "tensorboard", "csv"]),
        (["logger=[csv,tensorboard,mlflow]"], ["tensorboard", "mlflow", "csv"]),
        (["logger=csv", "logger.mlflow=true"], ["mlflow", "csv"]),
        (["logger=csv"], ["csv"]),
        (["logger=none"], []),
    ],
)
def test_logger_selects_one_tracker_or_several(overrides, trackers):
    assert compose_typed(overrides).logger.trackers == [LoggerKind(t) for t in trackers]


def test_a_misspelt_tracker_is_refused(tmp_path):
    import exp.run.compose
    import exp.train
    from exp.run.overrides import check_command_line

    for arg, words in (("logger=[wandb,tensorbord]", "tensorbord"), ("logger.tensorbord=true", "tensorbord")):
        problems, _ = check_command_line([arg], exp.train.__file__, str(exp.run.compose.CONF_DIR), "train")
        assert problems and words in "\n".join(problems), arg


def test_a_sweep_over_trackers_and_with_several_composes_every_job():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    several, sweep = OverridesParser.create().parse_overrides(["logger=[csv,tensorboard]", "logger=csv,mlflow"])
    assert not several.is_sweep_override() and list(sweep.sweep_string_iterator()) == ["csv", "mlflow"]
    assert compose_typed(["logger=[csv,tensorboard]", "lora.r=4"]).logger.trackers[0] == LoggerKind.tensorboard


def test_relative_tracking_uri_is_resolved_against_the_launch_directory(tmp_path, monkeypatch):
    from exp.run.trackers import mlflow_uri

    cfg = compose_typed(["logger=mlflow", "logger.tracking_uri=shared/mlruns"]).logger
    assert cfg.tracking_uri == str(Path(__file__).resolve().parents[1] / "shared" / "mlruns")  # compose_typed: repo
    assert mlflow_uri(cfg, tmp_path) == Path(cfg.tracking_uri).as_uri()
    assert mlflow_uri(LoggerConfig(mlflow=True), tmp_path) == (tmp_path / "mlruns").as_uri()
    assert mlflow_uri(LoggerConfig(tracking_uri="sqlite:///x.db"), tmp_path) == "sqlite:///x.db"
