"""`python -m exp.bench`: exp's training step against the hand-written QLoRA loop, on the same tokens.

    python -m exp.bench                                   # the headline: Gemma-7B shape, seq 2048 x 8, baseline vs exp
    python -m exp.bench ablate=true                       # + exp without each of its levers, the baseline with one
    python -m exp.bench model=gemma_tiny seq=64 micro_batch=2 steps=6 warmup=2      # CPU smoke test
    python -m exp.bench variant=exp micro_batch=8,16,32                             # capacity

Each variant runs in a fresh process (a monkey-patching lever or a compiled graph cannot leak into the next one,
and every process's peak memory is its own) on the same model shape, LoRA settings, optimiser and token batches:
step i is `bench_baseline.token_batch(i, seed, ...)`, labels = inputs, for both sides. The model (random weights
in the published architecture, `model.random_init=true`) is built once into exp's cache by the first variant.

* `baseline` is exp.bench.baseline_loop: the plain transformers + PEFT + bitsandbytes loop a user
  writes by hand; `baseline prepare=false` etc. switch its levers.
* `exp` is `python -m exp.train`'s code: the config composed from conf/ (hardware=gpu on a GPU, cpu otherwise) plus
  the bench's settings, checked by exp's preflight, `QLoRAModule` (model built by `exp.model.build.build_model` in
  `configure_model`, its `training_step`, `configure_optimizers`) driven by the Trainer of `exp.training.trainer.build_trainer`
  with a CSV logger, fed these batches instead of a data module. `exp hardware.loss_impl=hf` etc. add overrides.

Writes <out_dir>/bench-<model>-<seq>x<micro-batch>-<time>.json and .md (after every variant, so an interrupted
run keeps what it measured). Exit status 1 when a variant failed (out of memory is a result, not a failure) or an exp
variant's losses left the baseline's by more than parity_tol.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from exp.core.cli import USAGE_EXIT, Key, Tool, dotted, parse
from exp.core.config import Accelerator, ConfigError
from exp.bench.baseline_loop import ALL_PROJECTIONS

ROOT = Path(__file__).resolve().parents[3]
# Dense bf16 matmul throughput an H200 reaches (8192^3 products through PyTorch, measured at 769-798 TFLOP/s):
# MFU's denominator. Pass peak_tflops= for another GPU.
H200_BF16_TFLOPS = 790.0
PARITY_STEPS = 30  # the first steps whose losses are compared with the baseline's
PROFILED_STEPS = 2  # profile=true: the first timed steps profiled
# Settings the bench owns for both sides (its own keys): an override of them would change only the exp side.
# Exceptions (EXP_CHOOSES) are how exp computes, not what: the attention kernel gives the same scores.
EXP_CHOOSES = ("model.attn_implementation",)
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

    def exp_overrides(self) -> list[str]:
        """The settings as exp config overrides, with the baseline's optimiser (torch AdamW defaults, no clipping)."""
        if self.data_path:
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


def check_overrides(overrides: list[str]) -> None:
    """Refuse exp overrides of what the bench sets for both sides (they would change one side only)."""
    for option in overrides:
        key = option.lstrip("+~").partition("=")[0]
        if key not in EXP_CHOOSES and any(key == owned or key.startswith(owned + ".") for owned in BENCH_OWNED):
            raise ValueError(
                f"{option!r}: {key} is set by exp.bench for both sides (use its keys: model=, seq=, micro_batch=, "
                "steps=, lora_*=, lr=); as an exp override it would change one side only"
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
            # torch, transformers and Lightning load in the process that measures, not for --help or a bad argument
            from exp.bench.baseline_loop import BaselineOptions

            BaselineOptions.parse(options)  # raises on a bad option, before anything runs
        else:
            check_overrides(options)
        return cls(" ".join([side, *options]), side, options)

    @property
    def is_reference(self) -> bool:
        return self.side == "baseline" and not self.options


# ----------------------------------------------------------------------------------------------------------------
# FLOPs and MFU


def model_flops_per_token(arch: dict[str, Any], seq: int) -> dict[str, Any]:
    """Model FLOPs of one trained token of a LoRA run on a frozen base: 4 N + attention.

    Forward 2 N (a multiply-add per weight), backward 2 N for the gradients of the activations; the frozen weights
    get no weight gradient (the 2 N of full fine-tuning's 6 N), and the adapters' own FLOPs (rank r) are left out.
    N counts every weight a token's matmuls touch: the decoder projections and the head; Gemma ties the head to the
    embedding, whose lookup costs nothing, so the table is counted once. Attention adds, per layer, QK^T and AV over
    on average seq/2 keys (causal): forward 2 x 2 x d x seq/2 = 2 d seq with d = heads x head_dim, backward twice
    that: 6 d seq per layer. Recomputation (gradient checkpointing) is not counted: these are *model* FLOPs, so
    MFU does not reward recomputing. Gemma-7B shape at seq 2048: 34.15 G + 1.41 G = 35.6 GFLOP per token.
    """
    hidden, inter, layers = arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"]
    heads = arch["num_attention_heads"]
    kv_heads = arch.get("num_key_value_heads", heads)
    head_dim = arch.get("head_dim", 256)
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter
    n = layers * per_layer + arch["vocab_size"] * hidden
    attention = 6 * layers * q * seq
    return {"n_params": n, "linear": 4 * n, "attention": attention, "per_token": 4 * n + attention}


# ----------------------------------------------------------------------------------------------------------------
# Workers (one process per variant)


def _checkpoint_and_vocab(settings: Settings) -> tuple[str, int, float]:
    """The model's checkpoint dir (built into exp's cache on first use) and its vocabulary size."""
    from transformers import AutoConfig

    # torch, transformers and Lightning load in the process that measures, not for --help or a bad argument
    from exp.model.build import resolve_checkpoint
    from exp.run.compose import compose_config

    started = time.perf_counter()
    cfg = compose_config(settings.exp_overrides(), ROOT)
    path = resolve_checkpoint(cfg.model)
    return path, AutoConfig.from_pretrained(path).vocab_size, time.perf_counter() - started


def real_data(settings: Settings):
    """exp's data module for real-data mode: the tokenised examples and the split both sides use."""
    # torch, transformers and Lightning load in the process that measures, not for --help or a bad argument
    from exp.data.datamodule import build_datamodule
    from exp.model.build import build_tokenizer
    from exp.run.compose import compose_config

    cfg = compose_config(settings.exp_overrides(), ROOT)
    tokenizer = build_tokenizer(cfg.model)
    return cfg, tokenizer, build_datamodule(cfg.data, tokenizer, settings.micro_batch)


def baseline_real_batches(settings: Settings):
    """The hand-written loop's natural batching of real data: each step `micro_batch` examples in exp's seeded
    epoch order (without length grouping), padded to the longest; the validation split in padded batches of 4."""
    # torch, transformers and Lightning load in the process that measures, not for --help or a bad argument
    from exp.data.datamodule import collate, shuffled_batches

    cfg, tokenizer, dm = real_data(settings)
    pad = tokenizer.pad_token_id
    per_epoch = len(shuffled_batches(len(dm.train_set), settings.micro_batch, cfg.data.seed, 0))

    def batch(i: int) -> dict[str, Any]:
        epoch, k = divmod(settings.first_step + i, per_epoch)
        indices = shuffled_batches(len(dm.train_set), settings.micro_batch, cfg.data.seed, epoch)[k]
        return collate([dm.train_set[j] for j in indices], pad)

    val = [collate(dm.val_set[k : k + 4], pad) for k in range(0, len(dm.val_set), 4)]
    return batch, val


def run_baseline_worker(settings: Settings, variant: Variant) -> dict[str, Any]:
    # torch, transformers and Lightning load in the process that measures, not for --help or a bad argument
    from exp.bench.baseline_loop import BaselineOptions, run_baseline

    checkpoint, _, build_s = _checkpoint_and_vocab(settings)
    batches, val = baseline_real_batches(settings) if settings.data_path else (None, None)
    out = run_baseline(
        checkpoint,
        seq=settings.seq,
        micro_batch=settings.micro_batch,
        steps=settings.steps,
        warmup=settings.warmup,
        lora_r=settings.lora_r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        lora_targets=settings.lora_targets,
        lr=settings.lr,
        seed=settings.seed,
        device=settings.device,
        options=BaselineOptions.parse(variant.options),
        batches=batches,
        val_batches=val,
    )
    return {"build_s": round(build_s, 2), **out}


def run_exp_worker(settings: Settings, variant: Variant, work_dir: Path) -> dict[str, Any]:
    """exp's own step: QLoRAModule under exp's Trainer, as `exp.train.train` builds them, fed the bench's batches."""
    import lightning as L
    from torch.utils.data import DataLoader

    # torch, transformers and Lightning load in the process that measures, not for --help or a bad argument
    from exp.hardware.memory import estimate_for_config
    from exp.hardware.preflight import check, format_findings, probe_environment
    from exp.model.build import decoder_layers, quiet_third_party_logs
    from exp.run.compose import compose_config, config_dict
    from exp.run.tracking import build_loggers
    from exp.bench.baseline_loop import token_batch
    from exp.training.module import QLoRAModule
    from exp.training.trainer import build_trainer

    quiet_third_party_logs()
    checkpoint, vocab, build_s = _checkpoint_and_vocab(settings)
    cfg = compose_config(settings.exp_overrides() + variant.options, ROOT)
    on_gpu = cfg.hardware.accelerator != Accelerator.cpu
    # exp's preflight decides what `python -m exp.train` would: precision, compile, and the checkpointed layers
    # from the memory it may use (hardware.memory_budget_gib, or the free memory). Its memory check's refusal is
    # not applied: running out of memory is a result here (capacity runs), reported as "oom".
    result = check(cfg, probe_environment(check_bitsandbytes=False, need_gpus=on_gpu))
    refused = [f for f in result.findings if f.key != "memory"]
    if refused:
        raise RuntimeError(format_findings(result))
    cfg = result.cfg
    cuda = settings.device == "cuda"
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    datamodule = None
    if settings.data_path:
        # torch, transformers and Lightning load in the process that measures, not for --help or a bad argument
        from exp.data.datamodule import build_run_datamodule
        from exp.model.build import build_tokenizer

        datamodule = build_run_datamodule(cfg, build_tokenizer(cfg.model), num_workers=0)
        L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)  # as exp.train: data, then the seed
    else:
        tokens = [
            token_batch(i, settings.seed, settings.micro_batch, settings.seq, vocab) for i in range(settings.steps)
        ]
        # labels = inputs, as the baseline; each step's rows in exp's micro-batches (every row is full length, so
        # the mean of the micro-batch means is the step's mean).
        m = cfg.hardware.micro_batch_size
        batches = [{"input_ids": x[k : k + m], "labels": x[k : k + m]} for x in tokens for k in range(0, len(x), m)]
    # Padding-free batching decides the micro-batches per step from the data.
    accumulate = (datamodule.flat_accumulation if datamodule is not None else None) or cfg.accumulate_grad_batches
    if datamodule is not None and settings.first_step:
        datamodule.resume_at(settings.first_step * accumulate)  # the baseline's steps from first_step on
    clock = step_clock(settings.warmup, cuda, accumulate, profile=settings.profile)

    module = QLoRAModule(cfg)
    loggers = build_loggers(cfg.logger, work_dir, "bench", config_dict(cfg))
    trainer = build_trainer(cfg, work_dir, loggers, resuming=datamodule is None, accumulate=accumulate)
    trainer.callbacks.append(clock)
    started = time.perf_counter()
    if datamodule is not None:
        trainer.fit(module, datamodule=datamodule)
    else:
        trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    fit_s = time.perf_counter() - started
    val_loss = None
    if datamodule is not None:
        trainer.validate(module, datamodule=datamodule, verbose=False)
        val_loss = module.last_val["val/loss"]
    optimizer = trainer.optimizers[0]
    hw = cfg.hardware
    layers = len(decoder_layers(module.model))
    return {
        "real_tokens": clock.real_tokens,
        "val_loss": val_loss,
        "micro_batch_exp": hw.micro_batch_size,
        "accumulate": accumulate,
        # Padding-free steps hold exactly the baseline's examples (its seeded order): per-step losses compare.
        "same_steps": datamodule is not None and datamodule.flat is not None,
        "micro_batch_tokens": datamodule.flat.token_budget if datamodule is not None and datamodule.flat else None,
        "padding_fraction": datamodule.stats["train"]["padding_fraction"] if datamodule is not None else None,
        "attn_implementation": cfg.model.attn_implementation,
        "compile_stats": module.throughput_summary()["compile"],
        "preflight_notes": result.notes,
        "memory_finding": next((f.message for f in result.findings if f.key == "memory"), None),
        "estimated_gib": round(estimate_for_config(cfg).allocated / 2**30, 2),
        "checkpoint_layers": (hw.checkpoint_layers if hw.checkpoint_layers is not None else layers)
        if hw.gradient_checkpointing
        else 0,
        "layers": layers,
        "memory_budget_gib": hw.memory_budget_gib,
        "build_s": round(build_s, 2),
        "fit_s": round(fit_s, 2),
        "step_s": clock.step_s,
        "losses": [float(v) for v in clock.losses],
        "peak_memory_bytes": clock.peak,
        "lora_fingerprint": clock.fingerprint,
        "lora_b_norm": clock.b_norm,
        "profile": clock.profile,
        "dequantized_layers": hw.dequantized_layers,
        "offload_checkpoints": hw.offload_checkpoints,
        "trainable_params": sum(p.numel() for p in module.model.parameters() if p.requires_grad),
        "loss_impl": module.loss_choice.impl.value,
        "loss_impl_reason": module.loss_choice.reason,
        "gradient_checkpointing": hw.gradient_checkpointing,
        "compile": hw.compile,
        "fused_adamw": bool(optimizer.defaults.get("fused")),
        "precision": f"Lightning {hw.precision}",
        "checkpoint": checkpoint,
    }


# Kernel (or, on the CPU, operator) names by what they do, first match wins: the profile's summary.
PROFILE_CATEGORIES = (
    ("dequantize 4-bit", re.compile(r"dequant", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|_efficient_attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm\d+_|::mm|::addmm|::bmm|::linear|matmul", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
    ("fused loss (liger / chunked)", re.compile(r"liger|cross_entropy|element_mul|log_softmax", re.I)),
    ("compiled (Triton)", re.compile(r"^triton_|triton", re.I)),
    ("copy / cast / fill", re.compile(r"copy|cast|memcpy|memset|fill|to_copy|cat|clone", re.I)),
)


def profile_summary(
    events: list[tuple[str, float, int]],
    steps: int,
    top: int = 25,
    wall_s: list[float] | None = None,
) -> dict[str, Any]:
    """Where the time of `steps` profiled steps went: per category and the `top` names, in ms per step.
    `events`: (name, self time in microseconds, calls) per kernel (CUDA) or operator (CPU). `wall_s`: the steps'
    wall-clock times; the device is idle for the part of them its kernels do not fill."""
    by_name: dict[str, list[float]] = {}
    for name, us, calls in events:
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += calls
    total = sum(v[0] for v in by_name.values()) or 1.0
    categories: dict[str, float] = {}
    for name, (us, _) in by_name.items():
        cat = next((c for c, rx in PROFILE_CATEGORIES if rx.search(name)), "other")
        categories[cat] = categories.get(cat, 0.0) + us
    ms = lambda us: round(us / 1000 / steps, 3)  # noqa: E731
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    wall_ms = round(sum(wall_s) * 1000 / len(wall_s), 3) if wall_s else None
    return {
        "steps": steps,
        "total_ms_per_step": ms(total),
        "wall_ms_per_step": wall_ms,
        "categories": {
            c: {"ms_per_step": ms(us), "share": round(us / total, 4)}
            for c, us in sorted(categories.items(), key=lambda kv: -kv[1])
        },  # fmt: skip
        "top": [
            {
                "name": n[:160],
                "ms_per_step": ms(us),
                "calls_per_step": round(k / steps, 1),
                "share": round(us / total, 4),
            }
            for n, (us, k) in ranked
        ],  # fmt: skip
    }


def step_clock(warmup: int, cuda: bool, accumulate: int = 1, profile: bool = False):
    """A Lightning callback timing each optimiser step between device synchronisations, as the baseline does.

    An optimiser step of `accumulate` micro-batches is timed from the start of its first to the end of its last;
    its real (non-padding) input tokens are counted on the host (QLoRAModule counts them before the transfer) and
    its loss is the mean of its micro-batches' losses. With `profile`, the first two timed steps run under
    torch.profiler (their times are kept, but the profiler slows them: profile in a separate run from timing).

    Started before the module's own `on_train_batch_start` and stopped after the optimiser step (and Lightning's
    progress bar / logging of that step), so exp's per-step bookkeeping is inside the measured time. It keeps the
    losses as tensors (read once, after training), the LoRA fingerprint at the start of training, the LoRA B norm at
    the end, and the peak memory at the end of the last step (before Lightning's end-of-training checkpoint).
    """
    import lightning as L
    import torch

    # torch, transformers and Lightning load in the process that measures, not for --help or a bad argument
    from exp.bench.baseline_loop import lora_b_norm, lora_fingerprint

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.losses: list[torch.Tensor] = []
            self.fingerprint: str | None = None
            self.b_norm: float | None = None
            self.peak: int | None = None  # max_memory_allocated at the end of the last step (CUDA)
            self.real_tokens: list[int] = []
            self._t0 = 0.0
            self._tokens = 0
            self._step_losses: list[torch.Tensor] = []
            self.profile: dict[str, Any] | None = None
            self._profiler = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.fingerprint = lora_fingerprint(pl_module.model)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._tokens += pl_module._batch_tokens
            if batch_idx % accumulate:
                return  # mid-step
            if batch_idx == warmup * accumulate and cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            if profile and batch_idx == warmup * accumulate:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as torch_profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                self._profiler = torch_profile(activities=activities)
                self._profiler.__enter__()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            # Lightning divides the returned loss by `accumulate`; the micro-batch's own loss is logged unscaled.
            self._step_losses.append(outputs["loss"].detach() * accumulate)
            if (batch_idx + 1) % accumulate:
                return
            sync()
            self.step_s.append(time.perf_counter() - self._t0)
            self.losses.append(torch.stack(self._step_losses).mean())
            self.real_tokens.append(self._tokens)
            self._step_losses, self._tokens = [], 0
            if cuda:
                self.peak = torch.cuda.max_memory_allocated()
            if self._profiler is not None and batch_idx + 1 == (warmup + PROFILED_STEPS) * accumulate:
                self._profiler.__exit__(None, None, None)
                kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
                events = [
                    (e.name, e.self_device_time_total if cuda else e.self_cpu_time_total, 1)
                    for e in self._profiler.events()
                    # Ranges the code marks (Optimizer.step: Lightning runs the whole closure inside it) would
                    # count their kernels twice.
                    if e.device_type == kind and not e.is_user_annotation
                ]
                self.profile = profile_summary(events, PROFILED_STEPS, wall_s=self.step_s[-PROFILED_STEPS:])
                self._profiler = None

        def on_train_end(self, trainer, pl_module) -> None:
            self.b_norm = lora_b_norm(pl_module.model)

    return StepClock()


def worker_main(spec_path: Path) -> None:
    """Run the variant a spec file names and write its result file (status ok / oom / failed)."""
    spec = json.loads(spec_path.read_text())
    settings = Settings(**spec["settings"])
    variant = Variant(**spec["variant"])
    result_path = Path(spec["result_path"])
    row: dict[str, Any] = {"status": "failed"}
    try:
        import torch

        try:
            if variant.side == "baseline":
                row.update(run_baseline_worker(settings, variant))
            else:
                row.update(run_exp_worker(settings, variant, Path(spec["work_dir"])))
            row["status"] = "ok"
        except torch.OutOfMemoryError as e:
            row["status"] = "oom"
            row["error"] = str(e).splitlines()[0]
    finally:
        result_path.write_text(json.dumps(row, default=str) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# The parent: run the variants, compare, write the results


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "lightning", "liger-kernel", "triton"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    import torch

    out["cuda"] = torch.version.cuda
    return out


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def run_variant(settings: Settings, variant: Variant, tmp: Path, index: int) -> dict[str, Any]:
    spec = tmp / f"spec-{index}.json"
    result = tmp / f"result-{index}.json"
    work = tmp / f"work-{index}"
    work.mkdir()
    spec.write_text(
        json.dumps(
            {
                "settings": asdict(settings),
                "variant": asdict(variant),
                "result_path": str(result),
                "work_dir": str(work),
            }
        )
    )
    log_path = tmp / f"variant-{index}.log"
    started = time.time()
    with log_path.open("w") as log_file:
        proc = subprocess.run(
            [sys.executable, "-m", "exp.bench", f"worker={spec}"], stdout=log_file, stderr=subprocess.STDOUT
        )
    row: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {"status": "failed"}
    row["wall_s"] = round(time.time() - started, 1)
    if proc.returncode != 0 and row["status"] == "ok":
        row["status"] = "failed"
    if row["status"] == "failed":
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        row["error"] = "\n".join(tail)
        print(f"exp.bench: {variant.name} failed (exit {proc.returncode}); its output ends:", file=sys.stderr)
        print("\n".join("    " + line for line in tail), file=sys.stderr)
    return row


def summarise(row: dict[str, Any], settings: Settings, flops: dict[str, Any], peak_tflops: float | None) -> None:
    """Add tokens/s, peak GiB, MFU and the warm-up's extra time to a worker's row.

    Random tokens: tokens/s from the median timed step (every step has micro-batch x seq tokens). Real data: real
    (non-padding) tokens of the timed steps over their summed time (steps differ in size), and the same over all
    steps, warm-up and compilation included (`all_steps_*`). `warmup_extra_s`: what the untimed first steps took
    beyond as many typical steps (compilation, allocator and kernel warm-up): what a short run pays once.
    """
    steps = row.get("step_s", [])
    timed = steps[settings.warmup :]
    if row["status"] != "ok" or not timed:
        return
    median = statistics.median(timed)
    row["step_s_median"] = round(median, 5)
    row["warmup_extra_s"] = round(sum(steps[: settings.warmup]) - settings.warmup * median, 2)
    real = row.get("real_tokens")
    if settings.data_path and real:
        row["tokens_per_s"] = round(sum(real[settings.warmup :]) / sum(timed), 1)
        row["all_steps_s"] = round(sum(steps), 2)
        row["all_steps_real_tokens"] = sum(real)
        row["all_steps_tokens_per_s"] = round(sum(real) / sum(steps), 1)
    else:
        row["tokens_per_s"] = round(settings.micro_batch * settings.seq / median, 1)
    peak = row.get("peak_memory_bytes")
    row["peak_memory_gib"] = round(peak / 2**30, 2) if peak is not None else None
    # Real data has no fixed sequence length (attention FLOPs per token vary): no MFU.
    mfu_ok = peak_tflops and not settings.data_path
    row["mfu"] = round(row["tokens_per_s"] * flops["per_token"] / (peak_tflops * 1e12), 6) if mfu_ok else None


def compare(rows: list[dict[str, Any]], parity_steps: int, tol: float, val_tol: float = 0.02) -> None:
    """Each row against the plain baseline of its micro-batch: speed-up, loss parity, identical LoRA init.

    Random tokens: both sides train on the very same batches, so the per-step losses are compared. Real data: exp
    batches the examples its own way (steps hold other examples), so the validation loss after the same examples
    is compared instead (within `val_tol`), and the speed-up is in real tokens per second.
    """
    for row in rows:
        ref = next((r for r in rows if r["is_reference"] and r["micro_batch"] == row["micro_batch"]), None)
        if ref is None or ref is row or ref["status"] != "ok" or row["status"] != "ok":
            continue
        row["speedup"] = round(row["tokens_per_s"] / ref["tokens_per_s"], 3) if ref.get("tokens_per_s") else None
        if row.get("all_steps_s") and ref.get("all_steps_s") and row.get("real_tokens") == ref.get("real_tokens"):
            # the same examples step by step: the whole run's wall-clock, compilation and warm-up included
            row["all_steps_speedup"] = round(ref["all_steps_s"] / row["all_steps_s"], 3)
        if ref.get("parts") and not row.get("same_steps"):
            continue  # a baseline joined from parts has no validation loss of the run, and these steps differ
        if row.get("val_loss") is not None and ref.get("val_loss") is not None:
            diff = abs(row["val_loss"] - ref["val_loss"]) / abs(ref["val_loss"])
            row["parity"] = {
                "val_loss": row["val_loss"],
                "baseline_val_loss": ref["val_loss"],
                "max_rel_loss_diff": diff,
                "ok": diff <= val_tol,
                "same_lora_init": row.get("lora_fingerprint") == ref.get("lora_fingerprint"),
            }
            if row.get("same_steps"):  # padding-free: the steps hold the baseline's examples
                k = min(parity_steps, len(ref["losses"]), len(row["losses"]))
                steps = [abs(a - b) / abs(b) for a, b in zip(row["losses"][:k], ref["losses"][:k], strict=True)]
                row["parity"]["steps"] = k
                row["parity"]["max_rel_step_loss_diff"] = max(steps) if steps else None
                row["parity"]["ok"] = row["parity"]["ok"] and bool(steps) and max(steps) <= tol
            continue
        k = min(parity_steps, len(ref["losses"]), len(row["losses"]))
        diffs = [abs(a - b) / abs(b) for a, b in zip(row["losses"][:k], ref["losses"][:k], strict=True)]
        row["parity"] = {
            "steps": k,
            "max_rel_loss_diff": max(diffs) if diffs else None,
            "ok": bool(diffs) and max(diffs) <= tol,
            "same_lora_init": row.get("lora_fingerprint") == ref.get("lora_fingerprint"),
        }


def checkpoint_cell(row: dict[str, Any]) -> str:
    """How many decoder layers recompute in the backward: `none`, `14/28`, `28/28` (`full` for the baseline)."""
    if "checkpoint_layers" in row:
        return f"{row['checkpoint_layers']}/{row['layers']}" if row["checkpoint_layers"] else "none"
    if "gradient_checkpointing" in row:
        return "full" if row["gradient_checkpointing"] else "none"
    return "-"


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        f"# exp.bench: {s['model']}, seq {s['seq']}, LoRA r={s['lora_r']} alpha={s['lora_alpha']} "
        f"dropout={s['lora_dropout']} on {', '.join(s['lora_targets'])}",
        "",
        f"Device: {report['device']}. Date: {report['date']}. Command: `{report['command']}`",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v) + ".",
        f"git: {report['git'].get('commit')}{' (dirty)' if report['git'].get('dirty') else ''}.",
        "",
        *(
            [
                f"Real data: `{s['data_path']}`, {s['micro_batch']} examples per step, data.max_seq_len {s['seq']}; "
                f"{s['steps']} steps per variant, the first {s['warmup']} untimed; tokens/s = real (non-padding) "
                "tokens of the timed steps / their time; peak = `max_memory_allocated` after warm-up (CUDA). Loss diff "
                "= |validation loss - baseline's| / baseline's after the same steps (tolerance 2%). The baseline pads "
                "each step's examples to the longest; exp batches them with its defaults (micro-batch x accumulation "
                "in the micro-batch column).",
            ]
            if s.get("data_path")
            else [
                f"{s['steps']} steps per variant, the first {s['warmup']} untimed; tokens/s = micro-batch x seq / "
                "median timed step; peak = `max_memory_allocated` after warm-up (CUDA); MFU = tokens/s x "
                f"{report['flops']['per_token'] / 1e9:.4g} GFLOP/token (4N + attention) / "
                + (f"{report['peak_tflops']:g} TFLOP/s. " if report["peak_tflops"] else "the GPU's peak (none here). ")
                + f"Loss diff = max over the first {report['parity_steps']} steps of |loss - baseline| / baseline "
                f"(tolerance {report['parity_tol']:.0%}).",
            ]
        ),
        "Ckpt: decoder layers recomputed in the backward (exp: as its preflight chose"
        + (f", within hardware.memory_budget_gib={s['memory_budget']}" if s.get("memory_budget") else "")
        + "). Warm-up extra: the untimed first steps' time beyond as many median steps (compilation included).",
        "",
        "| variant | micro-batch | loss | ckpt | compile | tokens/s | vs baseline | MFU | peak GiB | warm-up extra s "
        "| loss diff | same LoRA init | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(v: Any, spec: str = "") -> str:
        return "-" if v is None else format(v, spec)

    for r in report["rows"]:
        parity = r.get("parity") or {}
        diff = parity.get("max_rel_loss_diff")
        micro = (
            r["micro_batch"]
            if r.get("micro_batch_exp") in (None, r["micro_batch"])
            else (f"{r['micro_batch']} ({r['micro_batch_exp']} x {r.get('accumulate')})")
        )
        lines.append(
            f"| {r['variant']} | {micro} | {r.get('loss_impl', '-')} | {checkpoint_cell(r)} "
            f"| {'-' if 'compile' not in r else 'yes' if r['compile'] else 'no'} "
            f"| {fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('speedup'), '.2f')}{'x' if r.get('speedup') else ''} "
            f"| {fmt(r.get('mfu'), '.1%')} | {fmt(r.get('peak_memory_gib'))} | {fmt(r.get('warmup_extra_s'))} "
            f"| {'-' if diff is None else f'{diff:.2e}'} | {'-' if not parity else 'yes' if parity['same_lora_init'] else 'NO'} "
            f"| {r['status']} |"
        )
    lines += [f"\n{r['variant']} (micro-batch {r['micro_batch']}): reused from {r['reference_from']}"
              for r in report["rows"] if r.get("reference_from")]  # fmt: skip
    if s.get("data_path"):
        lines += [
            "",
            "| variant | all steps s | vs baseline, all steps | real tokens | real tokens/s, all steps "
            "| validation loss |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['variant']} | {fmt(r.get('all_steps_s'))} "
            f"| {fmt(r.get('all_steps_speedup'), '.2f')}{'x' if r.get('all_steps_speedup') else ''} "
            f"| {fmt(r.get('all_steps_real_tokens'), ',')} "
            f"| {fmt(r.get('all_steps_tokens_per_s'), ',.0f')} | {fmt(r.get('val_loss'), '.4f')} |"
            for r in report["rows"]
        ]
        lines += [
            f"\n{r['variant']}: {r['parts']} parts of one run joined end to end (each from fresh adapters: the "
            "per-step losses are the first part's, the validation loss is none of theirs; the loss diff above is "
            f"the largest per-step difference over the first {report['parity_steps']} steps)"
            for r in report["rows"]
            if r.get("parts")
        ]
    for r in report["rows"]:
        prof = r.get("profile")
        if not prof:
            continue
        wall = prof.get("wall_ms_per_step")
        busy = (
            f" within {wall:,.1f} ms of wall-clock ({1 - prof['total_ms_per_step'] / wall:.0%} idle)"
            if wall and prof["total_ms_per_step"] <= wall
            else ""
        )
        lines += [
            "",
            f"Profile of {r['variant']} (micro-batch {r['micro_batch']}): {prof['total_ms_per_step']:,.1f} ms of "
            f"device time per step{busy} (the mean of {prof['steps']} profiled steps; the profiler's own cost "
            "included)",
            "",
            "| kind | ms per step | share |",
            "|---|---|---|",
            *(f"| {c} | {v['ms_per_step']:,.1f} | {v['share']:.1%} |" for c, v in prof["categories"].items()),
            "",
            "| kernel | ms per step | calls per step | share |",
            "|---|---|---|---|",
            *(
                f"| `{t['name'][:90]}` | {t['ms_per_step']:,.2f} | {t['calls_per_step']:g} | {t['share']:.1%} |"
                for t in prof["top"][:15]
            ),  # fmt: skip
        ]
    lines += ["", "Per-step losses:", "", "| step | " + " | ".join(r["variant"] for r in report["rows"]) + " |"]
    lines.append("|---" * (len(report["rows"]) + 1) + "|")
    n = max((len(r.get("losses", [])) for r in report["rows"]), default=0)
    for i in range(n):
        cells = [f"{r['losses'][i]:.5f}" if i < len(r.get("losses", [])) else "-" for r in report["rows"]]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def reference_rows(
    paths: list[Path], settings: Settings, micro_batches: list[int], flops: dict[str, Any], peak_tflops: float | None
) -> list[dict[str, Any]]:
    """The plain baseline's rows of earlier results, if they were measured with these settings (for split runs).

    Several files are parts of one real-data run (`first_step`): together their steps must be this invocation's
    steps, each part starting where the one before ended; their rows are joined (`join_parts`) and summarised over
    the whole run."""
    # The memory budget and profiling are exp's alone: the baseline ran the same whatever they were.
    exp_only = {"micro_batch": None, "memory_budget": None, "profile": None}
    span = {"first_step": None, "steps": None} if len(paths) > 1 else {}
    mine = {**asdict(settings), **exp_only, **span}
    earlier = []
    for path in paths:
        report = json.loads(path.read_text())
        theirs = {**Settings().__dict__, **report["settings"]}
        compared = {**theirs, **exp_only, **span}
        if mine != compared:
            diff = {k: (compared.get(k), v) for k, v in mine.items() if compared.get(k) != v}
            raise ValueError(f"reference={path}: measured with other settings (theirs, ours): {diff}")
        rows = [
            {**r, "reference_from": str(path)}
            for r in report["rows"]
            if r["is_reference"] and r["micro_batch"] in micro_batches and r["status"] == "ok"
        ]
        missing = sorted(set(micro_batches) - {r["micro_batch"] for r in rows})
        if missing:
            raise ValueError(f"reference={path}: no successful plain-baseline row for micro-batch {missing}")
        earlier.append((theirs["first_step"], theirs["steps"], path, rows))
    if len(earlier) == 1:
        return earlier[0][3]
    earlier.sort(key=lambda e: e[0])
    at = settings.first_step
    for first, steps, path, _ in earlier:
        if first != at:
            raise ValueError(
                f"reference={path}: starts at step {first}, where the parts before it end at step {at}: the parts "
                f"must follow each other from first_step={settings.first_step}"
            )
        at += steps
    if at != settings.first_step + settings.steps:
        raise ValueError(
            f"reference: the parts cover steps {settings.first_step}-{at - 1}, this invocation's steps are "
            f"{settings.first_step}-{settings.first_step + settings.steps - 1}: give steps={at - settings.first_step} "
            "or the missing parts"
        )
    joined = []
    for mb in micro_batches:
        row = join_parts([next(r for r in e[3] if r["micro_batch"] == mb) for e in earlier])
        summarise(row, Settings(**{**asdict(settings), "micro_batch": mb}), flops, peak_tflops)
        joined.append(row)
    return joined


def join_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One baseline row from the rows of consecutive parts of a run: their steps' times and real tokens end to end
    (what the whole run's wall-clock is made of), the highest peak. Each part started from fresh adapters, so only
    the first part's losses belong to the run (the per-step comparison uses those) and no part's validation loss
    is the run's."""
    fingerprints = {p.get("lora_fingerprint") for p in parts}
    if len(fingerprints) > 1:
        raise ValueError("reference: the parts' LoRA inits differ (another seed or LoRA setting)")
    peaks = [p["peak_memory_bytes"] for p in parts if p.get("peak_memory_bytes") is not None]
    joined = {
        **{k: v for k, v in parts[0].items() if not isinstance(v, (list, dict))},
        "step_s": [t for p in parts for t in p["step_s"]],
        "real_tokens": [n for p in parts for n in p.get("real_tokens") or []] or None,
        "losses": list(parts[0]["losses"]),
        "val_loss": None,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "wall_s": round(sum(p.get("wall_s") or 0 for p in parts), 1),
        "reference_from": ", ".join(p["reference_from"] for p in parts),
        "parts": len(parts),
    }
    for derived in ("step_s_median", "warmup_extra_s", "tokens_per_s", "all_steps_s", "all_steps_real_tokens",
                    "all_steps_tokens_per_s", "peak_memory_gib", "mfu"):  # fmt: skip
        joined.pop(derived, None)  # summarise computes them again over the whole run
    return joined


def bench_tool() -> Tool:
    d = Settings()
    return Tool(
        "exp.bench",
        __doc__,
        (
            Key("model", d.model, "a conf/model option (random weights)"),
            Key("seq", d.seq, "tokens per row (data.max_seq_len in real-data mode)", at_least=1),
            Key(
                "micro_batch",
                [d.micro_batch],
                "rows per step; several (8,16,32) measure capacity",
                kind=int,
                many=True,
                at_least=1,
            ),
            Key("steps", d.steps, "optimiser steps per variant (the loss of each is kept)", at_least=1),
            Key(
                "first_step",
                d.first_step,
                "real-data mode: start at this step of the seeded order (fresh adapters): a long run timed in parts",
                at_least=0,
            ),
            Key("warmup", d.warmup, "untimed first steps", at_least=0),
            Key("lora_r", d.lora_r, "LoRA rank", at_least=1),
            Key("lora_alpha", d.lora_alpha, "LoRA alpha", above=0),
            Key("lora_dropout", d.lora_dropout, "LoRA dropout", at_least=0, at_most=0.99),
            Key("lora_targets", "all", "'all' (the 7 projections) or a comma-separated list of module names"),
            Key("lr", d.lr, "learning rate", above=0),
            Key("seed", d.seed, "token batches (seed + step) and LoRA initialisation", at_least=0),
            Key("device", "auto", "where to run", choices=("auto", "cuda", "cpu")),
            Key(
                "variant",
                [],
                "'baseline [prepare|ckpt|liger|compile=true|false ...]' or 'exp [override ...]' (quoted); repeat the "
                "key for more. Default: baseline and exp",
                many=True,
                split=False,
                placeholder="SPEC",
            ),
            Key("profile", False, "profile two timed steps of each exp variant: device time per kind of kernel"),
            Key("ablate", False, "run the ablation set (+ any variant=): " + "; ".join(ABLATION)),
            Key(
                "parity_steps",
                PARITY_STEPS,
                "the first steps whose losses are compared with the baseline's",
                at_least=0,
            ),
            Key("parity_tol", 0.01, "max relative loss difference from the baseline", above=0),
            Key("peak_tflops", H200_BF16_TFLOPS, "MFU's denominator (GPU only)", above=0),
            Key(
                "reference",
                None,
                "take the plain baseline's rows from this earlier result (same settings) instead of running it again; "
                "several (comma-separated): parts of one real-data run (first_step) whose steps make this one's",
                placeholder="JSON[,JSON...]",
            ),
            Key(
                "memory_budget",
                None,
                "GPU memory exp's preflight may plan for (hardware.memory_budget_gib): GiB, or 'baseline' for the "
                "plain baseline's measured peak (the baseline then runs first)",
                placeholder="GiB|baseline",
            ),
            Key(
                "data",
                None,
                "real-data mode: an Alpaca-format file; micro_batch is the examples per step, seq data.max_seq_len",
                placeholder="FILE",
            ),
            Key("out_dir", str(ROOT / "benchmarks" / "results"), "where the .json and .md results go"),
            Key("worker", None, "internal: run one variant from its spec file", hidden=True),
        ),
        passes=dotted,
        passes_help=("a.b=value", "an exp config override for every exp variant (hardware.loss_impl=chunked, ...)"),
    )


@dataclass
class MemoryFigures:
    """The memory the bench's workers can have; None where it cannot be told."""

    host_available: int | None  # bytes the host can still give (/proc/meminfo's MemAvailable)
    gpu_free: int | None  # bytes free on the GPU the workers train on (device=cuda only)


def memory_figures(device: str) -> MemoryFigures:
    """This machine's `MemoryFigures` for `device`."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        host = int(re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M).group(1)) * 1024
    except (OSError, AttributeError):  # not Linux: nothing to go on
        host = None
    gpu = None
    if device == "cuda":
        # A subprocess initialises CUDA: a context in this process would hold memory the workers need all along.
        from exp.hardware.preflight import probe_environment

        gpus = probe_environment(need_gpus=True).gpus
        gpu = gpus[0].free_bytes if gpus else None
    return MemoryFigures(host, gpu)


def memory_problem(cfg: Any, device: str, figures: MemoryFigures) -> str:
    """Why the model of the composed config `cfg` cannot run on `device` with this memory ('' when it can, or when
    the figures do not say), told before any worker starts: the OOM killer ends a process without a word, and a
    model that cannot fit fails every variant alike.

    The random weights (model.random_init) are drawn in bf16 on the device that builds them, the GPU under CUDA and
    the host otherwise (exp.model.local), and written into exp's cache one shard at a time through host memory; once
    built they are reused. On the CPU the host also holds the model every worker trains; on CUDA the GPU must hold
    the quantized base, the adapters, their gradients and optimiser state before any activation
    (exp.hardware.memory.resident_bytes), whatever micro-batch or checkpointing a variant then chooses.
    """
    # loaded with the measuring code, not for --help
    from exp.hardware.memory import base_param_count, config_arch, resident_bytes
    from exp.model.local import MAX_SHARD_BYTES, random_checkpoint_dir

    model, host, gpu = cfg.model.name, figures.host_available, figures.gpu_free
    weights = 2 * base_param_count(config_arch(cfg))
    built = random_checkpoint_dir(cfg.model.family, dict(cfg.model.arch), cfg.model.seed).is_dir()
    if device == "cpu":
        if host is not None and weights > host:
            return (
                f"model={model}: its random weights alone take {_gib(weights)} GiB (bf16) and this machine has "
                f"{_gib(host)} GiB available, so the operating system would kill the bench. Fix: a smaller model "
                "(model=gemma_tiny), or device=cuda on a GPU."
            )
        return ""
    if not built and gpu is not None and weights > gpu:
        return (
            f"model={model}: its random weights are drawn on the GPU in bf16 (once, into exp's cache) and take "
            f"{_gib(weights)} GiB, and the GPU has {_gib(gpu)} GiB free, so the first variant would run out of memory "
            "before anything is measured. Fix: a smaller model (model=gemma_tiny), or a GPU with that much free memory."
        )
    if not built and host is not None and (shard := min(weights, MAX_SHARD_BYTES)) > host:
        return (
            f"model={model}: writing its random weights into exp's cache takes {_gib(shard)} GiB of host memory (one "
            f"checkpoint shard at a time) and this machine has {_gib(host)} GiB available, so the operating system "
            "would kill the bench. Fix: free host memory, or a smaller model (model=gemma_tiny)."
        )
    if gpu is not None and (resident := resident_bytes(cfg)) > gpu:
        quant = getattr(cfg.quantization.quant_type, "value", cfg.quantization.quant_type)
        return (
            f"model={model}: quantized ({quant}) with its LoRA adapters (lora_r={cfg.lora.r}), their gradients and "
            f"optimiser state and CUDA's own memory, it needs at least {_gib(resident)} GiB on the GPU before any "
            f"activation (exp.hardware.memory), and the GPU has {_gib(gpu)} GiB free, so no variant could take a "
            "step. Fix: a smaller model (model=gemma_tiny), a GPU with more free memory, or smaller adapters "
            "(lora_r=, lora_targets=)."
        )
    return ""


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def parse_args(argv: list[str]) -> SimpleNamespace:
    """The bench's `key=value` arguments, checked; its exp overrides are `.overrides`."""
    parsed = parse(bench_tool(), argv)
    a = SimpleNamespace(**parsed.values, overrides=parsed.passed)
    if a.steps <= a.warmup:
        raise ConfigError(f"steps={a.steps} must be larger than warmup={a.warmup}: no step would be timed")
    if a.memory_budget not in (None, "baseline"):
        try:
            if float(a.memory_budget) <= 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"memory_budget={a.memory_budget}: a positive number of GiB, or 'baseline'") from None
    if a.data:
        a.data = str(Path(a.data).resolve())
        if not Path(a.data).is_file():
            raise ConfigError(f"data={a.data}: no such file")
    elif a.first_step:
        raise ConfigError(
            f"first_step={a.first_step}: only real-data mode has an order of steps to start in; add data=<file> or "
            "drop first_step"
        )
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parse_args(argv)
    except ConfigError as e:
        print(f"exp: error: {e}", file=sys.stderr)
        return USAGE_EXIT
    if a.worker:
        worker_main(Path(a.worker))
        return 0
    import torch

    # torch, transformers and Lightning load in the process that measures, not for --help or a bad argument
    from exp.hardware.memory import config_arch, lora_param_count
    from exp.run.compose import compose_config
    from exp.run.tracking import _git_state

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    targets = ALL_PROJECTIONS if a.lora_targets == "all" else a.lora_targets.split(",")
    texts = list(dict.fromkeys([*(ABLATION if a.ablate else []), *a.variant])) or ["baseline", "exp"]
    try:
        check_overrides(a.overrides)
        variants = [Variant.parse(t) for t in texts]
        for v in variants:
            if v.side == "exp":  # the name keeps the variant's own options; the run gets the common ones too
                v.options = [*a.overrides, *v.options]
        fixed_budget = float(a.memory_budget) if a.memory_budget not in (None, "baseline") else None
        base = Settings(a.model, a.seq, a.micro_batch[0], a.steps, a.warmup, a.lora_r, a.lora_alpha,
                        a.lora_dropout, list(targets), a.lr, a.seed, device, fixed_budget, a.data,
                        a.profile, a.first_step)  # fmt: skip
        cfg = compose_config(base.exp_overrides() + a.overrides, ROOT)  # bad overrides fail here, before any run
        lora_param_count(config_arch(cfg), a.lora_r, targets)  # a target the model lacks, before any worker starts
        if problem := memory_problem(cfg, device, memory_figures(device)):
            raise ConfigError(problem)
    except (ValueError, ConfigError) as e:
        print(f"exp: error: exp.bench: {e}", file=sys.stderr)
        return USAGE_EXIT
    arch = config_arch(cfg)
    flops = model_flops_per_token(arch, a.seq)
    peak_tflops = a.peak_tflops if device == "cuda" else None
    reused: list[dict[str, Any]] = []
    if a.reference:
        try:
            reused = reference_rows([Path(p) for p in a.reference.split(",")], base, a.micro_batch, flops, peak_tflops)
        except ValueError as e:
            print(f"exp: error: exp.bench: {e}", file=sys.stderr)
            return USAGE_EXIT
        variants = [v for v in variants if not v.is_reference]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    mbs = "-".join(map(str, a.micro_batch))
    out = Path(a.out_dir) / f"bench-{a.model}-{a.seq}x{mbs}-{stamp}"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": "python -m exp.bench " + " ".join(shlex.quote(x) for x in argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": device_name(device),
        "versions": versions(),
        "git": _git_state(ROOT),
        "settings": {**asdict(base), "micro_batch": a.micro_batch, "memory_budget": a.memory_budget},
        "arch": arch,
        "flops": {**flops, "formula": model_flops_per_token.__doc__.split("\n\n")[0].strip()},
        "peak_tflops": peak_tflops,
        "parity_steps": a.parity_steps,
        "parity_tol": a.parity_tol,
        "rows": reused,
    }

    def write() -> None:  # after every variant: an interrupted run keeps what it measured
        compare(report["rows"], a.parity_steps, a.parity_tol)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(markdown(report))

    write()
    print(f"exp.bench: {len(variants)} variant(s) x micro-batch {a.micro_batch} on {report['device']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="exp-bench-") as tmp:
        index = 0
        if a.memory_budget == "baseline":  # its peak is the budget of the exp variants: measure it first
            variants.sort(key=lambda v: not v.is_reference)
        for mb in a.micro_batch:
            settings = Settings(**{**asdict(base), "micro_batch": mb})
            for v in variants:
                if a.memory_budget == "baseline" and v.side == "exp":
                    ref = next((r for r in report["rows"] if r["is_reference"] and r["micro_batch"] == mb), None)
                    peak = ref.get("peak_memory_gib") if ref else None
                    if peak is None:  # the CPU measures no peak; a failed baseline has none
                        print(f"exp.bench: no baseline peak for micro-batch {mb}: {v.name} runs without a budget")
                    settings.memory_budget = peak
                row = run_variant(settings, v, Path(tmp), index)
                index += 1
                row = {"variant": v.name, "side": v.side, "micro_batch": mb, "is_reference": v.is_reference, **row}
                summarise(row, settings, flops, peak_tflops)
                report["rows"].append(row)
                write()
                print(
                    f"  {v.name} (micro-batch {mb}): {row['status']}, {row.get('tokens_per_s', '-')} tokens/s, "
                    f"peak {row.get('peak_memory_gib', '-')} GiB, {row['wall_s']} s",
                    flush=True,
                )
    print(markdown(report).split("\nPer-step losses:")[0], flush=True)
    print(f"exp.bench: wrote {out}.json and {out}.md", flush=True)
    failed = [r["variant"] for r in report["rows"] if r["status"] == "failed"]
    off = [r["variant"] for r in report["rows"] if r["side"] == "exp" and not r.get("parity", {}).get("ok", True)]
    if failed or off:
        print(f"exp.bench: failed: {failed}; losses off the baseline: {off}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
