"""Data: Alpaca-style files read with `datasets`, response-only labels, <bos> once, <eos> appended, clear errors."""

from __future__ import annotations

import json
import os

import pytest
from conftest import SHARED_DATA, SHORT, compose_typed, encode

from exp.core.config import ConfigError
from exp.core.constants import IGNORE_INDEX
from exp.data.datamodule import InstructionDataModule
from exp.data.formats import format_prompt
from exp.data.splits import all_examples
from exp.model.build import build_tokenizer

ROW = {"instruction": "Repeat the words exactly.", "input": "red fox", "output": "red fox"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(compose_typed([]).model)


def test_bos_once_eos_last_and_loss_on_the_response_only(tokenizer):
    enc, truncated = encode(tokenizer, ROW, max_seq_len=128, train_on_prompt=False)
    assert not truncated
    assert enc.input_ids[0] == tokenizer.bos_token_id and enc.input_ids.count(tokenizer.bos_token_id) == 1
    assert enc.input_ids[-1] == tokenizer.eos_token_id
    prompt_len = 1 + len(
        tokenizer(format_prompt(ROW["instruction"], ROW["input"]), add_special_tokens=False)["input_ids"]
    )
    assert enc.labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert enc.labels[prompt_len:] == enc.input_ids[prompt_len:]  # the response and <eos> carry the loss
    assert tokenizer.decode(enc.input_ids[prompt_len:-1]) == "red fox"
    full, _ = encode(tokenizer, ROW, max_seq_len=128, train_on_prompt=True)
    assert full.labels == full.input_ids


def test_truncation_keeps_the_prompt_and_drops_examples_without_response(tokenizer):
    enc, truncated = encode(tokenizer, ROW, max_seq_len=len(encode(tokenizer, ROW)[0].input_ids) - 1)
    assert truncated and enc.input_ids[-1] != tokenizer.eos_token_id
    gone, truncated = encode(tokenizer, ROW, max_seq_len=8)
    assert gone is None and truncated


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_alpaca_jsonl_with_mapped_columns_and_bad_rows(tmp_path, tokenizer, caplog):
    rows = [{"q": f"Say {i}", "ctx": "", "a": f"{i}"} for i in range(20)] + [{"q": "no answer", "ctx": ""}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    overrides = ["data=alpaca", f"data.path={path}", "data.instruction_field=q", "data.input_field=ctx"]
    cfg = compose_typed(overrides + ["data.output_field=a", "data.val_size=4"]).data
    examples = all_examples(cfg, tokenizer)  # the usable rows in file order, encoded from the mapped columns
    assert len(examples) == 20
    assert examples[3].input_ids == encode(tokenizer, {"instruction": "Say 3", "input": "", "output": "3"})[0].input_ids
    assert "skipped 1 of 21 row(s)" in caplog.text and "(rows [20])" in caplog.text
    dm = InstructionDataModule(cfg, tokenizer, micro_batch_size=4)
    assert (dm.stats["train"]["kept"], dm.stats["val"]["kept"], dm.stats["bad_rows"]) == (16, 4, 1)
    assert "row 20: missing 'a'" in caplog.text


def test_missing_file_and_missing_column_are_named(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="no such file or directory"):
        all_examples(compose_typed(["data=alpaca", f"data.path={tmp_path / 'nope.json'}"]).data, tokenizer)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "completion": "y"}])
    with pytest.raises(ConfigError) as e:
        all_examples(compose_typed(["data=alpaca", f"data.path={path}"]).data, tokenizer)
    assert (
        "no column 'instruction'" in str(e.value)
        and "prompt" in str(e.value)
        and "data.instruction_field" in str(e.value)
    )


def datamodule(tokenizer, *overrides: str) -> InstructionDataModule:
    return InstructionDataModule(compose_typed(list(overrides)).data, tokenizer, micro_batch_size=4)


ALPACA = [{"instruction": f"Say {i}", "input": "", "output": f"number {i}"} for i in range(30)]


@pytest.mark.parametrize("suffix", ["csv", "parquet", "json"])
def test_csv_parquet_json_and_directories_are_read(tmp_path, tokenizer, suffix):
    import pandas as pd

    d = tmp_path / "dir"
    d.mkdir()
    frame = pd.DataFrame(ALPACA)
    {
        "csv": lambda p: frame.to_csv(p, index=False),
        "parquet": frame.to_parquet,
        "json": lambda p: frame.to_json(p, orient="records"),
    }[suffix](d / f"part.{suffix}")
    dm = datamodule(tokenizer, "data=alpaca", f"data.path={d}", "data.val_size=5")
    assert (dm.stats["train"]["kept"], dm.stats["val"]["kept"]) == (25, 5)


def test_separate_validation_file(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", ALPACA)
    val = write_jsonl(tmp_path / "val.jsonl", ALPACA[:3])
    dm = datamodule(tokenizer, "data=alpaca", f"data.path={train}", f"data.val_path={val}")
    assert (dm.stats["train"]["kept"], dm.stats["val"]["kept"]) == (30, 3)


BAD_INPUTS = {
    # case: (file content or None, extra overrides, what the message must say)
    "missing": (None, [], ["no such file or directory", "data.path="]),
    "unreadable": ("{not json at all", [], ["bad.jsonl: line 1 is not valid JSON", "one JSON object per line"]),
    "empty": ("", [], ["empty"]),
    "unsupported_suffix": ("x", ["SUFFIX=.xlsx"], ["unsupported file type '.xlsx'", "JSONL"]),
    "bad_rows_fail": (
        "\n".join(json.dumps(r) for r in ALPACA[:5] + [{"instruction": "x"}, {"instruction": "y", "output": 3}]),
        ["data.on_bad_rows=fail"],
        ["2 of 7 rows unusable", "row 5: missing 'output'", "row 6: 'output' is int, not a string", "bad.jsonl"],
    ),
    "all_rows_bad": (
        json.dumps({"instruction": "x", "output": ["a"]}),
        [],
        ["1 of 1 rows unusable", "row 0", "no row is usable"],
    ),
    "too_long": (json.dumps(ALPACA[0]), ["data.max_seq_len=1024"], ["data.max_seq_len=1024", "(512", "512 or less"]),
    "no_response_left": (
        "\n".join(json.dumps(r) for r in ALPACA),
        ["data.max_seq_len=8"],
        ["data.max_seq_len=8 leaves no example with a response token", "raise data.max_seq_len"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_every_bad_input_gets_its_message(case, tmp_path, tokenizer):
    content, extra, expected = BAD_INPUTS[case]
    suffix = next((e.split("=")[1] for e in extra if e.startswith("SUFFIX=")), ".jsonl")
    path = tmp_path / f"bad{suffix}"
    if content is not None:
        path.write_text(content)
    overrides = ["data=alpaca", f"data.path={path}", *[e for e in extra if not e.startswith("SUFFIX=")]]
    with pytest.raises(ConfigError) as e:
        datamodule(tokenizer, *overrides)
    for text in expected:
        assert text in str(e.value), (text, str(e.value))


def test_a_template_without_response_tokens_is_an_error(tmp_path, tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    # A broken template that never renders the assistant's content (a classic copy-paste mistake).
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 4,
    )
    with pytest.raises(ConfigError, match="no response token") as e:
        datamodule(tok, "data=chat", f"data.path={path}")
    assert "4 of 4 rows unusable" in str(e.value)


def test_hub_dataset_neither_cached_nor_reachable(monkeypatch, tokenizer):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as e:
        datamodule(tokenizer, "data=guanaco", "data.hub_id=nobody/no-such-dataset-exp")
    assert "data.hub_id=nobody/no-such-dataset-exp" in str(e.value) and "data.path=<file>" in str(e.value)


def test_second_build_reads_the_tokenisation_cache(tmp_path, monkeypatch, tokenizer):
    import exp.data.encoding

    monkeypatch.setenv("EXP_CACHE", str(tmp_path / "cache"))
    calls = []
    real = exp.data.encoding.render_row
    monkeypatch.setattr(exp.data.encoding, "render_row", lambda *a: calls.append(1) or real(*a))
    path = write_jsonl(tmp_path / "d.jsonl", ALPACA)
    first = datamodule(tokenizer, "data=alpaca", f"data.path={path}")
    assert len(calls) == 30
    second = datamodule(tokenizer, "data=alpaca", f"data.path={path}")
    assert len(calls) == 30, "the second build must not re-tokenise"
    assert second.encoded_cache_files == first.encoded_cache_files
    assert [e.input_ids for e in second.train_set] == [e.input_ids for e in first.train_set]
    datamodule(tokenizer, "data=alpaca", f"data.path={path}", "data.max_seq_len=64")  # encoding changed: redo
    assert len(calls) == 60


def test_preview_prints_examples_with_the_mask_and_statistics(capsys):
    from exp.preview import main

    assert main(["n=2", "data.num_examples=50"]) == 0
    out = capsys.readouterr().out
    assert "--- example 1" in out and "--- example 2" not in out
    # The prompt is wrapped in [[ ]] and the answer (what carries loss) follows it, ending with <eos>.
    assert "[[<bos>### Instruction:\nRepeat the words exactly." in out and "### Response:\n]]" in out
    assert "<eos>" in out.split("### Response:\n]]")[1].splitlines()[0]
    for stat in ("examples kept", "truncated", "length (tokens)", "loss-bearing", "padding"):
        assert stat in out
    assert "\033[" not in out  # no colour codes when not writing to a terminal


def test_preview_exits_2_on_bad_input_and_reports_packing(tmp_path, capsys):
    from exp.preview import main

    assert main(["data=alpaca", f"data.path={tmp_path / 'nope.jsonl'}"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["n=1", "data.num_examples=60", "data.packing=true"]) == 0
    out = capsys.readouterr().out
    assert "packed row 0" in out and "% of slots filled" in out


def test_preview_warns_of_a_split_smaller_than_one_batch(capsys):
    from exp.preview import main

    # 40 examples, 10% held out: 36 to train on and 4 to validate on, with 8 examples per optimiser step.
    assert main(["n=1", "data.num_examples=40", "trainer.global_batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "warning: the validation split holds 4 example(s), fewer than one batch (trainer.global_batch_size=8)" in out
    assert "warning: the train split" not in out
    assert main(["n=1", "data.num_examples=400", "trainer.global_batch_size=8"]) == 0
    assert "fewer than one batch" not in capsys.readouterr().out


@pytest.mark.shared_data("alpaca_en_demo.json")
@pytest.mark.slow
def test_real_alpaca_file_trains_from_a_relative_path(tmp_path, monkeypatch):
    """Relative data paths are resolved against the launch directory (here: the parent of the data directory)."""
    from exp.train import run

    monkeypatch.chdir(SHARED_DATA.parent)
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


@pytest.mark.shared_data("alpaca_zh_demo.json")
@pytest.mark.slow
def test_real_chinese_alpaca_file_trains(tmp_path):
    from exp.train import run

    result = run(
        SHORT
        + [
            "data=alpaca",
            f"data.path={SHARED_DATA / 'alpaca_zh_demo.json'}",
            "data.max_seq_len=256",
            "trainer.max_steps=4",
            "trainer.val_every_n_steps=4",
            "trainer.limit_val_batches=4",
        ],
        output_dir=tmp_path / "run",
    )
    summary = json.loads((result.output_dir / "summary.json").read_text())
    assert summary["data"]["train"]["examples"] + summary["data"]["val"]["examples"] == 1000
    assert summary["data"]["bad_rows"] == 0 and summary["data"]["train"]["dropped"] > 0  # long answers cut away
    assert result.final_val["val/loss"] < result.initial_val["val/loss"]
