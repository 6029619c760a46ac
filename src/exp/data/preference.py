"""Preference data: pairs (a prompt with a chosen and a rejected completion) for DPO, ORPO and SimPO, and unpaired
examples (a prompt, a completion, and whether it is desirable) for KTO.

Formats (`data.format`):
* `preference`: `{prompt, chosen, rejected}`. Text completions follow the prompt directly and end with `<eos>`, as
  `prompt_completion` renders them. Conversations (chosen and rejected as lists of `{role, content}` messages) are
  rendered with the tokenizer's chat template: the prompt is `prompt` (a list of messages, or a string as one user
  turn), or else the messages the two conversations share before their last (assistant) turn.
* `kto`: `{prompt, completion, label}` with `label` true for a desirable completion; completions as above.
* `synthetic` (the embedded default): the generated task of exp.data.synthetic, with its right answer chosen and a
  corrupted one (every word replaced by another) rejected; for KTO each example is the right or
  the corrupted answer, half and half.

Every row becomes `prompt` ids (`<bos>` first) and completion ids; only completion tokens carry the loss. Truncation
keeps the prompt whole and cuts each completion to fit `data.max_seq_len`; a row whose prompt leaves no room for a
completion token is dropped and counted (`too_long`). Rows that cannot be read are skipped or refused as
`data.on_bad_rows` says, with their row numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from exp.core.config import BadRows, ConfigError, DataConfig, DataFormat
from exp.core.constants import IGNORE_INDEX
from exp.data.batching import (
    ShardSampler,
    TrainStream,
    sequence_boundaries,
    shuffled_batches,
    step_sorted_batches,
)
from exp.data.formats import CHAT_ROLES, BadRow, _apply, format_prompt
from exp.data.padding_free import bucket_length
from exp.data.sources import read_source
from exp.data.splits import split_rows
from exp.data.synthetic import WORDS, generate_examples

log = logging.getLogger(__name__)
PREFERENCE_FORMATS = (DataFormat.preference, DataFormat.kto)


@dataclass
class PreferenceExample:
    prompt: list[int]
    chosen: list[int]  # the completion (KTO: the only one, desirable or not)
    rejected: list[int] | None = None  # None for unpaired (KTO) examples
    desirable: bool = True  # KTO's label
    truncated: bool = False  # a completion was cut to fit data.max_seq_len
    row: int = -1  # its row number in the source (0 first), as the bad-row messages count
    # The reference's summed log-probabilities of (chosen, rejected), when computed before training
    # (objective.precompute_reference): collated as the batch's `ref_logps`.
    reference: tuple[float, float] | None = None


def corrupt(words: list[str], rng: random.Random) -> list[str]:
    """A wrong answer of the right length: every word replaced by another of the task's words. Each of its tokens
    differs from the right answer's, so each scores the preference (one changed word would leave one token of a
    pair's difference, which a model from random weights learns from slowly)."""
    return [rng.choice([w for w in WORDS if w != word]) for word in words]


def synthetic_rows(cfg: DataConfig, unpaired: bool) -> list[dict[str, Any]]:
    """The generated task as preference rows (text)."""
    rng = random.Random(cfg.seed + 1)
    rows = []
    for r in generate_examples(cfg.num_examples, cfg.seed):
        prompt = format_prompt(r["instruction"], r["input"])
        wrong = " ".join(corrupt(r["output"].split(), rng))
        if unpaired:
            good = rng.random() < 0.5
            rows.append({"prompt": prompt, "completion": r["output"] if good else wrong, "label": good})
        else:
            rows.append({"prompt": prompt, "chosen": r["output"], "rejected": wrong})
    return rows


def _messages(value: Any, column: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRow(f"'{column}' is not a non-empty list of messages")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRow(f"'{column}' message {j} lacks a string 'role' / 'content'")
        if m["role"] not in CHAT_ROLES:
            raise BadRow(f"'{column}' message {j} has role '{m['role']}' (expected one of {', '.join(CHAT_ROLES)})")
        out.append({"role": m["role"], "content": m["content"]})
    return out


class _Encoder:
    """Token ids of one row's prompt and completions, as the module docstring says."""

    def __init__(self, cfg: DataConfig, tokenizer: Any) -> None:
        self.cfg, self.tok = cfg, tokenizer

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    def prompt_and_completions(self, prompt: Any, completions: list[tuple[str, Any]]) -> tuple[str, list[str]]:
        """The prompt text and each completion's text (`completions`: (column, value) pairs)."""
        chat = [isinstance(v, list) for _, v in completions]
        if not any(chat):
            if not isinstance(prompt, str):
                raise BadRow(f"'{self.cfg.prompt_field}' is {type(prompt).__name__}, not a string")
            for column, value in completions:
                if not isinstance(value, str) or not value.strip():
                    raise BadRow(f"'{column}' is not a non-empty string")
            return prompt, [v + self.tok.eos_token for _, v in completions]
        if not all(chat):
            raise BadRow("the completions mix text and conversations")
        if getattr(self.tok, "chat_template", None) is None:
            raise BadRow("conversations need a tokenizer with a chat template")
        conversations = [_messages(v, c) for c, v in completions]
        if prompt is None:  # the shared turns before the last one are the prompt
            head = conversations[0][:-1]
            if any(conv[:-1] != head for conv in conversations) or not head:
                raise BadRow("the conversations do not share their turns before the last one (give a prompt)")
            prompt_msgs = head
        else:
            prompt_msgs = (
                [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(prompt, "prompt")
            )
        prompt_text = _apply(self.tok, prompt_msgs, True)
        texts = []
        for (column, _), conv in zip(completions, conversations, strict=True):
            last = conv[-1]
            if last["role"] != "assistant" or not last["content"].strip():
                raise BadRow(f"'{column}' does not end with a non-empty assistant message")
            full = _apply(self.tok, [*prompt_msgs, last], False)
            if not full.startswith(prompt_text):
                raise BadRow("the chat template does not render the prompt as a prefix of the conversation")
            texts.append(full[len(prompt_text) :].rstrip("\n"))
        return prompt_text.removeprefix(self.tok.bos_token or ""), texts

    def encode(self, prompt_text: str, completion_texts: list[str]) -> tuple[list[int], list[list[int]], bool] | None:
        """Ids of the prompt (with `<bos>`), the completions cut to fit, and whether one was cut; None when no
        completion token fits."""
        prompt = [self.tok.bos_token_id, *self._ids(prompt_text)]
        room = self.cfg.max_seq_len - len(prompt)
        if room < 1:
            return None
        full = [self._ids(t) for t in completion_texts]
        return prompt, [ids[:room] for ids in full], any(len(ids) > room for ids in full)


def encode_rows(
    cfg: DataConfig, rows: Any, tokenizer: Any, source: str
) -> tuple[list[PreferenceExample], dict[str, Any]]:
    """The usable examples of `rows` and what was dropped: counts, and the row numbers (0 first) of the bad rows
    (with why), of those dropped for a prompt too long, and of those with a completion cut."""
    enc = _Encoder(cfg, tokenizer)
    out: list[PreferenceExample] = []
    bad: list[tuple[int, str]] = []
    long_rows: list[int] = []
    for i, row in enumerate(rows):
        try:
            prompt = row.get(cfg.prompt_field)
            if cfg.format == DataFormat.kto:
                label = row.get(cfg.label_field)
                if not isinstance(label, bool):
                    raise BadRow(f"'{cfg.label_field}' is {type(label).__name__}, not true / false")
                columns = [(cfg.completion_field, row.get(cfg.completion_field))]
            else:
                label = True
                columns = [
                    (cfg.chosen_field, row.get(cfg.chosen_field)),
                    (cfg.rejected_field, row.get(cfg.rejected_field)),
                ]
            for column, value in columns:
                if value is None:
                    raise BadRow(f"missing '{column}'")
            prompt_text, texts = enc.prompt_and_completions(prompt, columns)
            encoded = enc.encode(prompt_text, texts)
        except BadRow as e:
            bad.append((i, str(e)))
            continue
        if encoded is None or not all(encoded[1]):
            long_rows.append(i)
            continue
        ids, completions, cut = encoded
        rejected = completions[1] if len(completions) > 1 else None
        out.append(PreferenceExample(ids, completions[0], rejected, label, truncated=cut, row=i))
    too_long = len(long_rows)
    if bad:
        shown = "; ".join(f"row {i}: {why}" for i, why in bad[:5])
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        message = (
            f"{source}: {len(bad)} of {len(rows)} rows cannot be used as data.format={cfg.format.value}: {shown}{more}"
        )
        if cfg.on_bad_rows == BadRows.fail:
            raise ConfigError(
                f"{message}. Fix the rows, map the columns (data.prompt_field, data.chosen_field, ...), or set data.on_bad_rows=skip."
            )
        log.warning("%s; skipped (data.on_bad_rows=skip)", message)
    if long_rows:
        log.warning(
            "%s: %d row(s) dropped, their prompt leaving no room for a completion token within data.max_seq_len=%d: "
            "%s", source, too_long, cfg.max_seq_len, row_list(long_rows),
        )  # fmt: skip
    if not out:
        raise ConfigError(
            f"{source}: no usable preference rows for data.format={cfg.format.value} (bad: {len(bad)}, prompt too long "
            f"for data.max_seq_len={cfg.max_seq_len}: {too_long})"
        )
    return out, {
        "rows": len(rows),
        "bad_rows": len(bad),
        "too_long": too_long,
        "truncated": sum(e.truncated for e in out),
        "bad": bad,
        "too_long_rows": long_rows,
        "truncated_rows": [e.row for e in out if e.truncated],
    }


def row_list(rows: list[int], shown: int = 5) -> str:
    """`rows 3, 8, 11 (and 4 more)`: the first row numbers of a list, for messages."""
    more = f" (and {len(rows) - shown} more)" if len(rows) > shown else ""
    return f"row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:shown]))}{more}"


def preference_splits(
    cfg: DataConfig, tokenizer: Any, unpaired: bool
) -> tuple[list[PreferenceExample], list[PreferenceExample], dict[str, Any]]:
    """Training and held-out examples (held out: data.val_path's rows, else `data.val_size` of them by `data.seed`)."""
    if cfg.format == DataFormat.synthetic and not cfg.path:
        source = dataclasses.replace(cfg, format=DataFormat.kto if unpaired else DataFormat.preference)
        examples, counts = encode_rows(source, synthetic_rows(cfg, unpaired), tokenizer, "synthetic")
    else:
        rows = read_source(cfg, cfg.path, "data.path")
        examples, counts = encode_rows(cfg, list(rows.rows), tokenizer, rows.name)
    if cfg.val_path:
        val_rows = read_source(cfg, cfg.val_path, "data.val_path")
        val, val_counts = encode_rows(cfg, list(val_rows.rows), tokenizer, val_rows.name)
        return examples, val, counts | {"val_path": val_counts}
    train, val = split_rows(examples, cfg.val_size, cfg.seed)
    return train, val, counts


def all_preference_examples(cfg: DataConfig, tokenizer: Any, key: str = "data.path") -> list[PreferenceExample]:
    """Every usable row of `data.path` (or `data.hub_id`) in source order, encoded as training encodes it: a whole
    evaluation set, no split. `key` is the argument that named it, for messages."""
    rows = read_source(cfg, cfg.path, key)
    return encode_rows(cfg, list(rows.rows), tokenizer, rows.name)[0]


def _row(prompt: list[int], completion: list[int]) -> tuple[list[int], list[int]]:
    return prompt + completion, [IGNORE_INDEX] * len(prompt) + completion


def collate_preference(items: list[PreferenceExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Paired examples: the chosen rows, then the rejected rows (2B rows, one forward). Unpaired (KTO): the examples'
    rows, then B rows of each prompt with the next example's completion (the mismatched pairs KTO's reference point
    is estimated from), and `desirable` [B]. Padded on the right, with an attention mask."""
    rows = preference_rows(items)
    length = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for r, (i, lab) in enumerate(rows):
        ids[r, : len(i)] = torch.tensor(i)
        labels[r, : len(lab)] = torch.tensor(lab)
        mask[r, : len(i)] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if items[0].rejected is None:
        batch["desirable"] = torch.tensor([e.desirable for e in items])
    if items[0].reference is not None:  # in the rows' order: the chosen ones, then the rejected ones
        batch["ref_logps"] = torch.tensor([e.reference[0] for e in items] + [e.reference[1] for e in items])
    return batch


def preference_rows(items: list[PreferenceExample]) -> list[tuple[list[int], list[int]]]:
    """The rows of `collate_preference`, in its order, as (ids, labels)."""
    if items[0].rejected is not None:
        return [_row(e.prompt, e.chosen) for e in items] + [_row(e.prompt, e.rejected) for e in items]
    n = len(items)
    return [_row(e.prompt, e.chosen) for e in items] + [
        _row(e.prompt, items[(i + 1) % n].chosen) for i, e in enumerate(items)
    ]


def collate_flat_preference(items: list[PreferenceExample], pad_id: int) -> dict[str, torch.Tensor | int]:
    """`collate_preference`'s rows laid end to end in one row without padding (`hardware.padding_free`): every row
    keeps its own position ids (restarting at 0), and the sequence boundaries go with the batch for varlen attention
    (exp.data.batching.sequence_boundaries), so no token attends to another row. The forward then costs the rows'
    real tokens, where padded rows cost the longest row's length each: about half of a pair batch of real prompts
    and answers is padding.

    The loss reads only the completion tokens, so the decoder's output is gathered back into one short row per
    completion (exp.training.objectives): `row_index` [2B, C + 1] holds the positions, in the flat row, of the
    token before the completion and of its tokens, and `labels` [2B, C + 1] IGNORE then the completion's ids (C: the
    longest completion), laid out as padded rows so that every loss shifts them as it shifts padded rows. The head
    then never runs over prompt tokens either.

    The row, with at least one padding token (a sequence of its own, so every batch of B pairs has the same number
    of boundaries), and the gathered rows are rounded up to `bucket_length`: a pair batch's length varies with every
    batch, and each new length would be a new compiled graph and new sizes of the step's large activations, which
    the allocator cannot reuse for one another (on a GPU filled to its budget, that fragmentation runs it out of
    memory)."""
    rows = preference_rows(items)
    total = sum(len(ids) for ids, _ in rows)
    width = bucket_length(total + 1)
    ids = torch.full((1, width), pad_id, dtype=torch.long)
    positions = torch.zeros((1, width), dtype=torch.long)
    completion = bucket_length(max(sum(1 for x in lab if x != IGNORE_INDEX) for _, lab in rows) + 1)
    index = torch.zeros((len(rows), completion), dtype=torch.long)
    labels = torch.full((len(rows), completion), IGNORE_INDEX, dtype=torch.long)
    start = 0
    for r, (row_ids, row_labels) in enumerate(rows):
        n = len(row_ids)
        ids[0, start : start + n] = torch.tensor(row_ids)
        positions[0, start : start + n] = torch.arange(n)
        first = next(k for k, x in enumerate(row_labels) if x != IGNORE_INDEX)  # every row's prompt is non-empty
        span = n - first  # the completion (always at the row's end)
        index[r, : span + 1] = torch.arange(start + first - 1, start + n)
        labels[r, 1 : span + 1] = torch.tensor(row_labels[first:])
        start += n
    positions[0, start:] = torch.arange(width - start)
    batch: dict[str, torch.Tensor | int] = {
        "input_ids": ids,
        "position_ids": positions,
        **sequence_boundaries(positions),
        "labels": labels,
        "row_index": index,
        "real_tokens": torch.tensor(total),
    }
    if items[0].rejected is None:
        batch["desirable"] = torch.tensor([e.desirable for e in items])
    if items[0].reference is not None:
        batch["ref_logps"] = torch.tensor([e.reference[0] for e in items] + [e.reference[1] for e in items])
    return batch


def preference_collate(pad_id: int, flat: bool) -> Callable[[list[PreferenceExample]], dict[str, Any]]:
    """The collate function of `hardware.padding_free` (flat) or padded rows."""
    return functools.partial(collate_flat_preference if flat else collate_preference, pad_id=pad_id)


class PreferenceDataModule(L.LightningDataModule):
    """The preference splits, batched by examples (pairs, or KTO's labelled completions) in a seeded order that a
    resumed run continues from its position; validation in split order. Each completion is a row of its own (a
    pair's two are scored apart): padded rows, or with `flat` the micro-batch's rows end to end in one."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Any,
        micro_batch_size: int,
        unpaired: bool,
        num_workers: int = 0,
        step_micro_batches: int = 1,
        flat: bool = False,
    ):
        """`step_micro_batches`: the micro-batches of one optimiser step, all ranks together (what `data.group_by_length`
        sorts pairs within). `flat`: each micro-batch's rows laid end to end without padding
        (`collate_flat_preference`), training and validation alike."""
        super().__init__()
        self.cfg, self.tokenizer, self.padding_free = cfg, tokenizer, flat
        self.micro_batch_size, self.num_workers = micro_batch_size, num_workers
        self.unpaired, self.step_micro_batches = unpaired, step_micro_batches
        self.train_set, self.val_set, counts = preference_splits(cfg, tokenizer, unpaired)
        self.start_batch = 0
        kind = "unpaired completions" if unpaired else "pairs"
        self.stats: dict[str, Any] = {
            "train": {"examples": len(self.train_set)},
            "val": {"examples": len(self.val_set)},
            "bad_rows": counts["bad_rows"],
            "too_long": counts["too_long"],
            "truncated": counts["truncated"],
            "kind": kind,
        }
        # What exp.preview reports: the row numbers behind the counts (data.path's; data.val_path's apart).
        self.dropped = counts
        log.info(
            "data: %d training and %d held-out %s (%d rows; %d bad, %d with a prompt too long)",
            len(self.train_set), len(self.val_set), kind, counts["rows"], counts["bad_rows"], counts["too_long"],
        )  # fmt: skip

    # What the training pipeline reads of a DataModule.
    flat_accumulation = None
    step_weighted = False

    @property
    def batches_per_epoch(self) -> int:
        return len(self.train_epoch_batches(0))

    @property
    def step_sorted(self) -> bool:
        """`data.group_by_length` on pairs: each optimiser step's pairs sorted by length before they are cut into its
        micro-batches, so each micro-batch pads to a closer longest row. A step holds the same pairs either way and its
        loss is the mean over them (equal micro-batches), so only the padding changes. Within steps whatever
        `data.length_grouping` says: across steps would change what a step learns from. KTO keeps the seeded order:
        its reference point comes from the rows of each micro-batch."""
        return self.cfg.group_by_length and not self.unpaired and self.step_micro_batches > 1

    def train_epoch_batches(self, epoch: int) -> list[list[int]]:
        """The global micro-batches of training epoch `epoch`, in order (all ranks together)."""
        if self.step_sorted:
            # A pair's rows pad to the longer of its two.
            lengths = [len(e.prompt) + max(len(e.chosen), len(e.rejected)) for e in self.train_set]
            return step_sorted_batches(lengths, self.micro_batch_size, self.step_micro_batches, self.cfg.seed, epoch)
        return shuffled_batches(len(self.train_set), self.micro_batch_size, self.cfg.seed, epoch)

    def majority_token_accuracy(self) -> float:
        """The chance level a researcher compares preference accuracy with: a coin flip."""
        return 0.5

    def resume_at(self, batches_seen: int) -> None:
        self.start_batch = batches_seen

    def set_reference(self, train: list[tuple[float, float]], val: list[tuple[float, float]]) -> None:
        """Give every pair its reference log-probabilities (chosen, rejected), in split order."""
        for split, values in ((self.train_set, train), (self.val_set, val)):
            if len(values) != len(split):
                raise ValueError(f"{len(values)} reference values for {len(split)} examples")
            split[:] = [dataclasses.replace(e, reference=v) for e, v in zip(split, values, strict=True)]

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank()
        if self.batches_per_epoch == 0:
            raise ConfigError(
                f"the training split has {len(self.train_set)} preference examples, fewer than one micro-batch of "
                f"{self.micro_batch_size}: lower hardware.micro_batch_size or use more data"
            )
        stream = TrainStream(self.train_epoch_batches, rank, world, start=self.start_batch)
        return DataLoader(
            self.train_set,
            batch_sampler=stream,
            collate_fn=preference_collate(self.tokenizer.pad_token_id, self.padding_free),
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank()
        return DataLoader(
            self.val_set,
            batch_size=self.micro_batch_size,
            sampler=ShardSampler(len(self.val_set), rank, world),
            collate_fn=preference_collate(self.tokenizer.pad_token_id, self.padding_free),
            num_workers=self.num_workers,
        )
