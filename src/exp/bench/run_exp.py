"""exp's side of the bench, in its worker process: the config exp's preflight resolves, the fit `python -m exp.train`
builds (exp.training.fit.build_fit), fed the bench's token batches or its real data, timed by the step clock."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from exp.bench.baseline_loop import token_batch
from exp.bench.clock import StepClock
from exp.bench.variants import BenchModel, Settings, Variant
from exp.core.config import Accelerator
from exp.hardware.memory import estimate_for_config
from exp.hardware.preflight import PreflightResult, check, format_findings, probe_environment
from exp.model.build import decoder_layers
from exp.run.compose import config_dict
from exp.run.tracking import build_loggers
from exp.training.fit import Fit, build_fit


def preflight(settings: Settings, variant: Variant) -> PreflightResult:
    """exp's preflight decides what `python -m exp.train` would: precision, compile, and the checkpointed layers
    from the memory it may use (hardware.memory_budget_gib, or the free memory). Its memory check's refusal is not
    applied: running out of memory is a result here (capacity runs), reported as "oom"."""
    cfg = settings.exp_config(variant.options)
    on_gpu = cfg.hardware.accelerator != Accelerator.cpu
    result = check(cfg, probe_environment(check_bitsandbytes=False, need_gpus=on_gpu))
    refused = [f for f in result.findings if f.key != "memory"]
    if refused:
        raise RuntimeError(format_findings(result))
    return result


def token_batches(settings: Settings, vocab: int, micro_batch_size: int) -> list[dict[str, Any]]:
    """The baseline's token batches (labels = inputs), each step's rows cut into exp's micro-batches (every row is
    full length, so the mean of the micro-batch means is the step's mean)."""
    tokens = [token_batch(i, settings.seed, settings.micro_batch, settings.seq, vocab) for i in range(settings.steps)]
    m = micro_batch_size
    return [{"input_ids": x[k : k + m], "labels": x[k : k + m]} for x in tokens for k in range(0, len(x), m)]


def run_exp_worker(settings: Settings, variant: Variant, work_dir: Path, model: BenchModel) -> dict[str, Any]:
    """exp's own step: QLoRAModule under exp's Trainer, as `exp.train` builds them, fed the bench's batches."""
    result = preflight(settings, variant)
    cfg = result.cfg
    real = bool(settings.data_path)
    # Preference pairs: both sides train the same pairs step by step, compared by their per-step losses alone.
    paired = settings.objective != "sft"
    fit = build_fit(
        cfg,
        work_dir,
        lambda _module: build_loggers(cfg.logger, work_dir, "bench", config_dict(cfg)),
        with_data=real,
        num_workers=0,
        resuming=not real or paired,  # no step-0 evaluation: the bench's own batches have no validation split
    )
    datamodule, module, trainer = fit.datamodule, fit.module, fit.trainer
    # Padding-free batching decides the micro-batches per step from the data.
    accumulate = trainer.accumulate_grad_batches
    if datamodule is not None and settings.first_step:
        datamodule.resume_at(settings.first_step * accumulate)  # the baseline's steps from first_step on
    clock = StepClock(settings.warmup, settings.device == "cuda", accumulate, profile=settings.profile)
    trainer.callbacks.append(clock)
    started = time.perf_counter()
    if datamodule is not None:
        trainer.fit(module, datamodule=datamodule)
    else:
        batches = token_batches(settings, model.vocab, cfg.hardware.micro_batch_size)
        trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    fit_s = time.perf_counter() - started
    val_loss = None
    if datamodule is not None and not paired:
        trainer.validate(module, datamodule=datamodule, verbose=False)
        val_loss = module.last_val["val/loss"]
    return exp_row(result, fit, clock, model, val_loss, fit_s)


def exp_row(
    result: PreflightResult, fit: Fit, clock: StepClock, model: BenchModel, val_loss: float | None, fit_s: float
) -> dict[str, Any]:
    """What an exp variant's row says: how exp ran (its resolved config, the data's batching) and what it measured."""
    cfg, datamodule, module = result.cfg, fit.datamodule, fit.module
    hw = cfg.hardware
    layers = len(decoder_layers(module.model))
    flat = getattr(datamodule, "flat", None)  # preference data is padded, never laid end to end
    return {
        "real_tokens": clock.real_tokens,
        "val_loss": val_loss,
        "micro_batch_exp": hw.micro_batch_size,
        "accumulate": clock.accumulate,
        # Padding-free steps, and preference steps (pairs in the seeded order), hold exactly the baseline's examples:
        # per-step losses compare.
        "same_steps": datamodule is not None and (flat is not None or cfg.objective.preference),
        "micro_batch_tokens": flat.token_budget if flat is not None else None,
        "padding_fraction": datamodule.stats["train"].get("padding_fraction") if datamodule is not None else None,
        "attn_implementation": cfg.model.attn_implementation,
        "compile_stats": module.throughput_summary()["compile"],
        "preflight_notes": result.notes,
        "memory_finding": next((f.message for f in result.findings if f.key == "memory"), None),
        "estimated_gib": round(estimate_for_config(cfg).allocated / 2**30, 2),
        "checkpoint_layers": (hw.checkpoint_layers if hw.checkpoint_layers is not None else layers)
        if hw.gradient_checkpointing
        else 0,
        "layers": layers,
        "memory_budget_gib": hw.memory_budget_gib,
        "build_s": round(model.build_s, 2),
        "fit_s": round(fit_s, 2),
        "step_s": clock.step_s,
        "losses": [float(v) for v in clock.losses],
        "peak_memory_bytes": clock.peak,
        "lora_fingerprint": clock.fingerprint,
        "lora_b_norm": clock.b_norm,
        "profile": clock.profile,
        "dequantized_layers": hw.dequantized_layers,
        "offload_checkpoints": hw.offload_checkpoints,
        "trainable_params": sum(p.numel() for p in module.model.parameters() if p.requires_grad),
        "loss_impl": module.loss_choice.impl.value,
        "loss_impl_reason": module.loss_choice.reason,
        "gradient_checkpointing": hw.gradient_checkpointing,
        "compile": hw.compile,
        "fused_adamw": bool(fit.trainer.optimizers[0].defaults.get("fused")),
        "precision": f"Lightning {hw.precision}",
        "checkpoint": model.path,
    }
