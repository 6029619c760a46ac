"""Data mixtures (`data.mixture`): how many examples each source gives a training epoch, which ones, and what each
source's share of the examples and of the loss tokens came out as.

A source's weight is its share of the examples of every training epoch. An epoch holds as many examples as all
sources' training splits together (N = sum of n_i); source i gives k_i = N x w_i / sum(w) of them (largest
remainders round, so the k_i add up to N). Its k_i examples are drawn *without replacement* from its training
split in a seeded order (data.seed and the source's name): all of it as often as k_i / n_i goes, then the first
k_i mod n_i of one more seeded pass; so a source weighted above its size repeats whole passes (upsampled) and one
below it keeps a seeded subset (downsampled). The draw is made once per data.seed, and the mixed examples are then
batched and shuffled per epoch like any training set (exp.data.batching): a resumed run replays them exactly.

Reading, encoding and the held-out split of each source are `exp.data.splits`' (each source is a single-source
data config: `source_config`).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from exp.core.config import DataConfig, MixtureSource
from exp.data.encoding import Encoded, loss_tokens


def source_config(cfg: DataConfig, source: MixtureSource) -> DataConfig:
    """The single-source data config of one mixture source: its data, format, columns and held-out part, with the
    mixture's encoding settings (max_seq_len, train_on_prompt, seed, ...)."""
    mapped = {f"{name}_field": column for name, column in source.fields.items()}
    return replace(
        cfg,
        format=source.format,
        path=source.path,
        hub_id=source.hub_id,
        split=source.split,
        val_path=source.val_path,
        val_size=source.val_size,
        mixture=[],
        **mapped,
    )


def epoch_counts(sizes: list[int], weights: list[float]) -> list[int]:
    """Examples each source gives an epoch of sum(sizes) examples: proportional to the weights, largest remainders
    rounding (ties to the earlier source), so the counts add up to the epoch."""
    total, weight_sum = sum(sizes), sum(weights)
    exact = [total * w / weight_sum for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def draw(n: int, k: int, seed: int, name: str) -> list[int]:
    """`k` indices into a source of `n` examples, without replacement within each seeded pass over it."""
    out: list[int] = []
    rng = random.Random(f"exp-mixture-{seed}-{name}")
    while len(out) < k:
        order = list(range(n))
        rng.shuffle(order)
        out += order[: k - len(out)]
    return out


def mix(trains: list[list[Encoded]], cfg: DataConfig) -> tuple[list[Encoded], list[int], list[int]]:
    """The mixed training examples (source after source, each source's drawn examples in its draw order), the
    source index of each, and each source's count."""
    sizes = [len(t) for t in trains]
    counts = epoch_counts(sizes, [s.weight for s in cfg.mixture])
    examples: list[Encoded] = []
    sources: list[int] = []
    for i, (train, k) in enumerate(zip(trains, counts, strict=True)):
        examples += [train[j] for j in draw(len(train), k, cfg.seed, cfg.mixture[i].label)] if k else []
        sources += [i] * k
    return examples, sources, counts


def shares(cfg: DataConfig, train: list[Encoded], sources: list[int], trains: list[int], vals: list[Any]) -> list[dict]:
    """Per source: its weight's share, its usable training and held-out examples, and what it holds of one epoch's
    training examples and of their loss tokens (counted on the mixed examples training batches)."""
    total_examples = len(train)
    per_source_tokens = [0] * len(cfg.mixture)
    for e, s in zip(train, sources, strict=True):
        per_source_tokens[s] += loss_tokens(e)
    total_tokens = sum(per_source_tokens) or 1
    weight_sum = sum(s.weight for s in cfg.mixture)
    out = []
    for i, source in enumerate(cfg.mixture):
        examples = sources.count(i)
        out.append(
            {
                "name": source.label,
                "format": source.format.value,
                "weight": source.weight,
                "target_share": round(source.weight / weight_sum, 4),
                "train_rows": trains[i],
                "val_examples": len(vals[i]),
                "epoch_examples": examples,
                "example_share": round(examples / max(total_examples, 1), 4),
                "loss_tokens": per_source_tokens[i],
                "loss_token_share": round(per_source_tokens[i] / total_tokens, 4),
            }
        )
    return out
