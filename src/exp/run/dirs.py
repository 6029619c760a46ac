"""Run directories: claimed fresh (an earlier run's files are never overwritten, nor a directory's that is not an
exp run's), locked while in use, marked with their status.

A process holds an exclusive lock (`flock`) on the `.lock` file of its run directory for as long as it runs, and on
the run it continues: `trainer.resume` never picks a run that is running now or being continued by another
process, and a directory is claimed by taking its lock, so launches started in the same second never share one.
The operating system drops a process's locks when it ends, however it ends.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exp.core.config import ConfigError
from exp.core.constants import LAUNCH_ID_ENV
from exp.core.secrets import mask_secrets

# The layout of a run directory: every file and folder a run writes, by name (README "What every run leaves").
CONFIG_FILE = "config.yaml"  # the resolved, typed config the run trains with
STATUS_FILE = "status.json"  # running, completed, failed or preempted
SUMMARY_FILE = "summary.json"  # a completed run's results
MANIFEST_FILE = "manifest.json"  # how the run was made
RESUME_RECORD = "resume.json"  # in a continued run: the checkpoint and the run it continued
JOB_RECORD = "sweep_job.json"  # in each sweep job: the config the job was asked to run, and its fingerprint
LOCK_FILE = ".lock"
LOG_FILE = "train.log"
SAMPLES_FILE = "samples.txt"
HYDRA_DIR = ".hydra"  # Hydra's record of the composition
ADAPTER_DIR = "adapter"  # the final adapter in PEFT's format, and the tokenizer
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
METRICS_CSV = "csv/metrics.csv"
WANDB_DIR = "wandb"  # W&B's offline runs
# What a run's directory holds before its status.json: the lock its claim takes first, and Hydra's log and record of
# a sweep job (Hydra's launcher makes a job's directory and opens its log before the job claims it).
BEFORE_STATUS = (LOCK_FILE, LOG_FILE, HYDRA_DIR)
# Every name a run writes at its top level: what one rank may find that another rank of its launch wrote.
RUN_ENTRIES = (
    *BEFORE_STATUS,
    CONFIG_FILE,
    STATUS_FILE,
    SUMMARY_FILE,
    MANIFEST_FILE,
    RESUME_RECORD,
    JOB_RECORD,
    SAMPLES_FILE,
    ADAPTER_DIR,
    CHECKPOINT_DIR,
    METRICS_CSV.split("/")[0],
    WANDB_DIR,
)


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory's files: the one place that knows where a run keeps what."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def status(self) -> Path:
        return self.root / STATUS_FILE

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_FILE

    @property
    def resume_record(self) -> Path:
        return self.root / RESUME_RECORD

    @property
    def job_record(self) -> Path:
        return self.root / JOB_RECORD

    @property
    def log(self) -> Path:
        return self.root / LOG_FILE

    @property
    def samples(self) -> Path:
        return self.root / SAMPLES_FILE

    @property
    def hydra(self) -> Path:
        return self.root / HYDRA_DIR

    @property
    def adapter(self) -> Path:
        return self.root / ADAPTER_DIR

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINT_DIR

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_CSV

    def is_run(self) -> bool:
        """Holds a run's record (its status, or Hydra's record of a job that never got further)."""
        return self.status.exists() or self.hydra.exists()


# A sweep job's directory starts with its job number (`sweep_job_dir_name`).
_JOB_DIR = re.compile(r"\d+(_|$)")


def runs_under(root: Path) -> list[Path]:
    """The run directories among `root`'s subdirectories, in path order (`job_dirs_under`)."""
    return job_dirs_under(root, lambda p: RunLayout(p).is_run())


def job_dirs_under(root: Path, holds: Callable[[Path], bool]) -> list[Path]:
    """The subdirectories of `root` for which `holds` is true, in path order. A sweep job whose overrides hold a path
    (`data.path=data/a.json`) nests as Hydra names it, `0_data.path=data/a.json/...`: below a directory named like a
    job (`<number>_...`) the search goes on down to the one that holds; what is below a directory that holds is
    never searched, nor other directories (a foreign tree stays unread)."""
    found: list[Path] = []
    pending = [(p, False) for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    while pending:
        path, inside_job = pending.pop()
        if holds(path):
            found.append(path)
        elif inside_job or _JOB_DIR.match(path.name):
            pending += [(p, True) for p in path.iterdir() if p.is_dir()]
    return sorted(found)


def foreign_entries(path: Path, own: tuple[str, ...] = BEFORE_STATUS) -> list[str]:
    """What the directory `path` holds that is not an exp run's, by name (`dir/` for a directory): [] when it does not
    exist, is empty, holds a run (its status.json), or holds only names in `own` and the temporary files of exp's
    atomic writes (`.<name>.<pid>.tmp`)."""
    if not path.is_dir() or (path / STATUS_FILE).exists():
        return []
    entries = {e.name: e.is_dir() for e in path.iterdir()}
    if STATUS_FILE in entries:  # another process claimed it after the check above: a run's directory
        return []
    return sorted(
        name + "/" * is_dir
        for name, is_dir in entries.items()
        if name not in own and not (name.startswith(".") and name.endswith(".tmp"))
    )


def foreign_dir_message(key: str, path: Path, entries: list[str]) -> str:
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    inside = next(p for n in range(1, 10_000) if not (p := path / ("run" if n == 1 else f"run_{n}")).exists())
    return (
        f"{key}={path}: the directory exists and holds files that are not an exp run's ({shown}). A run writes "
        "config.yaml, train.log, checkpoints/ and more into its directory, which would overwrite files of those names, "
        f"so nothing was written. Fix: pass a new or empty directory, e.g. {key}={inside}; to continue an exp run, "
        "pass trainer.resume=<its run directory> (the continuation gets a directory of its own)."
    )


NAME_MAX_BYTES = 255  # the longest file name Linux and macOS file systems take
SHORT_NAME_BYTES = 150  # what is kept of a too-long job name, before its hash


def sweep_job_dir_name(num: int | str, override_dirname: str) -> str:
    """A sweep job's directory name: `<job number>_<its overrides>` (Hydra's `override_dirname`).

    Overrides with long values (a data path, many keys) can make a name longer than a file system takes, and the job
    could not be created. Such a name is cut, and a hash of the whole name appended, so that it stays unique and the
    same on every launch (a re-launch finds the job again). A value's `/` is kept where every part is short enough: a
    path then nests, as in Hydra's own naming.
    """
    name = f"{num}_{override_dirname}" if override_dirname else str(num)
    if all(len(part.encode()) <= NAME_MAX_BYTES for part in name.split("/")):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    head = name.replace("/", "_").encode()[:SHORT_NAME_BYTES].decode(errors="ignore").rstrip(",=_")
    return f"{head}-{digest}"


_held: dict[Path, int] = {}  # run directory (resolved) -> the open descriptor whose lock this process holds
# run directory (resolved) -> the directories this process created to claim it (it first, then new parents): only
# those may be removed again (`discard_run_dir`); a directory that was there before is never removed.
_created: dict[Path, list[Path]] = {}
# Run directories (resolved) whose status.json this process last wrote as `running`: each must say how it ended before
# the process does (`close_unfinished`), whatever stops it (exp.training.signals.ends_recorded).
_running: set[Path] = set()


def write_json(path: Path, data: Any) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: the ranks of a launch share a run dir
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def write_status(run_dir: Path, status: str, error: str | None = None) -> None:
    record: dict[str, Any] = {"status": status, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if error:
        record["error"] = mask_secrets(error)
    if launch := os.environ.get(LAUNCH_ID_ENV):
        record["launch"] = launch
    write_json(run_dir / STATUS_FILE, record)
    if status == "running":
        _running.add(run_dir.resolve())
    else:
        _running.discard(run_dir.resolve())


def close_unfinished(status: str, error: str) -> list[Path]:
    """Mark `status` (failed, preempted), with `error`, every run whose status.json this process wrote `running`
    and that still says so, unless another process holds its lock now (a job process that is still running it):
    the run stopped before exp's code could record its end (Hydra setting it up, a callback, an error outside
    the pipeline's own handling). The runs marked."""
    closed = []
    for run_dir in sorted(_running):
        if read_status(run_dir).get("status") == "running" and not in_use(run_dir):
            write_status(run_dir, status, error=error)
            closed.append(run_dir)
    _running.clear()
    return closed


def read_status(run_dir: Path) -> dict[str, Any]:
    """The run's status record; {} when it has none (never started, or not an exp run)."""
    try:
        return json.loads((run_dir / STATUS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def lock_run(run_dir: Path, create: bool = True) -> bool:
    """Take `run_dir`'s lock for this process, without waiting: True when this process holds it (now or already),
    False when another process does. `create=False` (a run being continued, whose files are not to be touched)
    locks its `.lock` only if the run has one, else the directory itself."""
    key = run_dir.resolve()
    if key in _held:
        return True
    if _shared_launch_rank():
        return True  # rank 0 of the launch holds the locks for every rank
    lock = run_dir / LOCK_FILE
    try:
        if create or lock.exists():
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        else:
            fd = os.open(run_dir, os.O_RDONLY)
    except OSError:
        return True  # cannot be opened (read-only, someone else's): nothing to coordinate with
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return True  # a file system without locks: nothing to coordinate with
    _held[key] = fd
    return True


def lock_holder(run_dir: Path) -> int | None:
    """The id of the process holding `run_dir`'s lock, as Linux lists it (/proc/locks); None where it says nothing."""
    try:
        st = (run_dir / LOCK_FILE).stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    file = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"  # the kernel's device:inode
    for line in table.splitlines():  # "1: FLOCK  ADVISORY  WRITE 18285 fe:00:2220963 0 EOF"
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == file and fields[4].isdigit():
            return int(fields[4])
    return None


def release_run(run_dir: Path) -> None:
    if (fd := _held.pop(run_dir.resolve(), None)) is not None:
        os.close(fd)


def release_runs() -> None:
    """Every lock this process holds (the end of `exp.train.run`, which may be called again in the same process), and
    every run it marked `running`: none is this process's to close any more (`close_unfinished`)."""
    for key in list(_held):
        release_run(key)
    _running.clear()


def in_use(run_dir: Path) -> bool:
    """Whether another process holds `run_dir`'s lock (running it, or continuing it)."""
    if run_dir.resolve() in _held or _shared_launch_rank():
        return False
    if not lock_run(run_dir, create=False):
        return True
    release_run(run_dir)
    return False


def run_state(run_dir: Path) -> str:
    """The run's status, with `running` told apart from `interrupted`: a run whose status says running but whose
    lock no process holds was killed (SIGKILL, a power cut) before it could say so. Its status.json is left as it
    is (a run's files are never rewritten by another process); a continuation may have finished its work since."""
    status = read_status(run_dir).get("status", "running")
    if status == "running" and (run_dir / LOCK_FILE).exists() and not in_use(run_dir):
        return "interrupted"
    return status


def _shared_launch_rank() -> bool:
    """A rank other than 0 of a torchrun / SLURM launch: its ranks share one run directory and one resume choice."""
    return bool(os.environ.get(LAUNCH_ID_ENV)) and os.environ.get("RANK", "0") != "0"


def make_dir(path: Path, key: str) -> list[Path]:
    """Create `path` and its parents; the directories this made (`path` first, then its new parents). Raises
    ConfigError naming `key` (the setting that named `path`) when it cannot be created."""
    made = [d for d in (path, *path.parents) if not d.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{key}={path}: the directory cannot be created ({e.strerror or e}). Pass a directory you can write, e.g. "
            f"{key}=<a writable path> (or run from a writable directory)."
        ) from None
    return made


def claim_run_dir(path: Path) -> Path:
    """`path`, or `path_1`, `path_2`, ...: the first that no run has used (no status.json) and that no other process
    is claiming, created and locked by this process, its status `running`. Atomic: two processes that claim the same
    path at the same moment get different directories. A directory this process claimed already is returned as is.
    A `path` that holds files of something else than an exp run is refused (ConfigError), nothing written there; a
    `path_N` that does is passed over.
    """
    candidate, n = path, 0
    while True:
        if candidate.resolve() in _held:
            return candidate
        if entries := foreign_entries(candidate):
            if candidate == path:
                raise ConfigError(foreign_dir_message("hydra.run.dir", path, entries))
            n += 1
            candidate = path.with_name(f"{path.name}_{n}")
            continue
        made = make_dir(candidate, "hydra.run.dir")
        # A run's directory is left as it is (no lock file added); a free one is locked, then checked again: another
        # process may have claimed it and written its status in between.
        if not (candidate / STATUS_FILE).exists() and lock_run(candidate):
            if not (candidate / STATUS_FILE).exists():
                write_status(candidate, "running")
                if made:
                    _created[candidate.resolve()] = made
                return candidate
            release_run(candidate)
        n += 1
        candidate = path.with_name(f"{path.name}_{n}")


def discard_run_dir(run_dir: Path) -> bool:
    """Remove a run directory that stopped before it trained (bad input, a failed preflight), so that no half-empty
    directory is left to look like a run. Only a directory this process created for the run, holding no results
    (checkpoint, adapter, summary), and not shared with the other ranks of a launch; True when it was removed."""
    made = _created.pop(run_dir.resolve(), None)
    if not made or os.environ.get(LAUNCH_ID_ENV):
        return False
    if any((run_dir / name).exists() for name in (CHECKPOINT_DIR, ADAPTER_DIR, SUMMARY_FILE)):
        return False
    release_run(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in made[1:]:  # the date directory this run was the first of, if nothing else went there since
        try:
            parent.rmdir()
        except OSError:
            break
    return True


def new_run_dir(root: Path) -> Path:
    """A fresh `root/<date>/<time>` directory, as Hydra names them."""
    return claim_run_dir(root / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S"))


def shared_launch_id(env: dict[str, str] | None = None) -> str | None:
    """For one rank of several started by torchrun or SLURM: an id that every rank of this launch computes alike
    ("" when the launcher gives none); None for a single process (exp's own workers never get here).

    The ranks compose their configs independently, and a time-stamped run directory differs between ranks that
    start a second apart: the run directory must come from something they share.
    """
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1)
    if world <= 1:
        return None
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:  # torchrun: --standalone draws a uuid, --rdzv-id names it; the default is "none"
        restart = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
        return "" if run_id == "none" else f"torchrun-{run_id[:8]}" + (f"-restart{restart}" if restart else "")
    if job := env.get("SLURM_JOB_ID"):
        step, restart = env.get("SLURM_STEP_ID"), int(env.get("SLURM_RESTART_COUNT") or 0)
        return f"slurm-{job}" + (f".{step}" if step else "") + (f"-restart{restart}" if restart else "")
    return ""
