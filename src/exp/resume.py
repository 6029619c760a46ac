"""Which checkpoint a run continues from (`trainer.resume`).

`auto` looks for the newest unfinished run with the same config (same model, data, LoRA, hardware and algorithm;
tracking and resume settings may differ) among the run directories near this one: the siblings of this run's
directory and of its parent (`outputs/<date>/<time>`, a sweep's `<job>` and `<job>_1`), and `outputs/` under the
launch directory. A run directory or a `.ckpt` file names the checkpoint directly.

The continuing run gets a directory of its own (nothing the interrupted run wrote is touched) and records where it
came from; its next `trainer.resume=auto` finds it, since it is then the newest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from exp.checkpoints import candidates, first_intact
from exp.config import ConfigError, TrainConfig
from exp.run_dir import read_status

log = logging.getLogger("exp.resume")

# Keys that may differ between a run and its continuation: they change bookkeeping, not the training math.
MAY_DIFFER = (
    "trainer.resume",
    "trainer.resume_fallback",
    "trainer.max_steps",  # a longer schedule, when the run is named explicitly (auto insists on the same one)
    "trainer.keep_last_checkpoints",
    "trainer.checkpoint_every_n_steps",
    "trainer.log_every_n_steps",
    "trainer.sample_prompts",
    "trainer.sample_count",
    "trainer.sample_max_new_tokens",
    "hardware.num_workers",
    # Which layers recompute changes memory and speed, not the result (the gradients are bitwise the same, tested),
    # and the preflight's choice follows the free memory of the GPU the continuation lands on.
    "hardware.gradient_checkpointing",
    "hardware.checkpoint_layers",
    "hardware.auto_checkpoint_layers",
    "logger",
)


@dataclass
class ResumePoint:
    run_dir: Path  # the run that wrote the checkpoint
    checkpoint: Path
    state: dict[str, Any]  # the loaded checkpoint (checked: it loads, and it is exp's)

    @property
    def step(self) -> int:
        return int(self.state.get("global_step", 0))


def _flat(cfg: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, f"{key}."))
        else:
            out[key] = v
    return out


def config_differences(recorded: dict, current: dict) -> list[str]:
    """`key: recorded -> current` for every training-relevant key whose values differ."""
    a, b = _flat(recorded), _flat(current)
    keys = sorted(set(a) | set(b))
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in keys
        if a.get(k) != b.get(k) and not any(k == m or k.startswith(m + ".") for m in MAY_DIFFER)
    ]


def _recorded_config(run_dir: Path) -> dict | None:
    try:
        return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    except Exception:  # not a run dir, or a config from an incompatible version: not a candidate
        return None


def _nearby_runs(output_dir: Path, launch_dir: Path) -> list[Path]:
    roots = {output_dir.parent, output_dir.parent.parent, launch_dir / "outputs"}
    runs = set()
    for root in roots:
        if root.is_dir():
            for pattern in ("*/config.yaml", "*/*/config.yaml"):
                runs.update(p.parent.resolve() for p in root.glob(pattern))  # resolved: a symlink is one run
    runs.discard(output_dir.resolve())
    return list(runs)


def _newest_checkpoint_time(run_dir: Path) -> float:
    return max((p.stat().st_mtime for p in candidates(run_dir)), default=0.0)


def find_auto(cfg_dict: dict, output_dir: Path, launch_dir: Path) -> Path | None:
    """The newest unfinished run with this config that has a checkpoint, or None."""
    matches = []
    for run in _nearby_runs(output_dir, launch_dir):
        recorded = _recorded_config(run)
        if recorded is None or read_status(run).get("status") == "completed" or not candidates(run):
            continue
        same_length = recorded.get("trainer", {}).get("max_steps") == cfg_dict["trainer"]["max_steps"]
        if same_length and not config_differences(recorded, cfg_dict):
            matches.append(run)
    return max(matches, key=_newest_checkpoint_time, default=None)


def resolve(cfg: TrainConfig, cfg_dict: dict, output_dir: Path, launch_dir: Path) -> ResumePoint | None:
    """The checkpoint `trainer.resume` asks for (checked), None for a fresh run; ConfigError if it can't be used."""
    t = cfg.trainer
    if not t.resume:
        return None
    if t.resume == "auto":
        run = find_auto(cfg_dict, output_dir, launch_dir)
        if run is None:
            log.info("trainer.resume=auto: no unfinished run with this config and a checkpoint; starting fresh")
            return None
        paths = candidates(run)
    else:
        target = Path(t.resume).expanduser()
        if not target.is_absolute():
            target = launch_dir / target
        if target.is_file():
            run = target.parent.parent if target.parent.name == "checkpoints" else target.parent
            paths = [target] + [p for p in candidates(run) if p != target]
        elif target.is_dir():
            run, paths = target, candidates(target)
            if not paths:
                raise ConfigError(
                    f"trainer.resume={t.resume}: {target} has no checkpoints/ (last.ckpt or step-*.ckpt) to resume "
                    "from; name a run directory of exp or a .ckpt file, or trainer.resume=auto"
                )
        else:
            raise ConfigError(
                f"trainer.resume={t.resume}: no such file or directory ({target}); name a run directory, a .ckpt "
                "file, or use trainer.resume=auto"
            )
        recorded = _recorded_config(run)
        if recorded is not None:
            diffs = config_differences(recorded, cfg_dict)
            if diffs:
                raise ConfigError(
                    f"trainer.resume={t.resume}: that run was trained with a different configuration, so its "
                    "checkpoint does not continue this one:\n"
                    + "\n".join(f"    {d}" for d in diffs)
                    + "\n  Repeat the run's settings (its config.yaml) with trainer.resume, or start a fresh run."
                )
    checkpoint, state = first_intact(paths, fallback=t.resume_fallback)
    if checkpoint != paths[0]:
        log.warning("trainer.resume: %s is damaged; falling back to %s", paths[0], checkpoint)
    point = ResumePoint(run, checkpoint, state)
    log.info("resuming from %s (step %d)", checkpoint, point.step)
    return point
