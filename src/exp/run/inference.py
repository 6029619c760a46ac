"""Load a finished run for inference: its recorded config, its tokenizer, its base model and its adapter.

Shared by `exp.evaluate`, `exp.generate` and `exp.merge`. The base is loaded through `exp.model.build.load_base_model`,
the same code training used, so the numbers match training's (bitsandbytes' CPU inference repacking stays off).
Also holds what their command lines share (exp.core.cli parses them): they take a run directory, not a Hydra
composition, and must not create Hydra run directories.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from exp.core.cli import VERBOSE_HELP, Key, Parsed, Tool, parse, run_tool
from exp.core.config import Accelerator, ConfigError, QuantizationConfig, QuantType, TrainConfig
from exp.core.strategies import Strategy
from exp.model.build import load_base_model, quiet_third_party_logs
from exp.run.checkpoints import load_checkpoint_file
from exp.run.compose import load_run_config
from exp.run.dirs import RunLayout

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass
class LoadedRun:
    run_dir: Path
    cfg: TrainConfig
    tokenizer: Any
    model: Any  # peft.PeftModel in eval mode
    device: torch.device


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def parse_args(argv: list[str], tool: Tool) -> dict[str, Any]:
    """The tool's `key=value` arguments, typed, with the `data.<field>=` / `model.path=` ones it passes on (as
    strings, checked later against the schema). Bad arguments raise UsageError naming them."""
    parsed = parse(tool, argv)
    return {**parsed.values, **dict(arg.split("=", 1) for arg in parsed.passed)}


def passes_run_config(key: str) -> bool:
    """`data.<field>=` and `model.path=`: the parts of a run's config exp.evaluate lets one change."""
    return key.startswith("data.") or key == "model.path"


def passes_model_path(key: str) -> bool:
    return key == "model.path"


MODEL_PATH_HELP = ("model.path=DIR", "the base model's directory, when it has moved since training")
RUN_CONFIG_HELP = (
    "data.<field>=VALUE",
    "a field of the run's data config (data.max_seq_len=512); model.path=DIR: the base model's directory",
)
RUN_KEYS = (
    Key("run", None, "the run directory exp.train wrote (outputs/<date>/<time>)", placeholder="DIR"),
    Key(
        "ckpt",
        None,
        "a checkpoint of that run (<run>/checkpoints/*.ckpt): its adapter weights replace adapter/",
        placeholder="FILE",
    ),
)
VERBOSE_KEY = Key("verbose", False, VERBOSE_HELP)


def run_cli(tool: Tool, body: Callable[[list[str]], Any], argv: list[str] | None = None) -> None:
    """Run a command's body; `--help` prints its keys, and bad input ends with one `exp: error: ...` paragraph
    and exit status 2."""
    argv = sys.argv[1:] if argv is None else argv

    def quiet_then_body(args: Parsed) -> None:
        # The console setup of exp.train, before anything loads: no loading bars, kernel notices or deprecations.
        quiet_third_party_logs(bool(args.values.get("verbose")))
        body(argv)

    if code := run_tool(tool, quiet_then_body, argv):
        sys.exit(code)


def resolve_run_dir(run: str | None, ckpt: str | None, command: str) -> Path:
    """The run directory, from `run=` or from a checkpoint inside it (`<run>/checkpoints/<name>.ckpt`)."""
    if not run and not ckpt:
        raise ConfigError(f"{command}: say which run: run=<run dir> (e.g. run=outputs/2026-11-30/11-45-49)")
    run_dir = Path(run).expanduser() if run else Path(ckpt).expanduser().resolve().parents[1]
    if not run_dir.is_dir():
        raise ConfigError(
            f"run={run_dir}: no such directory. Pass the directory a training run wrote (outputs/<date>/<time>)."
        )
    if not RunLayout(run_dir).config.exists():
        raise ConfigError(
            f"run={run_dir}: no config.yaml there, so this is not a run directory of exp.train. Pass the directory "
            "holding config.yaml, adapter/ and checkpoints/."
        )
    return run_dir


def adapter_dir_of(run_dir: Path) -> Path:
    adapter = RunLayout(run_dir).adapter
    if not (adapter / ADAPTER_WEIGHTS).exists():
        status = _run_status(run_dir)
        raise ConfigError(
            f"run={run_dir}: no adapter ({adapter / ADAPTER_WEIGHTS} is missing; the run's status is {status}). "
            "A run saves its adapter when training completes: pick a completed run, or use ckpt=<run>/checkpoints/"
            "last.ckpt with a run that has an adapter/ folder from a completed run."
        )
    return adapter


def _run_status(run_dir: Path) -> str:
    try:
        return json.loads(RunLayout(run_dir).status.read_text())["status"]
    except (OSError, ValueError, KeyError):
        return "unknown (no status.json)"


def run_config(
    run_dir: Path, device: torch.device, overrides: dict[str, Any] | None = None, quantized: bool = True
) -> TrainConfig:
    """The run's typed config, placed on one `device` of this machine (a run trained with DDP or on a GPU is
    evaluated in one process, here); `model.path=` points at a base that moved; `quantized=False` loads the base
    unquantized."""

    cfg = load_run_config(run_dir)
    overrides = overrides or {}
    if overrides.get("model.path"):
        cfg.model.path = str(Path(overrides["model.path"]).expanduser().resolve())
    on_gpu = device.type == "cuda"
    precision = cfg.hardware.precision
    if precision == "auto" or (not on_gpu and precision != "32-true"):
        # The compute dtype of training, unless that was a GPU precision and this is the CPU.
        precision = "bf16-mixed" if on_gpu else "32-true"
    hardware = replace(
        cfg.hardware,
        accelerator=Accelerator.gpu if on_gpu else Accelerator.cpu,
        strategy=Strategy.single_device,
        devices=1,
        num_nodes=1,
        precision=precision,
    )
    quantization = cfg.quantization if quantized else QuantizationConfig(quant_type=QuantType.none)
    return replace(cfg, hardware=hardware, quantization=quantization)


def load_base(cfg: TrainConfig, run_dir: Path, device: torch.device):
    """The base model as configured, with a message naming the run and the fix when its weights are gone."""

    try:
        return load_base_model(cfg, device)
    except ConfigError as e:
        raise ConfigError(
            f"the base model of run {run_dir} cannot be loaded: {e} If the base moved, pass model.path=<dir> "
            "(a save_pretrained directory with the same architecture)."
        ) from None


def load_adapter(base, adapter_dir: Path):
    """`PeftModel.from_pretrained`, explaining a shape mismatch (an adapter trained on another base)."""
    from peft import PeftModel

    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    except RuntimeError as e:
        if "size mismatch" not in str(e):
            raise damaged_adapter(adapter_dir, e) from None
        expected = _adapter_base(adapter_dir)
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e)[:300])
        raise ConfigError(
            f"the adapter in {adapter_dir} does not fit this base model ({first}). It was trained on "
            f"'{expected}' (adapter_config.json base_model_name_or_path), a different architecture from "
            f"'{base.config.name_or_path}'. Load it with the base it was trained on (model.path=<dir>), or pick the "
            "run that trained this base."
        ) from None
    except Exception as e:  # a JSON, safetensors or file-system error: a damaged or partial adapter/ file
        raise damaged_adapter(adapter_dir, e) from None
    model.eval()
    return model


def load_tokenizer(adapter_dir: Path):
    """The tokenizer a run saved next to its adapter."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(adapter_dir))
    except Exception as e:  # tokenizer.json or tokenizer_config.json cut short or overwritten
        raise damaged_adapter(adapter_dir, e) from None


def damaged_adapter(adapter_dir: Path, e: BaseException) -> ConfigError:
    """The paragraph for an adapter/ folder whose files cannot be read (cut short, overwritten, not exp's)."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return ConfigError(
        f"run={adapter_dir.parent}: the adapter in {adapter_dir} cannot be read ({type(e).__name__}: {first}). "
        "Fix: restore adapter/ from a copy, or pick another run."
    )


def _adapter_base(adapter_dir: Path) -> str:
    try:
        return json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path") or "?"
    except (OSError, ValueError):
        return "?"


def load_checkpoint_adapter(model, ckpt: Path) -> None:
    """Replace the adapter weights with those of a Lightning checkpoint of the same run.

    Its state_dict holds only the trainable tensors, named `model.<PeftModel parameter name>` (the LightningModule
    keeps the PeftModel in `self.model`).
    """
    if not ckpt.is_file():
        raise ConfigError(
            f"ckpt={ckpt}: no such file. Checkpoints are <run>/checkpoints/step-NNNNNN.ckpt or last.ckpt."
        )

    try:
        state = load_checkpoint_file(ckpt)["state_dict"]
    except ValueError as e:  # truncated, altered or foreign
        raise ConfigError(f"ckpt={ckpt}: not an intact checkpoint of exp.train ({e})") from None
    weights = {k.removeprefix("model."): v for k, v in state.items()}
    own = {n for n, p in model.named_parameters() if "lora_" in n}
    missing, unexpected = own - weights.keys(), weights.keys() - dict(model.named_parameters()).keys()
    if missing or unexpected:
        raise ConfigError(
            f"ckpt={ckpt}: its tensors do not match this run's adapter ({len(missing)} missing, e.g. "
            f"{sorted(missing)[:2]}; {len(unexpected)} unexpected, e.g. {sorted(unexpected)[:2]}). Use a checkpoint "
            "written by the same run."
        )
    try:
        model.load_state_dict(weights, strict=False)
    except RuntimeError as e:
        raise ConfigError(f"ckpt={ckpt}: tensor shapes differ from this run's adapter ({str(e)[:300]})") from None


def load_run(
    run_dir: Path,
    ckpt: Path | None = None,
    overrides: dict[str, Any] | None = None,
    device: torch.device | None = None,
) -> LoadedRun:
    """The run's 4-bit base (as trained) + its adapter (or a checkpoint's adapter weights), in eval mode."""
    device = device or default_device()
    adapter_dir = adapter_dir_of(run_dir)
    cfg = run_config(run_dir, device, overrides)
    tokenizer = load_tokenizer(adapter_dir)
    model = load_adapter(load_base(cfg, run_dir, device), adapter_dir)
    if ckpt is not None:
        load_checkpoint_adapter(model, ckpt)
    return LoadedRun(run_dir, cfg, tokenizer, model, device)
