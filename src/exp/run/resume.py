"""Which checkpoint a run continues from (`trainer.resume`).

`auto` looks for the newest unfinished run with the same config (same model, data, LoRA, hardware and algorithm;
tracking and resume settings may differ), in two places only: the run directories next to this run's (the
siblings of `outputs/<date>/<time>`, of a sweep's `<job>` and `<job>_1`, of a flat `hydra.run.dir`), and, when this
run's directory is Hydra's default `<root>/<date>/<time>`, the `<date>/<time>` runs of every other date under
`<root>`. A run directory or a `.ckpt` file names the checkpoint directly.

A run and its continuations (each continuation's `resume.json` names the run it continued) are one piece of work:
`auto` skips it when any of them completed, and when any of them is in use by another process (running, or being
continued: `exp.run.dirs` locks). The continuing process holds the lock of the run whose checkpoint it took, so two
continuations of one run cannot both start.

The continuing run gets a directory of its own (nothing the interrupted run wrote is touched) and records where it
came from; its next `trainer.resume=auto` finds it, since it is then the newest.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from exp.core.config import ConfigError, TrainConfig
from exp.run.checkpoints import candidates, first_intact
from exp.run.dirs import CHECKPOINT_DIR, RESUME_RECORD, RunLayout, in_use, lock_run, read_status

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
    "trainer.sample_at_start",
    "hardware.num_workers",
    # Which layers recompute changes memory and speed, not the result (the gradients are bitwise the same, tested),
    # and the preflight's choice follows the free memory of the GPU the continuation lands on.
    "hardware.gradient_checkpointing",
    "hardware.checkpoint_layers",
    "hardware.auto_checkpoint_layers",
    # The same products over the same weights, only kept or fetched differently (tested equal on the CPU).
    "hardware.dequantized_layers",
    "hardware.auto_dequantized_layers",
    "hardware.offload_checkpoints",
    # The same sum in another rounding order; which layers it acts in already follows the kept layers above.
    "hardware.fuse_lora",
    "logger",
    "verbose",
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
        return OmegaConf.to_container(OmegaConf.load(RunLayout(run_dir).config))
    except Exception:  # not a run dir, or a config from an incompatible version: not a candidate
        return None


def _named_run_config(run_dir: Path, resume: str) -> dict:
    """The config a named run recorded. Without it nothing says its checkpoint fits this config (a checkpoint of
    another `lora.r` fails deep in the weight loading), so a missing or damaged config.yaml is refused."""
    path = RunLayout(run_dir).config
    try:
        recorded = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:  # missing, not YAML, not text
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(
            f"trainer.resume={resume}: {path} cannot be read ({type(e).__name__}: {first}), so nothing says that "
            f"the run's checkpoints fit this configuration. Fix: restore it (Hydra's copy of the composed config is "
            f"{run_dir / '.hydra' / 'config.yaml'}), or start a fresh run."
        ) from None
    if not isinstance(recorded, dict) or not {"model", "lora", "trainer"} <= recorded.keys():
        raise ConfigError(
            f"trainer.resume={resume}: {path} holds no config of exp.train (no model, lora and trainer). Fix: restore it "
            f"(Hydra's copy of the composed config is {run_dir / '.hydra' / 'config.yaml'}), or start a fresh run."
        )
    return recorded


# Hydra's default run directory, `outputs/<date>/<time>` (`_N` for a second launch in the same second).
DATE_DIR = re.compile(r"\d{4}-\d{2}-\d{2}")
TIME_DIR = re.compile(r"\d{2}-\d{2}-\d{2}(_\d+)?")


def search_places(output_dir: Path) -> list[Path]:
    """The run directories `auto` considers: this run's siblings, and with Hydra's dated layout the runs of every
    date under the same root. Never anything above that."""
    parent = output_dir.parent
    if DATE_DIR.fullmatch(parent.name) and TIME_DIR.fullmatch(output_dir.name):
        dates = [d for d in parent.parent.iterdir() if d.is_dir() and DATE_DIR.fullmatch(d.name)]
        runs = [r for d in dates for r in d.iterdir() if TIME_DIR.fullmatch(r.name)]
    else:
        runs = list(parent.iterdir()) if parent.is_dir() else []
    here = output_dir.resolve()
    return sorted({r.resolve() for r in runs if r.is_dir() and RunLayout(r).config.is_file()} - {here})


def _continued(run_dir: Path) -> Path | None:
    """The run `run_dir` continued, from its resume.json."""
    try:
        return Path(json.loads((run_dir / RESUME_RECORD).read_text())["run"]).resolve()
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pieces_of_work(runs: list[Path]) -> list[list[Path]]:
    """`runs` grouped: a run with its continuations (and theirs), as linked by resume.json."""
    group = {r: r for r in runs}

    def root(r: Path) -> Path:
        while group[r] != r:
            r = group[r]
        return r

    for r in runs:
        if (before := _continued(r)) in group:
            group[root(r)] = root(before)
    pieces: dict[Path, list[Path]] = {}
    for r in runs:
        pieces.setdefault(root(r), []).append(r)
    return list(pieces.values())


def _newest_checkpoint_time(run_dir: Path) -> float:
    return max((p.stat().st_mtime for p in candidates(run_dir)), default=0.0)


def find_auto(cfg_dict: dict, output_dir: Path) -> Path | None:
    """The run to continue (locked by this process), or None: in the newest piece of work with this config that
    has a checkpoint, no completed run, and no run in use by another process, the run with the newest checkpoint."""
    matching = []
    for run in search_places(output_dir):
        recorded = _recorded_config(run)
        if recorded is None:
            continue
        same_length = recorded.get("trainer", {}).get("max_steps") == cfg_dict["trainer"]["max_steps"]
        if same_length and not config_differences(recorded, cfg_dict):
            matching.append(run)
    options = []
    for piece in _pieces_of_work(matching):
        done = [r for r in piece if read_status(r).get("status") == "completed"]
        busy = [r for r in piece if in_use(r)]
        with_checkpoints = [r for r in piece if candidates(r)]
        if done:
            log.info("trainer.resume=auto: %s completed; not continued again", done[0])
        elif busy:
            log.info("trainer.resume=auto: %s is in use by another process (running, or being continued)", busy[0])
        elif with_checkpoints:
            options.append(max(with_checkpoints, key=_newest_checkpoint_time))
    for run in sorted(options, key=_newest_checkpoint_time, reverse=True):
        if lock_run(run, create=False):  # another process may have taken it since it was looked at
            return run
    return None


def resolve(cfg: TrainConfig, cfg_dict: dict, output_dir: Path, launch_dir: Path) -> ResumePoint | None:
    """The checkpoint `trainer.resume` asks for (checked), None for a fresh run; ConfigError if it can't be used."""
    t = cfg.trainer
    if not t.resume:
        return None
    if t.resume == "auto":
        run = find_auto(cfg_dict, output_dir)
        if run is None:
            log.info("trainer.resume=auto: no unfinished run with this config and a checkpoint; starting fresh")
            return None
        paths = candidates(run)
    else:
        target = Path(t.resume).expanduser()
        if not target.is_absolute():
            target = launch_dir / target
        if target.is_file():
            run = target.parent.parent if target.parent.name == CHECKPOINT_DIR else target.parent
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
        if not lock_run(run, create=False):
            raise ConfigError(
                f"trainer.resume={t.resume}: {run} is in use by another process (it is running, or another run is "
                "continuing it); two processes cannot continue one run. Wait for it to end (its status.json says how "
                "it ended), then continue the newest run with trainer.resume=auto."
            )
        recorded = _named_run_config(run, t.resume)
        if diffs := config_differences(recorded, cfg_dict):
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
