"""What Hydra may instantiate, and a record of each run that holds no secret.

Hydra imports and calls every `_target_` under `hydra.callbacks`, `hydra.launcher` and `hydra.sweeper` (and
`logging.config` every handler `class` and `()` factory of the logging configs) before any of exp's code runs: a
YAML file or an override naming another callable would run it. `target_problems` checks the composed config
against an allow-list; `exp.train.cli` calls it (through `exp.overrides.check_command_line`) before Hydra starts.

Hydra's own record of a job (`.hydra/`) holds the command-line overrides verbatim, `+hydra.job.env_set.X=...`
values included. `RunRecord` writes that record itself, redacted (conf/train.yaml sets `hydra.output_subdir: null`
so that Hydra writes nothing first).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from exp.tracking import REDACTED, SECRET_NAME, redact, redact_argv

# Module prefixes a `_target_` may name: exp itself, Hydra plugins (submitit, Optuna, exp's `gpus` launcher),
# Hydra's built-in launcher and sweeper, and the samplers the Optuna sweeper builds.
ALLOWED_TARGETS = ("exp.", "hydra_plugins.", "hydra._internal.core_plugins.", "optuna.samplers.")
# Handler classes and formatter factories of the logging configs; not logging.config (fileConfig evaluates
# expressions read from a file).
ALLOWED_LOGGING = ("logging.", "colorlog.")
DENIED_LOGGING = ("logging.config.",)
LOGGING_SECTIONS = ("hydra.job_logging.", "hydra.hydra_logging.")

log = logging.getLogger(__name__)


def _allowed(value: Any, allowed: tuple[str, ...], denied: tuple[str, ...] = ()) -> bool:
    return isinstance(value, str) and value.startswith(allowed) and not value.startswith(denied)


def target_problems(config: dict[str, Any]) -> list[str]:
    """One paragraph per callable the config names outside the allow-list (`config`: the composed config with its
    `hydra` node, as plain containers, unresolved)."""
    problems = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")
            return
        if not isinstance(node, dict):
            return
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "_target_" and not _allowed(value, ALLOWED_TARGETS):
                allowed = ", ".join(p + "*" for p in ALLOWED_TARGETS)
                problems.append(_refusal(where, value, path, f"only these may be instantiated: {allowed}"))
            elif (
                key in ("class", "()")
                and where.startswith(LOGGING_SECTIONS)
                and not _allowed(value, ALLOWED_LOGGING, DENIED_LOGGING)
            ):
                problems.append(_refusal(where, value, path, "a logging handler or formatter must come from logging.*"))
            walk(value, where)

    walk(config, "")
    return problems


def _refusal(key: str, value: Any, parent: str, rule: str) -> str:
    return (
        f"{key}={value}: the config names a callable that Hydra would import and run, and {rule}. Nothing has been "
        f"run. Fix: remove {parent or 'it'} (drop the override or the YAML lines that set it, or add ~{parent}), or "
        "name an allowed class."
    )


def redact_override(line: str) -> str:
    """An override with its value masked when its key, or a key inside a dict value, looks like a secret."""
    masked = redact_argv([line])[0]
    key, sep, value = line.partition("=")
    if masked == line and sep and any(SECRET_NAME.search(k) for k in re.findall(r"([\w.\-]+)\s*:", value)):
        masked = f"{key}={REDACTED}"
    return masked


def secret_values(overrides: list[str]) -> list[str]:
    """The values of the secret-looking overrides: what must not be echoed back in an error message."""
    values = []
    for line in overrides:
        if redact_override(line) != line:
            values.append(line.partition("=")[2].strip("'\""))
    return [v for v in values if v]


def _write_yaml(path: Path, data: Any) -> None:
    """Atomically: a reader sees the previous file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(data)))
    os.replace(tmp, path)


def _redacted(record: dict[str, Any]) -> dict[str, Any]:
    """A composed config (with its `hydra` node) with secret-looking keys and overrides masked."""
    out = redact(record)
    overrides = out.get("hydra", {}).get("overrides", {})
    for side in ("task", "hydra"):
        if side in overrides:
            overrides[side] = [redact_override(o) for o in overrides[side]]
    return out


def write_hydra_record(config: DictConfig) -> Path:
    """Hydra's record of a job (config.yaml, hydra.yaml, overrides.yaml, as Hydra writes them) with secrets masked:
    values of secret-looking keys (`hydra.job.env_set.HF_TOKEN`, env_copy'd variables) and overrides."""
    record = OmegaConf.to_container(config, resolve=False, enum_to_str=True)
    assert isinstance(record, dict)
    task = _redacted(record)
    hydra_node = task.pop("hydra")
    out = Path(config.hydra.runtime.output_dir) / (config.hydra.output_subdir or ".hydra")
    out.mkdir(parents=True, exist_ok=True)
    _write_yaml(out / "config.yaml", task)
    _write_yaml(out / "hydra.yaml", {"hydra": hydra_node})
    _write_yaml(out / "overrides.yaml", hydra_node["overrides"]["task"])
    return out


def redact_multirun_record(sweep_dir: Path) -> None:
    """The sweeper's `multirun.yaml` (the whole config of a sweep), masked like `.hydra/`."""
    path = sweep_dir / "multirun.yaml"
    if path.exists():
        record = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        assert isinstance(record, dict)
        if (redacted := _redacted(record)) != record:
            _write_yaml(path, redacted)


def _secrets_in(record: Any, key: str = "") -> list[str]:
    """The values of secret-looking keys anywhere in a config (as plain containers)."""
    if isinstance(record, dict):
        return [s for k, v in record.items() for s in _secrets_in(v, str(k))]
    if isinstance(record, list):
        return [s for v in record for s in _secrets_in(v, key)]
    return [str(record)] if record and SECRET_NAME.search(key) else []


def remove_secret_pickles(sweep_dir: Path, config: DictConfig) -> list[Path]:
    """Delete the pickles a launcher left in the sweep directory (submitit's submitted and result files hold the
    whole config, Hydra's env_set values included) when they contain one of the sweep's secrets."""
    record = OmegaConf.to_container(config, resolve=False)
    overrides = OmegaConf.to_container(config.hydra.overrides)
    assert isinstance(overrides, dict)
    secrets = {s.encode() for s in [*_secrets_in(record), *secret_values(overrides["hydra"] + overrides["task"])]}
    removed = []
    for path in sweep_dir.rglob("*.pkl") if secrets and sweep_dir.is_dir() else []:
        if any(secret in path.read_bytes() for secret in secrets):
            path.unlink()
            removed.append(path)
    return removed


class RunRecord(Callback):
    """Registered in conf/train.yaml: the redacted `.hydra/` record of every job, and no secret on the command line.

    Once Hydra has parsed the command line, nothing in the process needs it verbatim: `sys.argv` is redacted so that
    W&B's run metadata (which records the arguments), the manifest or a crash report cannot copy a secret typed into
    an override. (The operating system's process list still shows it while the run lasts: secrets belong in the
    environment.)
    """

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        sys.argv[:] = [redact_override(arg) for arg in sys.argv]
        write_hydra_record(config)
        if config.hydra.mode == RunMode.MULTIRUN:
            redact_multirun_record(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # Launchers that run jobs in other processes (gpus, submitit) write multirun.yaml here without a job start.
        sweep_dir = Path(config.hydra.sweep.dir)
        redact_multirun_record(sweep_dir)
        if removed := remove_secret_pickles(sweep_dir, config):
            log.info("removed %d launcher pickle(s) holding secrets from %s", len(removed), sweep_dir)
