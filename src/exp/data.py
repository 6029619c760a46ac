"""Examples -> token ids -> batches: loading, prompt formatting, response-only labels, the Lightning DataModule."""

from __future__ import annotations

import functools
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from exp.config import ConfigError, DataConfig, DataFormat
from exp.synthetic import generate_examples

log = logging.getLogger(__name__)
IGNORE_INDEX = -100  # label value that cross-entropy skips: prompt tokens and padding


def format_prompt(instruction: str, input_text: str) -> str:
    """The Alpaca prompt; the response follows it directly."""
    if input_text:
        return f"### Instruction:\n{instruction}\n\n### Input:\n{input_text}\n\n### Response:\n"
    return f"### Instruction:\n{instruction}\n\n### Response:\n"


def load_examples(cfg: DataConfig) -> list[dict[str, str]]:
    """Rows of {instruction, input, output} from the generated default or a local Alpaca-style file."""
    if cfg.format == DataFormat.synthetic:
        return generate_examples(cfg.num_examples, cfg.seed)
    path = Path(cfg.path or "")
    if not path.exists():
        raise ConfigError(
            f"data.path={cfg.path}: no such file or directory. Relative paths are resolved against the directory "
            "exp.train was launched from; pass an absolute path or launch from the data's parent directory."
        )
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl")) if path.is_dir() else [path]
    if not files or any(f.suffix not in (".json", ".jsonl") for f in files):
        raise ConfigError(f"data.path={cfg.path}: expected a .json / .jsonl file or a directory of them")
    import datasets

    try:
        ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train")
    except Exception as e:  # datasets raises several types for unreadable JSON
        raise ConfigError(f"data.path={cfg.path}: could not be read as JSON / JSONL ({type(e).__name__}: {e})") from e
    fields = {"instruction": cfg.instruction_field, "input": cfg.input_field, "output": cfg.output_field}
    for role in ("instruction", "output"):
        if fields[role] not in ds.column_names:
            raise ConfigError(
                f"data.path={cfg.path}: no column '{fields[role]}' (data.{role}_field); the file has columns "
                f"{ds.column_names}. Map yours with e.g. data.{role}_field=<column>."
            )
    rows, bad = [], []
    for i, r in enumerate(ds):
        ins, out = r.get(fields["instruction"]), r.get(fields["output"])
        inp = r.get(fields["input"]) or ""
        if not isinstance(ins, str) or not isinstance(out, str) or not out.strip() or not isinstance(inp, str):
            bad.append(i)
            continue
        rows.append({"instruction": ins, "input": inp, "output": out})
    if bad:
        log.warning("data: skipped %d row(s) with a missing or non-string field (rows %s)", len(bad), bad[:10])
    if not rows:
        raise ConfigError(f"data.path={cfg.path}: no usable rows (every row lacks a string instruction/output)")
    return rows


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]


def encode_example(
    tokenizer: Any, row: dict[str, str], max_seq_len: int, train_on_prompt: bool
) -> tuple[Encoded | None, bool]:
    """Token ids and labels for one row; returns (None, True) when truncation would leave no response token.

    `<bos>` is added here exactly once (the text is tokenised without special tokens, since Gemma's tokenizer
    would add its own) and `<eos>` ends the response so the model learns to stop. The second value says
    whether the example was truncated.
    """
    prompt = tokenizer(format_prompt(row["instruction"], row["input"]), add_special_tokens=False)["input_ids"]
    response = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompt = [tokenizer.bos_token_id] + prompt
    ids = prompt + response
    truncated = len(ids) > max_seq_len
    ids = ids[:max_seq_len]
    n_prompt = min(len(prompt), len(ids))
    if n_prompt == len(ids):  # the response is entirely cut off: nothing to learn from
        return None, True
    labels = ids.copy() if train_on_prompt else [IGNORE_INDEX] * n_prompt + ids[n_prompt:]
    return Encoded(ids, labels), truncated


def split_rows(rows: list[Any], val_size: float, seed: int) -> tuple[list[Any], list[Any]]:
    """Seeded shuffle, then carve the validation split (a fraction < 1 or a count >= 1)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_val = int(val_size) if val_size >= 1 else max(1, round(len(rows) * val_size))
    if n_val >= len(rows):
        raise ConfigError(f"data.val_size={val_size} leaves no training examples out of {len(rows)}")
    return [rows[i] for i in order[n_val:]], [rows[i] for i in order[:n_val]]


def collate(examples: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example of the batch; padding is masked out and never a label."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class InstructionDataModule(L.LightningDataModule):
    """Tokenised train / validation splits of instruction data, batched with response-only labels."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, micro_batch_size: int, num_workers: int = 0):
        super().__init__()
        self.cfg, self.tokenizer = cfg, tokenizer
        self.micro_batch_size, self.num_workers = micro_batch_size, num_workers
        rows = load_examples(cfg)
        train_rows, val_rows = split_rows(rows, cfg.val_size, cfg.seed)
        self.train_set, train_stats = self._encode(train_rows)
        self.val_set, val_stats = self._encode(val_rows)
        self.stats = {"train": train_stats, "val": val_stats}
        if not self.train_set or not self.val_set:
            raise ConfigError(
                f"data.max_seq_len={cfg.max_seq_len} leaves no example with a response token "
                f"(train {len(self.train_set)}, val {len(self.val_set)} kept): raise data.max_seq_len"
            )
        log.info(
            "data: %d train / %d val examples (%d truncated, %d dropped with no response left)",
            len(self.train_set),
            len(self.val_set),
            train_stats["truncated"] + val_stats["truncated"],
            train_stats["dropped"] + val_stats["dropped"],
        )

    def _encode(self, rows: list[dict[str, str]]) -> tuple[list[Encoded], dict[str, int]]:
        kept, truncated, dropped = [], 0, 0
        for r in rows:
            enc, was_truncated = encode_example(self.tokenizer, r, self.cfg.max_seq_len, self.cfg.train_on_prompt)
            truncated += was_truncated
            if enc is None:
                dropped += 1
            else:
                kept.append(enc)
        return kept, {"examples": len(rows), "kept": len(kept), "truncated": truncated, "dropped": dropped}

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

    def _loader(self, dataset: list[Encoded], shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.micro_batch_size,
            shuffle=shuffle,
            # Seeded so the data order is a function of data.seed alone.
            generator=torch.Generator().manual_seed(self.cfg.seed) if shuffle else None,
            collate_fn=functools.partial(collate, pad_id=self.tokenizer.pad_token_id),
            num_workers=self.num_workers,
            drop_last=shuffle,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)


def build_datamodule(cfg: DataConfig, tokenizer: Any, micro_batch_size: int, num_workers: int = 0):
    return InstructionDataModule(cfg, tokenizer, micro_batch_size, num_workers)
