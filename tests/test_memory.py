"""The memory estimator's arithmetic: exact byte counts for hand-computed shapes, the scaling laws each term must obey,
the micro-batch search, and every model option of conf/ going through `estimate_for_config`.

Fast: no model is built, nothing touches a device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT, compose_typed

from exp.hardware import memory
from exp.hardware.memory import (
    GiB,
    MemoryEstimate,
    estimate_for_config,
    estimate_memory,
    largest_micro_batch,
    lora_param_count,
    suggest_micro_batch,
)
from exp.model import loss

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))

# A small GQA architecture whose numbers are easy to follow by hand: q_dim = 4 x 32 = 128, kv_dim = 2 x 32 = 64.
SMALL = dict(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
GEMMA_7B = dict(
    vocab_size=256000,
    hidden_size=3072,
    intermediate_size=24576,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=256,
)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def est(arch=SMALL, **kw) -> MemoryEstimate:
    args = dict(
        quant_type="nf4",
        double_quant=True,
        lora_r=8,
        lora_targets=["q_proj", "v_proj"],
        micro_batch_size=1,
        seq_len=16,
        gradient_checkpointing=False,
    )
    args.update(kw)
    return estimate_memory(arch, **args)


# --- weights ---------------------------------------------------------------------------------------------------------

# Decoder Linear sizes of SMALL, per layer: q 128x128 = 16384, k 128x64 = 8192, v 8192, o 16384,
# gate / up / down 128x512 = 65536 each -> 245760 weights per layer, 491520 in the 2 layers.


def test_4bit_weight_bytes_exact_without_double_quant():
    # 0.5 byte per weight + one fp32 absmax per 64 weights (every size here is a multiple of 64).
    assert est(double_quant=False).quantized_weights == 491520 // 2 + 4 * 491520 // 64 == 276480
    assert est(quant_type="fp4", double_quant=False).quantized_weights == 276480


def test_4bit_weight_bytes_exact_with_double_quant():
    # Per layer: packed 245760 / 2 = 122880; one uint8 absmax per 64 weights: 3840; one fp32 absmax per 256 blocks:
    # q, k, v, o have 256, 128, 128, 256 blocks (1 group each), gate / up / down 1024 blocks (4 groups each) ->
    # 16 groups x 4 B = 64; plus the nested code table (256 fp32) and offset (fp32) per Linear: 7 x 1028 = 7196.
    per_layer = 122880 + 3840 + 64 + 7196
    assert est().quantized_weights == 2 * per_layer == 267960


def test_double_quant_is_smaller_than_single():
    assert (
        est(arch=GEMMA_7B, double_quant=True).quantized_weights
        < est(arch=GEMMA_7B, double_quant=False).quantized_weights
    )


def test_int8_weights_about_twice_nf4():
    ratio = est(arch=GEMMA_7B, quant_type="int8").quantized_weights / est(arch=GEMMA_7B).quantized_weights
    assert 1.8 < ratio < 2.1


def test_unquantized_weights_in_compute_dtype_and_embedding_never_quantized():
    n = 491520
    assert est(quant_type="none").quantized_weights == 2 * n
    assert est(quant_type="none", compute_bytes=4).quantized_weights == 4 * n
    for q in ("nf4", "int8", "none"):
        assert est(quant_type=q).embeddings == 1000 * 128 * 2  # bf16, tied to lm_head: counted once
    assert est(compute_bytes=4).embeddings == 1000 * 128 * 4


# --- LoRA ------------------------------------------------------------------------------------------------------------


def test_lora_param_count_exact():
    # r = 8: q_proj 8 x (128 + 128) = 2048, v_proj 8 x (128 + 64) = 1536 -> 3584 per layer, 2 layers.
    assert lora_param_count(SMALL, 8, ["q_proj", "v_proj"]) == 7168
    e = est()
    assert e.lora_params == e.lora_grads == 4 * 7168  # fp32
    assert e.optimizer_state == 8 * 7168  # AdamW exp_avg + exp_avg_sq, fp32
    assert est(optimizer="paged_adamw_32bit").optimizer_state == 8 * 7168
    assert est(optimizer="paged_adamw_8bit").optimizer_state < 3 * 7168


def test_a_lora_on_the_head_is_counted_once_and_other_modules_are_refused():
    # The head: A is r x hidden, B is vocab x r, once in the model: 8 x (128 + 1000) beside q and v's 7168.
    targets = ["q_proj", "v_proj", "lm_head"]
    assert lora_param_count(SMALL, 8, targets) == 7168 + 8 * 1128
    base, head = est(), est(lora_targets=targets)
    assert head.lora_params - base.lora_params == 4 * 8 * 1128
    assert head.optimizer_state - base.optimizer_state == 8 * 8 * 1128
    # Saved for its backward: its input (bf16, T x hidden), lora_A's output (T x r), the bf16 casts of A and B.
    assert head.details["head_lora_bytes"] == 2 * 16 * 128 + 2 * 16 * 8 + 2 * 8 * 1128
    assert base.details["head_lora_bytes"] == 0
    with pytest.raises(ValueError, match=r"\['embed_tokens'\] match no linear layer .* Allowed: q_proj, .*, lm_head"):
        est(lora_targets=["q_proj", "embed_tokens"])


def test_modules_to_save_head_adds_a_trainable_table():
    base, head = est(), est(modules_to_save=["lm_head"])
    assert head.lora_params - base.lora_params == 4 * 1000 * 128
    assert head.optimizer_state - base.optimizer_state == 8 * 1000 * 128


# --- activations and logits ------------------------------------------------------------------------------------------


def test_layer_activations_exact_for_hand_derivation():
    # SMALL, 16 tokens, bf16 (2 B), LoRA r8 on q and v without dropout, SDPA, per layer:
    #   norms: 2 norms x fp32 copy of T x hidden: 2 x 4 x 16 x 128                       = 16384
    #   LoRA: shared q/v input 2 x 16 x 128 = 4096, lora_A outputs 2 x 2 x 16 x 8 = 512,
    #         bf16 casts of the 3584 fp32 adapter weights 2 x 3584 = 7168               = 11776
    #   attention: q, k, v, out 2 x 16 x (128 + 64 + 64 + 128) = 12288, lse 4 x 16 x 4 = 256 = 12544
    #   MLP: gate out, up out, gelu out: 3 x 2 x 16 x 512                               = 49152
    per_layer = 16384 + 11776 + 12544 + 49152
    e = est()
    assert e.details["layers_saved_bytes"] == 2 * per_layer == 179712
    # Peak at the start of backward: all layers + the final norm's fp32 input copy + 12 B x T x V of loss tensors.
    assert e.peak_phase == "loss"
    assert e.logits_and_loss == 12 * 16 * 1000
    assert e.activations == 2 * per_layer + 4 * 16 * 128


def test_logits_scale_linearly_in_micro_batch_and_vocab():
    big_vocab = dict(SMALL, vocab_size=32000)
    one = est(arch=big_vocab, micro_batch_size=1).logits_and_loss
    assert one == 12 * 16 * 32000
    for b in (2, 3, 8):
        assert est(arch=big_vocab, micro_batch_size=b).logits_and_loss == b * one
    assert est(arch=dict(big_vocab, vocab_size=64000)).logits_and_loss == 2 * one
    # Gemma 2's final-logit softcapping keeps the tanh output (bf16) for its backward.
    assert est(arch=big_vocab, family="gemma2", attn_implementation="eager").logits_and_loss == 14 * 16 * 32000


def test_checkpointing_reduces_activations():
    kw = dict(arch=GEMMA_7B, micro_batch_size=4, seq_len=2048, lora_targets=ALL, lora_r=16)
    full, ckpt = est(gradient_checkpointing=False, **kw), est(gradient_checkpointing=True, **kw)
    assert ckpt.activations < full.activations / 10
    assert ckpt.total < full.total
    # Checkpointing keeps each layer's input (bf16 T x hidden) + the final norm's fp32 copy.
    t = 4 * 2048
    assert ckpt.activations == 28 * 2 * t * 3072 + 4 * t * 3072
    assert ckpt.logits_and_loss == full.logits_and_loss


def test_fused_and_chunked_loss_hold_one_chunk_of_logits():
    # SMALL with 1000 tokens (micro-batch 8 x 125), bf16: hidden states H and their stored gradient (2 x 2 B x T x 128)
    # and an fp32 per-token value (4 B x T) around the chunk.
    around = 2 * 2 * 1000 * 128 + 4 * 1000
    kw = dict(micro_batch_size=8, seq_len=125, compute_bytes=2)
    # chunked: CHUNK_LOGIT_BYTES / (4 x 1000) tokens per chunk > 1000, so one chunk of all tokens: its bf16 logits,
    # the fp32 copy and the logsumexp temporary (2 + 4 + 4 bytes per entry).
    assert est(loss_impl="chunked", **kw).details["loss_bytes"] == around + 1000 * 1000 * 10
    # liger: chunks of up to LIGER_CHUNK_LOGIT_BYTES of logits, so one chunk of all 1000 tokens here, its bf16
    # logits overwritten in place by their gradient.
    assert est(loss_impl="liger", **kw).details["loss_bytes"] == around + 1000 * 1000 * 2
    assert memory.CHUNK_LOGIT_BYTES == loss.CHUNK_LOGIT_BYTES


def test_fused_loss_removes_the_vocabulary_term_of_gemma_7b():
    kw = dict(arch=GEMMA_7B, micro_batch_size=8, seq_len=2048, lora_targets=ALL, lora_r=16, gradient_checkpointing=True)
    hf, chunked, liger = (est(loss_impl=impl, **kw) for impl in ("hf", "chunked", "liger"))
    assert hf.logits_and_loss == 12 * 8 * 2048 * 256000  # ~47 GiB
    assert chunked.logits_and_loss < GiB and liger.logits_and_loss < GiB
    assert hf.total - chunked.total > 40 * GiB  # the peak moves to a layer's backward
    with pytest.raises(ValueError, match="loss_impl"):
        est(loss_impl="fused")


def test_checkpoint_layers_interpolates_between_none_and_all():
    kw = dict(arch=GEMMA_7B, micro_batch_size=4, seq_len=2048, lora_targets=ALL, lora_r=16, loss_impl="chunked")
    none, full = est(gradient_checkpointing=False, **kw), est(gradient_checkpointing=True, **kw)
    assert est(gradient_checkpointing=True, checkpoint_layers=0, **kw).total == none.total
    assert est(gradient_checkpointing=True, checkpoint_layers=28, **kw).total == full.total
    assert est(gradient_checkpointing=False, checkpoint_layers=5, **kw).total == none.total  # off means off
    peaks = [est(gradient_checkpointing=True, checkpoint_layers=k, **kw).allocated for k in range(29)]
    assert all(a > b for a, b in zip(peaks[:27], peaks[1:28], strict=True))
    # Recomputing the last layer too saves nothing: its recompute is needed at once, and its input is kept besides.
    assert peaks[28] - peaks[27] == 2 * 4 * 2048 * 3072
    # Each recomputed layer trades what it saves for its bf16 input (T x hidden).
    saved = sum(none.details["layer_saved_parts"]["global"].values())
    one = est(gradient_checkpointing=True, checkpoint_layers=1, **kw)
    assert none.details["checkpointed_layers"] == 0 and one.details["checkpointed_layers"] == 1
    assert none.activations - one.activations == saved - 2 * 4 * 2048 * 3072


def test_lora_dropout_adds_masks_and_copies():
    assert est(lora_dropout=0.05).activations > est(lora_dropout=0.0).activations


def test_eager_attention_keeps_quadratic_scores():
    kw = dict(family="gemma2", arch=dict(SMALL, vocab_size=256000), seq_len=1024)
    sdpa, eager = est(attn_implementation="sdpa", **kw), est(attn_implementation="eager", **kw)
    assert eager.activations - sdpa.activations > 2 * 4 * 1024 * 1024 * 4  # > fp32 softmax of 2 layers


def test_small_vocab_peaks_in_a_layer_backward():
    e = est(arch=dict(SMALL, vocab_size=16), gradient_checkpointing=True, seq_len=512, micro_batch_size=8)
    assert e.peak_phase == "layer_backward"
    assert e.logits_and_loss == 0
    assert e.activations > 0


def test_num_shards_divides_weights_not_logits():
    kw = dict(arch=GEMMA_7B, micro_batch_size=8, seq_len=2048, lora_targets=ALL, lora_r=16, gradient_checkpointing=True)
    one, two = est(**kw), est(num_shards=2, **kw)
    assert two.quantized_weights == pytest.approx(one.quantized_weights / 2, abs=1)
    assert two.embeddings == pytest.approx(one.embeddings / 2, abs=1)
    assert two.lora_params == pytest.approx(one.lora_params / 2, abs=1)
    assert two.optimizer_state == pytest.approx(one.optimizer_state / 2, abs=1)
    assert two.logits_and_loss == one.logits_and_loss
    assert two.activations == one.activations
    assert one.fsdp_buffers == 0 < two.fsdp_buffers


def test_estimate_object_api():
    e = est()
    assert e.total == sum(getattr(e, f) for f in MemoryEstimate.byte_fields())
    assert e.allocated == e.total - e.workspace
    assert e.workspace >= GiB // 2
    d = e.to_dict()
    assert d["total"] == e.total and d["quantized_weights"] == e.quantized_weights
    table = e.as_table()
    assert "GiB" in table and "logits_and_loss" in table and "total" in table


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match="quant_type"):
        est(quant_type="nf2")
    with pytest.raises(ValueError, match="vocab_size"):
        est(arch={k: v for k, v in SMALL.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="optimizer"):
        est(optimizer="sgd")


# --- the micro-batch search ------------------------------------------------------------------------------------------


def test_largest_micro_batch_fits_and_next_does_not():
    kw = dict(
        quant_type="nf4",
        double_quant=True,
        lora_r=16,
        lora_targets=ALL,
        seq_len=2048,
        gradient_checkpointing=True,
    )
    previous = 0
    for gib in (4, 8, 16, 24, 40, 80, 141, 500):
        budget = gib * GiB
        b = largest_micro_batch(GEMMA_7B, budget, **kw)
        assert b >= previous  # monotone in the budget
        previous = b
        if b:
            assert estimate_memory(GEMMA_7B, micro_batch_size=b, **kw).total <= budget
        assert estimate_memory(GEMMA_7B, micro_batch_size=b + 1, **kw).total > budget
    assert largest_micro_batch(GEMMA_7B, 4 * GiB, **kw) == 0  # the weights alone do not fit
    assert previous > 8


# --- from the composed configuration ---------------------------------------------------------------------------------


# What the preflight resolves `hardware=gpu`'s automatic precision and compile to on a CUDA GPU: the estimator takes
# resolved configs only.
GPU_RESOLVED = ["hardware=gpu", "hardware.precision=bf16-mixed", "hardware.compile=true"]


@pytest.mark.parametrize("model", MODELS)
def test_estimate_for_every_model_option(model: str):
    cfg = compose_typed([f"model={model}", *GPU_RESOLVED])
    e = estimate_for_config(cfg)
    assert e.total > e.workspace > 0
    assert e.quantized_weights > 0 and e.embeddings > 0 and e.lora_params > 0
    if model == "gemma_tiny":  # no vocab_size in its arch: the local tokenizer's 512 entries
        assert e.embeddings == 512 * cfg.model.arch["hidden_size"] * 2
    else:
        assert e.embeddings == cfg.model.arch["vocab_size"] * cfg.model.arch["hidden_size"] * 2


def test_estimate_for_default_cpu_config_uses_fp32():
    cfg = compose_typed([])
    e = estimate_for_config(cfg)
    assert e.embeddings == 512 * cfg.model.arch["hidden_size"] * 4  # "32-true"


def test_gemma_7b_qlora_recipe_is_plausible():
    overrides = [
        "model=gemma_7b",
        *GPU_RESOLVED,
        "lora=all_linear",
        "lora.r=16",
        "data.max_seq_len=2048",
        "hardware.micro_batch_size=8",
        "hardware.gradient_checkpointing=true",
    ]
    e = estimate_for_config(compose_typed([*overrides, "hardware.loss_impl=hf"]))
    assert 40 * GiB < e.total < 70 * GiB
    assert e.peak_phase == "loss" and e.logits_and_loss > e.total / 2  # the 256k-vocabulary loss dominates
    # The default loss on a GPU (liger or chunked) never holds the logits: the peak is a layer's backward.
    fast = estimate_for_config(compose_typed(overrides))
    assert fast.details["loss_impl"] in ("liger", "chunked") and fast.peak_phase == "layer_backward"
    assert fast.total < 20 * GiB


def test_suggest_micro_batch_for_config():
    cfg = compose_typed(["model=gemma_7b", *GPU_RESOLVED, "data.max_seq_len=2048"])
    b = suggest_micro_batch(cfg, 80 * GiB)
    assert b >= 1
    cfg.hardware.micro_batch_size = b
    assert estimate_for_config(cfg).total <= 80 * GiB
    cfg.hardware.micro_batch_size = b + 1
    assert estimate_for_config(cfg).total > 80 * GiB
    assert suggest_micro_batch(cfg, 1 * GiB) == 0


def test_compiled_layers_match_the_h200_bench():
    """Compiled layers (hardware.compile): the GeGLU saves two T x I tensors instead of three and the norms their
    c-byte input; against the peaks exp.bench measured on an H200 (benchmarks/results/bench-gemma_7b-2048x8-20261201-162521)."""
    import json

    from exp.bench.baseline_loop import ALL_PROJECTIONS

    arch = memory.config_arch(compose_typed(["model=gemma_7b", "model.random_init=true"]))
    common = dict(quant_type="nf4", double_quant=True, lora_r=16, lora_targets=ALL_PROJECTIONS, micro_batch_size=8,
                  seq_len=2048, loss_impl="liger", compute_bytes=2)  # fmt: skip
    eager = estimate_memory(arch, gradient_checkpointing=False, **common)
    compiled = estimate_memory(arch, gradient_checkpointing=False, compiled=True, **common)
    t, c = 8 * 2048, 2
    e_parts, c_parts = eager.details["layer_saved_parts"]["global"], compiled.details["layer_saved_parts"]["global"]
    assert e_parts["mlp"] - c_parts["mlp"] == c * t * arch["intermediate_size"]
    assert c_parts["norms"] == 2 * c * t * arch["hidden_size"] and e_parts["norms"] == 2 * 4 * t * arch["hidden_size"]
    # The run with both a partly recomputed (14 of 28 layers) and a no-recompute compiled row at micro-batch 8.
    result = ROOT / "benchmarks" / "results" / "bench-gemma_7b-2048x8-20261201-162521.json"
    rows = {r["variant"]: r for r in json.loads(result.read_text())["rows"]}
    for name, layers in (("exp", 14), ("exp hardware.memory_budget_gib=null", 0)):
        row = rows[name]
        assert row["checkpoint_layers"] == layers and row["compile"] is True
        est = estimate_memory(
            arch, gradient_checkpointing=layers > 0, checkpoint_layers=layers, compiled=True, **common
        )
        assert est.allocated / GiB == pytest.approx(row["peak_memory_gib"], rel=0.01)


@pytest.mark.parametrize(
    "tokens, vocab, hidden",
    [(4800, 256000, 3072), (16384, 256000, 3072), (300, 256000, 2048), (65536, 262144, 1152), (1000, 1000, 128)],
)
def test_liger_chunks_are_few_and_their_logits_bounded(tokens, vocab, hidden):
    """exp asks liger for chunks of about LIGER_CHUNK_LOGIT_BYTES of bf16 logits, not liger's default of
    ceil(vocab / hidden) chunks whatever the tokens (84 of 64 tokens for 4,800 tokens at Gemma-7B's head); the chunk
    follows liger's own rule, next_power_of_2(tokens / ceil(vocab / (mem_const x hidden))), so it is at most twice the
    budget."""
    from exp.model.loss_plan import LIGER_CHUNK_LOGIT_BYTES, liger_chunks

    def liger_chunk(mem_const: int) -> int:  # liger_kernel.ops.fused_linear_cross_entropy's chunk_size
        per_piece = -(-tokens // -(-vocab // (mem_const * hidden)))
        return min(tokens, 1 << (per_piece - 1).bit_length())

    chunks = liger_chunks(tokens, vocab, hidden, 2)
    assert chunks.tokens == liger_chunk(chunks.mem_const)
    assert chunks.tokens * vocab * 2 <= 2 * LIGER_CHUNK_LOGIT_BYTES or chunks.tokens == tokens
    # Thick matmuls (a thousand tokens or all of them) and fewer reads of the head than liger's default.
    assert chunks.tokens >= min(tokens, 1024) and chunks.tokens >= liger_chunk(1)
