"""What each `hardware.strategy` means: one row per concrete strategy, its properties named for the questions the
code asks of it (does each process see its own data? does any rank hold the whole weights? ...).

Code that depends on the strategy asks these properties instead of comparing with strategy names, so adding a
strategy is a member of `Strategy`, its row here, and its Lightning builder (`exp.training.trainer.build_strategy`).
`auto` has no row: the preflight (`exp.hardware.preflight.check`) resolves it to one of the others before anything
asks. docs/hardware.md ("What each strategy means") shows the table; tests/test_strategies.py keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Strategy(str, Enum):
    single_device = "single_device"  # one process, one device
    ddp = "ddp"  # one process and one full (4-bit) replica per device, gradients all-reduced
    fsdp = "fsdp"  # one process per device, weights sharded (4-bit storage in the compute dtype so it can shard)
    model_parallel = "model_parallel"  # one process, layers spread over all its devices (model larger than one GPU)
    auto = "auto"  # resolved by the preflight: the best of the above for the machine and the model


@dataclass(frozen=True)
class StrategyTraits:
    """One strategy's meaning. Each field answers one question; the comment says what depends on the answer."""

    strategy: Strategy
    # hardware.devices may exceed 1 (-1 means every visible device); otherwise one process uses one device.
    uses_several_devices: bool
    # Each process trains on its own slice of every batch, so the data-parallel size is devices x nodes and the
    # global batch is divided among them.
    data_parallel: bool
    # The weights are split across the ranks: each holds a shard and gathers a layer only for its use. FSDP's flat
    # parameters need float storage (4-bit weights stored in the compute dtype, adapters cast to it; int8 cannot
    # shard), gradient norms are taken over all shards, and each device holds 1/devices of the weights.
    sharded: bool
    # Every rank can read every weight at any time: sampling, the fused loss reading the head's weight, a kept
    # dequantized copy of a layer, and comparing the replicas' adapters all need it.
    whole_weights_on_each_rank: bool
    # Each device holds the whole model, so one device's memory budget is the whole model's (the preflight's choice
    # of kept dequantized layers assumes it).
    whole_model_on_each_device: bool
    # One process places the layers over every visible GPU of its machine: Lightning drives one device, and the
    # memory budget is the sum over the GPUs.
    spans_devices_in_one_process: bool
    # With more than one device in all, exp's launch starts one `python -m exp.training.worker` process per device
    # (unless torchrun / SLURM started the processes).
    spawns_workers: bool
    # Runs on the CPU (gloo); the others need GPUs.
    runs_on_cpu: bool

    @property
    def gathers_to_save(self) -> bool:
        """No rank holds the whole adapter, so every rank takes part in gathering it before rank 0 saves it."""
        return not self.whole_weights_on_each_rank

    def weight_shards(self, devices: int) -> int:
        """Into how many parts the weights are split: the memory estimate's `num_shards` for one device."""
        return devices if self.sharded else 1


# One row per concrete strategy; the columns are StrategyTraits' fields, in order.
_ROWS = (
    #                                       several  data     sharded  whole    whole    spans    spawns   runs
    #                                       devices  parallel          weights  model    devices  workers  on cpu
    StrategyTraits(Strategy.single_device,  False,   False,   False,   True,    True,    False,   False,   True),
    StrategyTraits(Strategy.ddp,            True,    True,    False,   True,    True,    False,   True,    True),
    StrategyTraits(Strategy.fsdp,           True,    True,    True,    False,   False,   False,   True,    False),
    StrategyTraits(Strategy.model_parallel, True,    False,   False,   True,    False,   True,    False,   False),
)  # fmt: skip

STRATEGIES: dict[Strategy, StrategyTraits] = {row.strategy: row for row in _ROWS}


def strategy_traits(strategy: Strategy) -> StrategyTraits:
    """The row of a concrete strategy. `auto` is refused: what it means depends on the machine, and only the
    preflight decides that."""
    if strategy == Strategy.auto:
        raise ValueError(
            "hardware.strategy=auto has no meaning until the preflight resolves it for this machine: ask of the "
            "config that exp.hardware.preflight.check returns"
        )
    return STRATEGIES[strategy]
