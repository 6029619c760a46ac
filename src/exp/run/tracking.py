"""Experiment tracking: the loggers a run records to (the CSV record, W&B offline unless it can really go online,
TensorBoard and MLflow from exp.run.trackers), their redacted config, and the run's manifest."""

from __future__ import annotations

import json
import logging
import netrc
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from exp.core.config import ConfigError, LoggerConfig, LoggerKind, WandbMode
from exp.core.secrets import redact, redact_argv
from exp.run.dirs import RunLayout, write_json

log = logging.getLogger(__name__)


def _wandb_host() -> str:
    return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")


def _has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(urlparse(_wandb_host()).hostname or "") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def _reachable(url: str, timeout: float = 2.0) -> bool:
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_wandb_mode(cfg: LoggerConfig) -> str:
    """`online` only with credentials and a server that answers within 2 s; never a login prompt."""
    if cfg.mode == WandbMode.offline or os.environ.get("WANDB_MODE") in ("offline", "dryrun"):
        return "offline"
    online_ok = _has_wandb_credentials() and _reachable(_wandb_host())
    if cfg.mode == WandbMode.online and not online_ok:
        raise ConfigError(
            "logger.mode=online: W&B needs an API key (WANDB_API_KEY or `wandb login`) and a reachable server "
            f"({_wandb_host()}). Set the key, or use logger.mode=auto to fall back to offline and `wandb sync` later."
        )
    return "online" if online_ok else "offline"


def wandb_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


def new_wandb_run_id() -> str:
    """A fresh W&B run id, chosen by exp so that checkpoints can carry it (and a resumed run reuse it).

    W&B's own generator where wandb is installed; otherwise the same form (8 characters of [a-z0-9]), so a run
    started without wandb and resumed with it still gets one W&B run."""
    if not wandb_installed():
        import secrets
        import string

        alphabet = string.ascii_lowercase + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(8))
    from wandb.sdk.lib.runid import generate_id

    return generate_id()


def build_loggers(
    cfg: LoggerConfig,
    output_dir: Path,
    run_name: str,
    config: dict[str, Any],
    experiment: str | None = None,
    tracking_ids: dict[str, str] | None = None,
    steps_done: Callable[[], int] | None = None,
    beside_others: bool = False,
    resumed_at: int | None = None,
) -> list:
    """Lightning loggers for the trackers `logger` switches on; their files stay inside `output_dir`, or the
    continued run's directory (exp.run.trackers).

    `tracking_ids`: where this run is in each tracker, saved in every checkpoint: a resumed run passes its
    checkpoint's, and continues those runs; a new run's ids are added to it here (W&B's, MLflow's run and store,
    TensorBoard's directory). `resumed_at`: the step a resumed run continues from.
    `steps_done`: the optimiser steps completed, which number the rows of csv/metrics.csv (exp.run.csv_record) and
    the other trackers' points. `beside_others`: this process tracks several runs at once (a group of jobs sharing
    one base), so each W&B run is a run of its own rather than the process's one run.
    """
    from exp.run.csv_record import AtomicCSVLogger  # Lightning's CSVLogger: only once a run builds its loggers

    if not cfg.trackers:
        return []
    ids = tracking_ids if tracking_ids is not None else {}
    if cfg.tensorboard or cfg.mlflow:
        # TensorBoard and MLflow import Lightning's loggers and their packages: only for a run that uses them.
        from exp.run import trackers

        trackers.require_packages(cfg)
    if cfg.mlflow and cfg.tracking_uri and urlparse(cfg.tracking_uri).scheme in ("http", "https"):
        if not _reachable(cfg.tracking_uri):  # MLflow itself retries for minutes
            raise ConfigError(
                f"logger.tracking_uri={cfg.tracking_uri}: the MLflow server does not answer (2 s). Start it, or "
                "drop logger.tracking_uri for a file store in the run directory (<run>/mlruns)."
            )
    # -> csv/metrics.csv
    loggers: list = [AtomicCSVLogger(save_dir=str(output_dir), name="", version="csv", steps_done=steps_done)]
    if cfg.wandb:
        loggers += _wandb(cfg, output_dir, run_name, config, experiment, ids, beside_others)
    if cfg.tensorboard:
        loggers.append(trackers.build_tensorboard(output_dir, config, ids, steps_done, resumed_at))
    if cfg.mlflow:
        loggers.append(
            trackers.build_mlflow(cfg, output_dir, run_name, config, experiment, ids, steps_done, resumed_at)
        )
    return loggers


def _wandb(
    cfg: LoggerConfig,
    output_dir: Path,
    run_name: str,
    config: dict[str, Any],
    experiment: str | None,
    tracking_ids: dict[str, str],
    beside_others: bool,
) -> list:
    """W&B's logger (none without the wandb package), under the run id `tracking_ids` holds or a new one."""
    # Chosen even without wandb: the run, resumed where wandb is installed, still gets one W&B run.
    run_id = tracking_ids.setdefault(LoggerKind.wandb.value, new_wandb_run_id())
    if not wandb_installed():
        # wandb is a dependency of exp, but a minimal environment (a cluster image, a GPU box without network) may
        # lack it: the run still records every metric in csv/metrics.csv, unless W&B was explicitly required.
        if cfg.mode == WandbMode.online:
            raise ConfigError(
                "logger.mode=online: the wandb package is not installed in this environment. Install it (pip install "
                "wandb), or use logger=csv (metrics in csv/metrics.csv) or logger.mode=auto"
            )
        log.warning(
            "logger=wandb: the wandb package is not installed, so metrics go to %s only. pip install wandb for W&B "
            "tracking, or set logger=csv to silence this",
            RunLayout(output_dir).metrics,
        )
        return []
    from lightning.pytorch.loggers import WandbLogger

    mode = resolve_wandb_mode(cfg)
    os.environ.setdefault("WANDB_SILENT", "true")  # its banner would interleave with the progress bar
    logger = WandbLogger(
        project=cfg.project,
        entity=cfg.entity,
        name=run_name,
        group=cfg.group,
        # The experiment's name joins its tags, so a study's runs can be filtered by recipe.
        tags=list(dict.fromkeys([*cfg.tags, *([experiment] if experiment else [])])) or None,
        save_dir=str(output_dir),
        mode=mode,
        config=redact(config),
        log_model=False,
        id=run_id,
        resume="allow",
        **({"reinit": "create_new"} if beside_others else {}),
    )
    # Lightning passes W&B `anonymous=None`, which wandb (0.2x on) answers with a warning at every run that the
    # setting has no effect: nothing a user can act on. Left out, W&B's own default applies, as before.
    getattr(logger, "_wandb_init", {}).pop("anonymous", None)
    log.info("W&B: %s run in %s", mode, output_dir / "wandb")
    return [logger]


def finish_loggers(loggers: list, ok: bool, preempted: bool = False) -> None:
    """Close the W&B run even when training failed, so the next run in this process starts clean; flush
    TensorBoard and end the MLflow run the same way.

    A preempted run is marked so in W&B and MLflow (it will continue under the same id).
    """
    for logger in loggers:
        if type(logger).__name__ == "WandbLogger":
            # The logger's own run (started at its first use; none if it logged nothing): with several runs in one
            # process, wandb.run is only the latest.
            run = getattr(logger, "_experiment", None)
            if run is not None and not getattr(run, "_is_finished", False):
                if preempted:
                    run.mark_preempting()
                run.finish(exit_code=0 if ok else 1)
        elif type(logger).__name__ in ("StepTensorBoardLogger", "StepMLFlowLogger"):
            # Built only when their packages are there (exp.run.trackers imports them).
            from exp.run.trackers import finish

            finish(logger, ok, preempted)


def log_adapter_artifact(loggers: list, adapter_dir: Path, run_name: str) -> None:
    for logger in loggers:
        if type(logger).__name__ == "WandbLogger":
            import wandb

            artifact = wandb.Artifact(name=f"adapter-{re.sub(r'[^A-Za-z0-9._-]', '_', run_name)}", type="model")
            artifact.add_dir(str(adapter_dir))
            logger.experiment.log_artifact(artifact)
        elif type(logger).__name__ == "StepMLFlowLogger":
            from exp.run.trackers import log_adapter  # as in finish_loggers

            log_adapter(logger, adapter_dir)


# The packages whose versions manifest.json records (null: not installed).
MANIFEST_PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "lightning",
    "hydra-core",
    "datasets",
    "wandb",
    "tensorboard",
    "mlflow-skinny",
)


def _git_state(path: Path) -> dict[str, Any]:
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        return {"commit": commit or None, "dirty": bool(git("status", "--porcelain")) if commit else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _sha256_files(paths: list[Path]) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        with open(p, "rb") as f:  # in chunks: a data file may be larger than memory
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _files(p: Path) -> list[Path]:
    """A data path's files: the file itself, or every file under a directory."""
    return [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]


def data_fingerprint(data_cfg: Any) -> str:
    """What the examples are: the bytes of the data file(s), or the generator's settings for the embedded task."""
    import hashlib

    if getattr(data_cfg, "path", None) and Path(data_cfg.path).exists():
        return "sha256:" + _sha256_files(_files(Path(data_cfg.path)))
    if getattr(data_cfg, "mixture", None):  # every source's files (a hub source: its id and split)
        parts = [
            _sha256_files(_files(Path(s.path))) if s.path and Path(s.path).exists() else f"{s.hub_id}:{s.split}"
            for s in data_cfg.mixture
        ]
        return "mixture:" + hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    key = json.dumps({"format": str(data_cfg.format.value), "n": data_cfg.num_examples, "seed": data_cfg.seed})
    return "generated:" + hashlib.sha256(key.encode()).hexdigest()


def write_manifest(run_dir: Path, tokenizer: Any, data_cfg: Any) -> None:
    """Everything needed to tell how a run was made: code, packages, machine, data, tokenizer, command line."""
    import importlib.metadata as md
    import platform
    import sys
    import tempfile

    import torch

    packages = {}
    for name in MANIFEST_PACKAGES:
        try:
            packages[name] = md.version(name)
        except md.PackageNotFoundError:
            packages[name] = None
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        tok_hash = _sha256_files([f for f in Path(tmp).iterdir() if f.is_file()])
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_initialized() else []
    )
    manifest = {
        "command": [sys.executable, *redact_argv(sys.argv)],
        "git": _git_state(Path(__file__).resolve().parent),
        "packages": packages,
        "python": platform.python_version(),
        "hardware": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gpus": gpus,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        },
        "data_fingerprint": data_fingerprint(data_cfg),
        # The validation file's bytes, when the held-out split is a file of its own (data.val_path).
        "val_data_fingerprint": (
            "sha256:" + _sha256_files(_files(Path(data_cfg.val_path))) if getattr(data_cfg, "val_path", None) else None
        ),
        "tokenizer_sha256": tok_hash,
    }
    write_json(RunLayout(run_dir).manifest, redact(manifest))
