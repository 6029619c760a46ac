"""Data: Alpaca-style files read with `datasets`, response-only labels, <bos> once, <eos> appended, clear errors."""

from __future__ import annotations

import json
import os

import pytest
from conftest import SHARED_DATA, SHORT, compose_typed

from exp.config import ConfigError
from exp.data import IGNORE_INDEX, InstructionDataModule, encode_example, format_prompt, load_examples
from exp.model import build_tokenizer

ROW = {"instruction": "Repeat the words exactly.", "input": "red fox", "output": "red fox"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(compose_typed([]).model)


def test_bos_once_eos_last_and_loss_on_the_response_only(tokenizer):
    enc, truncated = encode_example(tokenizer, ROW, max_seq_len=128, train_on_prompt=False)
    assert not truncated
    assert enc.input_ids[0] == tokenizer.bos_token_id and enc.input_ids.count(tokenizer.bos_token_id) == 1
    assert enc.input_ids[-1] == tokenizer.eos_token_id
    prompt_len = 1 + len(
        tokenizer(format_prompt(ROW["instruction"], ROW["input"]), add_special_tokens=False)["input_ids"]
    )
    assert enc.labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert enc.labels[prompt_len:] == enc.input_ids[prompt_len:]  # the response and <eos> carry the loss
    assert tokenizer.decode(enc.input_ids[prompt_len:-1]) == "red fox"
    full, _ = encode_example(tokenizer, ROW, max_seq_len=128, train_on_prompt=True)
    assert full.labels == full.input_ids


def test_truncation_keeps_the_prompt_and_drops_examples_without_response(tokenizer):
    enc, truncated = encode_example(
        tokenizer,
        ROW,
        max_seq_len=len(encode_example(tokenizer, ROW, 128, False)[0].input_ids) - 1,
        train_on_prompt=False,
    )
    assert truncated and enc.input_ids[-1] != tokenizer.eos_token_id
    gone, truncated = encode_example(tokenizer, ROW, max_seq_len=8, train_on_prompt=False)
    assert gone is None and truncated


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_alpaca_jsonl_with_mapped_columns_and_bad_rows(tmp_path, tokenizer, caplog):
    rows = [{"q": f"Say {i}", "ctx": "", "a": f"{i}"} for i in range(20)] + [{"q": "no answer", "ctx": ""}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = compose_typed(
        [
            "data=alpaca",
            f"data.path={path}",
            "data.instruction_field=q",
            "data.input_field=ctx",
            "data.output_field=a",
            "data.val_size=4",
        ]
    ).data
    examples = load_examples(cfg)
    assert len(examples) == 20 and examples[3] == {"instruction": "Say 3", "input": "", "output": "3"}
    assert "skipped 1 row" in caplog.text and "rows [20]" in caplog.text
    dm = InstructionDataModule(cfg, tokenizer, micro_batch_size=4)
    assert (dm.stats["train"]["kept"], dm.stats["val"]["kept"]) == (16, 4)


def test_missing_file_and_missing_column_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file or directory"):
        load_examples(compose_typed(["data=alpaca", f"data.path={tmp_path / 'nope.json'}"]).data)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "completion": "y"}])
    with pytest.raises(ConfigError) as e:
        load_examples(compose_typed(["data=alpaca", f"data.path={path}"]).data)
    assert (
        "no column 'instruction'" in str(e.value)
        and "prompt" in str(e.value)
        and "data.instruction_field" in str(e.value)
    )


@pytest.mark.skipif(not (SHARED_DATA / "alpaca_en_demo.json").exists(), reason="../shared/data not present")
def test_real_alpaca_file_trains_from_a_relative_path(tmp_path, monkeypatch):
    """Relative data paths are resolved against the launch directory (here: the parent of shared/)."""
    from exp.train import run

    monkeypatch.chdir(SHARED_DATA.parent.parent)
    rel = os.path.relpath(SHARED_DATA / "alpaca_en_demo.json")
    result = run(
        SHORT
        + [
            "data=alpaca",
            f"data.path={rel}",
            "data.max_seq_len=256",
            "trainer.max_steps=6",
            "trainer.val_every_n_steps=6",
            "trainer.limit_val_batches=4",
        ],
        output_dir=tmp_path / "run",
    )
    summary = json.loads((result.output_dir / "summary.json").read_text())
    assert summary["data"]["train"]["examples"] + summary["data"]["val"]["examples"] == 999
    assert summary["data"]["train"]["truncated"] > 0  # long answers at 256 tokens of a 512-entry tokenizer
    assert result.final_val["val/loss"] < result.initial_val["val/loss"]
    assert str(SHARED_DATA / "alpaca_en_demo.json") in (result.output_dir / "config.yaml").read_text()
