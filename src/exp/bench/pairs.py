"""Real preference pairs for `exp.bench objective=dpo|orpo` from an Alpaca file: each example's prompt with its own
output chosen and another example's output rejected.

No preference data set is at hand where the bench runs (no hub), and the speed of a preference step depends on the
lengths of real prompts and completions, not on which completion is better: an example's own answer against the
answer to another instruction is a pair a model can learn to tell apart, with real text on both sides. The other
example is the next one in a seeded shuffle of the file (so never the example itself), and a pair whose two outputs
are the same text is left out. A file that already holds `{prompt, chosen, rejected}` rows is used as it is.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from exp.data.formats import format_prompt


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON array or JSON-lines file."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    rows = json.loads(text)
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON array of rows")
    return rows


def alpaca_pairs(rows: list[dict[str, Any]], seed: int) -> list[dict[str, str]]:
    """{prompt, chosen, rejected} for each Alpaca row: the Alpaca prompt, the row's output, and the output of the row
    after it in a seeded shuffle of the rows."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    other = {i: order[(k + 1) % len(order)] for k, i in enumerate(order)}
    pairs = []
    for i, row in enumerate(rows):
        chosen, rejected = row["output"], rows[other[i]]["output"]
        if chosen.strip() and rejected.strip() and chosen != rejected:
            pairs.append(
                {
                    "prompt": format_prompt(row["instruction"], row.get("input") or ""),
                    "chosen": chosen,
                    "rejected": rejected,
                }
            )
    return pairs


def preference_file(source: Path, out_dir: Path, seed: int) -> Path:
    """The preference file the bench trains on: `source` itself when its rows are pairs, else the pairs of its
    Alpaca rows written to `out_dir` (pairs-<name>-seed<seed>.jsonl)."""
    rows = read_rows(source)
    if not rows:
        raise ValueError(f"{source}: no rows")
    if {"prompt", "chosen", "rejected"} <= rows[0].keys():
        return source
    if not {"instruction", "output"} <= rows[0].keys():
        raise ValueError(
            f"{source}: neither preference rows (prompt, chosen, rejected) nor Alpaca rows (instruction, input, "
            f"output); its first row has {sorted(rows[0])}"
        )
    out = out_dir / f"pairs-{source.stem}-seed{seed}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p) + "\n" for p in alpaca_pairs(rows, seed)))
    return out
