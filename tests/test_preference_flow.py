"""SFT, then DPO (docs/objectives.md): `model.adapter` starts a run from an earlier run's adapter (or a PEFT adapter
directory) in its own shape, refusing what cannot fit; `objective.reference=start` scores the reference with a
frozen copy of that adapter; `objective.precompute_reference` scores it once before training, cached, with the
losses of scoring it in every step.

Fast: configs, and one tiny 4-bit model scored without training. Slow: the SFT-then-DPO workflow end to end (an SFT
run, DPO from its directory, a continuation of that DPO run from its step-2 checkpoint)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import compose_typed

from exp.core.config import ConfigError, Reference
from exp.run.compose import write_run_config

PAIRS = ["data.num_examples=40", "data.val_size=8", "hardware.micro_batch_size=4", "trainer.global_batch_size=4"]


def _peft_dir(path: Path, **changes) -> Path:
    """A LoRA adapter_config.json as PEFT writes it (no weights: composing the config reads only this)."""
    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["v_proj", "q_proj", "o_proj"],
              "modules_to_save": None, "bias": "none", "base_model_name_or_path": "somewhere"}  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return path


def test_a_starting_adapter_brings_its_own_shape_and_is_recorded_resolved(tmp_path):
    adapter = _peft_dir(tmp_path / "peft")
    cfg = compose_typed(["objective=dpo", f"model.adapter={adapter}", "lora.r=4", "lora.dropout=0.1"])
    assert cfg.model.adapter == str(adapter.resolve())
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules) == (16, 32, ["o_proj", "q_proj", "v_proj"])
    assert cfg.lora.dropout == 0.1  # the run's own
    assert cfg.reference == Reference.start  # auto: the model at step 0
    assert compose_typed(["objective=dpo"]).reference == Reference.base
    assert compose_typed(["objective=dpo", f"model.adapter={adapter}", "objective.reference=base"]).reference == "base"


def test_the_command_lines_check_leaves_the_shape_warning_to_the_runs_own_log(tmp_path, monkeypatch, caplog):
    """`python -m exp.train` checks the typed config before Hydra sets up the run's log; the warning that a starting
    adapter replaces the config's LoRA shape (given once per process) must come from the run's own composition,
    into train.log, not from that earlier check."""
    import exp.train
    from exp.run.compose import CONF_DIR
    from exp.run.overrides import check_command_line

    adapter = _peft_dir(tmp_path / "peft")  # r 16, where the command line says 4
    monkeypatch.chdir(tmp_path)
    argv = [f"model.adapter={adapter}", "lora.r=4", f"hydra.run.dir={tmp_path / 'run'}"]
    with caplog.at_level("WARNING", logger="exp.run.start_adapter"):
        problems, _ = check_command_line(argv, exp.train.__file__, str(CONF_DIR), "train")
        assert problems == [] and "fixed by its weights" not in caplog.text
        compose_typed(argv[:2])
    assert "fixed by its weights" in caplog.text and "lora.r 4 -> 16" in caplog.text


def test_a_run_directory_resolves_to_its_adapter_and_must_share_the_base(tmp_path):
    run = tmp_path / "sft"
    run.mkdir()
    write_run_config(compose_typed([]), run)
    with pytest.raises(ConfigError, match=r"model.adapter=.*sft: that run has no saved adapter .*its status is"):
        compose_typed([f"model.adapter={run}"])
    _peft_dir(run / "adapter", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    assert compose_typed([f"model.adapter={run}"]).model.adapter == str(run / "adapter")
    with pytest.raises(ConfigError, match=r"another base \(model.seed: 0 there, 3 here\)"):
        compose_typed([f"model.adapter={run}", "model.seed=3"])
    with pytest.raises(ConfigError, match=r"another base"):  # named by its adapter/ folder: the same check
        compose_typed([f"model.adapter={run / 'adapter'}", "model.seed=3"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.adapter=/nonexistent/run"], r"model.adapter=/nonexistent/run: /nonexistent/run does not exist\. "),
        (["model.adapter=."], r"holds neither config.yaml \(a run\) nor adapter_config.json"),
        (["objective=dpo", "objective.reference=start"], r"objective.reference=start without model.adapter"),
        (["objective=kto", "objective.precompute_reference=true"], r"changes with every batch's order"),
        (["objective=orpo", "objective.precompute_reference=true"], r"it has no reference pass"),
    ],
)
def test_what_cannot_work_is_refused_with_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_typed(overrides)


def test_an_adapter_of_another_kind_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"says peft_type IA3; exp trains LoRA adapters"):
        compose_typed([f"model.adapter={_peft_dir(tmp_path / 'ia3', peft_type='IA3')}"])


@pytest.fixture(scope="module")
def start_adapter(tmp_path_factory) -> Path:
    """A PEFT adapter of the tiny model whose B matrices are not zero: a policy that differs from the base."""
    from exp.model.build import build_model

    model = build_model(compose_typed([]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    out = tmp_path_factory.mktemp("start") / "adapter"
    model.save_pretrained(out)
    return out


def _scored(cfg):
    """The model of `cfg` (in eval mode: no dropout), its data module and a few shuffled training batches."""
    from exp.data.datamodule import build_run_datamodule
    from exp.model.build import build_model, build_tokenizer

    model = build_model(cfg).eval()
    datamodule = build_run_datamodule(cfg, build_tokenizer(cfg.model), 0)
    return model, datamodule


def _losses(model, batches, cfg):
    from exp.core.config import LossImpl
    from exp.training.objectives import preference_loss

    with torch.no_grad():
        return [preference_loss(model, b, cfg.objective, LossImpl.hf) for b in batches]


@pytest.mark.parametrize(("reference", "padding_free"), [("start", False), ("base", False), ("base", True)])
def test_precomputed_reference_gives_the_losses_of_the_per_step_pass(start_adapter, reference, padding_free):
    """Also in padding-free rows, which the reference is then scored in too."""
    from exp.core.config import LossImpl
    from exp.training.reference import precompute_reference

    cfg = compose_typed(["objective=dpo", f"model.adapter={start_adapter}", f"objective.reference={reference}", *PAIRS,
                         f"hardware.padding_free={str(padding_free).lower()}"])  # fmt: skip
    model, datamodule = _scored(cfg)
    assert "row_index" in datamodule.train_dataloader().collate_fn(datamodule.train_set[:2]) if padding_free else True
    batches = [datamodule.train_dataloader().collate_fn(datamodule.train_set[i::5][:4]) for i in range(3)]
    batches.append(next(iter(datamodule.val_dataloader())))
    per_step = _losses(model, batches, cfg)
    record = precompute_reference(model, datamodule, cfg, LossImpl.hf, torch.device("cpu"))
    assert not record["reused"]
    batches = [datamodule.train_dataloader().collate_fn(datamodule.train_set[i::5][:4]) for i in range(3)]
    batches.append(next(iter(datamodule.val_dataloader())))
    assert all("ref_logps" in b for b in batches)
    precomputed = _losses(model, batches, cfg)
    for (loss_a, sums_a), (loss_b, sums_b) in zip(per_step, precomputed, strict=True):
        torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=0)
        # (Not the accuracy: at step 0 with reference=start every reward is 0 up to round-off, whose sign decides it.)
        for key in ("rewards_chosen", "rewards_rejected", "logps_chosen"):
            torch.testing.assert_close(sums_b[key], sums_a[key], atol=1e-5, rtol=0)
    # Policy = reference at step 0 only when the reference is the starting adapter; the held-out batch is scored in
    # the same micro-batches either way, so its rewards are exactly 0.
    for _, sums in (per_step[-1], precomputed[-1]):
        assert (sums["rewards_chosen"] == 0) if reference == "start" else (sums["rewards_chosen"] != 0)
    # A second run with the same base, reference and pairs reads the values back.
    _, again = _scored(cfg)
    assert precompute_reference(model, again, cfg, LossImpl.hf, torch.device("cpu"))["reused"]
    assert [e.reference for e in again.train_set] == [e.reference for e in datamodule.train_set]


def test_the_reference_copy_is_frozen_and_the_trained_adapter_stays_active(start_adapter):
    """Where the trainable adapter computes the copy's model with its values (here in eval mode: no dropout), the pass
    copies them in and back, the trainable adapter active throughout. Where it would drop out (training mode,
    lora.dropout 0.05 here), the copy is made the active adapter for the pass instead."""
    from exp.model.build import REFERENCE_ADAPTER
    from exp.training.objectives import reference_model

    cfg = compose_typed(["objective=dpo", f"model.adapter={start_adapter}", *PAIRS])
    model, _ = _scored(cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
    assert any(f".{REFERENCE_ADAPTER}." in n for n, _ in model.named_parameters())
    with torch.no_grad():  # a trained policy: other values than the copy's
        for n, p in model.named_parameters():
            if n in trainable:
                p.add_(0.01)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if n in trainable}
    with reference_model(model):
        assert model.active_adapter == "default"
        params = dict(model.named_parameters())
        copies = {n: p for n, p in params.items() if f".{REFERENCE_ADAPTER}." in n}
        assert copies and all(
            torch.equal(params[n.replace(REFERENCE_ADAPTER, "default")], p) for n, p in copies.items()
        )
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters() if n in trainable)
    model.train()
    with reference_model(model):
        assert model.active_adapter == REFERENCE_ADAPTER
        assert not any(p.requires_grad for p in model.parameters())
    assert model.active_adapter == "default"
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    # graph=True (a compiled model's pass with gradients on): the copy requires gradients while it lasts, so the
    # pass builds the policy's kind of graph; the trained adapter is frozen meanwhile and trainable again after.
    with reference_model(model, graph=True):
        needing = {n for n, p in model.named_parameters() if p.requires_grad}
        assert needing and all(f".{REFERENCE_ADAPTER}." in n for n in needing)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters() if n in trainable)


def test_an_adapter_of_another_shape_stops_the_build_with_the_key(start_adapter, tmp_path):
    """A PEFT directory from elsewhere is checked when it loads: here its weights are of another hidden size."""
    import shutil

    from safetensors.torch import load_file, save_file

    from exp.model.build import build_model

    other = tmp_path / "other"
    shutil.copytree(start_adapter, other)
    weights = load_file(other / "adapter_model.safetensors")
    save_file(
        {k: torch.zeros(v.shape[0], 2 * v.shape[1]) for k, v in weights.items()}, other / "adapter_model.safetensors"
    )
    with pytest.raises(ConfigError, match=r"model.adapter=.*other: the adapter does not fit this base \(size mismatch"):
        build_model(compose_typed(["objective=dpo", f"model.adapter={other}"]))


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


SHORT = ["trainer.sample_count=0", "trainer.log_every_n_steps=1", "logger=csv", *PAIRS]


@pytest.mark.slow
def test_sft_then_dpo_from_the_sft_run(tmp_path):
    """SFT briefly, then DPO from that run's directory: the step-0 rewards are exactly 0 (the reference is the SFT
    policy), the SFT run's files are untouched, the DPO adapter loads with plain PEFT, and a DPO run continued from
    its step-2 checkpoint with the precomputed reference ends with the same adapter as the uninterrupted one."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from exp.model.build import load_base_model
    from exp.train import run

    sft = tmp_path / "sft"
    run([*SHORT, "trainer.max_steps=4", "trainer.learning_rate=5e-3", "lora.r=4"], output_dir=sft)
    before = _digest(sft)
    dpo = [*SHORT, "objective=dpo", f"model.adapter={sft}", "objective.precompute_reference=true",
           "trainer.max_steps=4", "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2"]  # fmt: skip
    run(dpo, output_dir=tmp_path / "dpo")
    assert _digest(sft) == before
    summary = json.loads((tmp_path / "dpo" / "summary.json").read_text())
    assert summary["start_adapter"]["path"] == str(sft / "adapter")
    assert summary["reference"] == "start" and not summary["reference_precomputed"]["reused"]
    first = summary["initial_val"]
    assert first["val/rewards/chosen"] == first["val/rewards/rejected"] == first["val/rewards/margin"] == 0.0
    assert summary["final_val"]["val/rewards/margin"] != 0.0

    trained = load_file(tmp_path / "dpo" / "adapter" / "adapter_model.safetensors")
    start = load_file(sft / "adapter" / "adapter_model.safetensors")
    assert trained.keys() == start.keys()  # the SFT adapter's shape (r=4), without the reference copy
    assert any(not torch.equal(trained[k], start[k]) for k in trained)
    cfg = compose_typed(dpo)
    loaded = PeftModel.from_pretrained(load_base_model(cfg, torch.device("cpu")), str(tmp_path / "dpo" / "adapter"))
    assert loaded.peft_config["default"].r == 4

    resumed = tmp_path / "resumed"
    run([*dpo, f"trainer.resume={tmp_path / 'dpo' / 'checkpoints' / 'step-000002.ckpt'}"], output_dir=resumed)
    assert json.loads((resumed / "summary.json").read_text())["reference_precomputed"]["reused"]
    again = load_file(resumed / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(again[k], trained[k]) for k in trained)
    assert _digest(sft) == before
