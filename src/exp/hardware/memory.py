"""Predict the peak GPU memory of one training step, per device, from a configuration: arithmetic only.

Nothing here touches CUDA (it runs before any device is initialised, e.g. to pick a micro-batch or to refuse a
configuration that cannot fit). The model of a step is the code path `exp` runs: transformers' Gemma loaded through
bitsandbytes (frozen base), PEFT LoRA adapters, bf16 autocast (Lightning's "bf16-mixed") or plain fp32 ("32-true"),
SDPA or eager attention, transformers' `ForCausalLMLoss` or exp.model.loss's chunked / liger's fused linear cross-entropy
(`loss_impl`), non-reentrant checkpointing of all, some (`checkpoint_layers`) or no decoder layers, torch AdamW on
the adapters. A family's shapes, norms, softcaps and sliding-window pattern are its row in exp.model.families.

Where the bytes go
------------------
Persistent (the whole step):
  * decoder Linear weights, quantized (`_linear_weight_bytes`);
  * the embedding, tied to `lm_head` (counted once). bitsandbytes quantizes `nn.Linear` layers only, and
    transformers keeps `lm_head` out of quantization, so the 256k x hidden table stays in the load dtype;
  * norm weights (tiny);
  * the trainable tensors: LoRA A/B in fp32 (PEFT upcasts adapters to fp32) on the decoder projections and on the
    head if targeted, their fp32 grads and the optimizer's state.
Saved for backward (`_layer_saved_bytes`): what autograd keeps per decoder layer, derived op by op below. The 4-bit
base layers save *no* activation: bitsandbytes' `MatMul4Bit` keeps only the packed weight (`ctx.tensors = (None, B)`),
because the weight needs no gradient. So the memory of a QLoRA step is norms, attention, the GeGLU MLP and the
adapters' inputs (a LoRA on the head: its input too), plus the loss over the vocabulary.
The loss over the vocabulary (`_logits_peak_bytes`): for Gemma's 256k vocabulary this dominates everything else.

The peak is the larger of two moments:
  A. the start of backward: every saved activation of the forward is alive (all layers, or the checkpointed layer
     inputs) and the loss backward holds three fp32 vocabulary-sized tensors;
  B. the backward of the last decoder layer (with checkpointing: its recompute), after the logits are gone: the
     saved activations + one fully recomputed layer + the gradient temporaries of its MLP + one dequantized weight.
With transformers' loss A wins by far for Gemma (12 bytes x tokens x 256k); with the chunked / fused loss, which
holds one chunk of logits, B is usually the peak.

Preference objectives (docs/objectives.md): a micro-batch of B pairs is 2B rows in one forward (the chosen rows,
then the rejected; KTO: B rows and B mismatched KL rows), so every activation term counts 2B rows
(`rows_per_example`). DPO and KTO then score the same rows under the reference (the base with the adapters off,
no gradients) while the policy's forward is alive, a third candidate for the peak (`reference_forward`):
  C. after the policy forward: every saved activation, what the policy's log-probabilities keep for backward (the
     [rows, T, vocab] logits with transformers' loss; the completion positions' hidden states with the chunked /
     fused one), and the reference forward's working set: one layer's transient activations and dequantized
     weight, and its logits (all of them with transformers' loss; one chunk with the chunked / fused one).

`MemoryEstimate.total` predicts what the device must hold (allocator peak + `workspace`); `allocated` predicts what
`torch.cuda.max_memory_allocated` reports (everything but `workspace`).

Checked: the per-layer saved bytes against `torch.autograd.graph.saved_tensors_hooks` counts on the real
bitsandbytes + PEFT path (CPU; Gemma / Gemma 2 eager / Gemma 3, bf16 and fp32, GQA, dropout, masks: within 1%);
the allocator peaks of the hand-written baseline loop (exp.bench.baseline_loop), which runs without autocast
after `prepare_model_for_kbit_training` (= `compute_bytes=4` here), within 0.2%; exp's bf16-autocast path on a GPU
with benchmarks/memory_calibration.py (docs/bench.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from exp.core.config import Accelerator, ConfigError, pattern_key_target
from exp.core.constants import CHUNK_LOGIT_BYTES
from exp.model.families import (
    ATTENTION_OUTPUT,
    Family,
    Projection,
    Sizes,
    family_row,
    lora_target_problem,
)
from exp.model.loss_plan import liger_chunks, plan_loss_impl

GiB = 2**30

# bitsandbytes 4-bit: one absmax per block of 64 weights (the `blocksize` transformers passes for NF4/FP4).
BNB_4BIT_BLOCK = 64
# Double quantization quantizes those absmax values to 8 bits, in blocks of 256 absmax values, each with one
# fp32 absmax of its own (bitsandbytes `compress_statistics`, nested block size 256).
BNB_NESTED_BLOCK = 256

# Memory the device needs beyond the bytes PyTorch hands out (what `max_memory_allocated` does not see): the CUDA
# context and loaded kernels (~0.3-0.5 GiB on Hopper), cuBLAS/cuDNN handles, NCCL buffers for one peer group.
WORKSPACE_FIXED_BYTES = GiB // 2
# The caching allocator reserves more than it hands out (block rounding, fragmentation between the large and
# short-lived logits tensors and everything else): a few percent of the allocated peak in steady training.
WORKSPACE_FRACTION = 0.03


@dataclass
class MemoryEstimate:
    """Bytes per component at the predicted peak of one training step on one device.

    `activations` and `logits_and_loss` are the amounts alive at the peak moment (`peak_phase`): with a large
    vocabulary that is the start of backward ("loss"); otherwise the backward of the last layer ("layer_backward"),
    when the logits are already freed (`logits_and_loss` is then 0).
    """

    quantized_weights: int = 0  # decoder Linear layers (4-bit + absmax, int8 + scales, or unquantized)
    dequantized_weights: int = 0  # hardware.dequantized_layers: those layers' weights again, in the compute dtype
    embeddings: int = 0  # embed_tokens, tied to lm_head: counted once
    other_weights: int = 0  # RMSNorm weights
    lora_params: int = 0  # trainable tensors (LoRA A/B, modules_to_save copies), fp32
    lora_grads: int = 0  # their gradients, fp32
    optimizer_state: int = 0  # AdamW exp_avg + exp_avg_sq
    fsdp_buffers: int = 0  # FSDP: unsharded copies in flight (root unit with the embedding, 2 decoder layers)
    activations: int = 0  # tensors saved for backward (+ backward temporaries when the peak is a layer's backward)
    logits_and_loss: int = 0  # logits, fp32 upcast, log-softmax and its gradients
    workspace: int = 0  # CUDA context + allocator slack: outside `max_memory_allocated`
    peak_phase: str = "loss"
    # Intermediate quantities (bytes or counts), for calibration and debugging; not part of `total`.
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def byte_fields(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.type in ("int", int)]

    @property
    def total(self) -> int:
        """Predicted peak device memory, bytes."""
        return sum(getattr(self, name) for name in self.byte_fields())

    @property
    def allocated(self) -> int:
        """Predicted `torch.cuda.max_memory_allocated` (the total without `workspace`)."""
        return self.total - self.workspace

    @property
    def weights(self) -> int:
        return self.quantized_weights + self.dequantized_weights + self.embeddings + self.other_weights

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total"] = self.total
        d["allocated"] = self.allocated
        return d

    def as_table(self) -> str:
        rows = [(name, getattr(self, name)) for name in self.byte_fields()]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value / GiB:9.3f} GiB" for name, value in rows]
        lines.append("-" * (width + 15))
        lines.append(f"{'total':<{width}}  {self.total / GiB:9.3f} GiB  (peak at: {self.peak_phase})")
        return "\n".join(lines)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _linear_weight_bytes(n_in: int, n_out: int, quant_type: str, double_quant: bool, compute_bytes: int) -> int:
    """Bytes one frozen Linear occupies after loading."""
    n = n_in * n_out
    if quant_type in ("nf4", "fp4"):
        packed = _ceil_div(n, 2)  # two 4-bit codes per byte
        blocks = _ceil_div(n, BNB_4BIT_BLOCK)
        if not double_quant:
            return packed + 4 * blocks  # one fp32 absmax per 64 weights: +0.0625 byte/param
        # 8-bit absmax per block + an fp32 absmax per 256 blocks (+ the nested 256-entry fp32 code table and offset).
        return packed + blocks + 4 * _ceil_div(blocks, BNB_NESTED_BLOCK) + 4 * 256 + 4
    if quant_type == "int8":
        return n + 4 * n_out  # LLM.int8: int8 weight + one fp32 scale per output row (SCB)
    if quant_type == "none":
        return n * compute_bytes  # loaded in the compute dtype
    raise ValueError(f"quant_type={quant_type!r}: expected nf4, fp4, int8 or none")


def _targets(row: Family, targets: Sequence[str] | str) -> list[Projection]:
    """The projections `targets` names, each once. A composed config has had its targets checked against the family
    (exp.run.compose); a direct caller naming another module gets the same refusal."""
    names = [targets] if isinstance(targets, str) else list(targets)
    if problem := lora_target_problem(row, names):
        raise ConfigError(problem)
    return [row.target(name) for name in dict.fromkeys(names)]


def base_param_count(arch: Mapping[str, Any], family: str = "gemma") -> int:
    """Weights of the base: the (tied) embedding and every decoder projection (norms are negligible)."""
    row = family_row(family)
    return row.param_count(row.sizes(arch))


def lora_param_count(
    arch: Mapping[str, Any],
    lora_r: int,
    lora_targets: Sequence[str] | str,
    family: str = "gemma",
    lora_ranks: Mapping[str, int] | None = None,
) -> int:
    """Number of LoRA parameters: r x (in + out) per targeted Linear (A is r x in, B is out x r), in every layer for
    a decoder projection, once for the head; `lora_ranks`: another r for the projections it names
    (`pattern_ranks`)."""
    row = family_row(family)
    names = [p.name for p in _targets(row, lora_targets)]
    return row.lora_param_count(row.sizes(arch), lora_r, names, lora_ranks)


def pattern_ranks(lora_r: int, rank_pattern: Mapping[str, int], targets: Sequence[str]) -> dict[str, int]:
    """The rank of each target projection that `lora.rank_pattern` sets: a key ends in a target's name (a module
    name, or a path or regex ending in one: exp.core.config checks it). A key naming some layers only (a path such as
    `model.layers.0.mlp.down_proj`) counts in every layer, and two keys ending in one name count at the larger rank:
    an upper bound, so what the estimate lets through fits."""
    ranks: dict[str, int] = {}
    for key, rank in rank_pattern.items():
        if (name := pattern_key_target(key, list(targets))) is not None:
            ranks[name] = max(ranks.get(name, lora_r), int(rank))
    return ranks


def _lora_input_bytes(n_targets: int, width: int, tokens: int, dropout: bool, c: int) -> int:
    """What the LoRA branches reading one tensor (tokens x width) save for lora_A's backward: its input.

    Without dropout lora_A saves the input itself, one tensor shared by every branch reading it. With dropout each
    branch has its own `nn.Dropout`: a bool mask (1 byte; CUDA's fused dropout) + the dropped copy (c bytes).
    """
    if n_targets == 0:
        return 0
    if dropout:
        return n_targets * (1 + c) * tokens * width
    return c * tokens * width


def _lora_saved_bytes(
    targets: Sequence[Projection],
    s: Sizes,
    *,
    tokens: int,
    lora_r: int,
    dropout: bool,
    c: int,
    eager: bool,
    dora: bool = False,
    lora_ranks: Mapping[str, int] | None = None,
) -> int:
    """What the LoRA branches on `targets` save for their backward: lora_A's input (`_lora_input_bytes`, shared by
    the branches reading one tensor), lora_B's input (T x r); under bf16 autocast also the bf16 casts of the fp32 A
    and B (cached per forward, saved by the matmuls). The attention output is o_proj's input: SDPA saves it for
    its own backward, so a LoRA on o_proj without dropout saves that very tensor; eager attention's reaches o_proj
    as a fresh `.contiguous()` copy.

    DoRA (PEFT's `DoraLinearLayer.forward`: `(m / |W + BA| - 1) * base + m / |W + BA| * lora * scaling`, m the fp32
    magnitude) saves, per projection, both products it scales (T x out each) and the 1 x out scale twice. The fp32
    scale promotes what it multiplies: under bf16 autocast one of the two comes out in fp32, so c + 4 bytes per
    output element (8 in fp32)."""
    by_input: dict[str, list[Projection]] = {}
    for p in targets:
        by_input.setdefault(p.reads, []).append(p)
    saved = 0
    for reads, group in by_input.items():
        if reads == ATTENTION_OUTPUT and not (dropout or eager):
            continue
        saved += _lora_input_bytes(len(group), group[0].shape(s)[0], tokens, dropout, c)
    rank = {p.name: (lora_ranks or {}).get(p.name, lora_r) for p in targets}
    saved += c * tokens * sum(rank.values())  # lora_A outputs, saved by lora_B
    if dora:
        saved += sum((c + 4) * tokens * p.shape(s)[1] + 2 * 4 * p.shape(s)[1] for p in targets)
    if c == 2:
        saved += 2 * sum(rank[p.name] * sum(p.shape(s)) for p in targets)  # bf16 casts of the fp32 adapters
    return saved


def _layer_saved_bytes(
    s: Sizes,
    *,
    batch: int,
    seq: int,
    targets: Sequence[Projection],
    lora_r: int,
    dropout: bool,
    c: int,
    row: Family,
    eager: bool,
    repeat_kv: bool,
    attn_softcap: bool,
    compiled: bool = False,
    dora: bool = False,
    lora_ranks: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Bytes autograd saves for the backward of one decoder layer, by part (c = bytes of the activation dtype).

    Derived op by op from transformers 5.x `GemmaDecoderLayer` (and Gemma 2/3), and checked by counting the
    tensors `torch.autograd.graph.saved_tensors_hooks` sees on the real bitsandbytes + PEFT path:
      RMSNorm: `x.float()` is saved by `pow` and by `x * rsqrt(...)`: 4 bytes/element whatever c is; `* (1 + w)`
        (w frozen) and `.type_as` save nothing of size T x hidden. The family's norms per layer (2 in Gemma, 4 in
        Gemma 2 and 3), and with QK-norm (Gemma 3) q and k normalised over head_dim (4 bytes x T x (q_dim + kv_dim)).
      4-bit base projections: nothing (bitsandbytes' `MatMul4Bit` keeps only the packed weight).
      LoRA per targeted projection: `_lora_saved_bytes`.
      RoPE: saves only cos / sin (T x head_dim, shared by all layers; ignored).
      SDPA (flash / memory-efficient / cuDNN kernels): q, k, v and the output + an fp32 logsumexp per head and token;
        no T x T matrix. GQA heads are repeated (`repeat_kv`, then k and v are saved at `heads`) only when a mask
        is materialised (padding, or a sliding-window layer longer than its window). The output is o_proj's
        input: a LoRA on o_proj without dropout saves that very tensor.
      eager attention (Gemma 2): q, the repeated k and v, and per score (batch x heads x S x S): the tanh output of
        the logit softcap (c), the fp32 softmax (4) and its cast back to c (saved by `probs @ v`; the same tensor
        when c = 4). Its output reaches o_proj as a fresh `.contiguous()` copy.
      GeGLU MLP: gelu_tanh saves its input (gate output), `act * up` saves both factors: 3 x T x intermediate; the
        product is down_proj's input, saved only by a LoRA on down_proj.
      Residual adds, `* scaling` and `.clone()` save nothing.
    Compiled (`torch.compile` of the layer, `compiled`): Inductor's partitioner recomputes cheap pointwise work in
      the backward instead of saving it: the GeGLU saves its two matmul outputs (gate, up) and recomputes the
      activation, and the norms save their c-byte input instead of its fp32 copies. (Measured on an H200 for the
      Gemma-7B shape: 3.13 GiB per layer at 2,048 x 8 tokens, this model 3.13.)
    """
    t = batch * seq
    parts = {"norms": row.norms_per_layer * (c if compiled else 4) * t * s.hidden}
    if row.qk_norm:
        parts["norms"] += 4 * t * (s.q_dim + s.kv_dim)
    parts["lora_inputs"] = _lora_saved_bytes(
        targets, s, tokens=t, lora_r=lora_r, dropout=dropout, c=c, eager=eager, dora=dora, lora_ranks=lora_ranks
    )

    kv_saved = s.q_dim if repeat_kv else s.kv_dim
    attn = c * t * (2 * s.q_dim + 2 * kv_saved)  # q, k, v, output
    if eager:
        attn -= c * t * s.q_dim  # the output itself is not saved; o_proj's LoRA input copy is counted above
        probs_cast = c if c != 4 else 0
        attn += batch * s.heads * seq * seq * ((c if attn_softcap else 0) + 4 + probs_cast)
    else:
        attn += 4 * t * s.heads  # logsumexp
    parts["attention"] = attn
    parts["mlp"] = (2 if compiled else 3) * c * t * s.inter
    return parts


def _logits_peak_bytes(tokens: int, vocab: int, c: int, final_softcap: bool) -> int:
    """Peak bytes of the vocabulary-sized tensors of transformers' ForCausalLMLoss (cross entropy, mean).

    forward:  lm_head output L (T x V, c bytes) -> `.float()` F (4 B; a no-op returning L when c = 4) ->
              log_softmax LS (4 B, saved for backward; `nll_loss` saves LS too, the same tensor). F is a temporary
              freed when the loss function returns, L lives in the model output. Forward peak: (c + 4 + 4) T V.
              The frozen tied head saves no input (its weight needs no gradient) and no copy of itself.
    backward: the output object is dropped before `backward()` (Lightning's training_step returns only the loss;
              a plain loop reads `.loss` off a temporary), so L is gone. NllLossBackward makes a zero-filled fp32
              gradient G1 (4 B) and scatters into it; LogSoftmaxBackward computes G2 = G1 - exp(LS) * sum (4 B,
              a new tensor) while LS and G1 are still alive: LS + G1 + G2 = 12 T V. Then LS and G1 are freed; the
              cast back (G2 -> bf16, 2 B) and the lm_head input gradient (T x hidden) are small by comparison.
    So the peak is max(c + 8, 12) = 12 bytes per token and vocabulary entry, at the start of backward, while
    every saved activation is still alive. Gemma 2's final-logit softcapping (`tanh(L / cap) * cap`) adds the
    tanh output saved for its backward (c bytes).
    """
    per = max(c + 8, 12) + (c if final_softcap else 0)
    return per * tokens * vocab


# A compiled layer's backward holds more at once than the eager one: it recomputes the GeGLU activation and
# produces the gradients of both MLP branches in one fused kernel. Fitted, not derived: on an H200 (Gemma-7B
# shape, 2,048 x 8 tokens, liger loss) compiled runs peaked 1.1-1.2 GiB above the eager-layer model less the
# smaller saved set, i.e. 1.5 x tokens x intermediate x c bytes; checked against runs with 0, 14, 20 and 28
# recomputed layers.
COMPILED_BACKWARD_EXTRA = 1.5


def _fused_loss_peak_bytes(impl: str, tokens: int, vocab: int, hidden: int, c: int, final_softcap: bool) -> int:
    """Peak bytes of a loss that never holds the [tokens, vocab] logits (`hardware.loss_impl` chunked / liger).

    Both compute the loss and the gradient of the hidden states in the forward pass, one chunk of tokens at a time,
    so the peak is in that forward pass: the final hidden states H (T x hidden, c bytes: the decoder's output,
    freed when the loss returns), the stored gradient dH (T x hidden, c bytes, kept until the backward scales
    it), and one chunk's vocabulary-sized temporaries.
      chunked (exp.model.loss): a chunk of CHUNK_LOGIT_BYTES / (4 V) tokens; its logits (c), their fp32 copy z and the
        logsumexp's exp(z - max) temporary (4 + 4; when c = 4 the copy is the logits themselves), with a softcap
        the tanh kept for the gradient (4). The gradient is written over z in place; its cast to c is smaller than
        the freed temporaries.
      liger (liger_kernel.ops.fused_linear_cross_entropy): chunks of exp.model.loss_plan.liger_chunks tokens
        (about LIGER_CHUNK_LOGIT_BYTES of logits); the kernel writes the gradient over the chunk's logits (c) in
        place; plus an fp32 per-token loss.
    """
    around = 2 * c * tokens * hidden + 4 * tokens
    if impl == "liger":
        return around + liger_chunks(tokens, vocab, hidden, c).tokens * vocab * c
    chunk = min(tokens, max(1, CHUNK_LOGIT_BYTES // (4 * vocab)))
    per = (4 + 4 if c == 4 else c + 4 + 4) + (4 if final_softcap else 0)
    return around + chunk * vocab * per


def estimate_memory(
    arch: Mapping[str, Any],
    *,
    quant_type: str,
    double_quant: bool,
    lora_r: int,
    lora_targets: Sequence[str] | str,
    micro_batch_size: int,
    seq_len: int,
    gradient_checkpointing: bool,
    checkpoint_layers: int | None = None,
    loss_impl: str = "hf",
    compute_bytes: int = 2,
    num_shards: int = 1,
    optimizer: str = "adamw",
    lora_dropout: float = 0.0,
    family: str = "gemma",
    attn_implementation: str = "sdpa",
    padding_mask: bool = False,
    modules_to_save: Sequence[str] = (),
    compiled: bool = False,
    dequantized_layers: int = 0,
    offload_checkpoints: bool = False,
    rows_per_example: int = 1,
    reference_forward: bool = False,
    dora: bool = False,
    lora_ranks: Mapping[str, int] | None = None,
) -> MemoryEstimate:
    """Predict the peak memory of one training step on one device (see the module docstring for the model).

    arch: transformers Gemma config fields (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
        num_attention_heads, num_key_value_heads, head_dim; Gemma 2 softcapping and sliding_window are read).
    compute_bytes: bytes of the activation dtype. 2: bf16/fp16 autocast ("*-mixed"; exp then loads the model in
        that dtype). 4: "32-true", or no autocast over fp32 non-quantized weights, which is what a plain loop after
        `peft.prepare_model_for_kbit_training` runs (it upcasts the embedding and the norms to fp32; bitsandbytes
        then casts its output back to fp32).
    checkpoint_layers: with gradient_checkpointing, how many decoder layers (the first N) recompute; None: all.
    loss_impl: "hf" (transformers' loss over the full logits), "chunked" or "liger" (exp.model.loss: no full logits).
    num_shards: FSDP shard count; weights and trainable state are divided, activations and logits are per device.
    optimizer: "adamw" / "paged_adamw_32bit" (8 bytes of state per parameter; paging only moves it under pressure,
        and bitsandbytes' paged buffers live outside PyTorch's allocator, so `max_memory_allocated` misses them) or
        "paged_adamw_8bit" (2 bytes per parameter + a fp32 absmax per 256 values).
    lora_dropout: > 0 adds a mask and a dropped copy of every adapter input.
    dora: DoRA adapters (`lora.use_dora`): two saved products per projection and the column norms' temporaries.
    lora_ranks: the rank of the projections `lora.rank_pattern` sets, by target name (`pattern_ranks`); the others
        take `lora_r`.
    family / attn_implementation: a row of exp.model.families ("gemma" | "gemma2" | "gemma3": its norms, softcaps,
        sliding windows) and "sdpa" | "eager" (eager keeps batch x heads x seq x seq scores per layer).
    padding_mask: batches carry padding, so the attention mask is materialised; for GQA models transformers then
        repeats the key/value heads before SDPA.
    modules_to_save: PEFT's full trainable copies; `lm_head` / `embed_tokens` copy the vocab x hidden table.
    compiled: the decoder layers run `torch.compile`d (`hardware.compile`): fewer saved tensors per layer, a wider
        backward (`_layer_saved_bytes`, COMPILED_BACKWARD_EXTRA).
    dequantized_layers: decoder layers whose 4-bit weights are also kept in the compute dtype (exp.model.dequantized).
    offload_checkpoints: what the backward keeps from outside the recomputed layers lives in host memory; one
        checkpointed layer's input at a time comes back to the device.
    rows_per_example: rows one example of the micro-batch becomes: 1 (SFT), 2 (a preference pair; KTO's example
        and its KL row).
    reference_forward: a no-grad forward of the same rows under the reference after the policy's (DPO, KTO).
    """
    row = family_row(family)
    s = row.sizes(arch)
    targets = _targets(row, lora_targets)
    if micro_batch_size < 1 or seq_len < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}, seq_len={seq_len}: both must be >= 1")
    if rows_per_example < 1:
        raise ValueError(f"rows_per_example={rows_per_example}: must be >= 1")
    # From here on the micro-batch is counted in rows, what the forward sees.
    micro_batch_size *= rows_per_example
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes={compute_bytes}: 2 (bf16/fp16 mixed) or 4 (fp32)")
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: must be >= 1")
    if loss_impl not in ("hf", "chunked", "liger"):
        raise ValueError(f"loss_impl={loss_impl!r}: hf, chunked or liger")
    if checkpoint_layers is not None and checkpoint_layers < 0:
        raise ValueError(f"checkpoint_layers={checkpoint_layers}: must be >= 0 (or None for all layers)")
    if not 0 <= dequantized_layers <= s.layers:
        raise ValueError(f"dequantized_layers={dequantized_layers}: must be in 0..{s.layers}")
    if attn_implementation not in ("sdpa", "eager", "flash_attention_2", "flex_attention", "varlen"):
        raise ValueError(
            f"attn_implementation={attn_implementation!r}: sdpa, eager, flash_attention_2, flex_attention or varlen"
        )
    if attn_implementation in ("flex_attention", "varlen"):
        # Like FlashAttention: q, k, v, the output and the log-sum-exp per head and token, no score matrix, no
        # materialised mask (a block mask of a few bytes per 128 x 128 tile) and no repeated GQA heads. The varlen
        # kernel (exp.model.varlen) is FlashAttention itself, its boundaries a few bytes per example.
        attn_implementation, padding_mask = "flash_attention_2", False
    c = compute_bytes
    t = micro_batch_size * seq_len
    eager = attn_implementation == "eager"
    attn_softcap = bool(arch.get("attn_logit_softcapping", row.attn_logit_softcapping))
    final_softcap = bool(arch.get("final_logit_softcapping", row.final_logit_softcapping))

    # Persistent: the frozen weights.
    lin = [p.shape(s) for p in row.projections]
    layer_weight = sum(_linear_weight_bytes(i, o, quant_type, double_quant, c) for i, o in lin)
    norm_params = s.layers * (row.norms_per_layer * s.hidden + (2 * s.head_dim if row.qk_norm else 0)) + s.hidden
    # Loaded in the compute dtype and never quantized; a head tied to it is the same table.
    emb = (1 if row.tied_head else 2) * s.vocab * s.hidden * c

    # Persistent: the trainable state. PEFT keeps adapters in fp32; gradients live from backward to the optimizer
    # step (and across micro-batches when accumulating), so they are counted too.
    n_train = row.lora_param_count(s, lora_r, [p.name for p in targets], lora_ranks)
    if any(m in row.vocabulary_modules for m in modules_to_save):
        n_train += s.vocab * s.hidden  # a full trainable copy of the tied table
    if optimizer in ("adamw", "paged_adamw_32bit"):
        opt_per_param = 8.0  # exp_avg + exp_avg_sq in fp32
    elif optimizer == "paged_adamw_8bit":
        opt_per_param = 2.0 + 2 * 4 / 256  # two uint8 states + an fp32 absmax per 256-value block each
    else:
        raise ValueError(f"optimizer={optimizer!r}: adamw, paged_adamw_32bit or paged_adamw_8bit")

    est = MemoryEstimate(
        quantized_weights=_ceil_div(s.layers * layer_weight, num_shards),
        dequantized_weights=dequantized_layers * sum(i * o for i, o in lin) * c if quant_type != "none" else 0,
        embeddings=_ceil_div(emb, num_shards),
        other_weights=_ceil_div(norm_params * c, num_shards),
        lora_params=_ceil_div(4 * n_train, num_shards),
        lora_grads=_ceil_div(4 * n_train, num_shards),
        optimizer_state=_ceil_div(int(opt_per_param * n_train), num_shards),
    )
    if num_shards > 1:
        # FSDP all-gathers a unit before using it. The root unit (embedding / tied head, final norm) stays gathered
        # from forward to backward; each decoder layer is gathered for its forward and backward, with the next one
        # prefetched. The local shards are counted above, the gathered copies here.
        est.fsdp_buffers = emb + 2 * layer_weight

    # Saved activations, per kind of layer: Gemma 2 / 3 alternate sliding-window and global layers; a sliding layer
    # longer than its window needs a materialised mask (and SDPA then gets repeated GQA heads).
    window = arch.get("sliding_window") if row.sliding_window_pattern else None
    n_global = sum(row.layer_is_global(i, bool(window)) for i in range(s.layers))
    kinds = {
        "global": (n_global, padding_mask),
        "sliding": (s.layers - n_global, padding_mask or (bool(window) and seq_len > int(window))),
    }
    per_kind: dict[str, dict[str, int]] = {}
    for kind, (count, masked) in kinds.items():
        if not count:
            continue
        per_kind[kind] = _layer_saved_bytes(
            s,
            batch=micro_batch_size,
            seq=seq_len,
            targets=[p for p in targets if p.per_layer],
            lora_r=lora_r,
            dropout=lora_dropout > 0,
            c=c,
            row=row,
            eager=eager,
            repeat_kv=s.kv_heads < s.heads and (eager or masked),
            attn_softcap=attn_softcap,
            compiled=compiled,
            dora=dora,
            lora_ranks=lora_ranks,
        )
    # Layer i's kind, as transformers assigns them (the family's sliding-window pattern).
    layer_saved = [
        sum(per_kind["global" if row.layer_is_global(i, bool(window)) else "sliding"].values()) for i in range(s.layers)
    ]
    # Masks transformers materialises (bool for SDPA, compute dtype for eager), one per attention kind in use.
    n_masks = sum(1 for n, m in kinds.values() if n and (m or eager))
    masks = n_masks * micro_batch_size * seq_len * seq_len * (c if eager else 1)
    # Final norm (not checkpointed): its fp32 input copy. Its output feeds the frozen head, which saves no input; a
    # LoRA on the head saves what a decoder projection's does (its input, lora_A's output, the adapters' casts). Both
    # are freed by the head's backward, before any layer's.
    head_lora = _lora_saved_bytes(
        [p for p in targets if not p.per_layer],
        s,
        tokens=t,
        lora_r=lora_r,
        dropout=lora_dropout > 0,
        c=c,
        eager=eager,
        dora=dora,
        lora_ranks=lora_ranks,
    )
    final = 4 * t * s.hidden + head_lora
    # Non-reentrant checkpointing keeps each checkpointed layer's input (an argument of its recompute) and nothing
    # else; the first `n_ckpt` layers are checkpointed (exp.model.build), the others keep what they save.
    n_ckpt = (
        (s.layers if checkpoint_layers is None else min(checkpoint_layers, s.layers)) if gradient_checkpointing else 0
    )
    ckpt_inputs = n_ckpt * c * t * s.hidden
    saved_all = ckpt_inputs + sum(layer_saved[n_ckpt:])
    if offload_checkpoints:
        # All of it is in host memory; the backward brings back one layer's share at a time.
        ckpt_inputs = c * t * s.hidden if n_ckpt else 0
        saved_all = max([ckpt_inputs, *layer_saved[n_ckpt:]])
        final = 0
    recompute = max(layer_saved[:n_ckpt], default=0)

    # Phase B's extra: the gradient temporaries of one layer's backward, widest in the MLP: the down-projection
    # input gradient and the two product-rule gradients of `act * up` (3 x T x intermediate), two T x hidden
    # residual gradients, and the weight bitsandbytes dequantizes to multiply the gradient by.
    largest_weight = max(i * o for i, o in lin) * c if quant_type != "none" else 0
    bwd_temp = 3 * c * t * s.inter + 2 * c * t * s.hidden + largest_weight
    if compiled:
        bwd_temp += int(COMPILED_BACKWARD_EXTRA * c * t * s.inter)
    if dora:
        # DoRA's column norms, every forward (and every recompute): B @ A as lora_B(lora_A(I)) with I the fp32
        # in x in identity (and its cast to c, saved by lora_A until the product is dropped), then the dequantized
        # weight, W + BA and its norm's input in the input's dtype (fp32 once a DoRA product has promoted it).
        bwd_temp += max((4 + c) * i * i + 3 * 4 * i * o for i, o in (p.shape(s) for p in targets))

    if loss_impl == "hf":
        logits = _logits_peak_bytes(t, s.vocab, c, final_softcap)
    else:
        logits = _fused_loss_peak_bytes(loss_impl, t, s.vocab, s.hidden, c, final_softcap)
    phase_loss = saved_all + final + masks + logits
    # The backward walks the layers from the last: at the last layer everything saved is alive; at the last
    # checkpointed layer the later layers' activations are freed and its recompute is alive instead.
    phase_layer = masks + bwd_temp + max(saved_all, ckpt_inputs + recompute if n_ckpt else 0)
    phase_reference, reference = 0, 0
    if reference_forward:
        # Phase C (module docstring): the policy's log-probabilities keep the logits (transformers' loss) or the
        # hidden states (chunked / fused); the reference forward holds one layer's transients (its MLP's widest,
        # like the backward's) and dequantized weight, then its logits.
        kept = c * t * s.vocab if loss_impl == "hf" else c * t * s.hidden
        ref_logits = c * t * s.vocab + 4 * seq_len * s.vocab if loss_impl == "hf" else logits
        reference = max(2 * c * t * s.inter + 2 * c * t * s.hidden + largest_weight, ref_logits)
        phase_reference = saved_all + final + masks + kept + reference
    if phase_reference > max(phase_loss, phase_layer):
        est.peak_phase = "reference_forward"
        est.activations = phase_reference - reference
        est.logits_and_loss = reference
    elif phase_loss >= phase_layer:
        est.peak_phase = "loss"
        est.activations = phase_loss - logits
        est.logits_and_loss = logits
    else:
        est.peak_phase = "layer_backward"
        est.activations = phase_layer
        est.logits_and_loss = 0

    est.workspace = WORKSPACE_FIXED_BYTES + int(WORKSPACE_FRACTION * est.total)
    est.details = {
        "tokens": t,
        "trainable_params": n_train,
        "layer_saved_parts": per_kind,
        "layers_saved_bytes": sum(layer_saved),
        "checkpointed_layers": n_ckpt,
        "loss_impl": loss_impl,
        "loss_bytes": logits,
        "checkpoint_inputs_bytes": ckpt_inputs,
        "final_norm_bytes": final - head_lora,
        "head_lora_bytes": head_lora,
        "mask_bytes": masks,
        "backward_temporaries_bytes": bwd_temp,
        "phase_loss_bytes": phase_loss,
        "phase_layer_backward_bytes": phase_layer,
        "rows_per_example": rows_per_example,
        "phase_reference_forward_bytes": phase_reference,
    }
    return est


# --- From the typed configuration ------------------------------------------------------------------------------


def _config_kwargs(cfg: Any, num_shards: int = 1) -> dict[str, Any]:
    """estimate_memory's arguments for a typed `TrainConfig` (everything but the architecture)."""

    hw = cfg.hardware
    # The preflight alone decides what `auto` becomes (exp.hardware.preflight.check): an estimate of an unresolved
    # config would have to decide it a second time.
    unresolved = [k for k in ("precision", "compile") if getattr(hw, k) == "auto"]
    if unresolved:
        raise ValueError(
            f"estimate_for_config needs a resolved config (hardware.{', hardware.'.join(unresolved)} is 'auto'): "
            "pass the config exp.hardware.preflight.check returns"
        )
    fp32 = hw.precision == "32-true"
    return dict(
        **_model_kwargs(cfg),
        lora_dropout=float(cfg.lora.dropout),
        dora=bool(cfg.lora.use_dora),
        micro_batch_size=int(cfg.hardware.micro_batch_size),
        seq_len=int(cfg.data.max_seq_len),
        gradient_checkpointing=bool(cfg.hardware.gradient_checkpointing),
        checkpoint_layers=cfg.hardware.checkpoint_layers,
        loss_impl=plan_loss_impl(cfg, on_cuda=cfg.hardware.accelerator != Accelerator.cpu).impl.value,
        compute_bytes=4 if fp32 else 2,
        num_shards=num_shards,
        attn_implementation=cfg.model.attn_implementation,
        # The collator pads each batch to its longest example: assume a mask (the worst case).
        padding_mask=True,
        compiled=hw.compile is True,
        dequantized_layers=int(hw.dequantized_layers),
        offload_checkpoints=bool(hw.offload_checkpoints),
        **_objective_kwargs(cfg),
    )


def _objective_kwargs(cfg: Any) -> dict[str, Any]:
    """What the objective adds to a step: a preference micro-batch is two rows per example, and DPO / KTO run the
    reference forward (module docstring)."""
    o = cfg.objective
    return dict(rows_per_example=2 if o.preference else 1, reference_forward=bool(o.uses_reference))


def _model_kwargs(cfg: Any) -> dict[str, Any]:
    """estimate_memory's arguments that say what the device holds whatever the step: the quantization, the adapters
    and their optimiser (no choice of the preflight's among them)."""
    return dict(
        quant_type=_value(cfg.quantization.quant_type),
        double_quant=bool(cfg.quantization.double_quant),
        lora_r=int(cfg.lora.r),
        lora_targets=list(cfg.lora.target_modules),
        lora_ranks=pattern_ranks(int(cfg.lora.r), cfg.lora.rank_pattern, list(cfg.lora.target_modules)),
        modules_to_save=list(cfg.lora.modules_to_save),
        optimizer=_value(cfg.trainer.optimizer),
        family=_value(cfg.model.family),
    )


def _value(x: Any) -> Any:
    return getattr(x, "value", x)


def config_arch(cfg: Any) -> dict[str, Any]:
    """The architecture a config trains, with the vocabulary filled in for the locally built tiny model."""
    arch = dict(cfg.model.arch)
    if "vocab_size" not in arch:
        # Without a vocabulary size, `build_random_checkpoint` sizes the table to the local tokenizer (<= 512).
        from exp.model.local import TOKENIZER_VOCAB

        arch["vocab_size"] = TOKENIZER_VOCAB
    if not {"hidden_size", "num_hidden_layers"} <= arch.keys():
        raise ValueError(
            f"model={cfg.model.name}: no architecture in model.arch, so the memory cannot be estimated; "
            "add the published config.json fields (hidden_size, intermediate_size, ...) to its option file"
        )
    return arch


def estimate_for_config(cfg: Any, num_shards: int = 1) -> MemoryEstimate:
    """Estimate the peak memory per device of a typed `TrainConfig` (the composed configuration of a run)."""
    return estimate_memory(config_arch(cfg), **_config_kwargs(cfg, num_shards))


def resident_bytes(cfg: Any) -> int:
    """What one device holds for a typed `TrainConfig` before any activation: the quantized base, the adapters, their
    gradients and optimiser state, and CUDA's own memory. No step needs less, whatever its micro-batch, sequence
    length, checkpointing or precision (bf16, the smaller compute dtype, is assumed): a floor of
    `estimate_for_config(cfg).total` that needs no resolved config."""
    est = estimate_memory(
        config_arch(cfg), **_model_kwargs(cfg), micro_batch_size=1, seq_len=1, gradient_checkpointing=True
    )
    return est.weights + est.lora_params + est.lora_grads + est.optimizer_state + WORKSPACE_FIXED_BYTES


def largest_micro_batch(arch: Mapping[str, Any], budget_bytes: int, *, max_batch: int = 1 << 16, **kwargs: Any) -> int:
    """Largest micro-batch whose estimated `total` fits `budget_bytes` (0 if even 1 does not).

    `kwargs` are `estimate_memory`'s keyword arguments except `micro_batch_size`. The estimate grows with the batch,
    so an exponential then a binary search finds the boundary.
    """
    kwargs.pop("micro_batch_size", None)

    def fits(b: int) -> bool:
        return estimate_memory(arch, micro_batch_size=b, **kwargs).total <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= max_batch and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_batch + 1)
    while hi - lo > 1:  # fits(lo) and not fits(hi) (or hi beyond max_batch)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def fewest_checkpoint_layers(cfg: Any, budget_bytes: int, num_shards: int = 1) -> int | None:
    """Fewest decoder layers to recompute (0: no checkpointing) for this config's estimated `total` to fit
    `budget_bytes` per device; None when even recomputing every layer does not fit. Each recomputed layer keeps
    only its input, so the estimate falls as layers are added: the first count that fits is the fewest."""
    kwargs = _config_kwargs(cfg, num_shards)
    arch = config_arch(cfg)
    for k in range(int(arch["num_hidden_layers"]) + 1):
        kwargs.update(gradient_checkpointing=k > 0, checkpoint_layers=k)
        if estimate_memory(arch, **kwargs).total <= budget_bytes:
            return k
    return None


def most_dequantized_layers(cfg: Any, budget_bytes: int, num_shards: int = 1) -> int:
    """Most decoder layers whose 4-bit weights can stay dequantized (hardware.dequantized_layers) with this config's
    estimated `total` still within `budget_bytes` per device (0 when none fits, or when it is already over)."""
    kwargs = _config_kwargs(cfg, num_shards)
    arch = config_arch(cfg)
    best = 0
    for k in range(1, int(arch["num_hidden_layers"]) + 1):
        kwargs.update(dequantized_layers=k)
        if estimate_memory(arch, **kwargs).total > budget_bytes:
            break
        best = k
    return best


def suggest_micro_batch(cfg: Any, budget_bytes: int, num_shards: int = 1) -> int:
    """Largest `hardware.micro_batch_size` for this config whose estimate fits `budget_bytes` per device (0: none)."""
    kwargs = _config_kwargs(cfg, num_shards)
    return largest_micro_batch(config_arch(cfg), budget_bytes, **kwargs)


__all__ = [
    "GiB",
    "MemoryEstimate",
    "config_arch",
    "estimate_for_config",
    "resident_bytes",
    "base_param_count",
    "estimate_memory",
    "fewest_checkpoint_layers",
    "largest_micro_batch",
    "lora_param_count",
    "most_dequantized_layers",
    "pattern_ranks",
    "suggest_micro_batch",
]
