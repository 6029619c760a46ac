"""QLoRA under FSDP: the adapters are gathered and restored without FSDP's full state dict.

FSDP's full state dict walks every module's `state_dict`, the 4-bit bitsandbytes layers included (their packed
weights and quantization state, flattened into FSDP's shards), to build a copy of the whole model, only for exp to
keep the adapters. On the CPU reproduction of this path that walk crashed the process at the first checkpoint
(docs/hardware.md). exp needs only the trainable tensors: `summon_full_params` unshards the original parameters
in place, the adapters are copied out (or in), and nothing else is serialised.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from exp.core.config import ConfigError
from exp.run.checkpoints import load_checkpoint_file

# Module-path pieces FSDP (and activation checkpointing) insert: the checkpoint uses the plain names.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def gather_trainable(root: nn.Module, module: nn.Module) -> dict[str, torch.Tensor]:
    """A full CPU copy of every trainable tensor of `module`, by plain name. Every rank must call it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(root, writeback=False):
        return {clean_name(n): p.detach().cpu().clone() for n, p in module.named_parameters() if p.requires_grad}


def restore_trainable(root: nn.Module, module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy `state` (plain names) into the trainable tensors of `module`; every one must be there."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(root, writeback=True):
        params = {clean_name(n): p for n, p in module.named_parameters() if p.requires_grad}
        missing = sorted(set(params) - set(state))
        if missing:
            raise KeyError(f"the checkpoint has no value for {len(missing)} adapter tensors, e.g. {missing[0]}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name].to(p.device, p.dtype))


def save_peft_adapter(peft_model: nn.Module, state: Mapping[str, torch.Tensor], adapter_dir: Path) -> None:
    """PEFT's adapter format (`adapter_config.json`, `adapter_model.safetensors`) from gathered adapter tensors.

    `state` is keyed like `PeftModel.state_dict()` (`base_model.model....lora_A.default.weight`). PEFT's own
    `save_pretrained(state_dict=...)` picks the adapter's entries by the model's module paths, which under FSDP carry
    the wrapper names the gathered keys lack, and so saves nothing; the format itself is simple: the adapter name
    dropped from each key.
    """
    from safetensors.torch import save_file

    name = peft_model.active_adapter
    adapter_dir.mkdir(parents=True, exist_ok=True)
    peft_model.peft_config[name].save_pretrained(str(adapter_dir))
    tensors = {k.replace(f".{name}.", "."): v.contiguous() for k, v in state.items()}
    save_file(tensors, str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


class QLoRAFSDPStrategy(FSDPStrategy):
    """Lightning's FSDP with adapter-only checkpoints (see the module docstring); optimiser state as Lightning does.

    It also keeps one FSDP root for the whole run. For `trainer.validate` after `trainer.fit`, Lightning sets the
    strategy up again, finds the decoder layers already wrapped and leaves the LightningModule unwrapped: the root
    unit (embeddings, final norm, head) then stays as flat shards and the embedding fails with "'weight' must be
    2-D" (seen on 2 H200s and reproduced on the CPU). Re-using the first root keeps its parameters managed.
    """

    _root: nn.Module | None = None

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self._root is not None and getattr(self._root, "module", None) is model:
            return self._root
        self._root = super()._setup_model(model)
        return self._root

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return gather_trainable(self.model, self.lightning_module)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Every rank's own optimiser state (the Adam moments of its shards of the adapters), in rank order.

        The adapters' optimiser state is small, so each rank's local state is gathered as it is, instead of FSDP's
        full-state re-sharding: on the CPU reproduction, `optim_state_dict_to_load` gave rank 1 no Adam state at all
        for its shards after a resume. The price: an FSDP run resumes on the same number of processes.
        """
        import torch.distributed as dist
        from lightning.pytorch.core.optimizer import LightningOptimizer

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        local = _to_cpu(optimizer.state_dict())
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        return {"per_rank": gathered}

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))

        try:
            checkpoint = load_checkpoint_file(path)
        except ValueError as e:
            raise ConfigError(f"checkpoint {path} is damaged ({e}); resume from another checkpoint") from None
        restore_trainable(self.model, self.lightning_module, checkpoint.pop("state_dict"))
        if self.lightning_module.trainer.state.fn == "fit" and checkpoint.get("optimizer_states"):
            self._load_optimizer_states(checkpoint["optimizer_states"])
        return checkpoint

    def _load_optimizer_states(self, states: list[dict[str, Any]]) -> None:
        for optimizer, state in zip(self.optimizers, states, strict=True):
            per_rank = state["per_rank"]
            if len(per_rank) != self.world_size:
                raise ConfigError(
                    f"trainer.resume: the checkpoint was written by an FSDP run of {len(per_rank)} processes and this "
                    f"run has {self.world_size}; resume it with hardware.devices={len(per_rank)}"
                )
            optimizer.load_state_dict(per_rank[self.global_rank])


def _to_cpu(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_to_cpu(v) for v in x)
    return x
