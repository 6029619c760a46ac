"""A data config -> its training and held-out examples (`build_splits`), or a whole evaluation set (`all_examples`).

The one place a data config becomes split examples, for training, `exp.evaluate` and `exp.merge` alike: read the
source (`exp.data.sources`), encode it (`exp.data.encoding`, cached), keep the usable rows (bad rows skipped or
refused, per `data.on_bad_rows`), and carve the held-out split.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from exp.core.config import BadRows, ConfigError, DataConfig
from exp.data.encoding import (
    Encoded,
    as_encoded,
    check_position_limit,
    encode_source,
    loss_tokens,
    tokenizer_fingerprint,
)
from exp.data.mixture import mix, shares, source_config
from exp.data.sources import Source, read_source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Splits:
    """The training and held-out examples of a data config, encoded as training sees them, in split order.

    Examples whose response was truncated away are dropped and counted; bad rows are skipped and counted (or fail,
    per `data.on_bad_rows`).
    """

    train: list[Encoded]
    val: list[Encoded]
    # Per split: examples, kept, truncated, dropped, tokens, loss_tokens (see `keep_examples`).
    train_stats: dict[str, int]
    val_stats: dict[str, int]
    bad_rows: int  # in data.path and data.val_path together
    cache_files: list[str]  # the tokenisation cache files of data.path
    val_source: str  # what the held-out split is, for logs and reports (`validation_source`)
    # data.mixture: the source index of each training example, and each source's shares (exp.data.mixture.shares).
    train_sources: list[int] | None = None
    mixture: list[dict] | None = None


def build_splits(cfg: DataConfig, tokenizer: Any) -> Splits:
    """The train / held-out examples of `cfg`, rendered per `data.format` and encoded as training encodes them.

    The only place a data config becomes split examples: the DataModule trains and validates on these, and
    `exp.evaluate` and `exp.merge` score the same held-out examples in the same order. The held-out split is the
    usable rows of `data.val_path`, or `data.val_size` of the usable rows of `data.path` drawn with `data.seed`.
    """
    check_position_limit(cfg, tokenizer)
    tokenizer_fp = tokenizer_fingerprint(tokenizer)
    if cfg.mixture:
        return _mixture_splits(cfg, tokenizer, tokenizer_fp)
    rows, bad_rows, cache_files = usable_encoded(cfg, cfg.path, "data.path", tokenizer, tokenizer_fp)
    if cfg.val_path:
        val_rows, val_bad_rows, _ = usable_encoded(cfg, cfg.val_path, "data.val_path", tokenizer, tokenizer_fp)
        train_split, val_split, bad_rows = rows, val_rows, bad_rows + val_bad_rows
    else:
        train_split, val_split = split_rows(rows, cfg.val_size, cfg.seed)
    train, train_stats = keep_examples(train_split)
    val, val_stats = keep_examples(val_split)
    if not train or not val:
        raise ConfigError(
            f"data.max_seq_len={cfg.max_seq_len} leaves no example with a response token "
            f"(train {len(train)}, val {len(val)} kept): raise data.max_seq_len"
        )
    return Splits(train, val, train_stats, val_stats, bad_rows, cache_files, validation_source(cfg))


def _mixture_splits(cfg: DataConfig, tokenizer: Any, tokenizer_fp: str) -> Splits:
    """data.mixture: each source read, encoded and split as a single source is (its own val_size / val_path, drawn
    with data.seed), its training examples drawn by weight into one training set (exp.data.mixture), its held-out
    examples all validated on (source after source)."""
    trains, vals, bad_rows, cache_files, dropped = [], [], 0, [], 0
    for i, source in enumerate(cfg.mixture):
        scfg, key = source_config(cfg, source), f"data.mixture[{i}]"
        rows, bad, files = usable_encoded(scfg, scfg.path, f"{key}.path", tokenizer, tokenizer_fp)
        if scfg.val_path:
            val_rows, val_bad, _ = usable_encoded(scfg, scfg.val_path, f"{key}.val_path", tokenizer, tokenizer_fp)
            train_split, val_split, bad = rows, val_rows, bad + val_bad
        else:
            train_split, val_split = split_rows(rows, scfg.val_size, cfg.seed)
        train, train_stats = keep_examples(train_split)
        val, val_stats = keep_examples(val_split)
        if not train and source.weight > 0:
            raise ConfigError(
                f"{key} ({source.label}): no training example keeps a response token at data.max_seq_len="
                f"{cfg.max_seq_len}: raise data.max_seq_len, or give the source weight=0"
            )
        trains.append(train)
        vals.append(val)
        bad_rows += bad
        cache_files += files
        dropped += train_stats["dropped"] + val_stats["dropped"]
    mixed, sources, _ = mix(trains, cfg)
    val = [e for v in vals for e in v]
    if not val:
        raise ConfigError("data.mixture: no source has a held-out example; give the sources a val_size or val_path")
    train_stats, val_stats = keep_examples(mixed)[1], keep_examples(val)[1]
    train_stats["dropped"] = dropped  # the sources' (the mixed examples are all kept ones)
    mixture = shares(cfg, mixed, sources, [len(t) for t in trains], vals)
    return Splits(mixed, val, train_stats, val_stats, bad_rows, cache_files, validation_source(cfg), sources, mixture)


def source_name(cfg: DataConfig) -> str:
    """The training source of `cfg` as the user named it: a file, a hub dataset, the generated task or a mixture."""
    if cfg.mixture:
        return f"data.mixture of {', '.join(s.label for s in cfg.mixture)}"
    if cfg.path:
        return f"data.path={cfg.path}"
    if cfg.hub_id:
        return f"data.hub_id={cfg.hub_id} (split {cfg.split})"
    return f"the generated task (data.num_examples={cfg.num_examples})"


def validation_source(cfg: DataConfig) -> str:
    """What the held-out split of `cfg` is: every usable row of data.val_path, or data.val_size of the training
    source's usable rows drawn with data.seed."""
    if cfg.val_path:
        return f"data.val_path={cfg.val_path} (every usable row)"
    if cfg.mixture:
        parts = [
            f"{s.label}: " + (f"val_path={s.val_path}" if s.val_path else f"val_size={s.val_size:g}")
            for s in cfg.mixture
        ]
        return f"each source's held-out part ({'; '.join(parts)}), drawn with data.seed={cfg.seed}"
    return f"data.val_size={cfg.val_size:g} of {source_name(cfg)}, drawn with data.seed={cfg.seed}"


def all_examples(cfg: DataConfig, tokenizer: Any, key: str = "data.path") -> list[Encoded]:
    """Every usable row of `data.path` in source order, encoded as `build_splits` encodes it: a whole evaluation set,
    no split. `key` is the argument that named the path, for messages."""
    check_position_limit(cfg, tokenizer)
    rows, _, _ = usable_encoded(cfg, cfg.path, key, tokenizer, tokenizer_fingerprint(tokenizer))
    kept, _ = keep_examples(rows)
    if not kept:
        raise ConfigError(
            f"{key}={cfg.path}: no row keeps a response token at data.max_seq_len={cfg.max_seq_len}; raise "
            "data.max_seq_len"
        )
    return kept


def split_rows(rows: list[Any], val_size: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Seeded shuffle, then carve the validation split (a fraction < 1 or a count >= 1). Called by `build_splits`:
    the held-out split of a run is a function of its usable rows, `val_size` and `seed`."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_val = int(val_size) if val_size >= 1 else max(1, round(len(rows) * val_size))
    if n_val >= len(rows):
        raise ConfigError(
            f"data.val_size={val_size} leaves no training examples out of {len(rows)} usable rows: lower it "
            "(a fraction like 0.1 or a count) or give a separate data.val_path"
        )
    return [rows[i] for i in order[n_val:]], [rows[i] for i in order[:n_val]]


def usable_rows(cfg: DataConfig, source: Source, encoded) -> list[int]:
    """Indices of rows without problems; bad rows are reported (and skipped) or fail, per `data.on_bad_rows`."""
    errors = encoded["error"]
    bad = [(i, e) for i, e in enumerate(errors) if e]
    if bad:
        shown = "; ".join(f"row {i}: {e}" for i, e in bad[:10]) + (" ..." if len(bad) > 10 else "")
        if cfg.on_bad_rows == BadRows.fail or len(bad) == len(errors):
            fix = (
                "fix the rows, map the columns (data.<name>_field=...), or pass data.on_bad_rows=skip to drop them"
                if len(bad) < len(errors)
                else "no row is usable: check data.format and the column mapping (data.<name>_field=...)"
            )
            raise ConfigError(f"{source.name}: {len(bad)} of {len(errors)} rows unusable ({shown}); {fix}")
        log.warning(
            "data: skipped %d of %d row(s) of %s (rows %s): %s",
            len(bad),
            len(errors),
            source.name,
            [i for i, _ in bad[:20]],
            shown,
        )
    return [i for i, e in enumerate(errors) if not e]


def usable_encoded(
    cfg: DataConfig, path: str | None, key: str, tokenizer: Any, tokenizer_fp: str
) -> tuple[list[Encoded], int, list[str]]:
    """One source's usable rows, encoded (cached), in source order; how many rows were bad; the cache files."""
    source = read_source(cfg, path, key)
    encoded = encode_source(cfg, source, tokenizer, tokenizer_fp)
    rows = as_encoded(encoded)
    usable = usable_rows(cfg, source, encoded)
    return [rows[i] for i in usable], len(rows) - len(usable), [f["filename"] for f in encoded.cache_files]


def keep_examples(split: list[Encoded]) -> tuple[list[Encoded], dict[str, int]]:
    """Drop rows whose response was truncated away (empty encodings), counting what happened."""
    kept = [e for e in split if e.input_ids]
    return kept, {
        "examples": len(split),
        "kept": len(kept),
        "truncated": sum(e.truncated for e in split),
        "dropped": len(split) - len(kept),
        "tokens": sum(len(e.input_ids) for e in kept),
        "loss_tokens": sum(loss_tokens(e) for e in kept),
    }
