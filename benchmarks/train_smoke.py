"""Run `python -m exp.train` on a GPU for a few configurations and record tokens/s and peak memory.

    python benchmarks/train_smoke.py --out benchmarks/results [--only gemma_2b]

Each run is the real CLI in a subprocess (the same code path a user gets); its `summary.json` plus the exact
command, the GPU and the library versions go to `<out>/train_<name>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = {
    # The commands of the issue: the synthetic default task (short sequences), 20 optimiser steps.
    "gemma_2b": ["model=gemma_2b", "model.random_init=true", "hardware=gpu", "trainer.max_steps=20"],
    "gemma_7b": ["model=gemma_7b", "model.random_init=true", "hardware=gpu", "trainer.max_steps=20"],
}
COMMON = ["logger=csv", "trainer.warmup_steps=0"]


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "lightning"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "missing"
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--only", nargs="*", default=list(RUNS))
    a = p.parse_args()
    import torch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    for name in a.only:
        run_dir = Path(tempfile.mkdtemp(prefix=f"smoke-{name}-"))
        overrides = RUNS[name] + COMMON
        cmd = [sys.executable, "-m", "exp.train", *overrides, f"hydra.run.dir={run_dir}"]
        started = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        record = {
            "command": "python -m exp.train " + " ".join(shlex.quote(o) for o in overrides),
            "returncode": proc.returncode,
            "wall_s": round(time.time() - started, 1),
            "gpu": gpu,
            "versions": versions(),
            "date": time.strftime("%Y-%m-%d"),
        }
        summary = run_dir / "summary.json"
        if summary.exists():
            record["summary"] = json.loads(summary.read_text())
        else:
            record["stderr_tail"] = proc.stderr[-3000:]
        (out / f"train_{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps({k: record[k] for k in ("command", "returncode", "wall_s")}), flush=True)
        print(json.dumps(record.get("summary", record.get("stderr_tail")), indent=1)[:3000], flush=True)


if __name__ == "__main__":
    main()
