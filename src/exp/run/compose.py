"""The typed config of a run: composed from `conf/` as `python -m exp.train` composes it, checked, written into the
run directory (`config.yaml`) and read back from it. Torch-free: a bad command line never pays for torch."""

from __future__ import annotations

import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from exp.core.config import ConfigError, TrainConfig, register_configs
from exp.core.constants import CONF_DIR
from exp.run.dirs import RESUME_RECORD, RunLayout, sweep_job_dir_name
from exp.run.overrides import check_cli_overrides, composition_error
from exp.run.typed import config_dict, to_typed

register_configs()
# conf/train.yaml names a sweep job's directory with it (hydra.sweep.subdir).
if not OmegaConf.has_resolver("exp.job_dir"):
    OmegaConf.register_new_resolver("exp.job_dir", sweep_job_dir_name)


def write_run_config(cfg: TrainConfig, output_dir: Path) -> None:
    RunLayout(output_dir).config.write_text(OmegaConf.to_yaml(config_dict(cfg)))


def load_run_config(run_dir: Path) -> TrainConfig:
    """The typed config a run recorded (what its workers, and a resumed run, train with). A config.yaml that is
    not YAML, or not exp's schema, raises ConfigError naming the file."""
    path = RunLayout(run_dir).config
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as e:  # YAML's, OmegaConf's and the file system's errors: what a damaged file raises
        raise ConfigError(damaged_config(run_dir, e)) from None


def damaged_config(run_dir: Path, e: BaseException) -> str:
    """The paragraph for a run whose config.yaml cannot be read."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return (
        f"run={run_dir}: its config.yaml cannot be read ({type(e).__name__}: {first}), so the run's settings are "
        f"unknown. Fix: restore {RunLayout(run_dir).config} (Hydra's copy of the composed config is "
        f"{run_dir / '.hydra' / 'config.yaml'}), or pick another run."
    )


def read_resume_record(run_dir: Path) -> dict | None:
    path = run_dir / RESUME_RECORD
    return json.loads(path.read_text()) if path.exists() else None


def compose_config(overrides: list[str], launch_dir: Path | None = None) -> TrainConfig:
    """The typed config `python -m exp.train <overrides>` would run, composed without a run directory.

    Unknown keys, bad values and failed cross-field checks raise one ConfigError (the CLI's messages).
    """

    problems = check_cli_overrides(overrides)
    if problems:
        raise ConfigError("\n".join(problems))
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            dcfg = compose(config_name="train", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(composition_error(e, list(overrides))) from e
    return to_typed(dcfg, launch_dir or Path.cwd())
