"""Checkpoint files: written atomically, kept (the newest K, `last`, the best), read safely and checked.

A checkpoint holds what continuing needs and nothing more: the LoRA weights (not the frozen base), the optimiser
and scheduler state, Lightning's loop counters, and `checkpoint["exp"]` (micro-batches consumed, RNG states, the
step-0 evaluation, the W&B run id). Everything in it is a plain type or a tensor, so it loads with
`torch.load(weights_only=True)`: opening a checkpoint never runs code from it.

Every checkpoint carries a hash of its content (`CONTENT_HASH`: every tensor's bytes, dtype and shape, and every
other value), checked whenever exp loads one: a flipped bit in a tensor, which loads without any error, is reported
as damage like a truncated file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from exp.core.config import ConfigError, TrainConfig
from exp.run.dirs import CHECKPOINT_DIR, LAST_CHECKPOINT

CONTENT_HASH = "exp_content_sha256"


def content_hash(checkpoint: dict[str, Any]) -> str:
    """sha256 of everything in a checkpoint but the hash itself, independent of how torch lays out the file."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in checkpoint.items() if k != CONTENT_HASH})
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, dict):
        h.update(b"{")
        for key in sorted(value, key=repr):  # optimizer states mix int and str keys
            _feed(h, key)
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, list | tuple):  # a round trip through torch.save may turn one into the other
        h.update(b"[")
        for item in value:
            _feed(h, item)
        h.update(b"]")
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        h.update(f"tensor {tensor.dtype} {tuple(tensor.shape)}:".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr((type(value).__name__, value)).encode())


def load_checkpoint_file(path: Path | str) -> dict[str, Any]:
    """A checkpoint written by exp, loaded with `weights_only=True` and its content hash checked. A truncated,
    corrupt, altered or foreign file raises ValueError saying which."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, EOFError, pickle errors ... for damaged files
        first = str(e).splitlines()[0].split(". ")[0] if str(e) else "unreadable"  # torch appends a paragraph
        raise ValueError(f"{type(e).__name__}: {first}") from e
    if not isinstance(ckpt, dict) or "exp" not in ckpt or "state_dict" not in ckpt:
        raise ValueError("not a checkpoint written by exp (no 'exp' resume state)")
    recorded = ckpt.pop(CONTENT_HASH, None)
    if recorded is None:
        raise ValueError(f"it carries no content hash ({CONTENT_HASH}), so its content cannot be trusted")
    if recorded != content_hash(ckpt):
        raise ValueError("its content does not match the hash written with it (the file changed after it was saved)")
    return ckpt


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the same directory, fsync, then rename over the target; show it once the
    step's metrics are on disk.

    A kill (or a full disk) during a save leaves the previous checkpoint of that name intact: a reader sees the old
    file or the new one, never half of one. Reads use `weights_only=True` and check the content hash.

    Lightning writes a step's checkpoints before it hands that step's metrics to the loggers: a run killed in
    between would have a checkpoint of step N and no CSV row for it, and its continuation starts after step N, so
    the row would be missing from both. The renames (and the removals of checkpoints they replace) therefore wait,
    in order, until `commit()`, which `exp.training.preemption.PreemptionCheckpoint` calls when the next step starts (the
    loggers have written the row by then), before a validation, and when training ends or fails.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[tuple[Path, Path | None]] = []  # (temporary file, target) or (checkpoint to remove, None)
        self.saves = 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.saves += 1  # per process and per save: never two writers on one file
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{self.saves}.partial")
        checkpoint = {**checkpoint, CONTENT_HASH: content_hash(checkpoint)}
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.pending.append((tmp, path))

    def remove_checkpoint(self, path) -> None:
        self.pending.append((Path(path), None))

    def commit(self) -> None:
        """Make the checkpoints saved so far visible (and remove those they replace), in the order of the saves."""
        while self.pending:
            source, target = self.pending.pop(0)
            if target is None:
                source.unlink(missing_ok=True)
            else:
                os.replace(source, target)

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = True) -> dict[str, Any]:
        try:
            return load_checkpoint_file(path)
        except ValueError as e:  # checked when the resume was planned: damaged since, or named in some other way
            raise ConfigError(f"checkpoint {path} is damaged ({e}); resume from another checkpoint") from None


def build_checkpoint_callbacks(cfg: TrainConfig, output_dir: Path) -> list[ModelCheckpoint]:
    """Periodic checkpoints (the newest `keep_last_checkpoints`, plus `last.ckpt`) and the best by val/loss."""
    t = cfg.trainer
    periodic = ModelCheckpoint(
        dirpath=output_dir / CHECKPOINT_DIR,
        filename="step-{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=t.checkpoint_every_n_steps,
        monitor="step",  # "top k by step" is "the newest k"
        mode="max",
        save_top_k=t.keep_last_checkpoints,
        save_last=True,
    )
    best = ModelCheckpoint(
        dirpath=output_dir / CHECKPOINT_DIR,
        filename="best-step-{step:06d}",
        auto_insert_metric_name=False,
        monitor="val/loss",
        mode="min",
        save_top_k=1,
        save_on_train_epoch_end=False,
    )
    return [periodic, best]


def checkpoint_step(path: Path) -> int:
    """The optimiser step a `step-NNNNNN.ckpt` / `best-step-NNNNNN.ckpt` file was written at (-1 if unnamed)."""
    stem = path.stem.removeprefix("best-")
    return int(stem.removeprefix("step-")) if stem.startswith("step-") and stem[5:].isdigit() else -1


def candidates(run_dir: Path) -> list[Path]:
    """A run's checkpoints, the one to resume from first: newest step first, `last.ckpt` before a periodic one of
    the same step.

    `last.ckpt` is usually the newest (a preemption writes only it), but Lightning writes it after the periodic
    checkpoint of the same step: a run killed in between has a `step-N.ckpt` newer than its `last.ckpt`.
    """
    ckpt_dir = run_dir / CHECKPOINT_DIR
    if not ckpt_dir.is_dir():
        return []
    periodic = sorted(ckpt_dir.glob("step-*.ckpt"), key=checkpoint_step, reverse=True)
    last = ckpt_dir / LAST_CHECKPOINT
    if not last.is_file():
        return periodic
    step = _saved_step(last)
    if step is None:  # unreadable: first, so that resuming names it as damaged
        return [last, *periodic]
    newer = [p for p in periodic if checkpoint_step(p) > step]
    return [*newer, last, *periodic[len(newer) :]]


def _saved_step(path: Path) -> int | None:
    """The `global_step` a checkpoint holds, read without loading its tensors (memory-mapped); None if unreadable."""
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except Exception:
        return None


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load and check a checkpoint written by exp; a truncated, corrupt, altered or foreign file raises ValueError."""
    return load_checkpoint_file(path)


def first_intact(paths: list[Path], fallback: bool) -> tuple[Path, dict[str, Any]]:
    """The first checkpoint of `paths` that loads; a damaged one is an error unless `fallback` allows the next."""
    problems = []
    for path in paths:
        try:
            return path, read_checkpoint(path)
        except ValueError as e:
            problems.append(f"{path}: {e}")
            if not fallback:
                others = [p.name for p in paths if p != path]
                raise ConfigError(
                    f"trainer.resume: checkpoint {path} is damaged ({e}). Resume from another one "
                    f"with trainer.resume=<file> ({', '.join(others) or 'none in this run'}), or set "
                    "trainer.resume_fallback=true to take the newest intact checkpoint of the run."
                ) from None
    raise ConfigError(
        "trainer.resume: no intact checkpoint to resume from:\n" + "\n".join(f"  - {p}" for p in problems)
    )


def newest_checkpoint(output_dir: Path, resume: dict | None) -> Path | None:
    """Where a run stopped outside its training loop goes on from: its newest checkpoint, or the one it continued."""
    found = last_good_checkpoint(output_dir, Path(resume["checkpoint"]) if resume else None)
    return Path(found) if found else None


def last_good_checkpoint(output_dir: Path, resumed_from: Path | None) -> str | None:
    """The newest checkpoint this run (or the run it continues) has on disk: where to go back to."""

    found = candidates(output_dir)
    return str(found[0]) if found else (str(resumed_from) if resumed_from else None)
