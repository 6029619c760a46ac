"""Typed configuration: one dataclass schema per Hydra group, registered in Hydra's ConfigStore.

This module is the single home of defaults and of cross-field validation, except the rules of a model family
(which LoRA targets and attention kernels it takes), which live with the family's row in `exp.model.families` and
are checked when a config is composed (`exp.run.typed.to_typed`). YAML files under `conf/` hold only the values
that differ from these defaults. Keys reuse the names of the library they feed (PEFT's `r`, `alpha`,
`target_modules`; bitsandbytes' `quant_type`, `double_quant`; Lightning's `max_steps`, `precision`).

Below `exp.train.main`, code receives these dataclasses (via `OmegaConf.to_object`), never a DictConfig.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from exp.core.secrets import SECRET_NAME
from exp.core.strategies import Strategy, StrategyTraits, strategy_traits


class ConfigError(ValueError):
    """A configuration that composes but cannot work. The message is meant for a person: key, value, fix."""


class ModelFamily(str, Enum):
    # Each family's facts (transformers classes, norms, softcaps, projections, LoRA targets): exp.model.families.
    gemma = "gemma"
    gemma2 = "gemma2"
    gemma3 = "gemma3"


class QuantType(str, Enum):
    nf4 = "nf4"
    fp4 = "fp4"
    int8 = "int8"
    none = "none"


class LoraInit(str, Enum):
    """How the adapters start (PEFT's `init_lora_weights`); what each does and costs: docs/lora.md."""

    default = "default"  # A: Kaiming-uniform, B: zeros (PEFT's `True`): the adapter starts as a no-op
    gaussian = "gaussian"  # A: normal with std 1/r, B: zeros
    # The base's principal (PiSSA: top singular) or orthonormal (OLoRA: QR) directions move into the adapter and
    # the base keeps the residual (re-quantized on a 4-bit base). The saved adapter is converted to a plain LoRA of
    # rank 2r on the original base (exp.model.residual_init).
    pissa = "pissa"
    olora = "olora"
    # LoftQ: A and B fitted to the 4-bit quantization error (PEFT's replace_lora_weights_loftq); the base is untouched.
    loftq = "loftq"
    # Data-driven inits, refused with the reason (see `_lora_problems`).
    eva = "eva"
    corda = "corda"


# Initialisations that replace the base weights by a residual (the adapter holds what was taken out).
RESIDUAL_INITS = (LoraInit.pissa, LoraInit.olora)


class Accelerator(str, Enum):
    cpu = "cpu"
    gpu = "gpu"
    auto = "auto"  # resolved by the preflight from what the machine has


# Lightning precision strings (kept as strings: OmegaConf matches enums by member name, and these names hold
# dashes). Only modes that leave the 4-bit weights alone: a "*-true" low precision would cast the quantized modules.
# "auto": bf16-mixed on GPUs that support it (compute capability >= 8.0), 32-true on the CPU (preflight decides).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "auto")
# hardware.compile and hardware.fuse_lora: a bool, or "auto" (the preflight decides).
COMPILE_CHOICES = (True, False, "auto")


class Schedule(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class Optimizer(str, Enum):
    adamw = "adamw"  # torch.optim.AdamW
    paged_adamw_32bit = "paged_adamw_32bit"  # bitsandbytes: optimizer state paged to CPU memory under pressure (GPU)
    paged_adamw_8bit = "paged_adamw_8bit"  # the same with 8-bit state (GPU)


class LossImpl(str, Enum):
    """How the training loss over the vocabulary is computed (the same loss; different memory and speed)."""

    auto = "auto"  # CUDA: liger where liger-kernel imports, else chunked; the CPU: hf (the reference numbers)
    hf = "hf"  # transformers' own: the full [tokens, vocab] logits, upcast to fp32
    chunked = "chunked"  # exp.model.loss: a few hundred tokens' logits at a time, pure torch (any device)
    liger = "liger"  # liger-kernel's fused linear cross-entropy (Triton, CUDA)


class NonFinite(str, Enum):
    stop = "stop"  # stop the run at the first NaN/Inf loss or gradient, naming the step and the last good checkpoint
    skip = "skip"  # drop that step's update (weights and optimizer state untouched), up to max_skipped_steps in all


class DataFormat(str, Enum):
    synthetic = "synthetic"  # generated, embedded default
    alpaca = "alpaca"  # {instruction, input, output}
    prompt_completion = "prompt_completion"  # {prompt, completion}
    chat = "chat"  # {messages: [{role, content}]}, rendered with the tokenizer's chat template
    sharegpt = "sharegpt"  # {conversations: [{from, value}]}
    text = "text"  # {text}: plain text, continued pre-training (every token carries loss)
    guanaco = "guanaco"  # {text: "### Human: ... ### Assistant: ..."} (oasst1 as used by QLoRA)
    preference = "preference"  # {prompt, chosen, rejected}: text or conversations (exp.data.preference)
    kto = "kto"  # {prompt, completion, label}: unpaired, label true for a desirable completion


class Objective(str, Enum):
    sft = "sft"  # next-token loss on the responses (the default)
    dpo = "dpo"  # Direct Preference Optimization, against a frozen reference (objective.reference)
    orpo = "orpo"  # Odds Ratio Preference Optimization: the chosen NLL plus an odds-ratio term, no reference
    simpo = "simpo"  # Simple Preference Optimization: length-normalised margins with a target, no reference
    kto = "kto"  # Kahneman-Tversky Optimization: unpaired desirable / undesirable completions


class Reference(str, Enum):
    auto = "auto"  # `start` when model.adapter is set, `base` otherwise
    base = "base"  # the base alone: every adapter switched off
    start = "start"  # the model at step 0: the base with the starting adapter (model.adapter), frozen


class DpoLoss(str, Enum):
    sigmoid = "sigmoid"  # the DPO paper's -log sigmoid(beta * margin)
    ipo = "ipo"  # IPO: (margin - 1 / (2 beta))^2 over per-token mean log-probs
    hinge = "hinge"  # SLiC's hinge: relu(1 - beta * margin)
    robust = "robust"  # DPO robust to label noise (label_smoothing is the flip rate)


class BadRows(str, Enum):
    skip = "skip"  # drop rows with a missing / non-string field, warn with how many and which
    fail = "fail"  # stop with a ConfigError naming the file and the rows


class LengthGrouping(str, Enum):
    # Sort within each optimiser step: the steps hold the examples of a random order (what a step learns from is
    # that of plain random batching), its micro-batches hold similar lengths, and the step's loss is the mean over
    # all of its loss tokens, as if it were one batch.
    step = "step"
    # Sort within windows of 50 micro-batches: less padding, but each step's examples are of similar length.
    window = "window"


class LoggerKind(str, Enum):
    """The trackers a run can record to (each a `logger.<name>` switch, and a conf/logger option)."""

    wandb = "wandb"
    tensorboard = "tensorboard"
    mlflow = "mlflow"
    csv = "csv"


class WandbMode(str, Enum):
    auto = "auto"  # online only with credentials and a reachable server, else offline; never prompts
    online = "online"
    offline = "offline"


# gemma_tiny, the embedded default's architecture.
TINY_ARCH: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    # 5x Gemma's 0.02: with 0.02 the frozen random tied head caps logits near 2.5, so no answer can become likely.
    "initializer_range": 0.1,
}


@dataclass
class ModelConfig:
    """Which Gemma to fine-tune and where its weights come from."""

    name: str = "gemma_tiny"
    family: ModelFamily = ModelFamily.gemma
    # Hub id (`google/gemma-2b`) used when `path` is unset and `random_init` is false.
    hub_id: str | None = None
    # A local directory holding a transformers checkpoint; wins over `hub_id`.
    path: str | None = None
    # Build the real architecture from `arch` with random weights (saved once into the local cache, then loaded
    # through the same 4-bit `from_pretrained` path as real weights). For offline tests and benchmarks, and the
    # embedded default (gemma_tiny); the option files of real Gemma models set it to false.
    random_init: bool = True
    # Architecture fields passed to the family's transformers config class when `random_init` is true. The default
    # is gemma_tiny's: 4 layers, hidden 128, small enough to fine-tune on a laptop CPU in minutes.
    arch: dict[str, Any] = field(default_factory=lambda: dict(TINY_ARCH))
    # Gemma 2 needs attention logit softcapping, which plain SDPA lacks: its option file sets "eager".
    attn_implementation: str = "sdpa"
    # Gemma is native in transformers: remote code is never needed, so it stays off unless asked for.
    trust_remote_code: bool = False
    revision: str | None = None
    seed: int = 0  # seed of the random weights when `random_init` is true
    # The adapter training starts from instead of a fresh LoRA (docs/objectives.md, "SFT, then DPO"): an earlier
    # run's directory (its adapter/) or a PEFT adapter directory, resolved to that adapter directory when the config
    # is composed. Its shape (r, alpha, targets) is the adapter's; its files are only read.
    adapter: str | None = None


@dataclass
class QuantizationConfig:
    """How the frozen base is stored (bitsandbytes). The compute dtype follows `hardware.precision`."""

    quant_type: QuantType = QuantType.nf4
    double_quant: bool = True


@dataclass
class LoraConfig:
    """PEFT LoRA settings; names as in `peft.LoraConfig`."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    # Full copies trained next to the adapters. Gemma ties `lm_head` to the 256k-row embedding: naming either
    # here trains (and saves) that whole matrix; a warning says how large.
    modules_to_save: list[str] = field(default_factory=list)
    bias: str = "none"
    init_seed: int = 0  # seed of the adapter initialisation, separate from the data order
    # DoRA (weight-decomposed LoRA): a trained magnitude per output column beside the low-rank direction update.
    # On a 4-bit base each forward dequantizes the weight once more for the column norms: much slower (docs/lora.md).
    use_dora: bool = False
    # rsLoRA: scale the update by alpha / sqrt(r) instead of alpha / r, so higher ranks keep learning.
    use_rslora: bool = False
    init: LoraInit = LoraInit.default
    # With init=pissa: null for the exact SVD; n for PEFT's randomized SVD with n subspace iterations ("pissa_niter_n"),
    # seconds instead of minutes on a 7B model.
    pissa_niter: int | None = None
    # Per-module rank / alpha overriding r / alpha, keyed as PEFT keys them: a module name or a regex matched against
    # the end of the module path (q_proj, or model.layers.0.self_attn.q_proj). Each key must end in a target module.
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, int] = field(default_factory=dict)
    # LoRA+ (Hayou et al., 2024): B's learning rate is trainer.learning_rate x this ratio, A's trainer.learning_rate
    # (the paper suggests 16 for most tasks). null: one learning rate for every adapter tensor.
    plus_lr_ratio: float | None = None


@dataclass
class HardwareConfig:
    """Placement: where and how the steps run. Moving a run to another machine changes only this group."""

    accelerator: Accelerator = Accelerator.cpu
    # Devices per node; -1: every device this process can see (resolved by the preflight). Never a GPU index:
    # which GPUs is decided by CUDA_VISIBLE_DEVICES / the scheduler, and each process uses its strategy's device.
    devices: int = 1
    num_nodes: int = 1
    strategy: Strategy = Strategy.single_device
    precision: str = "32-true"  # one of PRECISIONS
    micro_batch_size: int = 8
    gradient_checkpointing: bool = False
    # With gradient_checkpointing: how many decoder layers recompute their activations in the backward pass (the
    # first N); null: all. Each layer not recomputed saves its share of the recompute (~1/3 of its forward+backward
    # FLOPs) and keeps its activations instead.
    checkpoint_layers: int | None = None
    # GPU, with gradient_checkpointing=true and checkpoint_layers unset: the preflight recomputes only the fewest
    # layers (possibly none) whose estimated peak (exp.hardware.memory) fits the GPU's free memory with
    # AUTO_CHECKPOINT_HEADROOM to spare, and prints its choice. An explicit checkpoint_layers is kept.
    auto_checkpoint_layers: bool = False
    # GPU: the preflight picks micro_batch_size from the memory estimate (the global batch, and so the optimisation,
    # stays): the largest divisor of the per-device global batch that fits without recomputing any layer, going no
    # lower than AUTO_MICRO_BATCH_MIN_TOKENS tokens per micro-batch (below that the fixed per-micro-batch work, e.g.
    # dequantising every 4-bit weight, dominates); what still does not fit then recomputes the fewest layers
    # (auto_checkpoint_layers). Recomputing costs ~1/3 of a layer's FLOPs, a smaller micro-batch almost nothing.
    auto_micro_batch: bool = False
    # Keep the 4-bit weights of the first N decoder layers also dequantized, in the compute dtype, on their device:
    # bitsandbytes otherwise dequantizes every weight at each use (forward, recompute and backward of every
    # micro-batch), and the base weights are frozen, so the copy never goes stale. Same product (F.linear over the
    # same dequantized weight); costs 2 bytes per weight of each such layer. 4-bit quantization only; not with FSDP.
    dequantized_layers: int = 0
    # GPU: the preflight keeps as many layers dequantized as fit in what the micro-batch and checkpointing choices
    # leave of the budget (never at their expense), and prints its choice. An explicit dequantized_layers is kept.
    auto_dequantized_layers: bool = False
    # In the layers with kept dequantized weights: LoRA's B product joins the base product (one GEMM over [W | B]
    # instead of two products and an addition over the output; exp.model.dequantized). For the projections whose output is
    # at least as wide as their input (q, k, v, gate, up); the others, and everything else, run as PEFT runs them.
    # Same sum, other rounding order. true | false | auto (resolved by the preflight: on, except for an objective with
    # a reference (DPO, KTO), whose loss needs the policy and the reference rounded alike). Typed Any as `compile`.
    fuse_lora: Any = False
    # Send the tensors the backward needs from outside the recomputed layers (each checkpointed layer's input, the
    # final norm's and the loss's) to pinned host memory in the forward, and back one by one in the backward. For
    # micro-batches whose checkpointed inputs alone would fill the GPU; the copies cost time (host link bandwidth).
    offload_checkpoints: bool = False
    # Training micro-batches without padding: each optimiser step's examples (the same examples, in the same
    # seeded order, as padded batching) laid end to end in rows with restarting position ids and no attention
    # across examples, cut into as few micro-batches of at most `micro_batch_tokens` tokens as every step of the run
    # allows (exp.data.padding_free). The step's loss and gradient are those of its padded batches. With
    # data.packing=true packing decides instead (its rows are the step's unit).
    padding_free: bool = False
    # With padding_free: the most tokens in one micro-batch (null: micro_batch_size x data.max_seq_len, which the
    # preflight's auto_micro_batch chooses on a GPU from the memory estimate). At least data.max_seq_len.
    micro_batch_tokens: int | None = None
    num_workers: int = 0
    # The training loss over Gemma's 256k vocabulary (see LossImpl): the stock path holds several fp32 copies of
    # [tokens, vocab] logits, the fused / chunked ones a few hundred tokens' worth. Which one ran is logged.
    loss_impl: LossImpl = LossImpl.auto
    # torch.optim.AdamW(fused=True): one kernel over all adapter tensors, on CUDA or the CPU (no effect with the
    # paged bitsandbytes optimisers). Clipping and fp16 loss scaling work with it (exp.training.precision). Off by
    # default: the CPU default run keeps torch's foreach AdamW, the optimiser of the hand-written reference loop the
    # CPU tests compare with bitwise; the GPU options turn it on.
    fused_adamw: bool = False
    # torch.compile each decoder layer in place (state-dict keys unchanged); the first steps pay the compile time.
    # true | false | auto (resolved by the preflight: on for a CUDA GPU, off on the CPU). On a GPU the preflight
    # turns it off (and says so) where Triton is missing or the GPU is older than Volta; a graph that fails to
    # compile runs eagerly (torch._dynamo's fallback, logged). Typed Any: OmegaConf has no bool-or-"auto" type.
    compile: Any = False
    # GPU memory this run may plan for, per device, in GiB (null: the free memory the preflight sees, less
    # AUTO_CHECKPOINT_HEADROOM). Caps the choices made by memory (auto_checkpoint_layers) and the memory check:
    # for sharing a GPU, or for matching another program's footprint.
    memory_budget_gib: float | None = None


# The `data.<name>_field` column mappings a mixture source may set in its `fields` (the SFT formats' columns).
MIXTURE_FIELDS = ("instruction", "input", "output", "prompt", "completion", "messages", "tools", "text")
# The formats a mixture may mix: the SFT ones (preference pairs train other objectives).
MIXTURE_FORMATS = ("synthetic", "alpaca", "prompt_completion", "chat", "sharegpt", "text", "guanaco")


@dataclass
class MixtureSource:
    """One source of `data.mixture`: where its rows come from, how they read, its share of each training epoch and
    its held-out part (docs/data.md "Mixtures")."""

    # A local file / directory, or a hub dataset (and its split); neither for format=synthetic (the generated task,
    # data.num_examples rows).
    path: str | None = None
    hub_id: str | None = None
    split: str = "train"
    format: DataFormat = DataFormat.alpaca
    # Relative weight: the source's share of every training epoch's examples is weight / (sum of weights); an
    # epoch holds as many examples as all sources' training splits together. 0: held out only (validated on).
    weight: float = 1.0
    # This source's held-out part, carved before mixing (a fraction < 1 or a count >= 1, drawn with data.seed), or
    # every usable row of its own val_path.
    val_size: float = 0.1
    val_path: str | None = None
    # Column mappings, as data.<name>_field: e.g. {instruction: question, output: answer}.
    fields: dict[str, str] = field(default_factory=dict)
    # How reports name it (default: the file's stem, the hub id, or "synthetic").
    name: str | None = None

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.path:
            return Path(self.path).stem
        return self.hub_id or self.format.value


@dataclass
class DataConfig:
    """The examples: where they come from and how they become token ids."""

    format: DataFormat = DataFormat.synthetic
    # A local JSON / JSONL / CSV / Parquet file (or a directory of them) for file-based formats; relative paths are
    # resolved against the directory `exp.train` was launched from.
    path: str | None = None
    # Or a dataset on the Hugging Face hub (read from the local `datasets` cache when offline), and its split.
    hub_id: str | None = None
    split: str = "train"
    # A separate validation file (same format; Alpaca rows for `format=synthetic`), for every source: validation
    # is then all of its usable rows, and `val_size` is unused. When unset, `val_size` is carved from the training
    # data.
    val_path: str | None = None
    # Column names, mappable for files that use other names (see docs/data.md for which format reads which).
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    # format=chat: the OpenAI-style function declarations of a row (optional; see docs/data.md "Tool calls").
    tools_field: str = "tools"
    text_field: str = "text"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    label_field: str = "label"
    max_seq_len: int = 128
    # Held-out split: a fraction (< 1) or a number of examples (>= 1), drawn with `seed`.
    val_size: float = 0.1
    train_on_prompt: bool = False
    on_bad_rows: BadRows = BadRows.skip
    # Concatenate training examples into full max_seq_len rows (no padding, no cross-example attention).
    packing: bool = False
    # Without packing: batch examples of similar length (less padding). Off for the synthetic default, whose
    # examples are all about as long, so its data order (and recorded losses) stay as they are.
    group_by_length: bool = False
    # Where examples are sorted by length (see LengthGrouping): within each optimiser step, or across windows of
    # steps.
    length_grouping: LengthGrouping = LengthGrouping.step
    # Size of the generated default dataset (`format=synthetic`).
    num_examples: int = 4000
    seed: int = 0
    # Several sources, each with its own format, columns, weight and held-out part, mixed into one training set
    # (exp.data.mixture); data.path / hub_id / format / val_* are then unused. Empty: the one source above.
    mixture: list[MixtureSource] = field(default_factory=list)
    # Read data.path (JSONL / Parquet / CSV files) as a stream, tokenised as training reads it, for files too large
    # to tokenise up front (exp.data.streaming): memory stays flat whatever the file's size. Held out: the first
    # data.val_size rows (a count) or data.val_path. Batches are padded, in the stream's order.
    streaming: bool = False
    # Streaming: the rows a seeded buffer shuffles among (0: the file's order).
    shuffle_buffer: int = 1000


@dataclass
class TrainerConfig:
    """The algorithm: steps, optimiser, schedule, batch. Independent of the machine (see `hardware`).

    The defaults are the embedded default run's (gemma_tiny on the synthetic task, from random weights): a learning
    rate 25x the usual QLoRA 2e-4, since the adapters learn the task from nothing in a few minutes of CPU. Real
    models: `trainer=default` (the common QLoRA values) or an experiment file."""

    max_steps: int = 3000
    optimizer: Optimizer = Optimizer.adamw
    learning_rate: float = 5e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    # Linear warmup, as transformers' TrainingArguments.warmup_steps: a whole number of steps (>= 1), or a fraction
    # of trainer.max_steps (0 < x < 1, rounded up), so that a shortened run or a sweep over max_steps keeps the
    # schedule's shape instead of warming up for longer than it trains.
    warmup_steps: float = 0.03  # 90 of the default 3000 steps: a shortened run keeps a full schedule
    lr_schedule: Schedule = Schedule.cosine
    # Examples per optimiser step across all devices; accumulation = global / (micro x devices x nodes).
    global_batch_size: int = 8
    max_grad_norm: float = 1.0
    val_every_n_steps: int = 500
    # Validation batches per evaluation (null: the whole held-out split).
    limit_val_batches: int | None = None
    # Greedy answers written to <run>/samples.txt (and a W&B table) at every validation, to watch them change:
    # these instructions in the data's prompt format, or (empty) the first `sample_count` held-out examples.
    sample_prompts: list[str] = field(default_factory=list)
    sample_count: int = 3  # 0 (with no sample_prompts): no samples
    sample_max_new_tokens: int = 24
    # Also at the step-0 validation. Off: the adapters start as the identity (LoRA's B is zero), so step 0's answers
    # are the base model's, the same for every job of a sweep, and an untrained adapter rarely stops early: all
    # `sample_max_new_tokens` decoding steps, before the first training step (on one H100, 5.7 s of a Gemma-7B-shape
    # step-0 validation of 8.0 s; benchmarks/results/real200_h100_20261206/).
    sample_at_start: bool = False
    checkpoint_every_n_steps: int = 1000
    # Periodic checkpoints kept (the newest K; `last.ckpt` and the best by val/loss are kept besides).
    keep_last_checkpoints: int = 3
    # null: a fresh run. "auto": continue the newest run with this config from its last checkpoint (a fresh run if
    # there is none). A run directory or a .ckpt file: continue from it.
    resume: str | None = None
    # A corrupt or truncated checkpoint stops the resume with an error; true: fall back to the newest intact one.
    resume_fallback: bool = False
    on_nonfinite: NonFinite = NonFinite.stop
    max_skipped_steps: int = 10  # with on_nonfinite=skip: stop once more steps than this were skipped
    log_every_n_steps: int = 25
    seed: int = 0

    @property
    def warmup_step_count(self) -> int:
        """The warmup in optimiser steps: `warmup_steps` itself, or its fraction of `max_steps` rounded up (and
        short of the whole run: the last step trains at the peak learning rate, even in a one-step run)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return min(math.ceil(self.warmup_steps * self.max_steps), self.max_steps - 1)


@dataclass
class LoggerConfig:
    """Experiment tracking: one switch per tracker, so that `logger=[wandb,tensorboard]` (Hydra's selection of
    several options of a group, each switching its own on) records to both. csv/metrics.csv is written whenever any
    is on; none on is `logger=none`. W&B is the default run's tracker (conf/train.yaml's `logger: wandb`)."""

    wandb: bool = True
    tensorboard: bool = False  # <run>/tensorboard (Lightning's TensorBoardLogger)
    mlflow: bool = False  # an MLflow run in the store `tracking_uri` names
    csv: bool = False  # metrics.csv alone
    # W&B's project, and MLflow's experiment.
    project: str = "exp"
    run_name: str | None = None  # default: <experiment>-<model>-<run dir>; a sweep job: its overrides
    entity: str | None = None
    mode: WandbMode = WandbMode.auto
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    log_adapter: bool = False  # upload the final adapter as a W&B / MLflow artifact
    # MLflow's store: a URI (file:, sqlite:, http(s)://) or a directory (relative: to where the run was launched);
    # null: a file store in the run directory (<run>/mlruns), no server.
    tracking_uri: str | None = None

    @property
    def trackers(self) -> list[LoggerKind]:
        """The trackers switched on, csv/metrics.csv included whenever any is."""
        on = [kind for kind in LoggerKind if kind != LoggerKind.csv and getattr(self, kind.value)]
        return [*on, LoggerKind.csv] if on or self.csv else []


@dataclass
class ObjectiveConfig:
    """What the adapters are trained to do (docs/objectives.md): SFT's next-token loss, or a preference objective
    on preference data (data.format=preference / kto, or the generated pairs of the synthetic default)."""

    kind: Objective = Objective.sft
    # The preference objectives' temperature (DPO, KTO: how far from the reference; ORPO: the odds-ratio term's
    # weight lambda; SimPO: the reward scale).
    beta: float = 0.1
    dpo_loss: DpoLoss = DpoLoss.sigmoid
    # DPO's robust loss and SimPO: the assumed rate of flipped preference labels.
    label_smoothing: float = 0.0
    # SimPO's target reward margin gamma, given as gamma / beta (the margin is simpo_gamma x beta).
    simpo_gamma: float = 0.5
    # KTO: weights of the desirable and undesirable examples' losses.
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    # DPO and KTO's reference model (auto: `start` with model.adapter, else `base`).
    reference: Reference = Reference.auto
    # Score the reference once before training (train and held-out pairs, cached on disk) instead of in every step:
    # a third fewer forward passes per step, at one pass over the data up front (docs/objectives.md). DPO only.
    precompute_reference: bool = False

    @property
    def preference(self) -> bool:
        return self.kind != Objective.sft

    @property
    def uses_reference(self) -> bool:
        """DPO and KTO compare with a reference model (objective.reference: the base, or the starting adapter)."""
        return self.kind in (Objective.dpo, Objective.kto)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    # Name of the experiment (set by `experiment=` files); becomes a tag and part of the run name.
    experiment_name: str | None = None
    # The console shows exp's own lines and warnings; true (or -v) adds the INFO logs of Lightning, transformers and
    # W&B and the model-loading bars. train.log in the run directory gets everything either way.
    verbose: bool = False

    def __post_init__(self) -> None:
        problems = _validate(self)
        if problems:
            raise ConfigError("Invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))

    @property
    def data_parallel_size(self) -> int:
        """Processes that each take their own micro-batch: model parallelism spans devices with one process."""
        return data_parallel_size(self.hardware)

    @property
    def accumulate_grad_batches(self) -> int:
        return self.trainer.global_batch_size // (self.hardware.micro_batch_size * self.data_parallel_size)

    @property
    def reference(self) -> Reference | None:
        """DPO and KTO's reference, resolved: `start` (the base with the starting adapter) or `base`; None for the
        objectives without one."""
        o = self.objective
        if not o.uses_reference:
            return None
        if o.reference == Reference.auto:
            return Reference.start if self.model.adapter else Reference.base
        return o.reference


def data_parallel_size(hw: HardwareConfig) -> int:
    if (traits := _resolved_traits(hw)) is not None and traits.data_parallel:
        return max(hw.devices, 1) * hw.num_nodes
    return hw.num_nodes


def _resolved_traits(hw: HardwareConfig) -> StrategyTraits | None:
    """What the strategy means; None while it is `auto`, which the checks here skip: the preflight resolves it and
    then runs them again (`config_problems`)."""
    return None if hw.strategy == Strategy.auto else strategy_traits(hw.strategy)


def _validate(cfg: TrainConfig) -> list[str]:
    """Collect every cross-field problem, so one run reports them all at once."""
    p: list[str] = non_finite_problems(cfg)
    if p:  # every range check below would report the same keys again, less clearly
        return p
    m, q, lo, hw, d, t = cfg.model, cfg.quantization, cfg.lora, cfg.hardware, cfg.data, cfg.trainer
    p += objective_problems(cfg)
    if not (m.path or m.hub_id or m.random_init):
        p.append(f"model '{m.name}' has no weights: set model.path=<dir>, model.hub_id=<id> or model.random_init=true")
    if m.random_init and not m.arch:
        p.append(f"model.random_init=true needs model.arch (the architecture) but model '{m.name}' has none")
    p += _secret_keys("model.arch", m.arch)
    if m.random_init:
        p += arch_problems(m)
    if m.attn_implementation not in ATTN_IMPLEMENTATIONS:
        p.append(
            f"model.attn_implementation={m.attn_implementation}: allowed values are {', '.join(ATTN_IMPLEMENTATIONS)} "
            "(what transformers and exp's memory estimate support), e.g. model.attn_implementation=sdpa"
        )
    elif m.attn_implementation == "flex_attention" and cfg.hardware.accelerator == Accelerator.cpu:
        p.append(
            "model.attn_implementation=flex_attention on the CPU: FlexAttention has no backward pass on the CPU; use "
            "e.g. model.attn_implementation=sdpa (or eager for Gemma 2)"
        )
    elif m.attn_implementation.startswith("flash") and cfg.hardware.accelerator == Accelerator.cpu:
        p.append(
            f"model.attn_implementation={m.attn_implementation} on the CPU: FlashAttention is a CUDA kernel; use "
            "e.g. model.attn_implementation=sdpa (or eager)"
        )
    if lo.r <= 0:
        p.append(f"lora.r={lo.r}: the rank must be a positive integer, e.g. lora.r=8")
    if lo.alpha <= 0:
        p.append(f"lora.alpha={lo.alpha}: must be positive (PEFT scales the update by alpha / r), e.g. lora.alpha=16")
    if not 0.0 <= lo.dropout < 1.0:
        p.append(f"lora.dropout={lo.dropout}: must be in [0, 1), e.g. lora.dropout=0.05")
    if not lo.target_modules:
        p.append("lora.target_modules is empty: name at least one module, e.g. lora.target_modules=[q_proj,v_proj]")
    if lo.bias not in ("none", "all", "lora_only"):
        p.append(f"lora.bias={lo.bias!r}: allowed values are none, all, lora_only")
    p += _lora_problems(cfg)
    if hw.devices == 0 or hw.devices < -1 or hw.num_nodes < 1:
        p.append(
            f"hardware.devices={hw.devices}, hardware.num_nodes={hw.num_nodes}: devices must be >= 1 (or -1 for "
            "every visible device) and num_nodes >= 1"
        )
    traits = _resolved_traits(hw)
    if traits is not None and not traits.uses_several_devices and hw.devices not in (1, -1):
        p.append(
            f"hardware.devices={hw.devices} with hardware.strategy={hw.strategy.value}: one process uses one device; "
            "for several use hardware=ddp (a replica per GPU), hardware=fsdp (sharded) or hardware=model_parallel"
        )
    if traits is not None and traits.spans_devices_in_one_process and hw.num_nodes != 1:
        p.append(f"hardware.strategy={hw.strategy.value} spans the GPUs of one machine: set hardware.num_nodes=1")
    if hw.accelerator == Accelerator.cpu and traits is not None and not traits.runs_on_cpu:
        p.append(f"hardware.strategy={hw.strategy.value} needs GPUs; on the CPU use single_device or ddp")
    if hw.micro_batch_size < 1:
        p.append(
            f"hardware.micro_batch_size={hw.micro_batch_size}: must be >= 1 (the examples of one forward pass per "
            "process), e.g. hardware.micro_batch_size=4"
        )
    if hw.micro_batch_tokens is not None and hw.micro_batch_tokens < d.max_seq_len:
        p.append(
            f"hardware.micro_batch_tokens={hw.micro_batch_tokens} is below data.max_seq_len={d.max_seq_len}: a "
            f"padding-free micro-batch must hold the longest example; use hardware.micro_batch_tokens="
            f"{d.max_seq_len} or more (or null: micro-batch x max_seq_len)"
        )
    if hw.compile not in COMPILE_CHOICES:
        p.append(f"hardware.compile={hw.compile}: allowed values are true, false and auto (on for a CUDA GPU)")
    if hw.fuse_lora not in COMPILE_CHOICES:
        p.append(
            f"hardware.fuse_lora={hw.fuse_lora}: allowed values are true, false and auto (on, except for objectives "
            "with a reference: dpo, kto)"
        )
    if hw.memory_budget_gib is not None and not (hw.memory_budget_gib > 0 and math.isfinite(hw.memory_budget_gib)):
        p.append(
            f"hardware.memory_budget_gib={hw.memory_budget_gib}: GiB of GPU memory per device, a positive number "
            "(e.g. hardware.memory_budget_gib=40), or null for the free memory"
        )
    layers = (m.arch or {}).get("num_hidden_layers")
    if hw.checkpoint_layers is not None and not 0 <= hw.checkpoint_layers <= (layers or hw.checkpoint_layers):
        p.append(
            f"hardware.checkpoint_layers={hw.checkpoint_layers}: the number of decoder layers to recompute, from 0 to "
            f"{layers or 'the number of layers'} (model {m.name}), or null for all"
        )
    if not 0 <= hw.dequantized_layers <= (layers or hw.dequantized_layers):
        p.append(
            f"hardware.dequantized_layers={hw.dequantized_layers}: the number of decoder layers whose 4-bit weights "
            f"stay dequantized, from 0 to {layers or 'the number of layers'} (model {m.name}); e.g. "
            "hardware.dequantized_layers=0 (none), or hardware.auto_dequantized_layers=true on a GPU"
        )
    if hw.precision not in PRECISIONS:
        p.append(
            f"hardware.precision={hw.precision}: allowed values are {', '.join(PRECISIONS)} (a '*-true' low "
            "precision would cast the 4-bit weights; use the '-mixed' form, e.g. hardware.precision=bf16-mixed)"
        )
    elif hw.accelerator == Accelerator.cpu and hw.precision == "16-mixed":
        p.append(
            "hardware.precision=16-mixed on the CPU: fp16 with a loss scaler is the fallback for GPUs without bf16, "
            "and Gemma overflows in fp16; use hardware.precision=32-true (the cpu default) or bf16-mixed"
        )
    if hw.accelerator == Accelerator.cpu and hw.loss_impl == LossImpl.liger:
        p.append(
            "hardware.loss_impl=liger on the CPU: liger-kernel's fused loss is a Triton (CUDA) kernel; use "
            "hardware.loss_impl=chunked (exp's own, any device) or auto"
        )
    if hw.accelerator == Accelerator.cpu and q.quant_type == QuantType.int8:
        p.append("quantization=int8 needs a GPU (bitsandbytes' 8-bit matmul has no CPU kernel here): use nf4 or fp4")
    if traits is not None and traits.sharded and q.quant_type == QuantType.int8:
        p.append(
            f"quantization=int8 with hardware.strategy={hw.strategy.value}: FSDP shards only floating-point "
            "tensors, and 8-bit weights cannot be stored as floats (4-bit ones can: bnb_4bit_quant_storage). Use "
            "quantization=nf4 with hardware=fsdp (FSDP-QLoRA), or keep int8 with hardware=ddp"
        )
    if hw.offload_checkpoints and not (hw.gradient_checkpointing and hw.checkpoint_layers is None):
        p.append(
            "hardware.offload_checkpoints=true sends the inputs of recomputed layers to host memory, so every layer "
            f"must recompute (hardware.gradient_checkpointing={hw.gradient_checkpointing}, "
            f"hardware.checkpoint_layers={hw.checkpoint_layers}); set hardware.gradient_checkpointing=true "
            "hardware.checkpoint_layers=null, or hardware.offload_checkpoints=false"
        )
    if hw.dequantized_layers and q.quant_type not in (QuantType.nf4, QuantType.fp4):
        p.append(
            f"hardware.dequantized_layers={hw.dequantized_layers} with quantization={q.quant_type.value}: only 4-bit "
            "weights are kept dequantized; use hardware.dequantized_layers=0"
        )
    if hw.dequantized_layers and traits is not None and not traits.whole_weights_on_each_rank:
        p.append(
            f"hardware.dequantized_layers={hw.dequantized_layers} with hardware.strategy={hw.strategy.value}: FSDP "
            "gathers each layer's 4-bit shards for its use and frees them, so no full dequantized copy can stay; use "
            "hardware.dequantized_layers=0"
        )
    p += batch_problems(hw, t)
    if t.optimizer != Optimizer.adamw and hw.accelerator == Accelerator.cpu:
        p.append(
            f"trainer.optimizer={t.optimizer.value} pages optimizer state between GPU and CPU memory and needs a GPU: "
            "use trainer.optimizer=adamw on the CPU"
        )
    if t.max_steps < 1:
        p.append(
            f"trainer.max_steps={t.max_steps}: must be >= 1 (optimizer steps to train), e.g. trainer.max_steps=1000"
        )
    if t.learning_rate <= 0:
        p.append(f"trainer.learning_rate={t.learning_rate}: must be positive, e.g. trainer.learning_rate=2e-4")
    if t.warmup_steps < 0 or (t.warmup_steps >= 1 and t.warmup_steps != int(t.warmup_steps)):
        p.append(
            f"trainer.warmup_steps={t.warmup_steps:g}: must be a whole number of steps (>= 1), a fraction of "
            "trainer.max_steps (0 < x < 1) or 0 (no warmup), e.g. trainer.warmup_steps=10 or trainer.warmup_steps=0.03"
        )
    if t.max_grad_norm < 0:
        p.append(
            f"trainer.max_grad_norm={t.max_grad_norm}: must be >= 0 (0 disables clipping), e.g. trainer.max_grad_norm=1.0"
        )
    for key, value, default in (
        ("val_every_n_steps", t.val_every_n_steps, 50),
        ("checkpoint_every_n_steps", t.checkpoint_every_n_steps, 100),
        ("log_every_n_steps", t.log_every_n_steps, 5),
    ):
        if value < 1:
            p.append(
                f"trainer.{key}={value}: an interval in optimizer steps, must be >= 1, e.g. trainer.{key}={default}"
            )
    if t.keep_last_checkpoints < 1:
        p.append(
            f"trainer.keep_last_checkpoints={t.keep_last_checkpoints}: must be >= 1 (the newest is what resumes), e.g. "
            "trainer.keep_last_checkpoints=3"
        )
    if t.max_skipped_steps < 0:
        p.append(f"trainer.max_skipped_steps={t.max_skipped_steps}: must be >= 0, e.g. trainer.max_skipped_steps=10")
    if d.format != DataFormat.synthetic and not (d.path or d.hub_id):
        p.append(f"data.format={d.format.value} reads a file: set data.path=<file or directory> or data.hub_id=<name>")
    if d.format == DataFormat.synthetic and (d.path or d.hub_id):
        # Training on generated rows while the user named a dataset would measure something they did not ask for.
        key, value = ("data.path", d.path) if d.path else ("data.hub_id", d.hub_id)
        p.append(
            f"{key}={value}: data.format=synthetic (the default) generates its training examples and reads no "
            "dataset; pick the format of the data, e.g. data=alpaca for {instruction, input, output} rows (docs/data.md "
            f"lists them), or drop {key} to train on the generated task"
        )
    if d.max_seq_len < 8:
        p.append(f"data.max_seq_len={d.max_seq_len}: too short to hold a prompt and a response; use >= 8")
    if d.val_size <= 0 or (d.val_size >= 1 and d.val_size != int(d.val_size)):
        p.append(
            f"data.val_size={d.val_size}: must be a fraction in (0, 1) or a whole count >= 1, e.g. data.val_size=0.1"
        )
    p += mixture_problems(cfg)
    p += streaming_problems(cfg)
    p += library_range_problems(cfg)
    return p


def streaming_problems(cfg: TrainConfig) -> list[str]:
    """What `data.streaming=true` cannot do: a stream is one local source, of unknown length, read in order."""
    d, p = cfg.data, []
    if d.shuffle_buffer < 0:
        p.append(f"data.shuffle_buffer={d.shuffle_buffer}: rows to shuffle among, >= 0 (0: the file's order)")
    if not d.streaming:
        return p
    why = "data.streaming=true reads one local file or directory (data.path) as a stream"
    if d.mixture:
        p.append(f"{why}; data.mixture is not streamed: drop data.streaming, or train one source")
    elif not d.path:
        p.append(f"{why}: set data.path=<file or directory> (JSONL, Parquet or CSV; a hub dataset: save it as one)")
    if not d.val_path and d.val_size < 1:
        p.append(
            f"data.val_size={d.val_size:g} with data.streaming=true: a stream's length is unknown, so the held-out "
            "split is the first data.val_size rows of the file, a count: e.g. data.val_size=500, or data.val_path"
        )
    if d.packing:
        p.append("data.packing=true with data.streaming=true: packing plans over the whole split; drop one")
    if cfg.objective.preference:
        p.append(f"data.streaming=true with objective={cfg.objective.kind.value}: only SFT data streams")
    return p


def mixture_problems(cfg: TrainConfig) -> list[str]:
    """What is wrong with `data.mixture`: sources without data, unknown column keys, weights that cannot make an
    epoch, a mixture beside a single source or with a preference objective."""
    d, p = cfg.data, []
    if not d.mixture:
        return p
    for key in ("path", "hub_id", "val_path"):
        if getattr(d, key):
            p.append(
                f"data.{key}={getattr(d, key)} is set beside data.mixture, which lists the sources and would ignore "
                f"it: move it into a source of data.mixture (or drop data.mixture)"
            )
    if cfg.objective.preference:
        p.append(
            f"data.mixture with objective={cfg.objective.kind.value}: mixtures hold SFT examples; preference "
            "objectives read one preference source (data.format=preference / kto and data.path)"
        )
    for i, s in enumerate(d.mixture):
        key = f"data.mixture[{i}]"
        if s.format.value not in MIXTURE_FORMATS:
            p.append(
                f"{key}.format={s.format.value}: a mixture mixes SFT formats ({', '.join(MIXTURE_FORMATS)}); train "
                "preference data alone with data.format and data.path"
            )
        has_data = bool(s.path or s.hub_id)
        if s.format == DataFormat.synthetic and has_data:
            p.append(f"{key}: format=synthetic generates its rows and reads no path or hub_id; drop them")
        elif s.format != DataFormat.synthetic and has_data == bool(s.path and s.hub_id):
            p.append(f"{key} (format={s.format.value}): give exactly one of path=<file or directory> or hub_id=<name>")
        if not math.isfinite(s.weight) or s.weight < 0:
            p.append(f"{key}.weight={s.weight}: a weight is a share of each epoch, >= 0 (0: validated on only)")
        if s.val_size <= 0 or (s.val_size >= 1 and s.val_size != int(s.val_size)):
            p.append(f"{key}.val_size={s.val_size}: must be a fraction in (0, 1) or a whole count >= 1, e.g. 0.1")
        unknown = sorted(set(s.fields) - set(MIXTURE_FIELDS))
        if unknown:
            p.append(
                f"{key}.fields has {unknown}: the keys are the columns a format reads ({', '.join(MIXTURE_FIELDS)}), "
                f"each mapped to the file's column name, e.g. fields={{instruction: question}}"
            )
    weights = [s.weight for s in d.mixture]
    if all(math.isfinite(w) and w >= 0 for w in weights) and sum(weights) <= 0:
        p.append(
            f"data.mixture weights {weights} sum to 0: no source would be trained on; give at least one a weight > 0"
        )
    labels = [s.label for s in d.mixture]
    if len(set(labels)) < len(labels):
        p.append(f"data.mixture names its sources {labels}: two share a name; give each a distinct name=<...>")
    return p


# Seeds feed numpy (Lightning's seed_everything, which silently replaces a seed outside this range by 0), torch and
# Python's random: the range all of them take.
MAX_SEED = 2**32 - 1


def non_finite_problems(cfg: Any, path: str = "") -> list[str]:
    """Every float of the config that is NaN or infinite: no setting of exp means anything there (a NaN compares
    false with every bound, so range checks alone would let it through)."""
    import dataclasses

    problems = []
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{path}{f.name}"
        if dataclasses.is_dataclass(value):
            problems += non_finite_problems(value, f"{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{key}={value}: must be a finite number, e.g. {key}={getattr(type(cfg)(), f.name)}")
        elif isinstance(value, dict):  # model.arch: passed to transformers' config class as it is
            problems += [
                f"{key}.{k}={v}: must be a finite number; set a real value (e.g. the model's published one) or drop it"
                for k, v in value.items()
                if isinstance(v, float) and not math.isfinite(v)
            ]
    return problems


def library_range_problems(cfg: TrainConfig) -> list[str]:
    """Ranges the libraries fed by these keys enforce later, with a traceback (torch.optim.AdamW, DataLoader,
    numpy's seeding, Lightning's Trainer, W&B's settings): refused here instead, before anything runs."""
    p: list[str] = []
    m, lo, hw, d, t, lg = cfg.model, cfg.lora, cfg.hardware, cfg.data, cfg.trainer, cfg.logger
    for key, beta in (("trainer.adam_beta1", t.adam_beta1), ("trainer.adam_beta2", t.adam_beta2)):
        if not 0.0 <= beta < 1.0:
            default = 0.9 if key.endswith("1") else 0.999
            p.append(f"{key}={beta}: AdamW's betas must be in [0, 1), e.g. {key}={default}")
    # key, value, the smallest value allowed, an example, what the value is
    minimums = [
        ("trainer.weight_decay", t.weight_decay, 0, 0.0, "0: no decay"),
        ("hardware.num_workers", hw.num_workers, 0, 0, "data-loading processes; 0: load in the training process"),
        ("trainer.sample_count", t.sample_count, 0, 3, "0: no samples"),
        ("trainer.sample_max_new_tokens", t.sample_max_new_tokens, 1, 24, "tokens per sample answer"),
    ]
    if t.limit_val_batches is not None:  # the step-0 and final evaluations are part of every run
        minimums.append(("trainer.limit_val_batches", t.limit_val_batches, 1, 10, "or null for the whole split"))
    if d.format == DataFormat.synthetic:
        minimums.append(("data.num_examples", d.num_examples, 2, 4000, "one to train on, one held out"))
    for key, value, least, example, why in minimums:
        if value < least:
            p.append(f"{key}={value}: must be >= {least} ({why}), e.g. {key}={example}")
    for key, seed in (
        ("trainer.seed", t.seed),
        ("data.seed", d.seed),
        ("model.seed", m.seed),
        ("lora.init_seed", lo.init_seed),
    ):
        if not 0 <= seed <= MAX_SEED:
            p.append(f"{key}={seed}: a seed must be in [0, 2**32 - 1] (numpy's range), e.g. {key}=0")
    if lg.mlflow and not lg.project.strip():
        p.append(
            f"logger.project={lg.project!r}: the MLflow experiment's name must not be empty, e.g. logger.project=exp"
        )
    if lg.wandb:
        bad = sorted(set(lg.project) & set(WANDB_PROJECT_FORBIDDEN))
        if not lg.project or len(lg.project) > 128 or bad:
            p.append(
                f"logger.project={lg.project!r}: W&B project names are 1 to 128 characters without "
                f"{' '.join(WANDB_PROJECT_FORBIDDEN)}, e.g. logger.project=exp"
            )
        tags = [*lg.tags, *([cfg.experiment_name] if cfg.experiment_name else [])]
        if long := [tag for tag in tags if not 1 <= len(tag) <= 64]:
            p.append(f"logger.tags={long}: W&B tags (the experiment name is one) are 1 to 64 characters each")
    return p


WANDB_PROJECT_FORBIDDEN = "/\\#?%:"


# Attention kernels a model may be loaded with (transformers' names; exp.hardware.memory estimates each).
# varlen: exp.model.varlen (torch's FlashAttention varlen kernel over examples laid end to end; SDPA per example
# on the CPU).
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flex_attention", "varlen")
# Sizes of a random-weight architecture (model.arch) that transformers would take and then fail on with a bare
# tensor-shape error, or build into a model that cannot train.
ARCH_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
)


def arch_problems(m: ModelConfig) -> list[str]:
    """`model.arch` of a random-weight model: positive sizes, an even head size (rotary embeddings rotate pairs of
    dimensions), query heads in whole groups per key/value head."""
    p = []
    for key in ARCH_SIZES:
        value = m.arch.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            p.append(
                f"model.arch.{key}={value}: must be a whole number >= 1 (model {m.name}); drop it or set e.g. "
                f"model.arch.{key}=128"
            )
    head_dim, heads, kv = m.arch.get("head_dim"), m.arch.get("num_attention_heads"), m.arch.get("num_key_value_heads")
    if isinstance(head_dim, int) and head_dim >= 1 and head_dim % 2:
        p.append(
            f"model.arch.head_dim={head_dim}: must be even (rotary position embeddings rotate pairs of "
            f"dimensions), e.g. model.arch.head_dim={head_dim + 1}"
        )
    if isinstance(heads, int) and isinstance(kv, int) and heads >= 1 and kv >= 1 and heads % kv:
        p.append(
            f"model.arch.num_attention_heads={heads} is not a multiple of model.arch.num_key_value_heads={kv}: "
            f"each key/value head serves a whole group of query heads, e.g. model.arch.num_key_value_heads=1"
        )
    return p


def _secret_keys(path: str, node: Any) -> list[str]:
    """Secret-looking keys in a free-form part of the config: it is recorded in config.yaml and W&B."""
    if not isinstance(node, dict):
        return []
    problems = []
    for key, value in node.items():
        if SECRET_NAME.search(str(key)):
            problems.append(
                f"{path}.{key}: a secret-looking key in the training config would be recorded in config.yaml and W&B. "
                "Remove it; pass credentials in the environment (e.g. HF_TOKEN, WANDB_API_KEY)"
            )
        problems += _secret_keys(f"{path}.{key}", value)
    return problems


def config_problems(cfg: TrainConfig) -> list[str]:
    """The cross-field checks of the schema, for a config whose values changed after construction (the preflight
    resolving `auto`)."""
    return _validate(cfg)


def batch_problems(hw: HardwareConfig, t: TrainerConfig) -> list[str]:
    """Accumulation is derived from the global batch; unknown until `devices=-1` is resolved by the preflight."""
    if hw.devices == -1 and ((traits := _resolved_traits(hw)) is None or traits.data_parallel):
        return []
    if hw.micro_batch_size < 1:
        return []  # the micro-batch's own check names it; no global batch would be a multiple of it
    replicas = data_parallel_size(hw)
    per_step = hw.micro_batch_size * replicas
    if t.global_batch_size < 1:
        return [
            f"trainer.global_batch_size={t.global_batch_size}: must be >= 1 (the examples of one optimizer step), "
            f"e.g. trainer.global_batch_size={per_step}"
        ]
    if t.global_batch_size % per_step == 0:
        return []
    if 1 <= t.global_batch_size < per_step:
        fits = [m for m in range(t.global_batch_size // replicas, 0, -1) if t.global_batch_size % (m * replicas) == 0]
        return [
            f"hardware.micro_batch_size={hw.micro_batch_size} x data-parallel processes ({replicas}) = {per_step} is "
            f"larger than trainer.global_batch_size={t.global_batch_size}: one optimizer step cannot take fewer "
            "examples than one micro-batch per process. Use e.g. "
            + (f"hardware.micro_batch_size={fits[0]}, or " if fits else "")
            + f"trainer.global_batch_size={per_step}"
        ]
    return [
        f"trainer.global_batch_size={t.global_batch_size} is not a multiple of hardware.micro_batch_size "
        f"({hw.micro_batch_size}) x data-parallel processes ({replicas}) = {per_step}: gradient accumulation is "
        f"derived from it; use e.g. trainer.global_batch_size={max(per_step, 1) * 2}"
    ]


def pattern_key_target(key: str, targets: list[str]) -> str | None:
    """The target module a `lora.rank_pattern` / `lora.alpha_pattern` key ends in (a name, or a path or regex ending
    in one, as PEFT matches a key against the end of a module path), or None."""
    return next((t for t in targets if re.search(rf"(^|\.)({re.escape(t)})\$?$", key)), None)


def _lora_problems(cfg: TrainConfig) -> list[str]:
    """The LoRA variants' rules: pattern keys that name a target, and the initialisations PEFT can run on this base."""
    lo, q, hw = cfg.lora, cfg.quantization, cfg.hardware
    p: list[str] = []
    for key_name, pattern in (("rank_pattern", lo.rank_pattern), ("alpha_pattern", lo.alpha_pattern)):
        for key, value in pattern.items():
            if pattern_key_target(key, list(lo.target_modules)) is None:
                p.append(
                    f"lora.{key_name}: the key '{key}' names no module of lora.target_modules={list(lo.target_modules)} "
                    "(PEFT matches a key against the end of a module path, so it must end in a target, e.g. "
                    f"lora.{key_name}={{q_proj:16}} or {{model.layers.0.self_attn.q_proj:16}}); fix the key or add its "
                    "module to lora.target_modules"
                )
            if not value > 0:
                p.append(f"lora.{key_name}: '{key}': {value} must be a positive integer, e.g. {{{key}: 16}}")
    if lo.plus_lr_ratio is not None and not lo.plus_lr_ratio > 0:
        p.append(
            f"lora.plus_lr_ratio={lo.plus_lr_ratio}: B's learning rate as a multiple of A's, a positive number (the "
            "LoRA+ paper suggests 16), or null for one learning rate"
        )
    if lo.pissa_niter is not None and (lo.init != LoraInit.pissa or lo.pissa_niter < 1):
        p.append(
            f"lora.pissa_niter={lo.pissa_niter} with lora.init={lo.init.value}: the subspace iterations of PiSSA's "
            "randomized SVD, a positive integer with lora.init=pissa (e.g. lora.pissa_niter=16), or null"
        )
    init = lo.init.value
    if lo.init in (LoraInit.eva, LoraInit.corda):
        p.append(
            f"lora.init={init}: a data-driven initialisation (PEFT computes it from the base's activations on training "
            "batches before training, initialize_lora_eva_weights / preprocess_corda), which exp's model build, done "
            "before any data is loaded, does not run. Fix: lora.init=pissa (the data-free SVD initialisation closest "
            "to it) or lora.init=default"
        )
    if lo.init in RESIDUAL_INITS:
        if q.quant_type == QuantType.int8:
            p.append(
                f"lora.init={init} with quantization=int8: the base becomes the residual W - BA, which exp re-quantizes "
                "for a 4-bit base only. Fix: quantization=nf4, or lora.init=default"
            )
        if (traits := _resolved_traits(hw)) is not None and traits.sharded:
            p.append(
                f"lora.init={init} with hardware.strategy={hw.strategy.value}: the residual base is computed layer by "
                "layer in one process before sharding. Fix: hardware=ddp or one GPU, or lora.init=default"
            )
        if lo.use_dora:
            p.append(
                f"lora.init={init} with lora.use_dora=true: the saved adapter is converted into a plain LoRA on the "
                "original base (ΔW = BA - B0A0), and DoRA's magnitude vector has no such form. Fix: one of the two"
            )
        if lo.use_rslora and (lo.rank_pattern or lo.alpha_pattern):
            p.append(
                f"lora.init={init} with lora.use_rslora=true and a rank/alpha pattern: PEFT cannot convert that "
                "adapter into a plain LoRA on the original base. Fix: drop lora.use_rslora or the patterns"
            )
    if lo.init == LoraInit.loftq:
        if q.quant_type != QuantType.nf4:
            p.append(
                f"lora.init=loftq with quantization={q.quant_type.value}: LoftQ fits the adapter to the NF4 quantization "
                "error of each weight (PEFT's replace_lora_weights_loftq). Fix: quantization=nf4, or lora.init=default"
            )
        if hw.accelerator == Accelerator.cpu:
            p.append(
                "lora.init=loftq on the CPU: PEFT's LoftQ for a bitsandbytes 4-bit base (replace_lora_weights_loftq) "
                "runs its SVD on CUDA only. Fix: run on a GPU (hardware=gpu), or lora.init=pissa (an SVD "
                "initialisation that runs on the CPU)"
            )
    return p


def objective_problems(cfg: TrainConfig) -> list[str]:
    """An objective and its data must agree: preference objectives read pairs (KTO: labelled completions), SFT
    reads examples."""
    o, d, p = cfg.objective, cfg.data, []
    paired = (DataFormat.preference, DataFormat.synthetic)
    if o.kind == Objective.kto and d.format not in (DataFormat.kto, DataFormat.synthetic):
        p.append(
            f"objective=kto with data.format={d.format.value}: KTO reads unpaired labelled completions; use "
            "data.format=kto ({prompt, completion, label}) or the synthetic default"
        )
    elif o.preference and o.kind != Objective.kto and d.format not in paired:
        p.append(
            f"objective={o.kind.value} with data.format={d.format.value}: {o.kind.value} reads preference pairs; use "
            "data.format=preference ({prompt, chosen, rejected}) or the synthetic default"
        )
    elif not o.preference and d.format in (DataFormat.preference, DataFormat.kto):
        p.append(
            f"data.format={d.format.value} is preference data: pick a preference objective, e.g. objective=dpo "
            "(objective=kto for data.format=kto)"
        )
    if o.preference:
        if o.beta <= 0:
            p.append(f"objective.beta={o.beta}: must be > 0, e.g. objective.beta=0.1")
        if not 0 <= o.label_smoothing < 0.5:
            p.append(f"objective.label_smoothing={o.label_smoothing}: a flip rate in [0, 0.5), e.g. 0.1")
        elif o.label_smoothing and (
            o.kind in (Objective.orpo, Objective.kto) or (o.kind == Objective.dpo and o.dpo_loss != DpoLoss.robust)
        ):
            p.append(
                f"objective.label_smoothing={o.label_smoothing} with objective={o.kind.value}"
                + (f" objective.dpo_loss={o.dpo_loss.value}" if o.kind == Objective.dpo else "")
                + ": only DPO's robust loss and SimPO model flipped labels; use objective.dpo_loss=robust or "
                "objective.label_smoothing=0"
            )
        if d.packing:
            p.append(
                f"data.packing=true with objective={o.kind.value}: a preference batch keeps each completion in its own "
                "row beside its pair; set data.packing=false"
            )
    if o.reference == Reference.start and not cfg.model.adapter:
        p.append(
            "objective.reference=start without model.adapter: the model at step 0 is the base itself here; set "
            "model.adapter=<run dir> (the adapter to start from) or objective.reference=base"
        )
    if o.precompute_reference and o.kind != Objective.dpo:
        why = (
            "its reference point pairs each prompt with the next example's completion in the batch, which changes "
            "with every batch's order"
            if o.kind == Objective.kto
            else "it has no reference pass"
        )
        p.append(
            f"objective.precompute_reference=true with objective={o.kind.value}: {why}; set "
            "objective.precompute_reference=false"
        )
    return p


def schema_node() -> TrainConfig:
    """The node conf/ composes onto: the defaults, with no tracker on. The trackers are chosen in the defaults list
    (conf/train.yaml's `logger: wandb`): each option of the logger group switches its own on, so that several
    options (`logger=[wandb,tensorboard]`) add up and one (`logger=tensorboard`) is that one alone."""
    node = TrainConfig()
    node.logger.wandb = False
    return node


def register_configs() -> None:
    """Register the root schema; the YAML files under conf/ are validated against it at composition."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=schema_node())


__all__ = [
    "Accelerator",
    "BadRows",
    "LengthGrouping",
    "ConfigError",
    "DataConfig",
    "DataFormat",
    "HardwareConfig",
    "LoggerConfig",
    "LoggerKind",
    "LoraConfig",
    "LossImpl",
    "Objective",
    "ObjectiveConfig",
    "ModelConfig",
    "ModelFamily",
    "Optimizer",
    "COMPILE_CHOICES",
    "PRECISIONS",
    "QuantType",
    "MixtureSource",
    "QuantizationConfig",
    "Reference",
    "Schedule",
    "Strategy",
    "TrainConfig",
    "TrainerConfig",
    "WandbMode",
    "register_configs",
    "schema_node",
]


def resolve_paths(cfg: TrainConfig, launch_dir: Path) -> TrainConfig:
    """Make relative data and model paths absolute against the directory the user launched from; a model.path
    that holds no checkpoint is refused here, before anything is loaded."""
    for holder in (cfg.data, cfg.model):
        if holder.path and not Path(holder.path).expanduser().is_absolute():
            holder.path = str((launch_dir / holder.path).resolve())
    for holder in (cfg.data, *cfg.data.mixture):
        for key in ("path", "val_path") if holder is not cfg.data else ("val_path",):
            value = getattr(holder, key)
            if value and not Path(value).expanduser().is_absolute():
                setattr(holder, key, str((launch_dir / value).resolve()))
    uri = cfg.logger.tracking_uri
    if uri and ":" not in uri and not Path(uri).expanduser().is_absolute():  # a directory, not a URI
        cfg.logger.tracking_uri = str((launch_dir / uri).resolve())
    if cfg.model.path and (problem := model_path_problem(cfg.model.path)):
        raise ConfigError(problem)
    return cfg


def model_path_problem(path: str) -> str | None:
    """Why `model.path` cannot be loaded by `from_pretrained`, or None."""
    where = Path(path).expanduser()
    if (where / "config.json").is_file():
        return None
    found = "" if where.is_dir() else ": the path does not exist" if not where.exists() else ": it is a file"
    return (
        f"model.path={path}: no config.json there{found}. Point model.path at a directory written by save_pretrained "
        "(config.json and the weights), or drop model.path to use model.hub_id."
    )


def schema_fields(cls: type) -> dict[str, Any]:
    """A dataclass's fields with their resolved types."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def config_key(name: str) -> str | None:
    """The config key a flag-style name most likely means: a group or top-level key as it is (`model`), a field by
    its name when one group has it (`max_steps` -> `trainer.max_steps`); None when none or several match."""
    top = schema_fields(TrainConfig)
    if name in top:
        return name
    matches = [
        f"{group}.{name}" for group, cls in top.items() if dataclasses.is_dataclass(cls) and name in schema_fields(cls)
    ]
    return matches[0] if len(matches) == 1 else None
