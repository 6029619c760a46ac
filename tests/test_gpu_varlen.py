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
    keeps eager, on rows capped at data.max_seq_len): softcapping as its score modifier and the examples' boundaries (from the
    restarting position ids) as its block mask give the padded eager step's losses and gradients, fp32 on the GPU."""
    from test_padding_free import assert_flat_step_equals_padded, tiny_model

    # FlexAttention's Triton kernels need a head dimension of at least 16 (Inductor refuses 8, the CPU tests' size).
    assert_flat_step_equals_padded(
        tiny_model("gemma2", head_dim=16).cuda(), "flex_attention", rel=1e-4, grad_rtol=1e-3, grad_atol=1e-5
    )


def test_gemma2_eager_capped_rows_equal_padded_on_the_gpu():
    """Gemma 2's default padding-free micro-batches (eager attention, several rows of at most 48 tokens) give the
    padded step's losses and gradients, fp32 on the GPU."""
    from test_padding_free import assert_flat_step_equals_padded, tiny_model

    assert_flat_step_equals_padded(tiny_model("gemma2").cuda(), row_tokens=48, rel=1e-4, grad_rtol=1e-3, grad_atol=1e-5)


@pytest.mark.slow
def test_gemma2_capped_rows_train_compiled_on_the_gpu(tmp_path):
    """hardware=gpu on a tiny Gemma 2 (eager attention, compiled layers): rows capped at data.max_seq_len, several
    to a micro-batch, of varying counts and lengths; the run trains, with little padding, and compiles a few graphs
    (not one per shape)."""
    import json
    import math
    import subprocess
    import sys

    from test_padding_free import gemma2_capped_rows_run

    overrides = [*gemma2_capped_rows_run(tmp_path), "trainer.max_steps=12", "trainer.val_every_n_steps=12"]
    overrides += ["logger=csv", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "exp.train", *overrides], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["data"]["train"]["row_tokens"] == 128
    assert summary["padding_fraction"] <= 0.15 and math.isfinite(summary["final_val"]["val/loss"])
    assert summary["compile"]["graphs"] <= 6, summary["compile"]
