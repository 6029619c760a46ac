"""The strategy table (exp.core.strategies): one row per concrete strategy, `auto` refused, the rows saying what the
strategies mean, and docs/hardware.md showing the same table."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import ROOT

from exp.core.strategies import STRATEGIES, Strategy, StrategyTraits, strategy_traits

CONCRETE = [s for s in Strategy if s != Strategy.auto]
# Every question a row answers: its fields, and the properties derived from them.
QUESTIONS = [f.name for f in dataclasses.fields(StrategyTraits) if f.name != "strategy"] + ["gathers_to_save"]


def test_every_concrete_strategy_has_exactly_one_row():
    assert list(STRATEGIES) == CONCRETE
    for strategy, row in STRATEGIES.items():
        assert row.strategy == strategy and strategy_traits(strategy) is row


def test_auto_has_no_row_and_is_refused():
    assert Strategy.auto not in STRATEGIES
    with pytest.raises(ValueError, match="auto has no meaning until the preflight resolves it"):
        strategy_traits(Strategy.auto)


def test_the_rows_say_what_the_strategies_mean():
    single, ddp = strategy_traits(Strategy.single_device), strategy_traits(Strategy.ddp)
    fsdp, mp = strategy_traits(Strategy.fsdp), strategy_traits(Strategy.model_parallel)
    assert not single.uses_several_devices and not single.data_parallel and single.whole_weights_on_each_rank
    # DDP: data parallel, a whole replica on each rank, so each rank saves what it holds.
    assert ddp.data_parallel and ddp.whole_weights_on_each_rank and not ddp.sharded and not ddp.gathers_to_save
    assert ddp.spawns_workers and ddp.runs_on_cpu and ddp.weight_shards(4) == 1
    # FSDP: data parallel and sharded: no rank holds the whole weights, so saving gathers them.
    assert fsdp.data_parallel and fsdp.sharded and not fsdp.whole_weights_on_each_rank and fsdp.gathers_to_save
    assert fsdp.weight_shards(4) == 4 and not fsdp.runs_on_cpu
    # Model parallelism: one process spanning the devices, holding every weight but no device holding them all.
    assert mp.spans_devices_in_one_process and not mp.spawns_workers and not mp.data_parallel
    assert mp.whole_weights_on_each_rank and not mp.whole_model_on_each_device
    assert [s for s in CONCRETE if strategy_traits(s).spans_devices_in_one_process] == [Strategy.model_parallel]


def test_docs_show_the_table():
    text = (ROOT / "docs" / "hardware.md").read_text()
    section = text[text.index("## What each strategy means") :]
    section = section[: section.index("\n## ")]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows[0] == "| property | " + " | ".join(s.value for s in CONCRETE) + " |"
    shown = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        name = re.match(r"`(\w+)`", cells[0]).group(1)
        shown[name] = cells[1:]
    assert sorted(shown) == sorted(QUESTIONS)
    for name, cells in shown.items():
        assert cells == ["yes" if getattr(STRATEGIES[s], name) else "no" for s in CONCRETE], name
