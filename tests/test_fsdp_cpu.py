"""exp's FSDP path (QLoRAFSDPStrategy) on 2 CPU processes: it trains, its final validation and adapter work, it
matches DDP, and a resume from a checkpoint written at a validation step ends bitwise where the whole run ends; DPO's
reference pass computes under FSDP what it computes under DDP."""

from __future__ import annotations

import csv
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # two processes train

WORKER = Path(__file__).with_name("fsdp_cpu_worker.py")


def two_ranks(*args: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r), NODE_RANK="0"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]


def adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "adapter" / "adapter_model.safetensors")


def test_fsdp_trains_matches_ddp_and_resumes_exactly(tmp_path):
    two_ranks(str(tmp_path / "fsdp"), "fsdp")
    two_ranks(str(tmp_path / "ddp"), "ddp")
    ckpt = tmp_path / "fsdp" / "checkpoints" / "step-000003.ckpt"
    two_ranks(str(tmp_path / "resumed"), "fsdp", str(ckpt))

    fsdp, ddp, resumed = adapter(tmp_path / "fsdp"), adapter(tmp_path / "ddp"), adapter(tmp_path / "resumed")
    assert len(fsdp) == 16 and fsdp.keys() == ddp.keys() == resumed.keys()  # PEFT's names, no FSDP wrapper names
    assert any(v.abs().max() > 0 for k, v in fsdp.items() if "lora_B" in k)  # trained
    assert all(torch.equal(fsdp[k], ddp[k]) for k in fsdp)  # FSDP computes what DDP computes
    assert all(torch.equal(fsdp[k], resumed[k]) for k in fsdp)  # and resumes exactly
    saved = torch.load(ckpt, weights_only=True)
    assert len(saved["state_dict"]) == 16 and all("lora_" in k for k in saved["state_dict"])  # adapters only
    assert len(saved["optimizer_states"][0]["per_rank"]) == 2 and len(saved["exp"]["rng"]) == 2


def test_dpo_under_fsdp_starts_at_ln2_and_computes_what_ddp_computes(tmp_path):
    """The reference pass zeroes every adapter's A in place and copies it back (exp.model.reference): under FSDP the
    adapters are views of each rank's shard, which the forward gathers. Both strategies start DPO at exactly ln 2
    and take the same steps (the second step scores the trained adapters against the restored reference)."""
    dpo = ["--", "objective=dpo", "lora.dropout=0", "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=2"]
    two_ranks(str(tmp_path / "fsdp"), "fsdp", *dpo)
    two_ranks(str(tmp_path / "ddp"), "ddp", *dpo)
    losses = {}
    for name in ("fsdp", "ddp"):
        with (tmp_path / name / "csv" / "metrics.csv").open() as f:
            losses[name] = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    ln2 = torch.tensor(math.log(2.0)).item()  # in float32, as the loss is computed
    assert len(losses["fsdp"]) == 2 and losses["fsdp"][0] == ln2 == losses["ddp"][0]
    assert losses["fsdp"][1] != losses["fsdp"][0] and losses["fsdp"] == losses["ddp"]
    fsdp, ddp = adapter(tmp_path / "fsdp"), adapter(tmp_path / "ddp")
    assert any(v.abs().max() > 0 for k, v in fsdp.items() if "lora_B" in k)  # trained
    assert all(torch.equal(fsdp[k], ddp[k]) for k in fsdp)
