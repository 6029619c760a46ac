"""Training on a file too large to tokenise up front (`data.streaming=true`): rows read by `datasets` as a stream,
shuffled in a seeded buffer, encoded as training reads them, batched, and resumed from the exact position.

- **Reading**: `datasets.load_dataset(<json|parquet|csv>, streaming=True)` reads the files in chunks; nothing but
  the shuffle buffer and the batch at hand is held, so memory stays flat whatever the file's size.
- **Order**: epoch e reads the file from the top, skips the held-out head, and passes the rows through a buffer of
  `data.shuffle_buffer` rows: each step takes a seeded random row out and reads the next one in (the random source
  is a function of data.seed and e). `data.shuffle_buffer=0` keeps the file's order.
- **Held out**: the first `data.val_size` usable rows of the file (a count: the stream's length is unknown), or
  every usable row of `data.val_path` (read and encoded as a single source is).
- **Exact resume**: before each batch the stream notes where it is: the reader's own position (`datasets`'
  `IterableDataset.state_dict()`), the rows in the buffer and the random state. A checkpoint stores the note of the
  batch after the last one trained on (Lightning's DataModule `state_dict`); a resumed run loads it into a new
  reader (`load_state_dict`) and goes on with exactly the batch the uninterrupted run trained on next.
- **Batches**: padded micro-batches in the stream's order (no length grouping, packing or padding-free planning,
  which need the whole split); data-parallel rank r of w takes the stream's batches r, r + w, ...
"""

from __future__ import annotations

import copy
import functools
import glob
import json
import logging
import random
from collections import OrderedDict
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from exp.core.config import BadRows, ConfigError, DataConfig
from exp.data.batching import ShardSampler, collate
from exp.data.encoding import (
    Encoded,
    check_position_limit,
    encode_row,
    loss_tokens,
    majority_token_accuracy,
    tokenizer_fingerprint,
)
from exp.data.files import READERS, list_files
from exp.data.splits import keep_examples, usable_encoded

log = logging.getLogger(__name__)

# Notes kept of the latest batches: Lightning fetches a batch or two ahead of the one it trains on.
KEPT_NOTES = 16
# Training examples the chance-level accuracy is counted on (the stream is not read whole for it).
CHANCE_EXAMPLES = 2000


def open_rows(files: list) -> Any:
    """The rows of the files as a `datasets.IterableDataset` (read in chunks, never whole)."""
    import datasets

    datasets.disable_progress_bars()
    builder = READERS[files[0].suffix]
    # `datasets` reads data_files as glob patterns: the files are checked paths, so their `[`, `*`, `?` are literal.
    return datasets.load_dataset(
        builder, data_files=[glob.escape(str(f)) for f in files], split="train", streaming=True
    )


class RowStream:
    """One epoch after another of (row number, row): the file after its held-out head, through the seeded shuffle
    buffer. `note()` says where it is; `RowStream(..., note=...)` goes on from there."""

    def __init__(self, files: list, head_rows: int, buffer_size: int, seed: int, note: dict | None = None):
        self.files, self.head_rows, self.buffer_size, self.seed = files, head_rows, buffer_size, seed
        if note is None:
            self._start(0)
        else:
            self._start(note["epoch"], note)

    def _start(self, epoch: int, note: dict | None = None) -> None:
        self.epoch, self.rows = epoch, open_rows(self.files)
        self.rng = random.Random(f"exp-stream-{self.seed}-{epoch}")
        if note is None:
            self.read, self.buffer, self.exhausted = 0, [], False
            self.it = iter(self.rows)
            for _ in range(self.head_rows):  # the held-out head: read past, never trained on
                self._pull()
            return
        self.rows.load_state_dict(note["reader"])
        self.it = iter(self.rows)
        self.read, self.exhausted = note["read"], note["exhausted"]
        self.buffer = [(i, json.loads(r)) for i, r in note["buffer"]]
        self.rng.setstate((note["rng"][0], tuple(note["rng"][1]), note["rng"][2]))

    def _pull(self) -> tuple[int, dict] | None:
        if self.exhausted:
            return None
        try:
            row = next(self.it)
        except StopIteration:
            self.exhausted = True
            return None
        self.read += 1
        return self.read - 1, row

    def next_row(self) -> tuple[int, dict]:
        """The next (row number in the file, row), starting the next epoch at the end of one."""
        while True:
            if self.buffer_size == 0:
                if (item := self._pull()) is not None:
                    return item
            else:
                while len(self.buffer) < self.buffer_size and (item := self._pull()) is not None:
                    self.buffer.append(item)
                if self.buffer:
                    k = self.rng.randrange(len(self.buffer))
                    self.buffer[k], self.buffer[-1] = self.buffer[-1], self.buffer[k]
                    return self.buffer.pop()
            self._start(self.epoch + 1)

    def note(self) -> dict:
        """Where the stream is (the buffer's rows by reference: a note is taken before every batch, and only the
        one a checkpoint stores is written out, by `plain_note`)."""
        return {
            "epoch": self.epoch,
            "reader": copy.deepcopy(self.rows.state_dict()),
            "read": self.read,
            "exhausted": self.exhausted,
            "buffer": list(self.buffer),
            "rng": self.rng.getstate(),
        }


def plain_note(note: dict) -> dict:
    """A note in plain types, as a checkpoint stores it (read with `weights_only=True`): rows as JSON text."""
    version, state, gauss = note["rng"]
    return {
        **note,
        "buffer": [[i, json.dumps(r, default=str)] for i, r in note["buffer"]],
        "rng": [version, list(state), gauss],
    }


class ExampleStream:
    """Encoded training examples from a `RowStream`: bad rows skipped (logged) or refused per data.on_bad_rows,
    examples whose response is cut away by max_seq_len dropped; counts of what happened in `counts`."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, rows: RowStream, name: str):
        self.cfg, self.tokenizer, self.rows, self.name = cfg, tokenizer, rows, name
        self.counts = {"examples": 0, "bad_rows": 0, "dropped": 0, "truncated": 0, "loss_tokens": 0, "tokens": 0}

    def next_example(self) -> Encoded:
        while True:
            number, row = self.rows.next_row()
            out = encode_row(row, self.cfg, self.tokenizer)
            if out["error"]:
                self.counts["bad_rows"] += 1
                message = f"{self.name}: row {number}: {out['error']}"
                if self.cfg.on_bad_rows == BadRows.fail:
                    raise ConfigError(f"{message}; fix the row or pass data.on_bad_rows=skip to drop such rows")
                if self.counts["bad_rows"] <= 10:
                    log.warning("data: skipped %s", message)
                continue
            self.counts["truncated"] += out["truncated"]
            if not out["input_ids"]:
                self.counts["dropped"] += 1
                continue
            e = Encoded(out["input_ids"], out["labels"], out["truncated"])
            self.counts["examples"] += 1
            self.counts["tokens"] += len(e.input_ids)
            self.counts["loss_tokens"] += loss_tokens(e)
            return e


class StreamBatches(IterableDataset):
    """This rank's padded micro-batches of the stream, each noted (`notes`: global batch index -> where the
    stream stood before it) so that a checkpoint can say where the batch after the last one trained on starts."""

    def __init__(self, module: StreamingDataModule, rank: int, world: int, start: int, note: dict | None):
        self.module, self.rank, self.world, self.start, self.note = module, rank, world, start, note
        self.notes: OrderedDict[int, dict] = OrderedDict()

    def __iter__(self):
        m = self.module
        rows = RowStream(m.files, m.head_rows, m.cfg.shuffle_buffer, m.cfg.seed, self.note)
        stream = ExampleStream(m.cfg, m.tokenizer, rows, m.cfg.path)
        m.stream = stream
        pad = functools.partial(collate, pad_id=m.tokenizer.pad_token_id)
        g = self.start * self.world  # global batches already trained on (all ranks)
        if self.note is None and g:
            raise ConfigError(
                "the checkpoint holds no position of the data stream (written without data.streaming=true?): "
                "resume it with the data.streaming setting it was written with"
            )
        while True:
            self.notes[g] = rows.note()
            while len(self.notes) > KEPT_NOTES:
                self.notes.popitem(last=False)
            batch = [stream.next_example() for _ in range(m.micro_batch_size)]
            if g % self.world == self.rank:
                yield pad(batch)
            g += 1


class StreamingDataModule(L.LightningDataModule):
    """The DataModule of `data.streaming=true`: held-out examples in memory, training batches from the stream."""

    # What the training pipeline reads of a DataModule: padded micro-batches, each its own mean.
    flat = None
    flat_accumulation = None
    step_weighted = False
    packed = None

    def __init__(self, cfg: DataConfig, tokenizer: Any, micro_batch_size: int):
        super().__init__()
        self.cfg, self.tokenizer, self.micro_batch_size = cfg, tokenizer, micro_batch_size
        check_position_limit(cfg, tokenizer)
        self.files = list_files(cfg.path, "data.path")
        if READERS[self.files[0].suffix] == "json" and self.files[0].suffix == ".json":
            log.info("data: %s is a JSON array: datasets reads it whole; JSONL streams in chunks", cfg.path)
        self.start_batch, self.resume_note, self.batches = 0, None, None
        self.stream: ExampleStream | None = None
        if cfg.val_path:
            val, bad, _ = usable_encoded(
                cfg, cfg.val_path, "data.val_path", tokenizer, tokenizer_fingerprint(tokenizer)
            )
            self.val_set, self.head_rows, head_bad = keep_examples(val)[0], 0, bad
            validated_on = f"data.val_path={cfg.val_path} (every usable row)"
        else:
            self.val_set, self.head_rows, head_bad = self._head()
            validated_on = f"the first {len(self.val_set)} usable rows of data.path={cfg.path} (data.val_size)"
        if not self.val_set:
            raise ConfigError(f"data.path={cfg.path}: no held-out example keeps a response token; check the file")
        val_stats = keep_examples(self.val_set)[1]
        self.stats: dict[str, Any] = {
            "streaming": True,
            "train": {"examples": None, "padding_fraction": None, "loss_tokens_per_batch": None},
            "val": val_stats,
            "bad_rows": head_bad,
            "validated_on": validated_on,
        }
        log.info(
            "data: streaming %s (shuffle buffer %d rows); %d held-out examples: %s",
            cfg.path, cfg.shuffle_buffer, len(self.val_set), validated_on,
        )  # fmt: skip

    def _head(self) -> tuple[list[Encoded], int, int]:
        """The first data.val_size usable rows in file order, and how many rows (bad ones too) that took."""
        rows = RowStream(self.files, 0, 0, self.cfg.seed)
        stream = ExampleStream(self.cfg, self.tokenizer, rows, self.cfg.path)
        val = []
        while len(val) < int(self.cfg.val_size):
            val.append(stream.next_example())
            if rows.epoch > 0:
                raise ConfigError(
                    f"data.val_size={self.cfg.val_size:g} with data.streaming=true holds out the first rows of "
                    f"data.path={self.cfg.path}, which has fewer usable ones: lower it or give data.val_path"
                )
        return val, rows.read, stream.counts["bad_rows"]

    @property
    def batches_per_epoch(self) -> int:
        """Unknown until the stream has been read through; 0 then (summary.json's `epochs` is left out)."""
        return 0

    def train_examples(self, n: int) -> list[Encoded]:
        """The first `n` training examples of epoch 0, in the stream's order (the preview shows them)."""
        stream = ExampleStream(
            self.cfg, self.tokenizer, RowStream(self.files, self.head_rows, self.cfg.shuffle_buffer, self.cfg.seed),
            self.cfg.path,
        )  # fmt: skip
        return [stream.next_example() for _ in range(n)]

    def majority_token_accuracy(self) -> float:
        """Accuracy on the held-out labels of always guessing the most frequent label of the stream's first
        CHANCE_EXAMPLES training examples."""
        return majority_token_accuracy(self.train_examples(CHANCE_EXAMPLES), self.val_set)

    def resume_at(self, batches_seen: int) -> None:
        self.start_batch = batches_seen

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands after the last batch trained on (all ranks), for the checkpoint."""
        if self.batches is None or self.trainer is None:
            return {}
        g = self.trainer.lightning_module.batches_seen * self.batches.world
        if g not in self.batches.notes:
            raise RuntimeError(f"no note of the data stream before batch {g} (kept: {list(self.batches.notes)})")
        return {"batches": g, "note": plain_note(self.batches.notes[g])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume_note = state.get("note")

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank()
        self.batches = StreamBatches(self, rank, world, self.start_batch, self.resume_note)
        # In this process: the notes of where the stream stands must be where the checkpoint is written.
        return DataLoader(self.batches, batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank()
        order = sorted(range(len(self.val_set)), key=lambda i: (-len(self.val_set[i].input_ids), i))
        return DataLoader(
            self.val_set,
            batch_size=self.micro_batch_size,
            sampler=ShardSampler(len(self.val_set), rank, world, order=order),
            collate_fn=functools.partial(collate, pad_id=self.tokenizer.pad_token_id),
        )
