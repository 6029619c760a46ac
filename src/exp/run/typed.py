"""The typed config of a composed one: the schema's dataclasses, checked (cross-field rules, paths, the starting
adapter, the model family's rules), and the plain dict a typed config is recorded as. Torch-free, and apart from
`exp.run.compose` so that the command line's checks (`exp.run.overrides`) run it before anything is written."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from exp.core.config import ConfigError, TrainConfig, resolve_paths
from exp.core.secrets import secret_value_problems
from exp.model.families import family_problems
from exp.run.start_adapter import resolve_start_adapter


def config_dict(cfg: TrainConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def to_typed(dcfg: DictConfig, launch_dir: Path, quiet: bool = False) -> TrainConfig:
    """The checked TrainConfig of a composed config (ConfigError names what is wrong). `quiet`: a check only, whose
    result is not run; it logs no warning (the run's own composition does, once its log is set up)."""
    cfg: TrainConfig = OmegaConf.to_object(dcfg)  # runs the schema's cross-field validation
    if problems := secret_value_problems(config_dict(cfg)):
        raise ConfigError("\n".join(problems))
    # A starting adapter brings its own LoRA shape (exp.run.start_adapter), which the family's checks then see.
    cfg = resolve_start_adapter(resolve_paths(cfg, launch_dir), launch_dir, quiet)
    # The model family's rules (its LoRA targets, the attention kernels it can use) live with its row in
    # exp.model.families, above the schema's layer: checked here, once, for every composed config.
    if problems := family_problems(cfg):
        raise ConfigError("\n".join(problems))
    return cfg
