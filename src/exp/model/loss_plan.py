"""Which training loss a config means (`hardware.loss_impl`), decided from the config and the kind of device alone.

The one place that turns `auto` into `hf`, `chunked` or `liger` (for a preference objective, `liger` is
liger-kernel's chunked preference loss, where it computes the objective as exp does: `preference_liger_gap`): the preflight records its answer in the resolved
config, the memory estimate counts the loss it names, and `exp.model.loss.resolve_loss_impl` starts from it,
falling back only for what the loaded model or this process shows (a head that is not a plain Linear,
liger-kernel failing to import). Torch-free.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from exp.core.config import DpoLoss, LossImpl, Objective, TrainConfig
from exp.core.strategies import strategy_traits
from exp.model.families import family_row

# liger's fused loss computes the head's logits and their gradient one chunk of tokens at a time, reading the whole
# [vocab, hidden] head weight twice per chunk. By default it cuts ceil(vocab / hidden) chunks whatever the number of
# tokens (84 for Gemma-7B's 256k vocabulary): on a padding-free step of a few thousand tokens, 84 chunks of 64 tokens,
# matmuls too thin for the tensor cores and 84 x 2 reads of the 1.5 GB head, a cost that does not shrink with the
# step. Chunks whose logits take up to this many bytes instead: about a thousand tokens, a few chunks a step.
LIGER_CHUNK_LOGIT_BYTES = 512 * 2**20


@dataclass(frozen=True)
class LigerChunks:
    """How liger's fused loss cuts `tokens` rows: its `chunk_mem_const` and the chunk length that gives."""

    mem_const: int
    tokens: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def liger_chunks(tokens: int, vocab: int, hidden: int, logit_bytes: int) -> LigerChunks:
    """The `chunk_mem_const` for chunks of at most LIGER_CHUNK_LOGIT_BYTES of logits (`logit_bytes` per entry),
    and the chunk length liger then takes: next_power_of_2(tokens / ceil(vocab / (mem_const x hidden))), at most
    `tokens` (liger_kernel.ops.fused_linear_cross_entropy). The memory estimate counts that chunk."""
    want = max(1, LIGER_CHUNK_LOGIT_BYTES // (logit_bytes * vocab))
    mem_const = max(1, _ceil_div(vocab, hidden * _ceil_div(tokens, want)))
    per_chunk = _ceil_div(tokens, _ceil_div(vocab, mem_const * hidden))
    return LigerChunks(mem_const, min(tokens, 1 << max(0, (per_chunk - 1).bit_length())))


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
    if not strategy_traits(hw.strategy).whole_weights_on_each_rank:
        # The head's weight lives in FSDP's root unit; using it outside the head's forward is not tested.
        return LossChoice(LossImpl.hf, f"hardware.loss_impl={wanted.value} is not used with FSDP (not verified)")
    head = family_row(cfg.model.family).head.name
    if head in lora.target_modules or head in lora.modules_to_save:
        # A trained head is wrapped (LoRA) or copied (modules_to_save): its weight alone is not the head.
        return LossChoice(LossImpl.hf, f"hardware.loss_impl={wanted.value} needs a plain head: {head} is trained")
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
    if not cfg.objective.preference:
        return LossChoice(LossImpl.liger, f"hardware.loss_impl={wanted.value}: liger-kernel fused linear CE")
    if gap := preference_liger_gap(cfg):
        return LossChoice(LossImpl.chunked, f"hardware.loss_impl={wanted.value}: {gap}, so exp's chunked loss")
    kind = cfg.objective.kind.value
    return LossChoice(LossImpl.liger, f"hardware.loss_impl={wanted.value}: liger-kernel's chunked {kind} loss")


def preference_liger_gap(cfg: TrainConfig) -> str | None:
    """Why liger-kernel's chunked preference losses cannot compute this config's objective as exp does (None: they
    can). Their chunk step projects without Gemma 2's final-logit softcap, their DPO has no IPO (it needs each
    completion's length), and their KTO weighs every example alike."""
    o = cfg.objective
    if family_row(cfg.model.family).final_logit_softcapping is not None:
        return f"liger's preference losses do not softcap the final logits ({cfg.model.family.value})"
    if o.kind == Objective.dpo and o.dpo_loss == DpoLoss.ipo:
        return "liger's DPO has no ipo loss"
    if o.kind == Objective.kto and (o.desirable_weight, o.undesirable_weight) != (1.0, 1.0):
        return "liger's KTO has no desirable / undesirable weights"
    return None
