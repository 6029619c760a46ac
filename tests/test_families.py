"""The family table (exp.model.families) against what it describes: each row's facts as transformers builds the
family, its option files, PEFT's adapters, and the composition check of `lora.target_modules` it owns."""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT, compose_typed

from exp.core.config import TINY_ARCH, ConfigError, ModelFamily
from exp.model.families import FAMILIES, family_of_model_type, family_row

# Six layers and a sliding window: both kinds of layer of every pattern, and a vocabulary of its own.
ARCH = {**TINY_ARCH, "num_hidden_layers": 6, "vocab_size": 300, "sliding_window": 16}


def _tiny(row):
    import torch

    config = row.config_class()(**ARCH)
    with torch.random.fork_rng(devices=[]):  # the draw leaves the random state of the tests after it alone
        return config, row.model_class()(config)


@pytest.mark.parametrize("name", list(ModelFamily))
def test_each_row_describes_the_model_transformers_builds(name):
    import torch

    row = FAMILIES[name]
    assert row.name == name and family_row(name.value) is row
    config, model = _tiny(row)
    assert family_of_model_type(config.model_type) is row
    # Defaults where model.arch leaves a field out.
    defaults = row.config_class()()
    assert defaults.head_dim == row.head_dim
    assert getattr(defaults, "attn_logit_softcapping", None) == row.attn_logit_softcapping
    assert getattr(defaults, "final_logit_softcapping", None) == row.final_logit_softcapping
    # The sliding-window pattern, as transformers assigns the layers' kinds.
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * ARCH["num_hidden_layers"]
    assert [k == "full_attention" for k in kinds] == [row.layer_is_global(i, True) for i in range(len(kinds))]
    # The decoder layer: its class, its norms, QK-norm.
    layer = model.model.layers[0]
    assert type(layer) is row.decoder_layer_class()
    norms = [n for n, m in layer.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert len([n for n in norms if n.split(".")[-1] not in ("q_norm", "k_norm")]) == row.norms_per_layer
    assert any(n.endswith("q_norm") for n in norms) == row.qk_norm
    # Every LoRA target is a Linear of that name, of the shape the row gives it.
    sizes = row.sizes(config.to_dict())
    linears = {n.rsplit(".", 1)[-1]: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for target in row.lora_targets:
        p = row.target(target)
        assert (linears[target].in_features, linears[target].out_features) == p.shape(sizes), target
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == row.tied_head
    assert row.param_count(sizes) == sum(
        t.numel() for n, t in model.named_parameters() if "norm" not in n and n != "lm_head.weight"
    )


def test_every_option_file_takes_its_familys_attention():
    for path in sorted((ROOT / "conf" / "model").glob("*.yaml")):
        cfg = compose_typed([f"model={path.stem}"])
        assert cfg.model.attn_implementation == family_row(cfg.model.family).attn_implementation, path.name


def test_the_estimate_counts_the_trainable_parameters_peft_makes():
    """A LoRA on the head and on two projections: the estimate's trainable count is PEFT's, exactly."""
    from exp.hardware.memory import estimate_for_config
    from exp.model.build import build_model

    # A vocabulary the config names, so the estimate and the built table agree on its size.
    cfg = compose_typed(["lora.target_modules=[q_proj,v_proj,lm_head]", "+model.arch.vocab_size=512", "logger=none"])
    model = build_model(cfg, "cpu")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert any("lm_head.lora_A" in n for n, _ in model.named_parameters())
    estimate = estimate_for_config(cfg)
    assert estimate.details["trainable_params"] == trainable
    assert estimate.lora_params == 4 * trainable  # fp32


@pytest.mark.parametrize("targets", ["[q_proj,embed_tokens]", "[q_proj,qv_proj]", "[all-linear]"])
def test_a_target_the_family_lacks_is_refused_when_composing(targets):
    with pytest.raises(ConfigError) as refused:
        compose_typed([f"lora.target_modules={targets}"])
    message = str(refused.value)
    assert message.startswith("lora.target_modules=['") and "\n" not in message
    assert "Allowed: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head." in message
    assert "Fix: e.g. lora.target_modules=[q_proj,v_proj]" in message


def test_varlen_is_refused_for_a_family_that_softcaps_attention():
    with pytest.raises(ConfigError, match="varlen with a Gemma 2 model: the varlen kernel has no attention-logit"):
        compose_typed(["model=gemma2_2b", "model.attn_implementation=varlen"])
    assert compose_typed(["model=gemma3_1b", "model.attn_implementation=varlen"]).model.attn_implementation == "varlen"


def test_every_family_has_an_option_file():
    families = {(yaml.safe_load(p.read_text()) or {}).get("family", "gemma") for p in (ROOT / "conf/model").iterdir()}
    assert families == {f.value for f in FAMILIES}
