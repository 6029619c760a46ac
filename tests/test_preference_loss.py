"""The preference losses of exp.model.preference: each against its paper's formula written out here, against TRL's
own trainers on the same inputs, the per-sequence log-probabilities (plain and chunked) against direct and TRL
computations, and the batch mean's independence of how a batch is split into micro-batches.

Fast: tiny random tensors on the CPU, no model is trained. TRL's losses are methods of its trainers: they are called
on a trainer made without its __init__ (`object.__new__`), given only the attributes the method reads, and, where
the loss sits inside the trainer's forward (DPO, KTO), a bigram "model" that answers the trainer's fused-head call.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from exp.core.constants import IGNORE_INDEX
from exp.model.preference import (
    DPO_LOSS_TYPES,
    average_logps,
    chunked_sequence_logps,
    dpo_loss,
    kto_loss,
    orpo_loss,
    sequence_logps,
    simpo_loss,
)

VOCAB, WIDTH, LENGTH = 48, 8, 12
PAPER = dict(atol=1e-6, rtol=1e-6)  # against the formula, computed in fp64 from the same fp32 inputs
TRL = dict(atol=1e-5, rtol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sums_and_lengths(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of n completions of 1..20 tokens (about -0.2 to -1.7 nats a token)."""
    lengths = torch.randint(1, 21, (n,), generator=gen)
    per_token = -(0.2 + 1.5 * torch.rand(n, generator=gen))
    return per_token * lengths, lengths


def _completions(n: int, gen: torch.Generator, length: int = LENGTH) -> dict[str, torch.Tensor]:
    """n right-padded rows of a prompt (at least one token) and a completion (at least one), as TRL's collators
    give them, with the labels (the completion tokens, IGNORE_INDEX elsewhere) that `sequence_logps` takes."""
    input_ids = torch.randint(0, VOCAB, (n, length), generator=gen)
    prompt = torch.randint(1, length // 2, (n,), generator=gen)
    completion = torch.stack([torch.randint(1, length - int(p) + 1, (1,), generator=gen)[0] for p in prompt])
    t = torch.arange(length)
    completion_mask = ((t >= prompt[:, None]) & (t < (prompt + completion)[:, None])).long()
    attention_mask = (t < (prompt + completion)[:, None]).long()
    labels = input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)
    return dict(input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask, labels=labels)


class _BigramLM:
    """A causal LM small enough to write out: logits = embed[token] @ head.T. Called as TRL's trainers call a
    model with a fused LM head (`labels=..., fused_lm_head=True`), it returns the per-token log-probabilities of the
    next-token labels computed by TRL's own `selective_log_softmax` (0 where the label is IGNORE_INDEX)."""

    training = True

    def __init__(self, gen: torch.Generator) -> None:
        self.embed = torch.randn(VOCAB, WIDTH, generator=gen)
        self.head = torch.randn(VOCAB, WIDTH, generator=gen) / 2

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids] @ self.head.T

    def __call__(self, input_ids, labels, fused_lm_head, attention_mask=None, use_cache=None):
        from trl.trainer.utils import selective_log_softmax

        assert fused_lm_head
        targets = labels[:, 1:]
        mask = targets != IGNORE_INDEX
        log_probs = selective_log_softmax(self.logits(input_ids)[:, :-1], targets.clamp(min=0)).masked_fill(~mask, 0)
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def _trl_trainer(cls: type, model: _BigramLM | None = None, **attrs):
    """A TRL trainer without its __init__, holding just what its loss code reads: one process (gather is identity)."""
    trainer = object.__new__(cls)
    trainer.model = model
    trainer.accelerator = SimpleNamespace(
        device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x
    )
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens = 0
    trainer._tp_size = 1
    trainer.aux_loss_enabled = False
    for name, value in attrs.items():
        setattr(trainer, name, value)
    return trainer


# ---------------------------------------------------------------------------------------------------------------------
# Against the papers' formulas
# ---------------------------------------------------------------------------------------------------------------------


def _neg_log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return -torch.log(torch.sigmoid(x))


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_loss_matches_the_formula(loss_type):
    gen = _gen(0)
    beta = 0.5 if loss_type == "ipo" else 0.1
    eps = 0.1 if loss_type == "robust" else 0.0
    (pc, n_c), (pr, n_r) = _sums_and_lengths(16, gen), _sums_and_lengths(16, gen)
    rc, rr = pc + torch.randn(16, generator=gen), pr + torch.randn(16, generator=gen)
    if loss_type == "ipo":  # per-token averages, policy and reference alike
        out = dpo_loss(*(average_logps(s, n) for s, n in ((pc, n_c), (pr, n_r), (rc, n_c), (rr, n_r))), beta, "ipo")
    else:
        out = dpo_loss(pc, pr, rc, rr, beta, loss_type, label_smoothing=eps)

    d = {k: v.double() for k, v in dict(pc=pc, pr=pr, rc=rc, rr=rr, n_c=n_c, n_r=n_r).items()}
    h = (d["pc"] - d["rc"]) - (d["pr"] - d["rr"])
    if loss_type == "sigmoid":  # Rafailov et al.: -log sigma(beta (log pi/ref (y_w) - log pi/ref (y_l)))
        expected = _neg_log_sigmoid(beta * h)
    elif loss_type == "ipo":  # Azar et al., Eq. 17, on length-normalised log-ratios: (h - 1 / (2 tau))^2
        h_avg = (d["pc"] - d["rc"]) / d["n_c"] - (d["pr"] - d["rr"]) / d["n_r"]
        expected = (h_avg - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":  # max(0, 1 - beta h)
        expected = torch.clamp(1 - beta * h, min=0)
    else:  # robust DPO: the unbiased loss under a label flipped with probability eps
        expected = ((1 - eps) * _neg_log_sigmoid(beta * h) - eps * _neg_log_sigmoid(-beta * h)) / (1 - 2 * eps)
    torch.testing.assert_close(out.losses.double(), expected, **PAPER)
    if loss_type != "ipo":
        torch.testing.assert_close(out.chosen_rewards.double(), beta * (d["pc"] - d["rc"]), **PAPER)
        torch.testing.assert_close(out.rejected_rewards.double(), beta * (d["pr"] - d["rr"]), **PAPER)
    torch.testing.assert_close(out.margins, out.chosen_rewards - out.rejected_rewards)
    assert torch.equal(out.accuracies, (out.chosen_rewards > out.rejected_rewards).float())


def test_dpo_loss_gradient_and_detached_rewards():
    """Rafailov et al.'s gradient: d loss / d log pi(y_w) = -beta sigma(-beta h) = -d loss / d log pi(y_l)."""
    gen = _gen(1)
    pc, pr = (_sums_and_lengths(8, gen)[0].requires_grad_() for _ in range(2))
    rc, rr = pc.detach() + torch.randn(8, generator=gen), pr.detach() + torch.randn(8, generator=gen)
    out = dpo_loss(pc, pr, rc, rr, beta=0.2)
    out.losses.sum().backward()
    h = (pc - rc) - (pr - rr)
    torch.testing.assert_close(pc.grad, -0.2 * torch.sigmoid(-0.2 * h.detach()))
    torch.testing.assert_close(pr.grad, 0.2 * torch.sigmoid(-0.2 * h.detach()))
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad


def test_dpo_loss_refuses_what_it_would_ignore():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(x, x, x, x, 0.1, "exo_pair")
    with pytest.raises(ValueError, match="no effect"):
        dpo_loss(x, x, x, x, 0.1, "sigmoid", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        dpo_loss(x, x, x, x, 0.1, "robust", label_smoothing=0.5)


def test_orpo_loss_matches_the_formula():
    """Hong et al.: L_OR = -log sigma(log(odds(y_w) / odds(y_l))), odds(y) = P(y) / (1 - P(y)), P the per-token average
    probability; the returned term is lambda (TRL's beta) times it."""
    gen = _gen(2)
    (cs, n_c), (rs, n_r) = _sums_and_lengths(16, gen), _sums_and_lengths(16, gen)
    beta = 0.25
    out = orpo_loss(average_logps(cs, n_c), average_logps(rs, n_r), beta)

    p_c, p_r = torch.exp(cs.double() / n_c), torch.exp(rs.double() / n_r)
    odds_c, odds_r = p_c / (1 - p_c), p_r / (1 - p_r)
    torch.testing.assert_close(out.losses.double(), beta * _neg_log_sigmoid(torch.log(odds_c / odds_r)), **PAPER)
    torch.testing.assert_close(out.log_odds_ratio.double(), torch.log(odds_c / odds_r), **PAPER)
    torch.testing.assert_close(out.log_odds_chosen.double(), torch.log(odds_c), **PAPER)
    torch.testing.assert_close(out.chosen_rewards.double(), beta * cs.double() / n_c, **PAPER)
    torch.testing.assert_close(out.rejected_rewards.double(), beta * rs.double() / n_r, **PAPER)


def test_orpo_loss_is_finite_near_probability_one():
    """log(1 - exp(x)) loses everything to cancellation as x -> 0 unless computed as log(-expm1(x))."""
    chosen = torch.tensor([-1e-6, -1e-3], requires_grad=True)
    out = orpo_loss(chosen, torch.tensor([-2.0, -2.0]), beta=0.1)
    out.losses.sum().backward()
    assert torch.isfinite(out.losses).all() and torch.isfinite(chosen.grad).all()
    x = chosen.detach().double()
    torch.testing.assert_close(out.log_odds_chosen.double(), x - torch.log(-torch.expm1(x)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_loss_matches_the_formula(label_smoothing):
    """Meng et al.: -log sigma(beta / |y_w| log pi(y_w) - beta / |y_l| log pi(y_l) - gamma), smoothed as in CPO."""
    gen = _gen(3)
    (cs, n_c), (rs, n_r) = _sums_and_lengths(16, gen), _sums_and_lengths(16, gen)
    beta, gamma_beta_ratio = 2.0, 0.3
    out = simpo_loss(average_logps(cs, n_c), average_logps(rs, n_r), beta, gamma_beta_ratio, label_smoothing)

    gamma = beta * gamma_beta_ratio
    x = beta * cs.double() / n_c - beta * rs.double() / n_r - gamma
    expected = (1 - label_smoothing) * _neg_log_sigmoid(x) + label_smoothing * _neg_log_sigmoid(-x)
    torch.testing.assert_close(out.losses.double(), expected, **PAPER)
    torch.testing.assert_close(out.chosen_rewards.double(), beta * cs.double() / n_c, **PAPER)
    torch.testing.assert_close(out.rejected_rewards.double(), beta * rs.double() / n_r, **PAPER)


@pytest.mark.parametrize("kl_shift", [-3.0, 3.0], ids=["kl-clamped", "kl-positive"])
def test_kto_loss_matches_the_formula(kl_shift):
    """Ethayarajh et al.: loss = lambda_y - v(x, y), v = lambda_D sigma(beta (r - z0)) for a desirable y and
    lambda_U sigma(beta (z0 - r)) for an undesirable one, r = log pi/ref (y | x), z0 = max(0, KL estimate) detached."""
    gen = _gen(4)
    chosen, rejected = _sums_and_lengths(5, gen)[0], _sums_and_lengths(3, gen)[0]
    ref_chosen, ref_rejected = chosen + torch.randn(5, generator=gen), rejected + torch.randn(3, generator=gen)
    kl_policy = _sums_and_lengths(8, gen)[0].requires_grad_()
    kl_ref = kl_policy.detach() - kl_shift + torch.randn(8, generator=gen)
    chosen.requires_grad_()
    beta, lam_d, lam_u = 0.3, 1.5, 0.7
    out = kto_loss(chosen, rejected, ref_chosen, ref_rejected, kl_policy, kl_ref, beta, lam_d, lam_u)

    z0 = torch.clamp((kl_policy.detach().double() - kl_ref.double()).mean(), min=0)
    assert (z0 == 0) == (kl_shift < 0)
    r_d, r_u = chosen.detach().double() - ref_chosen.double(), rejected.double() - ref_rejected.double()
    expected = torch.cat(
        (lam_d - lam_d * torch.sigmoid(beta * (r_d - z0)), lam_u - lam_u * torch.sigmoid(beta * (z0 - r_u)))
    )
    torch.testing.assert_close(out.losses.double(), expected, **PAPER)
    torch.testing.assert_close(out.kl.double(), z0, **PAPER)
    torch.testing.assert_close(out.chosen_rewards.double(), beta * r_d, **PAPER)
    torch.testing.assert_close(out.rejected_rewards.double(), beta * r_u, **PAPER)
    out.losses.sum().backward()
    assert chosen.grad is not None and kl_policy.grad is None  # the baseline takes no gradient


def test_kto_loss_takes_a_batch_of_one_kind():
    gen = _gen(5)
    chosen = _sums_and_lengths(4, gen)[0]
    empty = torch.zeros(0)
    kl = _sums_and_lengths(4, gen)[0]
    out = kto_loss(chosen, empty, chosen - 1.0, empty, kl, kl - 0.5, beta=0.1, undesirable_weight=2.0)
    assert out.losses.shape == (4,) and out.rejected_rewards.shape == (0,)
    torch.testing.assert_close(out.losses, 1 - torch.sigmoid(0.1 * (torch.ones(4) - 0.5)))


# ---------------------------------------------------------------------------------------------------------------------
# Against TRL
# ---------------------------------------------------------------------------------------------------------------------


def _trl_dpo(model, batch, ref_chosen, ref_rejected, beta, loss_type, label_smoothing):
    from trl import DPOTrainer

    trainer = _trl_trainer(
        DPOTrainer,
        model,
        beta=beta,
        loss_types=[loss_type],
        loss_weights=[1.0],
        label_smoothing=label_smoothing,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        use_weighting=False,
    )
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "completion_mask")}
    inputs.update(ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected)
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    return loss, trainer._metrics["train"]


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_loss_matches_trl(loss_type):
    pytest.importorskip("trl")
    gen = _gen(6)
    model, pairs = _BigramLM(gen), 3
    batch = _completions(2 * pairs, gen)  # TRL's layout: the chosen rows, then the rejected ones
    ref = _sums_and_lengths(2 * pairs, gen)[0]
    beta, eps = 0.1, (0.2 if loss_type == "robust" else 0.0)

    sums, counts = sequence_logps(model.logits(batch["input_ids"]), batch["labels"])
    logps = average_logps(sums, counts) if loss_type == "ipo" else sums
    ref_logps = average_logps(ref, counts) if loss_type == "ipo" else ref
    out = dpo_loss(*logps.chunk(2), *ref_logps.chunk(2), beta, loss_type, eps)

    trl_mean, _ = _trl_dpo(model, batch, *ref.chunk(2), beta, loss_type, eps)
    torch.testing.assert_close(out.losses.mean(), trl_mean, **TRL)
    for i in range(pairs):  # one pair a batch: its own loss and rewards
        rows = [i, pairs + i]
        pair = {k: v[rows] for k, v in batch.items()}
        trl_loss, metrics = _trl_dpo(model, pair, ref[i : i + 1], ref[pairs + i : pairs + i + 1], beta, loss_type, eps)
        torch.testing.assert_close(out.losses[i], trl_loss, **TRL)
        # TRL logs summed-logp rewards whatever the loss type; ipo's here are per token.
        scale = counts[rows].float() if loss_type == "ipo" else torch.ones(2)
        trl_rewards = torch.tensor([metrics["rewards/chosen"][-1], metrics["rewards/rejected"][-1]])
        ours = torch.stack([out.chosen_rewards[i], out.rejected_rewards[i]]) * scale
        torch.testing.assert_close(ours, trl_rewards, **TRL)


def test_orpo_loss_matches_trl():
    pytest.importorskip("trl")
    from trl.experimental.orpo import ORPOTrainer

    gen = _gen(7)
    (cs, n_c), (rs, n_r) = _sums_and_lengths(16, gen), _sums_and_lengths(16, gen)
    chosen, rejected = average_logps(cs, n_c), average_logps(rs, n_r)
    beta = 0.1
    out = orpo_loss(chosen, rejected, beta)
    trainer = _trl_trainer(ORPOTrainer, beta=beta)
    losses, chosen_rewards, rejected_rewards, mean_ratio, mean_log_odds = trainer.odds_ratio_loss(chosen, rejected)
    torch.testing.assert_close(out.losses, -losses, **TRL)  # TRL's term is negated: its loss is nll - mean
    torch.testing.assert_close(out.chosen_rewards, chosen_rewards, **TRL)
    torch.testing.assert_close(out.rejected_rewards, rejected_rewards, **TRL)
    torch.testing.assert_close(-out.losses.mean() / beta, mean_ratio, **TRL)  # TRL's `log_odds_ratio`
    torch.testing.assert_close(out.log_odds_ratio.mean(), mean_log_odds, **TRL)  # TRL's `log_odds_chosen`


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_loss_matches_trl(label_smoothing):
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer

    gen = _gen(8)
    (cs, n_c), (rs, n_r) = _sums_and_lengths(16, gen), _sums_and_lengths(16, gen)
    chosen, rejected = average_logps(cs, n_c), average_logps(rs, n_r)
    beta, gamma_beta_ratio = 2.0, 0.25
    out = simpo_loss(chosen, rejected, beta, gamma_beta_ratio, label_smoothing)
    trainer = _trl_trainer(
        CPOTrainer,
        beta=beta,
        loss_type="simpo",
        simpo_gamma=beta * gamma_beta_ratio,  # TRL's simpo_gamma is the margin gamma itself
        label_smoothing=label_smoothing,
        alpha=0.0,
    )
    losses, chosen_rewards, rejected_rewards = trainer.cpo_loss(chosen, rejected)
    torch.testing.assert_close(out.losses, losses, **TRL)
    torch.testing.assert_close(out.chosen_rewards, chosen_rewards, **TRL)
    torch.testing.assert_close(out.rejected_rewards, rejected_rewards, **TRL)


def _trl_kto(model, batch, kl_batch, is_desirable, ref_logps, ref_kl_logps, beta, lam_d, lam_u):
    from trl import KTOTrainer

    trainer = _trl_trainer(
        KTOTrainer,
        model,
        beta=beta,
        loss_type="kto",
        desirable_weight=lam_d,
        undesirable_weight=lam_u,
        calculate_KL=True,
        precompute_ref_logps=True,
    )
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "completion_mask")}
    inputs.update({f"KL_{k}": kl_batch[k] for k in ("input_ids", "attention_mask", "completion_mask")})
    inputs.update(label=is_desirable, ref_logps=ref_logps, ref_KL_logps=ref_kl_logps)
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    return loss, trainer._metrics["train"]


@pytest.mark.parametrize(
    ("labels", "weights", "kl_shift"),
    [
        ([1, 0, 1, 1, 0], (1.0, 1.0), 2.0),
        ([0, 1, 0, 0, 1], (1.5, 0.7), -2.0),  # the KL estimate is negative: clamped to 0
        ([1, 1, 1, 1, 1], (1.0, 1.3), 2.0),  # no undesirable example
    ],
    ids=["mixed", "weighted-kl-clamped", "all-desirable"],
)
def test_kto_loss_matches_trl(labels, weights, kl_shift):
    pytest.importorskip("trl")
    gen = _gen(9)
    model = _BigramLM(gen)
    n = len(labels)
    batch, kl_batch = _completions(n, gen), _completions(n, gen)
    is_desirable = torch.tensor(labels, dtype=torch.bool)
    sums = sequence_logps(model.logits(batch["input_ids"]), batch["labels"])[0]
    kl_sums = sequence_logps(model.logits(kl_batch["input_ids"]), kl_batch["labels"])[0]
    ref = sums + torch.randn(n, generator=gen)
    ref_kl = kl_sums - kl_shift + torch.randn(n, generator=gen)
    beta = 0.2
    out = kto_loss(
        sums[is_desirable], sums[~is_desirable], ref[is_desirable], ref[~is_desirable], kl_sums, ref_kl, beta, *weights
    )
    assert (out.kl == 0) == (kl_shift < 0)

    trl_mean, metrics = _trl_kto(model, batch, kl_batch, is_desirable, ref, ref_kl, beta, *weights)
    torch.testing.assert_close(out.losses.mean(), trl_mean, **TRL)
    torch.testing.assert_close(out.kl, torch.tensor(metrics["kl"][-1]), **TRL)
    torch.testing.assert_close(out.chosen_rewards.mean(), torch.tensor(metrics["rewards/chosen"][-1]), **TRL)
    if not is_desirable.all():
        torch.testing.assert_close(out.rejected_rewards.mean(), torch.tensor(metrics["rewards/rejected"][-1]), **TRL)
    # One example a batch, against the whole batch's KL completions: each example's own (weighted) loss.
    order = torch.cat((is_desirable.nonzero(), (~is_desirable).nonzero())).squeeze(1)
    for position, i in enumerate(order.tolist()):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        trl_loss, _ = _trl_kto(model, one, kl_batch, is_desirable[i : i + 1], ref[i : i + 1], ref_kl, beta, *weights)
        torch.testing.assert_close(out.losses[position], trl_loss, **TRL)


# ---------------------------------------------------------------------------------------------------------------------
# Per-sequence log-probabilities
# ---------------------------------------------------------------------------------------------------------------------


def test_sequence_logps_matches_trl():
    pytest.importorskip("trl")
    from trl.experimental.orpo import ORPOTrainer
    from trl.trainer.utils import selective_log_softmax

    gen = _gen(10)
    batch = _completions(6, gen)
    logits = 3 * torch.randn(6, LENGTH, VOCAB, generator=gen)
    sums, counts = sequence_logps(logits, batch["labels"])
    torch.testing.assert_close(sums, ORPOTrainer.get_batch_logps(logits, batch["labels"]), **TRL)
    torch.testing.assert_close(
        average_logps(sums, counts), ORPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True), **TRL
    )
    assert torch.equal(counts, batch["completion_mask"][:, 1:].sum(-1))
    targets = batch["labels"][:, 1:]
    per_token = selective_log_softmax(logits[:, :-1], targets.clamp(min=0))
    torch.testing.assert_close(sums, (per_token * (targets != IGNORE_INDEX)).sum(-1), **TRL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequence_logps_matches_log_softmax_and_gather(dtype):
    """Values and gradients of the fp32 log-softmax + gather it stands for, whatever the logits' dtype."""
    gen = _gen(11)
    labels = _completions(4, gen)["labels"]
    labels[2] = IGNORE_INDEX  # a row without a target
    base = 3 * torch.randn(4, LENGTH, VOCAB, generator=gen)
    upstream = torch.randn(4, generator=gen)
    ours_leaf, naive_leaf = (base.to(dtype).requires_grad_() for _ in range(2))

    sums, counts = sequence_logps(ours_leaf, labels)
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    per_token = naive_leaf[:, :-1].float().log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    naive = (per_token * mask).sum(-1)
    (sums * upstream).sum().backward()
    (naive * upstream).sum().backward()

    assert sums.dtype == torch.float32 and sums[2] == 0 and counts[2] == 0
    assert torch.equal(counts, mask.sum(-1))
    torch.testing.assert_close(sums, naive, atol=1e-5, rtol=1e-6)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(ours_leaf.grad, naive_leaf.grad, **tol)


def _hidden_case(gen: torch.Generator):
    """3 rows of 11 positions, targets at 8 + 0 + 7 = 15 of them (row 1 has none): chunks of 4 leave a remainder."""
    hidden = torch.randn(3, 11, 16, generator=gen)
    weight = torch.randn(VOCAB, 16, generator=gen) / 2
    labels = torch.randint(0, VOCAB, (3, 11), generator=gen)
    labels[0, :3] = IGNORE_INDEX
    labels[1] = IGNORE_INDEX
    labels[2, :2] = IGNORE_INDEX
    labels[2, -2:] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
def test_chunked_sequence_logps_matches_the_full_logits(softcap):
    gen = _gen(12)
    hidden, weight, labels = _hidden_case(gen)
    chunk = 4
    targets = int((labels[:, 1:] != IGNORE_INDEX).sum())
    assert chunk < targets and targets % chunk != 0 and chunk < labels.numel()
    upstream = torch.randn(3, generator=gen)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    sums, counts = chunked_sequence_logps(h1, w1, labels, softcap=softcap, chunk_tokens=chunk)
    (sums * upstream).sum().backward()

    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h2 @ w2.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ref_sums, ref_counts = sequence_logps(logits, labels)
    (ref_sums * upstream).sum().backward()

    assert torch.equal(counts, ref_counts) and counts[1] == 0 and sums[1] == 0
    torch.testing.assert_close(sums, ref_sums, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-5)
    # A position takes gradient exactly when the next label is a target: none in row 1, nor at any row's end.
    assert h1.grad[1].abs().sum() == 0 and h1.grad[:, -1].abs().sum() == 0 and h1.grad[0, :2].abs().sum() == 0
    assert (h1.grad[0, 2:-1].abs().sum(-1) > 0).all()


def test_chunked_sequence_logps_matches_trl_kernel():
    """TRL's own chunked log-probabilities from hidden states (its fused LM head's kernel), with Gemma's softcap."""
    pytest.importorskip("trl")
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    gen = _gen(13)
    hidden, weight, labels = _hidden_case(gen)
    sums, _ = chunked_sequence_logps(hidden, weight, labels, softcap=5.0, chunk_tokens=4)
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    per_token = ChunkedLogProbFunction.apply(
        hidden[:, :-1][mask], weight, None, targets[mask], 1.0, 16, 5.0, 1.0, ("log_probs",)
    )[0]
    trl_sums = torch.zeros(3).index_add(0, mask.nonzero()[:, 0], per_token)
    torch.testing.assert_close(sums, trl_sums, **TRL)


def test_chunked_sequence_logps_follows_autocast():
    """Under autocast the head's matmul runs in the autocast dtype, in backward as in forward, as the head would."""
    gen = _gen(14)
    hidden, weight, labels = _hidden_case(gen)
    h1 = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sums, _ = chunked_sequence_logps(h1, weight, labels, softcap=5.0, chunk_tokens=4)
    sums.sum().backward()
    h2 = hidden.bfloat16().requires_grad_()
    ref, _ = chunked_sequence_logps(h2, weight.bfloat16(), labels, softcap=5.0, chunk_tokens=4)
    ref.sum().backward()
    full, _ = chunked_sequence_logps(hidden, weight, labels, softcap=5.0, chunk_tokens=4)

    assert h1.grad.dtype == torch.float32
    torch.testing.assert_close(sums, ref)
    torch.testing.assert_close(h1.grad, h2.grad.float())
    assert not torch.allclose(sums, full, atol=1e-6, rtol=0)  # it did run in bf16


# ---------------------------------------------------------------------------------------------------------------------
# Micro-batches
# ---------------------------------------------------------------------------------------------------------------------


def _pair_losses(name: str, model: _BigramLM, batch: dict[str, torch.Tensor], ref: torch.Tensor) -> torch.Tensor:
    sums, counts = sequence_logps(model.logits(batch["input_ids"]), batch["labels"])
    avg = average_logps(sums, counts)
    if name == "orpo":
        return orpo_loss(*avg.chunk(2), beta=0.1).losses
    if name == "simpo":
        return simpo_loss(*avg.chunk(2), beta=2.0, gamma_beta_ratio=0.25).losses
    if name == "ipo":
        return dpo_loss(*avg.chunk(2), *average_logps(ref, counts).chunk(2), beta=0.5, loss_type="ipo").losses
    eps = 0.1 if name == "robust" else 0.0
    return dpo_loss(*sums.chunk(2), *ref.chunk(2), beta=0.1, loss_type=name, label_smoothing=eps).losses


@pytest.mark.parametrize("name", [*DPO_LOSS_TYPES, "orpo", "simpo"])
def test_mean_loss_is_the_same_over_micro_batches(name):
    """The batch's mean per-pair loss equals the pair-weighted sum of its micro-batches' means, each micro-batch
    padded only to its own longest row (as a collator pads it)."""
    gen = _gen(15)
    model, pairs = _BigramLM(gen), 6
    batch = _completions(2 * pairs, gen, length=16)
    ref = _sums_and_lengths(2 * pairs, gen)[0]
    whole = _pair_losses(name, model, batch, ref).mean()

    total, widths = torch.zeros(()), []
    for start, stop in ((0, 2), (2, 5), (5, 6)):
        rows = [*range(start, stop), *range(pairs + start, pairs + stop)]
        widths.append(int(batch["attention_mask"][rows].sum(-1).max()))
        micro = {k: v[rows, : widths[-1]] for k, v in batch.items()}
        total = total + (stop - start) * _pair_losses(name, model, micro, ref[rows]).mean()
    assert min(widths) < batch["input_ids"].shape[1]  # some micro-batch is padded less than the whole batch
    torch.testing.assert_close(total / pairs, whole, atol=1e-6, rtol=1e-6)
