"""Kept dequantized weights (hardware.dequantized_layers) and host-offloaded checkpoints (hardware.offload_checkpoints)
change where tensors live, not what is computed: on the real NF4 CPU path the loss and every LoRA gradient are
the same as without them. The preflight's choice of how many layers keep their weights is in test_preflight.py.
"""

from __future__ import annotations

import contextlib
import re

import bitsandbytes as bnb
import pytest
import torch
from conftest import compose_typed

from exp.hardware.memory import estimate_memory
from exp.model.build import build_model, decoder_layers
from exp.model.dequantized import DequantizedLinear4bit
from exp.model.loss import causal_lm_loss

BASE = ["hardware=cpu", "hardware.loss_impl=chunked", "lora.init_seed=3"]


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (2, 24), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _loss_and_grads(overrides: list[str], autocast: bool = False, offload: bool = False):
    cfg = compose_typed([*BASE, *overrides])
    model = build_model(cfg, "cpu")
    # Non-zero B (PEFT starts it at zero), so the adapters take part in the loss and in every gradient.
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    batch = _batch(model.config.vocab_size)
    torch.manual_seed(0)  # the same LoRA dropout masks in both runs
    hooks = torch.autograd.graph.save_on_cpu() if offload else contextlib.nullcontext()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), hooks:
        loss = causal_lm_loss(model, batch, cfg.hardware.loss_impl)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return model, loss.detach(), grads


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_dequantized_layers_compute_what_bitsandbytes_computes(autocast):
    _, loss, grads = _loss_and_grads([], autocast)
    model, loss_kept, grads_kept = _loss_and_grads(["hardware.dequantized_layers=2"], autocast)
    layers = decoder_layers(model)
    kept = [type(m) is DequantizedLinear4bit for layer in layers for m in layer.modules()
            if isinstance(m, bnb.nn.Linear4bit)]  # fmt: skip
    per_layer = len(kept) // len(layers)
    assert kept == [True] * 2 * per_layer + [False] * (len(layers) - 2) * per_layer
    # The kept copy is the packed weight dequantized, in the dtype bitsandbytes computes in.
    q = layers[0].self_attn.q_proj.base_layer
    w = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).to(q.compute_dtype or torch.float32)
    assert torch.equal(q.dequantized, w)
    assert torch.equal(loss_kept, loss)
    assert grads_kept.keys() == grads.keys() and len(grads) > 0
    for name, g in grads.items():
        assert torch.equal(grads_kept[name], g), name
    # Nothing of it reaches the state dict: checkpoints and adapters are those of a run without it.
    assert not any("dequantized" in k for k in model.state_dict())


@pytest.mark.slow
def test_offloaded_checkpoints_give_the_same_loss_and_gradients():
    ckpt = ["hardware.gradient_checkpointing=true"]
    _, loss, grads = _loss_and_grads(ckpt)
    _, loss_off, grads_off = _loss_and_grads([*ckpt, "hardware.offload_checkpoints=true"], offload=True)
    assert torch.equal(loss_off, loss)
    for name, g in grads.items():
        assert torch.equal(grads_off[name], g), name


def test_the_training_step_offloads_only_when_asked():
    from exp.training.module import QLoRAModule

    on = QLoRAModule(
        compose_typed([*BASE, "hardware.gradient_checkpointing=true", "hardware.offload_checkpoints=true"])
    )
    off = QLoRAModule(compose_typed(BASE))
    assert isinstance(on._saved_tensors_place(), torch.autograd.graph.save_on_cpu)
    assert isinstance(off._saved_tensors_place(), contextlib.nullcontext)


def test_offloaded_checkpoint_inputs_leave_the_device_estimate():
    arch = dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=16, head_dim=256)  # fmt: skip
    common = dict(quant_type="nf4", double_quant=True, lora_r=16, lora_targets=["q_proj"], micro_batch_size=128,
                  seq_len=2048, gradient_checkpointing=True, loss_impl="liger")  # fmt: skip
    on_device = estimate_memory(arch, **common)
    offloaded = estimate_memory(arch, **common, offload_checkpoints=True)
    inputs = 28 * 2 * 128 * 2048 * 3072  # bf16 input of each recomputed layer
    assert on_device.details["checkpoint_inputs_bytes"] == inputs
    assert offloaded.details["checkpoint_inputs_bytes"] == inputs // 28  # one layer's input back at a time
    assert on_device.allocated - offloaded.allocated >= 27 * inputs // 28


def test_dequantized_weights_are_counted_per_layer():
    arch = dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32)  # fmt: skip
    common = dict(quant_type="nf4", double_quant=True, lora_r=8, lora_targets=["q_proj"], micro_batch_size=2,
                  seq_len=64, gradient_checkpointing=False)  # fmt: skip
    per_layer = 2 * (64 * 64 + 64 * 32 * 2 + 64 * 64 + 3 * 64 * 256)  # q, k, v, o, gate, up, down in bf16
    assert estimate_memory(arch, **common, dequantized_layers=3).dequantized_weights == 3 * per_layer
    with pytest.raises(ValueError, match="dequantized_layers=5"):
        estimate_memory(arch, **common, dequantized_layers=5)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["hardware.dequantized_layers=-1"], "hardware.dequantized_layers=-1"),
        (["quantization=none", "hardware.dequantized_layers=1"], "quantization=none"),
        (["hardware.offload_checkpoints=true"], "hardware.offload_checkpoints=true"),
        (["hardware.offload_checkpoints=true", "hardware.gradient_checkpointing=true", "hardware.checkpoint_layers=1"],
         "hardware.checkpoint_layers=1"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_with_the_fix(overrides, key):
    from exp.core.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(key)) as err:
        compose_typed(["hardware=cpu", *overrides])
    assert "hardware.dequantized_layers=0" in str(err.value) or "hardware.offload_checkpoints" in str(err.value)


def _fused_modules(model) -> set[str]:
    from exp.model.dequantized import FusedLoraLinear4bit

    layer = decoder_layers(model)[0]
    return {n.rsplit(".", 1)[-1] for n, m in layer.named_modules() if type(m) is FusedLoraLinear4bit}


KEPT = ["lora=all_linear", "lora.dropout=0.1", "hardware.dequantized_layers=4"]


@pytest.mark.slow
def test_lora_inside_the_base_product_gives_peft_s_sum():
    """hardware.fuse_lora, fp32: the same loss and gradients as PEFT's two products and addition, up to rounding order."""
    _, loss, grads = _loss_and_grads(KEPT)
    model, loss_fused, grads_fused = _loss_and_grads([*KEPT, "hardware.fuse_lora=true"])
    # The projections whose output is at least as wide as their input (tiny Gemma: q and o 128 -> 128, gate and
    # up 128 -> 512; k and v 128 -> 64 and down 512 -> 128 are not).
    assert _fused_modules(model) == {"q_proj", "o_proj", "gate_proj", "up_proj"}
    assert torch.allclose(loss_fused, loss, rtol=1e-6)
    assert grads_fused.keys() == grads.keys()
    for name, g in grads.items():
        assert torch.allclose(grads_fused[name], g, rtol=1e-4, atol=1e-5 * g.abs().max()), name


@pytest.mark.slow
def test_lora_inside_the_base_product_is_no_less_exact_under_bf16_autocast():
    """Under bf16 autocast both paths round differently: measured against the fp32 gradients, the fused one is
    at least about as close as PEFT's (relative error of each tensor, within 2x of PEFT's + 1e-3)."""
    _, _, exact = _loss_and_grads(KEPT)
    _, loss, peft = _loss_and_grads(KEPT, autocast=True)
    _, loss_fused, fused = _loss_and_grads([*KEPT, "hardware.fuse_lora=true"], autocast=True)
    assert torch.allclose(loss_fused, loss, rtol=1e-2)

    def err(g: torch.Tensor, ref: torch.Tensor) -> float:
        return float((g.float() - ref).norm() / ref.norm())

    for name, ref in exact.items():
        assert err(fused[name], ref) <= 2 * err(peft[name], ref) + 1e-3, name


def _reference_gap(fuse: bool, b_scale: float) -> tuple[float, float]:
    """q_proj of the first decoder layer under bf16 autocast, with B of `b_scale` (an adapter a few small steps
    from its zero start): the RMS of (policy output - reference-pass output) - the exact LoRA term, and the RMS of
    that term."""
    from exp.model.reference import reference_pass

    cfg = compose_typed([*BASE, "lora=all_linear", "lora.dropout=0", "hardware.dequantized_layers=1",
                         f"hardware.fuse_lora={str(fuse).lower()}"])  # fmt: skip
    model = build_model(cfg, "cpu")
    q = decoder_layers(model)[0].self_attn.q_proj
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        b = q.lora_B["default"].weight
        b.copy_(torch.randn(b.shape, generator=g).sign() * b_scale)
    x = torch.randn(64, q.in_features, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        # The LoRA term as both paths form it (x A^T s and B in bf16), then multiplied exactly.
        xa = (x.double() @ q.lora_A["default"].weight.double().t() * q.scaling["default"]).to(torch.bfloat16)
        term = xa.double() @ b.to(torch.bfloat16).double().t()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            policy = q(x).double()
            with reference_pass(model):
                reference = q(x).double()
    return float((policy - reference - term).pow(2).mean().sqrt()), float(term.pow(2).mean().sqrt())


def test_the_fused_product_rounds_the_reference_gap_coarser_than_peft():
    """Why hardware.fuse_lora=auto is off for DPO and KTO: with a small adapter, PEFT's path (base product rounded,
    then the LoRA term added) leaves the policy-reference difference off by at most the term itself, where the
    fused product (one rounding of the sum) moves elements near a rounding boundary by a whole ulp."""
    peft_error, term = _reference_gap(fuse=False, b_scale=1e-5)
    fused_error, _ = _reference_gap(fuse=True, b_scale=1e-5)
    assert peft_error <= 1.01 * term
    assert fused_error > 3 * term, (fused_error, term)
