"""Where the adapters start (`lora.init`), and how an adapter whose init changed the base is saved.

PEFT runs the plain initialisations (default, gaussian) when it creates the adapters, and PiSSA / OLoRA too on a base
in a float dtype. On a bitsandbytes 4-bit base PEFT refuses PiSSA (its SVD needs float weights) and PEFT's LoftQ for
that case is a separate pass (`replace_lora_weights_loftq`); both run here after the adapters exist.

PiSSA and OLoRA move part of each targeted weight into the adapter (W = W_res + s B0 A0) and leave the residual W_res
in the base. PEFT writes the residual into a float base. On a 4-bit base the packed weight stays as it is: PEFT's own
`pissa_init` / `olora_init` runs on a dequantized copy for B0 and A0, and each layer subtracts the frozen s B0 A0
product from its output, so the base the adapter trains on is Q(W) - s B0 A0, the exact residual of the 4-bit weight
(re-quantizing the residual instead, as PEFT does for OLoRA, adds a second quantization error). The frozen pair costs
one more rank-r product per targeted layer.

A PiSSA / OLoRA adapter means something only next to its residual base, so the run's adapter is saved converted, by
PEFT (`save_pretrained(path_initial_model_for_weight_conversion=...)`), into a plain LoRA of rank 2r on the original
base: ΔW = s (B A - B0 A0). `PeftModel.from_pretrained` on the base checkpoint then computes what trained, and
`exp.merge` merges it like any LoRA.

The starting adapter (B0, A0) is kept on the CPU beside the model for that conversion. It is recomputed from the same
weights and seed whenever the model is built again (resuming), so a checkpoint's B and A meet the base they trained
against.
"""

from __future__ import annotations

import logging
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from exp.core.config import RESIDUAL_INITS, LoraConfig, LoraInit

log = logging.getLogger(__name__)

# The attribute of a PeftModel holding its starting adapter (CPU tensors, PEFT's state-dict keys): residual inits only.
INITIAL_ADAPTER = "exp_initial_adapter"


def peft_init_name(lora: LoraConfig) -> bool | str:
    """`init_lora_weights` as PEFT names this init (True: PEFT's default)."""
    if lora.init == LoraInit.pissa and lora.pissa_niter is not None:
        return f"pissa_niter_{lora.pissa_niter}"
    return {LoraInit.default: True, LoraInit.loftq: True}.get(lora.init, lora.init.value)


def creation_init(lora: LoraConfig, quantized: bool) -> bool | str:
    """What PEFT runs when it creates the adapters: everything except the 4-bit passes of `apply_init` (which start
    from PEFT's default adapters and overwrite them)."""
    if quantized and (lora.init in RESIDUAL_INITS or lora.init == LoraInit.loftq):
        return True
    return peft_init_name(lora)


def apply_init(model: nn.Module, lora: LoraConfig, adapter: str, quantized: bool, source: str | None) -> None:
    """Run the initialisations PEFT does not run at creation on a 4-bit base, and keep a residual init's starting
    adapter for `save_adapter`. `source`: where the base was loaded from (LoftQ reads the original weights there)."""
    started = time.perf_counter()
    if quantized and lora.init == LoraInit.loftq:
        assert source is not None, "LoftQ reads the original weights from the base checkpoint"
        from peft import replace_lora_weights_loftq  # LoftQ runs only

        # A local directory is read as is; a hub id from the local Hugging Face cache (PEFT resolves it).
        replace_lora_weights_loftq(model, model_path=source if Path(source).is_dir() else None, adapter_name=adapter)
    if lora.init not in RESIDUAL_INITS:
        if lora.init == LoraInit.loftq:
            log.info("lora.init=loftq: %.1f s", time.perf_counter() - started)
        return
    if quantized:
        layers = _decompose_4bit(model, adapter, str(peft_init_name(lora)))
        log.info("lora.init=%s: %d 4-bit layers start from their decomposition (%.1f s)",
                 lora.init.value, layers, time.perf_counter() - started)  # fmt: skip
    model.peft_config[adapter].init_lora_weights = peft_init_name(lora)
    from peft.utils import get_peft_model_state_dict  # the model is a PEFT model already: PEFT is loaded

    state = get_peft_model_state_dict(model, adapter_name=adapter)
    setattr(model, INITIAL_ADAPTER, {k: v.detach().to("cpu", copy=True) for k, v in state.items()})


@torch.no_grad()
def _decompose_4bit(model: nn.Module, adapter: str, init_name: str) -> int:
    """PEFT's PiSSA / OLoRA init of every 4-bit LoRA layer, on its dequantized weight; the layer keeps its packed
    weight and subtracts the starting product (`_subtract_initial`). Returns the number of layers."""
    import bitsandbytes as bnb  # the 4-bit path only
    from peft.tuners.lora import LoraLayer  # the model is a PEFT model already: PEFT is loaded

    count = 0
    for layer in model.modules():
        if not isinstance(layer, LoraLayer) or adapter not in layer.lora_A:
            continue
        base = layer.get_base_layer()
        packed = base.weight
        if not isinstance(packed, bnb.nn.Params4bit):
            continue
        # PEFT's inits read and write `weight.data` when it is a float tensor: give them a copy, then drop it.
        base.weight = nn.Parameter(bnb.functional.dequantize_4bit(packed.data, packed.quant_state).float(), False)
        try:
            if init_name == LoraInit.olora.value:
                layer.olora_init(adapter)
            else:
                layer.pissa_init(adapter, init_name)
        finally:
            base.weight = packed
        # Not in the state dict: recomputed at every build, like the adapter's own starting values.
        layer.register_buffer("exp_initial_a", layer.lora_A[adapter].weight.detach().clone(), persistent=False)
        layer.register_buffer("exp_initial_b", layer.lora_B[adapter].weight.detach().clone(), persistent=False)
        layer.exp_initial_scaling = layer.scaling[adapter]
        layer.register_forward_hook(_subtract_initial)
        count += 1
    return count


def _subtract_initial(layer: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The base as PiSSA / OLoRA leave it: the layer's output less s B0 A0 x (no dropout: it is part of the base)."""
    x = args[0]
    a0, b0 = layer.exp_initial_a, layer.exp_initial_b
    # Under autocast the products run in the autocast dtype; otherwise in the adapter's, as PEFT casts its branch.
    inp = x if torch.is_autocast_enabled(x.device.type) else x.to(a0.dtype)
    return output - (F.linear(F.linear(inp, a0), b0) * layer.exp_initial_scaling).to(output.dtype)


def save_adapter(model: nn.Module, lora: LoraConfig, out_dir: Path, selected: list[str] | None = None) -> None:
    """The adapter in PEFT's format (`selected`: those of the model's adapters to save, default all); after a residual
    init (PiSSA, OLoRA) converted by PEFT into a plain LoRA of rank 2r on the original base (see the module
    docstring), loadable with `PeftModel.from_pretrained` on the checkpoint."""
    initial = getattr(model, INITIAL_ADAPTER, None)
    if lora.init not in RESIDUAL_INITS or initial is None:
        model.save_pretrained(str(out_dir), selected_adapters=selected)
        return
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        # PEFT loads it as an adapter named after the directory, and writes its config there (init: default).
        initial_dir = Path(tmp) / "exp_initial"
        initial_dir.mkdir()
        save_file(initial, str(initial_dir / "adapter_model.safetensors"))
        with warnings.catch_warnings():
            # Loading the starting adapter for the conversion, PEFT warns that PiSSA changes the base: known here.
            warnings.filterwarnings("ignore", message="PiSSA changes the base weights")
            model.save_pretrained(
                str(out_dir), selected_adapters=selected, path_initial_model_for_weight_conversion=str(initial_dir)
            )
