"""Padding-free preference micro-batches (`hardware.padding_free` with a preference objective,
exp.data.preference.collate_flat_preference): a micro-batch's completion rows laid end to end in one row, the
decoder's output gathered back into one short row per completion. The loss, the metrics and the LoRA gradients
equal the padded rows' (fp32, the tiny Gemma on the real 4-bit path) for every objective and loss implementation,
and the preflight keeps padding-free pairs on the GPU configuration."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_typed
from test_gpu_objectives import CASES, _model

from exp.core.config import DataConfig, DataFormat, LossImpl
from exp.core.constants import IGNORE_INDEX
from exp.data.padding_free import bucket_length
from exp.data.preference import (
    collate_flat_preference,
    collate_preference,
    encode_rows,
    preference_rows,
    synthetic_rows,
)
from exp.hardware.preflight import Environment, Gpu, check
from exp.model.build import build_tokenizer
from exp.training.objectives import preference_loss

IMPLS = [LossImpl.hf, LossImpl.chunked, LossImpl.liger]


def _examples(cfg, pairs: int):
    unpaired = cfg.objective.kind.value == "kto"
    tokenizer = build_tokenizer(cfg.model)
    data = DataConfig(format=DataFormat.kto if unpaired else DataFormat.preference, max_seq_len=64)
    examples, _ = encode_rows(data, synthetic_rows(DataConfig(num_examples=pairs), unpaired), tokenizer, "synthetic")
    if unpaired:
        examples[0].desirable, examples[1].desirable = True, False
    return examples[:pairs], tokenizer.pad_token_id


def _run(model, batch, cfg, impl: LossImpl):
    model.zero_grad(set_to_none=True)
    batch = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    loss, sums = preference_loss(model, batch, cfg.objective, impl)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), {k: float(v) for k, v in sums.items()}, grads


def test_the_flat_row_holds_every_completion_row_once_with_its_own_positions():
    cfg = compose_typed(["objective=dpo"])
    examples, pad = _examples(cfg, 4)
    rows = preference_rows(examples)
    batch = collate_flat_preference(examples, pad)
    total = sum(len(ids) for ids, _ in rows)
    ids, positions = batch["input_ids"][0], batch["position_ids"][0]
    width = ids.numel()
    assert width == bucket_length(total + 1) and total < width  # at least one padding token
    assert int(batch["real_tokens"]) == total
    # One boundary per row, and the padding tail as a sequence of its own.
    starts = batch["cu_seq_lens_q"].tolist()
    assert len(starts) == len(rows) + 2 and starts[-1] == width
    assert batch["max_length_q"] == max(max(len(r) for r, _ in rows), width - total)
    start = 0
    for r, (row_ids, row_labels) in enumerate(rows):
        n = len(row_ids)
        assert ids[start : start + n].tolist() == row_ids and positions[start : start + n].tolist() == list(range(n))
        assert starts[r] == start
        # The gathered row: the token before the completion, then the completion; its labels shift onto it.
        completion = [x for x in row_labels if x != IGNORE_INDEX]
        span = len(completion)
        assert ids[batch["row_index"][r, : span + 1]].tolist() == row_ids[n - span - 1 :]
        assert batch["labels"][r, 0] == IGNORE_INDEX and batch["labels"][r, 1 : span + 1].tolist() == completion
        assert (batch["labels"][r, span + 1 :] == IGNORE_INDEX).all()
        start += n
    assert (ids[total:] == pad).all() and positions[total:].tolist() == list(range(width - total))
    longest = max(sum(1 for x in lab if x != IGNORE_INDEX) for _, lab in rows)
    assert batch["row_index"].shape == batch["labels"].shape == (len(rows), bucket_length(longest + 1))


@pytest.mark.parametrize("name", ["dpo", "dpo-hinge", "orpo", "simpo", "kto"])
@pytest.mark.parametrize("impl", IMPLS, ids=lambda i: i.value)
def test_flat_pairs_give_the_padded_rows_loss_metrics_and_gradients(name, impl):
    if impl == LossImpl.liger:
        pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (the gpu extra)")
    cfg = compose_typed([*CASES[name], "lora.dropout=0"])
    examples, pad = _examples(cfg, 4)
    padded, flat = collate_preference(examples, pad), collate_flat_preference(examples, pad)
    model = _model(cfg, torch.device("cpu"))
    loss, sums, grads = _run(model, padded, cfg, impl)
    f_loss, f_sums, f_grads = _run(model, flat, cfg, impl)
    assert f_loss.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert f_sums.keys() == sums.keys()
    for k, v in sums.items():
        assert f_sums[k] == pytest.approx(v, rel=1e-5, abs=1e-5), k
    assert f_grads.keys() == grads.keys()
    for n, g in grads.items():
        assert torch.allclose(f_grads[n], g, rtol=1e-4, atol=1e-6), n
    assert any(g.abs().sum() > 0 for g in grads.values())


def _h200() -> Environment:
    return Environment(torch_cuda="13.0", gpus=[Gpu("NVIDIA H200", 143 * 2**30, 140 * 2**30, (9, 0))])


def test_the_preflight_keeps_pairs_padding_free_on_the_gpu_and_sizes_micro_batches_by_pairs():
    cfg = compose_typed(["objective=dpo", "hardware=gpu", "model=gemma_7b", "data.max_seq_len=1024",
                         "trainer.global_batch_size=8", "hardware.memory_budget_gib=69.31"])  # fmt: skip
    result = check(cfg, _h200())
    hw = result.cfg.hardware
    assert hw.padding_free and hw.micro_batch_tokens is None
    assert result.cfg.model.attn_implementation == "varlen"
    assert 8 % hw.micro_batch_size == 0
    assert any(n.startswith("hardware.auto_micro_batch: micro-batch ") for n in result.notes), result.notes


@pytest.mark.parametrize("objective", ["sft", "dpo", "kto", "orpo", "simpo"])
def test_fuse_lora_auto_adds_lora_after_the_base_product_for_objectives_with_a_reference(objective):
    """hardware=gpu's hardware.fuse_lora=auto is on where no reference pass compares with the policy, and off, with
    a note, for DPO and KTO; an explicit true is kept."""
    cfg = compose_typed([f"objective={objective}", "hardware=gpu", "model=gemma_2b", "data.max_seq_len=512"])
    assert cfg.hardware.fuse_lora == "auto"
    result = check(cfg, _h200())
    with_reference = objective in ("dpo", "kto")
    assert result.cfg.hardware.fuse_lora is not with_reference
    noted = [n for n in result.notes if "hardware.fuse_lora=auto -> false" in n]
    assert len(noted) == with_reference, result.notes
    explicit = compose_typed([f"objective={objective}", "hardware=gpu", "model=gemma_2b", "hardware.fuse_lora=true"])
    assert check(explicit, _h200()).cfg.hardware.fuse_lora is True


def test_eager_attention_keeps_padded_pairs_with_a_note():
    cfg = compose_typed(["objective=dpo", "hardware=gpu", "model=gemma2_2b", "data.max_seq_len=512"])
    result = check(cfg, _h200())
    assert not result.cfg.hardware.padding_free
    assert any("eager" in n and "hardware.padding_free=true is not used" in n for n in result.notes), result.notes


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dpo", "orpo", "kto"])
@pytest.mark.parametrize("impl", [LossImpl.chunked, LossImpl.liger], ids=lambda i: i.value)
def test_flat_pairs_through_varlen_attention_on_the_gpu(name, impl):
    """On CUDA the flat row takes FlashAttention's varlen kernel (exp.model.varlen) and padded rows SDPA with their
    mask: the same loss and gradients within bf16's rounding."""
    cfg = compose_typed([*CASES[name], "lora.dropout=0", "model.attn_implementation=varlen"])
    examples, pad = _examples(cfg, 8)
    model = _model(cfg, torch.device("cuda"))

    def on_gpu(batch):
        return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, sums, grads = _run(model, on_gpu(collate_preference(examples, pad)), cfg, impl)
        f_loss, f_sums, f_grads = _run(model, on_gpu(collate_flat_preference(examples, pad)), cfg, impl)
    assert f_loss.item() == pytest.approx(loss.item(), rel=2e-2, abs=1e-3)
    assert f_sums["accuracy"] == sums["accuracy"]
    for k in ("logps_chosen", "logps_rejected"):
        assert f_sums[k] == pytest.approx(sums[k], rel=2e-2), k
    cosine = [torch.nn.functional.cosine_similarity(f_grads[n].flatten().float(), g.flatten().float(), dim=0)
              for n, g in grads.items() if g.abs().sum() > 0]  # fmt: skip
    assert cosine and min(cosine) > 0.99, min(cosine)
