"""One variant in its worker process (`python -m exp.bench worker=<spec>`, started by exp.bench.runner): the spec
file's variant run on its side, its row written to the result file whatever happens."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from exp.bench.run_baseline import run_baseline_worker
from exp.bench.run_exp import run_exp_worker
from exp.bench.variants import BenchModel, Settings, Variant
from exp.model.build import quiet_third_party_logs, resolve_checkpoint


def resolve_model(settings: Settings) -> BenchModel:
    """The model's checkpoint dir (built into exp's cache on first use) and its vocabulary size."""
    started = time.perf_counter()
    path = resolve_checkpoint(settings.exp_config().model)
    return BenchModel(path, AutoConfig.from_pretrained(path).vocab_size, time.perf_counter() - started)


def worker_main(spec_path: Path) -> None:
    """Run the variant a spec file names and write its result file (status ok / oom / failed)."""
    spec = json.loads(spec_path.read_text())
    settings = Settings(**spec["settings"])
    variant = Variant(**spec["variant"])
    result_path = Path(spec["result_path"])
    row: dict[str, Any] = {"status": "failed"}
    try:
        if variant.side == "exp":
            quiet_third_party_logs()  # as exp.train starts; the baseline keeps the output a plain script has
        model = resolve_model(settings)
        if variant.side == "baseline":
            row.update(run_baseline_worker(settings, variant, model))
        else:
            row.update(run_exp_worker(settings, variant, Path(spec["work_dir"]), model))
        row["status"] = "ok"
    except torch.OutOfMemoryError as e:
        row["status"] = "oom"
        row["error"] = str(e).splitlines()[0]
    finally:
        result_path.write_text(json.dumps(row, default=str) + "\n")
