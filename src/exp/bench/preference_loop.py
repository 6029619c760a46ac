"""The hand-written preference step of `exp.bench objective=dpo|orpo`: the DPO and ORPO losses as users write them
around transformers + PEFT (the loop itself, model and optimiser, is exp.bench.baseline_loop's).

Each step's batch is a micro-batch of pairs as exp collates them (the chosen rows, then the rejected rows, padded on
the right, labels IGNORE over the prompt and padding). The step runs what the DPO paper's reference code and the
common tutorials run:

* one forward of all 2B rows through the PEFT model, the full [2B, T, vocab] logits, `log_softmax` over them and a
  gather of each label's log-probability, summed over the completion tokens;
* DPO: the reference is the same model with the adapters off, `with model.disable_adapter(): with torch.no_grad():`
  the same forward again; loss = mean over pairs of -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)));
* ORPO (no reference): per-token mean log-probabilities; loss = the chosen completions' NLL + beta x the
  odds-ratio term -log sigmoid(log odds(chosen) - log odds(rejected)), averaged over pairs.

The NLL term is the mean over pairs of each chosen completion's per-token NLL, exp's definition (docs/objectives.md),
so that both sides optimise the same objective and their per-step losses compare; TRL's ORPOTrainer takes the
token mean over the batch's chosen completions instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

IGNORE = -100


def batch_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its label tokens and how many there are (the DPO reference code's
    `_get_batch_logps`)."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    mask = labels != IGNORE
    labels[~mask] = 0
    per_token = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    return (per_token * mask).sum(-1), mask.sum(-1)


def _forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return batch_logps(logits, batch["labels"])


def dpo_step_loss(beta: float) -> Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]:
    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        n = batch["input_ids"].shape[0] // 2
        logps, _ = _forward(model, batch)
        with model.disable_adapter(), torch.no_grad():
            ref, _ = _forward(model, batch)
        margin = (logps[:n] - ref[:n]) - (logps[n:] - ref[n:])
        return -F.logsigmoid(beta * margin).mean()

    return loss


def orpo_step_loss(beta: float) -> Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]:
    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        n = batch["input_ids"].shape[0] // 2
        logps, counts = _forward(model, batch)
        mean = logps / counts
        chosen, rejected = mean[:n], mean[n:]
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        return -chosen.mean() - beta * F.logsigmoid(log_odds).mean()

    return loss


STEP_LOSSES = {"dpo": dpo_step_loss, "orpo": orpo_step_loss}
