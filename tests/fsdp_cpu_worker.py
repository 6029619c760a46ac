"""One rank of a Lightning FSDP run on the CPU (gloo), for tests/test_fsdp_cpu.py.

Lightning and torch refuse FSDP without a GPU; two patches lift that (and nothing else), so exp's FSDP code (its
strategy, adapter gathering, checkpoints, resume) runs here exactly as on GPUs, on the real 4-bit CPU path.
Usage (with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set):
    python fsdp_cpu_worker.py <run dir> <ddp|fsdp> [ckpt] [-- override ...]
"""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from exp.core.strategies import Strategy
from exp.run.checkpoints import read_checkpoint
from exp.run.compose import compose_config
from exp.training.launch import end_rank
from exp.training.pipeline import train

_AcceleratorConnector._check_strategy_and_fallback = lambda self: None  # "fsdp requires a GPU accelerator"
_fsdp_init = FSDP.__init__


def _fsdp_on_cpu(self, *args, device_id=None, **kwargs):
    _fsdp_init(self, *args, device_id=device_id if device_id is not None else torch.device("cpu"), **kwargs)


FSDP.__init__ = _fsdp_on_cpu

OVERRIDES = [
    "hardware=ddp",
    "hardware.accelerator=cpu",
    "hardware.devices=2",
    "hardware.micro_batch_size=4",
    "trainer.global_batch_size=8",
    "trainer.max_steps=6",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=3",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.log_every_n_steps=1",
    "trainer.sample_count=0",
    "data.num_examples=200",
    "logger=csv",
]

if __name__ == "__main__":
    args, extra = (
        (sys.argv[1 : sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1 :])
        if "--" in sys.argv
        else (sys.argv[1:], [])
    )
    out, strategy = Path(args[0]), args[1]
    cfg = compose_config([*OVERRIDES, *extra])
    cfg.hardware.strategy = Strategy(strategy)  # set after the config checks, which refuse FSDP on the CPU
    cfg.hardware.precision = "32-true"
    out.mkdir(parents=True, exist_ok=True)
    if len(args) > 2:  # what exp.train's resume step would record
        ids = read_checkpoint(Path(args[2]))["exp"]["tracking_ids"]
        record = {"checkpoint": args[2], "run": "", "step": 3, "tracking_ids": ids}
        (out / "resume.json").write_text(json.dumps(record))
    end_rank(lambda: train(cfg, out, manage_run_dir=False))  # as exp's own workers end (see end_rank)
