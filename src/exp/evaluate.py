"""`python -m exp.evaluate run=<run dir>`: loss, perplexity and task metrics of a trained adapter.

Loads the base exactly as the run trained it (same quantization, same compute dtype) plus the run's adapter (or a
checkpoint's adapter weights with `ckpt=`), and scores the run's held-out split (the examples training validated
on, in the same order) or every row of another dataset in the run's data format (Alpaca rows for a run on the
generated default): `data=<file>`, `data.path=<file>` or `data.val_path=<file>` (the same: that file, every usable
row), or `data.hub_id=<name>`. Writes `<run>/eval.json` (`eval_<name>.json` for other data) and prints it; its
`data` entry names what was scored.

    python -m exp.evaluate run=outputs/2026-11-30/11-45-49
    python -m exp.evaluate ckpt=outputs/2026-11-30/11-45-49/checkpoints/step-001000.ckpt
    python -m exp.evaluate run=<run> data=my_eval.jsonl            # every row of a file in the run's data format
    python -m exp.evaluate run=<run> data.num_examples=8000        # any data.<field> of the run's data config
    python -m exp.evaluate run=<run> lm_eval=hellaswag,arc_easy    # lm-evaluation-harness, when installed

A run of a preference objective (`objective=dpo|orpo|simpo|kto`) is scored on pairs (KTO: labelled completions):
its held-out split, or a file in its data format (`data.format=preference` / `kto` rows for a run on the generated
pairs). The report holds what its validation logged, computed by the same code (exp.training.objectives): the
loss, preference accuracy (chosen rewarded above rejected; KTO: desirable above 0, undesirable below), the rewards
of chosen and rejected, their margin and the completions' log-probabilities, over `pairs` pairs.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import DataLoader

from exp.core.cli import Key, Tool
from exp.core.config import ConfigError, DataConfig, DataFormat, LossImpl, Objective, ObjectiveConfig
from exp.data.batching import collate
from exp.data.encoding import Encoded
from exp.data.preference import all_preference_examples, preference_collate, preference_splits
from exp.data.splits import all_examples, build_splits, validation_source
from exp.model.loss import resolve_loss_impl
from exp.model.metrics import add_sums, batch_response_metrics, validation_rates
from exp.run.dirs import RunLayout, write_json
from exp.run.inference import (
    RUN_CONFIG_HELP,
    RUN_KEYS,
    VERBOSE_KEY,
    LoadedRun,
    load_run,
    parse_args,
    passes_run_config,
    resolve_run_dir,
    run_cli,
)
from exp.training.objectives import preference_loss, preference_split_rates

TOOL = Tool(
    "exp.evaluate",
    __doc__,
    (
        *RUN_KEYS,
        Key(
            "data",
            None,
            "a data file (or directory) in the run's data format (alpaca for the generated default), evaluated in "
            "full instead of the held-out split (the same as data.path=FILE)",
            placeholder="FILE",
        ),
        Key(
            "name",
            None,
            "names the report eval_<name>.json [default: the data file's and the checkpoint's stems]",
            name_only=True,
        ),
        Key("batch_size", 0, "examples per forward pass (0: the run's hardware.micro_batch_size)", at_least=0),
        Key(
            "lm_eval",
            None,
            "comma-separated lm-evaluation-harness tasks (hellaswag,arc_easy), when installed",
            placeholder="TASKS",
        ),
        Key("lm_eval_limit", 0, "examples per lm-eval task (0: all)", at_least=0),
        VERBOSE_KEY,
    ),
    passes=passes_run_config,
    passes_help=RUN_CONFIG_HELP,
)


# Arguments that name a dataset to score whole instead of the run's held-out split. data.val_path names the file
# the held-out split would be read from, so it is scored the same way: every usable row.
SOURCE_KEYS = ("data", "data.path", "data.val_path", "data.hub_id")
# Fields that only choose how the held-out split is drawn: with a whole dataset they would change nothing.
SPLIT_KEYS = ("data.val_size", "data.num_examples", "data.seed")


@dataclass(frozen=True)
class EvalSource:
    """A dataset the arguments name in place of the run's held-out split: the key that named it and its value (a
    file made absolute against the current directory, or a hub id)."""

    key: str
    value: str

    @property
    def is_hub(self) -> bool:
        return self.key == "data.hub_id"


def eval_source(data: str | None, fields: dict[str, str]) -> EvalSource | None:
    """The dataset `data=` or a `data.path` / `data.val_path` / `data.hub_id` field names (None: the held-out
    split); refused, before any model loads, when two are named, a file does not exist, or a split field is given
    that a whole dataset would ignore."""
    given = {"data": data, **fields}
    named = [(k, str(given[k])) for k in SOURCE_KEYS if given.get(k) not in (None, "", "null")]
    if not named:
        return None
    if len({v for _, v in named}) > 1:
        listing = " and ".join(f"{k}={v}" for k, v in named)
        raise ConfigError(
            f"{listing}: two datasets to score, and exp.evaluate scores one. Keep one of them (data=<file> and "
            "data.path=<file> say the same), or evaluate twice with name= to keep both reports."
        )
    key, value = named[0]
    if unused := [f"{k}={given[k]}" for k in SPLIT_KEYS if k in fields]:
        raise ConfigError(
            f"{', '.join(unused)} with {key}={value}: these choose how the run's held-out split is drawn, and "
            f"{key}= scores every usable row of that dataset instead, so they would change nothing. Drop them, "
            f"or drop {key}= to score a held-out split drawn with them."
        )
    if key == "data.hub_id":
        return EvalSource(key, value)
    path = Path(value).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{key}={value}: no such file or directory (relative paths are read from the current directory, "
            f"{Path.cwd()}). Pass the path of the file to score (an absolute path, or one relative to here), or drop "
            f"{key}= to score the run's held-out split."
        )
    return EvalSource(key, str(path.resolve()))


def eval_data_config(
    base: DataConfig, data: str | None, fields: dict[str, str], synthetic_as: DataFormat = DataFormat.alpaca
) -> DataConfig:
    """The run's data config, or a dataset in its place (`eval_source`), with `data.<field>=` overrides checked
    against the schema.

    A dataset is read in the run's format with the run's column mapping (a chat run is scored on chat rows); the
    generated default has no file format of its own: its rows are read as `synthetic_as` (Alpaca rows; a
    preference objective's pairs or labelled completions).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = base
    source = eval_source(data, fields)
    fields = {k: v for k, v in fields.items() if k not in SOURCE_KEYS}
    if source is not None:
        fmt = synthetic_as if cfg.format == DataFormat.synthetic else cfg.format
        path, hub_id = (None, source.value) if source.is_hub else (source.value, None)
        cfg = replace(cfg, format=fmt, path=path, hub_id=hub_id, val_path=None)
    if fields:
        try:
            merged = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(list(fields_items(fields))))
        except OmegaConfBaseException as e:
            allowed = ", ".join(f"data.{k}" for k in DataConfig.__dataclass_fields__)
            raise ConfigError(f"{'; '.join(fields_items(fields))}: {e.msg}. Allowed: {allowed}.") from None
        cfg = OmegaConf.to_object(merged)
    return cfg


def fields_items(fields: dict[str, str]) -> list[str]:
    return [f"{k.removeprefix('data.')}={v}" for k, v in fields.items()]


def eval_examples(cfg: DataConfig, tokenizer: Any, whole: bool, key: str = "data") -> list[Encoded]:
    """The held-out split exactly as training drew it, or (`whole`: a dataset named by `key`) every usable row, in
    order."""
    return all_examples(cfg, tokenizer, key=key) if whole else build_splits(cfg, tokenizer).val


def scored(cfg: DataConfig, whole: bool) -> dict[str, Any]:
    """What was scored, for the report: the file (or hub dataset) the examples came from and which of its rows."""
    if whole:
        where = f"data.hub_id={cfg.hub_id} (split {cfg.split})" if cfg.hub_id and not cfg.path else cfg.path
        return {"path": cfg.path, "hub_id": None if cfg.path else cfg.hub_id, "split": f"all usable rows of {where}"}
    return {
        "path": cfg.val_path or cfg.path,
        "hub_id": None if cfg.val_path or cfg.path else cfg.hub_id,
        "split": validation_source(cfg),
    }


def build_eval_loader(cfg: DataConfig, tokenizer: Any, batch_size: int, whole: bool, key: str = "data") -> DataLoader:
    """`eval_examples` in order, padded as training's validation pads them."""
    pad = functools.partial(collate, pad_id=tokenizer.pad_token_id)
    examples = eval_examples(cfg, tokenizer, whole, key)
    return DataLoader(examples, batch_size=batch_size, shuffle=False, collate_fn=pad)


@torch.no_grad()
def score(model: Any, loader: DataLoader, device: torch.device, impl: LossImpl) -> dict[str, float]:
    """Token-weighted loss, perplexity, token accuracy and exact match: training's validation rates (with the logits
    computed the way the training loss `impl` computes them), and the examples and tokens they are over."""
    sums: dict[str, torch.Tensor] = {}
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        add_sums(sums, batch_response_metrics(model, batch, impl))
    rates = validation_rates(sums)
    return {
        "loss": rates["loss"],
        "perplexity": math.exp(rates["loss"]),  # next to the loss it is exp() of; the other rates follow
        **rates,
        "examples": int(sums["examples"]),
        "tokens": int(sums["tokens"]),
    }


def build_preference_loader(
    cfg: DataConfig,
    tokenizer: Any,
    batch_size: int,
    objective: ObjectiveConfig,
    whole: bool,
    key: str = "data",
    flat: bool = False,
) -> DataLoader:
    """The run's held-out pairs (KTO: labelled completions) as its validation drew them, or (`whole`) every usable
    row of a dataset, in order, batched as validation batches them (KTO's reference point is estimated within a
    batch, so the batch size is the run's micro-batch for its numbers to be validation's)."""
    unpaired = objective.kind == Objective.kto
    if whole:
        examples = all_preference_examples(cfg, tokenizer, key)
    else:
        examples = preference_splits(cfg, tokenizer, unpaired)[1]
    collate = preference_collate(tokenizer.pad_token_id, flat)
    return DataLoader(examples, batch_size=batch_size, shuffle=False, collate_fn=collate)


@torch.no_grad()
def score_preference(
    model: Any, loader: DataLoader, device: torch.device, impl: LossImpl, objective: ObjectiveConfig
) -> dict[str, float]:
    """A preference objective's validation metrics over the loader's pairs: training's validation step and rates."""
    sums: dict[str, torch.Tensor] = {}
    for batch in loader:
        batch = move_data_to_device(batch, device)
        add_sums(sums, preference_loss(model, batch, objective, impl)[1])
    return {**preference_split_rates(sums), "pairs": int(sums["pairs"])}


def check_lm_eval(tasks: str) -> None:
    """Before any model is loaded: the harness is an optional extra, not a dependency of exp."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            f"lm_eval={tasks}: the lm-evaluation-harness is not installed. Install it with "
            "`pip install lm-eval` (its benchmarks download their data from the Hugging Face hub), or drop lm_eval=."
        )


def run_lm_eval(loaded: LoadedRun, tasks: str, batch_size: int, limit: int) -> dict[str, Any]:
    """Standard benchmarks through EleutherAI's lm-evaluation-harness, on the model as loaded here."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=batch_size, device=str(loaded.device))
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks.split(","), limit=limit or None)
    return results["results"]


def evaluate(argv: list[str]) -> dict[str, Any]:
    """Parse `key=value` arguments, score the run, write and print the report; returns it."""
    args = parse_args(argv, TOOL)
    run_dir = resolve_run_dir(args["run"], args["ckpt"], "exp.evaluate")
    ckpt = Path(args["ckpt"]).expanduser() if args["ckpt"] else None
    if args["lm_eval"]:
        check_lm_eval(args["lm_eval"])
    fields = {k: v for k, v in args.items() if k.startswith("data.")}
    source = eval_source(args["data"], fields)  # a bad dataset argument fails here, before the model loads
    started = time.time()
    loaded = load_run(run_dir, ckpt=ckpt, overrides=args)
    objective = loaded.cfg.objective
    data_cfg = eval_data_config(loaded.cfg.data, args["data"], fields, pair_format(objective))
    batch_size = args["batch_size"] or loaded.cfg.hardware.micro_batch_size
    whole = source is not None
    key = source.key if source else "data"
    # The logits as the run's training loss computed them: in chunks unless its head or strategy rules that out.
    impl = resolve_loss_impl(loaded.cfg, loaded.model, loaded.device).impl
    if objective.preference:
        # In the run's layout (padding-free rows or padded), as its validation scored them.
        loader = build_preference_loader(
            data_cfg, loaded.tokenizer, batch_size, objective, whole, key, loaded.cfg.hardware.padding_free
        )
        scores = {
            "objective": objective.kind.value,
            **score_preference(loaded.model, loader, loaded.device, impl, objective),
        }
    else:
        loader = build_eval_loader(data_cfg, loaded.tokenizer, batch_size, whole, key)
        scores = score(loaded.model, loader, loaded.device, impl)
    report: dict[str, Any] = {
        "run": str(run_dir),
        "weights": str(ckpt) if ckpt else str(RunLayout(run_dir).adapter),
        "data": {"format": data_cfg.format.value, **scored(data_cfg, whole)},
        **scores,
    }
    if args["lm_eval"]:
        report["lm_eval"] = run_lm_eval(loaded, args["lm_eval"], batch_size, args["lm_eval_limit"])
    report["seconds"] = round(time.time() - started, 1)
    # A report per weights and data: a checkpoint's or another set's numbers never replace eval.json.
    other = {k: v for k, v in fields.items() if k not in SOURCE_KEYS}
    data_part = report_stem(source) if source else ("custom" if other else "")
    if source and other:
        data_part += "_custom"
    name = args["name"] or "_".join(p for p in [data_part, ckpt.stem if ckpt else ""] if p)
    out = run_dir / (f"eval_{name}.json" if name else "eval.json")
    write_json(out, report)
    print(json.dumps(report, indent=2, default=str))
    print(f"exp: scored {report['data']['split']}; wrote {out}")
    return report


def pair_format(objective: ObjectiveConfig) -> DataFormat:
    """The file format a run on the generated data is scored in: Alpaca rows, or its objective's pairs (KTO:
    labelled completions)."""
    if not objective.preference:
        return DataFormat.alpaca
    return DataFormat.kto if objective.kind == Objective.kto else DataFormat.preference


def report_stem(source: EvalSource) -> str:
    """The part of the report's name that says which dataset it scored: the file's stem, or the hub id."""
    return source.value.replace("/", "_") if source.is_hub else Path(source.value).stem


def main(argv: list[str] | None = None) -> None:
    run_cli(TOOL, evaluate, argv)


if __name__ == "__main__":
    main()
