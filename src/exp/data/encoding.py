"""Rows -> token ids and labels: the loss mask, `<bos>` / `<eos>`, truncation, and the on-disk tokenisation cache.

Per-format rendering (`exp.data.formats`) turns a row into prompt and response pieces; this module tokenises them
the same way for every format and encodes every row of a source once, cached by fingerprint under the exp cache
(source, tokenizer and the config's encoding fields), in a pool of processes for large sources (`exp.data.worker`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exp.core.cache import cache_dir, ensure_entry
from exp.core.config import ConfigError, DataConfig
from exp.core.constants import IGNORE_INDEX
from exp.data.formats import BadRow, Rendered, render_row
from exp.data.packing import Packed
from exp.data.sources import Source, check_columns
from exp.data.worker import run_in_child

# Bump when the encoding changes, so cached tokenisations are not reused.
ENCODING_VERSION = 1
# Rows above which tokenisation runs in parallel processes (below, process start-up costs more than it saves).
PARALLEL_ROWS = 20_000


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool = False  # cut at max_seq_len (an empty encoding: its response was cut off entirely)


def loss_tokens(e: Encoded | Packed) -> int:
    """Tokens that carry loss: position t predicts label t + 1, so the first label never counts."""
    return sum(t != IGNORE_INDEX for t in e.labels[1:])


def majority_token_accuracy(train: Iterable[Encoded | Packed], val: Iterable[Encoded | Packed]) -> float:
    """Accuracy on `val`'s labels of always guessing the most frequent label of `train`: the chance line."""
    counts: dict[int, int] = {}
    for e in train:
        for t in e.labels:
            if t != IGNORE_INDEX:
                counts[t] = counts.get(t, 0) + 1
    top = max(counts, key=counts.get)
    labels = [t for e in val for t in e.labels if t != IGNORE_INDEX]
    return sum(t == top for t in labels) / len(labels)


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


def encode_row(row: dict[str, Any], cfg: DataConfig, tokenizer: Any) -> dict[str, Any]:
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
            encode_row,
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

    entry = ensure_entry(cache_dir() / "tokenized" / fp, build, f"tokenisation of {source.name}")
    shards = sorted(entry.glob("rows*.arrow"))
    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(p)) for p in shards])


def as_encoded(encoded) -> list[Encoded]:
    """The rows of `encode_source`'s dataset as `Encoded` examples, in source order."""
    cols = encoded.to_dict()
    return [Encoded(*r) for r in zip(cols["input_ids"], cols["labels"], cols["truncated"], strict=True)]


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
