"""4-bit base weights kept dequantized on the device, for the layers the memory allows (hardware.dequantized_layers).

bitsandbytes stores a 4-bit weight packed and dequantizes it to the compute dtype at every use: for a training
micro-batch that is once in the forward, once more in a recomputed forward, and once in the backward. The base
weights are frozen, so the dequantized copy never goes stale: a layer that keeps it skips all of these for the price
of its weights in the compute dtype (2 bytes per weight, beside the packed 4-bit copy, which stays for saving,
merging and inference). The preflight spends only memory left over after the micro-batch and checkpointing choices.

The product is bitsandbytes' own: for a training batch its `MatMul4Bit` dequantizes the weight (`dequantize_4bit`,
cast to the input's dtype) and calls `F.linear`, and its backward multiplies the gradient by the same dequantized
weight. Here both use the kept copy.

With a kept weight, LoRA's second product can join the base one (hardware.fuse_lora): PEFT computes
`base(x) + (dropout(x) A^T) B^T * s` as two products and an addition over the layer's whole output, three passes over a
tensor as wide as the output (24,576 columns for Gemma-7B's gate and up projections). Keeping the weight as
`[W | B]` (out x (in + r)) gives the same sum as one product, `[x, s * dropout(x) A^T] [W | B]^T`, and one backward
product gives both the input's gradient and that of the LoRA branch. It pays where the output is at least as wide as
the input (q, k, v, gate, up); the joined input is one extra pass over `x`.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
import torch.nn.functional as F
from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
from torch import nn


class DequantizedLinear4bit(bnb.nn.Linear4bit):
    """A bitsandbytes Linear4bit that multiplies by its kept dequantized weight (`self.dequantized`)."""

    dequantized: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As Linear4bit.forward: compute in the compute dtype, return in the input's dtype.
        inp_dtype = x.dtype
        w = self.dequantized
        bias = None if self.bias is None else self.bias.to(w.dtype)
        return F.linear(x.to(w.dtype), w, bias).to(inp_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dequantized={self.dequantized.dtype}"


class _BaseAndLoraProduct(torch.autograd.Function):
    """`[x, xa] @ packed^T` where `packed = [W | B]` holds the frozen weight and LoRA's B (copied in by the caller),
    and `xa = s * dropout(x) A^T` comes from autograd (which then carries its gradient on to A and to x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, xa: torch.Tensor, packed: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(xa, packed)
        ctx.n_in, ctx.b_dtype = x.shape[-1], b.dtype
        return F.linear(torch.cat([x, xa], dim=-1), packed)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        xa, packed = ctx.saved_tensors
        n_in = ctx.n_in
        # Autocast ran the forward product in its dtype; the backward runs outside autocast. (With a model loaded in
        # the autocast dtype, as exp loads it, the two agree and nothing is copied.)
        packed, xa = packed.to(grad_y.dtype), xa.to(grad_y.dtype)
        grad_x = grad_xa = grad_b = None
        if ctx.needs_input_grad[0]:
            both = grad_y @ packed  # the input's gradient and the LoRA branch's, in one product
            grad_x, grad_xa = both[..., :n_in], both[..., n_in:]
        elif ctx.needs_input_grad[1]:
            grad_xa = grad_y @ packed[:, n_in:]
        if ctx.needs_input_grad[3]:
            flat_g, flat_xa = grad_y.reshape(-1, grad_y.shape[-1]), xa.reshape(-1, xa.shape[-1])
            grad_b = (flat_g.t() @ flat_xa).to(ctx.b_dtype)
        return grad_x, grad_xa, None, grad_b


class FusedLoraLinear4bit(LoraLinear4bit):
    """PEFT's LoRA around a kept-dequantized 4-bit Linear, with B's product inside the base product (see the module
    docstring). Anything but plain training or evaluation of one LoRA adapter (merged, disabled, several or mixed
    adapters, DoRA) takes PEFT's own path."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapters = self.active_adapters
        base = self.base_layer
        if (
            args
            or kwargs
            or self.disable_adapters
            or self.merged
            or len(adapters) != 1
            or adapters[0] not in self.lora_A
            or adapters[0] in self.lora_variant
            or base.bias is not None
        ):
            return super().forward(x, *args, **kwargs)
        name = adapters[0]
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        packed = base.packed
        with torch.no_grad():  # B trains: its current values, in the compute dtype, next to the frozen weight
            packed[:, base.in_features :].copy_(lora_b.weight)
        inp = x if torch.is_autocast_enabled() else x.to(lora_a.weight.dtype)  # as PEFT casts for the LoRA branch
        xa = lora_a(self.lora_dropout[name](inp)) * self.scaling[name]
        y = _BaseAndLoraProduct.apply(x.to(packed.dtype), xa.to(packed.dtype), packed, lora_b.weight)
        return y.to(x.dtype)


def keep_dequantized(layers: list[nn.Module], fuse_lora: bool = False, reference: str | None = None) -> int:
    """Give every 4-bit Linear of `layers` a dequantized copy of its weight in its compute dtype, on the weight's
    device, and make it multiply by that copy. Returns the number of bytes kept.

    `fuse_lora` joins LoRA's B to the copy where a layer has one adapter, or one beside the frozen copy named
    `reference` (objective.reference=start) of the same rank: only one of them is active in a pass, and the fused
    product copies the active one's B in at every call.

    The copy is a plain attribute, not a buffer: it is not part of the state dict (checkpoints and adapters are
    unchanged), and DDP, which broadcasts buffers at every forward, does not see it.
    """
    kept = 0
    for layer in layers:
        for wrapper in list(layer.modules()):
            # The 4-bit Linear itself, or PEFT's LoRA wrapper around one (whose B may join the kept weight).
            lora = wrapper if type(wrapper) is LoraLinear4bit else None
            module = lora.base_layer if lora is not None else wrapper
            if type(module) is not bnb.nn.Linear4bit:
                continue
            weight = module.weight
            dtype = module.compute_dtype or weight.quant_state.dtype  # what Linear4bit.forward computes in
            r = 0
            # DoRA (a LoRA variant) rescales the whole output by its magnitude / column norm: no [W | B] product.
            fusable = lora is not None and not lora.lora_variant and module.bias is None
            trained = [name for name in lora.lora_A if name != reference] if lora is not None else []
            ranks = {a.out_features for a in lora.lora_A.values()} if lora is not None else set()
            if fuse_lora and fusable and module.out_features >= module.in_features and len(trained) == len(ranks) == 1:
                r = ranks.pop()
            w = torch.empty(module.out_features, module.in_features + r, dtype=dtype, device=weight.device)
            with torch.no_grad():
                w[:, : module.in_features] = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
                if r:  # B's current values: the reference pass multiplies them by 0 and must not meet NaN there
                    w[:, module.in_features :] = lora.lora_B[trained[0]].weight
            module.__class__ = DequantizedLinear4bit
            module.dequantized = w[:, : module.in_features]
            if r:
                module.packed = w
                lora.__class__ = FusedLoraLinear4bit
            kept += w.numel() * w.element_size()
    return kept
