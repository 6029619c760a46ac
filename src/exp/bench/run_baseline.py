"""The baseline's side of the bench, in its worker process: the hand-written loop (exp.bench.baseline_loop) on the
bench's settings, with real data batched the way such a loop batches it."""

from __future__ import annotations

from typing import Any

from exp.bench.baseline_loop import BaselineOptions, run_baseline
from exp.bench.variants import BenchModel, Settings, Variant
from exp.data.batching import collate, shuffled_batches
from exp.data.datamodule import build_datamodule
from exp.model.build import build_tokenizer


def real_data(settings: Settings):
    """exp's data module for real-data mode: the tokenised examples and the split both sides use."""
    cfg = settings.exp_config()
    tokenizer = build_tokenizer(cfg.model)
    return cfg, tokenizer, build_datamodule(cfg.data, tokenizer, settings.micro_batch)


def baseline_real_batches(settings: Settings):
    """The hand-written loop's natural batching of real data: each step `micro_batch` examples in exp's seeded
    epoch order (without length grouping), padded to the longest; the validation split in padded batches of 4."""
    cfg, tokenizer, dm = real_data(settings)
    pad = tokenizer.pad_token_id
    per_epoch = len(shuffled_batches(len(dm.train_set), settings.micro_batch, cfg.data.seed, 0))

    def batch(i: int) -> dict[str, Any]:
        epoch, k = divmod(settings.first_step + i, per_epoch)
        indices = shuffled_batches(len(dm.train_set), settings.micro_batch, cfg.data.seed, epoch)[k]
        return collate([dm.train_set[j] for j in indices], pad)

    val = [collate(dm.val_set[k : k + 4], pad) for k in range(0, len(dm.val_set), 4)]
    return batch, val


def run_baseline_worker(settings: Settings, variant: Variant, model: BenchModel) -> dict[str, Any]:
    """The hand-written loop with the variant's levers: its row."""
    batches, val = baseline_real_batches(settings) if settings.data_path else (None, None)
    out = run_baseline(
        model.path,
        seq=settings.seq,
        micro_batch=settings.micro_batch,
        steps=settings.steps,
        warmup=settings.warmup,
        lora_r=settings.lora_r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        lora_targets=settings.lora_targets,
        lr=settings.lr,
        seed=settings.seed,
        device=settings.device,
        options=BaselineOptions.parse(variant.options),
        batches=batches,
        val_batches=val,
    )
    return {"build_s": round(model.build_s, 2), **out}
