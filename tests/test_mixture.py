"""Data mixtures: each source's share of an epoch follows its weight (without replacement within a pass, the same
for the same seed), each source is split on its own, the shares reach the preview and summary.json, bad mixtures are
refused with their key, and a killed run resumes the mixed order exactly."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import compose_typed

from exp.core.config import ConfigError
from exp.data.mixture import draw, epoch_counts

WORDS = "red blue green fox owl bee cat dog sun moon star tree".split()


def write_sources(root: Path) -> tuple[Path, Path]:
    """An Alpaca-like file with its own column names (question / answer) and a chat file."""
    rng = random.Random(0)
    qa, chat = root / "qa.jsonl", root / "chat.jsonl"
    with open(qa, "w") as f:
        for _ in range(60):
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    with open(chat, "w") as f:
        for _ in range(30):
            w = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
            messages = [{"role": "user", "content": f"Repeat: {w}"}, {"role": "assistant", "content": w}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return qa, chat


def mixture(qa: Path, chat: Path, qa_weight: float = 1, chat_weight: float = 3) -> str:
    return (
        f"data.mixture=[{{path: {qa}, format: alpaca, fields: {{instruction: question, output: answer}}, "
        f"weight: {qa_weight}}}, {{path: {chat}, format: chat, weight: {chat_weight}, val_size: 3}}]"
    )


def test_epoch_counts_follow_the_weights_and_fill_the_epoch():
    assert epoch_counts([54, 27], [1, 3]) == [20, 61]  # 81 x 1/4 = 20.25, 81 x 3/4 = 60.75
    assert epoch_counts([10, 10, 10], [1, 1, 1]) == [10, 10, 10]
    assert epoch_counts([10, 5], [1, 0]) == [15, 0]  # weight 0: held out only


def test_draw_is_without_replacement_within_a_pass_and_seeded():
    up = draw(7, 17, seed=0, name="a")  # two whole passes and 3 of a third
    counts = Counter(up)
    assert sorted(counts) == list(range(7)) and all(c in (2, 3) for c in counts.values())
    assert sum(c == 3 for c in counts.values()) == 3
    down = draw(20, 5, seed=0, name="a")
    assert len(set(down)) == 5
    assert draw(20, 5, seed=0, name="a") == down != draw(20, 5, seed=1, name="a")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("mixture"))


@pytest.fixture(scope="module")
def tokenizer():
    from exp.model.build import build_tokenizer

    return build_tokenizer(compose_typed([]).model)


def test_each_source_is_split_on_its_own_and_mixed_by_weight(sources, tokenizer):
    from exp.data.datamodule import build_datamodule
    from exp.preview import report

    cfg = compose_typed([mixture(*sources)]).data
    dm = build_datamodule(cfg, tokenizer, micro_batch_size=4)
    qa, chat = dm.stats["mixture"]
    assert (qa["name"], qa["train_rows"], qa["val_examples"]) == ("qa", 54, 6)  # val_size 0.1 of 60
    assert (chat["name"], chat["train_rows"], chat["val_examples"]) == ("chat", 27, 3)  # val_size 3
    assert (qa["epoch_examples"], chat["epoch_examples"]) == (20, 61) and len(dm.train_set) == 81
    assert len(dm.val_set) == 9
    # The loss-token shares are those of the mixed examples: chat's answers are several words, qa's a number.
    assert qa["loss_tokens"] + chat["loss_tokens"] == dm.stats["train"]["loss_tokens"]
    assert chat["loss_token_share"] > chat["example_share"]
    # The same seed gives the same split and the same draw; another seed another.
    again = build_datamodule(cfg, tokenizer, micro_batch_size=4)
    assert [e.input_ids for e in again.train_set] == [e.input_ids for e in dm.train_set]
    assert [e.input_ids for e in again.val_set] == [e.input_ids for e in dm.val_set]
    other = build_datamodule(compose_typed([mixture(*sources), "data.seed=1"]).data, tokenizer, micro_batch_size=4)
    assert [e.input_ids for e in other.val_set] != [e.input_ids for e in dm.val_set]
    text = report(dm, 1)
    assert "    qa              20 (24.7%; 25.0%) from 54 training rows" in text
    assert "    chat            61 (75.3%; 75.0%) from 27 training rows" in text


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.mixture=[{path: a.jsonl, weight: -1}]", r"data.mixture\[0\].weight=-1.0: a weight is a share"),
        ("data.mixture=[{path: a.jsonl, weight: 0}, {path: b.jsonl, weight: 0}]", r"weights \[0.0, 0.0\] sum to 0"),
        ("data.mixture=[{path: a.jsonl, fields: {question: q}}]", r"data.mixture\[0\].fields has \['question'\]"),
        ("data.mixture=[{format: chat}]", r"data.mixture\[0\] \(format=chat\): give exactly one of path"),
        ("data.mixture=[{path: a.jsonl, format: kto}]", r"data.mixture\[0\].format=kto: a mixture mixes SFT"),
        ("data.mixture=[{path: x/a.jsonl}, {path: y/a.jsonl}]", r"two share a name"),
    ],
)
def test_bad_mixtures_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        compose_typed([override])


def test_an_unknown_source_format_exits_non_zero_naming_the_choices(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", "data.mixture=[{path: a.jsonl, format: nope}]"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "Invalid value 'nope', expected one of [synthetic, alpaca" in proc.stderr
    assert not (tmp_path / "outputs").exists()


RUN = [
    "trainer.max_steps=12",
    "trainer.warmup_steps=2",
    "trainer.val_every_n_steps=6",
    "trainer.checkpoint_every_n_steps=4",
    "trainer.log_every_n_steps=1",
    "trainer.sample_count=0",
    "trainer.global_batch_size=8",
    "hardware.micro_batch_size=4",  # two micro-batches a step; 10 steps an epoch: the run crosses into epoch 2
    "logger=csv",
]


@pytest.mark.slow
def test_a_killed_mixture_run_resumes_the_exact_order(sources, tmp_path):
    """SIGKILL after step 4, `trainer.resume=auto`: every step's loss equals the uninterrupted run's bitwise (the
    mixed examples and their per-epoch order are a function of data.seed), and summary.json has the shares."""
    from test_resume import cli, losses, whole_and_killed

    mix = mixture(*sources)
    whole, killed = whole_and_killed(tmp_path, "step-000004.ckpt", *RUN, mix)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert killed.returncode == -signal.SIGKILL
    resumed = cli(tmp_path, *RUN, mix, "trainer.resume=auto", "hydra.run.dir=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = losses(tmp_path / "whole"), losses(tmp_path / "killed", tmp_path / "resumed")
    assert sorted(ref) == list(range(1, 13)) and got == ref
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    shares = {m["name"]: m["example_share"] for m in summary["data"]["mixture"]}
    assert shares == {"qa": 0.2469, "chat": 0.7531}
