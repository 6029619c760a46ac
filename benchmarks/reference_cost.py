"""What DPO's reference pass costs a training step: one process, the same model and batches, steps with the per-step
reference pass and steps with precomputed reference log-probabilities taken in turn (a busy machine slows both
alike), and the one pass that precomputes them. Prints the medians as JSON.

    python benchmarks/reference_cost.py [overrides...]      # e.g. hardware=gpu model=gemma_2b

The overrides are exp.train's (objective=dpo is added); the tiny model on the CPU by default.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time

import torch

from exp.data.datamodule import build_run_datamodule
from exp.model.build import build_model, build_tokenizer, quiet_third_party_logs
from exp.model.loss import resolve_loss_impl
from exp.run.compose import compose_config
from exp.training.objectives import preference_loss
from exp.training.reference import precompute_reference

ROUNDS = 12


def main(overrides: list[str]) -> dict:
    quiet_third_party_logs()
    cfg = compose_config(["objective=dpo", *overrides])
    device = torch.device("cuda" if cfg.hardware.accelerator.value == "gpu" else "cpu")
    model = build_model(cfg, device)
    impl = resolve_loss_impl(cfg, model, device).impl
    datamodule = build_run_datamodule(cfg, build_tokenizer(cfg.model), 0)
    # bf16 autocast on a GPU, as Lightning's bf16-mixed runs the steps; fp32 on the CPU
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    with autocast:
        record = precompute_reference(model, datamodule, cfg, impl, device)
    batches = iter(datamodule.train_dataloader())
    seconds: dict[str, list[float]] = {"per_step_reference": [], "precomputed_reference": []}
    for i in range(2 * ROUNDS + 2):
        batch = {k: v.to(device) for k, v in next(batches).items()}
        name = "precomputed_reference" if i % 2 else "per_step_reference"
        if name == "per_step_reference":
            batch.pop("ref_logps")
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with autocast:
            loss, _ = preference_loss(model, batch, cfg.objective, impl)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # the first two: warm-up
            seconds[name].append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    medians = {k: round(statistics.median(v), 4) for k, v in seconds.items()}
    return {
        "micro_batch_pairs": cfg.hardware.micro_batch_size,
        "median_step_seconds": medians,
        "saved_share": round(1 - medians["precomputed_reference"] / medians["per_step_reference"], 3),
        "precompute": {**record, "pairs": len(datamodule.train_set) + len(datamodule.val_set)},
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
