"""TensorBoard and MLflow: Lightning's loggers, their metrics numbered by optimiser steps as csv/metrics.csv's rows
are, given the same redacted config as W&B, and continued by a resumed run.

TensorBoard writes into `<run>/tensorboard`; MLflow into the store `logger.tracking_uri` names, by default a file
store in the run directory (`<run>/mlruns`: no server, no network). A run continued with `trainer.resume` writes
into the places of the run it continues, which its checkpoints carry in `tracking_ids` (`tensorboard`: the log
directory; `mlflow` and `mlflow_uri`: the run and its store): TensorBoard shows one run, whose points past the
continued checkpoint are replaced (SummaryWriter's `purge_step`), and MLflow one run whose metric history goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from exp.core.config import ConfigError, LoggerConfig, LoggerKind
from exp.core.secrets import redact
from exp.run.csv_record import StepNumbered

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
# The metrics TensorBoard's HParams tab shows beside each run's config (their last values).
HPARAM_METRICS = ("val/loss", "train/loss")
PACKAGES = {LoggerKind.tensorboard: "tensorboard", LoggerKind.mlflow: "mlflow"}


class StepTensorBoardLogger(StepNumbered, TensorBoardLogger):
    """TensorBoardLogger numbered by optimiser steps."""


class StepMLFlowLogger(StepNumbered, MLFlowLogger):
    """MLFlowLogger numbered by optimiser steps."""


def require_packages(cfg: LoggerConfig) -> None:
    """A tracker asked for must be installed: the run would otherwise fail once its model is loaded."""
    missing = [kind for kind, module in PACKAGES.items() if getattr(cfg, kind.value) and not _installed(module)]
    if missing:
        names = " and ".join(PACKAGES[k] if k != LoggerKind.mlflow else "mlflow (or mlflow-skinny)" for k in missing)
        raise ConfigError(
            f"logger.{missing[0].value}=true: the {names} package is not installed in this environment. Install the "
            "trackers (pip install -e '.[trackers]'), or leave "
            + " and ".join(k.value for k in missing)
            + " out of logger= (e.g. logger=csv: metrics in csv/metrics.csv)"
        )


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """The redacted config as `a.b.c: value` (the keys as overrides name them), lists and None as text."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and (node or not prefix):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node if isinstance(node, (bool, int, float, str)) else str(node)

    walk(redact(config), "")
    return out


def config_text(config: dict[str, Any]) -> str:
    return yaml.safe_dump(redact(config), sort_keys=False)


def build_tensorboard(
    output_dir: Path, config: dict[str, Any], tracking_ids: dict[str, str], steps_done: Any, resumed_at: int | None
) -> StepTensorBoardLogger:
    """TensorBoard's logger, in this run's `tensorboard/` or the continued run's. `tracking_ids` gains its log
    directory. A continued run's first event purges the points logged after step `resumed_at` (those steps are
    trained again)."""
    log_dir = Path(tracking_ids.get(LoggerKind.tensorboard.value) or output_dir / TENSORBOARD_DIR)
    continued = LoggerKind.tensorboard.value in tracking_ids
    if continued and not log_dir.parent.is_dir():
        log.warning("TensorBoard: the continued run's directory %s is gone; logging to a new run", log_dir.parent)
        log_dir, continued = output_dir / TENSORBOARD_DIR, False
    tracking_ids[LoggerKind.tensorboard.value] = str(log_dir.resolve())  # a continuation may start elsewhere
    purge = {"purge_step": resumed_at + 1} if continued and resumed_at is not None else {}
    logger = StepTensorBoardLogger(
        save_dir=str(log_dir.parent), name="", version=log_dir.name, default_hp_metric=False, **purge
    )
    logger.steps_done = steps_done
    _start_tensorboard(logger, config, continued, resumed_at or 0)
    log.info("TensorBoard: %s", log_dir)
    return logger


@rank_zero_only
def _start_tensorboard(logger: StepTensorBoardLogger, config: dict[str, Any], continued: bool, step: int) -> None:
    """The config as text (at the step this process starts from) and hparams.yaml; a new run also its HParams
    summary, the config's keys beside the metrics HPARAM_METRICS (Lightning's log_hyperparams writes that summary
    only together with a metric value, which would add a point to the curves)."""
    from torch.utils.tensorboard.summary import hparams  # tensorboard's module: only with logger.tensorboard

    params = flat_config(config)
    logger.log_hyperparams(redact(config))  # -> hparams.yaml, once the run ends
    logger.experiment.add_text("config", f"```yaml\n{config_text(config)}```", global_step=step)
    if not continued:
        writer = logger.experiment._get_file_writer()
        for summary in hparams(params, dict.fromkeys(HPARAM_METRICS, 0.0)):
            writer.add_summary(summary)
    logger.save()


def mlflow_uri(cfg: LoggerConfig, output_dir: Path) -> str:
    """The store: `logger.tracking_uri` (a directory becomes a file store), else `<run>/mlruns`."""
    uri = cfg.tracking_uri
    if not uri:
        return (output_dir / MLFLOW_DIR).resolve().as_uri()
    return uri if ":" in uri else Path(uri).expanduser().resolve().as_uri()


def _file_store_gone(uri: str) -> bool:
    return uri.startswith("file:") and not Path(uri.removeprefix("file://").removeprefix("file:")).is_dir()


def build_mlflow(
    cfg: LoggerConfig,
    output_dir: Path,
    run_name: str,
    config: dict[str, Any],
    experiment: str | None,
    tracking_ids: dict[str, str],
    steps_done: Any,
    resumed_at: int | None,
) -> StepMLFlowLogger:
    """MLflow's logger: a new run in experiment `logger.project`, named `run_name`, or the continued run (from step
    `resumed_at`) in its own store. `tracking_ids` gains the run's id and store."""
    # MLflow 3 reports usage to its servers from a background thread unless told not to: no network from a run.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # MLflow 3 keeps file stores in maintenance and refuses them unless allowed: a file store needs no server and
    # no database, and `mlflow migrate-filestore` moves one into a database later.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    run_id = tracking_ids.get(LoggerKind.mlflow.value)
    uri = tracking_ids.get("mlflow_uri") if run_id else None
    if run_id and (not uri or _file_store_gone(uri)):
        log.warning("MLflow: the continued run's store %s is gone; logging to a new run", uri)
        run_id = None
    uri = uri if run_id else mlflow_uri(cfg, output_dir)
    if run_id is None:
        _experiment(uri, cfg.project)
    tags = {k: v for k, v in {"experiment": experiment, "group": cfg.group}.items() if v}
    tags.update(dict.fromkeys(cfg.tags, ""))
    logger = StepMLFlowLogger(
        experiment_name=cfg.project,
        run_name=run_name,
        tracking_uri=uri,
        tags=redact(tags) or None,
        run_id=run_id,
    )
    logger.steps_done = steps_done
    _start_mlflow(logger, config, run_id is not None, resumed_at or 0)
    if logger.run_id is not None:  # rank zero: the run exists now
        tracking_ids.update({LoggerKind.mlflow.value: logger.run_id, "mlflow_uri": uri})
        log.info("MLflow: run %s in %s", logger.run_id, uri)
    return logger


@rank_zero_only
def _experiment(uri: str, name: str) -> None:
    """Create the experiment where it is new (Lightning would, with a warning at every run into a new store)."""
    from mlflow.exceptions import MlflowException  # the mlflow package: only with logger.mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    if client.get_experiment_by_name(name) is None:
        try:
            client.create_experiment(name)
        except MlflowException:
            if client.get_experiment_by_name(name) is None:  # else another job of a sweep made it first
                raise


@rank_zero_only
def _start_mlflow(logger: StepMLFlowLogger, config: dict[str, Any], continued: bool, resumed_at: int) -> None:
    """The config as params (flattened, redacted) and as the artifact config.yaml. MLflow's params are written
    once: a continued run adds the keys it lacks, keeps the first values, and logs its own config as
    config-step-<N>.yaml (N: the step it continued from; trainer.resume or a longer trainer.max_steps differ)."""
    client, params = logger.experiment, flat_config(config)
    name = "config.yaml"
    if continued:
        client.update_run(logger.run_id, status="RUNNING")
        kept = client.get_run(logger.run_id).data.params
        changed = sorted(k for k in params if k in kept and kept[k] != str(params[k])[:250])
        if changed:
            log.info("MLflow: the continued run keeps the first values of %s", ", ".join(changed))
        params = {k: v for k, v in params.items() if k not in kept}
        name = f"config-step-{resumed_at}.yaml"
    logger.log_hyperparams(params)
    client.log_text(logger.run_id, config_text(config), name)


def finish(logger: Any, ok: bool, preempted: bool) -> None:
    """Close a TensorBoard or MLflow logger: the events flushed, the MLflow run FINISHED, FAILED or KILLED (a
    preempted run, continued later under the same id)."""
    if isinstance(logger, TensorBoardLogger):
        logger.finalize("success" if ok else "failed")
    elif isinstance(logger, MLFlowLogger) and logger._initialized:
        status = "FINISHED" if ok else "KILLED" if preempted else "FAILED"
        logger.experiment.set_terminated(logger.run_id, status)


def log_adapter(logger: Any, adapter_dir: Path) -> None:
    """The final adapter as the MLflow run's artifact `adapter/`."""
    if isinstance(logger, MLFlowLogger) and logger._initialized:
        logger.experiment.log_artifacts(logger.run_id, str(adapter_dir), "adapter")
