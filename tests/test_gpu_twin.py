"""The GPU configuration's code paths, run on the CPU (CI has no GPU).

`hardware=gpu` combines Lightning's bf16-mixed precision plugin, torch's fused AdamW, gradient clipping, exp's
chunked loss, partial gradient checkpointing, torch.compile and layers with kept dequantized weights. Each of these runs on the CPU too, so a failure of
their combination (a fused optimizer that Lightning refuses to clip, say) shows up here without a GPU.

What cannot run on a CPU, and so only runs in `pytest -m gpu` on a GPU:
  * liger-kernel's fused loss: Triton kernels, CUDA only (the CPU runs exp's chunked loss, the GPU's fallback);
  * bitsandbytes' CUDA kernels (the CPU runs its CPU kernels on the same NF4 weights);
  * Inductor's Triton code generation (on the CPU Inductor emits C++ from the same graphs);
  * the preflight's GPU probe and the checkpointed-layer choice by free memory (tests/test_preflight.py feeds
    `check` simulated GPUs instead);
  * CUDA memory statistics (peak memory in the summary).
"""

from __future__ import annotations

import csv
import json
import math

import lightning as L
import pytest
import torch
from conftest import dynamic_from_the_first_shape

from exp.model.build import LAYER_GRAPHS
from exp.training.precision import FusedOptimizerMixedPrecision, build_precision_plugin

CLIP = 0.05  # far below the gradient norm of these steps, so clipping changes every update


class _Linear(L.LightningModule):
    def __init__(self, fused: bool, inf_at: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(16, 16)
        self.fused = fused
        self.inf_at = inf_at

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).float().pow(2).mean()
        if batch_idx == self.inf_at:
            loss = loss * float("inf")  # every gradient becomes inf/NaN: a step the fp16 scaler must skip
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)


def _batches(n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


# The same checks on a GPU (pytest -m gpu): the CUDA fused kernel and CUDA autocast.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# CUDA's fused AdamW kernel rounds differently from the per-tensor ops of the reference (seen on an H200: up to
# 2e-5 absolute on weights of ~0.1 after six steps), far below what clipping changes (> 1e-4, asserted).
TOL = {"cpu": dict(rtol=1e-5, atol=1e-6), "cuda": dict(rtol=1e-4, atol=5e-5)}


def _fit(precision: str, fused: bool, clip: float | None, inf_at: int | None = None, device: str = "cpu") -> _Linear:
    module = _Linear(fused, inf_at)
    accelerator = "cpu" if device == "cpu" else "gpu"
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        plugins=[build_precision_plugin(precision, accelerator)],
        gradient_clip_val=clip,
        max_steps=len(_batches()),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(_batches(), batch_size=None))
    return module


def _reference(precision: str, clip: float | None, device: str = "cpu") -> torch.Tensor:
    """The same steps by hand: autocast, (fp16: scale, unscale), clip the true gradients, torch's AdamW."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16).to(device)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    scaler = torch.amp.GradScaler(device) if precision == "16-mixed" else None
    for x in _batches():
        x = x.to(device)
        with torch.autocast(device, dtype=dtype):
            loss = layer(x).float().pow(2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(layer.parameters(), clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    return layer.weight.detach().cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fused_adamw_is_clipped_like_torchs_adamw(precision, device):
    # Lightning's own MixedPrecision refuses to clip a fused optimizer (RuntimeError "does not allow for gradient
    # clipping"); exp's plugin unscales it first and clips the true gradients.
    trained = _fit(precision, fused=True, clip=CLIP, device=device).layer.weight.detach().cpu()
    torch.testing.assert_close(trained, _reference(precision, CLIP, device), **TOL[device])
    # Clipping is in effect: without it the same steps end elsewhere.
    assert not torch.allclose(trained, _reference(precision, None, device), atol=1e-4)


def test_lightnings_own_plugin_refuses_what_exps_clips():
    from lightning.pytorch.plugins.precision import MixedPrecision

    assert isinstance(build_precision_plugin("bf16-mixed", "cpu"), FusedOptimizerMixedPrecision)
    assert build_precision_plugin("32-true", "cpu") is None
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[MixedPrecision("bf16-mixed", "cpu")],
        gradient_clip_val=CLIP,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        trainer.fit(_Linear(fused=True), torch.utils.data.DataLoader(_batches(), batch_size=None))


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_scaler_skips_a_nonfinite_step_of_the_fused_optimizer(device):
    skipped = _fit("16-mixed", fused=True, clip=CLIP, inf_at=2, device=device)
    plain = _fit("16-mixed", fused=False, clip=CLIP, inf_at=2, device=device)
    # The fused kernel got the scaler's inf flag: the bad step changed nothing, exactly as for torch's AdamW.
    torch.testing.assert_close(skipped.layer.weight, plain.layer.weight, **TOL[device])
    assert torch.isfinite(skipped.layer.weight).all()
    scaler = skipped.trainer.precision_plugin.scaler
    assert scaler.get_scale() < 2.0**16  # the initial scale was lowered after the inf step


TWIN = [
    "hardware=gpu",
    "hardware.accelerator=cpu",
    "hardware.precision=bf16-mixed",  # the plugin hardware=gpu resolves to on an Ampere+ GPU
    "hardware.loss_impl=chunked",  # the GPU's loss where liger-kernel is missing (liger itself needs CUDA)
    "hardware.checkpoint_layers=2",  # what auto_checkpoint_layers picks by memory on a GPU: the first N
    "hardware.compile=true",  # auto on a GPU
    "hardware.dequantized_layers=1",  # what auto_dequantized_layers picks from the memory left on a GPU: the first N
    "hardware.fuse_lora=true",  # ... with LoRA's B product inside the base product there (q_proj: 128 -> 128)
    "hardware.micro_batch_size=4",
    "trainer.global_batch_size=8",  # 2 micro-batches per step: accumulation under the same plugins
    "trainer.max_steps=4",
    "trainer.warmup_steps=0",
    "trainer.max_grad_norm=0.5",
    "trainer.val_every_n_steps=4",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.sample_count=0",
    "data.num_examples=200",
    "logger=csv",
]


@pytest.mark.slow
def test_gpu_defaults_train_on_the_cpu(tmp_path):
    """`hardware=gpu`'s plugins, optimiser, clipping, loss, partial checkpointing and compile, a few steps. The
    layers that recompute their activations (gradient checkpointing inside the compiled call, as recent transformers
    place it) compile whole: Dynamo breaks no graph in this run (exp.model.build.compile_decoder_layers says why it
    could)."""
    from torch._dynamo.utils import counters

    from exp.train import run

    breaks = sum(counters["graph_break"].values())  # Dynamo's counters are per process: earlier tests' count too
    with dynamic_from_the_first_shape():
        result = run([*TWIN], output_dir=tmp_path / "run")
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    module, run_dir = result.module, result.output_dir
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    trainer = module.trainer
    assert isinstance(trainer.precision_plugin, FusedOptimizerMixedPrecision)
    assert trainer.precision_plugin.precision == "bf16-mixed" and trainer.gradient_clip_val == 0.5
    assert trainer.optimizers[0].defaults["fused"] is True
    assert module.loss_choice.impl.value == "chunked"
    from exp.model.build import decoder_layers

    layers = decoder_layers(module.model)
    assert [layer.gradient_checkpointing for layer in layers] == [True, True, False, False]
    assert all(layer._compiled_call_impl is not None for layer in layers)  # Module.compile: compiled in place
    from exp.model.dequantized import DequantizedLinear4bit, FusedLoraLinear4bit

    kept = [isinstance(layer.self_attn.q_proj.base_layer, DequantizedLinear4bit) for layer in layers]
    assert kept == [True, False, False, False]
    fused = [type(layer.self_attn.q_proj) is FusedLoraLinear4bit for layer in layers]
    assert fused == [True, False, False, False] and type(layers[0].self_attn.v_proj) is not FusedLoraLinear4bit
    lora_a = module.model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert lora_a.dtype == torch.float32  # adapters stay fp32 under autocast (the optimizer state too)
    with (run_dir / "csv" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    norms = [float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")]
    assert len(norms) == 4 and all(math.isfinite(x) and x > 0 for x in losses + norms)
    assert math.isfinite(result.final_val["val/loss"]) and result.final_val["val/loss"] < result.initial_val["val/loss"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    assert summary["compile"]["graphs"] >= 1 and summary["compile"]["seconds"] > 0  # compiled, not run eagerly
    # Three kinds of layer here (kept and recomputed, 4-bit and recomputed, 4-bit): a graph each per shape, more than
    # torch's default limit of 8 where the example count varies too (varlen attention on a GPU).
    assert torch._dynamo.config.recompile_limit >= LAYER_GRAPHS > 3 * 3


def test_gpu_runs_get_expandable_allocator_segments_unless_the_user_chose(monkeypatch):
    """Set before any CUDA allocation (torch reads it once); a user's PYTORCH_CUDA_ALLOC_CONF is left alone."""
    import os

    from exp.training.trainer import CUDA_ALLOC_CONF, configure_cuda_allocator

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    configure_cuda_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_ALLOC_CONF == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    configure_cuda_allocator()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
