"""What Hydra may instantiate, and a record of each run that holds no secret.

Hydra imports and calls every `_target_` under `hydra.callbacks`, `hydra.launcher` and `hydra.sweeper` (and
`logging.config` every handler `class` and `()` factory of the logging configs) before any of exp's code runs: a
YAML file or an override naming another callable would run it. `target_problems` checks the composed config
against an allow-list; `exp.train.cli` calls it (through `exp.run.overrides.check_command_line`) before Hydra starts.

Hydra's own record of a job (`.hydra/`) holds the command-line overrides verbatim, `+hydra.job.env_set.X=...`
values included. `RunRecord` writes that record itself, redacted (conf/train.yaml sets `hydra.output_subdir: null`
so that Hydra writes nothing first).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from exp.core.secrets import REDACTED, SECRET_NAME, redact, redact_argv
from exp.run.dirs import HYDRA_DIR

# Where Hydra (or logging.config) turns a config value into a callable, what that callable must be: the modules it
# may be defined in and the class it must derive from. A value is resolved exactly as Hydra resolves it (every
# attribute step of `a.b.c`), importing only modules of these packages, and then the object it names is checked,
# not the string: `exp.train.os.symlink` names `os.symlink`, defined in `posix`, whatever its prefix says.
PLUGINS = ("hydra_plugins", "hydra._internal.core_plugins")


@dataclass(frozen=True)
class Slot:
    what: str  # for messages
    modules: tuple[str, ...]  # packages (or modules) the object must be defined in
    base: str = ""  # "module:Class" the object must be a subclass of; "" with `function`: a plain function
    function: bool = False


CALLBACK = Slot("a Hydra callback", ("exp",), "hydra.experimental.callback:Callback")
LAUNCHER = Slot("a Hydra launcher", PLUGINS, "hydra.plugins.launcher:Launcher")
SWEEPER = Slot("a Hydra sweeper", PLUGINS, "hydra.plugins.sweeper:Sweeper")
SAMPLER = Slot("an Optuna sampler", ("optuna.samplers",), "optuna.samplers:BaseSampler")
SEARCH_SPACE = Slot("an Optuna search-space function", ("exp",), function=True)
OTHER_TARGET = Slot("a class", ("exp", *PLUGINS, "optuna.samplers"), "builtins:object")
# Logging: console and file handlers only (a socket, HTTP or mail handler would send the log elsewhere), formatters
# and filters. Not logging.config (fileConfig evaluates expressions read from a file).
HANDLER = Slot("a logging handler", ("logging", "colorlog"), "logging:StreamHandler")
NULL_HANDLER = Slot("a logging handler", ("logging",), "logging:NullHandler")
FORMATTER = Slot("a logging formatter", ("logging", "colorlog"), "logging:Formatter")
FILTER = Slot("a logging filter", ("logging",), "logging:Filter")
DENIED_MODULES = ("logging.config",)
LOGGING_SECTIONS = ("hydra.job_logging", "hydra.hydra_logging")
# What a logging config may import with `ext://` (logging.config imports any module named there).
EXT_ALLOWED = ("ext://sys.stdout", "ext://sys.stderr")
# A log file must stay inside the run directory (a FileHandler opened on another path appends to, or with mode w
# empties, whatever is there).
LOG_FILE_PREFIXES = ("${hydra.runtime.output_dir}/", "${hydra:runtime.output_dir}/")

log = logging.getLogger(__name__)


class Refused(Exception):
    """A callable name that must not be imported or run; the message says why."""


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _on_the_way(name: str, packages: tuple[str, ...]) -> bool:
    """`name` is one of `packages`, inside one, or a package above one (imported on the way to it)."""
    return _within(name, packages) or any(p.startswith(name + ".") for p in packages)


def _import(name: str, packages: tuple[str, ...]) -> Any:
    if not _on_the_way(name, packages) or _within(name, DENIED_MODULES):
        raise Refused(f"it would import module {name}")
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 (a missing or broken module: Hydra would fail on it too)
        raise Refused(f"module {name} cannot be imported ({type(e).__name__}: {e})") from None


def locate(path: Any, slot: Slot) -> Any:
    """The object Hydra's `_locate(path)` returns, found without importing anything outside `slot.modules`, and
    checked: defined in one of them and of the slot's kind. Raises Refused."""
    if not isinstance(path, str) or not path:
        raise Refused(f"it is not a dotted name but {path!r}")
    if "${" in path:
        raise Refused("a callable name may not be an interpolation (it would be resolved only when Hydra runs)")
    parts = path.split(".")
    if not all(part.isidentifier() for part in parts):
        raise Refused("it is not a dotted Python name")
    obj = _import(parts[0], slot.modules)
    for i in range(1, len(parts)):
        dotted = ".".join(parts[: i + 1])
        if hasattr(obj, parts[i]):  # Hydra tries the attribute first, then a submodule
            obj = getattr(obj, parts[i])
        elif isinstance(obj, types.ModuleType):
            obj = _import(dotted, slot.modules)
        else:
            raise Refused(f"{'.'.join(parts[:i])} has no attribute {parts[i]}")
        if isinstance(obj, types.ModuleType) and not _on_the_way(obj.__name__, slot.modules):
            step = "it reaches" if dotted == obj.__name__ else f"{dotted} is"
            raise Refused(f"{step} module {obj.__name__}, outside the allowed packages")
    return _checked(obj, slot)


def _checked(obj: Any, slot: Slot) -> Any:
    if isinstance(obj, types.ModuleType):
        raise Refused(f"it names module {obj.__name__}, not {slot.what}")
    module = getattr(obj, "__module__", None) or ""
    if not _within(module, slot.modules) or _within(module, DENIED_MODULES):
        raise Refused(f"it names {getattr(obj, '__qualname__', obj)!s}, defined in {module or 'no module'}")
    if slot.function:
        if not isinstance(obj, types.FunctionType):
            raise Refused(f"it names {type(obj).__name__} {obj!r}, not {slot.what}")
        return obj
    base_module, base_name = slot.base.split(":")
    base = getattr(importlib.import_module(base_module), base_name)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise Refused(f"it names {getattr(obj, '__qualname__', obj)!s}, which is not {slot.what} ({slot.base})")
    return obj


def _allowed_text(slot: Slot) -> str:
    kind = "a function" if slot.function else f"a subclass of {slot.base.replace(':', '.')}"
    return f"{slot.what} ({kind}) defined in {', '.join(m + '.*' for m in slot.modules)}"


def _target_slot(where: str) -> Slot:
    parent = where.rsplit(".", 1)[0]
    if parent.startswith("hydra.callbacks.") and parent.count(".") == 2:
        return CALLBACK
    return {"hydra.launcher": LAUNCHER, "hydra.sweeper": SWEEPER, "hydra.sweeper.sampler": SAMPLER}.get(
        parent, OTHER_TARGET
    )


def _logging_slot(where: str) -> Slot | None:
    """The kind of object a `class` / `()` key of a logging config makes; None where logging.config makes none."""
    parts = where.split(".")
    section = parts[2] if len(parts) == 5 else ""
    return {"handlers": HANDLER, "formatters": FORMATTER, "filters": FILTER}.get(section)


def target_problems(config: dict[str, Any]) -> list[str]:
    """One paragraph per callable the config names outside what may be instantiated (`config`: the composed config
    with its `hydra` node, as plain containers, unresolved). Nothing named is run; only the packages a slot allows
    are imported to resolve a name."""
    problems = []

    def check(where: str, parent: str, value: Any, slot: Slot | None) -> None:
        try:
            if slot is None:
                raise Refused("logging.config would call it, and only handlers, formatters and filters may be made")
            if slot is HANDLER and value in ("logging.NullHandler",):
                slot = NULL_HANDLER
            locate(value, slot)
        except Refused as why:
            allowed = _allowed_text(slot) if slot is not None else "nothing here"
            problems.append(_refusal(where, value, parent, f"{why}; only {allowed} may be named there"))

    def walk(node: Any, path: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")
            return
        if not isinstance(node, dict):
            in_logging = _within(path.split("[")[0], LOGGING_SECTIONS)
            if in_logging and isinstance(node, str) and node.startswith("ext://") and node not in EXT_ALLOWED:
                parent = path.rsplit(".", 1)[0]
                rule = f"logging.config imports what ext:// names, and only {', '.join(EXT_ALLOWED)} may be named"
                problems.append(_refusal(path, node, parent, rule))
            return
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            logging_key = _within(where, LOGGING_SECTIONS)
            if key == "_target_":
                check(where, path, value, _target_slot(where))
            elif where == "hydra.sweeper.custom_search_space" and value is not None:
                check(where, where, value, SEARCH_SPACE)
            elif logging_key and key in ("class", "()"):
                check(where, path, value, _logging_slot(where))
            elif logging_key and key == "filename" and not _inside_run_dir(value):
                rule = f"a log file must be inside the run directory (start with {LOG_FILE_PREFIXES[0]})"
                problems.append(_refusal(where, value, path, rule, callable_=False))
            walk(value, where)

    walk(config, "")
    subdir = config.get("hydra", {}).get("output_subdir")
    if subdir is not None:
        problems.append(
            f"hydra.output_subdir={subdir}: Hydra would write its own record of the run there, command-line overrides "
            "and hydra.job.env_set values verbatim (secrets included), before exp's redacted record replaces it. exp "
            "writes the record itself, redacted, to <run dir>/.hydra/. Fix: drop the override (the default is null)."
        )
    job_name = str(config.get("hydra", {}).get("job", {}).get("name") or "")
    if "/" in job_name or job_name.startswith("."):
        problems.append(
            f"hydra.job.name={job_name}: it names the log file (<run dir>/<job name>.log), so it must be a plain name "
            "without '/' or a leading '.'. Fix: drop the override, or use e.g. hydra.job.name=train."
        )
    return problems


def _inside_run_dir(filename: Any) -> bool:
    return (
        isinstance(filename, str)
        and filename.startswith(LOG_FILE_PREFIXES)
        and ".." not in Path(filename.split("}", 1)[1]).parts
    )


def _refusal(key: str, value: Any, parent: str, rule: str, callable_: bool = True) -> str:
    what = "names a callable that Hydra would import and run" if callable_ else "is refused"
    return (
        f"{key}={value}: the config {what}, and {rule}. Nothing has been run. Fix: remove {parent or 'it'} (drop the "
        f"override or the YAML lines that set it, or add ~{parent}), or name an allowed one."
    )


def redact_override(line: str) -> str:
    """An override with its value masked when its key, or a key inside a dict value, looks like a secret."""
    masked = redact_argv([line])[0]
    key, sep, value = line.partition("=")
    if masked == line and sep and any(SECRET_NAME.search(k) for k in re.findall(r"([\w.\-]+)\s*:", value)):
        masked = f"{key}={REDACTED}"
    return masked


def secret_values(overrides: list[str]) -> list[str]:
    """The values of the secret-looking overrides: what must not be echoed back in an error message."""
    values = []
    for line in overrides:
        if redact_override(line) != line:
            values.append(line.partition("=")[2].strip("'\""))
    return [v for v in values if v]


def _write_yaml(path: Path, data: Any) -> None:
    """Atomically: a reader sees the previous file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two launches never share one
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(data)))
    os.replace(tmp, path)


def _redacted(record: dict[str, Any]) -> dict[str, Any]:
    """A composed config (with its `hydra` node) with secret-looking keys and overrides masked."""
    out = redact(record)
    overrides = out.get("hydra", {}).get("overrides", {})
    for side in ("task", "hydra"):
        if side in overrides:
            overrides[side] = [redact_override(o) for o in overrides[side]]
    return out


def write_hydra_record(config: DictConfig, run_dir: Path | None = None) -> Path:
    """Hydra's record of a job (config.yaml, hydra.yaml, overrides.yaml, as Hydra writes them) with secrets masked:
    values of secret-looking keys (`hydra.job.env_set.HF_TOKEN`, env_copy'd variables) and overrides. Written into
    `run_dir` (default: Hydra's output directory of the job)."""
    record = OmegaConf.to_container(config, resolve=False, enum_to_str=True)
    assert isinstance(record, dict)
    task = _redacted(record)
    hydra_node = task.pop("hydra")
    out = Path(run_dir or config.hydra.runtime.output_dir) / (config.hydra.output_subdir or HYDRA_DIR)
    out.mkdir(parents=True, exist_ok=True)
    _write_yaml(out / "config.yaml", task)
    _write_yaml(out / "hydra.yaml", {"hydra": hydra_node})
    _write_yaml(out / "overrides.yaml", hydra_node["overrides"]["task"])
    return out


def redact_multirun_record(sweep_dir: Path) -> None:
    """The sweeper's `multirun.yaml` (the whole config of a sweep), masked like `.hydra/`."""
    path = sweep_dir / "multirun.yaml"
    if path.exists():
        record = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        assert isinstance(record, dict)
        if (redacted := _redacted(record)) != record:
            _write_yaml(path, redacted)


def _secrets_in(record: Any, key: str = "") -> list[str]:
    """The values of secret-looking keys anywhere in a config (as plain containers)."""
    if isinstance(record, dict):
        return [s for k, v in record.items() for s in _secrets_in(v, str(k))]
    if isinstance(record, list):
        return [s for v in record for s in _secrets_in(v, key)]
    return [str(record)] if record and SECRET_NAME.search(key) else []


def remove_secret_pickles(sweep_dir: Path, config: DictConfig) -> list[Path]:
    """Delete the pickles a launcher left in the sweep directory (submitit's submitted and result files hold the
    whole config, Hydra's env_set values included) when they contain one of the sweep's secrets."""
    record = OmegaConf.to_container(config, resolve=False)
    overrides = OmegaConf.to_container(config.hydra.overrides)
    assert isinstance(overrides, dict)
    secrets = {s.encode() for s in [*_secrets_in(record), *secret_values(overrides["hydra"] + overrides["task"])]}
    removed = []
    for path in sweep_dir.rglob("*.pkl") if secrets and sweep_dir.is_dir() else []:
        if any(secret in path.read_bytes() for secret in secrets):
            path.unlink()
            removed.append(path)
    return removed


class RunRecord(Callback):
    """Registered in conf/train.yaml: the redacted `.hydra/` record of every job, and no secret on the command line.

    Once Hydra has parsed the command line, nothing in the process needs it verbatim: `sys.argv` is redacted so that
    W&B's run metadata (which records the arguments), the manifest or a crash report cannot copy a secret typed into
    an override. (The operating system's process list still shows it while the run lasts: secrets belong in the
    environment.)
    """

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        sys.argv[:] = [redact_override(arg) for arg in sys.argv]
        if config.hydra.mode == RunMode.MULTIRUN:
            # A sweep job's record goes into the run directory the job claims (exp.train.start_sweep_job), which
            # is not Hydra's output directory when an earlier attempt is there: that attempt's record stays its own.
            redact_multirun_record(Path(config.hydra.sweep.dir))
        else:
            write_hydra_record(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # Launchers that run jobs in other processes (gpus, submitit) write multirun.yaml here without a job start.
        sweep_dir = Path(config.hydra.sweep.dir)
        redact_multirun_record(sweep_dir)
        if removed := remove_secret_pickles(sweep_dir, config):
            log.info("removed %d launcher pickle(s) holding secrets from %s", len(removed), sweep_dir)
