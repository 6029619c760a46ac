"""The training loss of a causal LM without the full [tokens, vocab] logits (`hardware.loss_impl`).

transformers' loss (`out.loss`) materialises the logits of every position, upcasts them to fp32 and keeps a
log-softmax for backward: for Gemma's 256k vocabulary that is ~3 MB per token (one 2,048 x 8 micro-batch: ~16 GiB
for the logits alone, several times that at the loss's peak), more than the 7B model itself in 4 bits. Two ways
around it, both the same mean cross-entropy over the loss-bearing tokens (labels != IGNORE_INDEX, shifted by one as
transformers does), with Gemma 2's final-logit softcap kept:

* `chunked` (here, pure torch, any device): the head's matmul, softcap, log-softmax and their gradients one chunk of
  tokens at a time, in the forward pass (as liger-kernel does), so only one chunk's logits exist at once and the
  backward pass has nothing left to recompute;
* `liger`: liger-kernel's fused linear cross-entropy, the same idea in Triton kernels (CUDA).

Both need the hidden states before the head, so they run the decoder (`<causal LM>.model`) themselves and apply
the head's weight directly. Where that is not what transformers would do (a trained or wrapped head, FSDP's sharded
root), `resolve_loss_impl` falls back to `hf` and says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from exp.core.config import LossImpl, TrainConfig
from exp.core.constants import CHUNK_LOGIT_BYTES, IGNORE_INDEX
from exp.core.strategies import strategy_traits
from exp.model.loss_plan import LossChoice, liger_chunks, plan_loss_impl

log = logging.getLogger(__name__)


def liger_available() -> str | None:
    """None when liger-kernel's fused loss can run here, else what is missing."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss  # noqa: F401
    except Exception as e:  # ImportError, or Triton failing to initialise
        return f"liger-kernel does not import ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def _head_problem(model: nn.Module) -> str | None:
    head = _causal_lm(model).get_output_embeddings()
    if type(head) is not nn.Linear:  # a LoRA-wrapped or modules_to_save head computes more than weight @ h
        return f"the output head is a {type(head).__name__}, not a plain Linear"
    if head.bias is not None:
        return "the output head has a bias"
    return None


def resolve_loss_impl(cfg: TrainConfig, model: nn.Module, device: torch.device) -> LossChoice:
    """The loss that runs: the plan for this device (`plan_loss_impl`), unless the loaded model rules it out (a head
    that is not a plain Linear) or liger-kernel cannot run in this process; each fallback says why."""
    wanted = cfg.hardware.loss_impl
    # The loaded head first: the plan knows a trained head only by the config's markers, the model says what it is.
    # Without the whole weights on this rank (FSDP) the plan keeps transformers' loss, whatever the head is.
    whole = strategy_traits(cfg.hardware.strategy).whole_weights_on_each_rank
    if wanted != LossImpl.hf and whole and (problem := _head_problem(model)):
        return LossChoice(LossImpl.hf, f"hardware.loss_impl={wanted.value} needs a plain head: {problem}")
    choice = plan_loss_impl(cfg, on_cuda=device.type == "cuda")
    if choice.impl == LossImpl.liger and (missing := liger_available()) is not None:
        return LossChoice(LossImpl.chunked, f"hardware.loss_impl={wanted.value}: {missing}, so exp's chunked loss")
    return choice


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers *ForCausalLM under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass(frozen=True)
class HeadInputs:
    """What the output head sees for a batch, flattened to rows: the decoder's last hidden states [N, H] and the
    next-token targets [N] (IGNORE_INDEX where no loss is taken; None for a batch without labels), both on the
    head's device, with its weight and softcap."""

    hidden: torch.Tensor
    targets: torch.Tensor | None
    weight: torch.Tensor
    softcap: float | None


def head_inputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> HeadInputs:
    """The decoder's output for `batch`, as *ForCausalLM.forward computes it before its head (no generation cache)."""
    lm = _causal_lm(model)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = lm.model(**inputs, use_cache=False).last_hidden_state
    weight = lm.get_output_embeddings().weight
    # Position t predicts token t+1: pad the labels by one IGNORE on the right and shift, as transformers'
    # ForCausalLMLoss does, so the hidden states need no (copying) slice.
    # Without labels (the caller lays the hidden states out itself: exp.training.objectives) there are no targets.
    labels = batch.get("labels")
    targets = None if labels is None else F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1)
    # Model parallelism puts the head on the first GPU and the last layers elsewhere: meet where the head is.
    return HeadInputs(
        hidden=hidden.reshape(-1, hidden.shape[-1]).to(weight.device),
        targets=None if targets is None else targets.to(weight.device),
        weight=weight,
        softcap=getattr(lm.config, "final_logit_softcapping", None),
    )


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], impl: LossImpl) -> torch.Tensor:
    """Mean cross-entropy of next-token prediction over the loss-bearing tokens, as `model(**batch).loss`."""
    if impl == LossImpl.hf:
        return model(**batch).loss
    h = head_inputs(model, batch)
    if impl == LossImpl.liger:
        return liger_linear_cross_entropy(h.hidden, h.weight, h.targets, h.softcap)
    return chunked_linear_cross_entropy(h.hidden, h.weight, h.targets, h.softcap)


def liger_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """chunked_linear_cross_entropy in liger-kernel's fused Triton kernels (CUDA), in chunks of
    exp.model.loss_plan.liger_chunks tokens."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # CUDA only: imports Triton

    vocab, width = weight.shape
    chunks = liger_chunks(hidden.shape[0], vocab, width, weight.element_size())
    return liger_fused_linear_cross_entropy(
        hidden, weight, targets, ignore_index=IGNORE_INDEX, softcap=softcap, chunk_mem_const=chunks.mem_const
    )


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    softcap: float | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """mean over targets != IGNORE_INDEX of cross_entropy(softcap(hidden @ weight.T), targets), in chunks of tokens.

    `hidden` [N, H], `weight` [V, H] (the head), `targets` [N]. The logits are computed in the dtype autocast or the
    inputs give (as the head would), and softcap, log-softmax and loss in fp32 (as transformers' loss upcasts).
    No loss-bearing token gives NaN, as torch's mean cross-entropy does.
    """
    if chunk_tokens is None:
        chunk_tokens = max(1, CHUNK_LOGIT_BYTES // (4 * weight.shape[0]))
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, softcap, chunk_tokens)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients in one pass over the chunks (forward); backward only scales the stored gradients.

    With p = softmax(z), z = c * tanh(l / c) (or z = l without a softcap), l = h W^T and n loss-bearing tokens:
      dLoss/dl = (p - onehot(target)) / n * (1 - tanh(l / c)^2)   (zero on ignored tokens)
      dLoss/dh = dLoss/dl @ W,   dLoss/dW = dLoss/dl^T @ h   (only when the head is trained)
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, softcap, chunk_tokens):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        valid = targets != IGNORE_INDEX
        n = valid.sum()
        # 1/n as a tensor: no host sync; n == 0 gives inf (and a NaN loss, like torch's mean over nothing).
        inv_n = 1.0 / n.to(torch.float32)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start : start + chunk_tokens]
            t = targets[start : start + chunk_tokens]
            ok = valid[start : start + chunk_tokens]
            logits = F.linear(h, weight)  # the head's matmul, in the autocast / input dtype
            z = logits.float()
            del logits
            if softcap is not None:
                tanh = torch.tanh(z / softcap)
                z = tanh * softcap
            lse = torch.logsumexp(z, dim=-1)
            safe_t = torch.where(ok, t, 0)
            picked = z.gather(1, safe_t[:, None]).squeeze(1)
            loss_sum += torch.where(ok, lse - picked, 0.0).sum()
            if not (want_h or want_w):
                continue
            # d(loss)/dz = softmax(z) - onehot(t), for loss-bearing rows, scaled by 1/n; in place over z.
            g = z.sub_(lse[:, None]).exp_()
            g.scatter_add_(1, safe_t[:, None], torch.full_like(picked[:, None], -1.0))
            g.mul_((ok.to(g.dtype) * inv_n)[:, None])
            if softcap is not None:
                g.mul_(1.0 - tanh * tanh)
                del tanh
            g_low = g.to(h.dtype) if h.dtype != torch.float32 else g
            if want_h:
                grad_h[start : start + chunk_tokens] = g_low @ weight.to(g_low.dtype)
            if want_w:
                grad_w += g.t() @ h.float()
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None))
        ctx.has = (want_h, want_w)
        ctx.weight_dtype = weight.dtype
        return loss_sum * inv_n

    @staticmethod
    def backward(ctx, grad_loss):
        saved = iter(ctx.saved_tensors)
        want_h, want_w = ctx.has
        grad_h = grad_w = None
        if want_h:
            stored = next(saved)
            grad_h = stored * grad_loss.to(stored.dtype)
        if want_w:
            grad_w = (next(saved) * grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None
