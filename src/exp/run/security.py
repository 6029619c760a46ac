"""What Hydra may instantiate, and a record of each run that holds no secret.

Hydra imports and calls every `_target_` under `hydra.callbacks`, `hydra.launcher` and `hydra.sweeper` (and
`logging.config` every handler `class` and `()` factory of the logging configs) before any of exp's code runs: a
YAML file or an override naming another callable would run it. `target_problems` checks the composed config, with
its interpolations resolved as Hydra resolves them for a job, against an allow-list; `exp.train.cli` calls it
(through `exp.run.overrides.check_command_line`) before Hydra starts.

Hydra's own record of a job (`.hydra/`) holds the command-line overrides verbatim, `+hydra.job.env_set.X=...`
values included. `RunRecord` writes that record itself, redacted (conf/train.yaml sets `hydra.output_subdir: null`
so that Hydra writes nothing first), and it must stay the last of the Hydra callbacks.
"""

from __future__ import annotations

import copy
import enum
import importlib
import logging
import os
import re
import secrets
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from exp.core.secrets import REDACTED, SECRET_NAME, mask_secrets, redact, redact_argv
from exp.run.dirs import HYDRA_DIR

# Where Hydra (or logging.config) turns a config value into a callable, what that callable must be: the modules it
# may be defined in, the class it must derive from and, where exp's own code is named, the objects themselves. A
# value is resolved exactly as Hydra resolves it (every attribute step of `a.b.c`), importing only modules of these
# packages, and then the object it names is checked, not the string: `exp.train.os.symlink` names `os.symlink`,
# defined in `posix`, whatever its prefix says.
PLUGINS = ("hydra_plugins", "hydra._internal.core_plugins")


@dataclass(frozen=True)
class Slot:
    what: str  # for messages
    modules: tuple[str, ...]  # packages (or modules) the object must be defined in
    base: str = ""  # "module:Class" the object must be a subclass of; "" with `function`: a plain function
    function: bool = False
    # The objects that may be named (by any path that reaches them); None: any object of the slot's kind. exp's
    # own code is named only here: any other class of exp's would run with whatever arguments the config gives it.
    names: tuple[str, ...] | None = None
    note: str = ""  # why nothing may be named, for a slot with no names


# exp's Hydra callbacks, as conf/train.yaml registers them.
EXP_CALLBACKS = ("exp.study.records.SweepStatus", "exp.run.security.RunRecord")
CALLBACK = Slot("a Hydra callback", ("exp",), "hydra.experimental.callback:Callback", names=EXP_CALLBACKS)
LAUNCHER = Slot("a Hydra launcher", PLUGINS, "hydra.plugins.launcher:Launcher")
SWEEPER = Slot("a Hydra sweeper", PLUGINS, "hydra.plugins.sweeper:Sweeper")
SAMPLER = Slot("an Optuna sampler", ("optuna.samplers",), "optuna.samplers:BaseSampler")
# exp defines no search-space function (the search space is hydra.sweeper.params).
SEARCH_SPACE = Slot(
    "an Optuna search-space function",
    ("exp",),
    function=True,
    names=(),
    note="exp defines none: give the search space in hydra.sweeper.params",
)
# Nested `_target_`s (arguments of the callbacks, launcher or sweeper, Hydra instantiates them first) and the training
# config's: none of the project's configs has one, and exp builds its objects with builders, not `_target_`s.
OTHER_TARGET = Slot(
    "a class",
    ("exp", *PLUGINS, "optuna.samplers"),
    "builtins:object",
    names=(),
    note="Hydra would make a nested _target_ before the node around it, and exp's configs need none",
)
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
# empties, whatever is there). The check resolves the config with hydra.runtime.output_dir set to this directory,
# which does not exist (its name is new in every process): a file name that follows the run's output directory
# resolves inside it, one typed as a literal path or leaving it with `..` (however interpolated) resolves outside.
OUTPUT_DIR_STAND_IN = f"/exp-check-{secrets.token_hex(8)}/run"
# Parts of the hydra node that are records or help texts, not settings a job resolves.
NOT_RESOLVED = ("overrides", "runtime", "help", "hydra_help")
# Where conf/train.yaml registers RunRecord: the callback that keeps secrets out of the run's record, W&B's copy of
# the command line, a sweep's multirun.yaml and the launcher's pickles. Hydra calls the end-of-sweep hooks in
# reverse order and SweepStatus ends the process, so RunRecord must be the last callback.
RUN_RECORD = "run_record"

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
    checked: defined in one of them, of the slot's kind and, for a slot of named objects, one of them. Raises
    Refused."""
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
    name = f"{module}.{getattr(obj, '__qualname__', obj)!s}"
    if slot.function:
        if not isinstance(obj, types.FunctionType):
            raise Refused(f"it names {type(obj).__name__} {obj!r}, not {slot.what}")
    else:
        base_module, base_name = slot.base.split(":")
        base = getattr(importlib.import_module(base_module), base_name)
        if not (isinstance(obj, type) and issubclass(obj, base)):
            raise Refused(f"it names {name}, which is not {slot.what} ({slot.base})")
    if slot.names is not None and not any(obj is _named(n) for n in slot.names):
        raise Refused(f"it names {name}, which is not on exp's list")
    return obj


def _named(path: str) -> Any:
    """An object of a slot's list (exp's own code, named in this module)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _allowed_text(slot: Slot | None) -> str:
    if slot is None or slot.names == ():
        return f"nothing may be named there{f' ({slot.note})' if slot else ''}"
    if slot.names:
        return f"only {slot.what} on exp's list ({', '.join(slot.names)}) may be named there"
    kind = "a function" if slot.function else f"a subclass of {slot.base.replace(':', '.')}"
    return f"only {slot.what} ({kind}) defined in {', '.join(m + '.*' for m in slot.modules)} may be named there"


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


# --- the config as Hydra resolves it for a job --------------------------------------------------------------------


def resolve_as_hydra(cfg: DictConfig, multirun: bool) -> dict[str, Any]:
    """The composed config (with its `hydra` node) resolved as Hydra resolves it when it runs a job, as plain
    containers: `${oc.create:...}` and `${oc.decode:...}` become the nodes they make, `${hydra:...}` reads the job's
    Hydra config. `hydra.runtime.output_dir` is OUTPUT_DIR_STAND_IN; a sweep's job is its first (`hydra.job.num`
    0). Records and help texts (NOT_RESOLVED) and the directory settings of the other mode are left out. Raises
    Refused (one paragraph) for an interpolation that cannot be resolved: what Hydra would build from it cannot be
    checked."""
    view = copy.deepcopy(cfg)
    with read_write(view), open_dict(view):
        view.hydra.runtime.output_dir = OUTPUT_DIR_STAND_IN
        if multirun:  # set by the sweeper for each job
            for key, value in (("num", 0), ("id", "0")):
                if OmegaConf.is_missing(view.hydra.job, key):
                    view.hydra.job[key] = value
    skipped = {*NOT_RESOLVED, "run" if multirun else "sweep"}
    regions = [str(k) for k in view if k != "hydra"] + [f"hydra.{k}" for k in view.hydra if k not in skipped]
    hydra_config = HydraConfig.instance()
    previous = hydra_config.cfg
    hydra_config.set_config(view)  # what the ${hydra:...} resolver reads
    resolved: dict[str, Any] = {"hydra": {}}
    try:
        for region in regions:
            try:
                value = OmegaConf.select(view, region, throw_on_missing=False)
                if OmegaConf.is_config(value):
                    value = OmegaConf.to_container(value, resolve=True, enum_to_str=True)
            except Exception as e:  # noqa: BLE001 (a resolver's own error, a missing key, a cycle: all the user's)
                raise Refused(_unresolvable(e, region, cfg)) from None
            if isinstance(value, enum.Enum):
                value = value.name
            head, _, key = region.rpartition(".")
            (resolved["hydra"] if head else resolved)[key] = value
    finally:
        hydra_config.cfg = previous
    return resolved


def _unresolvable(e: Exception, region: str, cfg: DictConfig) -> str:
    key = getattr(e, "full_key", None) or region
    try:
        node = _raw_value(cfg, key)
    except Exception:  # noqa: BLE001 (a key path the error names loosely)
        node = None
    shown = f"{key}={node}" if isinstance(node, str | int | float | bool) else key
    reason = str(e).splitlines()[0].strip().rstrip(".") or type(e).__name__
    return (
        f"{shown}: the interpolation cannot be resolved ({type(e).__name__}: {reason}), and exp checks what Hydra "
        "would build from the config with its interpolations resolved. Nothing has been run. Fix: correct or remove "
        "the interpolation (an unset environment variable: export it, or give a default, ${oc.env:NAME,default})."
    )


def _raw_value(cfg: DictConfig, key: str) -> Any:
    """The value at `key` as written (its interpolation unresolved)."""
    node: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in re.findall(r"[^.\[\]]+", key):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


# --- the check ----------------------------------------------------------------------------------------------------


def target_problems(cfg: DictConfig, multirun: bool = False) -> list[str]:
    """One paragraph per problem with what Hydra would instantiate, open or write for this config (`cfg`: the
    composed config with its `hydra` node; `multirun`: composed for a sweep): callables outside the allow-list,
    found after resolving every interpolation (and refused when an interpolation makes their name), log files
    outside the run directory, RunRecord removed or not last. Nothing named is run; only the packages a slot
    allows are imported to resolve a name."""
    raw = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    assert isinstance(raw, dict)
    try:
        config = resolve_as_hydra(cfg, multirun)
    except Refused as why:
        return [str(why)]
    hydra = config.get("hydra") or {}
    job = hydra.get("job") or {}
    places = (hydra.get("sweep") if multirun else hydra.get("run")) or {}
    parts = [str(places.get(k) or "") for k in (("dir", "subdir") if multirun else ("dir",))]
    run_dir = os.path.normpath(os.path.join(*parts)) if parts[0] else ""
    log_files = _LogFiles(run_dir, bool(job.get("chdir")))
    problems: list[str] = []
    refused_callbacks: set[str] = set()

    def check(where: str, parent: str, value: Any, slot: Slot | None, made: bool) -> None:
        try:
            if made:
                raise Refused(
                    "a callable name may not be an interpolation, nor come from one (${oc.create:...}, "
                    "${oc.decode:...}): the check reads names as written"
                )
            if slot is None:
                raise Refused("logging.config would call it, and only handlers, formatters and filters may be made")
            if slot is HANDLER and value in ("logging.NullHandler",):
                slot = NULL_HANDLER
            locate(value, slot)
        except Refused as why:
            problems.append(_refusal(where, value, parent, f"{why}; {_allowed_text(slot)}"))
            if parent.startswith("hydra.callbacks."):
                refused_callbacks.add(parent.split(".")[2])

    def walk(node: Any, written: Any, path: str, made: bool) -> None:
        """`written`: the same node as the config file or override wrote it; `made`: the node comes from an
        interpolation (it, or a node above it, was written as `${...}`)."""
        if isinstance(node, list):
            for i, item in enumerate(node):
                below = written[i] if isinstance(written, list) and i < len(written) else None
                walk(item, below, f"{path}[{i}]", made or _interpolated(below, item))
            return
        in_logging = _within(path.split("[")[0], LOGGING_SECTIONS)
        if not isinstance(node, dict):
            if in_logging and isinstance(node, str):
                parent = path.rsplit(".", 1)[0]
                if node.startswith("ext://") and node not in EXT_ALLOWED:
                    rule = f"logging.config imports what ext:// names, and only {', '.join(EXT_ALLOWED)} may be named"
                    problems.append(_refusal(path, node, parent, rule))
                elif node.startswith("cfg://"):
                    rule = "logging.config would replace it by another value of the logging config, unchecked"
                    problems.append(_refusal(path, node, parent, rule, callable_=False))
            return
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            below = written.get(key) if isinstance(written, dict) else None
            made_here = made or _interpolated(below, value)
            logging_key = _within(where, LOGGING_SECTIONS)
            if key == "_target_":
                check(where, path, value, _target_slot(where), made_here)
            elif where == "hydra.sweeper.custom_search_space" and value is not None:
                check(where, where, value, SEARCH_SPACE, made_here)
            elif logging_key and key in ("class", "()"):
                check(where, path, value, _logging_slot(where), made_here)
            elif logging_key and key == ".":
                rule = "logging.config sets the attributes it names on the object it made (a file handler's file name)"
                problems.append(_refusal(where, value, path, rule, callable_=False))
            elif logging_key and key == "filename":
                problems.extend(log_files.problems(where, below if below is not None else value, value))
            walk(value, below, where, made_here)

    walk(config, raw, "", False)
    problems += _run_record_problems(hydra.get("callbacks"), refused_callbacks)
    params = (hydra.get("sweeper") or {}).get("params") or {}
    for key, value in params.items() if isinstance(params, dict) else ():
        if str(key).startswith("hydra"):
            problems.append(
                f"hydra.sweeper.params.{key}={value}: a sweep's params become each job's overrides, and Hydra's own "
                "settings (hydra.*) are not swept: per job they would change its logging, record and directories "
                f"after the check (Hydra refuses {key}=a,b on the command line for the same reason). Nothing has been "
                "run. Fix: remove it from hydra.sweeper.params, and set it once, on the command line or in the YAML."
            )
    subdir = hydra.get("output_subdir")
    if subdir is not None:
        problems.append(
            f"hydra.output_subdir={subdir}: Hydra would write its own record of the run there, command-line overrides "
            "and hydra.job.env_set values verbatim (secrets included), before exp's redacted record replaces it. exp "
            "writes the record itself, redacted, to <run dir>/.hydra/. Fix: drop the override (the default is null)."
        )
    job_name = str(job.get("name") or "")
    if "/" in job_name or job_name.startswith("."):
        problems.append(
            f"hydra.job.name={job_name}: it names the log file (<run dir>/<job name>.log), so it must be a plain name "
            "without '/' or a leading '.'. Fix: drop the override, or use e.g. hydra.job.name=train."
        )
    return problems


def _interpolated(written: Any, value: Any) -> bool:
    """`value` was not written as such: an interpolation (`${...}`) made it."""
    return (isinstance(written, str) and "${" in written) or (written is None and value is not None)


@dataclass(frozen=True)
class _LogFiles:
    """Where a log handler's file name leads: it must lie inside the job's output directory (`run_dir`, as the
    config resolves it), by the name as resolved with the stand-in output directory and by its real path (a
    symbolic link inside the run directory may lead out of it)."""

    run_dir: str
    chdir: bool  # hydra.job.chdir: a relative name is relative to the run directory, else to the launch directory

    def problems(self, where: str, written: Any, filename: Any) -> list[str]:
        if isinstance(filename, str) and filename:
            path = os.path.join(OUTPUT_DIR_STAND_IN if self.chdir else os.getcwd(), filename)
            if path.startswith(OUTPUT_DIR_STAND_IN + os.sep):
                # Normalised as a relative path, `..` past the run directory stays visible.
                rest = os.path.normpath(path[len(OUTPUT_DIR_STAND_IN) + 1 :])
                shown = os.path.normpath(os.path.join(self.run_dir, rest))
                inside = rest != "." and rest != os.pardir and not rest.startswith(os.pardir + os.sep)
                if inside and self.run_dir:
                    real = os.path.realpath(shown)
                    inside = real.startswith(os.path.realpath(self.run_dir) + os.sep)
                    shown += "" if inside else f" (by a symbolic link, {real})"
            else:
                shown = os.path.normpath(path if os.path.isabs(filename) else filename)
                inside = False
            if inside:
                return []
            leads = f"it resolves to {shown}, outside the run directory {self.run_dir or '(not known)'}"
        else:
            leads = f"it is not a file name but {filename!r}"
        return [
            f"{where}={str(written).replace(OUTPUT_DIR_STAND_IN, '${hydra.runtime.output_dir}')}: the config is "
            "refused, and a log file must be inside the run directory: "
            f"{leads}, and a FileHandler appends to, or with mode w empties, whatever file is there. Nothing has been "
            f"run. Fix: name it below the run directory, e.g. {where}=${{hydra.runtime.output_dir}}/train.log, or "
            "drop the override."
        ]


def _run_record_problems(callbacks: Any, refused: set[str]) -> list[str]:
    """RunRecord, as the last of the callbacks Hydra would make (callbacks refused already left aside), by itself."""
    entries = [(name, node) for name, node in (callbacks or {}).items() if name not in refused]
    name, node = entries[-1] if entries else ("", None)
    try:
        ok = isinstance(node, dict) and set(node) == {"_target_"} and locate(node["_target_"], CALLBACK) is RunRecord
    except Refused:
        ok = False
    if ok:
        return []
    if not any(isinstance(n, dict) and n.get("_target_") == EXP_CALLBACKS[1] for _, n in entries):
        how = "it is missing (removed with ~hydra.callbacks.run_record, or replaced)"
    elif not isinstance(node, dict) or node.get("_target_") != EXP_CALLBACKS[1]:
        how = f"hydra.callbacks.{name} comes after it"
    else:
        how = f"its node holds more than _target_ ({', '.join(sorted(map(str, node)))})"
    return [
        f"hydra.callbacks.{RUN_RECORD}: exp's callback {EXP_CALLBACKS[1]} must be the last of the Hydra callbacks, "
        f"and {how}. It writes the run's .hydra/ record with secrets masked and masks them in the command line W&B "
        "records, in a sweep's multirun.yaml and in the launcher's pickles; without it those hold secrets verbatim. "
        f"Nothing has been run. Fix: drop the override or the YAML lines that remove, replace or follow "
        f"hydra.callbacks.{RUN_RECORD} (conf/train.yaml registers it)."
    ]


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


def redact_job_return(job_return: JobReturn) -> None:
    """The configs and overrides a job hands back to its launcher, masked in place as its `.hydra/` record is; a
    failed job's exception with the secrets masked in its message (its arguments and string attributes, what
    pickling it keeps)."""
    known = secret_values(list(job_return.overrides or []))  # before the overrides are masked
    failure = job_return._return_value  # a failed job's exception (the property re-raises it)
    if isinstance(failure, BaseException):
        mask_exception(failure, known)
    if job_return.hydra_cfg is not None:
        record = OmegaConf.to_container(job_return.hydra_cfg, resolve=False)
        assert isinstance(record, dict)
        job_return.hydra_cfg = OmegaConf.create(_redacted(record))
    if job_return.cfg is not None:
        job_return.cfg = OmegaConf.create(redact(OmegaConf.to_container(job_return.cfg, resolve=False)))
    if job_return.overrides:
        job_return.overrides = [redact_override(o) for o in job_return.overrides]


def mask_exception(e: BaseException, known: list[str]) -> None:
    """`e`'s message arguments and string attributes with secret environment values and `known` values masked, in
    place, down its cause and context chain."""

    def masked(text: str) -> str:
        text = mask_secrets(text)
        for value in sorted(known, key=len, reverse=True):
            text = text.replace(value, REDACTED)
        return text

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.args = tuple(masked(a) if isinstance(a, str) else a for a in e.args)
        for name, value in list(vars(e).items()):
            if isinstance(value, str):
                setattr(e, name, masked(value))
        e = e.__cause__ or e.__context__


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


def remove_secret_pickles(sweep_dir: Path, config: DictConfig, paths: list[Path] | None = None) -> list[Path]:
    """Delete the pickles a launcher left in the sweep directory (submitit's submitted and result files hold the
    whole config, Hydra's env_set values included), or the given `paths`, when they contain one of the sweep's
    secrets."""
    record = OmegaConf.to_container(config, resolve=False)
    overrides = OmegaConf.to_container(config.hydra.overrides)
    assert isinstance(overrides, dict)
    secrets = {s.encode() for s in [*_secrets_in(record), *secret_values(overrides["hydra"] + overrides["task"])]}
    if paths is None:
        paths = list(sweep_dir.rglob("*.pkl")) if sweep_dir.is_dir() else []
    removed = []
    for path in [p for p in paths if p.is_file()] if secrets else []:
        if any(secret in path.read_bytes() for secret in secrets):
            path.unlink()
            removed.append(path)
    return removed


# What RunRecord.on_job_start failed on for the job now starting (empty: it did its work).
_record_failures: list[Exception] = []


def run_record_failure() -> Exception | None:
    """Why the job now starting has no redacted record or still has its secrets on the command line (None: it has
    both): a job must not run without them."""
    return _record_failures[0] if _record_failures else None


class RunRecord(Callback):
    """Registered in conf/train.yaml: the redacted `.hydra/` record of every job, and no secret on the command line.

    Once Hydra has parsed the command line, nothing in the process needs it verbatim: `sys.argv` is redacted so that
    W&B's run metadata (which records the arguments), the manifest or a crash report cannot copy a secret typed into
    an override. (The operating system's process list still shows it while the run lasts: secrets belong in the
    environment.)
    """

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra only warns about a callback's exception and runs the job anyway: what failed is kept for the job to
        # refuse to run (`run_record_failure`), since a job without it would train with its secrets unmasked.
        _record_failures.clear()
        try:
            sys.argv[:] = [redact_override(arg) for arg in sys.argv]
            if config.hydra.mode == RunMode.MULTIRUN:
                # A sweep job's record goes into the run directory the job claims (exp.study.job.start_sweep_job),
                # which is not Hydra's output directory when an earlier attempt is there: that attempt's record
                # stays its own.
                redact_multirun_record(Path(config.hydra.sweep.dir))
            else:
                write_hydra_record(config)
        except Exception as e:
            _record_failures.append(e)
            raise

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # What the job hands back to its launcher: submitit pickles it into the job's `*_result.pkl` as it ends, and
        # a launcher killed outright (SIGKILL) never reads and deletes it. The sweep needs only the job's value.
        redact_job_return(job_return)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # Launchers that run jobs in other processes (gpus, submitit) write multirun.yaml here without a job start.
        sweep_dir = Path(config.hydra.sweep.dir)
        redact_multirun_record(sweep_dir)
        if removed := remove_secret_pickles(sweep_dir, config):
            log.info("removed %d launcher pickle(s) holding secrets from %s", len(removed), sweep_dir)
