"""Whether this machine can hold the bench's model at all, told before any worker starts (the parent's check)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exp.hardware.memory import base_param_count, config_arch, resident_bytes
from exp.hardware.preflight import probe_environment
from exp.model.local import MAX_SHARD_BYTES, random_checkpoint_dir


@dataclass
class MemoryFigures:
    """The memory the bench's workers can have; None where it cannot be told."""

    host_available: int | None  # bytes the host can still give (/proc/meminfo's MemAvailable)
    gpu_free: int | None  # bytes free on the GPU the workers train on (device=cuda only)


def memory_figures(device: str) -> MemoryFigures:
    """This machine's `MemoryFigures` for `device`."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        host = int(re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M).group(1)) * 1024
    except (OSError, AttributeError):  # not Linux: nothing to go on
        host = None
    gpu = None
    if device == "cuda":
        # probe_environment asks a subprocess: a CUDA context in this process would hold memory the workers need
        # all along.
        gpus = probe_environment(need_gpus=True).gpus
        gpu = gpus[0].free_bytes if gpus else None
    return MemoryFigures(host, gpu)


def memory_problem(cfg: Any, device: str, figures: MemoryFigures) -> str:
    """Why the model of the composed config `cfg` cannot run on `device` with this memory ('' when it can, or when
    the figures do not say), told before any worker starts: the OOM killer ends a process without a word, and a
    model that cannot fit fails every variant alike.

    The random weights (model.random_init) are drawn in bf16 on the device that builds them, the GPU under CUDA and
    the host otherwise (exp.model.local), and written into exp's cache one shard at a time through host memory; once
    built they are reused. On the CPU the host also holds the model every worker trains; on CUDA the GPU must hold
    the quantized base, the adapters, their gradients and optimiser state before any activation
    (exp.hardware.memory.resident_bytes), whatever micro-batch or checkpointing a variant then chooses.
    """
    model, host, gpu = cfg.model.name, figures.host_available, figures.gpu_free
    weights = 2 * base_param_count(config_arch(cfg), cfg.model.family)
    built = random_checkpoint_dir(cfg.model.family, dict(cfg.model.arch), cfg.model.seed).is_dir()
    if device == "cpu":
        if host is not None and weights > host:
            return (
                f"model={model}: its random weights alone take {_gib(weights)} GiB (bf16) and this machine has "
                f"{_gib(host)} GiB available, so the operating system would kill the bench. Fix: a smaller model "
                "(model=gemma_tiny), or device=cuda on a GPU."
            )
        return ""
    if not built and gpu is not None and weights > gpu:
        return (
            f"model={model}: its random weights are drawn on the GPU in bf16 (once, into exp's cache) and take "
            f"{_gib(weights)} GiB, and the GPU has {_gib(gpu)} GiB free, so the first variant would run out of memory "
            "before anything is measured. Fix: a smaller model (model=gemma_tiny), or a GPU with that much free memory."
        )
    if not built and host is not None and (shard := min(weights, MAX_SHARD_BYTES)) > host:
        return (
            f"model={model}: writing its random weights into exp's cache takes {_gib(shard)} GiB of host memory (one "
            f"checkpoint shard at a time) and this machine has {_gib(host)} GiB available, so the operating system "
            "would kill the bench. Fix: free host memory, or a smaller model (model=gemma_tiny)."
        )
    if gpu is not None and (resident := resident_bytes(cfg)) > gpu:
        quant = getattr(cfg.quantization.quant_type, "value", cfg.quantization.quant_type)
        return (
            f"model={model}: quantized ({quant}) with its LoRA adapters (lora_r={cfg.lora.r}), their gradients and "
            f"optimiser state and CUDA's own memory, it needs at least {_gib(resident)} GiB on the GPU before any "
            f"activation (exp.hardware.memory), and the GPU has {_gib(gpu)} GiB free, so no variant could take a "
            "step. Fix: a smaller model (model=gemma_tiny), a GPU with more free memory, or smaller adapters "
            "(lora_r=, lora_targets=)."
        )
    return ""


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"
