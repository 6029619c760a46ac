"""Configuration tests: every group option composes into the typed schema, typos and invalid values fail early
with a message naming the key, and the CLI leaves no finished-looking run directory behind on such errors.

Fast: no model is loaded and nothing is trained (the CLI tests stop at composition or validation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import hydra
import pytest
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, ListConfig, OmegaConf

import exp.run.compose
import exp.train
from exp.core.config import (
    Accelerator,
    ConfigError,
    DataFormat,
    LoggerKind,
    ModelFamily,
    QuantType,
    TrainConfig,
)
from exp.run.overrides import check_cli_overrides

CONF_DIR = Path(exp.run.compose.CONF_DIR)
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "experiment")

# Options that are valid only together with another choice (cross-field validation would reject them alone).
REQUIRED_COMPANIONS: dict[tuple[str, str], list[str]] = {
    # int8 has no CPU kernel: rejected with the default hardware=cpu. Only the accelerator is switched
    # here, so this covers int8 alone (hardware=gpu has its own tests, e.g. test_int8_with_hardware_gpu).
    ("quantization", "int8"): ["hardware.accelerator=gpu"],
    # file-based formats need a path
    **{
        ("data", f): ["data.path=train.jsonl"]
        for f in ("alpaca", "chat", "guanaco", "prompt_completion", "sharegpt", "text")
    },
}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


GROUP_OPTIONS = [(g, o) for g in GROUPS for o in _options(g)]
EXPERIMENTS = _options("experiment") if (CONF_DIR / "experiment").is_dir() else []
MODEL_OPTIONS = _options("model")


@pytest.fixture(autouse=True)
def clean_hydra():
    """Each test composes from a fresh Hydra (a test that failed mid-compose must not leak its state)."""
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def compose(overrides: list[str] | None = None) -> DictConfig:
    GlobalHydra.instance().clear()
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra.compose("train", overrides=list(overrides or []))


def typed(overrides: list[str] | None = None) -> TrainConfig:
    cfg = OmegaConf.to_object(compose(overrides))
    assert isinstance(cfg, TrainConfig)
    return cfg


def _plain(value: Any) -> Any:
    """A typed config value as the YAML would spell it (enums by value, containers as plain lists/dicts)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _assert_file_values_applied(section: Any, file_values: dict, where: str) -> None:
    """Every key the option file sets is present, with that value, in the typed section."""
    for key, expected in file_values.items():
        if key == "defaults":  # Hydra's own list (the option this one extends), not a schema field
            continue
        assert hasattr(section, key), f"{where}.{key} set by the option file is missing from the typed config"
        assert _plain(getattr(section, key)) == expected, f"{where}.{key}"


def _error_text(exc: BaseException) -> str:
    """The message of an exception and of the exceptions it was raised from (Hydra chains the detail)."""
    parts = []
    while exc is not None:
        parts.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


# --- 1. every option of every group composes into the typed schema --------------------------------


def test_groups_and_options_are_discovered():
    # Guards the discovery itself: an empty parametrization would make the tests below vacuous.
    assert {"model", "quantization", "lora", "hardware", "data", "trainer", "logger"} <= set(GROUPS)
    assert {"gemma_tiny", "gemma_7b"} <= set(MODEL_OPTIONS)
    assert len(GROUP_OPTIONS) >= 20


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes_to_typed_schema(group: str, option: str):
    overrides = [f"{group}={option}", *REQUIRED_COMPANIONS.get((group, option), [])]
    cfg = typed(overrides)
    section = getattr(cfg, group)
    # The values the option file sets (comments and `{}` files give an empty mapping) reach the typed section.
    file_values = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"), resolve=True)
    _assert_file_values_applied(section, file_values or {}, group)
    if group == "model":
        assert cfg.model.name == option  # each model option names itself
        assert isinstance(cfg.model.family, ModelFamily)


def test_model_gemma_7b():
    cfg = typed(["model=gemma_7b"])
    assert cfg.model.name == "gemma_7b"
    assert cfg.model.hub_id == "google/gemma-7b"
    assert cfg.model.family is ModelFamily.gemma
    assert cfg.model.arch["hidden_size"] == 3072
    assert cfg.model.random_init is False


def test_lora_guanaco():
    lora = typed(["lora=guanaco"]).lora
    assert lora.r == 64
    assert lora.alpha == 16
    assert lora.dropout == pytest.approx(0.1)
    assert len(lora.target_modules) == 7
    assert set(lora.target_modules) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def test_lora_all_linear_keeps_default_rank():
    lora = typed(["lora=all_linear"]).lora
    assert len(lora.target_modules) == 7
    assert (lora.r, lora.alpha) == (8, 16)


@pytest.mark.parametrize(
    ("option", "expected"),
    [("nf4", QuantType.nf4), ("fp4", QuantType.fp4), ("int8", QuantType.int8), ("none", QuantType.none)],
)
def test_quantization_options_give_enum(option: str, expected: QuantType):
    cfg = typed([f"quantization={option}", *REQUIRED_COMPANIONS.get(("quantization", option), [])])
    assert isinstance(cfg.quantization.quant_type, QuantType)
    assert cfg.quantization.quant_type is expected
    assert cfg.quantization.quant_type.value == option


def test_hardware_gpu():
    hw = typed(["hardware=gpu"]).hardware
    assert hw.accelerator is Accelerator.gpu
    assert hw.precision == "auto"  # resolved by the preflight (bf16-mixed on Ampere+)
    assert hw.micro_batch_size == 4
    assert hw.gradient_checkpointing is True


def test_hardware_cpu():
    hw = typed(["hardware=cpu"]).hardware
    assert hw.accelerator is Accelerator.cpu
    assert hw.precision == "32-true"


def test_data_logger_trainer_options():
    assert typed(["data=alpaca", "data.path=x.jsonl"]).data.format is DataFormat.alpaca
    assert typed(["logger=csv"]).logger.trackers == [LoggerKind.csv]
    assert typed(["logger=none"]).logger.trackers == []
    assert typed(["trainer=default"]).trainer.max_steps == 1000
    assert typed(["trainer=tiny"]).trainer.max_steps == 3000


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name: str):
    # A file-based data format needs a path; any placeholder composes (nothing is read here).
    cfg = typed([f"experiment={name}", "data.path=placeholder.jsonl"])
    raw = OmegaConf.load(CONF_DIR / "experiment" / f"{name}.yaml")
    header = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    if "@package _global_" in header:
        # Values set directly in the experiment file reach the typed config (the `defaults` list aside).
        values = OmegaConf.to_container(raw, resolve=False) or {}
        values.pop("defaults", None)
        for key, val in values.items():
            if isinstance(val, dict):
                _assert_file_values_applied(getattr(cfg, key), val, key)
            else:
                assert _plain(getattr(cfg, key)) == val, key


def test_guanaco_7b_is_the_reference_recipe():
    cfg = typed(["experiment=guanaco_7b", "data.path=oasst1.jsonl"])
    assert (cfg.model.name, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout) == ("gemma_7b", 64, 16, 0.1)
    assert "lm_head" not in cfg.lora.target_modules and len(cfg.lora.target_modules) == 7
    assert cfg.accumulate_grad_batches == 16 and cfg.trainer.max_steps == 1875
    assert (cfg.trainer.learning_rate, cfg.trainer.max_grad_norm) == (2e-4, 0.3)
    assert cfg.trainer.optimizer.value == "paged_adamw_32bit" and cfg.hardware.gradient_checkpointing
    with pytest.raises(ConfigError, match="data.path"):
        typed(["experiment=guanaco_7b"])  # the recipe's data must be named


# --- 2. defaults ----------------------------------------------------------------------------------


@pytest.mark.parametrize("option", MODEL_OPTIONS)
def test_model_options_do_not_trust_remote_code(option: str):
    assert typed([f"model={option}"]).model.trust_remote_code is False


@pytest.mark.parametrize("option", MODEL_OPTIONS)
def test_gemma2_options_use_eager_attention(option: str):
    model = typed([f"model={option}"]).model
    if model.family is ModelFamily.gemma2:
        assert model.attn_implementation == "eager"
    else:
        assert model.attn_implementation == "sdpa"


def test_there_are_gemma2_options():
    families = {typed([f"model={o}"]).model.family for o in MODEL_OPTIONS}
    assert ModelFamily.gemma2 in families


def test_default_composition():
    cfg = typed()
    assert cfg.model.name == "gemma_tiny"
    assert cfg.model.random_init is True
    assert cfg.model.trust_remote_code is False
    assert cfg.quantization.quant_type is QuantType.nf4
    assert cfg.quantization.double_quant is True
    assert cfg.lora.r == 8
    assert cfg.lora.alpha == 16
    assert cfg.lora.dropout == pytest.approx(0.05)
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.hardware.accelerator is Accelerator.cpu
    assert cfg.data.format is DataFormat.synthetic
    assert cfg.experiment_name is None


# --- 3. typos and invalid values fail at composition ----------------------------------------------


def test_unknown_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as info:
        compose(["lora.rank=16"])
    assert "rank" in _error_text(info.value)


def test_wrong_type_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as info:
        compose(["lora.r=abc"])
    text = _error_text(info.value)
    assert "lora.r" in text
    assert "abc" in text


def test_unknown_group_option_lists_available():
    with pytest.raises(ConfigCompositionException) as info:
        compose(["model=gemma_tny"])
    text = _error_text(info.value)
    assert "gemma_tny" in text
    assert "gemma_7b" in text
    assert "gemma_tiny" in text


def test_invalid_enum_value_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as info:
        compose(["quantization.quant_type=nf5"])
    text = _error_text(info.value)
    assert "quant_type" in text
    assert "nf5" in text
    assert "nf4" in text  # the allowed values are listed


# --- 4. cross-field validation (composes, then fails in the typed schema) -------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["lora.r=0"], "lora.r"),
        (["lora.alpha=-1"], "lora.alpha"),
        (["lora.dropout=1.5"], "lora.dropout"),
        (["lora.target_modules=[]"], "lora.target_modules"),
        (["trainer.global_batch_size=12"], "trainer.global_batch_size"),
        (["trainer.warmup_steps=-1"], "trainer.warmup_steps"),
        (["trainer.warmup_steps=10.5"], "trainer.warmup_steps"),
        (["hardware=cpu", "hardware.precision=16-mixed"], "hardware.precision"),
        (["quantization=int8"], "int8"),
        (["data=alpaca"], "data.path"),
        (["model=gemma_7b", "model.hub_id=null"], "model.path"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_cross_field_validation(overrides: list[str], key: str):
    dcfg = compose(overrides)  # composition itself succeeds
    with pytest.raises(ConfigError) as info:
        OmegaConf.to_object(dcfg)
    assert key in str(info.value)


def test_global_batch_not_multiple_of_micro_batch_names_both():
    with pytest.raises(ConfigError) as info:
        OmegaConf.to_object(compose(["trainer.global_batch_size=12"]))
    msg = str(info.value)
    assert "trainer.global_batch_size=12" in msg
    assert "hardware.micro_batch_size" in msg


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        OmegaConf.to_object(compose(["lora.r=0", "lora.alpha=0", "trainer.warmup_steps=-5"]))
    msg = str(info.value)
    assert "lora.r" in msg
    assert "lora.alpha" in msg
    assert "trainer.warmup_steps" in msg


def test_true_low_precision_is_rejected_with_the_mixed_alternative():
    # A "*-true" low precision would cast the 4-bit weights: refused, naming the fix.
    with pytest.raises(ConfigError) as info:
        OmegaConf.to_object(compose(["hardware=gpu", "hardware.precision=bf16-true"]))
    assert "hardware.precision=bf16-true" in str(info.value) and "bf16-mixed" in str(info.value)


def test_int8_with_hardware_gpu():
    cfg = typed(["quantization=int8", "hardware=gpu"])
    assert cfg.quantization.quant_type is QuantType.int8
    assert cfg.hardware.accelerator is Accelerator.gpu


def test_valid_companion_makes_rejected_option_pass():
    # The same options that fail alone pass once the missing piece is given.
    assert typed(["quantization=int8", "hardware.accelerator=gpu"]).quantization.quant_type is QuantType.int8
    assert typed(["data=alpaca", "data.path=train.jsonl"]).data.path == "train.jsonl"
    assert typed(["trainer.global_batch_size=16"]).trainer.global_batch_size == 16


# --- 5. check_cli_overrides -----------------------------------------------------------------------


def test_check_cli_overrides_unknown_field_lists_allowed():
    problems = check_cli_overrides(["lora.rank=16"])
    assert len(problems) == 1
    msg = problems[0]
    assert "rank" in msg
    assert "Allowed:" in msg
    for name in ("alpha", "dropout", "r", "target_modules"):
        assert name in msg


def test_check_cli_overrides_suggests_nearest_field_for_rank():
    (msg,) = check_cli_overrides(["lora.rank=16"])
    assert "Did you mean 'lora.r'" in msg


def test_check_cli_overrides_suggests_nearest_field_for_long_name():
    (msg,) = check_cli_overrides(["trainer.lerning_rate=1e-3"])
    assert "Did you mean 'trainer.learning_rate'" in msg


def test_check_cli_overrides_unknown_group_member():
    (msg,) = check_cli_overrides(["hardwre.devices=2"])
    assert "hardwre" in msg
    assert "the root config" in msg
    assert "Did you mean 'hardware'" in msg


@pytest.mark.parametrize(
    "args",
    [
        ["lora.r=16", "model=gemma_7b", "+foo=1", "hydra.run.dir=x", "-m"],
        ["model.arch.hidden_size=64"],
        ["lora.target_modules=[q_proj,k_proj]", "trainer.learning_rate=1e-3", "hardware.micro_batch_size=4"],
        ["~lora.bias", "--multirun", "experiment_name=foo"],
    ],
)
def test_check_cli_overrides_accepts_valid(args: list[str]):
    assert check_cli_overrides(args) == []


# --- 6. the real CLI ------------------------------------------------------------------------------


def _run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "exp.train", *args],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _completed_run_dirs(root: Path) -> list[Path]:
    done = []
    for status in root.rglob("status.json"):
        try:
            if json.loads(status.read_text()).get("status") == "completed":
                done.append(status.parent)
        except json.JSONDecodeError:
            continue
    return done


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("lora.rank=16", ["rank"]),
        ("lora.r=abc", ["lora.r", "abc"]),
        ("model=gemma_tny", ["gemma_tny", "gemma_7b"]),
    ],
)
def test_cli_rejects_bad_override(tmp_path: Path, arg: str, expected: list[str]):
    proc = _run_cli(tmp_path, arg)
    output = proc.stderr + proc.stdout
    assert proc.returncode != 0, output
    for text in expected:
        assert text in output, output
    assert _completed_run_dirs(tmp_path) == []


@pytest.mark.slow
def test_cli_cross_field_error_leaves_no_run_dir(tmp_path: Path):
    """The run directory claimed before the typed config's checks is removed again: no half-empty run (nor an empty
    outputs/<date>/) is left to look like one. (A directory that existed before is kept, marked failed:
    tests/test_run_dirs.py.)"""
    proc = _run_cli(tmp_path, "lora.r=0")
    output = proc.stderr + proc.stdout
    assert proc.returncode == 2, output
    assert "lora.r" in output and "Traceback" not in output
    assert list(tmp_path.iterdir()) == []


# --- 7. derived gradient accumulation -------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.global_batch_size=32", "hardware.micro_batch_size=8"], 4),
        (["trainer.global_batch_size=8", "hardware.micro_batch_size=8"], 1),
        (["hardware=ddp", "trainer.global_batch_size=64", "hardware.micro_batch_size=4", "hardware.devices=2"], 8),
        (
            [
                "hardware=ddp",
                "trainer.global_batch_size=96",
                "hardware.micro_batch_size=2",
                "hardware.devices=4",
                "hardware.num_nodes=3",
            ],
            4,
        ),
        # Model parallelism is one process: its GPUs do not multiply the batch.
        (["hardware=model_parallel", "hardware.devices=2", "trainer.global_batch_size=32"], 8),
        (["hardware=gpu", "trainer.global_batch_size=32"], 8),  # gpu micro batch is 4
    ],
)
def test_accumulate_grad_batches(overrides: list[str], expected: int):
    cfg = typed(overrides)
    assert cfg.accumulate_grad_batches == expected


def test_run_dir_that_is_a_file_is_refused_before_anything_runs(tmp_path):
    target = tmp_path / "afile"
    target.write_text("keep me")
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", f"hydra.run.dir={target}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "is an existing file" in proc.stderr and "Traceback" not in proc.stderr
    assert target.read_text() == "keep me"


def test_compose_config_names_the_key_of_an_unreadable_override():
    """The tools that compose without Hydra's CLI (exp.preview, exp.doctor) report a grammar error as exp.train
    does: the override, its key, and the quoting that reads the value."""
    with pytest.raises(ConfigError) as info:
        exp.run.compose.compose_config(["data.path=set[1].jsonl"])
    text = str(info.value)
    assert "Hydra cannot read the value of data.path" in text
    assert "\"data.path='set[1].jsonl'\"" in text
