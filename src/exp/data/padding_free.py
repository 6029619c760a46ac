"""Padding-free micro-batches: an optimiser step's examples laid end to end, cut into micro-batches by tokens.

A step holds the examples plain random batching gives it (`trainer.global_batch_size` of them, in the seeded
order); its micro-batches are rows of concatenated examples instead of padded rectangles. Each example keeps its own
position ids (restarting at 0) and the batch carries `position_ids` and no `attention_mask`: transformers reads the
restarts as sequence boundaries (`masking_utils.find_packed_sequence_indices`) and builds a block-diagonal causal mask
(SDPA, eager), a document mask (`flex_attention`) or varlen kernels (FlashAttention), so no token attends to another
example. The first label of every example is ignored, as in packing: no example learns to follow the previous one.

What changes against padded batches is only where the tokens sit. The step's loss is the mean over all of its loss
tokens (each micro-batch carries its step's total, `exp.training.module.step_token_weighted`), so the step's
gradient is the padded step's (tests/test_padding_free.py checks losses and gradients per family).

Lightning accumulates a fixed number of micro-batches per optimiser step, so the number is one per run: the fewest
(a multiple of the data-parallel ranks) whose token-balanced split of every step of the run keeps each micro-batch
within the token budget. Rows are rounded up to PAD_MULTIPLE tokens so that a compiled model meets few distinct
shapes; that rounding is the only padding.

Attention that computes every query-key pair of a row (eager: Gemma 2, whose logit softcapping SDPA and the varlen
kernel lack) costs a row of T tokens heads x T x T scores, so one long row would cost more than the padded batch it
replaces. `row_tokens` caps the rows: a micro-batch is then several rows of at most `row_tokens` tokens each (as
few rows as first fit needs, their tokens balanced: `pack_rows`), as many rows as the budget has `row_tokens` in it,
padded to its longest row. With `row_tokens` = max_seq_len a micro-batch of m rows holds at most the scores and
activations of m padded rows of max_seq_len, which is what the memory estimate counts.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

# Rows are padded up to a multiple of this many tokens (tensor-core friendly): at most 15 padding tokens per
# micro-batch (0.5% of a 3,000-token one), and a compiled layer meets 1 / 16 as many distinct lengths.
PAD_MULTIPLE = 16
# Steps whose split decides the micro-batch count: the run's steps, but at most this many epochs of them (later
# epochs reshuffle the same lengths; a step there that needs more keeps the count and exceeds the budget slightly).
PLAN_EPOCHS = 20


@dataclass(frozen=True)
class FlatBatching:
    """How padding-free micro-batches are cut: `token_budget` tokens at most per micro-batch, `global_batch_size`
    examples per optimiser step over `world_size` data-parallel ranks, for a run of `max_steps` steps."""

    token_budget: int
    global_batch_size: int
    world_size: int = 1
    max_steps: int = 1
    row_tokens: int | None = None  # the longest row (None: one row per micro-batch)

    @property
    def rows_per_micro_batch(self) -> int | None:
        return None if self.row_tokens is None else max(1, self.token_budget // self.row_tokens)


def balanced_split(indices: list[int], lengths: list[int], parts: int) -> list[list[int]]:
    """`indices` (examples of one step) into `parts` groups of about equal token counts: longest first, each to the
    lightest group so far (ties: the lower group). Each group keeps the step's order. Deterministic."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    lightest = [(0, j) for j in range(parts)]  # (load, group): a heap, so the lightest (then lowest) group is first
    for position in sorted(range(len(indices)), key=lambda p: (-lengths[indices[p]], p)):
        load, g = heapq.heappop(lightest)
        groups[g].append(position)
        heapq.heappush(lightest, (load + lengths[indices[position]], g))
    return [[indices[p] for p in sorted(group)] for group in groups]


def largest_load(groups: list[list[int]], lengths: list[int]) -> int:
    return max(sum(lengths[i] for i in g) for g in groups)


def pack_rows(group: list[int], lengths: list[int], row_tokens: int) -> list[list[int]]:
    """`group`'s examples in rows of at most `row_tokens` tokens: as many rows as first fit (longest first) needs,
    their tokens then balanced (`balanced_split`, improved by `even_out`) where that keeps every row within the cap
    (the micro-batch pads to its longest row, and eager attention costs each row its length squared), else first
    fit's rows. An example longer than the cap gets a row of its own. Each row keeps the group's order.
    Deterministic."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for position in sorted(range(len(group)), key=lambda p: (-lengths[group[p]], p)):
        n = lengths[group[position]]
        target = next((r for r, load in enumerate(loads) if load + n <= row_tokens), None)
        if target is None:
            rows.append([])
            loads.append(0)
            target = len(rows) - 1
        rows[target].append(position)
        loads[target] += n
    first_fit = [[group[p] for p in sorted(row)] for row in rows]
    if len(rows) == 1:
        return first_fit
    balanced = even_out(balanced_split(group, lengths, len(rows)), lengths, group)
    if largest_load(balanced, lengths) <= row_tokens:
        return balanced
    return first_fit


def even_out(groups: list[list[int]], lengths: list[int], order: list[int]) -> list[list[int]]:
    """Lower the heaviest group's load by moving one of its examples to another group, or swapping it for a
    shorter one there, the best such change at a time, until none helps (longest-first greedy leaves a step's few
    examples up to a long example's length apart; the longest row is what the micro-batch pads to). Each change
    lowers the heaviest load or the number of groups that carry it, so it ends. Each group keeps `order` (the
    step's)."""
    rank = {i: p for p, i in enumerate(order)}
    groups = [list(g) for g in groups]
    while True:
        loads = [sum(lengths[i] for i in g) for g in groups]
        heavy = max(range(len(groups)), key=lambda j: (loads[j], -j))
        best = None  # (new larger load of the two groups, example out, example in or None, other group)
        for j, other in enumerate(groups):
            if j == heavy:
                continue
            for a in groups[heavy]:
                for b in [None, *other]:
                    shift = lengths[a] - (0 if b is None else lengths[b])
                    if shift <= 0:
                        continue
                    after = max(loads[heavy] - shift, loads[j] + shift)
                    if after < loads[heavy] and (best is None or after < best[0]):
                        best = (after, a, b, j)
        if best is None:
            return groups
        _, a, b, j = best
        groups[heavy].remove(a)
        groups[j].append(a)
        if b is not None:
            groups[j].remove(b)
            groups[heavy].append(b)
        groups[heavy].sort(key=rank.__getitem__)
        groups[j].sort(key=rank.__getitem__)


def fits(group: list[int], lengths: list[int], plan: FlatBatching) -> bool:
    """Whether `group` makes one micro-batch within the plan: its tokens within the budget, and with capped rows,
    its rows no more than the budget holds."""
    if sum(lengths[i] for i in group) > plan.token_budget:
        return False
    if plan.row_tokens is None:
        return True
    return len(pack_rows(group, lengths, plan.row_tokens)) <= plan.rows_per_micro_batch


def micro_batches_per_step(steps: list[list[int]], lengths: list[int], plan: FlatBatching) -> int:
    """The fewest micro-batches per step (a multiple of the ranks, at most one example each) within the budget."""
    world, most = plan.world_size, plan.global_batch_size
    k = world
    for step in steps:
        while k < most and not all(fits(g, lengths, plan) for g in balanced_split(step, lengths, k)):
            k += world
    return k


def micro_batch_slots(group: list[int], lengths: list[int], row_tokens: int | None) -> int:
    """Token positions (real and padding) of `group`'s micro-batch: one row rounded up to PAD_MULTIPLE, or with capped
    rows, its rows padded to the longest (rounded up)."""
    if row_tokens is None:
        return row_length(sum(lengths[i] for i in group))
    rows = pack_rows(group, lengths, row_tokens)
    return len(rows) * row_length(max(sum(lengths[i] for i in row) for row in rows))


def validation_groups(lengths: list[int], plan: FlatBatching) -> list[list[int]]:
    """The held-out examples (indices into `lengths`) in padding-free micro-batches within `plan` (its token budget
    and row cap): the fewest groups, a multiple of the ranks (so that every rank runs as many forward passes, which
    FSDP's gathers need), of about equal token counts. Without gradients a micro-batch costs less than a training
    one of the same tokens, so the training budget bounds validation's memory too."""
    indices = list(range(len(lengths)))
    if not indices:
        return []
    world = plan.world_size
    fewest = -(-sum(lengths) // plan.token_budget)
    k = min(len(indices), -(-fewest // world) * world)
    groups = balanced_split(indices, lengths, k)
    while k < len(indices) and not all(fits(g, lengths, plan) for g in groups):
        k = min(len(indices), k + world)
        groups = balanced_split(indices, lengths, k)
    return [g for g in groups if g]


def bucket_length(tokens: int) -> int:
    """`tokens` rounded up to one of 4 lengths per doubling (a multiple of a quarter of the power of two below it;
    PAD_MULTIPLE at least): rows of any length from 2^k to 2^(k+1) take one of 4 shapes, and above 4 x PAD_MULTIPLE
    tokens at most a fifth of the row is padding."""
    step = max(PAD_MULTIPLE, (1 << max(tokens - 1, 1).bit_length()) // 8)
    return -(-tokens // step) * step


def row_length(tokens: int) -> int:
    """A micro-batch's row length: its tokens rounded up to PAD_MULTIPLE."""
    return -(-tokens // PAD_MULTIPLE) * PAD_MULTIPLE
