"""Faults during training, turned into one clear message each: NaN/Inf steps and running out of GPU memory."""

from __future__ import annotations

import torch

from exp.core.config import TrainConfig
from exp.core.strategies import strategy_traits
from exp.hardware.memory import estimate_for_config, suggest_micro_batch


class TrainingFault(RuntimeError):
    """Training stopped for a reason the message explains; the CLI prints it without a traceback."""


class NonFiniteError(TrainingFault):
    """The loss or the gradients of an optimiser step were NaN/Inf (and the run was told to stop)."""


class OutOfMemory(TrainingFault):
    """The GPU ran out of memory; the message holds the estimate's breakdown and what to change."""


def oom_diagnosis(cfg: TrainConfig, device: torch.device, step: int) -> OutOfMemory:
    """What ran out, what the estimator expected, and concrete changes that fit (smallest change first)."""

    hw, d = cfg.hardware, cfg.data
    strategy = strategy_traits(hw.strategy)
    shards = strategy.weight_shards(hw.devices)
    estimate = estimate_for_config(cfg, num_shards=shards)
    lines = [f"CUDA out of memory at step {step} on {device}."]
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        peak = torch.cuda.max_memory_allocated(device)
        lines.append(
            f"Device memory {total / 2**30:.1f} GiB; peak allocated before the failure {peak / 2**30:.1f} GiB."
        )
        budget = int(total * 0.9)  # headroom for the allocator's fragmentation and the CUDA context
    else:
        budget = 0
    lines.append(
        f"exp's estimate for this config ({estimate.total / 2**30:.1f} GiB per device):\n{estimate.as_table()}"
    )
    fixes = []
    fits = suggest_micro_batch(cfg, budget, num_shards=shards) if budget else 0
    if hw.micro_batch_size > 1:
        smaller = fits if 0 < fits < hw.micro_batch_size else max(1, hw.micro_batch_size // 2)
        fixes.append(
            f"hardware.micro_batch_size={smaller} (trainer.global_batch_size={cfg.trainer.global_batch_size} stays: "
            "more accumulation, the same optimisation)"
        )
    if not hw.gradient_checkpointing:
        fixes.append("hardware.gradient_checkpointing=true (recompute activations in the backward pass)")
    elif hw.checkpoint_layers is not None:
        layers = cfg.model.arch.get("num_hidden_layers", "all")
        fixes.append(
            f"hardware.checkpoint_layers={layers} (only {hw.checkpoint_layers} decoder layers recompute now; an explicit "
            "value is kept by the preflight)"
        )
    fixes.append(f"a shorter data.max_seq_len (now {d.max_seq_len}; activations and logits grow with it)")
    if strategy.data_parallel and strategy.whole_weights_on_each_rank:  # a whole replica per GPU, several GPUs
        fixes.append("hardware=fsdp (shard the 4-bit weights instead of a full replica per GPU)")
    lines.append("Fix, any of: " + "; ".join(fixes) + ". `python -m exp.doctor <same overrides>` checks a config.")
    return OutOfMemory("\n".join(lines))
