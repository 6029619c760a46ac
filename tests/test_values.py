"""Every value the schema accepts runs; every other value is refused by the schema, naming the key, the value and
the fix, before anything runs.

The table pairs each refused value with the library call that would have failed on it later (with a traceback):
the schema's ranges are derived from what torch, Lightning, numpy and W&B reject. The boundary values just inside
each range go through the same library calls without an error.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import compose_typed

from exp.core.config import ConfigError

PARAM = [torch.nn.Parameter(torch.zeros(2))]


def adamw(**kwargs):
    defaults = dict(lr=2e-4, betas=(0.9, 0.999), weight_decay=0.0)
    return torch.optim.AdamW(PARAM, **{**defaults, **kwargs})


def loader(num_workers: int):
    return torch.utils.data.DataLoader([1, 2], num_workers=num_workers)


def wandb_settings(**kwargs):
    from wandb.sdk.wandb_settings import Settings

    return Settings(**kwargs)


# override, what the message must say (key and value), and the library call that rejects the value (None: exp's own
# rule, e.g. a NaN that a library would take and then train on).
REFUSED = [
    ("trainer.learning_rate=nan", "trainer.learning_rate=nan: must be a finite number", lambda: adamw(lr=math.nan)),
    ("trainer.learning_rate=inf", "trainer.learning_rate=inf: must be a finite", None),
    ("trainer.learning_rate=-1e-3", "trainer.learning_rate=-0.001: must be positive", lambda: adamw(lr=-1e-3)),
    (
        "trainer.adam_beta1=1.5",
        "trainer.adam_beta1=1.5: AdamW's betas must be in [0, 1)",
        lambda: adamw(betas=(1.5, 0.9)),
    ),
    ("trainer.adam_beta1=1.0", "trainer.adam_beta1=1.0: AdamW", lambda: adamw(betas=(1.0, 0.9))),
    ("trainer.adam_beta2=-0.1", "trainer.adam_beta2=-0.1: AdamW", lambda: adamw(betas=(0.9, -0.1))),
    ("trainer.adam_beta2=nan", "trainer.adam_beta2=nan: must be a finite", lambda: adamw(betas=(0.9, math.nan))),
    (
        "trainer.weight_decay=-1",
        "trainer.weight_decay=-1.0: must be >= 0 (0: no decay)",
        lambda: adamw(weight_decay=-1.0),
    ),
    ("trainer.weight_decay=nan", "trainer.weight_decay=nan: must be a finite", None),
    ("trainer.max_grad_norm=inf", "trainer.max_grad_norm=inf: must be a finite", None),
    ("trainer.max_grad_norm=-1", "trainer.max_grad_norm=-1.0: must be >= 0", None),
    ("hardware.num_workers=-1", "hardware.num_workers=-1: must be >= 0 (data-loading processes", lambda: loader(-1)),
    ("data.val_size=nan", "data.val_size=nan: must be a finite number", None),
    ("data.val_size=inf", "data.val_size=inf: must be a finite number", None),
    ("data.val_size=0", "data.val_size=0.0: must be a fraction", None),
    ("data.val_size=2.5", "data.val_size=2.5: must be a fraction in (0, 1) or a whole count", None),
    ("data.num_examples=1", "data.num_examples=1: must be >= 2 (one to train on", None),
    ("data.num_examples=-5", "data.num_examples=-5", None),
    ("lora.dropout=nan", "lora.dropout=nan: must be a finite number", None),
    ("lora.dropout=-inf", "lora.dropout=-inf: must be a finite number", None),
    ("trainer.seed=-1", "trainer.seed=-1: a seed must be in [0, 2**32 - 1]", lambda: np.random.seed(-1)),
    ("trainer.seed=4294967296", "trainer.seed=4294967296", lambda: np.random.seed(2**32)),
    ("data.seed=-7", "data.seed=-7: a seed", None),
    ("model.seed=18446744073709551616", "model.seed=18446744073709551616", lambda: torch.manual_seed(2**64)),
    ("lora.init_seed=-2", "lora.init_seed=-2: a seed", None),
    ("trainer.limit_val_batches=0", "trainer.limit_val_batches=0: must be >= 1", None),
    ("trainer.sample_count=-1", "trainer.sample_count=-1: must be >= 0", None),
    ("trainer.sample_max_new_tokens=0", "trainer.sample_max_new_tokens=0: must be >= 1", None),
    ("logger.project=team/exp", "logger.project='team/exp': W&B project names", lambda: wandb_settings(project="a/b")),
    ("logger.project=''", "logger.project='': W&B project names are 1 to 128", None),
    (
        "logger.tags=[" + "x" * 65 + "]",
        "W&B tags (the experiment name is one) are 1 to 64",
        lambda: wandb_settings(run_tags=("x" * 65,)),
    ),
    ("+model.arch.rope_theta=nan", "model.arch.rope_theta=nan: must be a finite number", None),
    ("model.arch.hidden_size=-1", "model.arch.hidden_size=-1: must be a whole number >= 1", None),
    ("model.arch.num_attention_heads=0", "model.arch.num_attention_heads=0: must be a whole number", None),
    ("model.arch.head_dim=3", "model.arch.head_dim=3: must be even", None),
    ("model.arch.num_key_value_heads=3", "model.arch.num_attention_heads=4 is not a multiple of", None),
    ("model.attn_implementation=flash_attention_3", "allowed values are sdpa, eager, flash_attention_2", None),
    ("model.attn_implementation=flash_attention_2", "flash_attention_2 on the CPU: FlashAttention is a CUDA", None),
    ("trainer.max_skipped_steps=-1", "trainer.max_skipped_steps=-1: must be >= 0", None),
    ("hardware.micro_batch_size=0", "hardware.micro_batch_size=0: must be >= 1", None),
    ("trainer.global_batch_size=0", "trainer.global_batch_size=0: must be >= 1", None),
]


@pytest.mark.parametrize(("override", "message", "library"), REFUSED, ids=[r[0][:40] for r in REFUSED])
def test_the_schema_refuses_what_a_library_would_crash_on(override: str, message: str, library):
    with pytest.raises(ConfigError) as info:
        compose_typed([override, "logger=wandb"])
    text = str(info.value)
    assert message in text, text
    assert text.count("\n  - ") == 1, text  # one value wrong, one finding: none derived from it
    assert any(fix in text for fix in ("e.g.", "or null", "characters", "drop it"))  # a fix, or what is allowed
    if library is not None:  # the check exists because the library fails on the value, later and with a traceback
        with pytest.raises((ValueError, RuntimeError, TypeError, Exception)):
            library()


# Values just inside each range: accepted by the schema and by the library that takes them.
ACCEPTED = [
    ("trainer.adam_beta1=0.0", lambda c: adamw(betas=(c.trainer.adam_beta1, c.trainer.adam_beta2))),
    ("trainer.adam_beta2=0.9999", lambda c: adamw(betas=(c.trainer.adam_beta1, c.trainer.adam_beta2))),
    ("trainer.weight_decay=0", lambda c: adamw(weight_decay=c.trainer.weight_decay)),
    ("trainer.learning_rate=1e-9", lambda c: adamw(lr=c.trainer.learning_rate)),
    ("hardware.num_workers=0", lambda c: loader(c.hardware.num_workers)),
    ("hardware.num_workers=1", lambda c: loader(c.hardware.num_workers)),
    ("trainer.seed=4294967295", lambda c: np.random.seed(c.trainer.seed)),
    ("trainer.seed=0", lambda c: np.random.seed(c.trainer.seed)),
    ("data.val_size=1", lambda c: None),
    ("data.val_size=0.999", lambda c: None),
    ("trainer.max_grad_norm=0", lambda c: None),
    ("trainer.limit_val_batches=1", lambda c: None),
    ("trainer.sample_count=0", lambda c: None),
    ("logger.project=my-project_2", lambda c: wandb_settings(project=c.logger.project)),
    ("logger.tags=[" + "x" * 64 + "]", lambda c: wandb_settings(run_tags=tuple(c.logger.tags))),
]


@pytest.mark.parametrize(("override", "library"), ACCEPTED, ids=[r[0][:40] for r in ACCEPTED])
def test_values_at_the_edge_of_each_range_are_accepted_and_run(override: str, library):
    cfg = compose_typed([override, "logger=wandb"])
    library(cfg)


def test_every_accepted_value_builds_the_trainer_and_the_optimizer():
    """The edge values together: the Lightning Trainer and the optimiser exp builds take them."""
    from exp.training.module import build_optimizer
    from exp.training.trainer import build_trainer

    cfg = compose_typed(
        [
            "trainer.adam_beta1=0.0",
            "trainer.weight_decay=0",
            "trainer.max_grad_norm=0",
            "trainer.limit_val_batches=1",
            "trainer.sample_count=0",
            "trainer.seed=4294967295",
            "logger=none",
        ]
    )
    build_optimizer(cfg.trainer, PARAM)
    trainer = build_trainer(cfg, __import__("pathlib").Path("/nonexistent-run"), [])
    assert trainer.max_steps == cfg.trainer.max_steps


def test_a_nan_is_reported_once_not_once_per_range_check():
    with pytest.raises(ConfigError) as info:
        compose_typed(["lora.dropout=nan"])
    assert str(info.value).count("\n  - ") == 1 and "lora.dropout=nan" in str(info.value)


def test_an_architecture_the_tokenizer_does_not_fit_is_refused_when_built(tmp_path, monkeypatch):
    from exp.core.config import ModelFamily
    from exp.model.local import build_random_checkpoint

    monkeypatch.setenv("EXP_CACHE", str(tmp_path))
    arch = {**compose_typed([]).model.arch, "vocab_size": 10}
    with pytest.raises(ConfigError, match=r"model.arch.vocab_size=10: smaller than the local tokenizer"):
        build_random_checkpoint(ModelFamily.gemma, arch, 0)
    assert [p.name for p in (tmp_path / "models").iterdir()] == []  # the half-built entry is gone
