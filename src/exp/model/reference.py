"""The reference model of DPO and KTO: the policy's own forward with the LoRA contribution switched off.

The reference is the frozen base, so at the start (LoRA's B is zero) the policy equals it and every reward is 0, the
DPO loss ln 2. That holds exactly only if the two passes compute the same numbers, which they do only on the same
numeric path. PEFT's `disable_adapter` takes another one wherever the adapted layer is not PEFT's plain "base, then
add the LoRA product": a layer with a kept dequantized weight and `hardware.fuse_lora` (exp.model.dequantized)
multiplies by `[W | B]` with its input widened by LoRA's r columns, a product of another shape (for which cuBLAS may
pick a kernel that rounds differently) than the disabled layer's `W` alone; and a compiled decoder layer gets a
graph without the LoRA nodes, whose fusions may round differently. With random weights, every token's difference
adds up over a completion: an H200 run of the Gemma-7B shape started DPO at a loss of 0.677 instead of 0.693.

`reference_pass` instead zeroes LoRA's A in every layer for the pass (saved before and copied back after): every
layer runs the code it runs for the policy, its LoRA product adds exact zeros (the fused product multiplies B by
zeros in the same kernel), so the result is the base computed the policy's way. Nothing a compiled graph holds as a
constant changes, only the values of tensors the graph takes as inputs, so a compiled layer runs the policy's very
graph and compiles none of its own. Setting PEFT's float scaling to 0 instead changes a constant of every compiled
layer that holds a LoRA layer: another graph, whose kernels may round otherwise (on one H100 the Gemma-7B shape, its
layers compiled with every projection adapted, started DPO at 0.7076 where the eager layers gave exactly ln 2;
benchmarks/results/h100_20261207e). The copy of A costs r x in_features values per adapted layer while the pass
lasts (Gemma-7B, r=16 on all seven projections: 79 MB in fp32). Where zeroing A does not give the base, PEFT's switch
is used: a LoRA variant (DoRA rescales the whole output by its trained magnitude), `lora.modules_to_save` (trained
copies of whole modules) or trained biases (`lora.bias`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper
from torch import nn


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def zeroed_a_problem(model: nn.Module) -> str | None:
    """Why zeroing LoRA's A would not give this model's base (None: it does)."""
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
    if zeroed_a_problem(model) is not None:
        with model.disable_adapter():
            yield
        return
    # Every adapter's, not only the active one's: exp.model.adapters adds inactive ones too.
    weights = [w for layer in _lora_layers(model) for w in _lora_a_weights(layer)]
    with _replaced([(w, None) for w in weights]):
        yield


def start_copy_problem(model: nn.Module, active: str, start: str) -> str | None:
    """Why adapter `active` holding the values of adapter `start` would not compute `start`'s model (None: it
    does): the two must have the same layers, shapes and scalings, and `active`'s dropout must be off (`start`,
    the reference, has none)."""
    if (problem := zeroed_a_problem(model)) is not None:
        return problem
    for layer in _lora_layers(model):
        for factors in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            table = getattr(layer, factors)
            if (start in table) != (active in table):
                return f"the adapters '{active}' and '{start}' adapt different layers"
            if start in table and _tensor(table[start]).shape != _tensor(table[active]).shape:
                return f"the adapters '{active}' and '{start}' differ in shape"
        if start in layer.scaling and layer.scaling[start] != layer.scaling.get(active):
            return f"the adapters '{active}' and '{start}' differ in scaling"
        dropout = layer.lora_dropout[active] if active in layer.lora_dropout else None
        if layer.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            return f"adapter '{active}' drops out in training (lora.dropout={dropout.p})"
    return None


@contextlib.contextmanager
def start_reference_pass(model: nn.Module, active: str, start: str) -> Iterator[None]:
    """Within: adapter `active` holds the values of adapter `start` (the frozen starting adapter of
    `objective.reference=start`), so the PEFT `model` computes `start`'s model through the policy's own modules,
    the active adapter unchanged; `start_copy_problem` says where that does not hold. A compiled layer runs the
    policy's graph (switching the active adapter would change what its graph holds as constants: a graph for the
    reference and another for the policy after it)."""
    pairs = []
    for layer in _lora_layers(model):
        for factors in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            table = getattr(layer, factors)
            if start in table:
                pairs.append((_tensor(table[active]), _tensor(table[start])))
    with _replaced(pairs):
        yield


@contextlib.contextmanager
def _replaced(pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> Iterator[None]:
    """Within: each tensor holds its paired value (None: zeros), in place; every tensor's own value is copied
    back on exit, whatever ends the block."""
    saved = [w.detach().clone() for w, _ in pairs]
    try:
        with torch.no_grad():
            for w, value in pairs:
                w.zero_() if value is None else w.copy_(value)
        # Autocast keeps its lower-precision copy of each trainable fp32 weight for the rest of its region, whatever
        # changes the weight in place: without a fresh cast the pass would multiply by the policy's values, and the
        # policy's pass after it by the replaced ones.
        torch.clear_autocast_cache()
        yield
    finally:
        with torch.no_grad():
            for (w, _), value in zip(pairs, saved, strict=True):
                w.copy_(value)
        torch.clear_autocast_cache()


def _tensor(entry: nn.Module | torch.Tensor) -> torch.Tensor:
    """A LoRA factor's tensor: the weight of a Linear's A or B, an Embedding's A or B itself."""
    return entry.weight if isinstance(entry, nn.Module) else entry


def _lora_a_weights(layer: nn.Module) -> list[torch.Tensor]:
    """The first factor of each of the layer's adapters: A of a Linear's, the embedding A of an Embedding's."""
    return [a.weight for a in layer.lora_A.values()] + list(layer.lora_embedding_A.values())
