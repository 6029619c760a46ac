"""Which training loss a config means (`hardware.loss_impl`), decided from the config and the kind of device alone.

The one place that turns `auto` into `hf`, `chunked` or `liger`: the preflight records its answer in the resolved
config, the memory estimate counts the loss it names, and `exp.model.loss.resolve_loss_impl` starts from it,
falling back only for what the loaded model or this process shows (a head that is not a plain Linear,
liger-kernel failing to import). Torch-free.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from exp.core.config import LossImpl, Strategy, TrainConfig


@dataclass(frozen=True)
class LossChoice:
    impl: LossImpl  # hf, chunked or liger: what runs
    reason: str  # why (a fallback names what was missing)


def plan_loss_impl(cfg: TrainConfig, on_cuda: bool) -> LossChoice:
    """What `hardware.loss_impl` becomes on a CUDA device (`on_cuda`) or not, for this config."""
    hw, lora = cfg.hardware, cfg.lora
    wanted = hw.loss_impl
    if wanted == LossImpl.hf:
        return LossChoice(LossImpl.hf, "hardware.loss_impl=hf")
    if hw.strategy == Strategy.fsdp:
        # The head's weight lives in FSDP's root unit; using it outside the head's forward is not tested.
        return LossChoice(LossImpl.hf, f"hardware.loss_impl={wanted.value} is not used with FSDP (not verified)")
    if "lm_head" in lora.target_modules or "lm_head" in lora.modules_to_save:
        # A trained head is wrapped (LoRA) or copied (modules_to_save): its weight alone is not the head.
        return LossChoice(LossImpl.hf, f"hardware.loss_impl={wanted.value} needs a plain head: lm_head is trained")
    if wanted == LossImpl.chunked:
        return LossChoice(LossImpl.chunked, "hardware.loss_impl=chunked")
    if not on_cuda:
        if wanted == LossImpl.liger:
            return LossChoice(LossImpl.chunked, "hardware.loss_impl=liger needs CUDA: chunked instead")
        return LossChoice(LossImpl.hf, "hardware.loss_impl=auto on the CPU: transformers' loss (the reference)")
    if importlib.util.find_spec("liger_kernel") is None:
        return LossChoice(
            LossImpl.chunked, f"hardware.loss_impl={wanted.value}: liger-kernel is not installed, so exp's chunked loss"
        )
    return LossChoice(LossImpl.liger, f"hardware.loss_impl={wanted.value}: liger-kernel fused linear CE")
