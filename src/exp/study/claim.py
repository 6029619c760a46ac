"""Whose a sweep directory is: a sweep directory holds one study, claimed before Hydra writes there.

`claim_study` takes the directory for the launch's study (`study.json`: the keys it sweeps and the settings its jobs
share) and holds its lock for as long as the launch runs. A directory that holds another study's jobs (other
settings, or other swept keys), jobs without a readable `study.json` (whose study cannot be told), that another
launch is writing now (its lock), or that is not a study's at all is refused, or, when its name is the time-stamped
default, passed over for `<dir>_2`. Within the study, the job-by-job check of a re-launch is
`exp.study.records.earlier_result`.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from exp.core.config import ConfigError
from exp.run.compose import config_dict, to_typed
from exp.run.dirs import JOB_RECORD, LOCK_FILE, job_dirs_under, lock_holder, lock_run, make_dir, release_run, write_json
from exp.run.overrides import config_loader
from exp.study.journal import PLACEMENTS
from exp.study.records import fingerprinted, free_sweep_dir, job_dirs, job_groups, shown_value

STUDY_RECORD = "study.json"  # the keys a study sweeps and the settings its jobs share
# A study directory's own files besides its jobs: its record and lock, Hydra's multirun.yaml, the launchers' and
# sweepers' records (submitit's job folder included).
STUDY_FILES = (STUDY_RECORD, LOCK_FILE, "multirun.yaml", PLACEMENTS, "optimization_results.yaml", ".submitit")
# sweep directory (resolved) -> the directories this process made to claim it (it first, then new parents).
_claimed: dict[Path, list[Path]] = {}


def study_of(cfg: DictConfig, overrides: list[str], launch_dir: Path) -> dict[str, Any]:
    """The study a multirun launch makes: the keys it sweeps, and the settings its jobs share, as a job's fingerprint
    sees them (`fingerprinted`). `cfg`: the config as Hydra composes it before the sweep (sweep values not applied),
    with its `hydra` node; `overrides`: the command line's. More grid values or more Optuna trials make the same
    study; another fixed value or another swept key, another one."""
    parser = OverridesParser.create()
    given = parser.parse_overrides(overrides)
    fixed = {o.key_or_group for o in given if not o.is_sweep_override()}
    swept = {o.key_or_group for o in given if o.is_sweep_override() and not o.is_hydra_override()}
    one_value = {}
    # A sweeper's own search space (the basic sweeper's and Optuna's `params`); a command-line value replaces an entry.
    for key, value in (OmegaConf.select(cfg, "hydra.sweeper.params", default=None) or {}).items():
        if key in fixed:
            continue
        try:
            override = parser.parse_override(f"{key}={value}")
        except Exception:  # noqa: BLE001 (a sweeper's own syntax: a swept key all the same)
            swept.add(key)
            continue
        if override.is_sweep_override():
            swept.add(key)
        else:
            one_value[key] = override.value()  # every job gets it, as if it were on the command line
    task = copy.deepcopy(cfg)
    with open_dict(task):
        del task["hydra"]
    try:
        config = config_dict(to_typed(task, launch_dir))  # as each job records it: paths resolved
    except Exception:  # noqa: BLE001 (a check only the swept values pass: the settings as written)
        try:
            config = OmegaConf.to_container(task, resolve=True, enum_to_str=True)
        except Exception:  # noqa: BLE001 (an interpolation only a job resolves)
            config = OmegaConf.to_container(task, resolve=False, enum_to_str=True)
    settings = {
        k: v for k, v in fingerprinted(config).items() if not any(k == s or k.startswith(s + ".") for s in swept)
    }
    study = {"swept": sorted(swept), "settings": {**settings, **one_value}}
    return json.loads(json.dumps(study, sort_keys=True, default=str))  # as study.json reads back


def read_study(sweep_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((sweep_dir / STUDY_RECORD).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_study_dir(path: Path) -> bool:
    """Written by a multirun: its record, Hydra's multirun.yaml, or a job directory with a job's record."""
    return (
        (path / STUDY_RECORD).exists()
        or (path / "multirun.yaml").exists()
        or bool(job_dirs_under(path, lambda d: (d / JOB_RECORD).exists()))
    )


def claim_study(argv: list[str], caller: str, config_path: str, config_name: str) -> list[str]:
    """For a multirun (`python -m exp.train -m <argv>`, checked by exp.run.overrides.check_command_line): claim its
    sweep directory before Hydra writes there, and return `argv` with it pinned (`hydra.sweep.dir`, a `${now:...}`
    resolved once). Raises ConfigError when the directory is not this study's to write (`take_sweep_dir`).
    `release_studies` ends the claim. `argv` that runs no sweep is returned as it is."""
    from hydra._internal.utils import get_args_parser  # Hydra's own parser, as check_command_line reads argv

    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion:
        return argv
    loader = config_loader(args, caller, config_path)
    cfg = loader.load_configuration(
        config_name=args.config_name or config_name,
        overrides=args.overrides,
        run_mode=RunMode.MULTIRUN,
        from_shell=True,
    )
    if not args.multirun and cfg.hydra.mode != RunMode.MULTIRUN:
        return argv
    try:
        sweep_dir = Path(str(OmegaConf.select(cfg, "hydra.sweep.dir")))
    except Exception:  # noqa: BLE001 (e.g. ${hydra:...}, resolvable only once Hydra runs: nothing to claim here)
        return argv
    written = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["dir"]
    claimed = take_sweep_dir(sweep_dir, study_of(cfg, args.overrides, Path.cwd()), "${now:" in str(written))
    quoted = str(claimed).replace("\\", "\\\\").replace('"', '\\"')
    return [*(a for a in argv if a.lstrip("+").split("=", 1)[0] != "hydra.sweep.dir"), f'hydra.sweep.dir="{quoted}"']


def take_sweep_dir(path: Path, study: dict[str, Any], time_stamped: bool = False) -> Path:
    """`path`, created if need be and locked by this process for the study: refused (ConfigError, nothing written
    there) when it holds another study's jobs, when another launch holds its lock, or when it holds files of something
    else than a study. A `time_stamped` name (the default `multirun/<date>/<time>`, which no one resumes) gives way to
    `<path>_2`, `<path>_3`, ... instead."""
    candidate = path
    while (problem := _take(candidate, study)) is not None:
        if not time_stamped:
            raise ConfigError(problem)
        candidate = free_sweep_dir(path)
    if candidate != path:
        print(f"exp: {path} is not this study's to write; this study goes to {candidate}", file=sys.stderr)
    return candidate


def _take(path: Path, study: dict[str, Any]) -> str | None:
    """Claim `path` for `study`; the reason it is not this study's (None: claimed)."""
    key = path.resolve()
    if key in _claimed:
        return None
    if path.is_dir():
        entries = sorted(e.name + "/" * e.is_dir() for e in path.iterdir())
        foreign = [e for e in entries if e.rstrip("/") not in STUDY_FILES]
        if foreign and not is_study_dir(path):
            return foreign_study_message(path, foreign)
        if (problem := _other_study(path, study)) is not None:
            return problem  # before the lock: a refused launch adds nothing to the directory
    made = make_dir(path, "hydra.sweep.dir")
    if not lock_run(path):
        holder = lock_holder(path)
        return (
            f"hydra.sweep.dir={path} is being written by another launch right now ("
            + (f"process {holder}" if holder else "another process")
            + f" holds {path / LOCK_FILE}). Two launches in one sweep directory would run the same jobs twice and mix "
            f"their records, so this launch stops here and changes nothing in {path}. Fix: wait for that launch to "
            "end (the same study launched again then reuses the jobs it completed), or give this study its own "
            f"directory, hydra.sweep.dir={free_sweep_dir(path)}."
        )
    if (problem := _other_study(path, study)) is not None:  # again under the lock: a launch may have ended since
        release_run(path)
        return problem
    if read_study(path) != study:
        write_json(path / STUDY_RECORD, study)
    _claimed[key] = made
    return None


def _other_study(path: Path, study: dict[str, Any]) -> str | None:
    """Why `path` may hold another study's jobs; None when it holds this study's, or no job (nothing to mix with)."""
    recorded = read_study(path)
    if recorded == study or not job_dirs(path):
        return None
    if recorded is None:
        return unknown_study_message(path)
    keys = sorted(set(recorded["swept"]) | set(study["swept"]) | recorded["settings"].keys() | study["settings"].keys())

    def shown(s: dict[str, Any], k: str) -> str:
        return "swept" if k in s["swept"] else shown_value(s["settings"].get(k))

    differs = [
        f"{k}: {shown(recorded, k)} there, {shown(study, k)} now" for k in keys if shown(recorded, k) != shown(study, k)
    ]
    more = f"; and {len(differs) - 6} more" if len(differs) > 6 else ""
    jobs = len(job_groups(path))
    return (
        f"hydra.sweep.dir={path} already holds another study, {jobs} job(s) of other settings than this launch's "
        f"({'; '.join(differs[:6])}{more}). A sweep directory holds one study: this launch's jobs would be mixed with "
        "that study's (its job numbers, multirun.yaml and report would describe two sets of settings), so this "
        f"launch stops here and changes nothing in {path}. Fix: give this study its own directory, "
        f"hydra.sweep.dir={free_sweep_dir(path)}, or launch with the settings of {path / STUDY_RECORD} to resume or "
        "extend that study."
    )


def unknown_study_message(path: Path) -> str:
    """Jobs without the record of their study (its study.json removed, damaged, or never written by exp.train's
    claim): whose they are cannot be told, and adopting them would be the mixing the record exists to prevent."""
    jobs = len(job_groups(path))
    state = "cannot be read" if (path / STUDY_RECORD).exists() else "is missing"
    return (
        f"hydra.sweep.dir={path} holds {jobs} job(s), but {path / STUDY_RECORD}, the record of their study (the keys "
        f"it sweeps and the settings its jobs share), {state}, so whether they are this launch's study cannot be "
        "told. A sweep directory holds one study: this launch's jobs could be mixed with another study's (its job "
        f"numbers, multirun.yaml and report would describe two sets of settings), so this launch stops here and "
        f"changes nothing in {path}. Fix: give this study its own directory, hydra.sweep.dir={free_sweep_dir(path)} "
        f"(the jobs in {path} stay as they are; python -m exp.report {path} still reads them)."
    )


def foreign_study_message(path: Path, entries: list[str]) -> str:
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    return (
        f"hydra.sweep.dir={path}: the directory exists and holds files that are not an exp study's ({shown}). A sweep "
        "writes multirun.yaml, study.json and a directory per job there, which would overwrite files of those names, "
        f"so nothing was written. Fix: pass a new or empty directory, e.g. hydra.sweep.dir={free_sweep_dir(path)}."
    )


def release_studies() -> None:
    """The end of a launch: each sweep directory it claimed unlocked, and one it made that holds no job (the launch
    was refused, or stopped before its first job) removed again, with the directories it made above it."""
    for key, made in list(_claimed.items()):
        del _claimed[key]
        if made and key.is_dir() and all(e.name in STUDY_FILES for e in key.iterdir()):
            shutil.rmtree(key, ignore_errors=True)
            for parent in made[1:]:
                try:
                    parent.rmdir()
                except OSError:
                    break
        release_run(key)
