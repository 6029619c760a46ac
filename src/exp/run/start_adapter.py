"""`model.adapter`: the adapter a run starts from, resolved when the config is composed (docs/objectives.md).

The value is an earlier run's directory (its `adapter/`) or a PEFT adapter directory; it becomes that adapter
directory's absolute path, so config.yaml records what the run loaded. Checked here, before anything heavy loads:
the path holds a LoRA adapter, and an earlier run of exp trained it on this run's base (its config.yaml's model
settings). The adapter's shape (r, alpha, targets, modules to save, bias) is fixed by its weights, so it replaces
`lora.*`, with a warning naming every value that changes; `lora.dropout` is this run's own. Torch-free, and the
source's files are only read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from exp.core.config import ConfigError, TrainConfig
from exp.run.dirs import RunLayout

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
# The model settings that decide the base's weights: a LoRA adapter only fits the base it was trained on.
BASE_KEYS = ("family", "hub_id", "path", "revision", "random_init")
RANDOM_BASE_KEYS = ("arch", "seed")  # with random_init, the architecture and the seed of the random weights


def _not_an_adapter(value: str, problem: str) -> ConfigError:
    return ConfigError(
        f"model.adapter={value}: {problem}. Set it to an earlier run's directory (outputs/<date>/<time>, which holds "
        "adapter/) or to a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), or drop "
        "model.adapter to start from a fresh LoRA."
    )


def adapter_location(value: str, launch_dir: Path) -> tuple[Path, Path | None]:
    """(the adapter directory, the run directory it belongs to or None) for a `model.adapter` value."""
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else launch_dir / path).resolve()
    if not path.exists():
        raise _not_an_adapter(value, f"{path} does not exist")
    layout = RunLayout(path)
    if layout.config.is_file():  # a run directory of exp.train
        if not (layout.adapter / ADAPTER_CONFIG).is_file():
            status = _run_status(layout)
            raise ConfigError(
                f"model.adapter={value}: that run has no saved adapter ({layout.adapter} is missing; its status is "
                f"{status}). A run saves its adapter when training completes: finish it (trainer.resume=<that "
                "run>) or pick a completed run."
            )
        return layout.adapter, path
    if (path / ADAPTER_CONFIG).is_file():
        parent = RunLayout(path.parent)
        return path, path.parent if path.name == layout.adapter.name and parent.config.is_file() else None
    raise _not_an_adapter(value, f"{path} holds neither config.yaml (a run) nor {ADAPTER_CONFIG} (an adapter)")


def _run_status(layout: RunLayout) -> str:
    try:
        return json.loads(layout.status.read_text())["status"]
    except (OSError, ValueError, KeyError):
        return "unknown (no status.json)"


def _adapter_config(value: str, adapter_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model.adapter={value}: {adapter_dir / ADAPTER_CONFIG} cannot be read ({type(e).__name__}). Fix: restore "
            "the adapter from a copy, or pick another one."
        ) from None
    if config.get("peft_type") != "LORA":
        raise ConfigError(
            f"model.adapter={value}: its adapter_config.json says peft_type {config.get('peft_type')}; exp trains "
            "LoRA adapters. Pick a LoRA adapter (peft_type LORA)."
        )
    if not isinstance(config.get("target_modules"), list):
        raise ConfigError(
            f"model.adapter={value}: its target_modules is {config.get('target_modules')!r}, not a list of module "
            "names (lora.target_modules). Pick an adapter saved with a list of targets."
        )
    return config


def _base_differences(cfg: TrainConfig, run_dir: Path) -> list[str]:
    """This run's model settings that differ from those the run in `run_dir` trained its adapter on."""
    try:
        trained = OmegaConf.to_container(OmegaConf.load(RunLayout(run_dir).config), resolve=True)["model"]
    except Exception:  # noqa: BLE001 (YAML's, OmegaConf's and the file system's errors: a damaged config.yaml)
        return []  # the adapter's shapes are checked when it loads
    mine = OmegaConf.to_container(OmegaConf.structured(cfg.model), enum_to_str=True)
    keys = BASE_KEYS + (RANDOM_BASE_KEYS if mine["random_init"] else ())
    return [f"model.{k}: {trained.get(k)!r} there, {mine[k]!r} here" for k in keys if trained.get(k) != mine[k]]


def lora_from_adapter(cfg: TrainConfig, config: dict[str, Any]) -> tuple[Any, list[str]]:
    """`cfg.lora` with the adapter's shape, and the changes as `lora.<key> <composed> -> <adapter's>`."""
    shape = {
        "r": config["r"],
        "alpha": config["lora_alpha"],
        "target_modules": sorted(config["target_modules"]),
        "modules_to_save": list(config.get("modules_to_save") or []),
        "bias": config.get("bias", "none"),
    }
    changes = []
    for key, value in shape.items():
        composed = getattr(cfg.lora, key)
        same = sorted(composed) == value if key == "target_modules" else composed == value
        if not same:
            changes.append(f"lora.{key} {composed} -> {value}")
    return dataclasses.replace(cfg.lora, **shape), changes


@functools.cache  # a sweep composes each job's config more than once in one process
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def resolve_start_adapter(cfg: TrainConfig, launch_dir: Path, quiet: bool = False) -> TrainConfig:
    """`cfg` with `model.adapter` resolved to its adapter directory and `lora.*` set to the adapter's shape; a path
    that holds no LoRA adapter, or a run that trained on another base, raises ConfigError. `quiet`: no warning of
    the replaced LoRA shape (a check whose result is thrown away)."""
    value = cfg.model.adapter
    if not value:
        return cfg
    adapter_dir, run_dir = adapter_location(value, launch_dir)
    config = _adapter_config(value, adapter_dir)
    if run_dir is not None and (differences := _base_differences(cfg, run_dir)):
        raise ConfigError(
            f"model.adapter={value}: that run trained its adapter on another base ({'; '.join(differences)}). A LoRA "
            "adapter only fits the base it was trained on: use the model settings of that run (its config.yaml), "
            "or pick an adapter trained on this model."
        )
    lora, changes = lora_from_adapter(cfg, config)
    if changes and not quiet:
        _warn_once(
            f"model.adapter={value}: the adapter's LoRA shape is fixed by its weights, so it replaces the config's: "
            f"{', '.join(changes)} (lora.dropout={cfg.lora.dropout} is this run's own)"
        )
    model = dataclasses.replace(cfg.model, adapter=str(adapter_dir))
    return dataclasses.replace(cfg, model=model, lora=lora)
