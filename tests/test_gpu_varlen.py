"""exp.model.varlen's CUDA kernel (skipped without CUDA) against its reference, SDPA one example at a time."""

from __future__ import annotations

import pytest
import torch

from exp.model import varlen

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window",
    [(16, 16, 256, None), (8, 1, 256, None), (4, 1, 256, 64), (8, 4, 256, 512), (4, 2, 64, 32)],
)
def test_cuda_varlen_equals_per_example_sdpa(heads, kv_heads, head_dim, window):
    """Gemma-7B's heads, Gemma-2B's single KV head, Gemma 3's grouped heads and sliding windows shorter than some
    examples: outputs and input gradients within bf16 tolerance of the reference."""
    if varlen.VARLEN_ATTN is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    torch.manual_seed(0)
    lengths = [300, 17, 1, 640, 90, 1000]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    n = sum(lengths)
    q, k, v = (
        torch.randn(n, h, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    scale = head_dim**-0.5
    grad_out = torch.randn(n, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    got = varlen._cuda_varlen(q, k, v, cu, max(lengths), scale, window)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    ref = varlen.reference_varlen(q.float(), k.float(), v.float(), cu, scale, window)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out.float())
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    for g, r in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(g.float(), r.float(), rtol=5e-2, atol=5e-2)
    # The check can fail: without the window (or across examples) the outputs differ.
    if window:
        wrong = varlen.reference_varlen(q.float(), k.float(), v.float(), cu, scale, None)
        assert (wrong - ref).abs().max() > 0.1


def test_gemma2_flex_attention_padding_free_equals_padded_eager():
    """`model.attn_implementation=flex_attention` for Gemma 2's padding-free rows (chosen by hand; the preflight
    keeps eager on padded micro-batches): softcapping as its score modifier and the examples' boundaries (from the
    restarting position ids) as its block mask give the padded eager step's losses and gradients, fp32 on the GPU."""
    from test_padding_free import assert_flat_step_equals_padded, tiny_model

    # FlexAttention's Triton kernels need a head dimension of at least 16 (Inductor refuses 8, the CPU tests' size).
    assert_flat_step_equals_padded(
        tiny_model("gemma2", head_dim=16).cuda(), "flex_attention", rel=1e-4, grad_rtol=1e-3, grad_atol=1e-5
    )
