"""Build the trainable model: a (4-bit) Gemma loaded once on a given device, wrapped with PEFT LoRA."""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from exp.core.config import (
    ConfigError,
    LoraConfig,
    LoraInit,
    ModelConfig,
    QuantizationConfig,
    QuantType,
    Reference,
    TrainConfig,
    model_path_problem,
)
from exp.core.strategies import strategy_traits
from exp.model import varlen
from exp.model.adapters import add_adapters
from exp.model.compile_cache import use_compile_cache
from exp.model.families import family_row
from exp.model.lora_init import apply_init, creation_init

log = logging.getLogger(__name__)

# The frozen copy of the starting adapter that scores DPO / KTO's reference (objective.reference=start).
REFERENCE_ADAPTER = "reference"
COMPUTE_DTYPE = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    return COMPUTE_DTYPE[precision]


def resolve_checkpoint(cfg: ModelConfig) -> str:
    """Where `from_pretrained` reads from: a local path, a random-weight build in the cache, or a hub id."""
    if cfg.path:
        if problem := model_path_problem(cfg.path):
            raise ConfigError(problem)
        source = str(Path(cfg.path).expanduser())
    elif cfg.random_init:
        # needed on this path only (the random-weight builder; bitsandbytes classes for kept weights)
        from exp.model.local import build_random_checkpoint

        source = str(build_random_checkpoint(cfg.family, dict(cfg.arch), cfg.seed))
    else:
        assert cfg.hub_id is not None  # guaranteed by TrainConfig validation
        source = cfg.hub_id
    if cfg.trust_remote_code:
        _warn_remote_code(source)
    return source


@functools.cache  # once per repository and process: the tokenizer and the model both resolve it
def _warn_remote_code(source: str) -> None:
    log.warning(
        "model.trust_remote_code=true: Python code from '%s' (its modeling / tokenizer files) will be imported and run "
        "in this process. Gemma is native in transformers and never needs it: set model.trust_remote_code=false "
        "unless you have read that code.",
        source,
    )


def build_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    source = resolve_checkpoint(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        raise ConfigError(_hub_hint(cfg, source, e)) from e
    if tok.pad_token_id is None:  # Gemma defines <pad>; a foreign tokenizer may not
        tok.pad_token = tok.eos_token
    return tok


def build_quantization_config(cfg: QuantizationConfig, dtype: torch.dtype, storage: torch.dtype | None = None):
    """bitsandbytes settings for `from_pretrained`; None for plain (unquantized) LoRA.

    `storage` packs the 4-bit values into tensors of that dtype instead of uint8: FSDP flattens all parameters of a
    wrapped layer into one tensor and needs them to share a dtype (issue: "Must flatten tensors with uniform dtype").
    """
    from transformers import BitsAndBytesConfig

    if cfg.quant_type == QuantType.none:
        return None
    if cfg.quant_type == QuantType.int8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.quant_type.value,
        bnb_4bit_use_double_quant=cfg.double_quant,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=storage or torch.uint8,
    )


def _hub_hint(cfg: ModelConfig, source: str, err: Exception) -> str:
    return (
        f"model={cfg.name}: could not load '{source}' ({type(err).__name__}: {str(err).splitlines()[0]}). "
        "Without network access the hub weights must already be in the local Hugging Face cache; otherwise "
        "download them elsewhere and pass model.path=<dir>, or build the architecture with random weights "
        "using model.random_init=true."
    )


def load_base_model(cfg: TrainConfig, device: torch.device) -> nn.Module:
    """Load the frozen base on `device`, quantized as configured. A 4-bit model cannot move after this."""
    from transformers import AutoModelForCausalLM

    dtype = compute_dtype(cfg.hardware.precision)
    source = resolve_checkpoint(cfg.model)
    strategy = strategy_traits(cfg.hardware.strategy)
    # Map the whole model ("") to the strategy's device: the key is the module prefix, the value the device (the
    # widely copied {0: ""} has them swapped). Model parallelism instead spreads the layers over every visible GPU.
    device_map = layer_device_map(source, cfg) if strategy.spans_devices_in_one_process else {"": device}
    # Sharding splits only floating-point tensors: the packed 4-bit bytes are stored in the compute dtype.
    storage = dtype if strategy.sharded else None
    if cfg.model.attn_implementation == varlen.NAME:
        varlen.register()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            quantization_config=build_quantization_config(cfg.quantization, dtype, storage),
            device_map=device_map,
            dtype=dtype,
            attn_implementation=cfg.model.attn_implementation,
            revision=cfg.model.revision,
            trust_remote_code=cfg.model.trust_remote_code,
        )
    except OSError as e:
        raise ConfigError(_hub_hint(cfg.model, source, e)) from e
    _disable_cpu_inference_repacking(model)
    return model


def layer_device_map(source: str, cfg: TrainConfig) -> dict[str, int]:
    """Model parallelism: decoder layers split evenly over the visible GPUs, in order; the embedding (tied to the
    head) and everything outside the layers on the first one, where Lightning puts the batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    n_gpus = torch.cuda.device_count()
    config = AutoConfig.from_pretrained(source, revision=cfg.model.revision)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    layers = config.num_hidden_layers
    per_gpu = -(-layers // n_gpus)
    device_map: dict[str, int] = {}
    for name, _ in skeleton.named_children():
        if name != "model":
            device_map[name] = 0
    for name, _ in skeleton.model.named_children():
        if name != "layers":
            device_map[f"model.{name}"] = 0
    for i in range(layers):
        device_map[f"model.layers.{i}"] = min(i // per_gpu, n_gpus - 1)
    return device_map


def _disable_cpu_inference_repacking(model: nn.Module) -> None:
    """Keep bitsandbytes' CPU fast path from breaking training.

    On CPUs with AVX512-BF16, bitsandbytes 0.50 repacks a Linear4bit's weight into an inference-only layout the
    first time it runs in eval mode (a validation pass), and from then on its forward has no autograd: gradients
    stop flowing through every 4-bit layer, so the adapters below it never train. We evaluate during training,
    so the repacking must stay off.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def warn_full_copies(model: nn.Module, cfg: ModelConfig, lora: LoraConfig) -> None:
    """Say how large a vocabulary-sized module in `lora.modules_to_save` is. (`lora.target_modules` was checked against
    the family's row when the config was composed: exp.run.compose.)"""
    vocabulary_modules = family_row(cfg.family).vocabulary_modules
    for name in lora.modules_to_save:
        if name in vocabulary_modules:
            emb = model.get_input_embeddings().weight
            size_mb = emb.numel() * 4 / 2**20  # trained in fp32 and saved with the adapter
            log.warning(
                "lora.modules_to_save contains '%s': Gemma ties it to the %d x %d embedding, so the adapter "
                "trains and saves a full copy (~%.0f MB in fp32). Drop it unless you change the vocabulary.",
                name,
                emb.shape[0],
                emb.shape[1],
                size_mb,
            )


def build_lora_config(cfg: LoraConfig, quantized: bool = False):
    """PEFT's LoraConfig; `quantized`: the base is 4-bit, where some inits run after creation (exp.model.lora_init)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        modules_to_save=list(cfg.modules_to_save) or None,
        bias=cfg.bias,
        use_dora=cfg.use_dora,
        use_rslora=cfg.use_rslora,
        init_lora_weights=creation_init(cfg, quantized),
        rank_pattern=dict(cfg.rank_pattern),
        alpha_pattern=dict(cfg.alpha_pattern),
        task_type="CAUSAL_LM",
    )


def check_patterns(model: nn.Module, cfg: LoraConfig) -> None:
    """Every `lora.rank_pattern` / `lora.alpha_pattern` key must have matched a LoRA layer: PEFT ignores a key that
    matches none, and the run would train at the default rank without a word."""
    from peft.tuners.lora import LoraLayer

    names = [n.removeprefix("base_model.model.") for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    for field_name, pattern in (("rank_pattern", cfg.rank_pattern), ("alpha_pattern", cfg.alpha_pattern)):
        for key in pattern:
            if not any(re.match(rf"(.*\.)?({key})$", n) for n in names):  # PEFT's own match of a pattern key
                raise ConfigError(
                    f"lora.{field_name}: the key '{key}' matches no LoRA layer of this model (e.g. {names[0]}). "
                    f"Fix: a target module name (lora.{field_name}={{{names[0].rsplit('.', 1)[-1]}:16}}) or the end of a "
                    "module path as above, or remove the key."
                )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers transformers can checkpoint, in order (GradientCheckpointingLayer instances)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def limit_checkpointed_layers(model: nn.Module, count: int | None) -> None:
    """Recompute only the first `count` decoder layers (None: all). transformers checks each layer's own
    `gradient_checkpointing` flag at every forward, so clearing it on a layer makes that layer save its activations
    as without checkpointing; exp.hardware.memory counts the same split."""
    if count is None:
        return
    for i, layer in enumerate(decoder_layers(model)):
        layer.gradient_checkpointing = i < count


def build_model(
    cfg: TrainConfig, device: torch.device | str = "cpu", adapters: dict[str, LoraConfig] | None = None
) -> nn.Module:
    """The trainable model: base loaded on `device` + LoRA adapters, in train mode, checkpointing as configured.

    `adapters`: several named adapters over the one base, all trainable (a study's jobs trained together,
    exp.model.adapters), instead of the one `cfg.lora` adapter named "default"."""
    from peft import get_peft_model

    device = torch.device(device)
    model = load_base_model(cfg, device)
    warn_full_copies(model, cfg.model, cfg.lora)
    model.config.use_cache = False  # a generation KV cache is dead weight in training (and clashes with checkpointing)
    if cfg.hardware.gradient_checkpointing:
        # Non-reentrant: works with frozen inputs (no enable_input_require_grads) and with DDP + LoRA.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        limit_checkpointed_layers(model, cfg.hardware.checkpoint_layers)
    # The adapter initialisation has its own seed, so the same lora.init_seed gives the same adapters whatever
    # else consumed random numbers before (data generation, the random-weight build). The adapters are drawn on
    # the CPU and then moved next to their base layer (PEFT does), so they are the same on every device: Lightning
    # calls configure_model with the strategy's device as torch's default device, where the draws would come from
    # that device's generator instead.
    # (torch.manual_seed seeds every device's generator: an init computed on the GPU, PiSSA's randomized SVD, draws
    # the same numbers each time the model is built, on resume too.)
    (first, first_lora), *others = (adapters or {"default": cfg.lora}).items()
    if cfg.model.adapter and adapters:
        raise ValueError("model.adapter: a job that starts from an adapter trains alone (exp.study.grouping)")
    quantized = cfg.quantization.quant_type in (QuantType.nf4, QuantType.fp4)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(first_lora.init_seed)
        if cfg.model.adapter:
            model = load_start_adapter(model, cfg.model.adapter, cfg.lora.dropout)
        else:
            model = get_peft_model(model, build_lora_config(first_lora, quantized), adapter_name=first)
            source = resolve_checkpoint(cfg.model) if first_lora.init == LoraInit.loftq else None  # LoftQ reads it
            apply_init(model, first_lora, first, quantized, source)
        if cfg.reference == Reference.start:
            add_reference_adapter(model, cfg.model.adapter)
    check_patterns(model, first_lora)
    if others:
        add_adapters(model, dict(others), build_lora_config)
    if cfg.hardware.dequantized_layers:
        # needed on this path only (the random-weight builder; bitsandbytes classes for kept weights)
        from exp.model.dequantized import keep_dequantized

        kept = keep_dequantized(
            decoder_layers(model)[: cfg.hardware.dequantized_layers],
            fuse_lora=cfg.hardware.fuse_lora is True,  # "auto" is resolved by the preflight
            reference=REFERENCE_ADAPTER,
        )
        log.info("kept dequantized weights: %d decoder layers, %.2f GiB", cfg.hardware.dequantized_layers, kept / 2**30)
    if strategy_traits(cfg.hardware.strategy).sharded:
        # FSDP flattens each wrapped layer's parameters into one tensor of one dtype: adapters join the (4-bit
        # storage and norm) weights in the compute dtype. PEFT keeps them in fp32 otherwise.
        dtype = compute_dtype(cfg.hardware.precision)
        for name, p in model.named_parameters():
            if p.requires_grad or f".{REFERENCE_ADAPTER}." in name:
                p.data = p.data.to(dtype)
    if cfg.hardware.compile is True:  # "auto" is resolved by the preflight; unresolved, it stays eager
        log.info("compile caches: %s", use_compile_cache())
        if adapters is not None:  # several adapters: their routing stays eager (compile_adapter_free_parts says why)
            parts = compile_adapter_free_parts(model)
            log.info("compiled in every decoder layer: %s (the parts without adapters)", ", ".join(parts) or "none")
        else:
            compile_decoder_layers(model)
    # from_pretrained returns eval mode, where dropout and gradient checkpointing are inactive.
    model.train()
    return model


def load_start_adapter(model: nn.Module, adapter_dir: str, dropout: float) -> nn.Module:
    """The PEFT model over `model` with the adapter in `adapter_dir` (`model.adapter`, resolved) as its trainable
    "default" adapter, in the adapter's own shape; `dropout` is this run's `lora.dropout`."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel

    config = PeftLoraConfig.from_pretrained(adapter_dir)
    config.lora_dropout = dropout
    try:
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True, config=config, torch_device="cpu")
    except RuntimeError as e:
        if "size mismatch" not in str(e):
            raise
        first = next(line.strip() for line in str(e).splitlines() if "size mismatch" in line)
        raise ConfigError(
            f"model.adapter={adapter_dir}: the adapter does not fit this base ({first}). It was trained on "
            f"'{config.base_model_name_or_path}', another architecture: use that base (model=... / model.path=...) "
            "or pick an adapter trained on this one."
        ) from None


def add_reference_adapter(model: nn.Module, adapter_dir: str) -> None:
    """A frozen copy of the adapter in `adapter_dir`, named REFERENCE_ADAPTER, beside the trainable one: DPO and
    KTO's reference when it is the model at step 0 (exp.training.objectives). Without dropout, so that the reference
    is one fixed function whatever mode the model is in."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import load_peft_weights, set_peft_model_state_dict

    config = PeftLoraConfig.from_pretrained(adapter_dir)
    config.lora_dropout = 0.0
    config.inference_mode = True
    model.add_adapter(REFERENCE_ADAPTER, config)  # inactive and frozen: the trainable adapter stays the active one
    weights = load_peft_weights(adapter_dir, device="cpu")
    loaded = set_peft_model_state_dict(model, weights, adapter_name=REFERENCE_ADAPTER)
    if loaded.unexpected_keys:  # a copy that kept its fresh initialisation would be a wrong reference, silently
        raise RuntimeError(f"the reference copy of {adapter_dir} did not take {loaded.unexpected_keys[:3]}")


def compile_decoder_layers(model: nn.Module) -> None:
    """torch.compile every decoder layer in place (`Module.compile`: parameter names and state-dict keys stay).

    Per layer rather than the whole model: every layer has the same code, so one compiled graph serves them all.
    Dynamo's automatic dynamic shapes handle varying lengths (exp.model.compile_cache says how many graphs that makes).

    Recent transformers checkpoint a layer's `forward` (GradientCheckpointingLayer), inside the compiled call, so a
    recomputed layer is one `torch.utils.checkpoint` region of the graph. Where the `kernels` package is installed
    (transformers depends on it), the layer's forward sets and resets a context variable of that package, a side
    effect Dynamo will not replay in the recomputation: it breaks the graph there and the layer runs eagerly
    (`TORCH_LOGS=graph_breaks`: "HOP: Unsafe side effect"). A set-and-reset needs no replay, so Dynamo is told to
    skip it (tests/test_gpu_twin.py::test_gpu_defaults_train_on_the_cpu counts the breaks).
    """
    import torch._dynamo.config as dynamo_config

    if hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # torch versions that have it
        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    allow_layer_graphs()
    for layer in decoder_layers(model):
        layer.compile()


# The graphs one compiled frame may hold before Dynamo runs every call it has no graph for eagerly, for the rest of
# the process (torch's `recompile_limit`, 8 by default). One decoder layer's code serves layers of up to four kinds
# (kept dequantized weights or 4-bit, recomputed or not: Dynamo guards on a submodule's type and on the layer's
# `gradient_checkpointing` flag), each at up to three shapes (exp.model.compile_cache): up to 12 graphs. On one H100
# the Gemma-2B shape with 5 of 18 layers kept hit the default limit at its tenth step, and so did the 7B shape, each
# layer kind's later shapes then running eager (benchmarks/results/h100_20261207b/group_2b/warm.txt,
# benchmarks/results/families_h100_20261206/call3/gemma_7b_first.txt).
LAYER_GRAPHS = 32


def allow_layer_graphs() -> None:
    """Let each compiled frame hold LAYER_GRAPHS graphs (a larger limit the user set stays)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, LAYER_GRAPHS)


def compile_adapter_free_parts(model: nn.Module) -> list[str]:
    """torch.compile, in every decoder layer, the largest submodules that hold no LoRA layer (the norms, an MLP
    without adapters, Gemma 3's query and key norms), in place; returns their names (relative to a layer, once each).

    For several adapters over one base (exp.model.adapters.RowRouter): the router's hooks on the LoRA layers route
    each micro-batch's rows by Python lists that change every step, which a compiled graph would take as constants
    and recompile on. The parts without adapters have no routing, so they compile once (dynamic in the token count
    from their second shape on) and fuse their pointwise work (RMSNorm's fp32 arithmetic, GeGLU) as a compiled single
    job's layers do. A lone Linear (a projection without adapters) is left eager: compiling one product fuses nothing.
    """
    from peft.tuners.lora import LoraLayer  # a PEFT model already: PEFT is loaded

    def has_lora(module: nn.Module) -> bool:
        return any(isinstance(m, LoraLayer) for m in module.modules())

    def worth_compiling(module: nn.Module) -> bool:
        # A parameterless leaf (an activation, dropout) is one kernel however it runs.
        leaf = next(module.children(), None) is None
        return not isinstance(module, nn.Linear) and not (leaf and next(module.parameters(), None) is None)

    compiled: dict[str, None] = {}
    allow_layer_graphs()

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, LoraLayer):
                continue  # its routed adapters run eager, its base layer is one product
            if has_lora(child):
                visit(child, f"{path}.")
            elif worth_compiling(child):
                child.compile()
                compiled[path] = None

    for layer in decoder_layers(model):
        visit(layer, "")
    return list(compiled)


def count_parameters(model: nn.Module) -> dict[str, Any]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable": trainable, "total": total}


def quiet_third_party_logs(verbose: bool = False) -> None:
    """Keep the console to what a user acts on (`verbose`: also transformers' INFO lines and loading bars).

    bitsandbytes logs the absence of an optional CPU kernel package; Lightning installs a second console handler
    (every line would print twice next to Hydra's) and advertises a cloud logger; transformers draws a "Loading
    weights" bar per model load, which buries the lines around it. exp.train, exp.preview, exp.bench, exp.evaluate,
    exp.generate and exp.merge all start with this.
    """
    import warnings

    from transformers.utils import logging as hf_logging

    if verbose:
        hf_logging.set_verbosity_info()
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
        # exp.merge chooses the dtype it dequantizes to and names it in its own summary.
        logging.getLogger("transformers.integrations.bitsandbytes").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        lightning_log = logging.getLogger(name)
        if logging.getLogger().handlers:  # someone (Hydra) already prints and files the root logger
            for handler in list(lightning_log.handlers):
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                    lightning_log.removeHandler(handler)
            lightning_log.propagate = True
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "litlogger" not in r.getMessage())
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)")
    # QLoRAModule counts tokens in this hook and exp's data module has none: there is nothing to choose between.
    warnings.filterwarnings("ignore", message=".*overridden `on_before_batch_transfer`.*LightningDataModule")
    # exp.data tokenizes up front and collates in memory: loader workers would add processes, not speed
    # (hardware.num_workers is there for the rare dataset where they help).
    warnings.filterwarnings("ignore", message=".*does not have many workers which may be a bottleneck")
    # A continued run writes its checkpoints into its own run directory by design (docs/resume.md).
    warnings.filterwarnings("ignore", message="The dirpath has changed from")
