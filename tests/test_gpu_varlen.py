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
    """What the preflight gives Gemma 2 rows of several examples on a GPU: flex_attention, softcapping as its score
    modifier and the examples' boundaries (from the restarting position ids) as its block mask; losses and
    gradients as from padded eager micro-batches, fp32 on the GPU."""
    from test_padding_free import LENGTHS, WINDOW, examples, flat_step, padded_step, tiny_model

    model = tiny_model("gemma2").cuda()
    step = examples()
    assert max(LENGTHS) > WINDOW
    ref_examples, ref_loss, ref_grads = padded_step(model, step, micro=3)
    model.config._attn_implementation = "flex_attention"
    got_examples, got_loss, got_grads = flat_step(model, step, parts=2)
    assert got_examples == pytest.approx(ref_examples, rel=1e-4, abs=1e-5)
    assert got_loss == pytest.approx(ref_loss, rel=1e-4)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # The check can fail: positions running on across the row let the examples attend to each other.
    wrong_examples, _, _ = flat_step(model, step, parts=2, restart_positions=False)
    assert max(abs(a - b) for a, b in zip(wrong_examples, ref_examples, strict=True)) > 1e-3
