"""The reference model of DPO and KTO: the policy's own forward with the LoRA contribution switched off.

The reference is the frozen base, so at the start (LoRA's B is zero) the policy equals it and every reward is 0, the
DPO loss ln 2. That holds exactly only if the two passes compute the same numbers, which they do only on the same
numeric path. PEFT's `disable_adapter` takes another one wherever the adapted layer is not PEFT's plain "base, then
add the LoRA product": a layer with a kept dequantized weight and `hardware.fuse_lora` (exp.model.dequantized)
multiplies by `[W | B]` with its input widened by LoRA's r columns, a product of another shape (for which cuBLAS may
pick a kernel that rounds differently) than the disabled layer's `W` alone; and a compiled decoder layer gets a
graph without the LoRA nodes, whose fusions may round differently. With random weights, every token's difference
adds up over a completion: an H200 run of the Gemma-7B shape started DPO at a loss of 0.677 instead of 0.693.

`reference_pass` instead sets LoRA's scaling to 0 for the pass: every layer runs the code it runs for the policy,
its LoRA product multiplied by 0 adds exact zeros (the fused product adds 0 x B in the same kernel), so the result
is the base computed the policy's way. The fused layer reads its scaling from a tensor, so that a compiled layer runs
the very graph of the policy: with PEFT's float scaling, 0 was a constant of another graph, and on one H100 the
Gemma-7B shape with every layer kept and fused started DPO at 0.7076 (compiled) against exactly ln 2 (eager, or
compiled without the fused product; benchmarks/results/h100_20261207d). Where a scaling of 0 is not the base,
PEFT's switch is used: a LoRA variant (DoRA rescales the whole output by its trained magnitude),
`lora.modules_to_save` (trained copies of whole modules) or trained biases (`lora.bias`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper
from torch import nn


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def scaling_switch_problem(model: nn.Module) -> str | None:
    """Why a LoRA scaling of 0 would not give this model's base (None: it does)."""
    if any(isinstance(m, ModulesToSaveWrapper) for m in model.modules()):
        return "lora.modules_to_save trains copies of whole modules"
    if any(getattr(c, "bias", "none") != "none" for c in getattr(model, "peft_config", {}).values()):
        return "lora.bias trains the base layers' biases"
    for layer in _lora_layers(model):
        if layer.lora_variant:
            return "a LoRA variant (DoRA) rescales the base output"
    return None


@contextlib.contextmanager
def reference_pass(model: nn.Module) -> Iterator[None]:
    """Within: the PEFT `model` computes the reference (its base), through the policy's own path where it can (the
    module docstring). No gradients are switched off here: the caller's `torch.no_grad()` does that."""
    if scaling_switch_problem(model) is not None:
        with model.disable_adapter():
            yield
        return
    layers = _lora_layers(model)
    saved = [dict(layer.scaling) for layer in layers]
    try:
        for layer in layers:  # every adapter's, not only the active one's: exp.model.adapters adds inactive ones too
            for name in layer.scaling:
                layer.scaling[name] = 0.0
            for scale in getattr(layer, "lora_scale", {}).values():  # a fused layer's (exp.model.dequantized)
                scale.fill_(0.0)
        yield
    finally:
        for layer, scaling in zip(layers, saved, strict=True):
            layer.scaling.clear()
            layer.scaling.update(scaling)
            for name, scale in getattr(layer, "lora_scale", {}).items():
                scale.fill_(float(scaling[name]))
