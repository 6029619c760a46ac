"""Examples -> batches: the order of every epoch (seeded, replayable), the samplers that shard it over ranks and
resume it mid-epoch, and the collators (padded, packed, padding-free).

Which micro-batches make a padding-free step is `exp.data.padding_free`'s; packing's rows are `exp.data.packing`'s.
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import Sampler

from exp.core.config import ConfigError
from exp.core.constants import IGNORE_INDEX
from exp.data.encoding import Encoded, loss_tokens
from exp.data.packing import Packed, concatenate
from exp.data.padding_free import FlatBatching, micro_batch_slots, pack_rows, row_length


def epoch_rng(seed: int, epoch: int) -> random.Random:
    """The random source of one epoch's data order: a function of (seed, epoch) only, so any epoch is replayable."""
    return random.Random(f"exp-data-order-{seed}-{epoch}")


def shuffled_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch of full batches in a seeded random order (the last, partial batch is dropped)."""
    order = list(range(n))
    epoch_rng(seed, epoch).shuffle(order)
    return [order[k : k + batch_size] for k in range(0, n - batch_size + 1, batch_size)]


def length_grouped_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch of full batches of similar-length examples in a seeded random order (less padding than random).

    Shuffle, cut into mega-batches of 50 batches, sort each by length, cut into batches, shuffle the batches; the
    order depends only on (seed, epoch).
    """
    rng = epoch_rng(seed, epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    mega = batch_size * 50
    batches = []
    for s in range(0, len(order), mega):
        group = sorted(order[s : s + mega], key=lambda i: -lengths[i])
        batches += [group[k : k + batch_size] for k in range(0, len(group), batch_size)]
    batches = [b for b in batches if len(b) == batch_size]
    rng.shuffle(batches)
    return batches


def step_sorted_batches(lengths: list[int], micro_batch: int, per_step: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch of micro-batches, `per_step` to an optimiser step, sorted by length within each step.

    The steps hold the examples `shuffled_batches` would give them (the same seeded order, cut every
    `micro_batch * per_step` examples; the last, partial step is dropped), so what a step learns from does not depend
    on the grouping; inside a step the examples are sorted longest first and cut into its micro-batches.
    """
    step = micro_batch * per_step
    batches = []
    for group in shuffled_batches(len(lengths), step, seed, epoch):
        group = sorted(group, key=lambda i: -lengths[i])
        batches += [group[k : k + micro_batch] for k in range(0, step, micro_batch)]
    return batches


class TrainStream(Sampler[list[int]]):
    """Every micro-batch one rank trains on, epoch after epoch without end, from any position.

    The global sequence is epoch 0's batches, then epoch 1's, ... (`epoch_batches(e)`, a pure function of e);
    rank r of w takes global batches r, r + w, r + 2w, ... A run is counted in optimiser steps, not epochs, so the
    loader never ends (Lightning stops at max_steps) and every optimiser step takes exactly the same number of
    micro-batches. `start` is how many micro-batches this rank has already trained on: a resumed run passes the
    count its checkpoint recorded and continues mid-epoch with exactly the batch it would have seen next.
    """

    def __init__(self, epoch_batches, rank: int = 0, world_size: int = 1, start: int = 0):
        self.epoch_batches, self.rank, self.world_size, self.start = epoch_batches, rank, world_size, start
        self.batches_per_epoch = len(epoch_batches(0))
        if self.batches_per_epoch < world_size:
            raise ConfigError(
                f"the training split has {self.batches_per_epoch} full micro-batches per epoch, fewer than the "
                f"{world_size} data-parallel processes: lower hardware.micro_batch_size or use more data"
            )

    def position(self, consumed: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of the next global batch after `consumed` on this rank."""
        return divmod(consumed * self.world_size + self.rank, self.batches_per_epoch)

    def __iter__(self):
        consumed = self.start
        epoch, cached = -1, []
        while True:
            e, i = self.position(consumed)
            if e != epoch:
                epoch, cached = e, self.epoch_batches(e)
            yield cached[i]
            consumed += 1


class ShardSampler(Sampler[int]):
    """Rank r of w takes examples r, r + w, ... (of `order`, default 0..n-1): every example evaluated exactly once
    across ranks, none repeated (Lightning's DistributedSampler pads with repeats, which would count some examples
    twice in summed metrics)."""

    def __init__(self, n: int, rank: int = 0, world_size: int = 1, order: list[int] | None = None):
        order = list(range(n)) if order is None else order
        self.indices = order[rank::world_size]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def padding_stats(rows: list, batches: list[list[int]], flat: FlatBatching | None = None) -> dict[str, float]:
    """Padding fraction and loss-bearing tokens per batch for `batches` (lists of indices into `rows`), padded to
    the longest row or (`flat`) laid end to end as exp.data.padding_free lays them."""
    slots = real = loss = 0
    for b in batches:
        lens = [len(rows[i].input_ids) for i in b]
        if flat is not None:
            slots += micro_batch_slots(list(range(len(b))), lens, flat.row_tokens)
        else:
            slots += max(lens) * len(b)
        real += sum(lens)
        loss += sum(loss_tokens(rows[i]) for i in b)
    return {
        "padding_fraction": round(1 - real / slots, 4) if slots else 0.0,
        "loss_tokens_per_batch": round(loss / len(batches), 1) if batches else 0.0,
        "batches": len(batches),
    }


def collate(examples: list[Encoded | Packed], pad_id: int, width: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row of the batch (or to `width`); padding is masked out and never a label.

    Packed rows get `position_ids` (restarting per example) and no `attention_mask`: transformers then builds
    the block-diagonal mask from the position restarts (see `exp.data.packing`), and their sequence boundaries
    (`sequence_boundaries`) for varlen attention. Padding in a packed batch forms its own short "sequence"
    (positions from 0) that no real token attends to.
    """
    width = max(width or 0, max(len(e.input_ids) for e in examples))
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    packed = isinstance(examples[0], Packed)
    positions = torch.arange(width).repeat(len(examples), 1) if packed else None
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
        if packed:
            positions[i, :n] = torch.tensor(e.position_ids)
            positions[i, n:] = torch.arange(width - n)
    if packed:
        return {"input_ids": ids, "labels": labels, "position_ids": positions, **sequence_boundaries(positions)}
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sequence_boundaries(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """Where the examples of position-id rows begin and end, rows flattened end to end, under transformers' names
    for varlen attention (exp.model.varlen reads them; other attention implementations ignore them). Every restart
    at 0 begins an example; a row's padding tail (positions from 0) is a sequence of its own that no real token
    sees. The longest length is a Python int: read on the GPU it would cost a host sync every step."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    ends = torch.cat([starts[1:], torch.tensor([flat.numel()])])
    cu = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    longest = int((ends - starts).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


class StepTokens:
    """Training rows addressed as (index, loss tokens of the index's optimiser step): each micro-batch carries its
    step's total, from which the module weights the micro-batch's loss (exp.training.module)."""

    def __init__(self, rows: list):
        self.rows = rows

    def __getitem__(self, key: tuple[int, int]) -> tuple[Encoded | Packed, int]:
        index, step_tokens = key
        return self.rows[index], step_tokens

    def __len__(self) -> int:
        return len(self.rows)


def collate_with_step_tokens(items: list[tuple[Encoded | Packed, int]], pad_id: int) -> dict[str, torch.Tensor]:
    batch = collate([e for e, _ in items], pad_id)
    batch["step_loss_tokens"] = torch.tensor(float(items[0][1]))
    return batch


def collate_flat(
    items: list[tuple[Encoded, int]], pad_id: int, row_tokens: int | None = None
) -> dict[str, torch.Tensor]:
    """A padding-free micro-batch (exp.data.padding_free) with its step's loss-token total and its real token count
    (`real_tokens`, read and removed by the module before the model sees the batch)."""
    batch = flat_rows([e for e, _ in items], pad_id, row_tokens)
    batch["step_loss_tokens"] = torch.tensor(float(items[0][1]))
    batch["real_tokens"] = torch.tensor(sum(len(e.input_ids) for e, _ in items))
    return batch


def flat_rows(examples: list[Encoded], pad_id: int, row_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Examples end to end (a padding-free micro-batch; validation's as it is, training's with its step total):
    one row, or (`row_tokens`) rows of at most that many tokens (`pack_rows`), each rounded
    up to PAD_MULTIPLE tokens and padded to the longest."""
    lengths = [len(e.input_ids) for e in examples]
    groups = (
        [list(range(len(examples)))]
        if row_tokens is None
        else pack_rows(list(range(len(examples))), lengths, row_tokens)
    )
    rows = [concatenate([examples[i] for i in g], IGNORE_INDEX) for g in groups]
    return collate(rows, pad_id, width=row_length(max(len(r.input_ids) for r in rows)))
