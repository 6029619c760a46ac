"""The parent's loop: every variant at every micro-batch in a worker process of its own (exp.bench.worker), each row
summarised, compared and written into the result as soon as it is measured."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from exp.bench.report import summarise
from exp.bench.variants import Settings, Variant


def run_variant(settings: Settings, variant: Variant, tmp: Path, logs: Path, index: int) -> dict[str, Any]:
    """Start `python -m exp.bench worker=<spec>` on the variant and read back its row (exp.bench.worker writes it).
    The worker's output goes to `logs/variant-<index>.log`, kept beside the results: a run stopped from outside (a
    time limit) still shows how far each variant got."""
    spec = tmp / f"spec-{index}.json"
    result = tmp / f"result-{index}.json"
    work = tmp / f"work-{index}"
    work.mkdir()
    spec.write_text(
        json.dumps(
            {
                "settings": asdict(settings),
                "variant": asdict(variant),
                "result_path": str(result),
                "work_dir": str(work),
            }
        )
    )
    log_path = logs / f"variant-{index}.log"
    started = time.time()
    with log_path.open("w") as log_file:
        proc = subprocess.run(
            [sys.executable, "-m", "exp.bench", f"worker={spec}"], stdout=log_file, stderr=subprocess.STDOUT
        )
    row: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {"status": "failed"}
    row["wall_s"] = round(time.time() - started, 1)
    if proc.returncode != 0 and row["status"] == "ok":
        row["status"] = "failed"
    if row["status"] == "failed":
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        row["error"] = "\n".join(tail)
        print(f"exp.bench: {variant.name} failed (exit {proc.returncode}); its output ends:", file=sys.stderr)
        print("\n".join("    " + line for line in tail), file=sys.stderr)
    return row


def run_variants(
    report: dict[str, Any],
    base: Settings,
    variants: list[Variant],
    micro_batches: list[int],
    baseline_budget: bool,
    write: Callable[[], None],
    logs: Path,
) -> None:
    """Run `variants` at each of `micro_batches`, appending each row to `report["rows"]` and calling `write` after
    it (an interrupted run keeps what it measured). `baseline_budget`: each exp variant may use the memory the plain
    baseline of its micro-batch peaked at (that baseline then runs first). `logs`: the workers' output."""
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="exp-bench-") as tmp:
        index = 0
        if baseline_budget:  # its peak is the budget of the exp variants: measure it first
            variants.sort(key=lambda v: not v.is_reference)
        for mb in micro_batches:
            settings = Settings(**{**asdict(base), "micro_batch": mb})
            for v in variants:
                if baseline_budget and v.side == "exp":
                    ref = next((r for r in report["rows"] if r["is_reference"] and r["micro_batch"] == mb), None)
                    peak = ref.get("peak_memory_gib") if ref else None
                    if peak is None:  # the CPU measures no peak; a failed baseline has none
                        print(f"exp.bench: no baseline peak for micro-batch {mb}: {v.name} runs without a budget")
                    settings.memory_budget = peak
                row = run_variant(settings, v, Path(tmp), logs, index)
                index += 1
                row = {"variant": v.name, "side": v.side, "micro_batch": mb, "is_reference": v.is_reference, **row}
                summarise(row, settings, report["flops"], report["peak_tflops"])
                report["rows"].append(row)
                write()
                print(
                    f"  {v.name} (micro-batch {mb}): {row['status']}, {row.get('tokens_per_s', '-')} tokens/s, "
                    f"peak {row.get('peak_memory_gib', '-')} GiB, {row['wall_s']} s",
                    flush=True,
                )
