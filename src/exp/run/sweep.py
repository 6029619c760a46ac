"""Sweep bookkeeping: whose a sweep directory is, which earlier job a re-launched job may reuse, and, after a Hydra
multirun, which jobs completed or failed, with the failure count as exit status.

A sweep directory holds one study. `claim_study` takes it before Hydra writes there: a directory that holds another
study's jobs (other settings, or other swept keys: `study.json`), jobs without a readable `study.json` (whose study
cannot be told), that another launch is writing now (its lock), or that is not a study's at all is refused, or, when its name is the time-stamped default, passed over for `<dir>_2`.
Within the study, a job that completed is reused by a re-launch only when the config it was asked
to run (recorded in its `sweep_job.json`) has the same fingerprint as the new job's; a job directory that holds
another config stops the launch with `SweepConflict` before anything is written (see docs/sweeps.md for why it
refuses instead of running the job again beside the old one).

`SweepStatus` is registered in conf/train.yaml under `hydra.callbacks` (Hydra's only hook for the start and end of
a multirun). It reads each job's `status.json`, so it works for every launcher (sequential, submitit, SLURM) as
long as the jobs share the file system with the parent.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from exp.core.config import ConfigError
from exp.run.compose import config_dict, to_typed
from exp.run.dirs import (
    JOB_RECORD,
    LOCK_FILE,
    RunLayout,
    lock_holder,
    lock_run,
    make_dir,
    read_status,
    release_run,
    write_json,
)
from exp.run.overrides import config_loader

log = logging.getLogger("exp.sweep")

# Left out of a job's fingerprint: what names or labels a run, never what it computes. The W&B run name and group
# are derived from the job's overrides and the sweep directory's name, so a renamed or moved sweep directory is still
# the same study; a continued run (trainer.resume) reaches the result the uninterrupted one would. Everything else,
# hardware included, stays in: the micro-batch size changes how the loss is averaged, the precision the numbers.
NOT_IN_FINGERPRINT = ("logger", "experiment_name", "trainer.resume", "trainer.resume_fallback")
# multirun.yaml as it was before this launch, by sweep directory: Hydra's basic sweeper rewrites it before the
# first job starts, and a launch refused at a job puts the study's own record back. Kept in memory (the refusal is
# decided in this process, also under the `gpus` launcher), so a launch refused earlier leaves no copy behind.
_previous_records: dict[Path, tuple[bytes, os.stat_result]] = {}
STUDY_RECORD = "study.json"  # the keys a study sweeps and the settings its jobs share
# A study directory's own files besides its jobs: its record and lock, Hydra's multirun.yaml, the launchers' and
# sweepers' records (submitit's job folder included).
STUDY_FILES = (STUDY_RECORD, LOCK_FILE, "multirun.yaml", "placements.jsonl", "optimization_results.yaml", ".submitit")
# sweep directory (resolved) -> the directories this process made to claim it (it first, then new parents).
_claimed: dict[Path, list[Path]] = {}


class SweepConflict(ConfigError):
    """A job directory of this sweep holds a job that was asked to run another config."""


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def fingerprinted(config: dict) -> dict[str, Any]:
    """The flat `key: value` pairs of a typed config (as `exp.train.config_dict` writes it) that decide results."""
    return {
        k: v for k, v in _flat(config).items() if not any(k == n or k.startswith(n + ".") for n in NOT_IN_FINGERPRINT)
    }


def fingerprint(config: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprinted(config), sort_keys=True, default=str).encode()).hexdigest()


def record_job(run_dir: Path, config: dict) -> None:
    write_json(run_dir / JOB_RECORD, {"fingerprint": fingerprint(config), "config": config})


def read_job_record(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / JOB_RECORD).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def attempts(job_dir: Path) -> list[Path]:
    """A job's run directories: `<job>`, then the re-launched attempts `<job>_1`, `<job>_2`, ... that exist."""
    found, n = [], 0
    while (d := job_dir if n == 0 else job_dir.with_name(f"{job_dir.name}_{n}")).is_dir():
        found.append(d)
        n += 1
    return found


def earlier_result(job_dir: Path, config: dict, sweep_dir: Path) -> Path | None:
    """The attempt of this job that completed with the same config, to be reused instead of run again; None when
    the job is to run (never ran, or failed). Raises SweepConflict when an attempt was asked to run another config,
    or completed without a record of it: its results would be paired with this config's parameters."""
    mine = fingerprint(config)
    done = None
    for run in attempts(job_dir):
        record, status = read_job_record(run), read_status(run).get("status")
        if record is None:
            if status == "completed":
                raise SweepConflict(conflict_message(sweep_dir, run, None, config))
            continue  # failed before its config was recorded (a bad value): nothing to compare, nothing to reuse
        if record["fingerprint"] != mine:
            raise SweepConflict(conflict_message(sweep_dir, run, record["config"], config))
        if status == "completed":
            done = run
    return done


def conflict_message(sweep_dir: Path, run: Path, recorded: dict | None, config: dict) -> str:
    if recorded is None:
        differs = "that completed without a record of its config (no sweep_job.json), so it cannot be shown to match"
    else:
        old, new = fingerprinted(recorded), fingerprinted(config)
        keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        shown = "; ".join(f"{k}: {_value(old.get(k))} there, {_value(new.get(k))} now" for k in keys[:6])
        more = f"; and {len(keys) - 6} more" if len(keys) > 6 else ""
        differs = f"that was asked to run another config than this launch's job {run.name} ({shown}{more})"
    free = free_sweep_dir(sweep_dir)
    return (
        f"hydra.sweep.dir={sweep_dir} already holds a job {run.name} {differs}. A sweep directory holds one study: "
        "reusing that job would pair its results with these settings, and replacing it would lose them, so this "
        f"launch stops here and changes nothing that was in {sweep_dir}. Fix: give this study its own directory, "
        f"hydra.sweep.dir={free}, or re-launch with the settings {sweep_dir} was made with to resume or extend its "
        "study."
    )


def free_sweep_dir(sweep_dir: Path) -> Path:
    """The first `<dir>_2`, `<dir>_3`, ... that does not exist: a directory to suggest for another study."""
    return next(p for n in range(2, 10_000) if not (p := sweep_dir.with_name(f"{sweep_dir.name}_{n}")).exists())


def _value(v: Any) -> str:
    return "(unset)" if v is None else json.dumps(v) if isinstance(v, list | dict) else str(v)


def keep_sweep_record(sweep_dir: Path) -> None:
    """Before the sweeper rewrites multirun.yaml: the one there, for `restore_sweep_record`."""
    path = sweep_dir / "multirun.yaml"
    if path.is_file():
        _previous_records[sweep_dir.resolve()] = (path.read_bytes(), path.stat())


def restore_sweep_record(sweep_dir: Path) -> None:
    """A launch refused: multirun.yaml back as the study left it."""
    if (previous := _previous_records.pop(sweep_dir.resolve(), None)) is not None:
        content, stat = previous
        tmp = sweep_dir / f".multirun.yaml.{os.getpid()}.tmp"
        tmp.write_bytes(content)
        os.utime(tmp, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        os.replace(tmp, sweep_dir / "multirun.yaml")


def final_metric(run_dir: Path) -> float:
    """A job's final validation loss (what sweepers minimise), +inf when it has none."""
    try:
        return json.loads(RunLayout(run_dir).summary.read_text())["final_val"]["val/loss"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return float("inf")


def ran_out_of_memory(run_dir: Path) -> bool:
    """The job failed for memory: CUDA ran out during the run, or its preflight found less free memory than its
    estimate (another process held what the launcher had planned for)."""
    error = read_status(run_dir).get("error", "")
    return bool(re.search(r"out of memory|OutOfMemory|\[memory\]", error, re.IGNORECASE))


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Every run directory of a sweep (a job's retries included), in name order."""
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and RunLayout(p).is_run())


def job_groups(sweep_dir: Path) -> dict[str, list[Path]]:
    """Run directories grouped by job: a re-launched job that failed before has its attempts in `<job>_1`, ..."""
    dirs = job_dirs(sweep_dir)
    names = {d.name for d in dirs}
    groups: dict[str, list[Path]] = {}
    for d in dirs:
        base = re.sub(r"_\d+$", "", d.name)
        groups.setdefault(base if base in names else d.name, []).append(d)
    return groups


class SweepStatus(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        keep_sweep_record(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        _previous_records.pop(sweep_dir.resolve(), None)  # the launch went through: its record stands
        if not sweep_dir.is_dir():
            return
        groups = job_groups(sweep_dir)
        failed = {}
        for job, attempts in groups.items():
            records = [read_status(d) for d in attempts]
            if not any(r.get("status") == "completed" for r in records):
                failed[job] = records[-1].get("error", "no error recorded")
        log.info(
            "sweep %s: %d job(s), %d completed, %d failed",
            sweep_dir,
            len(groups),
            len(groups) - len(failed),
            len(failed),
        )
        for job, error in failed.items():
            log.error("  failed: %s: %s", job, error.splitlines()[0] if error else "")
        log.info("table and plots: python -m exp.report %s", sweep_dir)
        if failed:
            raise SystemExit(min(len(failed), 100))  # the exit status says how many jobs failed


# --- whose the sweep directory is ----------------------------------------------------------------------------------


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
        or any((d / JOB_RECORD).exists() for d in path.iterdir() if d.is_dir())
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
        return "swept" if k in s["swept"] else _value(s["settings"].get(k))

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
