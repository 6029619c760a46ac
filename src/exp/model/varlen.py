"""Attention over examples laid end to end, each example attending only to itself: `model.attn_implementation=varlen`.

A padding-free micro-batch (exp.data.padding_free) or a packed row holds several examples whose position ids
restart at 0. SDPA keeps them apart with a dense block-diagonal mask over the whole row: its kernel computes every
query-key block of the row and masks most of them away, so its cost grows with the row's length squared (on a
4.8k-token Gemma-7B row, 43% of the step's device time went to it: benchmarks/results/padding_free/README.md).
torch's FlashAttention varlen kernel (`torch.nn.attention.varlen.varlen_attn`) instead takes the examples'
boundaries (cumulative lengths) and runs each example's causal, optionally sliding-window, attention alone: the
cost is the sum of the examples' squared lengths, on the flash kernel.

The boundaries come with the batch: `collate` of position-id rows (exp.data.batching.sequence_boundaries) adds
`cu_seq_lens_q` / `cu_seq_lens_k` (int32) and `max_length_q` / `max_length_k` (Python ints, so no host sync in the
step), transformers' names for them; its models pass them to the attention function untouched. Batches with an
attention mask (padded validation, generation) take transformers' SDPA path with the SDPA mask instead. Where the CUDA kernel is not available (the CPU), the same
boundaries run through SDPA one example at a time: slower, the same math, which the CPU tests check.

No logit softcapping (Gemma 2's attention needs FlexAttention or eager) and no attention dropout.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

NAME = "varlen"


def _kernel():
    """torch's varlen FlashAttention and the keywords its version takes (None where torch has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


VARLEN_ATTN, VARLEN_PARAMS = _kernel()


def varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask for this implementation: none for boundary-carrying rows (the kernel takes the
    boundaries), SDPA's mask for batches with an attention mask (they take the SDPA path)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, attention_mask=attention_mask, **kwargs)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query [B, Hq, T, D], key / value [B, Hkv, S, D] in, the output
    [B, T, Hq, D] out. Rows without boundaries and without a mask are one sequence each."""
    if attention_mask is not None or query.shape[2] != key.shape[2]:  # padded batches, cached generation
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
            sliding_window=sliding_window, softcap=softcap, **kwargs,
        )  # fmt: skip
    if softcap is not None:
        raise ValueError(
            "model.attn_implementation=varlen has no attention-logit softcapping (Gemma 2 has it): use "
            "flex_attention on a GPU or eager"
        )
    if dropout:
        raise ValueError("model.attn_implementation=varlen has no attention dropout: set the model's to 0")
    b, heads, t, d = query.shape
    if cu_seq_lens_q is None:
        cu_seq_lens_q = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=query.device)
        max_length_q = t
    scale = d**-0.5 if scaling is None else scaling
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    if q.is_cuda and VARLEN_ATTN is not None:
        out = _cuda_varlen(q, k, v, cu_seq_lens_q, max_length_q, scale, sliding_window)
    else:
        out = reference_varlen(q, k, v, cu_seq_lens_q, scale, sliding_window)
    return out.reshape(b, t, heads, d), None


def flash_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in a dtype FlashAttention takes (fp16, bf16). Under autocast SDPA casts its inputs to the autocast
    dtype, and the varlen kernel gets the same: projections may come out in fp32 within a bf16 step (DoRA scales
    them by its fp32 magnitude vector)."""
    if q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype:
        return q, k, v
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        raise ValueError(
            f"model.attn_implementation=varlen: FlashAttention takes fp16 or bf16, and the attention's inputs are "
            f"{q.dtype} outside autocast: set hardware.precision=bf16-mixed, or use model.attn_implementation=sdpa"
        )
    dtype = torch.get_autocast_dtype(device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _cuda_varlen(q, k, v, cu, longest, scale, window):
    q, k, v = flash_dtype(q, k, v)
    kwargs = {}
    if "window_size" in VARLEN_PARAMS:
        # transformers' sliding window: a query sees the `window` keys ending at itself (itself included).
        kwargs["window_size"] = (window - 1, 0) if window else (-1, 0)
    else:
        if window and longest > window:
            raise ValueError(
                f"torch {torch.__version__}'s varlen kernel has no sliding window, and an example is longer than the "
                f"model's window ({longest} > {window}): use model.attn_implementation=sdpa"
            )
        kwargs["is_causal"] = True
    if "scale" in VARLEN_PARAMS:
        kwargs["scale"] = scale
    else:
        q = q * (scale * math.sqrt(q.shape[-1]))  # the kernel's own scale is 1 / sqrt(head_dim)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return VARLEN_ATTN(q, k, v, cu, cu, longest, longest, **kwargs)


def reference_varlen(q, k, v, cu, scale, window):
    """The same attention through SDPA, one example at a time (any device; the CPU's path and the GPU test's
    reference). q [N, Hq, D], k / v [N, Hkv, D]."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e == s:
            continue
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
        if group > 1:
            ks, vs = ks.repeat_interleave(group, dim=0), vs.repeat_interleave(group, dim=0)
        i = torch.arange(e - s, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if window:
            allowed &= i[:, None] - i[None, :] < window
        out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale).transpose(0, 1)
    return out


def register() -> None:
    """Make `attn_implementation="varlen"` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, varlen_mask)
