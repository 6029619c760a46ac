"""Examples -> token ids -> batches: sources, tokenisation (cached), masks, splits, batching, the DataModule.

Per-format rendering lives in `exp.data.formats`, packing in `exp.data.packing`; this module does what is common to all
formats: read the source with `datasets`, encode every row once (cached by fingerprint under the exp cache),
collect bad rows, carve the validation split (`build_splits`, the one place a data config becomes train / held-out
examples, for training, `exp.evaluate` and `exp.merge` alike), and batch (padded, length-grouped or packed).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from exp.core.cache import cache_dir, ensure_entry
from exp.core.config import BadRows, ConfigError, DataConfig, DataFormat, LengthGrouping, TrainConfig
from exp.core.constants import IGNORE_INDEX
from exp.data.files import READERS, diagnose, list_files, missing_columns
from exp.data.formats import BadRow, Rendered, format_prompt, render_row
from exp.data.packing import Packed, concatenate, pack
from exp.data.padding_free import (
    PLAN_EPOCHS,
    FlatBatching,
    balanced_split,
    micro_batch_slots,
    micro_batches_per_step,
    pack_rows,
    row_length,
    validation_groups,
)
from exp.data.synthetic import generate_examples
from exp.data.worker import run_in_child

log = logging.getLogger(__name__)
# Bump when the encoding changes, so cached tokenisations are not reused.
ENCODING_VERSION = 1
# Rows above which tokenisation runs in parallel processes (below, process start-up costs more than it saves).
PARALLEL_ROWS = 20_000

__all__ = [
    "IGNORE_INDEX",
    "Encoded",
    "InstructionDataModule",
    "Splits",
    "all_examples",
    "build_datamodule",
    "build_splits",
    "collate",
    "encode_rendered",
    "format_prompt",
]


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool = False  # cut at max_seq_len (an empty encoding: its response was cut off entirely)


# ---------------------------------------------------------------------------------------------------- encoding


def encode_rendered(
    tokenizer: Any, rendered: Rendered, max_seq_len: int, train_on_prompt: bool
) -> tuple[Encoded | None, bool]:
    """Token ids and labels for rendered pieces; (None, truncated) when no response token is left.

    Pieces are tokenised without special tokens (Gemma's tokenizer would add its own `<bos>` to each) and
    concatenated, so a mask boundary is always a token boundary. `<bos>` is prepended unless the rendering
    already starts with it (chat templates do): exactly one per sequence. `<eos>` ends the last response of
    plain formats. Response pieces (and `<eos>`) carry the loss; prompt pieces only with `train_on_prompt`.
    """
    ids: list[int] = []
    is_response: list[bool] = []
    for text, response in zip(rendered.texts, rendered.response, strict=True):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids += piece
        is_response += [response] * len(piece)
    if rendered.add_eos:
        ids.append(tokenizer.eos_token_id)
        is_response.append(True)
    if not ids or ids[0] != tokenizer.bos_token_id:
        ids.insert(0, tokenizer.bos_token_id)
        is_response.insert(0, False)
    if not any(is_response[1:]):
        raise BadRow("the rendering has no response token (check the template / the response field)")
    truncated = len(ids) > max_seq_len
    ids, is_response = ids[:max_seq_len], is_response[:max_seq_len]
    if not any(is_response[1:]):  # the response is entirely cut off: nothing to learn from
        return None, True
    labels = (
        ids.copy() if train_on_prompt else [t if r else IGNORE_INDEX for t, r in zip(ids, is_response, strict=True)]
    )
    return Encoded(ids, labels, truncated), truncated


def _encode_row(row: dict[str, Any], cfg: DataConfig, tokenizer: Any) -> dict[str, Any]:
    """`datasets.map` function: one row -> ids, labels and what happened (error / truncated / dropped)."""
    try:
        enc, truncated = encode_rendered(
            tokenizer, render_row(cfg, row, tokenizer), cfg.max_seq_len, cfg.train_on_prompt
        )
    except BadRow as e:
        return {"input_ids": [], "labels": [], "truncated": False, "error": str(e)}
    if enc is None:
        return {"input_ids": [], "labels": [], "truncated": True, "error": ""}
    return {"input_ids": enc.input_ids, "labels": enc.labels, "truncated": truncated, "error": ""}


# ---------------------------------------------------------------------------------------------------- sources


@dataclass
class Source:
    """Rows as a `datasets.Dataset`, a name for messages (the file or hub id) and a stable fingerprint."""

    rows: Any
    name: str
    fingerprint: str


def read_source(cfg: DataConfig, path: str | None, key: str) -> Source:
    """Read a local file / directory (`path`), or a hub dataset (cache first), or generate the synthetic rows.

    `path` is the file the caller names (data.path, or data.val_path for the held-out split): a file is read for
    every format, the synthetic one included (its rows are Alpaca rows), so no named file is ever replaced by
    generated examples."""
    import datasets

    datasets.disable_progress_bars()  # a bar per small map / read is noise; large runs log their counts
    if cfg.format == DataFormat.synthetic and not path:
        rows = generate_examples(cfg.num_examples, cfg.seed)
        digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
        return Source(datasets.Dataset.from_list(rows), "synthetic", digest)
    if path:
        files = list_files(path, key)
        ds = _read_files(files, path, key)
        stamp = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        return Source(ds, path, hashlib.sha256(json.dumps(stamp).encode()).hexdigest())
    try:
        ds = datasets.load_dataset(cfg.hub_id, split=cfg.split)
    except Exception as e:
        raise ConfigError(
            f"data.hub_id={cfg.hub_id} (split {cfg.split}): not in the local datasets cache and the hub could not "
            f"be reached or has no such dataset ({type(e).__name__}: {_short(e)}). Download it once on a connected "
            "machine (it is then cached under ~/.cache/huggingface/datasets), or save it as JSONL and pass "
            "data.path=<file>."
        ) from e
    return Source(ds, cfg.hub_id, ds._fingerprint)


# What a readable file of each reader looks like: the end of the message for one `datasets` cannot read.
VALID_FORM = {
    "json": "JSON (one array of objects) or JSONL (one object per line)",
    "csv": "CSV (a header row of column names, then one row per example; fields with commas, quotes or line breaks "
    "quoted, a quote inside doubled)",
    "parquet": "Parquet (as pandas' to_parquet or pyarrow write it)",
}


def _read_files(files: list[Path], path: str, key: str):
    """`datasets` reads the checked files; when it cannot, the files are diagnosed (which file, which line), and a
    reader that fails on files with nothing wrong gets one more try with its cache entry rebuilt."""
    import datasets

    builder = READERS[files[0].suffix]
    # CSV goes through pandas, which would keep a UTF-8 byte-order mark in the first column's name.
    options = {"encoding": "utf-8-sig"} if builder == "csv" else {}

    # `datasets` reads data_files as glob patterns: the files are checked paths, so their `[`, `*`, `?` are literal.
    patterns = [glob.escape(str(f)) for f in files]

    def read(**kwargs):
        return datasets.load_dataset(
            builder, data_files=patterns, split="train", cache_dir=str(_cache("datasets")), **kwargs
        )

    try:
        return read(**options)
    except Exception as e:  # datasets raises several types for unreadable files
        error = e
    if problem := diagnose(files, key):
        raise ConfigError(problem) from error
    try:
        ds = read(download_mode="force_redownload", **options)
    except Exception:  # noqa: BLE001 (the first error is the one to report)
        raise ConfigError(
            f"{key}={path}: could not be read as {builder.upper()} ({type(error).__name__}: {_short(error)}). "
            f"Check that the file is valid {VALID_FORM[builder]}."
        ) from error
    log.warning(
        "data: reading %s failed (%s: %s) but the files are sound; rebuilt its datasets cache entry under %s",
        path,
        type(error).__name__,
        _short(error),
        _cache("datasets"),
    )
    return ds


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _cache(kind: str) -> Path:
    d = cache_dir() / kind
    d.mkdir(parents=True, exist_ok=True)
    return d


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of everything in the tokenizer that changes token ids: vocabulary, merges, template, special ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = [type(tokenizer).__name__, tokenizer.chat_template, tokenizer.bos_token_id, tokenizer.eos_token_id]
    return hashlib.sha256((vocab + json.dumps(extra, default=str)).encode()).hexdigest()


def encoding_fingerprint(cfg: DataConfig, source: Source, tokenizer_fp: str) -> str:
    """What the encoded rows depend on: the source, the tokenizer and the encoding fields of the config."""
    fields = ["format", "max_seq_len", "train_on_prompt"] + [k for k in vars(cfg) if k.endswith("_field")]
    key = {k: str(getattr(cfg, k)) for k in fields}
    key.update(source=source.fingerprint, tokenizer=tokenizer_fp, v=ENCODING_VERSION)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def check_columns(cfg: DataConfig, source: Source) -> None:
    """Refuse an empty source, or one without the columns `data.format` reads (as mapped by `data.<name>_field`)."""
    columns = source.rows.column_names
    if len(source.rows) == 0:
        raise ConfigError(f"{source.name}: the dataset is empty (0 rows); point data.path at a file with examples")
    if problem := missing_columns(cfg, source.name, columns):
        raise ConfigError(problem)


def encode_source(cfg: DataConfig, source: Source, tokenizer: Any, tokenizer_fp: str):
    """Tokenise every row with `datasets.map`, cached under <exp cache>/tokenized/<fingerprint>/ (an entry of
    `exp.core.cache`: verified on use, rebuilt when damaged).

    A second run with the same source, tokenizer and encoding fields reads the cache entry and calls no encoder.
    """
    ds = source.rows
    check_columns(cfg, source)
    import datasets

    fp = encoding_fingerprint(cfg, source, tokenizer_fp)

    num_proc = min(4, max(1, len(ds) // PARALLEL_ROWS)) if len(ds) >= PARALLEL_ROWS else None

    def tokenise(tmp: Path) -> None:
        ds.map(
            _encode_row,
            fn_kwargs={"cfg": cfg, "tokenizer": tokenizer},
            remove_columns=ds.column_names,
            num_proc=num_proc,
            cache_file_name=str(tmp / "rows.arrow"),  # one file per process with num_proc: rows_0000N_of_0000M
            load_from_cache_file=False,
            new_fingerprint=fp,
            desc=f"tokenising {source.name}",
        )

    def build(tmp: Path) -> None:
        if num_proc is None:
            tokenise(tmp)
        else:  # the pool in a process group of its own, which a signal here ends at once (exp.data.worker)
            run_in_child(functools.partial(tokenise, tmp), f"tokenisation of {source.name}")

    entry = ensure_entry(_cache("tokenized") / fp, build, f"tokenisation of {source.name}")
    shards = sorted(entry.glob("rows*.arrow"))
    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(p)) for p in shards])


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


def position_limit(tokenizer: Any) -> int | None:
    """The model's position limit, from the checkpoint the tokenizer came from (its config.json), if known."""
    source = getattr(tokenizer, "name_or_path", "") or ""
    config = Path(source) / "config.json"
    limit = None
    try:
        if config.is_file():
            data = json.loads(config.read_text())
        else:
            from transformers import AutoConfig

            data = AutoConfig.from_pretrained(source, local_files_only=True).to_dict()
        data = data.get("text_config") or data  # multimodal Gemma 3 keeps the text model's fields nested
        limit = data.get("max_position_embeddings")
    except Exception:  # a hub id not cached here: the model load reports that; nothing to check against
        pass
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and tok_limit < 10**7:  # huge values are transformers' "unset" sentinel
        limit = min(limit, tok_limit) if limit else tok_limit
    return limit


def check_position_limit(cfg: DataConfig, tokenizer: Any) -> None:
    """Refuse a `data.max_seq_len` above the model's position limit: positions beyond it were never trained."""
    limit = position_limit(tokenizer)
    if limit is not None and cfg.max_seq_len > limit:
        raise ConfigError(
            f"data.max_seq_len={cfg.max_seq_len} is above the model's position limit ({limit}, "
            "max_position_embeddings): positions beyond it were never trained and break the model; use "
            f"data.max_seq_len={limit} or less"
        )


# ---------------------------------------------------------------------------------------------------- splits


@dataclass(frozen=True)
class Splits:
    """The training and held-out examples of a data config, encoded as training sees them, in split order.

    Examples whose response was truncated away are dropped and counted; bad rows are skipped and counted (or fail,
    per `data.on_bad_rows`).
    """

    train: list[Encoded]
    val: list[Encoded]
    # Per split: examples, kept, truncated, dropped, tokens, loss_tokens (see `_keep`).
    train_stats: dict[str, int]
    val_stats: dict[str, int]
    bad_rows: int  # in data.path and data.val_path together
    cache_files: list[str]  # the tokenisation cache files of data.path
    val_source: str  # what the held-out split is, for logs and reports (`validation_source`)


def build_splits(cfg: DataConfig, tokenizer: Any) -> Splits:
    """The train / held-out examples of `cfg`, rendered per `data.format` and encoded as training encodes them.

    The only place a data config becomes split examples: the DataModule trains and validates on these, and
    `exp.evaluate` and `exp.merge` score the same held-out examples in the same order. The held-out split is the
    usable rows of `data.val_path`, or `data.val_size` of the usable rows of `data.path` drawn with `data.seed`.
    """
    check_position_limit(cfg, tokenizer)
    tokenizer_fp = tokenizer_fingerprint(tokenizer)
    rows, bad_rows, cache_files = _usable_encoded(cfg, cfg.path, "data.path", tokenizer, tokenizer_fp)
    if cfg.val_path:
        val_rows, val_bad_rows, _ = _usable_encoded(cfg, cfg.val_path, "data.val_path", tokenizer, tokenizer_fp)
        train_split, val_split, bad_rows = rows, val_rows, bad_rows + val_bad_rows
    else:
        train_split, val_split = split_rows(rows, cfg.val_size, cfg.seed)
    train, train_stats = _keep(train_split)
    val, val_stats = _keep(val_split)
    if not train or not val:
        raise ConfigError(
            f"data.max_seq_len={cfg.max_seq_len} leaves no example with a response token "
            f"(train {len(train)}, val {len(val)} kept): raise data.max_seq_len"
        )
    return Splits(train, val, train_stats, val_stats, bad_rows, cache_files, validation_source(cfg))


def source_name(cfg: DataConfig) -> str:
    """The training source of `cfg` as the user named it: a file, a hub dataset or the generated task."""
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
    return f"data.val_size={cfg.val_size:g} of {source_name(cfg)}, drawn with data.seed={cfg.seed}"


def all_examples(cfg: DataConfig, tokenizer: Any, key: str = "data.path") -> list[Encoded]:
    """Every usable row of `data.path` in source order, encoded as `build_splits` encodes it: a whole evaluation set,
    no split. `key` is the argument that named the path, for messages."""
    check_position_limit(cfg, tokenizer)
    rows, _, _ = _usable_encoded(cfg, cfg.path, key, tokenizer, tokenizer_fingerprint(tokenizer))
    kept, _ = _keep(rows)
    if not kept:
        raise ConfigError(
            f"{key}={cfg.path}: no row keeps a response token at data.max_seq_len={cfg.max_seq_len}; raise "
            "data.max_seq_len"
        )
    return kept


def _usable_encoded(
    cfg: DataConfig, path: str | None, key: str, tokenizer: Any, tokenizer_fp: str
) -> tuple[list[Encoded], int, list[str]]:
    """One source's usable rows, encoded (cached), in source order; how many rows were bad; the cache files."""
    source = read_source(cfg, path, key)
    encoded = encode_source(cfg, source, tokenizer, tokenizer_fp)
    rows = _as_encoded(encoded)
    usable = usable_rows(cfg, source, encoded)
    return [rows[i] for i in usable], len(rows) - len(usable), [f["filename"] for f in encoded.cache_files]


def _as_encoded(encoded) -> list[Encoded]:
    cols = encoded.to_dict()
    return [Encoded(*r) for r in zip(cols["input_ids"], cols["labels"], cols["truncated"], strict=True)]


def _keep(split: list[Encoded]) -> tuple[list[Encoded], dict[str, int]]:
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


# ---------------------------------------------------------------------------------------------------- batching


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


def loss_tokens(e: Encoded | Packed) -> int:
    """Tokens that carry loss: position t predicts label t + 1, so the first label never counts."""
    return sum(t != IGNORE_INDEX for t in e.labels[1:])


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
        train_stats, val_stats, n_bad = splits.train_stats, splits.val_stats, splits.bad_rows
        # Copies: the train entry gains this module's batching statistics, which are not a property of the split.
        self.stats: dict[str, Any] = {
            "train": dict(train_stats),
            "val": dict(val_stats),
            "bad_rows": n_bad,
            "validated_on": splits.val_source,
        }
        self.packed = pack(self.train_set, cfg.max_seq_len, IGNORE_INDEX) if cfg.packing else None
        # Packing has its own meaning of a step (rows, not examples): it wins over padding-free batching.
        self.flat = flat if self.packed is None else None
        if self.flat is not None:
            self.step_micro_batches = self._flat_micro_batches()
        self.stats["train"].update(self.train_batch_stats())
        log.info(
            "data: %d train / %d val examples (%d truncated, %d dropped with no response left, %d bad rows); "
            "%.1f loss-bearing tokens per train batch, %.1f%% padding%s",
            len(self.train_set),
            len(self.val_set),
            train_stats["truncated"] + val_stats["truncated"],
            train_stats["dropped"] + val_stats["dropped"],
            n_bad,
            self.stats["train"]["loss_tokens_per_batch"],
            100 * self.stats["train"]["padding_fraction"],
            f", {len(self.packed)} packed rows"
            if self.packed is not None
            else f", padding-free: {self.step_micro_batches} micro-batch(es) of <= {self.flat.token_budget} tokens "
            "per step" + (f" in rows of <= {self.flat.row_tokens} tokens" if self.flat.row_tokens is not None else "")
            if self.flat is not None
            else "",
        )
        log.info("data: validating on %s", splits.val_source)

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
        counts: dict[int, int] = {}
        for e in self.train_set:
            for t in e.labels:
                if t != IGNORE_INDEX:
                    counts[t] = counts.get(t, 0) + 1
        top = max(counts, key=counts.get)
        val = [t for e in self.val_set for t in e.labels if t != IGNORE_INDEX]
        return sum(t == top for t in val) / len(val)

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
    if not hw.padding_free or cfg.data.packing:
        return None
    budget = hw.micro_batch_tokens or hw.micro_batch_size * cfg.data.max_seq_len
    # Eager attention computes all T x T scores of a row: rows capped at max_seq_len cost what padded rows do.
    rows = cfg.data.max_seq_len if cfg.model.attn_implementation == "eager" else None
    return FlatBatching(budget, cfg.trainer.global_batch_size, cfg.data_parallel_size, cfg.trainer.max_steps, rows)


def build_run_datamodule(cfg: TrainConfig, tokenizer: Any, num_workers: int | None = None) -> InstructionDataModule:
    """The DataModule a training run of `cfg` uses (its micro-batches, accumulation and ranks)."""
    return build_datamodule(
        cfg.data,
        tokenizer,
        cfg.hardware.micro_batch_size,
        cfg.hardware.num_workers if num_workers is None else num_workers,
        cfg.accumulate_grad_batches * cfg.data_parallel_size,
        flat_batching(cfg),
    )
