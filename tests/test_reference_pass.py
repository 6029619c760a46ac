"""DPO's reference pass (exp.model.reference) on the GPU configuration's model, built on the CPU: the policy's own
path with LoRA's A zeroed, so fresh adapters give a DPO loss of exactly ln 2 and rewards of exactly 0 whatever
kernels, fusions and loss implementation the policy runs through.

On the CPU the kernels of the fused `[W | B]` product and of the plain `W` product happen to round alike, so the
numbers alone would not show a reference that leaves the policy's path: the first test also checks the path (the
fused product runs in the reference pass as in the policy's). On a GPU the numbers do show it (`-m gpu`)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_typed
from peft.tuners.lora import LoraLayer
from test_gpu_objectives import _batch

from exp.core.config import LossImpl
from exp.model import dequantized
from exp.model.build import REFERENCE_ADAPTER, build_model, decoder_layers
from exp.model.reference import reference_pass, start_copy_problem, zeroed_a_problem
from exp.training import objectives
from exp.training.objectives import preference_loss, reference_logps, row_logps

LN2 = torch.tensor(math.log(2.0), dtype=torch.float32).item()
# The GPU configuration as it resolves on a GPU (kept dequantized weights in every layer, LoRA's B joined to them),
# without dropout: both passes must see the same model.
TWIN = [
    "objective=dpo",
    "hardware=gpu",
    "hardware.accelerator=cpu",
    "hardware.precision=bf16-mixed",
    "hardware.dequantized_layers=2",
    "hardware.fuse_lora=true",
    "lora.dropout=0",
]
IMPLS = [LossImpl.hf, LossImpl.chunked, LossImpl.liger]


def _step(model, batch, cfg, impl: LossImpl, device: str = "cpu"):
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, sums = preference_loss(model, batch, cfg.objective, impl)
    loss.backward()  # after the reference pass: the fused product's saved [W | B] must be intact
    return loss.detach(), sums


@pytest.fixture(scope="module")
def twin():
    cfg = compose_typed(TWIN)
    return cfg, build_model(cfg, "cpu"), _batch(cfg, 4)


def test_the_reference_pass_runs_the_policys_fused_product_with_lora_off(twin, monkeypatch):
    cfg, model, batch = twin
    assert zeroed_a_problem(model) is None
    calls: list[bool] = []  # per fused product: whether LoRA's input columns are nonzero
    forward = dequantized._BaseAndLoraProduct.forward

    def counted(ctx, x, xa, packed, b):
        calls.append(bool(xa.any()))
        return forward(ctx, x, xa, packed, b)

    monkeypatch.setattr(dequantized._BaseAndLoraProduct, "forward", staticmethod(counted))
    a_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}
    _step(model, batch, cfg, LossImpl.chunked)
    fused = sum(type(m) is dequantized.FusedLoraLinear4bit for m in model.modules())
    # The reference's forward (every fused layer multiplied as in the policy's pass, LoRA's input 0), the policy's,
    # then the backward's recomputation of the checkpointed layers.
    assert fused and calls[:fused] == [False] * fused and calls[fused : 2 * fused] == [True] * fused
    assert all(calls[2 * fused :])
    # Nonzero (LoRA's A is drawn at random) and restored to the value: a step without an optimiser leaves it.
    assert all(p.any() and torch.equal(p, a_before[n]) for n, p in model.named_parameters() if "lora_A" in n)


def test_a_compiled_decoder_layer_runs_the_policys_graph_for_the_reference():
    """Compiled, a decoder layer is one graph for the policy's pass and the reference's, with LoRA on every projection:
    fused ones (`[W | B]`: q, o, gate and up here) and PEFT's own (k, v and down, which read PEFT's float scaling). The
    reference pass zeroes A, a tensor the graph takes as an input; a scaling of 0 would be a constant of another graph
    (on an H100 the Gemma-7B shape started DPO at 0.7076 with that second graph). Dynamo alone (a counting backend), no
    Inductor."""
    cfg = compose_typed([*TWIN, "lora=all_linear", "hardware.gradient_checkpointing=false"])
    model = build_model(cfg, "cpu")
    layer = decoder_layers(model)[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert type(attn.q_proj) is dequantized.FusedLoraLinear4bit and type(mlp.up_proj) is dequantized.FusedLoraLinear4bit
    assert isinstance(mlp.down_proj, LoraLayer) and type(mlp.down_proj) is not dequantized.FusedLoraLinear4bit
    a_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()  # no graph of an earlier test's compiled layers
    layer.compile(backend=counting)
    x = torch.randn(1, 5, model.config.hidden_size)
    position_ids = torch.arange(5)[None]
    inputs = dict(position_embeddings=model.base_model.model.model.rotary_emb(x, position_ids), attention_mask=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        policy = layer(x, **inputs)
        with reference_pass(model):
            reference = layer(x, **inputs)
        again = layer(x, **inputs)
    assert len(graphs) == 1  # the reference pass compiled nothing of its own
    assert torch.equal(reference, policy) and torch.equal(again, policy)  # B is 0: the reference is the policy
    assert all(torch.equal(p, a_before[n]) for n, p in model.named_parameters() if "lora_A" in n)  # A restored


def test_the_reference_pass_restores_a_when_the_pass_fails(twin):
    """A failing pass (out of memory, an interrupt) still leaves every adapter's A as it was."""
    cfg, model, batch = twin
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}
    with pytest.raises(RuntimeError, match="stopped"), reference_pass(model):
        assert all(not p.any() for n, p in model.named_parameters() if "lora_A" in n)
        raise RuntimeError("stopped")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora_A" in n)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.value)
def test_fresh_adapters_start_dpo_at_ln2_with_zero_rewards(twin, impl):
    if impl == LossImpl.liger:
        pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (the gpu extra)")
    cfg, model, batch = twin
    model.zero_grad(set_to_none=True)
    loss, sums = _step(model, batch, cfg, impl)
    assert loss.item() == LN2
    assert sums["rewards_chosen"].item() == 0.0 and sums["rewards_rejected"].item() == 0.0


def test_trained_adapters_score_the_base_as_the_reference(twin):
    """With B moved off 0, the reference is still the base: the same log-probabilities as PEFT's adapters-off pass."""
    cfg, model, batch = twin
    original = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = reference_logps(model, batch, LossImpl.chunked)
            with torch.no_grad(), model.disable_adapter():
                peft = row_logps(model, batch, LossImpl.chunked)[0]
            policy = row_logps(model, batch, LossImpl.chunked)[0].detach()
        assert torch.allclose(ours, peft, rtol=1e-3, atol=1e-2), (ours, peft)
        assert not torch.allclose(ours, policy, rtol=1e-3, atol=1e-2)  # the adapters are off in it
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in original:
                    p.copy_(original[name])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_reference_runs_first_in_the_policys_grad_mode_where_layers_are_compiled(compiled, monkeypatch):
    """A compiled layer has a graph per grad mode, and the two round differently on a GPU: where the layers are
    compiled the reference pass runs with gradients on (the policy's graph), before the policy's pass (so its saved
    activations are gone before the policy's are made), and no gradient flows through it. Eager layers keep it
    without gradients. (`backend="aot_eager"`: Dynamo's capture and AOTAutograd's joint graph, as Inductor gets them,
    without code generation. With `backend="eager"`, run after tests/test_gpu_twin.py in one process, the
    checkpointed layers' recomputation replayed other operations than their forward ran, and the backward failed.)"""
    cfg = compose_typed(TWIN)
    model = build_model(cfg, "cpu")
    if compiled:
        for layer in decoder_layers(model):
            layer.compile(backend="aot_eager")
    lora = [m for m in model.modules() if isinstance(m, LoraLayer)]
    seen: list[tuple[bool, bool]] = []  # per pass to the head: (LoRA switched off, gradients on)
    head_inputs = objectives.head_inputs

    def spied(m, inputs):
        seen.append((all(not a.weight.any() for layer in lora for a in layer.lora_A.values()), torch.is_grad_enabled()))
        return head_inputs(m, inputs)

    monkeypatch.setattr(objectives, "head_inputs", spied)
    batch = _batch(cfg, 4)
    loss, _ = _step(model, batch, cfg, LossImpl.chunked)
    assert seen == [(True, compiled), (False, True)]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads and loss == LN2
    # The same step with the reference's values handed in (no reference pass): the same gradients, bit for bit.
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference_logps(model, batch, LossImpl.chunked)
    assert ref.grad_fn is None
    _step(model, batch | {"ref_logps": ref.float()}, cfg, LossImpl.chunked)
    for name, grad in grads.items():
        assert torch.equal(dict(model.named_parameters())[name].grad, grad), name


def test_under_fsdp_the_reference_of_compiled_layers_keeps_no_grad(tmp_path):
    """Under FSDP a forward with gradients on prepares a backward (the shards gathered again) that never comes for
    the reference: its pass keeps `no_grad` there even where the layers are compiled. A one-process gloo group wraps
    the model as exp's FSDP strategy does (FullyShardedDataParallel)."""
    # Only this test forms a process group.
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].compile(backend="eager")
    assert objectives._reference_grad(model)
    with torch.no_grad():
        assert not objectives._reference_grad(model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.warns(UserWarning, match="NO_SHARD"):  # one rank: nothing to shard, the wrapping is the same
            sharded = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        assert not objectives._reference_grad(sharded)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def start_adapter(tmp_path_factory):
    """A saved adapter on every projection of the tiny model, with B off 0 (a policy other than the base)."""
    model = build_model(compose_typed(["lora=all_linear"]), "cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    out = tmp_path_factory.mktemp("start") / "adapter"
    model.save_pretrained(out)
    return out


def _start_twin(start_adapter, *overrides):
    cfg = compose_typed([*TWIN, f"model.adapter={start_adapter}", "hardware.gradient_checkpointing=false", *overrides])
    assert cfg.reference == "start"
    return build_model(cfg, "cpu")


def test_a_compiled_decoder_layer_runs_the_policys_graph_for_the_starting_adapters_reference(start_adapter):
    """`objective.reference=start`: the trainable adapter holds the starting adapter's values for the pass, so a
    compiled layer runs one graph for both passes (switching the active adapter compiled three: the reference's and
    the policy's again after it, whose trainable flags had changed). After training moved the policy, the pass still
    computes the starting adapter's model, and every trainable value comes back. The layers are kept dequantized and
    fused (`[W | B]` with the active adapter's B copied in at each call)."""
    model = _start_twin(start_adapter)
    layer = decoder_layers(model)[0]
    # The frozen copy has the trainable adapter's rank: LoRA's B joins the kept weight as with one adapter.
    assert type(layer.self_attn.q_proj) is dequantized.FusedLoraLinear4bit
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    layer.compile(backend=counting)
    x = torch.randn(1, 5, model.config.hidden_size)
    inputs = dict(position_embeddings=model.base_model.model.model.rotary_emb(x, torch.arange(5)[None]),
                  attention_mask=None)  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        start = layer(x, **inputs)  # the policy at step 0 is the starting adapter
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:  # a training step's worth of change to the trainable adapter
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        torch.clear_autocast_cache()  # (an optimiser steps outside the autocast region, whose casts it keeps)
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        policy = layer(x, **inputs)
        with objectives.reference_model(model, graph=True):
            reference = layer(x, **inputs)
        again = layer(x, **inputs)
    assert len(graphs) == 1
    assert torch.equal(reference, start) and not torch.equal(policy, start) and torch.equal(again, policy)
    assert trained and all(torch.equal(p, trained[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert model.active_adapter == "default"


def test_a_trainable_adapter_that_drops_out_switches_to_the_starting_adapter(start_adapter):
    """With lora.dropout > 0 the trainable adapter would drop out in a training-mode pass, and the reference has no
    dropout: there the starting adapter is made the active one; in eval mode both passes compute the same numbers."""
    model = _start_twin(start_adapter, "lora.dropout=0.5")
    assert "dropout" in start_copy_problem(model.train(), "default", REFERENCE_ADAPTER)
    batch = _batch(compose_typed(TWIN), 4)
    switched = []
    with objectives.reference_model(model):
        switched.append(model.active_adapter)
    assert switched == [REFERENCE_ADAPTER] and model.active_adapter == "default"
    model.eval()
    assert start_copy_problem(model, "default", REFERENCE_ADAPTER) is None
    with torch.no_grad():
        with objectives.reference_model(model):
            copied = row_logps(model, batch, LossImpl.hf)[0]
        model.set_adapter(REFERENCE_ADAPTER)
        alone = row_logps(model, batch, LossImpl.hf)[0]
        model.set_adapter("default")
    torch.testing.assert_close(copied, alone, rtol=0, atol=1e-6)


def test_dora_takes_pefts_switch():
    """DoRA's output is rescaled by its trained magnitude over the weight's norm: a zero A does not give the base, so
    the reference is PEFT's adapters-off pass. (Its policy is the base at the start only up to the rounding of that
    norm: its step-0 rewards are near 0, not exactly 0.)"""
    cfg = compose_typed([*TWIN, "lora.use_dora=true"])
    model = build_model(cfg, "cpu")
    assert "DoRA" in zeroed_a_problem(model)
    loss, sums = _step(model, _batch(cfg, 4), cfg, LossImpl.chunked)
    assert abs(sums["rewards_chosen"].item()) < 0.05 and abs(loss.item() - LN2) < 0.01
    with reference_pass(model):
        assert all(m.disable_adapters for m in model.modules() if isinstance(m, LoraLayer))


@pytest.mark.slow
def test_a_compiled_gpu_twin_dpo_run_starts_at_ln2(tmp_path):
    """`exp.train objective=dpo` on the GPU configuration's CPU twin, every layer compiled, kept and fused: the step-0
    evaluation's rewards are exactly 0 and the first training step's loss is exactly ln 2."""
    import csv
    import json

    from exp.train import run

    run([*TWIN, "hardware.dequantized_layers=4", "hardware.loss_impl=chunked", "hardware.compile=true",
         "hardware.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.max_steps=1",
         "trainer.val_every_n_steps=1", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
         "trainer.sample_count=0", "data.num_examples=48", "data.val_size=8", "logger=csv"],
        output_dir=tmp_path / "run")  # fmt: skip
    initial = json.loads((tmp_path / "run" / "summary.json").read_text())["initial_val"]
    assert initial["val/rewards/chosen"] == 0.0 and initial["val/rewards/rejected"] == 0.0
    assert initial["val/loss"] == LN2
    with (tmp_path / "run" / "csv" / "metrics.csv").open() as f:
        first = next(r for r in csv.DictReader(f) if r.get("train/loss"))
    assert float(first["train/loss"]) == LN2 and float(first["train/rewards/margin"]) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.value)
def test_fresh_adapters_start_dpo_at_ln2_on_the_gpu_compiled(impl):
    """On the GPU: cuBLAS picks its kernel by the product's shape, and the layers run compiled: the reference pass
    must still compute the policy's numbers."""
    _assert_gpu_start_at_ln2(compose_typed(GPU_COMPILED), impl)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.value)
def test_a_starting_adapter_starts_dpo_at_ln2_on_the_gpu_compiled(start_adapter, impl):
    """`objective.reference=start` on the GPU, every layer compiled, kept and fused: the policy at step 0 is the
    starting adapter, so its first loss is exactly ln 2 only if the reference pass computes the policy's numbers."""
    cfg = compose_typed([*GPU_COMPILED, f"model.adapter={start_adapter}"])
    assert cfg.reference == "start"
    _assert_gpu_start_at_ln2(cfg, impl)


# The GPU configuration with every layer compiled, kept and fused, without dropout.
GPU_COMPILED = [*TWIN[:2], "hardware.precision=bf16-mixed", "hardware.dequantized_layers=4", "hardware.fuse_lora=true",
                "lora.dropout=0", "hardware.compile=true"]  # fmt: skip


def _assert_gpu_start_at_ln2(cfg, impl: LossImpl) -> None:
    """Two DPO steps at the policy's start on the GPU (the first call compiles): each loss exactly ln 2, each reward 0."""
    model = build_model(cfg, "cuda")  # hardware.compile=true: every decoder layer compiled
    batch = _batch(cfg, pairs=8)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss, sums = _step(model, batch, cfg, impl, "cuda")
        assert loss.item() == LN2
        assert sums["rewards_chosen"].item() == 0.0 and sums["rewards_rejected"].item() == 0.0
