"""Several LoRA adapters over one frozen base, trained together: each row of a batch goes through the base once and
through its own adapter only.

PEFT keeps any number of named adapters in one model (`add_adapter`). `RowRouter` turns PEFT's own adapter pass off
in every LoRA layer and adds each adapter's low-rank product after the base layer itself, over its rows only: the
rows of one job are contiguous, so each adapter reads and writes a slice of the batch (no gathered copies, no index
lists sent to the device per layer, as PEFT's inference-only mixed-adapter batches do). A loss summed over the jobs'
rows then gives each adapter the gradient of its own rows alone. The router stays installed for as long as the
routing is needed (backward's recomputation of checkpointed layers included).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from exp.core.config import LoraConfig


def add_adapters(model: nn.Module, adapters: dict[str, LoraConfig], build_config) -> None:
    """Add the named adapters to a PEFT model, each drawn from its own `init_seed` on the CPU exactly as the first
    adapter (exp.model.build.build_model), so that an adapter is the one a run of its config alone starts from."""
    for name, lora in adapters.items():
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(lora.init_seed)
            model.add_adapter(name, build_config(lora))
    # PEFT marks only the active adapter trainable; every adapter trains here.
    for name in adapter_names(model):
        for p in adapter_parameters(model, name):
            p.requires_grad_(True)


def adapter_names(model: nn.Module) -> list[str]:
    return list(model.peft_config)


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The trainable tensors of adapter `name` (its A and B of every targeted layer), in the model's order."""
    marker = f".{name}."
    return [p for n, p in model.named_parameters() if marker in f"{n}." and ("lora_" in n)]


class RowRouter:
    """Route the next forward passes' rows (or tokens) to adapters: `router.route([("a", 4), ("b", 4)])` (each
    adapter with its count of consecutive rows), `router.route([("a", 900), ("b", 700)], axis=1)` (consecutive
    tokens of one row of examples laid end to end), or `router.route_all("a")`; set before each forward and kept
    until its backward is done. Installed on every LoRA layer of `model` until `remove()`."""

    def __init__(self, model: nn.Module) -> None:
        from peft.tuners.lora import LoraLayer  # the model is a PEFT model already: PEFT is loaded

        self.spans: list[tuple[str, tuple[slice, ...]]] = []
        self._layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        trainable = [p for p in model.parameters() if p.requires_grad]
        for layer in self._layers:
            layer.enable_adapters(False)  # PEFT's pass off (it also clears requires_grad, restored below)
        for p in trainable:
            p.requires_grad_(True)
        self._handles = [layer.register_forward_hook(self._add_adapters) for layer in self._layers]

    def route(self, parts: list[tuple[str, int]], axis: int = 0) -> None:
        """`parts`: (adapter, count) in order along `axis` of the layers' inputs (0: rows, 1: tokens)."""
        spans, start = [], 0
        for name, count in parts:
            spans.append((name, (slice(None),) * axis + (slice(start, start + count),)))
            start += count
        self.spans = spans

    def route_all(self, name: str) -> None:
        self.spans = [(name, (slice(None),))]

    def _add_adapters(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        # Under autocast the adapter's products run in the autocast dtype whatever their input's: casting the input
        # to the adapter's fp32 first (as PEFT does) would only add a copy of every targeted layer's input.
        autocast = torch.is_autocast_enabled(x.device.type)
        for name, index in self.spans:
            if name not in module.lora_A:  # a layer this adapter does not target
                continue
            lora_a, lora_b = module.lora_A[name], module.lora_B[name]
            part = x[index] if autocast else x[index].to(lora_a.weight.dtype)
            delta = lora_b(lora_a(module.lora_dropout[name](part))) * module.scaling[name]
            # In place, as PEFT adds its own pass: the base layer's backward keeps its input, not its output.
            output[index] += delta.to(output.dtype)
        return output

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def save_adapter(model: nn.Module, name: str, out_dir: Path) -> None:
    """Adapter `name` in PEFT's own format (adapter_config.json + adapter_model.safetensors, the keys of a model
    holding that adapter alone), loadable with `PeftModel.from_pretrained` like a single run's adapter."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(model, adapter_name=name)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(out_dir / "adapter_model.safetensors"))
    model.peft_config[name].save_pretrained(str(out_dir))
