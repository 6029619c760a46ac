"""The `lora` variants on the real NF4 CPU path: DoRA, rsLoRA, rank / alpha patterns, the inits (gaussian, PiSSA,
OLoRA) and LoRA+. Each trains a few steps, merges with exp.merge (parity ok) and loads with plain PEFT; the
refusals name the key and exit non-zero."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compose_typed, dynamic_from_the_first_shape
from safetensors.torch import load_file
from test_training import fixed_batches, plain_nf4_base

from exp.core.config import ConfigError
from exp.merge import merge
from exp.model.build import build_model
from exp.train import run

FEW = [
    "trainer.max_steps=4",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=4",
    "trainer.checkpoint_every_n_steps=2",
    "data.num_examples=64",
    "logger=csv",
]
VARIANTS = {
    "dora": ["lora=dora"],
    "rslora": ["lora=rslora", "lora.r=16"],
    "patterns": ["lora.init=gaussian", "+lora.rank_pattern.v_proj=4", "+lora.alpha_pattern.q_proj=32"],
    "pissa": ["lora=pissa"],
    "olora": ["lora.init=olora"],
    "plus": ["lora.plus_lr_ratio=16"],
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def trained(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(name)
    result = run([*FEW, *VARIANTS[name]], output_dir=root / "run")
    return name, result, root


def adapter_of(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_each_variant_trains_merges_and_loads_with_plain_peft(trained):
    from peft import PeftModel

    name, result, root = trained
    cfg = result.module.cfg
    assert torch.isfinite(torch.tensor(result.final_val["val/loss"]))
    # The adapter moved from where the same config starts.
    start = build_model(cfg)
    trained_params = dict(result.module.model.named_parameters())
    moved = [
        (p - trained_params[n].detach().to(p.device)).abs().max().item()
        for n, p in start.named_parameters()
        if "lora_B" in n
    ]
    assert moved and max(moved) > 1e-4, name

    report = merge([f"run={result.output_dir}", f"out={root / 'merged'}", "examples=8"])
    assert report["ok"], report

    batch = fixed_batches(cfg, 1, 4)[0]
    mask = batch["attention_mask"].bool()
    model = result.module.model.eval()
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[mask]
    base = plain_nf4_base(cfg)
    for m in base.modules():  # the kernel training used (see test_training), for a float32-exact comparison
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    reloaded = PeftModel.from_pretrained(base, str(result.adapter_dir)).eval()
    with torch.no_grad():
        plain = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[mask]
    if name in ("pissa", "olora"):
        # Saved as a plain LoRA of rank 2r on the original base (exp.model.lora_init): the same model.
        assert reloaded.peft_config["default"].r == 2 * cfg.lora.r
    torch.testing.assert_close(plain, expected, atol=1e-4, rtol=1e-4)
    if name == "dora":
        assert reloaded.peft_config["default"].use_dora
    if name == "patterns":
        layer = reloaded.base_model.model.model.layers[0].self_attn
        assert layer.v_proj.r["default"] == 4 and layer.q_proj.r["default"] == cfg.lora.r
        assert layer.q_proj.scaling["default"] == 32 / cfg.lora.r
    if name == "rslora":
        q = reloaded.base_model.model.model.layers[0].self_attn.q_proj
        assert q.scaling["default"] == pytest.approx(cfg.lora.alpha / 16**0.5)


def test_lora_plus_gives_b_its_learning_rate_and_keeps_it_on_resume(tmp_path):
    """LoRA+ with PiSSA: the groups' rates keep their ratio through the schedule, and a run resumed from its
    step-2 checkpoint (the residual base rebuilt, the optimiser's groups restored) ends bitwise where the
    uninterrupted run ends."""
    overrides = [*FEW, "lora=pissa", "lora.plus_lr_ratio=16", "trainer.warmup_steps=2"]
    whole = run(overrides, output_dir=tmp_path / "whole")
    groups = whole.module.optimizers().optimizer.param_groups
    by_name = {id(p): n for n, p in whole.module.model.named_parameters()}
    # The schedule scales each group's own starting rate (LambdaLR's initial_lr); it ends at 0 for both.
    rates = {
        ("B" if "lora_B" in by_name[id(p)] else "A"): g["initial_lr"]
        for g in groups
        for p in g["params"]
        if id(p) in by_name
    }
    lr = whole.module.cfg.trainer.learning_rate
    assert rates == {"A": pytest.approx(lr), "B": pytest.approx(16 * lr)}
    resumed = run([*overrides, f"trainer.resume={tmp_path / 'whole' / 'checkpoints' / 'step-000002.ckpt'}"],
                  output_dir=tmp_path / "resumed")  # fmt: skip
    a, b = adapter_of(whole.output_dir), adapter_of(resumed.output_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["lora.init=eva"], "lora.init=eva: a data-driven initialisation"),
        (["lora.init=loftq"], "lora.init=loftq on the CPU"),
        (["lora.init=pissa", "lora.use_dora=true"], "lora.init=pissa with lora.use_dora=true"),
        (["+lora.rank_pattern.o_proj=4"], "the key 'o_proj' names no module of lora.target_modules"),
        (["lora.plus_lr_ratio=0"], "lora.plus_lr_ratio=0.0"),
        (["lora.pissa_niter=4"], "lora.pissa_niter=4 with lora.init=default"),
    ],
)
def test_refusals_name_the_key_and_the_fix(overrides, expected):
    with pytest.raises(ConfigError, match="Fix|fix|e.g.|or null") as e:
        compose_typed(overrides)
    assert expected in str(e.value)


def test_a_pattern_key_matching_no_layer_is_refused_at_build(tmp_path):
    cfg = compose_typed(["++lora.rank_pattern={layers.99.self_attn.q_proj:4}"])
    with pytest.raises(ConfigError, match=r"lora.rank_pattern: the key 'layers.99.self_attn.q_proj' matches no LoRA"):
        build_model(cfg)


def test_the_memory_estimate_counts_a_rank_pattern_as_peft_builds_it():
    """The preflight's estimate takes each projection's rank from `lora.rank_pattern`: its trainable count is PEFT's
    own where a key names a projection in every layer, and an upper bound where a key names one layer's."""
    from exp.hardware.memory import config_arch, estimate_for_config, lora_param_count, pattern_ranks

    def counts(overrides: list[str]) -> tuple[int, int, int]:
        cfg = compose_typed(overrides)
        model = build_model(cfg)
        built = sum(p.numel() for p in model.parameters() if p.requires_grad)
        lo = cfg.lora
        ranks = pattern_ranks(lo.r, lo.rank_pattern, list(lo.target_modules))
        counted = lora_param_count(config_arch(cfg), lo.r, list(lo.target_modules), cfg.model.family.value, ranks)
        return built, counted, estimate_for_config(cfg).lora_params

    plain_built, plain_counted, plain_bytes = counts([])
    assert plain_built == plain_counted
    built, counted, estimated_bytes = counts(["+lora.rank_pattern.v_proj=32"])
    assert built == counted > plain_built
    assert estimated_bytes - plain_bytes == 4 * (built - plain_built)  # fp32 adapters
    built, counted, _ = counts(["++lora.rank_pattern={layers.0.self_attn.v_proj:32}"])
    assert plain_built < built < counted  # layer 0 only in the model, every layer in the estimate


def test_a_refused_variant_exits_non_zero_with_one_paragraph(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", "lora.init=corda", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0
    assert "lora.init=corda: a data-driven initialisation" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant", [["lora=dora"], ["lora=pissa", "lora.plus_lr_ratio=16"]], ids=["dora", "pissa_plus"]
)
def test_variants_train_under_the_gpu_configuration_on_the_cpu(variant, tmp_path):
    """hardware=gpu's code on the CPU (tests/test_gpu_twin.py): bf16 autocast, compiled layers, a kept dequantized
    layer with hardware.fuse_lora. DoRA's layers there keep the dequantized weight but not the joined [W | B]
    product (DoRA rescales the whole output); PiSSA's subtracted starting product runs inside the compiled layers."""
    from test_gpu_twin import TWIN

    from exp.model.build import decoder_layers
    from exp.model.dequantized import DequantizedLinear4bit, FusedLoraLinear4bit

    with dynamic_from_the_first_shape():
        result = run([*TWIN, *variant], output_dir=tmp_path / "run")
    assert torch.isfinite(torch.tensor(result.final_val["val/loss"]))
    q = decoder_layers(result.module.model)[0].self_attn.q_proj
    assert isinstance(q.base_layer, DequantizedLinear4bit)
    assert (type(q) is FusedLoraLinear4bit) == ("lora=dora" not in variant)


@pytest.mark.gpu
def test_loftq_fits_the_adapter_to_the_quantization_error_on_a_gpu(tmp_path):
    """lora.init=loftq (PEFT's replace_lora_weights_loftq, CUDA only): the adapter starts non-zero, trains, and
    the saved adapter is a plain LoRA on the 4-bit base (exp.merge loads it with PEFT and checks the merge)."""
    from peft import PeftConfig

    result = run([*FEW, "hardware=gpu", "lora.init=loftq"], output_dir=tmp_path / "run")
    cfg = result.module.cfg
    start = build_model(cfg, "cuda")
    b0 = [p for n, p in start.named_parameters() if "lora_B" in n]
    assert b0 and all(p.abs().max() > 0 for p in b0)  # LoftQ's B is not PEFT's zeros
    assert torch.isfinite(torch.tensor(result.final_val["val/loss"]))
    report = merge([f"run={result.output_dir}", f"out={tmp_path / 'merged'}", "examples=8"])
    assert report["ok"], report
    # A plain LoRA adapter: PEFT loading it does not run LoftQ again over the saved weights.
    saved = PeftConfig.from_pretrained(str(result.adapter_dir))
    assert saved.init_lora_weights is True and saved.r == cfg.lora.r


@pytest.mark.gpu
def test_dora_trains_padding_free_on_a_gpu(tmp_path):
    """DoRA's fp32 magnitude turns its projections' outputs to fp32 within the bf16 step; the GPU configuration's
    padding-free rows reach the varlen FlashAttention kernel, which takes fp16 / bf16 only (exp.model.varlen casts)."""
    result = run([*FEW, "hardware=gpu", "lora=dora"], output_dir=tmp_path / "run")
    assert result.module.cfg.hardware.padding_free and result.module.cfg.model.attn_implementation == "varlen"
    assert torch.isfinite(torch.tensor(result.final_val["val/loss"]))
