"""Padding-free micro-batches: the same steps, the same losses and gradients as padded batches, per Gemma family."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_typed

from exp.core.constants import IGNORE_INDEX
from exp.data.batching import collate, collate_flat, flat_rows, sequence_boundaries, shuffled_batches
from exp.data.datamodule import build_run_datamodule
from exp.data.encoding import Encoded, loss_tokens
from exp.data.packing import concatenate
from exp.data.padding_free import (
    PAD_MULTIPLE,
    FlatBatching,
    balanced_split,
    bucket_length,
    even_out,
    largest_load,
    micro_batch_slots,
    micro_batches_per_step,
    pack_rows,
    row_length,
    validation_groups,
)
from exp.model import varlen
from exp.training.module import step_token_weighted

# Example lengths of one step: several longer than the sliding window below, one of a single response token.
LENGTHS = [41, 7, 23, 2, 36, 15]
WINDOW = 8


def tiny_model(family: str, head_dim: int = 8):
    """A random fp32 model of `family`: Gemma 2 with its softcapping (eager), Gemma 2 / 3 with a sliding window
    shorter than most examples, and a full-attention layer beside it."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GemmaConfig,
        GemmaForCausalLM,
    )

    common = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        use_cache=False,
        initializer_range=0.2,  # larger than Gemma's, so that the logits (and any mistake) are not flat
    )
    torch.manual_seed(0)
    if family == "gemma":
        model = GemmaForCausalLM(GemmaConfig(num_hidden_layers=2, **common, attn_implementation="sdpa"))
    elif family == "gemma2":
        config = Gemma2Config(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,  # low enough to bend the scores of this model (Gemma 2's is 50)
            final_logit_softcapping=3.0,
            **common,
            attn_implementation="eager",
        )
        model = Gemma2ForCausalLM(config)
    else:
        config = Gemma3TextConfig(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            **common,
            attn_implementation="sdpa",
        )
        model = Gemma3ForCausalLM(config)
    return model.float().train()  # dropout is 0 in these configs: train mode changes nothing but is what training runs


def examples(seed: int = 0) -> list[Encoded]:
    """A step's examples: a prompt (no loss) then a response (loss), as exp's encoding gives them."""
    rng = random.Random(seed)
    out = []
    for n in LENGTHS:
        ids = [2] + [rng.randrange(3, 97) for _ in range(n - 1)]
        prompt = max(1, n // 3) if n > 2 else 1
        out.append(Encoded(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return out


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position next-token loss of one row (0 where no loss is taken)."""
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=IGNORE_INDEX, reduction="none")


def on(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def padded_step(model, step: list[Encoded], micro: int):
    """Per-example mean losses, the step's loss and its gradients from padded micro-batches of `micro` examples."""
    device = next(model.parameters()).device
    model.zero_grad()
    total = sum(loss_tokens(e) for e in step)
    per_example, step_loss = [], 0.0
    for k in range(0, len(step), micro):
        batch = on(collate(step[k : k + micro], pad_id=0), device)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        summed = 0
        for row in range(logits.shape[0]):
            t = token_losses(logits[row], batch["labels"][row])
            n = (batch["labels"][row, 1:] != IGNORE_INDEX).sum()
            per_example.append((t.sum() / n).item())
            summed = summed + t.sum()
        (summed / total).backward()
        step_loss += (summed / total).item()
    return per_example, step_loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def flat_step(model, step: list[Encoded], parts: int, restart_positions: bool = True, row_tokens: int | None = None):
    """The same from padding-free micro-batches, as exp trains them: `collate_flat` rows (their position ids and
    sequence boundaries; several rows of at most `row_tokens` tokens when given), transformers' own loss
    (`model(**batch).loss`, the mean over the micro-batch), re-weighted by `step_token_weighted` and divided by the
    accumulation as Lightning does."""
    device = next(model.parameters()).device
    model.zero_grad()
    total = sum(loss_tokens(e) for e in step)
    lengths = [len(e.input_ids) for e in step]
    groups = balanced_split(list(range(len(step))), lengths, parts)
    per_example: dict[int, float] = {}
    step_loss = 0.0
    for group in groups:
        batch = collate_flat([(step[i], total) for i in group], pad_id=0, row_tokens=row_tokens)
        rows = (
            [group]
            if row_tokens is None
            else [
                [group[p] for p in r]
                for r in pack_rows(list(range(len(group))), [lengths[i] for i in group], row_tokens)
            ]
        )
        assert "attention_mask" not in batch and batch["input_ids"].shape[0] == len(rows)
        longest = max(sum(lengths[i] for i in r) for r in rows)
        assert batch["input_ids"].shape[1] == row_length(longest)
        assert row_tokens is None or longest <= row_tokens
        batch.pop("real_tokens")
        step_tokens = batch.pop("step_loss_tokens")
        if restart_positions:
            inputs = batch
        else:
            ids = batch["input_ids"]
            positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            inputs = {**sequence_boundaries(positions), "input_ids": ids}
            inputs["position_ids"], inputs["labels"] = positions, batch["labels"]
        batch, inputs = on(batch, device), on(inputs, device)
        out = model(**inputs)
        loss = step_token_weighted(out.loss, batch["labels"], step_tokens, accumulate=parts, world_size=1) / parts
        loss.backward()
        step_loss += loss.item()
        for r, row in enumerate(rows):
            t = token_losses(out.logits[r], batch["labels"][r])
            start = 0
            for i in row:
                n = lengths[i]
                segment = t[start : start + n - 1]  # position start + j predicts label start + j + 1, in the example
                counted = (batch["labels"][r, start + 1 : start + n] != IGNORE_INDEX).sum()
                per_example[i] = (segment.sum() / counted).item()
                start += n
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return [per_example[i] for i in range(len(step))], step_loss, grads


@pytest.mark.parametrize(
    "family,attn", [("gemma", None), ("gemma2", None), ("gemma3", None), ("gemma", "varlen"), ("gemma3", "varlen")]
)
def test_padding_free_losses_and_gradients_equal_padded(family, attn):
    """SDPA's (and eager's) block-diagonal mask from the position ids, and exp's varlen attention from the batch's
    sequence boundaries (on the CPU: SDPA one example at a time, the CUDA kernel's reference)."""
    model = tiny_model(family)
    if attn:
        varlen.register()
        model.config._attn_implementation = attn
    assert_flat_step_equals_padded(model)


def test_eager_rows_capped_at_a_length_equal_padded():
    """Gemma 2 on eager attention (softcapping, a sliding window shorter than some examples): micro-batches of
    several rows of at most 48 tokens (the step's examples first-fit into rows) give the padded step's per-example
    losses, step loss and gradients."""
    assert_flat_step_equals_padded(tiny_model("gemma2"), row_tokens=48)


def assert_flat_step_equals_padded(
    model,
    flat_attn: str | None = None,
    rel: float = 1e-5,
    grad_rtol: float = 1e-5,
    grad_atol: float = 1e-6,
    row_tokens: int | None = None,
):
    """The padding-free step (with `flat_attn`, else the model's attention) gives the padded step's per-example
    losses, step loss and gradients; one long sequence instead (positions running on) gives other losses."""
    step = examples()
    assert max(LENGTHS) > WINDOW  # the sliding window is shorter than some examples
    ref_examples, ref_loss, ref_grads = padded_step(model, step, micro=3)
    if flat_attn:
        model.config._attn_implementation = flat_attn
    got_examples, got_loss, got_grads = flat_step(model, step, parts=2, row_tokens=row_tokens)
    assert got_examples == pytest.approx(ref_examples, rel=rel, abs=rel / 10)
    assert got_loss == pytest.approx(ref_loss, rel=rel)
    for name, g in ref_grads.items():
        torch.testing.assert_close(
            got_grads[name], g, rtol=grad_rtol, atol=grad_atol, msg=lambda m, n=name: f"{n}: {m}"
        )
    # The check can fail: one long sequence (positions running on, attention across examples) gives other losses.
    wrong_examples, _, _ = flat_step(model, step, parts=2, restart_positions=False, row_tokens=row_tokens)
    assert max(abs(a - b) for a, b in zip(wrong_examples, ref_examples, strict=True)) > 1e-3


def test_balanced_split_keeps_the_steps_examples_and_balances_tokens():
    lengths = [100, 90, 80, 10, 10, 10, 5, 5]
    step = [7, 3, 0, 5, 1, 6, 2, 4]
    groups = balanced_split(step, lengths, 3)
    assert sorted(i for g in groups for i in g) == sorted(step)  # every example once
    assert all(g == sorted(g, key=step.index) for g in groups)  # each in the step's order
    # 310 tokens in 3 parts need >= 104 in one; the split finds the best, 105.
    assert largest_load(groups, lengths) == 105
    plan = FlatBatching(token_budget=200, global_batch_size=8)
    assert micro_batches_per_step([step], lengths, plan) == 2  # 310 tokens: two micro-batches of <= 200
    assert micro_batches_per_step([step], lengths, FlatBatching(400, 8)) == 1
    # With ranks, a multiple of them.
    assert micro_batches_per_step([step], lengths, FlatBatching(200, 8, world_size=2)) == 2
    assert micro_batches_per_step([step], lengths, FlatBatching(100, 8, world_size=4)) == 4
    assert micro_batches_per_step([step], lengths, FlatBatching(100, 8, world_size=3)) == 6  # 310 > 3 x 100
    assert row_length(1) == PAD_MULTIPLE and row_length(PAD_MULTIPLE) == PAD_MULTIPLE


def varied_alpaca(path, n: int = 120, seed: int = 0) -> None:
    """An Alpaca-format file of very different lengths (a few words to a few hundred characters)."""
    rng = random.Random(seed)
    words = "river stone seven blue quick model answer light paper green under over".split()
    rows = [
        {
            "instruction": " ".join(rng.choice(words) for _ in range(rng.randint(2, 10))),
            "input": "",
            "output": " ".join(rng.choice(words) for _ in range(rng.choice([1, 3, 8, 20, 45]))),
        }
        for _ in range(n)
    ]
    path.write_text(json.dumps(rows))


def test_padding_free_steps_hold_the_padded_steps_examples(tmp_path):
    """hardware=gpu composed on the CPU: each step's micro-batches together hold exactly that step's examples of
    plain seeded batching, within the token budget, with (almost) no padding; the loader yields what was planned."""
    from exp.model.build import build_tokenizer

    data = tmp_path / "varied.json"
    varied_alpaca(data)
    cfg = compose_typed(
        [
            "hardware=gpu",
            "hardware.accelerator=cpu",
            "data=alpaca",
            f"data.path={data}",
            "data.max_seq_len=256",
            "trainer.global_batch_size=16",
            "trainer.max_steps=12",
            "hardware.micro_batch_tokens=1024",
            "data.val_size=0.3",
        ]
    )
    dm = build_run_datamodule(cfg, build_tokenizer(cfg.model), num_workers=0)
    k = dm.step_micro_batches
    assert dm.flat_accumulation == k and k >= 2  # 16 examples of up to 256 tokens do not fit in one 1,024 budget
    lengths = [len(e.input_ids) for e in dm.train_set]
    for epoch in range(2):
        micro = dm.train_epoch_batches(epoch)
        steps = shuffled_batches(len(dm.train_set), 16, cfg.data.seed, epoch)
        assert len(micro) == len(steps) * k
        for s, step in enumerate(steps):
            got = micro[s * k : (s + 1) * k]
            assert sorted(i for g in got for i in g) == sorted(step)
            if epoch == 0 and s < cfg.trainer.max_steps:
                assert largest_load(got, lengths) <= 1024
    stats = dm.stats["train"]
    assert stats["padding_fraction"] <= 0.05 and stats["micro_batches_per_step"] == k
    # What the loader yields: rows of real tokens, the step's loss-token total on each micro-batch.
    loader = iter(dm.train_dataloader())
    first = [next(loader) for _ in range(k)]
    plan = dm.train_epoch_batches(0)[:k]
    total = sum(loss_tokens(dm.train_set[i]) for g in plan for i in g)
    for batch, group in zip(first, plan, strict=True):
        assert int(batch["real_tokens"]) == sum(lengths[i] for i in group)
        assert float(batch["step_loss_tokens"]) == total
        assert batch["input_ids"].shape == (1, row_length(int(batch["real_tokens"])))
    # Validation is padding-free too: every held-out example exactly once, rows within the budget.
    val_rows = list(dm.val_dataloader())
    assert len(val_rows) >= 2 and all(b["input_ids"].shape[0] == 1 for b in val_rows)
    assert all(b["input_ids"].shape[1] <= 1024 and "attention_mask" not in b for b in val_rows)
    held_out = sorted(tuple(e.input_ids) for e in dm.val_set)
    seen = []
    for b in val_rows:
        ids, starts = b["input_ids"][0].tolist(), b["cu_seq_lens_q"].tolist()
        seen += [tuple(ids[a:z]) for a, z in zip(starts, starts[1:], strict=False)]
    # Every segment between restarts is a held-out example but a row's padding tail.
    assert sorted(x for x in seen if x in set(held_out)) == held_out and len(seen) <= len(held_out) + len(val_rows)
    real = sum(len(e.input_ids) for e in dm.val_set)
    assert 1 - real / sum(b["input_ids"].numel() for b in val_rows) <= 0.05


def gemma2_capped_rows_run(tmp_path) -> list[str]:
    """Overrides of a tiny Gemma 2 (eager) run under hardware=gpu on a varied Alpaca file written into `tmp_path`:
    rows capped at 128 tokens, four to a 512-token micro-batch, 16 examples a step."""
    data = tmp_path / "varied.json"
    varied_alpaca(data)
    return [
        "model.family=gemma2",
        "model.attn_implementation=eager",
        "hardware=gpu",
        "data=alpaca",
        f"data.path={data}",
        "data.max_seq_len=128",
        "hardware.micro_batch_tokens=512",
        "trainer.global_batch_size=16",
    ]


@pytest.mark.slow
def test_gemma2_eager_twin_trains_rows_capped_at_max_seq_len(tmp_path):
    """The GPU configuration's CPU twin of a Gemma 2 (eager) run: its micro-batches are several rows of at most
    data.max_seq_len tokens holding each step's examples, with little padding, and it trains."""
    from exp.train import run

    overrides = [*gemma2_capped_rows_run(tmp_path), "hardware.accelerator=cpu", "trainer.max_steps=3"]
    overrides += ["trainer.val_every_n_steps=3", "trainer.sample_count=0", "logger=csv"]
    from exp.model.build import build_tokenizer

    cfg = compose_typed(overrides)
    dm = build_run_datamodule(cfg, build_tokenizer(cfg.model), num_workers=0)
    assert dm.flat.row_tokens == 128 and dm.flat.rows_per_micro_batch == 4
    k = dm.step_micro_batches
    plan, loader = dm.train_epoch_batches(0)[:k], iter(dm.train_dataloader())
    lengths = [len(e.input_ids) for e in dm.train_set]
    rows_seen = []
    for group in plan:
        batch = next(loader)
        rows = batch["input_ids"].shape[0]
        rows_seen.append(rows)
        assert batch["input_ids"].shape[1] <= 128 and rows <= 4
        assert int(batch["real_tokens"]) == sum(lengths[i] for i in group)
        # Every row's examples restart their positions; the row holds no more than max_seq_len real tokens.
        assert (batch["position_ids"][:, 0] == 0).all()
    assert max(rows_seen) >= 2  # several rows in a micro-batch
    assert dm.stats["train"]["padding_fraction"] <= 0.15
    result = run(overrides, output_dir=tmp_path / "run")
    summary = json.loads((result.output_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["data"]["train"]["row_tokens"] == 128
    # Each validation's cost, padding-free: the step-0 and the final one, every held-out example in a few rows.
    times = summary["validation_seconds"]
    assert [t["step"] for t in times] == [0, 3] and all(t["seconds"] > 0 for t in times)
    assert all(t["examples"] == len(dm.val_set) and 1 <= t["micro_batches"] < len(dm.val_set) for t in times)
    assert result.final_val["val/loss"] < result.initial_val["val/loss"]


def test_padded_batching_is_unchanged_without_padding_free(tmp_path):
    data = tmp_path / "varied.json"
    varied_alpaca(data)
    from exp.model.build import build_tokenizer

    cfg = compose_typed(["data=alpaca", f"data.path={data}", "data.max_seq_len=256"])
    assert not cfg.hardware.padding_free
    dm = build_run_datamodule(cfg, build_tokenizer(cfg.model), num_workers=0)
    assert dm.flat is None and dm.flat_accumulation is None
    assert "micro_batches_per_step" not in dm.stats["train"]


def test_micro_batch_tokens_below_the_longest_example_is_refused():
    from exp.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"hardware.micro_batch_tokens=100 is below data.max_seq_len=128"):
        compose_typed(["hardware.padding_free=true", "hardware.micro_batch_tokens=100"])


def test_packed_rows_with_varlen_equal_sdpa_mask():
    """Packed rows (several rows, each with a padding tail) through varlen attention, whose boundaries span the
    rows flattened end to end, give the losses of SDPA's block-diagonal mask."""
    model = tiny_model("gemma3")
    step = examples()
    rows = [concatenate(step[:3], IGNORE_INDEX), concatenate(step[3:], IGNORE_INDEX)]
    batch = collate(rows, pad_id=0)
    assert batch["cu_seq_lens_q"].tolist()[-1] == batch["input_ids"].numel()
    with torch.no_grad():
        ref = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss
        varlen.register()
        model.config._attn_implementation = "varlen"
        got = model(**batch).loss
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)


def test_varlen_takes_fp32_projections_in_the_autocast_dtype_and_refuses_them_outside():
    """FlashAttention takes fp16 / bf16 only. Within a bf16 step DoRA's projections come out in fp32 (its fp32
    magnitude vector scales them): the kernel gets them cast as SDPA would cast them; outside autocast the error
    names the key and the fix."""
    q, k, v = (torch.randn(6, h, 8) for h in (4, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = varlen.flash_dtype(q, k, v)
    assert [x.dtype for x in cast] == [torch.bfloat16] * 3
    assert all(torch.equal(a, b.to(torch.bfloat16)) for a, b in zip(cast, (q, k, v), strict=True))
    halves = tuple(x.to(torch.bfloat16) for x in (q, k, v))
    assert all(a is b for a, b in zip(varlen.flash_dtype(*halves), halves, strict=True))
    with pytest.raises(ValueError, match=r"model.attn_implementation=varlen.*float32.*hardware.precision=bf16-mixed"):
        varlen.flash_dtype(q, k, v)


def test_bucket_lengths_take_four_shapes_per_doubling_with_at_most_a_fifth_padding():
    lengths = {n: bucket_length(n) for n in range(1, 20_000)}
    assert all(
        b >= n and b % PAD_MULTIPLE == 0 and (b - n) <= b / 5 for n, b in lengths.items() if n > 4 * PAD_MULTIPLE
    )
    assert len({lengths[n] for n in range(4097, 8193)}) == 4
    assert [bucket_length(n) for n in (1, 16, 17, 1024, 1025, 4000)] == [16, 16, 32, 1024, 1280, 4096]


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
@pytest.mark.parametrize("impl", ["hf", "chunked"])
@pytest.mark.parametrize("rows", [None, 32])
def test_padding_free_validation_metrics_equal_padded(family, impl, rows):
    """Validation's sums (loss, hits, exact matches, examples) over padding-free rows equal those over padded
    batches: each example is scored by itself, exact match included, across several rows of a small budget."""
    from exp.core.config import LossImpl
    from exp.model.metrics import batch_response_metrics

    model = tiny_model(family).eval()
    step = examples()
    with torch.no_grad():
        padded = collate(step, pad_id=0)
        logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
    # Two examples answered perfectly (teacher-forced): their response labels are the model's arg-max, so exact
    # match has something to count; the inputs are unchanged.
    for i in (1, 3):
        n, labels = LENGTHS[i], step[i].labels
        best = logits[i, : n - 1].argmax(-1).tolist()
        step[i] = Encoded(
            step[i].input_ids,
            [labels[0]] + [b if t != IGNORE_INDEX else t for b, t in zip(best, labels[1:], strict=True)],
        )

    def sums(batches):
        out: dict[str, float] = {}
        with torch.no_grad():
            for b in batches:
                for k, v in batch_response_metrics(model, b, LossImpl(impl)).items():
                    out[k] = out.get(k, 0.0) + float(v)
        return out

    ref = sums([collate(step[:3], pad_id=0), collate(step[3:], pad_id=0)])
    # rows=32: micro-batches of up to three rows of at most 32 tokens (the 41 and 36-token examples alone).
    groups = validation_groups(LENGTHS, FlatBatching(96 if rows else 48, len(LENGTHS), row_tokens=rows))
    assert len(groups) >= 2 and sorted(i for g in groups for i in g) == list(range(len(step)))
    batches = [flat_rows([step[i] for i in g], pad_id=0, row_tokens=rows) for g in groups]
    assert rows is None or max(b["input_ids"].shape[0] for b in batches) >= 2
    got = sums(batches)
    assert got["loss_sum"] == pytest.approx(ref["loss_sum"], rel=1e-5)
    assert {k: got[k] for k in ("tokens", "hits", "exact", "examples")} == {
        k: ref[k] for k in ("tokens", "hits", "exact", "examples")
    }
    assert ref["exact"] >= 2 and ref["examples"] == len(step)


def test_validation_groups_are_the_fewest_within_the_budget_and_a_multiple_of_the_ranks():
    lengths = [random.Random(i).randint(5, 200) for i in range(101)]
    for budget, world in ((256, 1), (512, 2), (1000, 4), (200, 3)):
        groups = validation_groups(lengths, FlatBatching(budget, len(lengths), world))
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert largest_load(groups, lengths) <= budget and len(groups) % world == 0
        fewest = -(-sum(lengths) // budget)
        assert len(groups) >= fewest
    assert validation_groups([], FlatBatching(64, 1)) == []
    capped = FlatBatching(600, len(lengths), 2, row_tokens=200)
    groups = validation_groups(lengths, capped)
    assert len(groups) % 2 == 0 and sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(pack_rows(g, lengths, 200)) <= 3 for g in groups)


def test_rows_are_evened_out_beyond_longest_first():
    """Longest-first greedy puts 300 + 200 + 200 against 300 + 200 (700 / 500 tokens); one swap evens them to
    600 / 600, and the micro-batch pads to the longer row. Members and the step's order are kept."""
    step = [7, 3, 9, 1, 5]
    lengths = {7: 300, 3: 200, 9: 300, 1: 200, 5: 200}
    dense = [lengths.get(i, 0) for i in range(10)]
    greedy = balanced_split(step, dense, 2)
    assert largest_load(greedy, dense) == 700
    rows = pack_rows(step, dense, 700)
    assert sorted(len(r) for r in rows) == [2, 3] and largest_load(rows, dense) == 600
    assert sorted(i for r in rows for i in r) == sorted(step)
    assert all(r == [i for i in step if i in r] for r in rows)  # each row in the step's order
    assert even_out(rows, dense, step) == rows  # nothing left to improve


def test_capped_rows_fill_at_most_the_budgets_rows_and_count_their_padding():
    lengths = [190, 120, 90, 60, 40, 30, 10, 200]
    rows = pack_rows(list(range(8)), lengths, 200)
    assert sorted(i for r in rows for i in r) == list(range(8))
    assert all(sum(lengths[i] for i in r) <= 200 for r in rows) and all(r == sorted(r) for r in rows)
    assert len(rows) == 4  # 740 tokens: first fit needs four rows, whose tokens are then balanced
    assert max(sum(lengths[i] for i in r) for r in rows) == 200
    plan = FlatBatching(400, 8, row_tokens=200)  # two rows a micro-batch
    k = micro_batches_per_step([list(range(8))], lengths, plan)
    assert k == 2 and all(len(pack_rows(g, lengths, 200)) <= 2 for g in balanced_split(list(range(8)), lengths, k))
    # 190, 120 and 10 tokens: two rows, balanced to 190 and 130, both padded to the longest (rounded up).
    assert micro_batch_slots([0, 6, 1], lengths, 200) == 2 * row_length(190)
    assert micro_batch_slots([0, 6, 1], lengths, None) == row_length(320)
