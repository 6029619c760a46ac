"""data.streaming: the same examples as reading the file up front (in the file's order with the shuffle off), a
seeded shuffle, a position that restores exactly (across epochs too), a killed run that resumes exactly, and the
settings a stream cannot take refused."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import pytest
from conftest import compose_typed

from exp.core.config import ConfigError
from exp.data.splits import all_examples
from exp.data.streaming import ExampleStream, RowStream, StreamingDataModule, plain_note


def write_rows(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            f.write(
                json.dumps({"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a + b} (row {i})"}) + "\n"
            )
    # One bad row, skipped by both readings.
    with open(path, "a") as f:
        f.write(json.dumps({"instruction": "no output"}) + "\n")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    return write_rows(root / "train.jsonl", 60, 0), write_rows(root / "val.jsonl", 6, 1)


@pytest.fixture(scope="module")
def tokenizer():
    from exp.model.build import build_tokenizer

    return build_tokenizer(compose_typed([]).model)


def cfg_for(train: Path, *extra: str):
    return compose_typed(["data=alpaca", f"data.path={train}", "data.streaming=true", *extra]).data


def ids(examples) -> list[tuple]:
    return [(tuple(e.input_ids), tuple(e.labels)) for e in examples]


def test_the_stream_holds_the_examples_of_the_up_front_reading(files, tokenizer):
    train, val = files
    whole = all_examples(compose_typed(["data=alpaca", f"data.path={train}"]).data, tokenizer)
    assert len(whole) == 60
    in_order = StreamingDataModule(cfg_for(train, f"data.val_path={val}", "data.shuffle_buffer=0"), tokenizer, 4)
    assert ids(in_order.train_examples(60)) == ids(whole)  # shuffle off: the file's order
    assert ids(in_order.train_examples(61))[60] == ids(whole)[0]  # then the next epoch from the top
    shuffled = StreamingDataModule(cfg_for(train, f"data.val_path={val}", "data.shuffle_buffer=16"), tokenizer, 4)
    epoch = ids(shuffled.train_examples(60))
    assert sorted(epoch) == sorted(ids(whole)) and epoch != ids(whole)
    assert ids(shuffled.train_examples(60)) == epoch  # seeded
    other = StreamingDataModule(cfg_for(train, f"data.val_path={val}", "data.seed=1"), tokenizer, 4)
    assert ids(other.train_examples(60)) != epoch


def test_the_held_out_head_is_the_first_rows_and_never_trained_on(files, tokenizer):
    train, _ = files
    dm = StreamingDataModule(cfg_for(train, "data.val_size=5", "data.shuffle_buffer=0"), tokenizer, 4)
    whole = ids(all_examples(compose_typed(["data=alpaca", f"data.path={train}"]).data, tokenizer))
    assert ids(dm.val_set) == whole[:5]
    assert ids(dm.train_examples(55)) == whole[5:]


def test_a_noted_position_restores_exactly_across_epochs(files, tokenizer):
    train, val = files
    cfg = cfg_for(train, f"data.val_path={val}", "data.shuffle_buffer=8")
    rows = RowStream([train], 0, 8, cfg.seed)
    stream = ExampleStream(cfg, tokenizer, rows, "t")
    for _ in range(50):
        stream.next_example()
    note = json.loads(json.dumps(plain_note(rows.note())))  # plain types, as a checkpoint stores them
    after = [stream.next_example() for _ in range(40)]  # into the second epoch
    assert rows.epoch == 1
    again = ExampleStream(cfg, tokenizer, RowStream([train], 0, 8, cfg.seed, note), "t")
    assert ids([again.next_example() for _ in range(40)]) == ids(after)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["data.val_size=0.1"], r"data.val_size=0.1 with data.streaming=true.*a count"),
        (["data.val_size=5", "data.packing=true"], "data.packing=true with data.streaming=true"),
        (["data.val_size=5", "data.shuffle_buffer=-1"], "data.shuffle_buffer=-1"),
    ],
)
def test_what_a_stream_cannot_do_is_refused(files, extra, message):
    with pytest.raises(ConfigError, match=message):
        cfg_for(files[0], *extra)
    with pytest.raises(ConfigError, match="reads one local file or directory"):
        compose_typed(["data=alpaca", "data.hub_id=x/y", "data.streaming=true", "data.val_size=5"])


RUN = [
    "data=alpaca",
    "data.streaming=true",
    "data.shuffle_buffer=16",
    "data.val_size=5",
    "trainer.max_steps=24",
    "trainer.warmup_steps=2",
    "trainer.val_every_n_steps=12",
    "trainer.checkpoint_every_n_steps=6",
    "trainer.log_every_n_steps=1",
    "trainer.sample_count=0",
    "trainer.global_batch_size=8",
    "hardware.micro_batch_size=4",  # two micro-batches a step, 54 examples an epoch: the run reads 3.5 epochs
    "logger=csv",
]


@pytest.mark.slow
def test_a_killed_streaming_run_resumes_at_the_exact_position(files, tmp_path):
    """SIGKILL after step 12 (mid-epoch, the shuffle buffer full), `trainer.resume=auto`: every step's loss equals
    the uninterrupted run's bitwise."""
    from test_resume import cli, losses, whole_and_killed

    run = [*RUN, f"data.path={files[0]}"]
    whole, killed = whole_and_killed(tmp_path, "step-000012.ckpt", *run)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert killed.returncode == -signal.SIGKILL
    resumed = cli(tmp_path, *run, "trainer.resume=auto", "hydra.run.dir=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = losses(tmp_path / "whole"), losses(tmp_path / "killed", tmp_path / "resumed")
    assert sorted(ref) == list(range(1, 25)) and got == ref
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["data"]["streaming"] is True and summary["epochs"] is None
