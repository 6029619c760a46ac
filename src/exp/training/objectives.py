"""A preference objective's loss and metrics for one batch (`objective=dpo|orpo|simpo|kto`, docs/objectives.md).

One forward pass scores every row of the batch (a pair's chosen rows, then its rejected rows; KTO: the examples,
then the mismatched prompt-completion rows its reference point comes from): each row's summed log-probability of
its completion tokens. The reference model of DPO and KTO is the same 4-bit base, scored with its outputs detached:
no second model in memory. It is the policy's own numeric path with LoRA's contribution switched off
(exp.model.reference: every LoRA layer's A zeroed for the pass, so that fresh adapters give rewards of exactly 0);
when the model holds the frozen copy of a starting adapter (exp.model.build.REFERENCE_ADAPTER,
`objective.reference=start`), the trainable adapter holds that copy's values for the pass instead. A batch that
carries its reference log-probabilities (`ref_logps`, computed once before training: exp.training.reference) skips
the reference pass. The losses themselves are exp.model.preference's, which equal TRL's on the same
log-probabilities (tests/test_preference_loss.py).

Under `hardware.loss_impl=liger` (exp.model.loss_plan chose it: CUDA, and an objective liger computes as exp does)
the policy's and the reference's hidden states go to liger-kernel's chunked preference losses instead
(`fused_preference_loss`): the same loss and metrics without a pass of exp's own over the head.

Metrics, summed so that a split's rates weight every pair alike (`validation_rates` divides by `pairs`): rewards
of chosen and rejected (beta x the policy's log-probability over the reference's; ORPO and SimPO, which have no
reference: beta x the per-token mean log-probability), their margin, preference accuracy (chosen rewarded above
rejected) and the log-probabilities.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from exp.core.config import DpoLoss, LossImpl, Objective, ObjectiveConfig
from exp.model.build import REFERENCE_ADAPTER
from exp.model.loss import head_inputs
from exp.model.preference import (
    average_logps,
    chunked_sequence_logps,
    dpo_loss,
    fused_kto_loss,
    fused_pair_loss,
    kto_loss,
    orpo_loss,
    sequence_logps,
    simpo_loss,
)
from exp.model.reference import reference_pass, start_copy_problem, start_reference_pass

# What the decoder reads of a preference batch: padded rows (attention mask), or flat rows (position ids and
# sequence boundaries, exp.data.preference.collate_flat_preference).
MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def _as_rows(x: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A per-position tensor of the forward ([N, T, ...] or the flat [T, ...]) as the batch's rows: flat rows
    gather each completion's positions (`row_index`), padded rows are themselves."""
    if "row_index" in batch:
        return x.reshape(-1, *x.shape[-1:])[batch["row_index"].to(x.device)]
    return x.reshape(*batch["labels"].shape, -1)


def row_logps(model: nn.Module, batch: dict[str, torch.Tensor], impl: LossImpl) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed completion log-probability and its completion token count (without the full logits
    unless the loss implementation is transformers' own)."""
    if impl == LossImpl.hf:
        logits = _as_rows(model(**_model_inputs(batch), use_cache=False).logits, batch)
        return sequence_logps(logits, batch["labels"].to(logits.device))
    hidden, weight, labels, softcap = _rows_hidden(model, batch)
    return chunked_sequence_logps(hidden, weight, labels, softcap)


def _rows_hidden(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None]:
    """The rows' hidden states before the head [N, T, H], the head's weight, the labels (on the head's device) and
    the final-logit softcap."""
    h = head_inputs(model, _model_inputs(batch))
    return _as_rows(h.hidden, batch), h.weight, batch["labels"].to(h.weight.device), h.softcap


@contextlib.contextmanager
def reference_model(model: nn.Module, graph: bool = False) -> Iterator[None]:
    """The model as the reference: the frozen starting adapter alone when the model holds one, else the base (every
    LoRA A zeroed, exp.model.reference). The starting adapter's values are copied into the trainable adapter for the
    pass (exp.model.reference.start_reference_pass: a compiled layer runs the policy's graph); where that would not
    compute the starting adapter's model (the trainable adapter drops out, or the model is sharded), the starting
    adapter is made the active one instead. The trainable adapter is active again (and trainable) on exit.
    `graph`: the starting adapter's copy requires gradients while it lasts (none ever flows to it), so that a pass
    with gradients on builds an autograd graph as the policy's does (`_reference_grad`)."""
    if REFERENCE_ADAPTER not in model.peft_config:
        with reference_pass(model):
            yield
        return
    active = model.active_adapter
    # FSDP keeps each adapter's tensors as its own shards; the copy is left to the plain models it is tested on.
    if not _sharded(model) and start_copy_problem(model, active, REFERENCE_ADAPTER) is None:
        with start_reference_pass(model, active, REFERENCE_ADAPTER):
            yield
        return
    model.set_adapter(REFERENCE_ADAPTER, inference_mode=not graph)  # freezes every other adapter while it lasts
    try:
        yield
    finally:
        model.set_adapter(active)


def _compiled(model: nn.Module) -> bool:
    """Whether any of the model's modules runs through torch.compile (`Module.compile`, exp.model.build)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def _sharded(model: nn.Module) -> bool:
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def _reference_grad(model: nn.Module) -> bool:
    """Whether the reference pass runs with gradients on (its outputs detached): where the layers are compiled and
    the caller computes gradients, which is where the policy's pass runs its compiled training graph. Not under
    FSDP, whose forward with gradients on prepares a backward (gathering the shards again) that would never come.

    A compiled layer has a graph per grad mode. Without gradients it runs the inference graph, fused otherwise than
    the training graph the policy runs (whose partition keeps what the backward needs), and rounding otherwise: on
    an H100 the Gemma-2B shape started DPO at a loss of 0.684 with its layers compiled and at exactly ln 2 = 0.6931
    eagerly (benchmarks/results/h100_20261207b). With gradients on, the reference runs the policy's
    graph; it runs before the policy's pass, so its saved activations are freed before the policy's are made and the
    step's peak memory is the policy's. Eager layers compute the same numbers in either mode, so they keep
    `torch.no_grad` (no activations kept at all)."""
    return torch.is_grad_enabled() and _compiled(model) and not _sharded(model)


@contextlib.contextmanager
def _reference_forward(model: nn.Module) -> Iterator[None]:
    """Within: a forward of `model` is the reference's, in the grad mode `_reference_grad` picks (the caller detaches
    what it keeps)."""
    graph = _reference_grad(model)
    with torch.set_grad_enabled(graph), reference_model(model, graph):
        yield


def reference_logps(model: nn.Module, batch: dict[str, torch.Tensor], impl: LossImpl) -> torch.Tensor:
    """The rows' log-probabilities under the reference (detached: no gradient flows from them)."""
    with _reference_forward(model):
        return row_logps(model, batch, impl)[0].detach()


def preference_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], o: ObjectiveConfig, impl: LossImpl
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch's mean loss (over its pairs, or KTO's examples) and its metric sums (detached)."""
    # liger's DPO and KTO take the reference's hidden states, not log-probabilities: a batch that carries its
    # precomputed reference goes through exp's chunked path.
    if impl == LossImpl.liger and "ref_logps" not in batch:
        return fused_preference_loss(model, batch, o)
    desirable = batch.get("desirable")
    ref = None
    if o.uses_reference and "ref_logps" not in batch:
        ref = reference_logps(model, batch, impl)  # first: its pass's memory is free before the policy's (above)
    logps, counts = row_logps(model, batch, impl)
    half = logps.shape[0] // 2
    if o.uses_reference:
        ref = batch["ref_logps"].to(logps) if ref is None else ref
    if o.kind == Objective.kto:
        return _kto(logps, ref, desirable.to(logps.device), o, half)
    chosen, rejected = logps[:half], logps[half:]
    # Per-token means: what IPO, ORPO and SimPO compare.
    mean_c, mean_r = average_logps(chosen, counts[:half]), average_logps(rejected, counts[half:])
    sums: dict[str, torch.Tensor] = {}
    if o.kind == Objective.dpo:
        if o.dpo_loss == DpoLoss.ipo:
            ref_c, ref_r = average_logps(ref[:half], counts[:half]), average_logps(ref[half:], counts[half:])
            args = (mean_c, mean_r, ref_c, ref_r)
        else:
            args = (chosen, rejected, ref[:half], ref[half:])
        out = dpo_loss(*args, beta=o.beta, loss_type=o.dpo_loss.value, label_smoothing=o.label_smoothing)
        loss = out.losses.mean()
    elif o.kind == Objective.orpo:
        out = orpo_loss(mean_c, mean_r, beta=o.beta)
        nll = -mean_c  # the chosen completion's per-token NLL, the SFT part of ORPO
        loss = nll.mean() + out.losses.mean()
        sums["nll"] = nll.detach().sum()
    else:
        out = simpo_loss(mean_c, mean_r, beta=o.beta, gamma_beta_ratio=o.simpo_gamma, label_smoothing=o.label_smoothing)
        loss = out.losses.mean()
    c, r = out.chosen_rewards.detach(), out.rejected_rewards.detach()
    sums |= {
        "pairs": torch.tensor(float(half), device=c.device),
        "loss": out.losses.detach().sum() + sums.get("nll", torch.zeros((), device=c.device)),
        "rewards_chosen": c.sum(),
        "rewards_rejected": r.sum(),
        "rewards_margin": (c - r).sum(),
        "accuracy": (c > r).float().sum(),
        "logps_chosen": chosen.detach().sum(),
        "logps_rejected": rejected.detach().sum(),
    }
    return loss, sums


def _hidden(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_rows_hidden` for liger's losses, which have no softcap."""
    hidden, weight, labels, softcap = _rows_hidden(model, batch)
    if softcap is not None:  # the plan never picks liger here (preference_liger_gap): a cap would be dropped
        raise ValueError("liger's preference losses do not softcap the final logits")
    return hidden, weight, labels


def fused_preference_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], o: ObjectiveConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`preference_loss` through liger-kernel's chunked losses (exp.model.preference.fused_pair_loss): the policy's
    hidden states, and the reference's (`reference_model`, detached) where the objective has one."""
    ref = None
    if o.uses_reference:  # first: its pass's memory is free before the policy's (`_reference_grad`)
        with _reference_forward(model):
            ref = _hidden(model, batch)[0].detach()
    hidden, weight, labels = _hidden(model, batch)
    compiled = hidden.device.type == "cuda"  # liger's torch.compile of its chunk step: CUDA; eager on the CPU
    half = labels.shape[0] // 2
    if o.kind == Objective.kto:
        # The reference point from the mismatched rows, as kto_loss computes it (detached: no gradient flows there).
        with torch.no_grad():
            kl_policy = chunked_sequence_logps(hidden[half:].detach(), weight, labels[half:])[0]
            kl_ref = chunked_sequence_logps(ref[half:], weight, labels[half:])[0]
        kl = (kl_policy - kl_ref).mean().clamp(min=0)
        desirable = batch["desirable"].to(hidden.device)
        out = fused_kto_loss(hidden[:half], weight, labels[:half], desirable, ref[:half], kl, o.beta, compiled)
        n = torch.tensor(float(half), device=hidden.device)
        return out.loss, {
            "pairs": n,
            "loss": out.loss.detach() * n,
            "desirable": desirable.sum().float(),
            "rewards_chosen": out.chosen_rewards_sum,
            "rewards_rejected": out.rejected_rewards_sum,
            "accuracy": out.right,
            "logps_chosen": out.chosen_logps_sum,
            "logps_rejected": out.rejected_logps_sum,
        }
    out = fused_pair_loss(hidden, weight, labels, o, ref, compiled)
    c, r = out.chosen_rewards, out.rejected_rewards
    pairs = torch.tensor(float(half), device=c.device)
    sums = {"nll": out.nll.sum()} if out.nll is not None else {}
    return out.loss, sums | {
        "pairs": pairs,
        "loss": out.loss.detach() * pairs,
        "rewards_chosen": c.sum(),
        "rewards_rejected": r.sum(),
        "rewards_margin": (c - r).sum(),
        "accuracy": (c > r).float().sum(),
        "logps_chosen": out.chosen_logps.sum(),
        "logps_rejected": out.rejected_logps.sum(),
    }


def _kto(logps, ref, desirable, o: ObjectiveConfig, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO over a batch's n labelled rows, with the n mismatched rows after them as its reference point."""
    policy, kl_policy = logps[:n], logps[n:]
    ref_rows, kl_ref = ref[:n], ref[n:]
    out = kto_loss(
        policy[desirable], policy[~desirable], ref_rows[desirable], ref_rows[~desirable], kl_policy, kl_ref,
        beta=o.beta, desirable_weight=o.desirable_weight, undesirable_weight=o.undesirable_weight,
    )  # fmt: skip
    c, r = out.chosen_rewards.detach(), out.rejected_rewards.detach()
    zero = torch.zeros((), device=logps.device)
    sums = {
        "pairs": torch.tensor(float(n), device=logps.device),
        "loss": out.losses.detach().sum(),
        "desirable": torch.tensor(float(c.numel()), device=logps.device),
        "rewards_chosen": c.sum() if c.numel() else zero,
        "rewards_rejected": r.sum() if r.numel() else zero,
        # A desirable completion is rewarded above 0, an undesirable one below: KTO's accuracy.
        "accuracy": (c > 0).float().sum() + (r < 0).float().sum(),
        "logps_chosen": policy[desirable].detach().sum(),
        "logps_rejected": policy[~desirable].detach().sum(),
    }
    return out.losses.mean(), sums


def preference_rates(sums: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor | float]:
    """Rates from summed metrics: per pair (KTO: per example; its rewards and log-probs per desirable or
    undesirable example). Tensors in, tensors out (a training step's metrics stay on the device until logged);
    floats in, floats out."""
    s = dict(sums)
    n = _at_least_one(s.get("pairs", 0.0))
    if "desirable" in s:
        good, bad = _at_least_one(s["desirable"]), _at_least_one(s["pairs"] - s["desirable"])
        return {
            "loss": s["loss"] / n,
            "accuracy": s["accuracy"] / n,
            "rewards/chosen": s["rewards_chosen"] / good,
            "rewards/rejected": s["rewards_rejected"] / bad,
            "rewards/margin": s["rewards_chosen"] / good - s["rewards_rejected"] / bad,
            "logps/chosen": s["logps_chosen"] / good,
            "logps/rejected": s["logps_rejected"] / bad,
        }
    out = {
        "loss": s["loss"] / n,
        "accuracy": s["accuracy"] / n,
        "rewards/chosen": s["rewards_chosen"] / n,
        "rewards/rejected": s["rewards_rejected"] / n,
        "rewards/margin": s["rewards_margin"] / n,
        "logps/chosen": s["logps_chosen"] / n,
        "logps/rejected": s["logps_rejected"] / n,
    }
    if "nll" in s:
        out["nll"] = s["nll"] / n
    return out


def preference_split_rates(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """A held-out split's rates from its summed metrics (every batch of every rank), as plain floats: what
    validation logs and `exp.evaluate` reports."""
    return {k: float(v) for k, v in preference_rates(sums).items()}


def _at_least_one(x: torch.Tensor | float) -> torch.Tensor | float:
    """A count to divide by: at least 1 (a split or batch without such examples reads 0, not NaN)."""
    return x.clamp(min=1.0) if isinstance(x, torch.Tensor) else max(float(x), 1.0)
