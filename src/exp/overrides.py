"""Check command-line overrides against the schema before Hydra composes, for errors that list what is allowed.

Hydra already rejects an unknown key (`lora.rank=16`), but its message names neither the valid fields nor the
nearest one. This check walks the dataclass schema and says both.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path

from exp.config import TrainConfig


def _fields(cls: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_cli_overrides(args: list[str]) -> list[str]:
    """One message per `a.b=value` override whose key path is not in the schema (flags and `+`/`~` skipped)."""
    problems = []
    for arg in args:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        if key in ("hydra.run.dir", "hydra.sweep.dir") and Path(value.strip("'\"")).is_file():
            problems.append(
                f"'{arg}': {value} is an existing file, not a directory: a run directory cannot be created there. "
                f"Pass a new directory, e.g. {key}={value}_run."
            )
            continue
        parts = key.split(".")
        if parts[0] == "hydra" or len(parts) < 2 or "@" in key:
            continue  # group choices (model=...) are checked by Hydra, which lists the options
        node: typing.Any = TrainConfig
        for depth, part in enumerate(parts):
            if not dataclasses.is_dataclass(node):
                break  # a dict or list field: free-form below this point
            fields = _fields(node)
            if part not in fields:
                where = ".".join(parts[:depth]) or "the root config"
                # Short field names (lora.r) are far from their spelled-out guesses (rank) by edit ratio: a
                # field that starts the typed word counts as close too.
                close = (
                    difflib.get_close_matches(part, fields, n=1)
                    or sorted((f for f in fields if part.startswith(f) or f.startswith(part)), key=len, reverse=True)[
                        :1
                    ]
                )
                hint = f" Did you mean '{'.'.join(parts[:depth] + close)}'?" if close else ""
                problems.append(
                    f"'{arg}': '{part}' is not a field of {where}.{hint} Allowed: {', '.join(sorted(fields))}."
                )
                break
            node = fields[part]
    return problems
