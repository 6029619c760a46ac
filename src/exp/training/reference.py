"""DPO's reference log-probabilities computed once, before training (`objective.precompute_reference=true`).

One pass without gradients over the training and held-out pairs, in split order and in micro-batches of
`hardware.micro_batch_size`, scores each pair's chosen and rejected completion under the reference
(exp.training.objectives.reference_model). The values go with the pairs into every batch (`ref_logps`), so a
training step runs no reference pass. They are cached under <exp cache>/reference/<fingerprint>/ (an entry of
exp.core.cache), keyed by what they depend on: the base and how it is loaded and computed, the reference (the
starting adapter's files, for `objective.reference=start`), the pairs' token ids and the micro-batch. A second run
with the same key (another beta or learning rate, a resumed run) reads them and scores nothing; a resumed run
thereby trains on the very values the interrupted one did.

Data-parallel ranks each score every world-th micro-batch and gather the rest, so every rank holds all values.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from safetensors.torch import load_file, save_file
from torch import nn

from exp.core.cache import cache_dir, ensure_entry, entry_problem, file_sha256
from exp.core.config import LossImpl, Reference, TrainConfig
from exp.data.preference import PreferenceDataModule, PreferenceExample, preference_collate
from exp.run.compose import config_dict
from exp.training.objectives import reference_logps

log = logging.getLogger(__name__)

# Bump when what is stored changes, so older entries are not read.
REFERENCE_VERSION = 1
VALUES_FILE = "reference_logps.safetensors"

Pairs = list[tuple[float, float]]


def _model_files(path: str | None) -> list[list[Any]]:
    """A local base's files by name, size and modification time: a changed checkpoint changes the key (hashing
    gigabytes of weights would cost more than scoring the pairs)."""
    if not path:
        return []
    root = Path(path)
    return [
        [str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(root.rglob("*"))
        if p.is_file()
    ]


def _examples_digest(examples: list[PreferenceExample]) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.prompt, e.chosen, e.rejected]).encode())
    return h.hexdigest()


def reference_fingerprint(
    cfg: TrainConfig, train: list[PreferenceExample], val: list[PreferenceExample], impl: LossImpl, device: str
) -> str:
    """What the reference log-probabilities depend on, hashed."""
    d = config_dict(cfg)
    model = {k: v for k, v in d["model"].items() if k != "adapter"}
    start = cfg.reference == Reference.start
    adapter = Path(cfg.model.adapter) if start else None
    key = {
        "model": model,
        "model_files": _model_files(cfg.model.path),
        "quantization": d["quantization"],
        "compute": [
            cfg.hardware.precision,
            cfg.hardware.dequantized_layers,
            cfg.hardware.fuse_lora,
            impl.value,
            device,
        ],
        "reference": cfg.reference.value,
        "adapter": [file_sha256(p) for p in sorted(adapter.iterdir()) if p.name.startswith("adapter_")]
        if adapter
        else None,
        "micro_batch_size": cfg.hardware.micro_batch_size,
        "padding_free": cfg.hardware.padding_free,
        "train": _examples_digest(train),
        "val": _examples_digest(val),
        "v": REFERENCE_VERSION,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


def score_pairs(
    model: nn.Module,
    examples: list[PreferenceExample],
    batch_size: int,
    pad_id: int,
    impl: LossImpl,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
    flat: bool = False,
) -> dict[int, tuple[float, float]]:
    """The reference's (chosen, rejected) log-probabilities of the pairs in this rank's micro-batches (every
    world-th, in split order), by example index, in training's layout (`flat`: padding-free rows), so that its
    rounding is the training step's."""
    out: dict[int, tuple[float, float]] = {}
    collate = preference_collate(pad_id, flat)
    for start in range(rank * batch_size, len(examples), world * batch_size):
        items = examples[start : start + batch_size]
        batch = move_data_to_device(collate(items), device)
        batch.pop("ref_logps", None)
        logps = reference_logps(model, batch, impl).float().tolist()
        n = len(items)
        out.update({start + i: (logps[i], logps[n + i]) for i in range(n)})
    return out


def _all_ranks(scored: dict[int, tuple[float, float]], count: int, gather: Callable[[Any], list[Any]]) -> Pairs:
    merged: dict[int, tuple[float, float]] = {}
    for part in gather(scored):
        merged.update(part)
    return [merged[i] for i in range(count)]


def precompute_reference(
    model: nn.Module,
    datamodule: PreferenceDataModule,
    cfg: TrainConfig,
    impl: LossImpl,
    device: torch.device,
    gather: Callable[[Any], list[Any]] = lambda x: [x],
    rank: int = 0,
    world: int = 1,
) -> dict[str, Any]:
    """Give the data module's pairs their reference log-probabilities, read from the cache or scored (and cached);
    what it cost, for summary.json. `gather`: every rank's object, in rank order (collective)."""
    train, val = datamodule.train_set, datamodule.val_set
    entry = cache_dir() / "reference" / reference_fingerprint(cfg, train, val, impl, device.type)
    started = time.perf_counter()
    cached = all(gather(entry_problem(entry) is None))  # every rank decides alike: scoring is collective
    if cached:
        values = load_file(str(entry / VALUES_FILE))  # checked against its manifest just now
        train_values, val_values = values["train"].tolist(), values["val"].tolist()
    else:
        size, pad = datamodule.micro_batch_size, datamodule.tokenizer.pad_token_id
        with torch.no_grad():
            train_values, val_values = (
                _all_ranks(
                    score_pairs(model, split, size, pad, impl, device, rank, world, datamodule.padding_free),
                    len(split),
                    gather,
                )
                for split in (train, val)
            )
        if rank == 0:

            def write(tmp: Path) -> None:
                tensors = {
                    "train": torch.tensor(train_values).reshape(-1, 2),
                    "val": torch.tensor(val_values).reshape(-1, 2),
                }
                save_file(tensors, str(tmp / VALUES_FILE))

            ensure_entry(entry, write, "reference log-probabilities")
    datamodule.set_reference([tuple(v) for v in train_values], [tuple(v) for v in val_values])
    seconds = time.perf_counter() - started
    log.info(
        "reference log-probabilities (%s): %d training and %d held-out pairs %s in %.1f s (%s)",
        cfg.reference.value,
        len(train),
        len(val),
        "read from the cache" if cached else "scored",
        seconds,
        entry,
    )
    return {"reference": cfg.reference.value, "cache": str(entry), "reused": cached, "seconds": round(seconds, 2)}
