"""The real NF4 path on CPU: training learns, matches a hand-written loop, and leaves a reloadable adapter."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from conftest import SHORT, compose_typed, encode

from exp.data.batching import collate
from exp.data.synthetic import generate_examples
from exp.hardware import memory
from exp.model.build import build_model, build_tokenizer, decoder_layers, resolve_checkpoint
from exp.train import run

compose = compose_typed


def fixed_batches(cfg, n_batches: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    tok = build_tokenizer(cfg.model)
    rows = generate_examples(n_batches * batch_size, seed=123)
    enc = [encode(tok, r, cfg.data.max_seq_len)[0] for r in rows]
    return [collate(enc[i : i + batch_size], tok.pad_token_id) for i in range(0, len(enc), batch_size)]


def plain_nf4_base(cfg):
    """The base model as a user loads it by hand: transformers + bitsandbytes, no exp code."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    return AutoModelForCausalLM.from_pretrained(
        resolve_checkpoint(cfg.model), quantization_config=quant, device_map={"": "cpu"}, dtype=torch.float32
    )


def test_short_run_learns_and_writes_run_dir(short_run):
    out = short_run.output_dir
    assert json.loads((out / "status.json").read_text())["status"] == "completed"
    assert (out / "config.yaml").exists()
    assert (out / "checkpoints" / "last.ckpt").exists()
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*.ckpt")) == [
        "step-000015.ckpt",
        "step-000030.ckpt",
    ]
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    rows = list(csv.DictReader((out / "csv" / "metrics.csv").open()))
    train_losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(train_losses) == 30
    val = [(int(r["step"]), float(r["val/loss"])) for r in rows if r.get("val/loss")]
    assert val[0][0] == 0, "the step-0 validation is recorded"
    # 30 steps at the tiny default's learning rate already move the loss well below its random-init value.
    assert short_run.final_val["val/loss"] < 0.8 * short_run.initial_val["val/loss"]
    assert val[-1][1] == pytest.approx(short_run.final_val["val/loss"], rel=1e-6)


def test_checkpoints_hold_only_adapter_weights(short_run):
    ckpt = torch.load(short_run.output_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    keys = list(ckpt["state_dict"])
    assert keys and all("lora_" in k for k in keys), keys[:5]
    assert ckpt["optimizer_states"] and ckpt["global_step"] == 30


def test_adapter_reloads_with_plain_peft_and_reproduces_logits(short_run):
    from peft import PeftModel

    cfg = short_run.module.cfg
    batch = fixed_batches(cfg, 1, 4)[0]
    trained = short_run.module.model
    trained.eval()
    with torch.no_grad():
        expected = trained(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    base = plain_nf4_base(cfg)
    reloaded = PeftModel.from_pretrained(base, short_run.adapter_dir)
    reloaded.eval()
    mask = batch["attention_mask"].bool()

    def logits():
        with torch.no_grad():
            return reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[mask]

    # Plain PEFT, as loaded. On CPUs with AVX512-BF16, bitsandbytes then runs an inference-only repacked 4-bit
    # kernel in eval mode (bf16 block scales), so the logits agree to ~3e-2, not to float32 round-off.
    plain = logits()
    torch.testing.assert_close(plain, expected[mask], atol=0.1, rtol=0)
    assert (plain.argmax(-1) == expected[mask].argmax(-1)).float().mean() > 0.99
    # With the kernel training used (what exp.model.build selects), the reload is exact.
    base2 = plain_nf4_base(cfg)
    for m in base2.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    reloaded = PeftModel.from_pretrained(base2, short_run.adapter_dir)
    reloaded.eval()
    torch.testing.assert_close(logits(), expected[mask], atol=1e-5, rtol=1e-5)
    # Without the adapter the base model's logits differ: the adapter is what reproduces the trained model.
    with reloaded.disable_adapter(), torch.no_grad():
        bare = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert (bare[mask] - expected[mask]).abs().max() > 0.5


def test_one_framework_step_matches_hand_written_loop(tmp_path):
    """exp's Lightning module vs transformers + PEFT + bitsandbytes + AdamW by hand: same losses, same weights."""
    import lightning as L
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader

    from exp.training.module import QLoRAModule
    from exp.training.trainer import build_trainer

    cfg = compose(
        [
            "lora.dropout=0",
            "trainer.max_steps=3",
            "trainer.warmup_steps=0",
            "trainer.max_grad_norm=0",
            "trainer.learning_rate=5e-3",
            "trainer.lr_schedule=constant",
            "trainer.global_batch_size=4",
            "hardware.micro_batch_size=4",
            "logger=none",
        ]
    )
    batches = fixed_batches(cfg, 3, 4)

    # exp: the LightningModule driven by exp's Trainer.
    L.seed_everything(0)
    module = QLoRAModule(cfg)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = build_trainer(cfg, tmp_path, [])
    trainer.callbacks.append(Record())
    identity = lambda b: b[0]  # noqa: E731 - the batches are already collated
    trainer.fit(
        module,
        train_dataloaders=DataLoader(batches, batch_size=1, collate_fn=identity),
        val_dataloaders=DataLoader(batches[:1], batch_size=1, collate_fn=identity),
    )

    # By hand: the loop a user would write.
    model = plain_nf4_base(cfg)
    torch.manual_seed(cfg.lora.init_seed)
    model = get_peft_model(
        model,
        LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3, weight_decay=0.0)
    ref_losses = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    ours = {k: v for k, v in module.model.state_dict().items() if "lora_" in k}
    ref = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert ours.keys() == ref.keys() and ours
    assert all(v.abs().sum() > 0 for k, v in ref.items() if "lora_B" in k)  # B starts at zero: the steps moved it
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], atol=1e-6, rtol=1e-5)


def test_gradient_checkpointing_is_active_and_non_reentrant():
    cfg = compose(["hardware.gradient_checkpointing=true", "logger=none"])
    model = build_model(cfg, "cpu")
    assert model.training and model.base_model.model.is_gradient_checkpointing
    layer = model.base_model.model.model.layers[0]
    calls = []
    layer.self_attn.register_forward_hook(lambda *a: calls.append(1))
    batch = fixed_batches(cfg, 1, 2)[0]
    model(**batch).loss.backward()
    assert len(calls) == 2, "a checkpointed layer runs its forward again during backward"
    # Non-reentrant checkpointing lets gradients reach the adapters although the inputs need no grad.
    grad = layer.self_attn.q_proj.lora_B["default"].weight.grad
    assert grad is not None and grad.abs().sum() > 0


def _saved_bytes_and_grads(overrides: list[str]) -> tuple[list[bool], int, dict[str, torch.Tensor]]:
    """Build the tiny 4-bit model, run one forward/backward; return each decoder layer's checkpointing flag, the
    bytes autograd saved outside checkpointed regions (distinct storages) and the adapters' gradients."""
    cfg = compose(["hardware.gradient_checkpointing=true", "lora.dropout=0", "logger=none", *overrides])
    model = build_model(cfg, "cpu")
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**fixed_batches(cfg, 1, 4)[0]).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return [layer.gradient_checkpointing for layer in decoder_layers(model)], sum(storages.values()), grads


@pytest.mark.slow
def test_checkpoint_layers_recomputes_only_the_first_n_and_the_estimate_counts_the_rest():
    flags, saved, grads = {}, {}, {}
    for k in (0, 1, 2, 4):
        flags[k], saved[k], grads[k] = _saved_bytes_and_grads([f"hardware.checkpoint_layers={k}"])
    assert flags[0] == [False] * 4 and flags[1] == [True, False, False, False] and flags[4] == [True] * 4
    # Each layer taken into checkpointing stops saving the same amount (its recompute keeps only its input).
    per_layer = saved[0] - saved[1]
    assert per_layer > 0 and saved[1] - saved[2] == per_layer and saved[2] > saved[4]
    # exp.hardware.memory's per-layer saved bytes for this very batch (4 x 37 tokens, fp32): within 5% of the measurement.
    cfg = compose(["lora.dropout=0"])
    kwargs = memory._config_kwargs(cfg) | {"micro_batch_size": 4, "seq_len": 37}
    parts = memory.estimate_memory(memory.config_arch(cfg), **kwargs).details["layer_saved_parts"]["global"]
    assert abs(sum(parts.values()) - per_layer) <= 0.05 * per_layer, (sum(parts.values()), per_layer)
    # Recomputing is the same arithmetic: the adapters' gradients do not depend on which layers recompute.
    for k in (1, 2, 4):
        for name, g in grads[0].items():
            torch.testing.assert_close(grads[k][name], g, atol=0, rtol=0)


def _alive_saved_bytes(overrides: list[str]) -> int:
    """Bytes of the distinct storages autograd holds for the backward once the forward has ended (what a step's
    peak holds), on the tiny 4-bit model with every projection targeted. Tensors saved by a graph that the forward
    dropped again (DoRA builds B @ A through lora_A and discards it) are dead by then and not counted."""
    import weakref

    targets = "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
    cfg = compose(["hardware.gradient_checkpointing=true", "lora.dropout=0", "logger=none", targets, *overrides])
    model = build_model(cfg, "cpu")
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**fixed_batches(cfg, 1, 4)[0]).loss
    alive = [t for t in (r() for r in saved) if t is not None]
    total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}.values())
    loss.backward()
    return total


@pytest.mark.slow
def test_the_estimate_counts_what_a_dora_layer_saves():
    """DoRA's layer saves both products it scales per projection: the estimate's DoRA term is within 5% of what a
    layer of the real 4-bit PEFT path holds (a layer taken out of checkpointing, measured as above), and 0 without
    DoRA."""
    per_layer = {}
    for name, extra in (("plain", []), ("dora", ["lora.use_dora=true"])):
        alive = [_alive_saved_bytes([f"hardware.checkpoint_layers={k}", *extra]) for k in (0, 1)]
        per_layer[name] = alive[0] - alive[1]
    measured = per_layer["dora"] - per_layer["plain"]
    targets = "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
    estimated = {}
    for name, extra in (("plain", []), ("dora", ["lora.use_dora=true"])):
        cfg = compose(["lora.dropout=0", targets, *extra])
        kwargs = memory._config_kwargs(cfg) | {"micro_batch_size": 4, "seq_len": 37}
        parts = memory.estimate_memory(memory.config_arch(cfg), **kwargs).details["layer_saved_parts"]["global"]
        estimated[name] = sum(parts.values())
    assert measured > 0.5 * per_layer["plain"]  # DoRA's products are a large share of a layer
    assert abs(estimated["dora"] - estimated["plain"] - measured) <= 0.05 * measured, (estimated, per_layer)


@pytest.mark.slow
def test_two_runs_in_one_process_do_not_leak_state(tmp_path):
    overrides = SHORT + ["trainer.max_steps=5", "trainer.val_every_n_steps=5", "data.num_examples=120", "logger=wandb"]
    first = run(overrides, output_dir=tmp_path / "a")
    import wandb

    assert wandb.run is None, "the W&B run is closed when training ends"
    second = run(overrides, output_dir=tmp_path / "b")
    assert first.output_dir != second.output_dir
    assert first.final_val == second.final_val  # same config, same seeds: same result, nothing carried over
    ids = [next((d.output_dir / "wandb").glob("offline-run-*")).name for d in (first, second)]
    assert ids[0] != ids[1]


def test_existing_run_dir_is_never_overwritten(short_run):
    from exp.run.dirs import claim_run_dir

    claimed = claim_run_dir(short_run.output_dir)
    assert claimed != short_run.output_dir and claimed.name == short_run.output_dir.name + "_1"
    assert (short_run.output_dir / "adapter" / "adapter_model.safetensors").exists()


def test_gradient_norm_is_the_norm_of_all_gradients_together():
    """The logged train/grad_norm (and the non-finite check's input): one fused norm over every gradient, in
    float32 whatever the gradients' dtype, the same as the per-tensor definition; None without gradients."""
    from exp.training.module import gradient_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in [(4, 8), (8,), (16, 2)]] + [
        torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.randn(5)),  # no gradient: left out
    ]
    for p in params[:4]:
        p.grad = torch.randn_like(p)
    direct = torch.stack([p.grad.float().norm() for p in params[:4]]).norm()
    norm = gradient_norm(params)
    assert norm.dtype == torch.float32 and torch.allclose(norm, direct, rtol=1e-6)
    params[0].grad[0, 0] = float("nan")
    assert not torch.isfinite(gradient_norm(params))
    assert gradient_norm(params[4:]) is None
