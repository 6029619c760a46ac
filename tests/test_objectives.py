"""Preference objectives end to end on the CPU (`objective=dpo|orpo|simpo|kto`): the configs refuse what cannot
work, preference rows are read and masked as docs/objectives.md says, and each objective trains on the real 4-bit
path with its metrics recorded. The losses' math against the papers and TRL: tests/test_preference_loss.py."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import compose_typed

from exp.core.config import ConfigError, DataConfig, DataFormat
from exp.core.constants import IGNORE_INDEX
from exp.data.preference import collate_preference, corrupt, encode_rows, synthetic_rows

SHORT = [
    "trainer.max_steps=4",
    "trainer.val_every_n_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.sample_count=0",
    "data.num_examples=96",
    "data.val_size=16",
    "logger=csv",
]


@pytest.fixture(scope="module")
def tokenizer():
    from exp.model.build import build_tokenizer

    return build_tokenizer(compose_typed([]).model)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["objective=dpo", "data=alpaca"], "data.format=alpaca"),
        (["objective=kto", "data.format=preference"], "objective=kto"),
        (["data.format=preference"], "data.format=preference is preference data"),
        (["objective=dpo", "objective.beta=0"], "objective.beta=0"),
        (["objective=dpo", "objective.label_smoothing=0.1"], "objective.dpo_loss=sigmoid"),
        (["objective=dpo", "data.packing=true"], "data.packing=true"),
    ],
)
def test_an_objective_and_its_data_must_agree(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_typed(overrides)


def test_every_objective_composes_with_the_default_data():
    for name in ("sft", "dpo", "orpo", "simpo", "kto"):
        assert compose_typed([f"objective={name}"]).objective.kind.value == name
    assert compose_typed(["objective=dpo", "objective.dpo_loss=robust", "objective.label_smoothing=0.1"])


def test_a_corrupted_answer_is_never_the_right_one():
    import random

    rng = random.Random(0)
    for r in synthetic_rows(DataConfig(num_examples=300), unpaired=False):
        assert r["rejected"] != r["chosen"]
    words = ["cat", "dog", "sun"]
    for _ in range(100):
        wrong = corrupt(words, rng)
        assert len(wrong) == len(words) and all(w != c for w, c in zip(wrong, words, strict=True))


def test_pairs_are_masked_to_their_completions_and_bad_rows_named(tokenizer):
    cfg = DataConfig(format=DataFormat.preference, max_seq_len=64)
    rows = [
        {"prompt": "Say red.", "chosen": "red", "rejected": "blue"},
        {"prompt": "Say sun.", "chosen": "sun"},  # no rejected completion
        {"prompt": "Say owl.", "chosen": "owl", "rejected": 3},
    ]
    examples, counts = encode_rows(cfg, rows, tokenizer, "pairs.jsonl")
    assert len(examples) == 1 and counts["bad_rows"] == 2
    e = examples[0]
    assert e.prompt[0] == tokenizer.bos_token_id
    assert e.chosen[-1] == e.rejected[-1] == tokenizer.eos_token_id
    batch = collate_preference([e, e], tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 4  # chosen rows, then rejected rows
    for row in range(4):
        labels = batch["labels"][row]
        completion = e.chosen if row < 2 else e.rejected
        assert (labels != IGNORE_INDEX).sum() == len(completion)
        assert (labels[: len(e.prompt)] == IGNORE_INDEX).all()
    with pytest.raises(ConfigError, match=r"row 1: missing 'rejected'.*row 2: 'rejected'"):
        encode_rows(DataConfig(format=DataFormat.preference, on_bad_rows="fail"), rows, tokenizer, "pairs.jsonl")


def test_conversation_pairs_use_the_chat_template_and_share_the_prompt(tokenizer):
    cfg = DataConfig(format=DataFormat.preference, max_seq_len=128)
    user = {"role": "user", "content": "Name a colour."}
    row = {
        "chosen": [user, {"role": "assistant", "content": "red"}],
        "rejected": [user, {"role": "assistant", "content": "dog"}],
    }
    (e,), _ = encode_rows(cfg, [row], tokenizer, "chat.jsonl")
    prompt = tokenizer.decode(e.prompt)
    assert "Name a colour." in prompt and prompt.rstrip().endswith("model")
    assert tokenizer.decode(e.chosen).startswith("red") and tokenizer.decode(e.chosen).endswith("<end_of_turn>")
    mismatched = {**row, "rejected": [{"role": "user", "content": "Other."}, {"role": "assistant", "content": "x"}]}
    assert encode_rows(cfg, [row, mismatched], tokenizer, "chat.jsonl")[1]["bad_rows"] == 1


def test_a_prompt_too_long_drops_the_row_and_a_long_completion_is_cut(tokenizer):
    cfg = DataConfig(format=DataFormat.preference, max_seq_len=12)
    rows = [
        {"prompt": "red " * 30, "chosen": "a", "rejected": "b"},
        {"prompt": "Say it.", "chosen": "red " * 30, "rejected": "blue"},
    ]
    examples, counts = encode_rows(cfg, rows, tokenizer, "pairs.jsonl")
    assert counts["too_long"] == 1 and len(examples) == 1
    assert len(examples[0].prompt) + len(examples[0].chosen) == 12


def test_kto_batches_carry_labels_and_mismatched_rows(tokenizer):
    rows = synthetic_rows(DataConfig(num_examples=20), unpaired=True)
    assert {r["label"] for r in rows} == {True, False}
    examples, _ = encode_rows(DataConfig(format=DataFormat.kto), rows, tokenizer, "synthetic")
    batch = collate_preference(examples[:3], tokenizer.pad_token_id)
    assert batch["desirable"].tolist() == [e.desirable for e in examples[:3]]
    # Row 3 is example 0's prompt with example 1's completion.
    kl = batch["input_ids"][3][batch["attention_mask"][3].bool()].tolist()
    assert kl == examples[0].prompt + examples[1].chosen


def _val_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open() as f:
        return [r for r in csv.DictReader(f) if r.get("val/accuracy")]


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo", "kto"])
def test_each_objective_trains_and_records_its_metrics(objective, tmp_path):
    """A short run of each objective on the generated pairs: finite losses, the preference metrics in metrics.csv
    and summary.json, a PEFT adapter. DPO and KTO start at their reference (the base with the adapters off, and the
    adapters start as a no-op): every step-0 reward is exactly 0."""
    from exp.train import run

    run([f"objective={objective}", *SHORT], output_dir=tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    final = summary["final_val"]
    for key in ("val/loss", "val/accuracy", "val/rewards/chosen", "val/rewards/rejected", "val/logps/chosen"):
        assert torch.isfinite(torch.tensor(final[key])), key
    assert 0 <= final["val/accuracy"] <= 1
    if objective in ("dpo", "kto"):
        assert summary["initial_val"]["val/rewards/chosen"] == 0.0
        assert summary["initial_val"]["val/rewards/rejected"] == 0.0
        # Trained adapters move the policy off its reference: a reference that kept the adapters on would leave 0.
        assert final["val/rewards/chosen"] != 0.0 and final["val/rewards/rejected"] != 0.0
    else:  # ORPO and SimPO reward the policy's own per-token log-probabilities: negative
        assert summary["initial_val"]["val/rewards/chosen"] < 0
    if objective == "orpo":
        assert final["val/nll"] > 0
    assert [int(r["step"]) for r in _val_rows(tmp_path / "run")] == [0, 2, 4]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_the_default_dpo_run_learns_the_generated_preferences(tmp_path):
    """`python -m exp.train objective=dpo` on the embedded default (tiny Gemma from random weights, generated pairs)
    moves held-out preference accuracy from 0 (every step-0 reward is 0: no pair is strictly preferred) to at least
    0.9; a 300-step run of it (the default run takes 3000) already does."""
    from exp.train import run

    run(
        ["objective=dpo", "trainer.max_steps=300", "trainer.val_every_n_steps=300", "trainer.sample_count=0",
         "data.val_size=64", "logger=csv"],
        output_dir=tmp_path / "run",
    )  # fmt: skip
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["initial_val"]["val/accuracy"] == 0.0
    assert summary["final_val"]["val/accuracy"] >= 0.9, summary["final_val"]


def test_grouping_by_length_sorts_pairs_within_each_step_only(tokenizer):
    """data.group_by_length on pairs: every optimiser step holds the pairs of the seeded order, sorted by length into
    its micro-batches (less padding); KTO's micro-batches keep the seeded order (its reference point is per batch)."""
    from exp.data.preference import PreferenceDataModule

    def module(group: bool, unpaired: bool = False) -> PreferenceDataModule:
        # The generated pairs (data.format=synthetic, the default data of every objective).
        cfg = DataConfig(num_examples=96, val_size=16, group_by_length=group, max_seq_len=64)
        return PreferenceDataModule(cfg, tokenizer, 4, unpaired, step_micro_batches=3)

    plain, grouped = module(False).train_epoch_batches(0), module(True).train_epoch_batches(0)
    steps = len(grouped) // 3
    assert steps and len(grouped) == 3 * steps
    for k in range(steps):
        assert sorted(sum(grouped[3 * k : 3 * k + 3], [])) == sorted(sum(plain[3 * k : 3 * k + 3], []))
    train = module(True).train_set

    def slots(batches):
        return sum(max(len(train[i].prompt) + max(len(train[i].chosen), len(train[i].rejected)) for i in b)
                   for b in batches[: 3 * steps])  # fmt: skip

    assert slots(grouped) < slots(plain)
    assert module(True, unpaired=True).train_epoch_batches(0) == module(False, unpaired=True).train_epoch_batches(0)
