"""4-bit base weights kept dequantized on the device, for the layers the memory allows (hardware.dequantized_layers).

bitsandbytes stores a 4-bit weight packed and dequantizes it to the compute dtype at every use: for a training
micro-batch that is once in the forward, once more in a recomputed forward, and once in the backward. The base
weights are frozen, so the dequantized copy never goes stale: a layer that keeps it skips all of these for the price
of its weights in the compute dtype (2 bytes per weight, beside the packed 4-bit copy, which stays for saving,
merging and inference). The preflight spends only memory left over after the micro-batch and checkpointing choices.

The product is bitsandbytes' own: for a training batch its `MatMul4Bit` dequantizes the weight (`dequantize_4bit`,
cast to the input's dtype) and calls `F.linear`, and its backward multiplies the gradient by the same dequantized
weight. Here both use the kept copy.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
import torch.nn.functional as F
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


def keep_dequantized(layers: list[nn.Module]) -> int:
    """Give every 4-bit Linear of `layers` a dequantized copy of its weight in its compute dtype, on the weight's
    device, and make it multiply by that copy. Returns the number of bytes kept.

    The copy is a plain attribute, not a buffer: it is not part of the state dict (checkpoints and adapters are
    unchanged), and DDP, which broadcasts buffers at every forward, does not see it.
    """
    kept = 0
    for layer in layers:
        for module in layer.modules():
            if type(module) is not bnb.nn.Linear4bit:
                continue
            weight = module.weight
            dtype = module.compute_dtype or weight.quant_state.dtype  # what Linear4bit.forward computes in
            with torch.no_grad():
                w = bnb.functional.dequantize_4bit(weight.data, weight.quant_state).to(dtype)
            module.__class__ = DequantizedLinear4bit
            module.dequantized = w
            kept += w.numel() * w.element_size()
    return kept
