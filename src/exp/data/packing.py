"""Packing: several tokenised examples per row of `max_seq_len`, without padding and without cross-example attention.

Each example keeps its own position ids (restarting at 0), and the batch carries `position_ids` and *no*
`attention_mask`: transformers (>= 4.5x, `masking_utils.find_packed_sequence_indices`) then reads the restarts as
sequence boundaries and builds a block-diagonal causal mask for sdpa / eager, or varlen kernels for
flash-attention. The first token of every example never carries a label, so no example is trained to follow the
previous one's `<eos>`; per-example losses equal those of unpacked batches (tests/test_packing.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class Packed:
    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    n_examples: int


def pack(examples: list, max_len: int, ignore_index: int) -> list[Packed]:
    """Best-fit decreasing bin packing of `examples` (objects with input_ids / labels) into rows of <= max_len.

    Deterministic; the row order is shuffled by the DataLoader (seeded). Best-fit decreasing wastes the fewest
    tokens of the simple strategies (efficiency is reported by `exp.preview`).
    """
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i].input_ids))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted: the tightest bin that fits comes first
    for i in order:
        n = len(examples[i].input_ids)
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            space, b = free.pop(j)
            bins[b].append(i)
            bisect.insort(free, (space - n, b))
        else:
            bins.append([i])
            bisect.insort(free, (max_len - n, len(bins) - 1))
    return [concatenate([examples[i] for i in members], ignore_index) for members in bins]


def concatenate(examples: list, ignore_index: int) -> Packed:
    """`examples` end to end in one row, each with its own position ids (from 0) and its first label ignored (never
    predict an example's first token from the one before it). Packing's rows and padding-free micro-batches."""
    ids, labels, pos = [], [], []
    for e in examples:
        ids += e.input_ids
        labels += [ignore_index] + list(e.labels[1:])
        pos += list(range(len(e.input_ids)))
    return Packed(ids, labels, pos, len(examples))
