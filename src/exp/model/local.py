"""Checkpoints the project builds itself: random-weight Gemma architectures and a locally trained tokenizer.

No model hub is needed: `build_random_checkpoint` writes a complete transformers checkpoint (config, safetensors
weights, tokenizer) into the local cache, once per (family, architecture, seed), and the caller then loads it
through the very same `from_pretrained` + `BitsAndBytesConfig` path as real Gemma weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from exp.core.cache import cache_dir, ensure_entry
from exp.core.config import ConfigError, ModelFamily
from exp.data.synthetic import corpus_for_tokenizer
from exp.model.families import family_row

log = logging.getLogger(__name__)

# Gemma's special-token ids (pad 0, eos 1, bos 2, unk 3); the turn markers follow.
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
TOKENIZER_VOCAB = 512
# Gemma's chat template (user / model turns); `model` is Gemma's name for the assistant role. Gemma has no tool role:
# tool use is written as text, as Gemma's function-calling guide does, in the tags of the widely used Hermes
# convention: the function declarations (`tools`, JSON) open the first turn inside <tools>, a model turn's calls
# follow its text as <tool_call>{"name", "arguments"}</tool_call>, and a tool's result comes back in a user turn
# inside <tool_response>. Conversations without tools render as they always did.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% elif message['role'] == 'tool' %}{% set role = 'user' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if loop.first and tools %}{{ 'You can call these functions:\n<tools>\n' }}"
    "{% for tool in tools %}{{ (tool.function if tool.function is defined else tool) | tojson + '\n' }}{% endfor %}"
    "{{ '</tools>\n\n' }}{% endif %}"
    "{% set content = (message['content'] or '') | trim %}"
    "{% if message['role'] == 'tool' %}{{ '<tool_response>\n' + content + '\n</tool_response>' }}"
    "{% else %}{{ content }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set f = call.function if call.function is defined else call %}"
    "{{ ('\n' if content or not loop.first else '') + '<tool_call>\n' }}"
    "{{ {'name': f.name, 'arguments': f.arguments} | tojson + '\n</tool_call>' }}{% endfor %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Bump when the way checkpoints are built changes, so stale cache entries are not reused.
BUILD_VERSION = 3


def build_tokenizer(out_dir: Path):
    """Train a small byte-level BPE tokenizer (deterministic) with Gemma's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Byte-level pieces: any UTF-8 text (a user's Alpaca file too) encodes without unknown tokens.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_for_tokenizer(), trainer=trainer)
    # Like Gemma's tokenizer: <bos> is prepended when special tokens are requested.
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="right",
    )
    hf_tok.chat_template = GEMMA_CHAT_TEMPLATE
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def _config_class(family: ModelFamily) -> type:
    return family_row(family).config_class()


def _model_class(family: ModelFamily) -> type:
    return family_row(family).model_class()


# The checkpoint is written in shards of at most this size, each held whole in host memory while it is written.
MAX_SHARD_BYTES = 5 * 10**9


def random_checkpoint_dir(family: ModelFamily, arch: dict[str, Any], seed: int) -> Path:
    """Where `build_random_checkpoint` keeps `arch`'s random weights drawn from `seed` (there once built)."""
    digest = hashlib.sha256(_random_key(family, arch, seed).encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{family.value}-random-{digest}"


def _random_key(family: ModelFamily, arch: dict[str, Any], seed: int) -> str:
    return json.dumps({"family": family.value, "arch": arch, "seed": seed, "v": BUILD_VERSION}, sort_keys=True)


def build_random_checkpoint(family: ModelFamily, arch: dict[str, Any], seed: int) -> Path:
    """Return a cached checkpoint dir holding `arch` with random weights drawn from `seed` (built on first use).

    `arch` without `vocab_size` gets the local tokenizer's vocabulary (the tiny default); with one, the table has
    that size and the local tokenizer uses its first ids. The entry is built in a temporary directory renamed into
    place and verified on every use (`exp.core.cache`): a killed build, two concurrent builders or a damaged file
    never leave an entry that loads wrong.
    """
    key = _random_key(family, arch, seed)

    def build(tmp: Path) -> None:
        tokenizer = build_tokenizer(tmp)
        fields = dict(arch)
        fields.setdefault("vocab_size", len(tokenizer))
        if fields["vocab_size"] < len(tokenizer):
            raise ConfigError(
                f"model.arch.vocab_size={fields['vocab_size']}: smaller than the local tokenizer's {len(tokenizer)} "
                f"tokens, whose ids would index past the embedding. Use model.arch.vocab_size={len(tokenizer)} or "
                "more, or drop it (the tokenizer's size is the default)"
            )
        fields.update(pad_token_id=0, eos_token_id=1, bos_token_id=2)
        try:
            config = _config_class(family)(**fields)
        except Exception as e:  # TypeError, ValueError, huggingface_hub's validation errors: the fields only
            raise ConfigError(
                f"model.arch={arch}: transformers' {_config_class(family).__name__} refuses it "
                f"({type(e).__name__}: {' '.join(str(e).split())}). Fix the architecture fields, e.g. as in "
                "conf/model/gemma_tiny.yaml"
            ) from None
        # From the config object: arch may leave any of these to the family's defaults.
        row = family_row(family)
        n_params = row.param_count(row.sizes(config.to_dict()))
        # Large shapes are stored in bf16 (as Google ships them); the tiny default in fp32 for exact CPU tests.
        dtype = torch.bfloat16 if n_params > 50_000_000 else torch.float32
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        # Drawing billions of random weights takes minutes on a CPU and seconds on a GPU. (The values differ
        # between the two; the cache key is per machine, so each machine is self-consistent.)
        build_device = "cuda" if dtype == torch.bfloat16 and torch.cuda.is_available() else "cpu"
        try:
            try:
                model = _draw_model(family, config, arch, seed, build_device)
            except torch.OutOfMemoryError:
                model = None  # retried below, once the failed attempt's frames (and their tensors) are gone
            if model is None:
                # A GPU too small for the whole model in bf16 (training loads it in 4 bits): draw it on the CPU.
                log.warning(
                    "model.random_init: %s does not fit on the GPU in bf16; drawing its weights on the CPU (minutes)",
                    _model_class(family).__name__,
                )
                torch.cuda.empty_cache()
                build_device = "cpu"
                model = _draw_model(family, config, arch, seed, build_device)
        finally:
            torch.set_default_dtype(previous)
        model.save_pretrained(tmp, max_shard_size=MAX_SHARD_BYTES)
        (tmp / "exp_build.json").write_text(key + "\n")
        del model
        if build_device == "cuda":
            torch.cuda.empty_cache()

    return ensure_entry(
        random_checkpoint_dir(family, arch, seed), build, f"model.random_init checkpoint of model.arch (seed {seed})"
    )


def _draw_model(family: ModelFamily, config: Any, arch: dict[str, Any], seed: int, device: str) -> Any:
    """`family`'s model of `config` with weights drawn from `seed` on `device` (the default dtype as set)."""
    # A private RNG stream: the build must not shift the caller's random state (dropout masks, data order), or a
    # run that builds the cache would differ from the same run with the cache already filled.
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if device == "cuda":
            torch.cuda.manual_seed(seed)
        try:
            return _model_class(family)(config)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            if "can't allocate memory" in str(e) or "not enough memory" in str(e):
                raise ConfigError(
                    f"model.random_init: the host has too little free memory to draw {_model_class(family).__name__} "
                    f"of model.arch={arch} ({' '.join(str(e).split())}). Free host memory, or use a smaller "
                    "architecture (e.g. model=gemma_tiny)"
                ) from None
            raise _arch_error(family, arch, e) from None
        # Shapes that do not fit together; KeyError: a rope_scaling type transformers does not know.
        except (ValueError, ZeroDivisionError, KeyError, TypeError, IndexError) as e:
            raise _arch_error(family, arch, e) from None


def _arch_error(family: ModelFamily, arch: dict[str, Any], e: Exception) -> ConfigError:
    return ConfigError(
        f"model.arch={arch}: building {_model_class(family).__name__} failed ({type(e).__name__}: "
        f"{' '.join(str(e).split())}). Fix the architecture fields, e.g. as in conf/model/gemma_tiny.yaml"
    )
