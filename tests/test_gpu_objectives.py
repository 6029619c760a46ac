"""liger-kernel's chunked preference losses (`hardware.loss_impl=liger`) against exp's own path (`chunked`) on the
same model and pairs: the batch's loss, the metrics exp records and the LoRA gradients, for DPO (its liger loss
types), ORPO, SimPO and KTO; and a preference run killed on the GPU resumes exactly.

liger's chunked losses are plain torch (torch.func, optionally torch.compile): on the CPU, where liger-kernel is
installed, they run eagerly in fp32 and must agree tightly; on the GPU, compiled and under bf16 autocast, within
bf16's rounding. The tiny Gemma on the real 4-bit path, its LoRA B moved off zero so the policy is not the
reference.
"""

from __future__ import annotations

import signal

import pytest
import torch
from conftest import compose_typed

from exp.core.config import DataConfig, DataFormat, LossImpl
from exp.data.preference import collate_preference, encode_rows, synthetic_rows
from exp.model.build import build_model, build_tokenizer
from exp.model.loss_plan import plan_loss_impl, preference_liger_gap
from exp.training.objectives import preference_loss

CASES = {
    "dpo": ["objective=dpo"],
    "dpo-hinge": ["objective=dpo", "objective.dpo_loss=hinge"],
    "dpo-robust": ["objective=dpo", "objective.dpo_loss=robust", "objective.label_smoothing=0.1"],
    "orpo": ["objective=orpo"],
    "simpo": ["objective=simpo", "objective.label_smoothing=0.1"],
    "kto": ["objective=kto"],
}
METRICS = ("loss", "rewards_chosen", "rewards_rejected", "accuracy", "logps_chosen", "logps_rejected")


def _batch(cfg, pairs: int) -> dict[str, torch.Tensor]:
    """`pairs` of the generated preference rows (KTO: labelled completions), collated as the data module does."""
    unpaired = cfg.objective.kind.value == "kto"
    tokenizer = build_tokenizer(cfg.model)
    data = DataConfig(format=DataFormat.kto if unpaired else DataFormat.preference, max_seq_len=64)
    examples, _ = encode_rows(data, synthetic_rows(DataConfig(num_examples=pairs), unpaired), tokenizer, "synthetic")
    if unpaired:  # both kinds in the batch
        examples[0].desirable, examples[1].desirable = True, False
    return collate_preference(examples[:pairs], tokenizer.pad_token_id)


def _model(cfg, device: torch.device):
    model = build_model(cfg, device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # zero at init: the policy would be the reference
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _run(model, batch, cfg, impl: LossImpl, autocast: torch.dtype | None):
    """The loss, the metric sums and the LoRA gradients of one micro-batch."""
    model.zero_grad(set_to_none=True)
    device = next(p for p in model.parameters() if p.requires_grad).device
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        loss, sums = preference_loss(model, batch, cfg.objective, impl)
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach().float(), {k: float(v) for k, v in sums.items()}, grads


def _compare(name: str, device: str, autocast: torch.dtype | None, pairs: int = 4, overrides: tuple[str, ...] = ()):
    cfg = compose_typed([*CASES[name], "lora.dropout=0", *overrides])  # no dropout: both passes see the same model
    batch = _batch(cfg, pairs)
    model = _model(cfg, torch.device(device))
    return _run(model, batch, cfg, LossImpl.chunked, autocast), _run(model, batch, cfg, LossImpl.liger, autocast)


@pytest.mark.parametrize("name", CASES)
def test_liger_preference_losses_equal_exps_on_the_cpu_in_fp32(name):
    pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (the gpu extra)")
    (loss, sums, grads), (f_loss, f_sums, f_grads) = _compare(name, "cpu", None)
    assert f_loss.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert f_sums.keys() == sums.keys()
    for k in sums:
        assert f_sums[k] == pytest.approx(sums[k], rel=1e-4, abs=1e-5), k
    assert sums["accuracy"] not in (0, sums["pairs"]) or name == "kto"  # the batch has both outcomes to get right
    assert f_grads.keys() == grads.keys()
    total = torch.cat([g.flatten() for g in grads.values()])
    assert total.norm() > 0
    diff = torch.cat([(f_grads[k] - grads[k]).flatten() for k in grads])
    assert diff.norm() <= 1e-4 * total.norm(), (diff.norm(), total.norm())


def test_liger_is_planned_only_where_it_computes_exps_objective():
    def plan(*overrides):
        return plan_loss_impl(compose_typed(["hardware=gpu", *overrides]), on_cuda=True)  # loss_impl=auto

    assert preference_liger_gap(compose_typed(["objective=dpo"])) is None
    assert "ipo" in preference_liger_gap(compose_typed(["objective=dpo", "objective.dpo_loss=ipo"]))
    assert "weights" in preference_liger_gap(compose_typed(["objective=kto", "objective.desirable_weight=2"]))
    assert "softcap" in preference_liger_gap(compose_typed(["objective=orpo", "model=gemma2_2b"]))
    try:
        import liger_kernel  # noqa: F401  (whether the plan can pick liger at all here)
    except ImportError:
        return
    assert plan("objective=dpo").impl == LossImpl.liger
    assert plan("objective=dpo", "objective.dpo_loss=ipo").impl == LossImpl.chunked
    assert plan("objective=orpo", "model=gemma2_2b").impl == LossImpl.chunked


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_liger_preference_losses_equal_exps_on_the_gpu_within_bf16(name):
    """Compiled liger against exp's chunked path, both under bf16 autocast: the loss within 1%, the gradient within
    2% of its norm (bf16 logits: an ulp is 0.4-0.8% of a value; the two sum in different orders)."""
    gpu = ("hardware=gpu", "hardware.precision=bf16-mixed")  # the model as a GPU run builds it
    (loss, sums, grads), (f_loss, f_sums, f_grads) = _compare(name, "cuda", torch.bfloat16, pairs=8, overrides=gpu)
    assert f_loss.item() == pytest.approx(loss.item(), rel=1e-2, abs=1e-3)
    for k in METRICS:
        if k != "accuracy":
            assert f_sums[k] == pytest.approx(sums[k], rel=2e-2, abs=2e-2), k
    total = torch.cat([g.flatten() for g in grads.values()])
    diff = torch.cat([(f_grads[k] - grads[k]).flatten() for k in grads])
    assert diff.norm() <= 2e-2 * total.norm(), (diff.norm(), total.norm())


def _exp_pair_loss(hidden, weight, labels, o, ref_hidden):
    """exp's own path on the same hidden states: chunked_sequence_logps, then the loss as
    exp.training.objectives.preference_loss composes it (DPO over sums, ORPO over per-token means plus the NLL)."""
    from exp.model.preference import average_logps, chunked_sequence_logps, dpo_loss, orpo_loss

    sums, counts = chunked_sequence_logps(hidden, weight, labels)
    half = labels.shape[0] // 2
    if o.kind.value == "dpo":
        with torch.no_grad():
            ref = chunked_sequence_logps(ref_hidden, weight, labels)[0]
        return dpo_loss(sums[:half], sums[half:], ref[:half], ref[half:], beta=o.beta).losses.mean()
    mean = average_logps(sums, counts)
    return -mean[:half].mean() + orpo_loss(mean[:half], mean[half:], beta=o.beta).losses.mean()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_liger_preference_loss_at_the_gemma_7b_head_shape(kind):
    """The bench's shape (Gemma-7B's 256k x 3072 head, 8 pairs at 1,024 tokens a side, prompts and padding masked):
    liger's loss and gradient against exp's chunked path under bf16 autocast, and the memory each adds over its
    inputs while it runs (printed: what the memory estimate's preference loss term should count)."""
    from exp.core.config import Objective, ObjectiveConfig
    from exp.core.constants import IGNORE_INDEX
    from exp.model.preference import fused_pair_loss

    torch.manual_seed(0)
    pairs, length, vocab, width = 8, 1024, 256000, 3072
    weight = torch.randn(vocab, width, device="cuda", dtype=torch.bfloat16) * 0.02
    labels = torch.randint(0, vocab, (2 * pairs, length), device="cuda")
    labels[:, :100] = IGNORE_INDEX  # the prompt
    labels[1::2, 700:] = IGNORE_INDEX  # padding of the shorter rows
    hidden = torch.randn(2 * pairs, length, width, device="cuda", dtype=torch.bfloat16)
    ref = hidden + 0.05 * torch.randn_like(hidden)
    o = ObjectiveConfig(kind=Objective(kind))
    results = {}
    for name in ("exp", "liger"):
        h = hidden.clone().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name == "liger":
                loss = fused_pair_loss(h, weight, labels, o, ref if kind == "dpo" else None).loss
            else:
                loss = _exp_pair_loss(h, weight, labels, o, ref)
        loss.backward()
        torch.cuda.synchronize()
        results[name] = (loss.float().item(), h.grad.float(), torch.cuda.max_memory_allocated() - before)
    (exp_loss, exp_grad, exp_peak), (liger_loss, liger_grad, liger_peak) = results["exp"], results["liger"]
    print(f"{kind} at 8 pairs x 1024: loss exp {exp_loss:.6f} liger {liger_loss:.6f}; peak over inputs exp "
          f"{exp_peak / 2**30:.2f} GiB, liger {liger_peak / 2**30:.2f} GiB")  # fmt: skip
    assert liger_loss == pytest.approx(exp_loss, rel=1e-2)
    assert (liger_grad - exp_grad).norm() <= 2e-2 * exp_grad.norm()
    # Never the batch's log-probabilities (16 rows x 1,024 x 256k in fp32: 16 GiB, what the hand-written loop holds
    # for its backward): one pair's logits at a time.
    assert liger_peak < 16 * 2**30, liger_peak


@pytest.mark.gpu
@pytest.mark.slow
def test_dpo_killed_on_the_gpu_then_resumed_ends_where_an_uninterrupted_run_ends(tmp_path):
    """SIGKILL after step 6 of a 12-step DPO run on the GPU (liger's loss, the reference with the adapters off),
    then `trainer.resume=auto`: every step's loss and the final adapters equal the uninterrupted run's (bitwise, or
    within 1e-6 relative: GPU kernels may sum in another order after a restart)."""
    from test_resume import adapter, cli, interrupted, losses

    run = [
        "objective=dpo", "hardware=gpu", "hardware.auto_micro_batch=false", "hardware.micro_batch_size=4",
        "hardware.auto_checkpoint_layers=false", "hardware.auto_dequantized_layers=false", "hardware.compile=false",
        "trainer.global_batch_size=8", "trainer.max_steps=12", "trainer.warmup_steps=0", "trainer.val_every_n_steps=6",
        "trainer.checkpoint_every_n_steps=3", "trainer.log_every_n_steps=1", "trainer.sample_count=0",
        "data.num_examples=200", "logger=csv",
    ]  # fmt: skip
    whole = cli(tmp_path, *run, "hydra.run.dir=whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "training loss: liger" in (tmp_path / "whole" / "train.log").read_text()
    killed = interrupted(tmp_path, "killed", signal.SIGKILL, "step-000006.ckpt", *run)
    assert killed.returncode == -signal.SIGKILL
    resumed = cli(tmp_path, *run, "trainer.resume=auto", "hydra.run.dir=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref, got = losses(tmp_path / "whole"), losses(tmp_path / "killed", tmp_path / "resumed")
    assert sorted(got) == sorted(ref) == list(range(1, 13))
    assert all(got[s] == pytest.approx(ref[s], rel=1e-6) for s in ref), (got, ref)
    a, b = adapter(tmp_path / "whole"), adapter(tmp_path / "resumed")
    assert a.keys() == b.keys()
    worst = max(((a[k].float() - b[k].float()).norm() / a[k].float().norm().clamp_min(1e-30)).item() for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a) or worst <= 1e-6, worst
