"""Preference-optimisation losses (DPO and its IPO / hinge / robust variants, ORPO, SimPO, KTO) in plain torch.

Each loss works from per-sequence log-probabilities, so a training step runs the policy (and, where the loss has
one, the reference model) over the chosen and rejected completions, reduces each row to its summed or averaged
log-probability over the completion tokens (`sequence_logps`, or `chunked_sequence_logps` from the hidden states
when the full [tokens, vocab] logits would not fit, as for Gemma's 256k vocabulary), and hands those to a loss here.

The losses follow TRL 1.16's definitions term for term, so that a run here and one under TRL's trainers optimise
the same objective and log comparable numbers. They return per-example losses, not their mean: the caller reduces,
which keeps the mean over a batch the same however it is split into micro-batches (each pair's loss depends on that
pair alone; KTO's KL baseline is the one batch-level term). Rewards are detached: they are for logging.

Which log-probabilities each loss takes (TRL's convention, which the results depend on):

* DPO `sigmoid`, `hinge`, `robust` and KTO: summed over the completion tokens (`sequence_logps(...)[0]`);
* DPO `ipo`: averaged per completion token (`average_logps`), policy and reference alike;
* ORPO and SimPO: averaged per completion token, policy only (neither has a reference model).

Labels follow transformers' convention throughout: unshifted, the label at position t + 1 is the target of the
logits at position t, and IGNORE_INDEX (prompt, padding) takes no part.

`fused_pair_loss` and `fused_kto_loss` are the same objectives through liger-kernel's chunked preference losses
(`hardware.loss_impl=liger`, CUDA): from the hidden states before the head, one pair (KTO: one example) of [T, vocab]
logits at a time, the gradient with respect to the hidden states computed in the forward pass. They give the batch's
mean loss and the metrics' inputs, not per-pair losses; where liger's definition is not exp's (ORPO's NLL, KTO's
accuracy) a small subclass of liger's function makes it exp's. exp.model.loss_plan.preference_liger_gap says which
objectives they cover: no final-logit softcap (liger's preference losses do not cap), no IPO, no KTO weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from exp.core.config import Objective, ObjectiveConfig
from exp.core.constants import IGNORE_INDEX

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


# ---------------------------------------------------------------------------------------------------------------------
# Per-sequence log-probabilities
# ---------------------------------------------------------------------------------------------------------------------


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its label tokens under `logits`, and how many label tokens it has.

    `logits` [N, T, V] (any float dtype; the log-softmax is taken in fp32), `labels` [N, T], unshifted. Returns fp32
    sums [N] and int64 counts [N]; a row without a label token sums to 0 with count 0.

    Only the target's log-probability is kept per position (its logit less the logsumexp over the vocabulary), never a
    full fp32 log-softmax; for logits narrower than fp32 the upcast is made one row at a time, in forward and backward.
    """
    _check_labels(logits.shape[:2], labels)
    targets = labels[:, 1:].long()
    mask = targets != IGNORE_INDEX
    logits = logits[:, :-1]
    picked = logits.gather(-1, targets.masked_fill(~mask, 0).unsqueeze(-1)).squeeze(-1).float()
    per_token = torch.where(mask, picked - _RowLogSumExp.apply(logits), 0.0)
    return per_token.sum(-1), mask.sum(-1)


def chunked_sequence_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    softcap: float | None = None,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps(logits, labels)` for logits = hidden @ weight.T (softcapped: softcap * tanh(logits / softcap),
    Gemma 2's final-logit softcap), computed from the hidden states before the head.

    `hidden` [N, T, H], `weight` [V, H] (the head's), `labels` [N, T], unshifted. Only the positions with a target are
    projected, `chunk_tokens` of them at a time, in forward and again in backward: at most one chunk's [chunk, V]
    logits exist at once. The matmul runs in the dtype autocast or the inputs give (as the head would), the softcap
    and log-softmax in fp32. Differentiable with respect to `hidden` and, when it requires grad, `weight`.
    """
    _check_labels(hidden.shape[:2], labels)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    rows, width = hidden.shape[0], hidden.shape[1]
    mask = labels[:, 1:] != IGNORE_INDEX
    row, col = mask.nonzero(as_tuple=True)
    # Position t of a row (t < T - 1) predicts the label at t + 1: select those hidden rows and their targets.
    picked_hidden = hidden.reshape(rows * width, hidden.shape[-1]).index_select(0, row * width + col)
    targets = labels[row, col + 1].long()
    per_token = _ChunkedTargetLogps.apply(picked_hidden, weight, targets, softcap, chunk_tokens)
    # Laid back at their positions, then summed per row: an `index_add` by row adds with atomics on a GPU, in an
    # order that varies from call to call, so the reference's and the policy's sums of the same numbers could part
    # by a last bit (fresh adapters' DPO loss then leaves ln 2). Each position is written once: the same order every
    # call.
    per_position = torch.zeros(rows, width - 1, dtype=torch.float32, device=hidden.device)
    sums = per_position.index_put((row, col), per_token).sum(-1)
    return sums, mask.sum(-1)


def average_logps(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-token average log-probability from `sequence_logps`'s sums and counts (0 for a row without tokens): what
    DPO's `ipo`, ORPO and SimPO take."""
    return sums / counts.clamp(min=1).to(sums.dtype)


def _check_labels(leading: torch.Size, labels: torch.Tensor) -> None:
    if labels.dim() != 2 or labels.shape != leading:
        raise ValueError(f"labels {tuple(labels.shape)} must be [N, T] matching the inputs' {tuple(leading)}")


class _RowLogSumExp(torch.autograd.Function):
    """logsumexp over the last dimension in fp32, one row of `x` [N, T, V] at a time, saving `x` and the result.

    torch.logsumexp of an upcast copy would keep that fp32 copy of every row for backward; here backward rebuilds
    each row's softmax from `x` and the saved result instead.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        for i in range(x.shape[0]):
            out[i] = torch.logsumexp(x[i].float(), dim=-1)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        x, out = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        for i in range(x.shape[0]):
            grad_x[i] = (x[i].float() - out[i, :, None]).exp_().mul_(grad[i, :, None])
        return grad_x


class _ChunkedTargetLogps(torch.autograd.Function):
    """log softmax(z)[target] per row of `hidden` [M, H], z = softcap(hidden @ weight.T), a chunk of rows at a time.

    Forward keeps only the logsumexp per row; backward recomputes each chunk's z. With p = softmax(z), l the raw
    logits and g the incoming gradient per row:
      d/dz = g * (onehot(target) - p),   d/dl = d/dz * (1 - tanh(l / c)^2)  (with a softcap c),
      d/dhidden = d/dl @ weight,   d/dweight = d/dl^T @ hidden.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, softcap, chunk_tokens):
        device_type = hidden.device.type
        compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            z, _ = _chunk_logits(hidden[start:stop], weight, softcap, compute)
            lse[start:stop] = torch.logsumexp(z, dim=-1)
            out[start:stop] = z.gather(1, targets[start:stop, None]).squeeze(1) - lse[start:stop]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.softcap, ctx.chunk_tokens, ctx.compute = softcap, chunk_tokens, compute
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        compute = ctx.compute
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # The head's gradient sums over every chunk: accumulate it in fp32 whatever the weight's dtype.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            stop = start + ctx.chunk_tokens
            h = hidden[start:stop]
            z, tanh = _chunk_logits(h, weight, ctx.softcap, compute)
            g = z.sub_(lse[start:stop, None]).exp_().neg_()  # -p, in place over z
            g.scatter_add_(1, targets[start:stop, None], torch.ones_like(g[:, :1]))
            g.mul_(grad_out[start:stop, None].float())
            if tanh is not None:
                g.mul_(1.0 - tanh * tanh)
            with torch.autocast(h.device.type, enabled=False):
                if want_hidden:
                    grad_hidden[start:stop] = g.to(compute) @ weight.to(compute)
                if want_weight:
                    grad_weight += g.t() @ h.float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None, compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 (softcapped) logits of a chunk, from a matmul in `compute`, and tanh(logits / softcap) when capped."""
    with torch.autocast(hidden.device.type, enabled=False):
        z = (hidden.to(compute) @ weight.to(compute).t()).float()
    if softcap is None:
        return z, None
    tanh = torch.tanh(z / softcap)
    return tanh * softcap, tanh


# ---------------------------------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreferenceLoss:
    """Per-pair losses [B] (not reduced) and the implicit rewards [B] of the chosen and rejected completions
    (detached, for logging)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        """Chosen reward less rejected reward, per pair (`rewards/margins`)."""
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracies(self) -> torch.Tensor:
        """1.0 where the chosen completion has the higher reward, per pair (`rewards/accuracies`)."""
        return (self.chosen_rewards > self.rejected_rewards).float()


@dataclass(frozen=True)
class OddsRatioLoss(PreferenceLoss):
    """ORPO's odds-ratio term per pair, its rewards and, per pair, the log-odds ratio of chosen over rejected and the
    log-odds of the chosen completion itself (all detached but `losses`)."""

    log_odds_ratio: torch.Tensor
    log_odds_chosen: torch.Tensor


@dataclass(frozen=True)
class KTOLoss:
    """KTO's weighted losses, desirable examples first then undesirable ([n_desirable + n_undesirable], not reduced),
    their rewards (each possibly empty; detached) and the KL baseline the rewards were measured against (a scalar)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    kl: torch.Tensor


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """Direct preference optimisation and its variants, per pair, as TRL's DPOTrainer (reverse-KL, one loss type).

    With h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected):

    * `sigmoid` (DPO): -log sigmoid(beta * h);
    * `hinge` (SLiC): relu(1 - beta * h);
    * `ipo` (IPO, beta is its tau): (h - 1 / (2 * beta))^2;
    * `robust` (robust DPO, label_smoothing the probability that a label is flipped, in [0, 0.5)):
      ((1 - eps) * -log sigmoid(beta * h) - eps * -log sigmoid(-beta * h)) / (1 - 2 * eps).

    The inputs are per-sequence log-probabilities of the completions [B]: sums over the completion tokens for
    `sigmoid`, `hinge` and `robust`; per-token averages (`average_logps`) for `ipo`, as TRL normalises IPO by the
    completion length. The rewards are beta * (policy - ref) of what is passed, so for `ipo` they are per token (TRL
    logs the summed ones there). `label_smoothing` enters only `robust`: TRL ignores it for the other types, and a
    value that would silently change nothing is refused here.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"the robust loss needs label_smoothing in [0, 0.5), got {label_smoothing}")
    if loss_type != "robust" and label_smoothing != 0.0:
        raise ValueError(f"label_smoothing={label_smoothing} has no effect on the {loss_type!r} loss; only 'robust'")
    chosen_logratios = policy_chosen - ref_chosen
    rejected_logratios = policy_rejected - ref_rejected
    h = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * h)
        flipped = -label_smoothing * F.logsigmoid(-beta * h)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    return PreferenceLoss(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0 without cancellation: log1p(-exp(x)) far from 0, log(-expm1(x)) near it (the branch
    at -log 2, TRL's form)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, beta: float) -> OddsRatioLoss:
    """ORPO's odds-ratio term per pair, beta * -log sigmoid(log(odds(chosen) / odds(rejected))), odds(y) = P / (1 - P),
    P the per-token average probability exp(avg logp); as TRL's ORPOTrainer (its beta is the paper's lambda).

    Takes per-token average log-probabilities (`average_logps`) of the policy [B], in fp32. The caller adds the mean
    of `losses` to the chosen completions' NLL: TRL returns the negated term (beta * log sigmoid) and subtracts it.
    TRL logs the mean of log sigmoid(log_odds_ratio) as `log_odds_ratio` (= -mean(losses) / beta here) and the mean
    of `log_odds_ratio` as `log_odds_chosen`.
    """
    chosen = chosen_avg_logps.float()
    rejected = rejected_avg_logps.float()
    log_odds_chosen = chosen - log1mexp(chosen)
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return OddsRatioLoss(
        losses=-beta * F.logsigmoid(log_odds),
        chosen_rewards=beta * chosen.detach(),
        rejected_rewards=beta * rejected.detach(),
        log_odds_ratio=log_odds.detach(),
        log_odds_chosen=log_odds_chosen.detach(),
    )


def simpo_loss(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    beta: float,
    gamma_beta_ratio: float,
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """SimPO per pair: -log sigmoid(beta * (chosen - rejected) - gamma), gamma = beta * gamma_beta_ratio the target
    reward margin, smoothed as (1 - eps) * that + eps * -log sigmoid(-(...)); as TRL's CPOTrainer with
    loss_type="simpo" and no behaviour-cloning term (cpo_alpha=0).

    Takes per-token average log-probabilities (`average_logps`) of the policy [B]; there is no reference model. TRL's
    `simpo_gamma` is gamma itself (it divides it by beta), so TRL's simpo_gamma = beta * gamma_beta_ratio here. The
    rewards are beta * the average log-probabilities.
    """
    logits = (chosen_avg_logps - rejected_avg_logps) - gamma_beta_ratio
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    return PreferenceLoss(losses, beta * chosen_avg_logps.detach(), beta * rejected_avg_logps.detach())


def kto_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    kl_policy_logps: torch.Tensor,
    kl_ref_logps: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> KTOLoss:
    """Kahneman-Tversky optimisation as TRL's KTOTrainer (loss_type="kto"), per example.

    chosen / rejected are the batch's desirable / undesirable examples (either may be empty), with r = policy - ref
    summed log-probabilities of their completions. The baseline kl = max(0, mean(kl_policy_logps - kl_ref_logps)),
    detached, estimates KL(policy || ref) from mismatched completions (each prompt with another example's completion,
    summed log-probabilities under policy and reference). Losses: desirable_weight * (1 - sigmoid(beta * (r - kl)))
    for each desirable example, then undesirable_weight * (1 - sigmoid(beta * (kl - r))) for each undesirable one;
    TRL's loss is their plain mean. Under data parallelism TRL averages the per-rank KL means over the ranks before
    the clamp: pass the gathered KL log-probabilities to match it.
    """
    kl = (kl_policy_logps - kl_ref_logps).mean().detach().clamp(min=0)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_losses = 1 - torch.sigmoid(beta * (chosen_logratios - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_logratios))
    return KTOLoss(
        losses=torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0),
        chosen_rewards=beta * chosen_logratios.detach(),
        rejected_rewards=beta * rejected_logratios.detach(),
        kl=kl,
    )


# ---------------------------------------------------------------------------------------------------------------------
# liger-kernel's chunked preference losses (hardware.loss_impl=liger)
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedPairLoss:
    """A paired objective's result through liger: the batch's mean loss (ORPO: with its NLL term; differentiable
    with respect to the hidden states) and, per pair, detached: the rewards, the policy's summed completion
    log-probabilities and, for ORPO, the chosen completion's per-token NLL."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    nll: torch.Tensor | None = None


@dataclass(frozen=True)
class FusedKTOLoss:
    """KTO through liger: the mean loss over the labelled examples and sums over them (detached): the rewards and
    summed log-probabilities of the desirable and of the undesirable ones, and how many are rewarded on the right
    side of 0 (KTO's accuracy)."""

    loss: torch.Tensor
    chosen_rewards_sum: torch.Tensor
    rejected_rewards_sum: torch.Tensor
    chosen_logps_sum: torch.Tensor
    rejected_logps_sum: torch.Tensor
    right: torch.Tensor


def _next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """liger scores position t against target t (no shift): the labels moved left by one, IGNORE_INDEX last, so the
    hidden states go in whole (no copying slice), as exp.model.loss.head_inputs does."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _completion_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != IGNORE_INDEX).sum(-1)


@functools.cache
def _liger_functions() -> dict[str, type]:
    """liger's autograd functions, ORPO's and KTO's made exp's (created once, on first use)."""
    # liger-kernel is the `gpu` extra: imported only when its losses are asked for.
    from liger_kernel.chunked_loss.dpo_loss import LigerFusedLinearDPOFunction
    from liger_kernel.chunked_loss.kto_loss import LigerFusedLinearKTOFunction
    from liger_kernel.chunked_loss.orpo_loss import LigerFusedLinearORPOFunction
    from liger_kernel.chunked_loss.simpo_loss import LigerFusedLinearSimPOFunction

    class PerPairNllORPO(LigerFusedLinearORPOFunction):
        """ORPO with exp's NLL term: the mean over pairs of each chosen completion's per-token mean (`-chosen_logps`,
        liger's per-token averages), so a batch's loss is the same however it is split into micro-batches. liger's
        own NLL (compute_nll_loss) is the token mean over the whole batch's chosen completions."""

        @staticmethod
        def preference_loss_fn(chosen_logps, rejected_logps, full_target, beta=0.1):
            loss, *aux = LigerFusedLinearORPOFunction.preference_loss_fn(
                chosen_logps, rejected_logps, full_target, beta=beta
            )
            return loss - chosen_logps.sum() / (full_target.shape[0] // 2), *aux

    class CountingKTO(LigerFusedLinearKTOFunction):
        """liger's KTO, also counting the examples rewarded on their label's side of 0 (liger returns the rewards
        only as sums)."""

        @staticmethod
        def preference_loss_fn(
            log_prob_chunk, preference_labels_chunk, full_target, ref_log_prob_chunk=None, beta=0.1, kl=None
        ):
            out = LigerFusedLinearKTOFunction.preference_loss_fn(
                log_prob_chunk, preference_labels_chunk, full_target, ref_log_prob_chunk, beta=beta, kl=kl
            )
            rewards = beta * (log_prob_chunk - ref_log_prob_chunk)
            right = torch.where(preference_labels_chunk, rewards > 0, rewards < 0).sum().float()
            return *out, right

    return {
        "dpo": LigerFusedLinearDPOFunction,
        "orpo": PerPairNllORPO,
        "simpo": LigerFusedLinearSimPOFunction,
        "kto": CountingKTO,
    }


def fused_pair_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    o: ObjectiveConfig,
    ref_hidden: torch.Tensor | None = None,
    compiled: bool = True,
) -> FusedPairLoss:
    """DPO (sigmoid, hinge, robust), ORPO or SimPO of a batch of pairs through liger-kernel's chunked losses; the
    same values as `dpo_loss`, `orpo_loss` + NLL and `simpo_loss` of `sequence_logps` over the logits hidden @ weight.T.

    `hidden` [2B, T, H] (the B chosen rows, then the B rejected rows, before the head), `weight` [V, H] (the head's),
    `labels` [2B, T] unshifted; `ref_hidden` the reference's hidden states of the same rows (DPO: the base with the
    adapters off, without gradients; liger projects them with the same head, one chunk at a time beside the
    policy's). `compiled`: liger's torch.compile of its per-chunk step (CUDA; eager elsewhere).
    """
    fns = _liger_functions()
    target = _next_token_targets(labels)
    if o.kind == Objective.dpo:
        if ref_hidden is None:
            raise ValueError("DPO through liger needs the reference's hidden states (ref_hidden)")
        loss, (chosen, rejected, _, _, _, c, r) = fns["dpo"].apply(
            hidden, weight, target, None, ref_hidden, weight, None, IGNORE_INDEX, o.beta, False, compiled, True,
            False, 1, o.dpo_loss.value, o.label_smoothing,
        )  # fmt: skip
        return FusedPairLoss(loss, c.detach(), r.detach(), chosen.detach(), rejected.detach())
    if o.kind == Objective.orpo:
        loss, (chosen, rejected, _, _, _, c, r, _, _) = fns["orpo"].apply(
            hidden, weight, target, None, IGNORE_INDEX, o.beta, False, None, compiled, 1
        )
    elif o.kind == Objective.simpo:
        # liger's gamma is the margin itself; exp's simpo_gamma is the margin over beta (TRL's convention).
        loss, (chosen, rejected, _, _, _, c, r) = fns["simpo"].apply(
            hidden, weight, target, None, IGNORE_INDEX, o.beta, 1.0, o.label_smoothing, False, compiled,
            o.beta * o.simpo_gamma, 1,
        )  # fmt: skip
    else:
        raise ValueError(f"objective {o.kind.value!r} is not a paired objective of liger's")
    # ORPO and SimPO compare per-token averages; the logged log-probabilities are sums, as on the other paths.
    counts = _completion_tokens(labels).to(chosen.dtype)
    half = labels.shape[0] // 2
    return FusedPairLoss(
        loss,
        c.detach(),
        r.detach(),
        (chosen * counts[:half]).detach(),
        (rejected * counts[half:]).detach(),
        -chosen.detach() if o.kind == Objective.orpo else None,
    )


def fused_kto_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    desirable: torch.Tensor,
    ref_hidden: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    compiled: bool = True,
) -> FusedKTOLoss:
    """`kto_loss` (unit weights) over n labelled rows through liger-kernel's chunked KTO loss.

    `hidden` / `ref_hidden` [n, T, H] the policy's and the reference's hidden states of the labelled rows, `labels`
    [n, T] unshifted, `desirable` [n] bool, `kl` the (detached, clamped) KL baseline that `kto_loss` computes from the
    mismatched rows."""
    loss, (cl, rl, _, _, cr, rr, right) = _liger_functions()["kto"].apply(
        hidden, weight, _next_token_targets(labels), desirable, None, ref_hidden, weight, None, kl, IGNORE_INDEX,
        beta, compiled, True, False, 1,
    )  # fmt: skip
    return FusedKTOLoss(loss, cr.detach(), rr.detach(), cl.detach(), rl.detach(), right.detach())
