"""Where rows come from: a local file or directory (checked by `exp.data.files`), a hub dataset, or the generated
task; each read into a `datasets.Dataset` with a fingerprint of what was read (the tokenisation cache's key).

The checks of `exp.data.files` need no `datasets` (they run before Hydra starts); reading does, so it lives here.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exp.core.cache import cache_dir
from exp.core.config import ConfigError, DataConfig, DataFormat
from exp.data.files import READERS, diagnose, list_files, missing_columns
from exp.data.synthetic import generate_examples

log = logging.getLogger(__name__)

# Above this much data read up front, the log points at data.streaming: every encoded example is held in memory (as
# Python lists) before training starts.
STREAM_HINT_BYTES = 2 * 10**9


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
        if (size := sum(f.stat().st_size for f in files)) > STREAM_HINT_BYTES:
            log.warning(
                "data: %s holds %.1f GB, all of it tokenised into memory before training; data.streaming=true reads "
                "it as a stream in flat memory (docs/data.md, Streaming)",
                path,
                size / 1e9,
            )
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
            builder, data_files=patterns, split="train", cache_dir=str(_datasets_cache()), **kwargs
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
        _datasets_cache(),
    )
    return ds


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _datasets_cache() -> Path:
    """`datasets`' own cache of the files it read (Arrow), kept under the exp cache."""
    d = cache_dir() / "datasets"
    d.mkdir(parents=True, exist_ok=True)
    return d


def check_columns(cfg: DataConfig, source: Source) -> None:
    """Refuse an empty source, or one without the columns `data.format` reads (as mapped by `data.<name>_field`)."""
    columns = source.rows.column_names
    if len(source.rows) == 0:
        raise ConfigError(f"{source.name}: the dataset is empty (0 rows); point data.path at a file with examples")
    if problem := missing_columns(cfg, source.name, columns):
        raise ConfigError(problem)
