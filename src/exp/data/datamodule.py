"""The LightningDataModule: the splits of `exp.data.splits`, batched for training and validation (padded, length-grouped,
packed or padding-free), and `build_datamodule` / `build_run_datamodule`, which make it from a config."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from exp.core.config import ConfigError, DataConfig, LengthGrouping, Objective, TrainConfig
from exp.core.constants import IGNORE_INDEX
from exp.data.batching import (
    ShardSampler,
    StepTokens,
    TrainStream,
    collate,
    collate_flat,
    collate_with_step_tokens,
    flat_rows,
    length_grouped_batches,
    padding_stats,
    shuffled_batches,
    step_sorted_batches,
)
from exp.data.encoding import loss_tokens, majority_token_accuracy
from exp.data.packing import pack
from exp.data.padding_free import PLAN_EPOCHS, FlatBatching, balanced_split, micro_batches_per_step, validation_groups
from exp.data.preference import PreferenceDataModule
from exp.data.splits import Splits, build_splits
from exp.data.streaming import StreamingDataModule

log = logging.getLogger(__name__)


class InstructionDataModule(L.LightningDataModule):
    """The splits of `build_splits`, batched: training padded, length-grouped, packed or padding-free (`flat`:
    exp.data.padding_free); validation padding-free with padding-free training, else padded in batches of similar
    length."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Any,
        micro_batch_size: int,
        num_workers: int = 0,
        step_micro_batches: int = 1,
        flat: FlatBatching | None = None,
    ):
        super().__init__()
        self.cfg, self.tokenizer = cfg, tokenizer
        self.micro_batch_size, self.num_workers = micro_batch_size, num_workers
        # Micro-batches per optimiser step over all data-parallel ranks (accumulation x ranks).
        self.step_micro_batches = step_micro_batches
        splits = build_splits(cfg, tokenizer)
        self.train_set, self.val_set = splits.train, splits.val
        self.encoded_cache_files = splits.cache_files
        # Copies: the train entry gains this module's batching statistics, which are not a property of the split.
        self.stats: dict[str, Any] = {
            "train": dict(splits.train_stats),
            "val": dict(splits.val_stats),
            "bad_rows": splits.bad_rows,
            "validated_on": splits.val_source,
        }
        if splits.mixture is not None:  # data.mixture: each source's share of the examples and the loss tokens
            self.stats["mixture"] = splits.mixture
        self.packed = pack(self.train_set, cfg.max_seq_len, IGNORE_INDEX) if cfg.packing else None
        # Packing has its own meaning of a step (rows, not examples): it wins over padding-free batching.
        self.flat = flat if self.packed is None else None
        if self.flat is not None:
            self.step_micro_batches = self._flat_micro_batches()
        self.stats["train"].update(self.train_batch_stats())
        self._log_counts(splits)

    def _log_counts(self, splits: Splits) -> None:
        """The split sizes, what was dropped or skipped, and how training batches its examples, for the log."""
        train, val = splits.train_stats, splits.val_stats
        log.info(
            "data: %d train / %d val examples (%d truncated, %d dropped with no response left, %d bad rows); "
            "%.1f loss-bearing tokens per train batch, %.1f%% padding%s",
            len(self.train_set),
            len(self.val_set),
            train["truncated"] + val["truncated"],
            train["dropped"] + val["dropped"],
            splits.bad_rows,
            self.stats["train"]["loss_tokens_per_batch"],
            100 * self.stats["train"]["padding_fraction"],
            self._batching_note(),
        )
        log.info("data: validating on %s", splits.val_source)
        for m in splits.mixture or []:
            log.info(
                "data: mixture source %s: %d of %d examples per epoch (%.1f%%, weight %.1f%%), %.1f%% of the loss tokens",
                m["name"],
                m["epoch_examples"],
                len(self.train_set),
                100 * m["example_share"],
                100 * m["target_share"],
                100 * m["loss_token_share"],
            )

    def _batching_note(self) -> str:
        """What the log line adds for packed or padding-free training (nothing for padded batches)."""
        if self.packed is not None:
            return f", {len(self.packed)} packed rows"
        if self.flat is None:
            return ""
        rows = f" in rows of <= {self.flat.row_tokens} tokens" if self.flat.row_tokens is not None else ""
        return (
            f", padding-free: {self.step_micro_batches} micro-batch(es) of <= {self.flat.token_budget} tokens per "
            f"step{rows}"
        )

    def _flat_micro_batches(self) -> int:
        """Micro-batches per optimiser step (all ranks) of padding-free batching: the fewest that keep every step
        of the run (its first PLAN_EPOCHS epochs at most) within the token budget (exp.data.padding_free)."""
        plan, lengths = self.flat, self._lengths()
        per_epoch = len(self.train_set) // plan.global_batch_size
        if per_epoch == 0:
            raise ConfigError(
                f"the training split has {len(self.train_set)} examples, fewer than one optimiser step's "
                f"{plan.global_batch_size} (trainer.global_batch_size): lower trainer.global_batch_size or use more "
                "data"
            )
        epochs = min(PLAN_EPOCHS, -(-plan.max_steps // per_epoch))
        steps = [
            s for e in range(epochs) for s in shuffled_batches(len(lengths), plan.global_batch_size, self.cfg.seed, e)
        ]
        return micro_batches_per_step(steps[: plan.max_steps], lengths, plan)

    def train_batch_stats(self) -> dict[str, float]:
        """Padding and loss-bearing tokens per batch of one training epoch, as the train loader batches it."""
        rows = self.packed if self.packed is not None else self.train_set
        stats = padding_stats(rows, self.train_epoch_batches(0), flat=self.flat)
        if self.flat is not None:
            stats["micro_batches_per_step"] = self.step_micro_batches
            stats["token_budget"] = self.flat.token_budget
            if self.flat.row_tokens is not None:
                stats["row_tokens"] = self.flat.row_tokens
        if self.packed is not None:
            tokens = sum(len(e.input_ids) for e in self.train_set)
            stats["packed_rows"] = len(self.packed)
            stats["packing_efficiency"] = round(tokens / (len(self.packed) * self.cfg.max_seq_len), 4)
        return stats

    @functools.cached_property
    def _loss_tokens(self) -> list[int]:
        return [loss_tokens(e) for e in self.train_set]

    def _lengths(self) -> list[int]:
        return [len(e.input_ids) for e in self.train_set]

    def majority_token_accuracy(self) -> float:
        """Accuracy on validation labels of always guessing the most frequent training label: the chance line."""
        return majority_token_accuracy(self.train_set, self.val_set)

    def _collate(self):
        return functools.partial(collate, pad_id=self.tokenizer.pad_token_id)

    def _val_order(self) -> list[int]:
        """The held-out examples longest first (ties in split order)."""
        return sorted(range(len(self.val_set)), key=lambda i: (-len(self.val_set[i].input_ids), i))

    def resume_at(self, batches_seen: int) -> None:
        """Start the training stream after `batches_seen` micro-batches (per rank): set by a resumed checkpoint."""
        self.start_batch = batches_seen

    def _rank(self) -> tuple[int, int]:
        """This process's data-parallel rank and the number of ranks (0, 1 outside a Trainer)."""
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    @property
    def step_weighted(self) -> bool:
        """Whether micro-batches carry their step's loss-token total (padding-free, length grouping within steps)."""
        if self.flat is not None:
            return True
        return self.cfg.group_by_length and self.packed is None and self.cfg.length_grouping == LengthGrouping.step

    @property
    def flat_accumulation(self) -> int | None:
        """Padding-free: the micro-batches per optimiser step on one rank (what the Trainer accumulates, decided here
        from the data); None otherwise (the config's trainer.global_batch_size / micro-batch / ranks)."""
        return self.step_micro_batches // self.flat.world_size if self.flat is not None else None

    def train_epoch_batches(self, epoch: int) -> list[list[int]]:
        """The global micro-batches of training epoch `epoch`, in order (all ranks together)."""
        if self.flat is not None:
            lengths, k = self._lengths(), self.step_micro_batches
            steps = shuffled_batches(len(lengths), self.flat.global_batch_size, self.cfg.seed, epoch)
            return [group for step in steps for group in balanced_split(step, lengths, k)]
        if self.step_weighted:
            return step_sorted_batches(
                self._lengths(), self.micro_batch_size, self.step_micro_batches, self.cfg.seed, epoch
            )
        if self.cfg.group_by_length and self.packed is None:
            return length_grouped_batches(self._lengths(), self.micro_batch_size, self.cfg.seed, epoch)
        rows = self.packed if self.packed is not None else self.train_set
        return shuffled_batches(len(rows), self.micro_batch_size, self.cfg.seed, epoch)

    @property
    def batches_per_epoch(self) -> int:
        """Full micro-batches in one pass over the training split (all ranks together)."""
        return len(self.train_epoch_batches(0))

    def _step_token_batches(self, epoch: int) -> list[list[tuple[int, int]]]:
        """`train_epoch_batches` with each index paired with its optimiser step's loss tokens (all ranks)."""
        batches, k, tokens = self.train_epoch_batches(epoch), self.step_micro_batches, self._loss_tokens
        out = []
        for s in range(0, len(batches), k):
            step = batches[s : s + k]
            total = sum(tokens[i] for b in step for i in b)
            out += [[(i, total) for i in b] for b in step]
        return out

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank()
        weighted = self.step_weighted
        if weighted and self.flat is None and self.batches_per_epoch == 0:
            raise ConfigError(
                f"the training split has {len(self.train_set)} examples, fewer than one optimiser step's "
                f"{self.micro_batch_size * self.step_micro_batches} (trainer.global_batch_size): lower "
                "trainer.global_batch_size or use more data"
            )
        epoch_batches = self._step_token_batches if weighted else self.train_epoch_batches
        stream = TrainStream(epoch_batches, rank, world, start=getattr(self, "start_batch", 0))
        rows = self.packed if self.packed is not None else self.train_set
        return DataLoader(
            StepTokens(rows) if weighted else rows,
            batch_sampler=stream,
            collate_fn=(
                functools.partial(collate_flat, pad_id=self.tokenizer.pad_token_id, row_tokens=self.flat.row_tokens)
                if self.flat is not None
                else functools.partial(collate_with_step_tokens, pad_id=self.tokenizer.pad_token_id)
                if weighted
                else self._collate()
            ),
            num_workers=self.num_workers,
            # The loader's own generator seeds its workers: iterating it never draws from the global RNG, so a
            # resumed run's dropout masks (global RNG, restored from the checkpoint) match the uninterrupted run's.
            generator=torch.Generator().manual_seed(self.cfg.seed),
        )

    def val_dataloader(self) -> DataLoader:
        # Never packed: validation metrics (exact match) are per example. The metrics are sums over the split, so the
        # order is free. Padding-free training validates padding-free too (exp.data.padding_free.validation_groups:
        # the held-out examples end to end in token-budget rows, each example scored apart by its position
        # restarts); padded, the examples go longest first, so that each batch pads to a similar length (a
        # step-0 validation of real data in split order is mostly padding) and the first batch shows the peak.
        rank, world = self._rank()
        if self.flat is not None:
            lengths = [len(e.input_ids) for e in self.val_set]
            groups = validation_groups(lengths, replace(self.flat, world_size=world))
            return DataLoader(
                self.val_set,
                batch_sampler=groups[rank::world],
                collate_fn=functools.partial(
                    flat_rows, pad_id=self.tokenizer.pad_token_id, row_tokens=self.flat.row_tokens
                ),
                num_workers=self.num_workers,
            )
        return DataLoader(
            self.val_set,
            batch_size=self.micro_batch_size,
            sampler=ShardSampler(len(self.val_set), rank, world, order=self._val_order()),
            collate_fn=self._collate(),
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.cfg.seed),
        )


def build_datamodule(
    cfg: DataConfig,
    tokenizer: Any,
    micro_batch_size: int,
    num_workers: int = 0,
    step_micro_batches: int = 1,
    flat: FlatBatching | None = None,
):
    """The DataModule for `cfg`: reads, checks and tokenises the data (cached), ready for `trainer.fit`.

    `step_micro_batches`: micro-batches per optimiser step over all data-parallel ranks (gradient accumulation x
    ranks), the unit `data.length_grouping=step` sorts within. `flat`: padding-free micro-batches instead
    (exp.data.padding_free; the module then decides the micro-batches per step, `accumulate_grad_batches`).
    """
    return InstructionDataModule(cfg, tokenizer, micro_batch_size, num_workers, step_micro_batches, flat)


def flat_batching(cfg: TrainConfig) -> FlatBatching | None:
    """The padding-free batching `hardware.padding_free` asks for (None: padded, or `data.packing`, which wins)."""
    hw = cfg.hardware
    if not hw.padding_free or cfg.data.packing or cfg.data.streaming:
        return None
    budget = hw.micro_batch_tokens or hw.micro_batch_size * cfg.data.max_seq_len
    # Eager attention computes all T x T scores of a row: rows capped at max_seq_len cost what padded rows do.
    rows = cfg.data.max_seq_len if cfg.model.attn_implementation == "eager" else None
    return FlatBatching(budget, cfg.trainer.global_batch_size, cfg.data_parallel_size, cfg.trainer.max_steps, rows)


def build_run_datamodule(cfg: TrainConfig, tokenizer: Any, num_workers: int | None = None) -> InstructionDataModule:
    """The DataModule a training run of `cfg` uses (its micro-batches, accumulation and ranks); preference
    objectives read pairs (exp.data.preference), `data.streaming` a stream (exp.data.streaming)."""
    workers = cfg.hardware.num_workers if num_workers is None else num_workers
    if cfg.data.streaming:
        if cfg.hardware.padding_free or cfg.data.group_by_length or workers:
            log.info("data: streaming: padded micro-batches in the stream's order, read in the training process")
        return StreamingDataModule(cfg.data, tokenizer, cfg.hardware.micro_batch_size)
    if cfg.objective.preference:
        unpaired = cfg.objective.kind == Objective.kto
        step = cfg.accumulate_grad_batches * cfg.data_parallel_size
        return PreferenceDataModule(
            cfg.data, tokenizer, cfg.hardware.micro_batch_size, unpaired, workers, step, flat=cfg.hardware.padding_free
        )
    return build_datamodule(
        cfg.data,
        tokenizer,
        cfg.hardware.micro_batch_size,
        workers,
        cfg.accumulate_grad_batches * cfg.data_parallel_size,
        flat_batching(cfg),
    )
