"""Packing: rows filled with several examples, no cross-example attention, the same per-example loss as unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_typed

from exp.data import IGNORE_INDEX, collate, encode_example, length_grouped_batches, padding_stats
from exp.packing import pack


def per_example_losses(logits: torch.Tensor, labels: torch.Tensor, starts: list[list[int]]) -> list[float]:
    """Mean next-token loss of each example, given where each example starts in its row."""
    out = []
    for row, row_starts in enumerate(starts):
        bounds = row_starts + [labels.shape[1]]
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            lg, lb = logits[row, s : e - 1], labels[row, s + 1 : e]
            if (lb != IGNORE_INDEX).any():
                out.append(F.cross_entropy(lg.float(), lb, ignore_index=IGNORE_INDEX).item())
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_give_the_same_per_example_losses_as_unpacked_batches(attn):
    from transformers import AutoModelForCausalLM

    from exp.model import build_tokenizer, resolve_checkpoint
    from exp.synthetic import generate_examples

    cfg = compose_typed([])
    tok = build_tokenizer(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(cfg.model), attn_implementation=attn).eval()
    # As in training (exp.model turns the cache off): with a KV cache transformers skips packed-sequence detection.
    model.config.use_cache = False
    examples = [encode_example(tok, r, 128, False)[0] for r in generate_examples(12, seed=3)]
    with torch.no_grad():
        unpacked = []
        for e in examples:
            b = collate([e], tok.pad_token_id)
            unpacked += per_example_losses(
                model(**{k: v for k, v in b.items() if k != "labels"}).logits, b["labels"], [[0]]
            )
        rows = pack(examples, 128, IGNORE_INDEX)
        assert len(rows) < len(examples) and all(len(r.input_ids) <= 128 for r in rows)
        batch = collate(rows, tok.pad_token_id)
        assert "attention_mask" not in batch  # transformers reads the boundaries from the position restarts
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        starts = [[k for k, p in enumerate(r.position_ids) if p == 0] for r in rows]
        order = [i for r in rows for i in _members(r, examples)]
        packed = per_example_losses(logits, batch["labels"], starts)
    by_example = dict(zip(order, packed, strict=True))
    diffs = [abs(by_example[i] - unpacked[i]) for i in range(len(examples))]
    assert max(diffs) < 1e-4, diffs
    # Without the position restarts (one long sequence) the losses would differ: the test can fail.
    with torch.no_grad():
        crossed = model(input_ids=batch["input_ids"]).logits
    assert (
        max(abs(a - b) for a, b in zip(per_example_losses(crossed, batch["labels"], starts), packed, strict=True))
        > 1e-3
    )


def _members(row, examples) -> list[int]:
    """Recover which examples a packed row holds, in order (examples are distinct)."""
    starts = [k for k, p in enumerate(row.position_ids) if p == 0] + [len(row.input_ids)]
    pieces = [row.input_ids[s:e] for s, e in zip(starts[:-1], starts[1:], strict=True)]
    return [next(i for i, e in enumerate(examples) if e.input_ids == p) for p in pieces]


def test_packing_fills_rows_and_never_labels_an_example_start():
    from types import SimpleNamespace as E

    examples = [E(input_ids=[2] + [5] * (n - 1), labels=[2] + [5] * (n - 1)) for n in (60, 50, 40, 30, 20, 10, 10)]
    rows = pack(examples, 64, IGNORE_INDEX)
    assert sorted(len(r.input_ids) for r in rows) == sorted([60, 50 + 10, 40 + 20, 30 + 10])
    for r in rows:
        for k, p in enumerate(r.position_ids):
            if p == 0:
                assert r.labels[k] == IGNORE_INDEX


def test_length_grouping_cuts_padding_and_is_seeded():
    from types import SimpleNamespace as E

    lengths = [(i * 37) % 200 + 5 for i in range(400)]
    rows = [E(input_ids=[1] * n, labels=[1] * n) for n in lengths]
    grouped = length_grouped_batches(lengths, 8, seed=0, epoch=0)
    assert sorted(i for b in grouped for i in b) == list(range(400))
    random_batches = [list(range(k, k + 8)) for k in range(0, 400, 8)]
    assert (
        padding_stats(rows, grouped)["padding_fraction"] < 0.1 < padding_stats(rows, random_batches)["padding_fraction"]
    )
    assert length_grouped_batches(lengths, 8, seed=0, epoch=0) == grouped != length_grouped_batches(lengths, 8, 0, 1)


def test_packed_training_runs_end_to_end(tmp_path):
    from conftest import SHORT

    from exp.train import run

    result = run(
        SHORT + ["data.packing=true", "trainer.max_steps=4", "trainer.val_every_n_steps=4"],
        output_dir=tmp_path / "run",
    )
    assert result.final_val["val/loss"] < result.initial_val["val/loss"]
