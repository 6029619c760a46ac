"""One way to build each data split (`exp.data.splits.build_splits`): training validates on it, and `exp.merge`
and `exp.evaluate` score the same held-out examples in the same order, on a run of every data format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import compose_typed

from exp.core.constants import IGNORE_INDEX
from exp.data.batching import collate
from exp.data.datamodule import InstructionDataModule
from exp.model.build import build_tokenizer

WORDS = ["red", "fox", "owl", "bee", "leaf", "blue"]


def row(case: str, i: int) -> dict:
    """Row i of a small file of `case`'s format: short, varied, every row usable."""
    a, b = WORDS[i % 6], WORDS[(i * 5 + 1) % 6]
    return {
        "alpaca": {"q": "Repeat", "ctx": f"{a} {b}", "a": f"{b} {a}"},  # columns mapped in CASES
        "prompt_completion": {"prompt": f"Repeat: {a} {b}\n", "completion": f"{a} {b}"},
        "chat": {"messages": [{"role": "user", "content": f"{a} {b}"}, {"role": "assistant", "content": a}]},
        "sharegpt": {"conversations": [{"from": "human", "value": f"{a} {b}"}, {"from": "gpt", "value": b}]},
        "text": {"text": f"The {a} met the {b}. " * (1 + i % 3)},
        "guanaco": {"text": f"### Human: {a} {b} ### Assistant: {b} {a}"},
    }[case]


# Every data format (conf/data/*.yaml). Two carry the variants whose examples come about differently: alpaca maps
# its columns and trains on the prompt too (labels differ from merge's response-only ones); prompt_completion holds
# out a separate validation file (data.val_path) instead of carving data.val_size.
CASES: dict[str, list[str]] = {
    "synthetic": ["data=synthetic", "data.num_examples=24"],
    "alpaca": [
        "data=alpaca",
        "data.instruction_field=q",
        "data.input_field=ctx",
        "data.output_field=a",
        "data.train_on_prompt=true",
    ],
    "prompt_completion": ["data=prompt_completion"],
    "chat": ["data=chat"],
    "sharegpt": ["data=sharegpt"],
    "text": ["data=text"],
    "guanaco": ["data=guanaco"],
}
# Small and quick: 20 training / 4 held-out examples (24 / 5 with a validation file) of at most 64 tokens, one
# optimiser step of 4; validation before the step and after it (val_every_n_steps beyond the run: no third).
COMMON = ["data.max_seq_len=64", "data.val_size=4", "data.packing=false", "hardware.micro_batch_size=4"]
TRAIN = [
    "trainer.max_steps=1",
    "trainer.warmup_steps=0",
    "trainer.global_batch_size=4",
    "trainer.val_every_n_steps=2",
    "trainer.sample_count=0",
    "logger=csv",
]


def write_rows(path: Path, case: str, rows: range) -> Path:
    path.write_text("".join(json.dumps(row(case, i)) + "\n" for i in rows))
    return path


def data_overrides(case: str, root: Path) -> list[str]:
    """The overrides of `case`, its data files written under `root`."""
    if case == "synthetic":
        return CASES[case] + COMMON
    overrides = [*CASES[case], f"data.path={write_rows(root / f'{case}.jsonl', case, range(24))}", *COMMON]
    if case == "prompt_completion":
        overrides.append(f"data.val_path={write_rows(root / f'{case}_val.jsonl', case, range(24, 29))}")
    return overrides


def ids(examples) -> list[list[int]]:
    return [e.input_ids for e in examples]


def recorded(result):
    """The run's config as exp.merge and exp.evaluate read it (config.yaml), and the tokenizer saved with it."""
    from transformers import AutoTokenizer

    from exp.run.compose import load_run_config

    return load_run_config(result.output_dir), AutoTokenizer.from_pretrained(str(result.adapter_dir))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(compose_typed([]).model)


@pytest.mark.parametrize("case", list(CASES))
def test_merge_and_evaluate_take_the_split_the_datamodule_trains_on(case, tmp_path, tokenizer):
    from exp.evaluate import eval_examples
    from exp.merge import heldout_batches

    cfg = compose_typed(data_overrides(case, tmp_path))
    dm = InstructionDataModule(cfg.data, tokenizer, micro_batch_size=4)
    assert len(dm.val_set) == (5 if case == "prompt_completion" else 4)
    evaluated = eval_examples(cfg.data, tokenizer, whole=False)
    assert ids(evaluated) == ids(dm.val_set) and [e.labels for e in evaluated] == [e.labels for e in dm.val_set]
    # merge: the same examples in the same order, batched, with labels on the response only (its parity is about
    # answers), whether or not the run trained on the prompt.
    batches = heldout_batches(cfg, tokenizer, n=16, batch_size=2)
    expected = [collate(dm.val_set[i : i + 2], tokenizer.pad_token_id) for i in range(0, len(dm.val_set), 2)]
    assert [b["input_ids"].tolist() for b in batches] == [b["input_ids"].tolist() for b in expected]
    for got, trained in zip(batches, expected, strict=True):
        response = got["labels"] != IGNORE_INDEX
        assert response.any() and (got["labels"][response] == trained["labels"][response]).all()
        assert cfg.data.train_on_prompt or got["labels"].tolist() == trained["labels"].tolist()
        assert not cfg.data.train_on_prompt or response.sum() < (trained["labels"] != IGNORE_INDEX).sum()


@pytest.mark.parametrize("case", list(CASES))
def test_evaluate_reads_a_whole_file_in_the_runs_format(case, tmp_path, tokenizer):
    """`exp.evaluate data=<file>`: every row, rendered as the run's format renders it (the generated default's
    rows are Alpaca rows, so a file for such a run is an Alpaca file)."""
    from exp.evaluate import eval_data_config, eval_examples

    run = compose_typed(data_overrides(case, tmp_path)).data
    path = tmp_path / "eval.jsonl"
    fmt = "alpaca" if case == "synthetic" else case
    if case == "synthetic":
        path.write_text("".join(json.dumps({"instruction": "Repeat", "input": w, "output": w}) + "\n" for w in WORDS))
    else:
        write_rows(path, case, range(len(WORDS)))
    cfg = eval_data_config(run, str(path), {})
    assert (cfg.format.value, cfg.path, cfg.val_path) == (fmt, str(path), None)
    examples = eval_examples(cfg, tokenizer, whole=True)
    assert len(examples) == len(WORDS) and all(e.input_ids[0] == tokenizer.bos_token_id for e in examples)


@pytest.fixture(scope="module", params=list(CASES))
def trained(request, tmp_path_factory):
    """A one-step run of each case, with the held-out examples its training validated on."""
    from exp.train import run

    root = tmp_path_factory.mktemp(request.param)
    result = run([*data_overrides(request.param, root), *TRAIN], output_dir=root / "run")
    return result, result.module.trainer.datamodule.val_set


@pytest.mark.slow
def test_evaluate_scores_the_held_out_split_training_validated_on(trained):
    from exp.evaluate import eval_examples, evaluate

    result, val_set = trained
    cfg, tokenizer = recorded(result)
    assert ids(eval_examples(cfg.data, tokenizer, whole=False)) == ids(val_set)
    report = evaluate([f"run={result.output_dir}"])
    assert report["examples"] == len(val_set)
    assert report["loss"] == pytest.approx(result.final_val["val/loss"], abs=1e-5)


@pytest.mark.slow
def test_merge_checks_parity_on_the_held_out_split(trained, tmp_path):
    from exp.merge import heldout_batches, merge

    result, val_set = trained
    cfg, tokenizer = recorded(result)
    (batch,) = heldout_batches(cfg, tokenizer, n=16, batch_size=len(val_set))
    assert batch["input_ids"].tolist() == collate(val_set, tokenizer.pad_token_id)["input_ids"].tolist()
    report = merge([f"run={result.output_dir}", f"out={tmp_path / 'merged'}"])
    assert report["ok"] and report["examples"] == len(val_set) and report["response_tokens"] > 0
    assert (tmp_path / "merged" / "parity.json").is_file()
