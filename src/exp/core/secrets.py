"""Secrets: what looks like one (by name or by the value of a secret environment variable), and how exp keeps them
out of every file and message it writes."""

from __future__ import annotations

import os
import re
from typing import Any

# A secret-looking key: one of these words as a whole segment of the name (hf_token, WANDB_API_KEY, db_password),
# so that `tokenizer`, `max_new_tokens` or `tokens_per_s` are left alone.
SECRET_NAME = re.compile(
    r"(^|[_\-.])((api|access|private|secret)[_-]?key|token|secret|password|passwd|credentials?)($|[_\-.])",
    re.IGNORECASE,
)
REDACTED = "***redacted***"
# Shorter values of secret-looking variables (a flag like "1", "true") would mask innocent text everywhere.
MIN_SECRET_LENGTH = 6


def environment_secrets(env: dict[str, str] | None = None) -> dict[str, str]:
    """The values of this process's secret-looking environment variables (name -> value): a secret can reach a file
    under another name (`logger.project=${oc.env:WANDB_API_KEY}`, or typed in by mistake), so it is also found by
    its value."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_LENGTH}


def mask_secrets(text: str) -> str:
    """`text` with every value of a secret-looking environment variable replaced by REDACTED."""
    for value in sorted(environment_secrets().values(), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


def secret_sources(value: Any, path: str = "") -> list[tuple[str, str]]:
    """(key, variable) for every string in a nested dict/list that holds the value of a secret environment
    variable."""
    if isinstance(value, dict):
        return [hit for k, v in value.items() for hit in secret_sources(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, list):
        return [hit for i, v in enumerate(value) for hit in secret_sources(v, f"{path}[{i}]")]
    if isinstance(value, str):
        return [(path, name) for name, secret in environment_secrets().items() if secret in value]
    return []


def secret_value_problems(config: Any, recorded: str = "the training config") -> list[str]:
    """One message per key of `config` that holds a secret environment variable's value (never the value)."""
    return [
        f"{key} holds the value of the environment variable {name}, a secret, and {recorded} is written to the run's "
        "files (config.yaml, .hydra/, W&B). Remove it (an ${oc.env:...} interpolation or a value typed in): "
        "credentials are read from the environment where they are needed."
        for key, name in secret_sources(config)
    ]


def redact(value: Any) -> Any:
    """A copy of a nested dict/list with the values of secret-looking keys replaced, and the values of secret
    environment variables masked wherever they appear."""
    if isinstance(value, dict):
        return {k: REDACTED if SECRET_NAME.search(str(k)) and v else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return mask_secrets(value)
    return value


def redact_argv(argv: list[str]) -> list[str]:
    """Command-line overrides with secret-looking keys (`+wandb.api_key=...`) masked."""
    out = []
    for arg in argv:
        key, sep, _ = arg.partition("=")
        out.append(f"{key}={REDACTED}" if sep and SECRET_NAME.search(key.split(".")[-1].lstrip("+~")) else arg)
    return [mask_secrets(a) for a in out]
