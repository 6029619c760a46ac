"""The baseline's side of the bench, in its worker process: the hand-written loop (exp.bench.baseline_loop) on the
bench's settings, with real data batched the way such a loop batches it, and a preference objective's pairs scored
by exp.bench.preference_loop's step."""

from __future__ import annotations

import functools
from typing import Any

from exp.bench.baseline_loop import BaselineOptions, run_baseline
from exp.bench.preference_loop import STEP_LOSSES
from exp.bench.variants import BenchModel, Settings, Variant
from exp.data.batching import collate, shuffled_batches
from exp.data.datamodule import build_datamodule
from exp.data.preference import PreferenceDataModule, collate_preference
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


def baseline_pair_batches(settings: Settings):
    """A preference objective's steps: `micro_batch` pairs each, in exp's seeded order of its training split (what
    exp's steps hold, however its preflight cuts them into micro-batches), collated as exp collates them."""
    cfg = settings.exp_config()
    tokenizer = build_tokenizer(cfg.model)
    train = PreferenceDataModule(cfg.data, tokenizer, settings.micro_batch, unpaired=False).train_set
    per_epoch = len(train) // settings.micro_batch
    pad = functools.partial(collate_preference, pad_id=tokenizer.pad_token_id)

    def batch(i: int) -> dict[str, Any]:
        epoch, k = divmod(settings.first_step + i, per_epoch)
        return pad([train[j] for j in shuffled_batches(len(train), settings.micro_batch, cfg.data.seed, epoch)[k]])

    return batch, cfg.objective.beta


def run_baseline_worker(settings: Settings, variant: Variant, model: BenchModel) -> dict[str, Any]:
    """The hand-written loop with the variant's levers: its row."""
    step_loss = None
    if settings.objective != "sft":
        batches, beta = baseline_pair_batches(settings)
        val, step_loss = None, STEP_LOSSES[settings.objective](beta)
    else:
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
        step_loss=step_loss,
        autocast=step_loss is not None,
    )
    return {"build_s": round(model.build_s, 2), **out}
