"""One job of a group sharing a base (exp.study.group_fit): what it trains and measured, and its checkpoints.

A member's checkpoint has the layout of a single run's (`checkpoints/step-NNNNNN.ckpt`, `last.ckpt`; its adapter's
tensors under the names a run of that job alone gives them, the optimiser and schedule state, `exp`'s resume state,
the content hash), so `trainer.resume=auto` finds it as it finds any run's, and a group continues a job's single-run
checkpoint as well as its own. `checkpoint["exp"]["group"]` marks one a group wrote: it holds no Lightning loop
state, so only a group continues it (a single run refuses it with a message).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exp.core.config import TrainConfig
from exp.data.datamodule import InstructionDataModule
from exp.run.checkpoints import AtomicCheckpointIO, checkpoint_step
from exp.run.dirs import CHECKPOINT_DIR, LAST_CHECKPOINT
from exp.training.lifecycle import RunLifecycle

SINGLE_RUN_ADAPTER = "default"  # PEFT's name for the one adapter of a single run


class SeededDropout(nn.Module):
    """Inverted dropout drawing its masks from a generator of its own (one per job), in place of the adapter's
    `nn.Dropout`, which draws from torch's global generator that every job of the group shares."""

    def __init__(self, p: float, generator: torch.Generator) -> None:
        super().__init__()
        self.p, self.generator = p, generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = torch.empty_like(x).bernoulli_(1 - self.p, generator=self.generator)
        return x * keep / (1 - self.p)


@dataclass
class Member:
    """One job of the group: its config, run directory, adapter, data, optimiser and what it measured."""

    adapter: str  # the adapter's name inside the shared model
    cfg: TrainConfig
    run_dir: Path
    datamodule: InstructionDataModule | None = None
    params: list[nn.Parameter] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    loggers: list = field(default_factory=list)
    lifecycle: RunLifecycle | None = None
    batches: Iterator[dict[str, torch.Tensor]] | None = None
    step: int = 0
    batches_seen: int = 0
    skipped_steps: int = 0
    initial_val: dict[str, float] | None = None
    last_val: dict[str, float] = field(default_factory=dict)
    last_val_step: int | None = None
    validation_times: list[dict[str, Any]] = field(default_factory=list)
    step_tokens_per_s: list[float] = field(default_factory=list)
    step_padding: list[float] = field(default_factory=list)
    tokens_trained: int = 0
    failed: str | None = None
    started: float = 0.0
    resumed_from: dict[str, Any] | None = None  # the continued checkpoint's record (resume.json)
    dropout_rng: torch.Generator | None = None  # this job's LoRA dropout masks (lora.dropout > 0)
    tracking_ids: dict[str, str] = field(default_factory=dict)  # the W&B run this job logs to
    sampler: Any = None  # its greedy samples at validations (exp.training.samples), when its config asks
    # Its run alone weights a step's micro-batches by their loss tokens (padding-free, or length-grouped by step);
    # equally otherwise (Lightning's accumulation).
    token_weighted: bool = False

    @property
    def training(self) -> bool:
        return self.failed is None and self.step < self.cfg.trainer.max_steps

    def state_dict_name(self, name: str) -> str:
        """A parameter's name in a checkpoint: as the LightningModule of a single run names it."""
        return "model." + name.replace(f".{self.adapter}.", f".{SINGLE_RUN_ADAPTER}.")

    def save_checkpoint(self, model: nn.Module, periodic: bool = False) -> Path:
        """`checkpoints/last.ckpt`, and with `periodic` `step-NNNNNN.ckpt` too (the newest `keep_last_checkpoints`
        kept), each written whole or not at all."""
        marker = f".{self.adapter}."
        checkpoint = {
            "state_dict": {
                self.state_dict_name(n): p.detach().cpu().clone()
                for n, p in model.named_parameters()
                if marker in n and "lora_" in n
            },
            "optimizer_states": [self.optimizer.state_dict()],
            "lr_schedulers": [self.scheduler.state_dict()],
            "global_step": self.step,
            "epoch": 0,
            "exp": {
                "batches_seen": self.batches_seen,
                "tokens_trained": self.tokens_trained,
                "skipped_steps": self.skipped_steps,
                "initial_val": self.initial_val,
                "tracking_ids": dict(self.tracking_ids),
                "rng": [],
                "group": {
                    "dropout_rng": self.dropout_rng.get_state() if self.dropout_rng is not None else None,
                    "last_val": self.last_val,
                    "last_val_step": self.last_val_step,
                    "validation_seconds": self.validation_times,
                },
            },
        }
        io = AtomicCheckpointIO()
        folder = self.run_dir / CHECKPOINT_DIR
        if periodic:
            io.save_checkpoint(checkpoint, folder / f"step-{self.step:06d}.ckpt")
            kept = self.cfg.trainer.keep_last_checkpoints
            earlier = sorted(
                (p for p in folder.glob("step-*.ckpt") if checkpoint_step(p) < self.step), key=checkpoint_step
            )
            for old in earlier[: max(0, len(earlier) - (kept - 1))]:
                io.remove_checkpoint(old)
        io.save_checkpoint(checkpoint, folder / LAST_CHECKPOINT)
        io.commit()
        return folder / LAST_CHECKPOINT

    def load_checkpoint(self, model: nn.Module, checkpoint: dict[str, Any]) -> None:
        """Continue from a checkpoint of this job (its own from a group, or a single run's)."""
        params = dict(model.named_parameters())
        marker = f".{self.adapter}."
        names = {self.state_dict_name(n): n for n in params if marker in n and "lora_" in n}
        missing = set(names) - set(checkpoint["state_dict"])
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} of this job's adapter tensors, e.g. {min(missing)}")
        with torch.no_grad():
            for key, name in names.items():
                params[name].copy_(checkpoint["state_dict"][key])
        self.optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        self.scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
        state = checkpoint["exp"]
        self.step = int(checkpoint["global_step"])
        self.batches_seen = int(state["batches_seen"])
        self.tokens_trained = int(state.get("tokens_trained", 0))
        self.skipped_steps = int(state["skipped_steps"])
        self.initial_val = state["initial_val"]
        group = state.get("group") or {}
        self.last_val = group.get("last_val") or {}
        self.last_val_step = group.get("last_val_step")
        self.validation_times = list(group.get("validation_seconds") or [])
        if self.dropout_rng is not None and group.get("dropout_rng") is not None:
            self.dropout_rng.set_state(group["dropout_rng"])
