"""Validation and evaluation metrics of a causal LM over the response tokens, summed per batch.

`response_metrics` scores a batch from its full [batch, seq, vocab] logits. For Gemma's 256k vocabulary those logits,
their fp32 copy and the log-softmax take ~10 bytes per token and vocabulary entry: 10 GiB for one 8 x 512 batch,
more than a memory-bounded training step holds at its peak. So wherever the training loss works from the hidden
states (`hardware.loss_impl` chunked / liger), the metrics do too (`chunked_response_metrics`): the head's matmul
one chunk of tokens at a time, the same chunk as the chunked loss, so the memory estimate of the training step
bounds validation as well.

The sums of a split's batches (`add_sums`, and over the ranks) become its means in one place, `validation_rates`:
training's validation logs them as `val/*`, `exp.evaluate` reports them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exp.core.config import LossImpl
from exp.core.constants import CHUNK_LOGIT_BYTES, IGNORE_INDEX
from exp.model.loss import head_inputs


def response_metrics(logits: torch.Tensor, labels: torch.Tensor, examples: torch.Tensor) -> dict[str, torch.Tensor]:
    """Summed loss, token hits and exact matches over loss-bearing (response) tokens of a batch.

    Sums, not means, so that metrics over a whole split weight every token (and every example) equally.
    Exact match is teacher-forced: every response token (and `<eos>`) is the arg-max, which is exactly when
    greedy decoding reproduces the reference answer. `examples`: `example_ids` of the batch.
    """
    targets = next_tokens(labels)
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    mask = targets != IGNORE_INDEX
    loss_sum = F.cross_entropy(flat_logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    hits = (flat_logits.argmax(-1) == targets) & mask
    return _sums(loss_sum, hits, mask, examples)


def next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts (the next one; IGNORE_INDEX at a row's end), rows flattened."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)


def example_ids(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which example each position of `batch` belongs to, rows flattened: its row in a padded batch; in a
    padding-free row (`position_ids`, no `attention_mask`) the number of position restarts before it, less one. A
    row's padding tail restarts too and forms an "example" with no loss token, which no metric counts."""
    labels = batch["labels"]
    if "position_ids" in batch and "attention_mask" not in batch:
        return (batch["position_ids"].reshape(-1) == 0).cumsum(0) - 1
    return torch.arange(labels.shape[0], device=labels.device).repeat_interleave(labels.shape[1])


def chunked_response_metrics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    examples: torch.Tensor,
    softcap: float | None = None,
    chunk_tokens: int | None = None,
) -> dict[str, torch.Tensor]:
    """`response_metrics` from the head's input: `hidden` [N, H] rows, `weight` [V, H], `targets` [N] (the next
    token, IGNORE_INDEX where no loss is taken), `examples` [N] (`example_ids`). Only one chunk's logits exist at once; they
    are computed in the dtype autocast or the inputs give (as the head would), softcap and log-softmax in fp32."""
    if chunk_tokens is None:
        chunk_tokens = max(1, CHUNK_LOGIT_BYTES // (4 * weight.shape[0]))
    mask = targets != IGNORE_INDEX
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    hits = torch.zeros_like(mask)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        z = F.linear(hidden[start:end], weight).float()
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        t, ok = targets[start:end], mask[start:end]
        safe_t = torch.where(ok, t, 0)
        token_loss = torch.logsumexp(z, dim=-1) - z.gather(1, safe_t[:, None]).squeeze(1)
        loss_sum += torch.where(ok, token_loss, 0.0).sum()
        hits[start:end] = (z.argmax(-1) == t) & ok
        del z
    return _sums(loss_sum, hits, mask, examples)


def batch_response_metrics(model: nn.Module, batch: dict[str, torch.Tensor], impl: LossImpl) -> dict[str, torch.Tensor]:
    """The metrics of `batch`, computed the way the training loss `impl` computes its logits: all at once for
    transformers' loss (`hf`: a wrapped or trained head, FSDP's sharded root), in chunks for chunked / liger."""
    if impl == LossImpl.hf:
        # No labels (transformers would compute a second loss over fp32 logits) and no KV cache (nothing is
        # generated; with a compiled layer the cache's bookkeeping also makes Dynamo recompile).
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs, use_cache=False).logits
        return response_metrics(logits, batch["labels"], example_ids(batch).to(logits.device))
    h = head_inputs(model, batch)
    return chunked_response_metrics(h.hidden, h.weight, h.targets, example_ids(batch).to(h.targets.device), h.softcap)


def _sums(
    loss_sum: torch.Tensor, hits: torch.Tensor, mask: torch.Tensor, examples: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The summed metrics from per-position hits, loss-bearing mask and example ids (all [N]). An example is an exact
    match when none of its loss tokens is missed; examples without a loss token are not counted."""
    missed = torch.zeros(examples.numel(), dtype=torch.int32, device=mask.device)
    missed.index_add_(0, examples, (mask & ~hits).int())
    scored = torch.zeros_like(missed).index_add_(0, examples, mask.int())
    return {
        "loss_sum": loss_sum.detach(),
        "tokens": mask.sum(),
        "hits": hits.sum(),
        "exact": ((missed == 0) & (scored > 0)).sum(),
        "examples": (scored > 0).sum(),
    }


def add_sums(sums: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> None:
    """Add a batch's summed metrics to a split's running sums: float64 (exact for the counts of any split) on the
    batch's device, so that nothing is read back to the host before the split ends."""
    for k, v in batch.items():
        sums[k] = sums.get(k, 0) + v.to(torch.float64)


def validation_rates(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """A split's means from its summed metrics (every batch of every rank): the loss per loss-bearing token, the
    share of loss-bearing tokens predicted right, and the share of examples answered exactly."""
    return {
        "loss": float(sums["loss_sum"] / sums["tokens"]),
        "token_accuracy": float(sums["hits"] / sums["tokens"]),
        "exact_match": float(sums["exact"] / sums["examples"]),
    }
