"""The plain baseline of `exp.bench`: the QLoRA loop a user writes by hand with transformers + PEFT + bitsandbytes.

It keeps the choices of the common tutorials and hand-written scripts, so that exp is compared with what people
actually run:

* the checkpoint loaded through `from_pretrained(quantization_config=BitsAndBytesConfig(NF4, double quant,
  compute dtype bf16), dtype=bf16, attn_implementation="sdpa")`, the whole model on one device;
* `peft.prepare_model_for_kbit_training` (which upcasts every non-4-bit weight to fp32, the tied 256k-row
  embedding / head included), then full non-reentrant gradient checkpointing;
* LoRA from `torch.manual_seed(seed)` + `get_peft_model`, `model.train()`;
* `torch.optim.AdamW(lr)` with torch's defaults otherwise (weight decay 0.01, no clipping, no schedule);
* every step: `model(input_ids=x, labels=x).loss` (transformers' loss over the full logits), backward, step,
  `zero_grad(set_to_none=True)`, timed between two device synchronisations, `loss.item()` read every step.

`BaselineOptions` are the levers qlora_baseline.py measured on top of it (its --no-prepare, --no-ckpt, --liger,
--compile); all off is the baseline. On the CPU (the harness's smoke test) the compute dtype is float32, the only
one bitsandbytes' CPU kernels train in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from exp.model.families import GEMMA_DECODER_PROJECTIONS, family_of_model_type

ALL_PROJECTIONS = [p.name for p in GEMMA_DECODER_PROJECTIONS]


def token_batch(step: int, seed: int, micro_batch: int, seq: int, vocab: int) -> torch.Tensor:
    """The token ids of step `step`: the very batches qlora_baseline.py draws, so any implementation can use them."""
    g = torch.Generator().manual_seed(seed + step)
    return torch.randint(0, vocab, (micro_batch, seq), generator=g)


@dataclass
class BaselineOptions:
    prepare: bool = True  # peft.prepare_model_for_kbit_training (false: only enable_input_require_grads)
    ckpt: bool = True  # full gradient checkpointing of every decoder layer
    liger: bool = False  # liger-kernel's patch of the model's family (its fused CE, RMSNorm, GeGLU, RoPE)
    compile: bool = False  # torch.compile of every decoder layer

    @classmethod
    def parse(cls, options: list[str]) -> BaselineOptions:
        """`["prepare=false", "liger=true"]` -> options; unknown names or values raise ValueError."""
        known = {f.name for f in fields(cls)}
        values: dict[str, bool] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in known or value.lower() not in ("true", "false"):
                raise ValueError(
                    f"baseline option {option!r}: expected NAME=true|false with NAME one of {', '.join(sorted(known))}"
                )
            values[key] = value.lower() == "true"
        return cls(**values)


def lora_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of every trainable tensor (name order, float32 bytes): equal fingerprints, identical LoRA init."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def lora_b_norm(model: torch.nn.Module) -> float:
    """L2 norm of all LoRA B matrices: they start at zero, so after training it says how far the adapters moved."""
    squares = [p.detach().float().pow(2).sum() for n, p in model.named_parameters() if "lora_B" in n]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean next-token cross-entropy over the loss-bearing tokens (labels != -100) of `batches`, in fp32."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=model.device)
    count = 0
    for batch in batches:
        batch = {k: v.to(model.device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits[:, :-1].float()
        target = labels[:, 1:]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
        count += int((target != -100).sum())
        del logits
    model.train()
    return float(total / count)


def run_baseline(
    checkpoint: str,
    *,
    seq: int,
    micro_batch: int,
    steps: int,
    warmup: int,
    lora_r: int,
    lora_alpha: int,
    lora_dropout: float,
    lora_targets: list[str],
    lr: float,
    seed: int,
    device: str,
    options: BaselineOptions,
    batches: Callable[[int], dict[str, torch.Tensor]] | None = None,
    val_batches: list[dict[str, torch.Tensor]] | None = None,
    step_loss: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None,
    autocast: bool = False,
) -> dict[str, Any]:
    """Load, wrap and train `steps` steps; the first `warmup` are not timed and precede the peak-memory reset.

    `batches(i)` gives step i's batch (input_ids, labels, optionally attention_mask): by default `token_batch`
    with labels = inputs. `val_batches`, if given, are evaluated after training: the mean loss over their
    loss-bearing tokens (`val_loss`). `step_loss(model, batch)`: the step's loss, `model(**batch).loss` by default
    (exp.bench.preference_loop's for a preference objective); `autocast`: each step's forward under bf16 autocast
    (CUDA), as a hand-written preference loop runs.
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if options.liger:
        import liger_kernel.transformers  # only for the liger lever (a CUDA package)

        # The patch of the checkpoint's family (liger_kernel.transformers.apply_liger_kernel_to_gemma, ...).
        patch = family_of_model_type(AutoConfig.from_pretrained(checkpoint).model_type).liger_patch
        getattr(liger_kernel.transformers, patch)()
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint,
        quantization_config=quant,
        device_map={"": 0 if cuda else "cpu"},
        dtype=dtype,
        attn_implementation="sdpa",
    )
    load_s = time.perf_counter() - started
    if options.prepare:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=options.ckpt)
    else:
        model.enable_input_require_grads()
    if options.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(seed)
    model = get_peft_model(
        model,
        LoraConfig(
            r=lora_r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=list(lora_targets),
            task_type="CAUSAL_LM",
        ),
    )
    if options.compile:
        for layer in model.base_model.model.model.layers:
            layer.compile()
    model.train()  # from_pretrained returns eval mode: checkpointing and dropout act only in train mode
    fingerprint = lora_fingerprint(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    vocab = model.config.vocab_size

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def random_tokens(i: int) -> dict[str, torch.Tensor]:
        x = token_batch(i, seed, micro_batch, seq, vocab)
        return {"input_ids": x, "labels": x}

    batches = batches or random_tokens
    times: list[float] = []
    losses: list[float] = []
    real_tokens: list[int] = []
    peak = None
    for i in range(steps):
        if i == warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
        batch = batches(i)
        mask = batch.get("attention_mask")
        real_tokens.append(int(mask.sum()) if mask is not None else batch["input_ids"].numel())
        batch = {k: v.to(model.device) for k, v in batch.items()}
        sync()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and cuda):
            loss = step_loss(model, batch) if step_loss is not None else model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    val_loss = evaluate(model, val_batches) if val_batches else None
    return {
        "real_tokens": real_tokens,
        "val_loss": val_loss,
        "load_s": round(load_s, 2),
        "step_s": times,
        "losses": losses,
        "peak_memory_bytes": peak,
        "lora_fingerprint": fingerprint,
        "lora_b_norm": lora_b_norm(model),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "loss_impl": "liger" if options.liger else "hf",
        "gradient_checkpointing": options.ckpt,
        # Without autocast (the SFT loop) what runs in bf16 is what bitsandbytes computes in its compute dtype;
        # prepare's fp32 upcast makes the embedding, head and norms fp32.
        "precision": (
            ("bf16 + fp32 upcast" if options.prepare else "bf16") + (", bf16 autocast" if autocast else "")
            if cuda
            else "float32"
        ),
    }
