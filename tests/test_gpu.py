"""GPU path (skipped without CUDA): the real CLI on a Gemma-2B-shaped model, 4-bit weights on the GPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.slow
def test_gemma_2b_trains_on_one_gpu(tmp_path):
    overrides = [
        "model=gemma_2b",
        "model.random_init=true",
        "hardware=gpu",
        "trainer.max_steps=20",
        "trainer.warmup_steps=0",
        "logger=csv",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run([sys.executable, "-m", "exp.train", *overrides], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["device"].startswith("cuda")
    assert math.isfinite(summary["final_val"]["val/loss"])
    assert summary["peak_memory_gib"] > 1.0 and summary["tokens_per_s_median"] > 0
    (placement,) = summary["placement_per_rank"]
    assert placement == {"root_device": "cuda:0", "frozen": ["cuda:0"], "trainable": ["cuda:0"]}
    # The run ends with a validation pass: its peak stays within the packer's headroom (10%) of the estimated
    # training-step allocation of the resolved config.
    from exp.hardware.memory import GiB, estimate_for_config
    from exp.run.compose import load_run_config

    estimate = estimate_for_config(load_run_config(tmp_path))
    assert summary["peak_memory_gib"] * GiB <= 1.1 * estimate.allocated, (summary["peak_memory_gib"], estimate)


def test_quantized_weights_and_adapters_live_on_the_strategy_device():
    from conftest import compose_typed

    from exp.model.build import build_model

    # precision is named here because nothing runs the preflight (which resolves `auto`) in this test.
    cfg = compose_typed(
        ["model=gemma_2b", "model.random_init=true", "hardware=gpu", "hardware.precision=bf16-mixed", "logger=csv"]
    )
    model = build_model(cfg, torch.device("cuda", torch.cuda.current_device()))
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__name__ == "Linear4bit"
    assert q_proj.base_layer.weight.device.type == "cuda"
    assert q_proj.lora_A["default"].weight.device.type == "cuda"
    assert {p.device.type for p in model.parameters()} == {"cuda"}


STALE_SCRIPT = r"""
import os, sys
import torch
torch.zeros(1, device="cuda")            # a notebook's first cell: CUDA initialised with the GPU visible
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a later cell hides it (or points elsewhere): CUDA will not notice
from exp.train import run
try:
    run(sys.argv[2:], output_dir=sys.argv[1])
except SystemExit as e:
    print("EXIT", e.code)
"""


def test_cuda_visible_devices_changed_after_init_gets_the_diagnosis(tmp_path):
    overrides = ["hardware=gpu", "trainer.max_steps=2", "trainer.warmup_steps=0", "logger=csv"]
    proc = subprocess.run(
        [sys.executable, "-c", STALE_SCRIPT, str(tmp_path / "stale"), *overrides],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "EXIT 3" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "[CUDA_VISIBLE_DEVICES]" in proc.stderr and "restart" in proc.stderr
    assert "INTERNAL ASSERT" in proc.stderr  # named in the message, not raised


def test_lora_init_does_not_depend_on_the_default_device():
    """Lightning builds the model under the strategy's device as torch's default device: the adapters must still
    be drawn as on the CPU (same lora.init_seed, same adapters, whatever the machine)."""
    from conftest import compose_typed

    from exp.bench.baseline_loop import lora_fingerprint
    from exp.model.build import build_model

    cfg = compose_typed(["hardware=gpu", "hardware.precision=bf16-mixed", "logger=csv"])
    # The same config on the CPU (bf16 too: PEFT rounds the adapters through the base's dtype before upcasting).
    cpu_cfg = compose_typed(["hardware=gpu", "hardware.accelerator=cpu", "hardware.precision=bf16-mixed", "logger=csv"])
    on_cpu = lora_fingerprint(build_model(cpu_cfg, torch.device("cpu")))
    with torch.device("cuda"):
        on_gpu = build_model(cfg, torch.device("cuda", torch.cuda.current_device()))
    assert {p.device.type for p in on_gpu.parameters() if p.requires_grad} == {"cuda"}
    assert lora_fingerprint(on_gpu) == on_cpu


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_liger_loss_in_few_chunks_equals_the_chunked_loss(softcap):
    """exp's liger call (chunks of about LIGER_CHUNK_LOGIT_BYTES of logits, not liger's ceil(vocab / hidden)
    chunks) gives exp's chunked loss and the same gradient at Gemma-7B's head shape on a padding-free step's token
    count, and its transient memory stays within the estimate's loss term."""
    from exp.core.constants import IGNORE_INDEX
    from exp.hardware.memory import _fused_loss_peak_bytes
    from exp.model.loss import chunked_linear_cross_entropy, liger_linear_cross_entropy

    torch.manual_seed(0)
    tokens, vocab, width = 4800, 256000, 3072
    weight = torch.randn(vocab, width, device="cuda", dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, vocab, (tokens,), device="cuda")
    targets[::7] = IGNORE_INDEX
    hidden = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name, fn in (("chunked", chunked_linear_cross_entropy), ("liger", liger_linear_cross_entropy)):
        h = hidden.clone().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fn(h, weight, targets, softcap)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        loss.backward()
        results[name] = (loss.float().item(), h.grad.float(), peak)
    (chunked, chunked_grad, _), (liger, liger_grad, liger_peak) = results["chunked"], results["liger"]
    assert liger == pytest.approx(chunked, rel=2e-3)
    # Both gradients are bf16 (an ulp is 0.4-0.8% of a value) summed in different orders: compare as a whole (1% of
    # the gradient's norm) and element-wise within two ulps of the largest element.
    assert (liger_grad - chunked_grad).norm() <= 1e-2 * chunked_grad.norm()
    assert (liger_grad - chunked_grad).abs().max() <= 2 * 2**-7 * chunked_grad.abs().max()
    estimate = _fused_loss_peak_bytes("liger", tokens, vocab, width, 2, softcap is not None)
    # The estimate also counts the decoder's output H, which exists before the loss starts.
    assert liger_peak <= estimate, (liger_peak, estimate)
