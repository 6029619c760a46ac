"""The Gemma families exp trains, one frozen row each: every fact about a family that more than one part of exp reads.

The model build (its FSDP wrapping unit), the random-weight builder (`exp.model.local`), the memory estimate
(`exp.hardware.memory`), the preflight, the composition checks (`exp.run.compose`) and the bench's hand-written loop
all read a family's facts here: its transformers classes, its norms, softcaps and sliding-window pattern, the
attention kernel its option files default to, the projections of a decoder layer with their shapes as functions
of the config's sizes, and the modules LoRA may target. A new family is one row of FAMILIES plus its option file
under conf/model/ (README.md, "Adding a model family").

Torch-free: the config checks and the memory estimate read it before torch loads. The transformers classes are
named by their import path and imported only by the code that builds a model (`Family.config_class` and the others).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from exp.core.config import ModelFamily, TrainConfig


@dataclass(frozen=True)
class Sizes:
    """The sizes of an architecture that every projection's shape is a function of."""

    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


# The tensors a Linear of the model reads. LoRA branches that read one tensor share the input they save
# (exp.hardware.memory counts it once without dropout).
ATTENTION_INPUT = "attention_input"  # the normed hidden state entering attention
ATTENTION_OUTPUT = "attention_output"  # the heads' output, before the output projection
MLP_INPUT = "mlp_input"  # the normed hidden state entering the MLP
MLP_PRODUCT = "mlp_product"  # gelu(gate) * up, the GeGLU's product
FINAL_HIDDEN = "final_hidden"  # the decoder's output after the final norm: the head's input


@dataclass(frozen=True)
class Projection:
    """A Linear LoRA can target: its module name, the tensor it reads, and its in / out features as `Sizes` fields."""

    name: str
    reads: str
    n_in: str
    n_out: str
    per_layer: bool = True  # one in every decoder layer; false: one in the whole model (the head)

    def shape(self, s: Sizes) -> tuple[int, int]:
        """(in_features, out_features)."""
        return getattr(s, self.n_in), getattr(s, self.n_out)


# A Gemma decoder layer: attention (q, k, v of the normed hidden state, o of the heads' output) and the GeGLU MLP
# (gate and up of the normed hidden state, down of their product). Every Gemma family has these seven.
GEMMA_DECODER_PROJECTIONS = (
    Projection("q_proj", ATTENTION_INPUT, "hidden", "q_dim"),
    Projection("k_proj", ATTENTION_INPUT, "hidden", "kv_dim"),
    Projection("v_proj", ATTENTION_INPUT, "hidden", "kv_dim"),
    Projection("o_proj", ATTENTION_OUTPUT, "q_dim", "hidden"),
    Projection("gate_proj", MLP_INPUT, "hidden", "inter"),
    Projection("up_proj", MLP_INPUT, "hidden", "inter"),
    Projection("down_proj", MLP_PRODUCT, "inter", "hidden"),
)
# The output head: a Linear over the final hidden state whose weight Gemma ties to the input embedding. The build
# lets LoRA target it (PEFT wraps it like any Linear); the embedding itself is an nn.Embedding, which it does not.
GEMMA_LM_HEAD = Projection("lm_head", FINAL_HIDDEN, "hidden", "vocab", per_layer=False)


@dataclass(frozen=True)
class Family:
    """One model family: what differs between families, and what code treating them alike must not repeat."""

    name: ModelFamily
    title: str  # as messages name it ("Gemma 2")
    model_types: tuple[str, ...]  # transformers' `config.model_type` of its checkpoints (the first: random_init's)
    # transformers classes, by import path: the config random_init builds `model.arch` with, the causal LM it draws,
    # and the repeated decoder layer (FSDP's wrapping unit).
    config_class_path: str
    model_class_path: str
    decoder_layer_path: str
    # RMSNorms of a decoder layer over the hidden size (Gemma: before attention and MLP; Gemma 2 and 3 also after).
    norms_per_layer: int
    # q and k are RMS-normed over head_dim (Gemma 3's replacement of attention softcapping).
    qk_norm: bool
    # Every n-th layer attends to the whole sequence and the others within `sliding_window` (layer i is global when
    # (i + 1) % n == 0, as transformers assigns `layer_types`); None: every layer is global.
    sliding_window_pattern: int | None
    # transformers' defaults where `model.arch` leaves them out (None: the family has none).
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    # The attention kernel the family's option files set: SDPA, or eager where SDPA cannot softcap attention logits.
    attn_implementation: str
    # Activations exceed fp16's range (65504): mixed precision must be bf16, or the run fp32.
    fp16_overflows: bool
    # The liger_kernel.transformers function that patches this family's modules (the bench's baseline lever).
    liger_patch: str
    head_dim: int = 256  # transformers' default where `model.arch` leaves it out
    projections: tuple[Projection, ...] = GEMMA_DECODER_PROJECTIONS
    head: Projection = GEMMA_LM_HEAD
    tied_head: bool = True  # lm_head shares the embedding's weight (the table is held once)
    # Modules whose weight is the vocab x hidden table: in lora.modules_to_save each trains a full copy of it.
    vocabulary_modules: tuple[str, ...] = ("lm_head", "embed_tokens")

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The names `lora.target_modules` may hold: the decoder projections and the head."""
        return (*(p.name for p in self.projections), self.head.name)

    @property
    def softcaps_attention(self) -> bool:
        return self.attn_logit_softcapping is not None

    def target(self, name: str) -> Projection:
        """The projection LoRA targets under `name` (KeyError for a name outside `lora_targets`)."""
        return {p.name: p for p in (*self.projections, self.head)}[name]

    def sizes(self, arch: Mapping[str, Any]) -> Sizes:
        """The sizes of an architecture given by transformers' config field names (`model.arch`, a config's
        `to_dict()`); ValueError naming the fields it lacks."""
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        if missing := [k for k in required if k not in arch]:
            raise ValueError(f"architecture lacks {missing} (transformers {self.title} config names)")
        heads = int(arch["num_attention_heads"])
        return Sizes(
            vocab=int(arch["vocab_size"]),
            hidden=int(arch["hidden_size"]),
            inter=int(arch["intermediate_size"]),
            layers=int(arch["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(arch.get("num_key_value_heads", heads)),
            head_dim=int(arch.get("head_dim", self.head_dim)),
        )

    def param_count(self, s: Sizes) -> int:
        """Weights of the base: the embedding (also the head when tied) and every decoder projection; the norms are
        negligible."""
        tables = 1 if self.tied_head else 2
        per_layer = sum(n_in * n_out for n_in, n_out in (p.shape(s) for p in self.projections))
        return tables * s.vocab * s.hidden + s.layers * per_layer

    def lora_param_count(self, s: Sizes, r: int, targets: Iterable[str], ranks: Mapping[str, int] | None = None) -> int:
        """Parameters of LoRA rank `r` on `targets` (`ranks`: another rank for the projections it names):
        rank x (in + out) per targeted Linear (A is rank x in, B is out x rank), in every decoder layer for a
        projection, once for the head."""
        ranks = ranks or {}
        total = 0
        for name in dict.fromkeys(targets):
            p = self.target(name)
            n_in, n_out = p.shape(s)
            total += ranks.get(name, r) * (n_in + n_out) * (s.layers if p.per_layer else 1)
        return total

    def layer_is_global(self, i: int, windowed: bool) -> bool:
        """Whether decoder layer `i` attends to the whole sequence (`windowed`: the architecture has a sliding
        window)."""
        n = self.sliding_window_pattern
        return not windowed or n is None or (i + 1) % n == 0

    def config_class(self) -> type:
        return _resolve(self.config_class_path)

    def model_class(self) -> type:
        return _resolve(self.model_class_path)

    def decoder_layer_class(self) -> type:
        return _resolve(self.decoder_layer_path)


def _resolve(path: str) -> type:
    """The class at an import path; importing transformers (and torch) on first use."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


FAMILIES: dict[ModelFamily, Family] = {
    ModelFamily.gemma: Family(
        name=ModelFamily.gemma,
        title="Gemma",
        model_types=("gemma",),
        config_class_path="transformers.GemmaConfig",
        model_class_path="transformers.GemmaForCausalLM",
        decoder_layer_path="transformers.models.gemma.modeling_gemma.GemmaDecoderLayer",
        norms_per_layer=2,
        qk_norm=False,
        sliding_window_pattern=None,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        attn_implementation="sdpa",
        fp16_overflows=False,
        liger_patch="apply_liger_kernel_to_gemma",
    ),
    ModelFamily.gemma2: Family(
        name=ModelFamily.gemma2,
        title="Gemma 2",
        model_types=("gemma2",),
        config_class_path="transformers.Gemma2Config",
        model_class_path="transformers.Gemma2ForCausalLM",
        decoder_layer_path="transformers.models.gemma2.modeling_gemma2.Gemma2DecoderLayer",
        norms_per_layer=4,
        qk_norm=False,
        sliding_window_pattern=2,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        attn_implementation="eager",
        fp16_overflows=True,
        liger_patch="apply_liger_kernel_to_gemma2",
    ),
    ModelFamily.gemma3: Family(
        name=ModelFamily.gemma3,
        title="Gemma 3",
        # The text-only decoder random_init builds; hub checkpoints with a vision tower say "gemma3".
        model_types=("gemma3_text", "gemma3"),
        config_class_path="transformers.Gemma3TextConfig",
        model_class_path="transformers.Gemma3ForCausalLM",
        decoder_layer_path="transformers.models.gemma3.modeling_gemma3.Gemma3DecoderLayer",
        norms_per_layer=4,
        qk_norm=True,
        sliding_window_pattern=6,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        attn_implementation="sdpa",
        fp16_overflows=True,
        liger_patch="apply_liger_kernel_to_gemma3_text",
    ),
}


def family_row(name: ModelFamily | str) -> Family:
    """The row of `name` (a ModelFamily or its value); ValueError naming the families for any other."""
    try:
        return FAMILIES[ModelFamily(name)]
    except ValueError:
        raise ValueError(f"family={name!r}: one of {', '.join(f.value for f in FAMILIES)}") from None


def family_of_model_type(model_type: str) -> Family:
    """The row whose checkpoints carry transformers' `config.model_type`; ValueError for another model."""
    for row in FAMILIES.values():
        if model_type in row.model_types:
            return row
    known = ", ".join(t for row in FAMILIES.values() for t in row.model_types)
    raise ValueError(f"model_type {model_type!r} is not a family exp knows ({known})")


def lora_target_problem(row: Family, targets: Iterable[str], model: str | None = None) -> str | None:
    """The one-paragraph refusal of `lora.target_modules` naming a module LoRA cannot target in `row` (None: all can)."""
    targets = list(targets)
    unknown = [t for t in targets if t not in row.lora_targets]
    if not unknown:
        return None
    where = f"a {row.title} model" + (f" (model={model})" if model else "")
    return (
        f"lora.target_modules={targets}: {unknown} match no linear layer LoRA can target in {where}. Allowed: "
        f"{', '.join(row.lora_targets)}. Fix: e.g. "
        "lora.target_modules=[q_proj,v_proj], or lora=all_linear for every projection."
    )


def family_problems(cfg: TrainConfig) -> list[str]:
    """What the model family refuses in a composed config: LoRA targets it lacks, and an attention kernel that
    cannot compute its attention (varlen has no logit softcapping)."""
    row = family_row(cfg.model.family)
    problems = []
    if problem := lora_target_problem(row, cfg.lora.target_modules, cfg.model.name):
        problems.append(problem)
    if cfg.model.attn_implementation == "varlen" and row.softcaps_attention:
        problems.append(
            f"model.attn_implementation=varlen with a {row.title} model: the varlen kernel has no attention-logit "
            f"softcapping, which {row.title} needs; use model.attn_implementation=flex_attention (GPU) or eager"
        )
    return problems
