"""Map the typed config onto a Lightning Trainer: placement from `hardware`, the algorithm from `trainer`."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from lightning.pytorch.plugins.precision import Precision

from exp.core.config import Accelerator, TrainConfig
from exp.core.strategies import Strategy, strategy_traits
from exp.model.build import compute_dtype
from exp.model.families import family_row
from exp.run.checkpoints import AtomicCheckpointIO, build_checkpoint_callbacks
from exp.run.logs import StepProgressBar
from exp.training.fsdp import QLoRAFSDPStrategy
from exp.training.precision import build_precision_plugin
from exp.training.preemption import PreemptionCheckpoint
from exp.training.samples import build_sample_callbacks


def build_strategy(cfg: TrainConfig):
    """Lightning strategy for `hardware.strategy` (the preflight has resolved `auto` before this is called)."""

    hw = cfg.hardware
    if hw.strategy == Strategy.ddp:
        from lightning.pytorch.strategies import DDPStrategy

        # Every LoRA parameter takes part in every step, so DDP need not search for unused ones.
        return DDPStrategy(find_unused_parameters=False)
    if hw.strategy == Strategy.fsdp:
        import torch
        from torch.distributed.fsdp import MixedPrecision

        dtype = compute_dtype(hw.precision)
        return QLoRAFSDPStrategy(
            auto_wrap_policy={family_row(cfg.model.family).decoder_layer_class()},
            # Frozen 4-bit and trainable adapter weights share a wrapped layer: keep the original parameters.
            use_orig_params=True,
            # Lightning's bf16-mixed would cast every flat parameter to fp32 before forward, which would turn the
            # packed 4-bit bytes (stored as bf16, see exp.model.build) into numbers. Keep them in the compute dtype.
            mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype),
            state_dict_type="full",
        )
    if hw.strategy == Strategy.model_parallel:
        return _ModelParallelSingleProcess()
    if hw.strategy == Strategy.single_device:
        return "auto"  # one device: Lightning's own single-device strategy
    raise ValueError(f"hardware.strategy={hw.strategy.value} has no Lightning strategy here (build_strategy)")


def _ModelParallelSingleProcess():
    """One process whose model spans several GPUs: Lightning must not move the placed layers to one device."""
    import torch
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class ModelParallelSingleProcess(SingleDeviceStrategy):
        def model_to_device(self) -> None:
            pass  # the layers were placed across the GPUs when loaded; batches go to the first one

    return ModelParallelSingleProcess(device=torch.device("cuda", 0))


def _plugins(cfg: TrainConfig) -> list:
    plugins: list = [AtomicCheckpointIO()]
    hw = cfg.hardware
    # FSDP brings its own precision plugin (sharded scaler, FSDP's mixed-precision policy); every other strategy
    # gets Lightning's mixed precision made to clip fused optimizers (exp.training.precision).
    if hw.strategy != Strategy.fsdp and (precision := build_precision_plugin(hw.precision, hw.accelerator.value)):
        plugins.append(precision)
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if SLURMEnvironment.detect():
        # exp's PreemptionCheckpoint owns SIGUSR1/SIGTERM (checkpoint at a step boundary, exit for a requeue);
        # Lightning's SLURM auto-requeue would save a second, differently named checkpoint from the signal handler.
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins


# PyTorch's caching allocator grows by fixed-size segments; a run whose tensors are a few very large ones (the MLP
# activations of a big micro-batch: 12 GiB each for Gemma-7B at 128 x 2048 tokens) can then fail with more than
# enough memory free in total, split over segments. Expandable segments map more memory into the same segment.
CUDA_ALLOC_CONF = "expandable_segments:True"


def configure_cuda_allocator() -> None:
    """Expandable allocator segments for this process's GPU work, unless PYTORCH_CUDA_ALLOC_CONF is already set
    (the user's choice is kept). Read by torch at the first CUDA allocation, so it must come before any: the
    preflight touches no CUDA, and Lightning allocates only in `fit`."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)


def build_trainer(
    cfg: TrainConfig, output_dir: Path, loggers: list, resuming: bool = False, accumulate: int | None = None
) -> L.Trainer:
    """`accumulate`: micro-batches per optimiser step on one rank, where the data decides it (padding-free
    batching, `InstructionDataModule.flat_accumulation`); by default the config's."""
    hw, t = cfg.hardware, cfg.trainer
    if hw.accelerator != Accelerator.cpu:
        configure_cuda_allocator()
    accumulate = accumulate or cfg.accumulate_grad_batches
    plugins = _plugins(cfg)
    return L.Trainer(
        accelerator=hw.accelerator.value,
        # A model-parallel run is one process (the model spans its GPUs): Lightning drives one device.
        devices=1 if strategy_traits(hw.strategy).spans_devices_in_one_process else hw.devices,
        strategy=build_strategy(cfg),
        num_nodes=hw.num_nodes,
        # Lightning refuses a precision flag next to a precision plugin: the plugin, where there is one, decides.
        precision=None if any(isinstance(p, Precision) for p in plugins) else hw.precision,
        plugins=plugins,
        max_steps=t.max_steps,
        max_epochs=-1,  # max_steps decides; the training stream never ends (exp.data.batching.TrainStream)
        accumulate_grad_batches=accumulate,
        gradient_clip_val=t.max_grad_norm or None,
        # Lightning counts validation intervals in micro-batches, the config in optimiser steps.
        val_check_interval=t.val_every_n_steps * accumulate,
        check_val_every_n_epoch=None,
        limit_val_batches=t.limit_val_batches if t.limit_val_batches is not None else 1.0,
        # The sanity check runs the whole validation split on the untrained adapters: it is the step-0 evaluation.
        # A resumed run has its step-0 evaluation in the checkpoint.
        num_sanity_val_steps=0 if resuming else -1,
        # exp.data.datamodule shards both splits itself (and resumes the training stream mid-epoch).
        use_distributed_sampler=False,
        log_every_n_steps=t.log_every_n_steps,
        logger=loggers or False,
        callbacks=[
            *build_checkpoint_callbacks(cfg, output_dir),
            PreemptionCheckpoint(output_dir, t.checkpoint_every_n_steps),
            StepProgressBar(refresh_rate=10),
            *build_sample_callbacks(cfg, output_dir),
        ],
        default_root_dir=str(output_dir),
        enable_model_summary=False,
    )
