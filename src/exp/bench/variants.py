"""What the two sides share and how a variant is named: the settings both train with, the exp config they make,
and the variants (`baseline [lever=...]`, `exp [override ...]`) with the ablation set."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from exp.bench.baseline_loop import ALL_PROJECTIONS, BaselineOptions
from exp.core.config import TrainConfig
from exp.run.compose import compose_config

# The repository: exp configs are composed from here (relative paths in them resolve against it), results go
# under its benchmarks/results.
ROOT = Path(__file__).resolve().parents[3]
# Settings the bench owns for both sides (its own keys): an override of them would change only the exp side.
# Exceptions (EXP_CHOOSES) are how exp computes, not what: the attention kernel gives the same scores.
EXP_CHOOSES = ("model.attn_implementation",)
# LoRA variants (docs/lora.md) exist on the exp side only: their rows compare with plain LoRA, the `exp` row of the same
# invocation. The rank, alpha, dropout, targets and init seed stay the bench's (`lora=<option>` picks an option file,
# whose r / dropout / targets the bench's own lora.* overrides then replace).
EXP_LORA_VARIANTS = (
    "lora",
    *(f"lora.{k}" for k in ("use_dora", "use_rslora", "init", "pissa_niter", "rank_pattern", "alpha_pattern")),
    "lora.plus_lr_ratio",
)
BENCH_OWNED = (
    "model",
    "lora",
    "quantization",
    "trainer.global_batch_size",
    "trainer.max_steps",
    "trainer.learning_rate",
    "trainer.weight_decay",
    "trainer.max_grad_norm",
    "trainer.optimizer",
    "trainer.adam_beta1",
    "trainer.adam_beta2",
    "trainer.lr_schedule",
    "trainer.warmup_steps",
    "data.max_seq_len",
    "data.path",
    "data.format",
    "data.seed",
    "data.val_size",
    "objective",
)
ABLATION = [
    "baseline",
    "exp",
    "exp hardware.loss_impl=hf",  # transformers' loss over the full logits
    "exp hardware.fused_adamw=false",
    "exp hardware.gradient_checkpointing=false",
    "exp hardware.compile=true",  # off by default until measured
    "baseline prepare=false",  # exp never upcasts the embedding / head: this is that lever on the baseline
]


@dataclass
class Settings:
    """What both sides share."""

    model: str = "gemma_7b"
    seq: int = 2048
    micro_batch: int = 8
    steps: int = 30  # optimiser steps per variant, each one's loss recorded
    warmup: int = 3  # the first steps, not timed; peak memory is reset after them
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: list(ALL_PROJECTIONS))
    lr: float = 1e-4
    seed: int = 0  # token batches (seed + step) and LoRA initialisation
    device: str = "cuda"
    # GiB: exp's hardware.memory_budget_gib (what its preflight may plan checkpointing for); None: the free memory.
    memory_budget: float | None = None
    # Real-data mode: an Alpaca-format file. Both sides train on its examples (exp's tokenisation and split), a step
    # is `micro_batch` examples, `seq` is data.max_seq_len; the baseline pads each step's examples to the longest,
    # exp batches them with its own defaults. The validation split is evaluated after the last step.
    data_path: str | None = None
    # exp rows: profile the first two timed steps (torch.profiler) and keep where the device time went.
    profile: bool = False
    # Real-data mode: the first step of the seeded order this invocation trains (from fresh adapters). A long run's
    # wall-clock can so be measured in parts, each within one command's time: a step's work depends on its
    # examples, not on the adapters' values.
    first_step: int = 0
    # sft (next-token loss), or a preference objective (dpo, orpo): data_path then holds {prompt, chosen, rejected}
    # rows (exp.bench.pairs), a step is `micro_batch` pairs and both sides train on the same pairs step by step.
    objective: str = "sft"

    def exp_overrides(self) -> list[str]:
        """The settings as exp config overrides, with the baseline's optimiser (torch AdamW defaults, no clipping)."""
        if self.objective != "sft":
            # exp's preference data on the pairs file; one micro-batch of the step's pairs unless exp's preflight
            # splits it to fit (hardware.auto_micro_batch), then with the step's pairs sorted by length first (the
            # same pairs per step: the per-step losses still compare).
            batching = [f"objective={self.objective}", "data.format=preference", f"data.path={self.data_path}",
                        f"hardware.micro_batch_size={self.micro_batch}", "data.group_by_length=true"]  # fmt: skip
        elif self.data_path:
            # exp's own batching of real data (hardware=gpu's micro-batch, accumulated to the step's examples).
            batching = ["data=alpaca", f"data.path={self.data_path}"]
        else:
            # One micro-batch per step, as the baseline, unless exp's preflight splits the step to fit its memory
            # (hardware.auto_micro_batch, on with hardware=gpu).
            batching = [f"hardware.micro_batch_size={self.micro_batch}"]
        budget = [f"hardware.memory_budget_gib={self.memory_budget}"] if self.memory_budget else []
        return [
            f"model={self.model}",
            "model.random_init=true",
            f"hardware={'gpu' if self.device == 'cuda' else 'cpu'}",
            *batching,
            *budget,
            "trainer=default",
            f"trainer.global_batch_size={self.micro_batch}",
            f"trainer.max_steps={self.steps}",
            f"trainer.learning_rate={self.lr}",
            "trainer.lr_schedule=constant",
            "trainer.warmup_steps=0",
            "trainer.weight_decay=0.01",  # torch.optim.AdamW's default, which the baseline keeps
            "trainer.max_grad_norm=0",  # the baseline does not clip
            f"trainer.seed={self.seed}",
            # No validation, checkpoint or sample inside the measured steps.
            "trainer.val_every_n_steps=1000000",
            "trainer.checkpoint_every_n_steps=1000000",
            "trainer.sample_count=0",
            f"lora.r={self.lora_r}",
            f"lora.alpha={self.lora_alpha}",
            f"lora.dropout={self.lora_dropout}",
            f"lora.target_modules=[{','.join(self.lora_targets)}]",
            f"lora.init_seed={self.seed}",
            f"data.max_seq_len={self.seq}",
            "logger=csv",
        ]

    def exp_config(self, options: list[str] | tuple[str, ...] = ()) -> TrainConfig:
        """The exp config of these settings, with an exp variant's `options` (hydra overrides) on top."""
        return compose_config([*self.exp_overrides(), *options], ROOT)


@dataclass
class BenchModel:
    """The model both sides load, resolved in each worker (exp.bench.worker.resolve_model)."""

    path: str  # its checkpoint directory (random weights, built into exp's cache by the first variant)
    vocab: int
    build_s: float  # seconds composing the config and resolving (or building) the checkpoint took


def check_overrides(overrides: list[str]) -> None:
    """Refuse exp overrides of what the bench sets for both sides (they would change one side only)."""
    for option in overrides:
        key = option.lstrip("+~").partition("=")[0]
        variant = key in EXP_LORA_VARIANTS or key.startswith(("lora.rank_pattern.", "lora.alpha_pattern."))
        if key not in EXP_CHOOSES and not variant and any(key == o or key.startswith(o + ".") for o in BENCH_OWNED):
            raise ValueError(
                f"{option!r}: {key} is set by exp.bench for both sides (use its keys: model=, seq=, micro_batch=, "
                "steps=, lora_*=, lr=); as an exp override it would change one side only. (The LoRA variants, "
                "lora=<option> and lora.use_dora / use_rslora / init / pissa_niter / rank_pattern / alpha_pattern / "
                "plus_lr_ratio, are exp rows to compare with the plain `exp` row.)"
            )


@dataclass
class Variant:
    """One side with its options: `baseline [prepare=false ...]` or `exp [hydra overrides ...]`."""

    name: str
    side: str
    options: list[str]

    @classmethod
    def parse(cls, text: str) -> Variant:
        side, *options = shlex.split(text)
        if side not in ("baseline", "exp"):
            raise ValueError(f"variant {text!r}: must start with 'baseline' or 'exp'")
        if side == "baseline":
            BaselineOptions.parse(options)  # raises on a bad option, before anything runs
        else:
            check_overrides(options)
        return cls(" ".join([side, *options]), side, options)

    @property
    def is_reference(self) -> bool:
        return self.side == "baseline" and not self.options
