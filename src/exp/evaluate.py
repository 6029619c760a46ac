"""`python -m exp.evaluate run=<run dir>`: loss, perplexity and task metrics of a trained adapter.

Loads the base exactly as the run trained it (same quantization, same compute dtype) plus the run's adapter (or a
checkpoint's adapter weights with `ckpt=`), and scores the run's held-out split (the examples training validated
on, in the same order) or every row of another file in the run's data format (Alpaca rows for a run on the
generated default). Writes `<run>/eval.json` (`eval_<name>.json` for other data) and prints it.

    python -m exp.evaluate run=outputs/2026-11-30/11-45-49
    python -m exp.evaluate ckpt=outputs/2026-11-30/11-45-49/checkpoints/step-001000.ckpt
    python -m exp.evaluate run=<run> data=my_eval.jsonl            # every row of a file in the run's data format
    python -m exp.evaluate run=<run> data.num_examples=8000        # any data.<field> of the run's data config
    python -m exp.evaluate run=<run> lm_eval=hellaswag,arc_easy    # lm-evaluation-harness, when installed
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from exp.core.cli import Key, Tool
from exp.core.config import ConfigError, DataConfig, DataFormat, LossImpl
from exp.data.datamodule import Encoded, all_examples, build_splits, collate
from exp.model.loss import resolve_loss_impl
from exp.model.metrics import batch_response_metrics
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

TOOL = Tool(
    "exp.evaluate",
    __doc__,
    (
        *RUN_KEYS,
        Key(
            "data",
            None,
            "a data file (or directory) in the run's data format (alpaca for the generated default), evaluated in "
            "full instead of the held-out split",
            placeholder="FILE",
        ),
        Key("name", None, "names the report eval_<name>.json [default: the data file's and the checkpoint's stems]"),
        Key("batch_size", 0, "examples per forward pass (0: the run's hardware.micro_batch_size)"),
        Key(
            "lm_eval",
            None,
            "comma-separated lm-evaluation-harness tasks (hellaswag,arc_easy), when installed",
            placeholder="TASKS",
        ),
        Key("lm_eval_limit", 0, "examples per lm-eval task (0: all)"),
        VERBOSE_KEY,
    ),
    passes=passes_run_config,
    passes_help=RUN_CONFIG_HELP,
)


def eval_data_config(base: DataConfig, data: str | None, fields: dict[str, str]) -> DataConfig:
    """The run's data config, or a file in its place, with `data.<field>=` overrides checked against the schema.

    A file is read in the run's format with the run's column mapping (a chat run is scored on chat rows); the
    generated default has no file format of its own, and its rows are Alpaca rows.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = base
    if data:
        path = Path(data).expanduser().resolve()
        fmt = DataFormat.alpaca if cfg.format == DataFormat.synthetic else cfg.format
        cfg = replace(cfg, format=fmt, path=str(path), hub_id=None, val_path=None)
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


def eval_examples(cfg: DataConfig, tokenizer: Any, whole: bool) -> list[Encoded]:
    """The held-out split exactly as training drew it, or (`whole`, the `data=` file) every usable row, in order."""
    return all_examples(cfg, tokenizer, key="data") if whole else build_splits(cfg, tokenizer).val


def split_name(cfg: DataConfig, whole: bool) -> str:
    """What was scored, for the report."""
    if whole:
        return "all rows"
    if cfg.val_path:
        return f"held-out (data.val_path={cfg.val_path})"
    return f"held-out (data.val_size={cfg.val_size}, seed {cfg.seed})"


def build_eval_loader(cfg: DataConfig, tokenizer: Any, batch_size: int, whole: bool) -> DataLoader:
    """`eval_examples` in order, padded as training's validation pads them."""
    pad = functools.partial(collate, pad_id=tokenizer.pad_token_id)
    return DataLoader(eval_examples(cfg, tokenizer, whole), batch_size=batch_size, shuffle=False, collate_fn=pad)


@torch.no_grad()
def score(model: Any, loader: DataLoader, device: torch.device, impl: LossImpl) -> dict[str, float]:
    """Token-weighted loss, perplexity, token accuracy and exact match, summed as training's validation does (with
    the logits computed the way the training loss `impl` computes them)."""

    sums: dict[str, torch.Tensor] = {}
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        for k, v in batch_response_metrics(model, batch, impl).items():
            sums[k] = sums.get(k, 0) + v.to(torch.float64).cpu()
    loss = float(sums["loss_sum"] / sums["tokens"])
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "token_accuracy": float(sums["hits"] / sums["tokens"]),
        "exact_match": float(sums["exact"] / sums["examples"]),
        "examples": int(sums["examples"]),
        "tokens": int(sums["tokens"]),
    }


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
    started = time.time()
    loaded = load_run(run_dir, ckpt=ckpt, overrides=args)
    fields = {k: v for k, v in args.items() if k.startswith("data.")}
    data_cfg = eval_data_config(loaded.cfg.data, args["data"], fields)
    batch_size = args["batch_size"] or loaded.cfg.hardware.micro_batch_size
    whole = bool(args["data"])
    loader = build_eval_loader(data_cfg, loaded.tokenizer, batch_size, whole)
    # The logits as the run's training loss computed them: in chunks unless its head or strategy rules that out.
    impl = resolve_loss_impl(loaded.cfg, loaded.model, loaded.device).impl
    report: dict[str, Any] = {
        "run": str(run_dir),
        "weights": str(ckpt) if ckpt else str(RunLayout(run_dir).adapter),
        "data": {
            "format": data_cfg.format.value,
            "path": data_cfg.path,
            "split": split_name(data_cfg, whole),
        },
        **score(loaded.model, loader, loaded.device, impl),
    }
    if args["lm_eval"]:
        report["lm_eval"] = run_lm_eval(loaded, args["lm_eval"], batch_size, args["lm_eval_limit"])
    report["seconds"] = round(time.time() - started, 1)
    # A report per weights and data: a checkpoint's or another set's numbers never replace eval.json.
    parts = [Path(args["data"]).stem if args["data"] else ("custom" if fields else ""), ckpt.stem if ckpt else ""]
    name = args["name"] or "_".join(p for p in parts if p)
    out = run_dir / (f"eval_{name}.json" if name else "eval.json")
    write_json(out, report)
    print(json.dumps(report, indent=2, default=str))
    print(f"exp: wrote {out}")
    return report


def main(argv: list[str] | None = None) -> None:
    run_cli(TOOL, evaluate, argv)


if __name__ == "__main__":
    main()
