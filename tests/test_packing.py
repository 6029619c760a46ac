"""Packing: rows filled with several examples, no cross-example attention, the same per-example loss as unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_typed, encode

from exp.core.constants import IGNORE_INDEX
from exp.data.batching import collate, length_grouped_batches, padding_stats
from exp.data.packing import pack


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
@pytest.mark.slow
def test_packed_rows_give_the_same_per_example_losses_as_unpacked_batches(attn):
    from transformers import AutoModelForCausalLM

    from exp.data.synthetic import generate_examples
    from exp.model.build import build_tokenizer, resolve_checkpoint

    cfg = compose_typed([])
    tok = build_tokenizer(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(cfg.model), attn_implementation=attn).eval()
    # As in training (exp.model.build turns the cache off): with a KV cache transformers skips packed-sequence detection.
    model.config.use_cache = False
    examples = [encode(tok, r)[0] for r in generate_examples(12, seed=3)]
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


def test_step_length_grouping_keeps_each_steps_examples_and_sorts_inside_it():
    """data.length_grouping=step: a step holds the examples plain random batching gives it; only its micro-batches
    are reordered (longest first), which cuts their padding."""
    from types import SimpleNamespace as E

    from exp.data.batching import shuffled_batches, step_sorted_batches

    lengths = [(i * 37) % 200 + 5 for i in range(403)]
    rows = [E(input_ids=[1] * n, labels=[1] * n) for n in lengths]
    batches = step_sorted_batches(lengths, 4, 4, seed=0, epoch=0)
    steps = shuffled_batches(403, 16, seed=0, epoch=0)
    assert len(batches) == 4 * len(steps) == 4 * 25  # the 3 examples left over from the last step are dropped
    for k, step in enumerate(steps):
        micro = batches[4 * k : 4 * k + 4]
        assert sorted(i for b in micro for i in b) == sorted(step)
        flat = [lengths[i] for b in micro for i in b]
        assert flat == sorted(flat, reverse=True)
    assert padding_stats(rows, batches)["padding_fraction"] < padding_stats(rows, steps)["padding_fraction"] / 2
    assert step_sorted_batches(lengths, 4, 4, 0, 1) != batches == step_sorted_batches(lengths, 4, 4, 0, 0)


@pytest.mark.parametrize("world_size", [1, 2])
def test_step_token_weighting_gives_the_gradient_of_the_whole_step(world_size):
    """Micro-batches of a step hold different numbers of loss tokens: weighted by exp.training.module.step_token_weighted,
    their accumulated gradients (Lightning's 1/accumulate, DDP's mean over ranks) equal the gradient of the mean
    over all the step's tokens, as one batch would give."""
    from exp.training.module import step_token_weighted

    torch.manual_seed(0)
    w = torch.randn(16, 32, requires_grad=True)
    hidden = torch.randn(8, 12, 16)
    labels = torch.randint(0, 32, (8, 12))
    for row, keep in enumerate([12, 3, 7, 1, 12, 5, 9, 2]):  # response lengths differ per row
        labels[row, keep:] = IGNORE_INDEX

    def mean_loss(h, y):
        logits = h @ w
        return F.cross_entropy(logits[:, :-1].reshape(-1, 32), y[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)

    (whole,) = torch.autograd.grad(mean_loss(hidden, labels), w)
    step_tokens = (labels[:, 1:] != IGNORE_INDEX).sum().float()
    accumulate = 4 // world_size
    ranks = []
    for r in range(world_size):
        grad = torch.zeros_like(w)
        for a in range(accumulate):
            rows = slice(2 * (a * world_size + r), 2 * (a * world_size + r) + 2)
            loss = step_token_weighted(mean_loss(hidden[rows], labels[rows]), labels[rows], step_tokens, accumulate,
                                       world_size)  # fmt: skip
            grad += torch.autograd.grad(loss / accumulate, w)[0]  # Lightning scales by 1/accumulate
        ranks.append(grad)
    torch.testing.assert_close(torch.stack(ranks).mean(0), whole)  # DDP averages the ranks
    unweighted = sum(torch.autograd.grad(mean_loss(hidden[k : k + 2], labels[k : k + 2]), w)[0] for k in (0, 2, 4, 6))
    assert not torch.allclose(unweighted / 4, whole, atol=1e-4)  # the plain mean of micro-batch means is not it


def test_step_grouped_batches_carry_their_steps_loss_tokens(tmp_path):
    import json

    from exp.data.batching import shuffled_batches
    from exp.data.datamodule import build_datamodule
    from exp.data.encoding import loss_tokens
    from exp.model.build import build_tokenizer

    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"instruction": "Say it.", "input": "", "output": " ".join(words[: 1 + i % 8])})
            for i in range(60)
        )  # fmt: skip
    )
    cfg = compose_typed(["data=alpaca", f"data.path={path}", "data.val_size=4"])
    assert cfg.data.group_by_length and cfg.data.length_grouping.value == "step"
    dm = build_datamodule(cfg.data, build_tokenizer(cfg.model), 2, 0, step_micro_batches=3)
    loader = iter(dm.train_dataloader())
    steps = shuffled_batches(len(dm.train_set), 6, cfg.data.seed, 0)
    for step in steps[:2]:
        micro = [next(loader) for _ in range(3)]
        expected = sum(loss_tokens(dm.train_set[i]) for i in step)
        assert [float(b["step_loss_tokens"]) for b in micro] == [expected] * 3
        assert sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro) == expected
    unweighted = build_datamodule(cfg.data.__class__(**{**vars(cfg.data), "length_grouping": "window"}),
                                  build_tokenizer(cfg.model), 2, 0, step_micro_batches=3)  # fmt: skip
    assert "step_loss_tokens" not in next(iter(unweighted.train_dataloader()))


@pytest.mark.slow
def test_packed_training_runs_end_to_end(tmp_path):
    from conftest import SHORT

    from exp.train import run

    result = run(
        SHORT + ["data.packing=true", "trainer.max_steps=4", "trainer.val_every_n_steps=4"],
        output_dir=tmp_path / "run",
    )
    assert result.final_val["val/loss"] < result.initial_val["val/loss"]
