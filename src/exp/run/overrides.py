"""Check the command line before Hydra runs anything, with errors that name the key, the value and the fix.

Hydra already rejects an unknown key (`lora.rank=16`), but its message names neither the valid fields nor the
nearest one; `check_cli_overrides` walks the dataclass schema and says both. `check_command_line` (what
`python -m exp.train` runs first) then composes the config as Hydra will and refuses what composition lets
through: keys the schema lacks (`+foo=1`), callables outside the allow-list (exp.run.security), a run directory that
cannot be created or that holds files of something else than an exp run. Composition errors come out as one
`exp: error:` paragraph, without Hydra's search-path dump.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from exp.core.cli import flag_value, not_key_value, unknown_flag
from exp.core.config import ConfigError, TrainConfig, config_key, schema_fields
from exp.core.constants import LAUNCH_ID_ENV
from exp.core.secrets import SECRET_NAME, secret_value_problems
from exp.run.dirs import (
    BEFORE_STATUS,
    RUN_ENTRIES,
    STATUS_FILE,
    claim_run_dir,
    foreign_dir_message,
    foreign_entries,
    read_status,
)
from exp.run.security import REDACTED, secret_values, target_problems
from exp.run.typed import to_typed

# Settings people look for under a key that exp derives from, or keeps under, another one.
_DTYPE = (
    "the compute dtype is not a setting of its own: it follows hardware.precision (32-true: float32, bf16-mixed: "
    "bfloat16, 16-mixed: float16). Use e.g. hardware.precision=bf16-mixed on a GPU (the CPU computes in float32)"
)
_ACCUMULATION = (
    "gradient accumulation is derived: trainer.global_batch_size / (hardware.micro_batch_size x data-parallel "
    "processes). Set e.g. trainer.global_batch_size=32"
)
MOVED = {
    **dict.fromkeys(("compute_dtype", "bnb_4bit_compute_dtype", "dtype", "torch_dtype"), _DTYPE),
    **dict.fromkeys(("gradient_accumulation_steps", "accumulate_grad_batches"), _ACCUMULATION),
}


def _not_a_field(shown: str, parts: list[str], depth: int, fields: dict[str, Any]) -> str:
    part, where = parts[depth], ".".join(parts[:depth]) or "the root config"
    if part in MOVED:
        return f"'{shown}': {MOVED[part]}."
    # Short field names (lora.r) are far from their spelled-out guesses (rank) by edit ratio: a field that starts
    # the typed word counts as close too, before a longer field the word starts (lora.rank: lora.r, not
    # lora.rank_pattern).
    starts = sorted((f for f in fields if part.startswith(f)), key=len, reverse=True)
    close = (
        difflib.get_close_matches(part, fields, n=1)
        or starts[:1]
        or sorted((f for f in fields if f.startswith(part)), key=len, reverse=True)[:1]
    )
    hint = f" Did you mean '{'.'.join(parts[:depth] + close)}'?" if close else ""
    return f"'{shown}': '{part}' is not a field of {where}.{hint} Allowed: {', '.join(sorted(fields))}."


def check_cli_overrides(args: list[str]) -> list[str]:
    """One message per `a.b=value` override whose key path is not in the schema, or that puts a secret into the
    training config. Flags, `~` deletions, group choices and Hydra's own `hydra.*` keys are skipped."""

    problems = []
    for arg in args:
        if "=" not in arg and not arg.startswith(("-", "~")):
            problems.append(not_key_value("exp.train", arg) + " python -m exp.train --help lists the config.")
        if arg.startswith(("-", "~")) or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+")
        parts = key.split(".")
        if parts[0] == "hydra" or "@" in key or "/" in key:
            continue
        if SECRET_NAME.search(parts[-1]):  # the value is not repeated: it is the secret
            problems.append(
                f"'{key}=...': '{parts[-1]}' looks like a secret (a key, token or password), and the training config "
                "is recorded in config.yaml, .hydra/, W&B and a sweep's directory names. Pass it in the environment "
                "instead (e.g. export HF_TOKEN=... or WANDB_API_KEY=...)."
            )
            continue
        if len(parts) < 2:
            continue  # group choices (model=...) are checked at composition, which lists the options
        node: typing.Any = TrainConfig
        for depth, part in enumerate(parts):
            if not dataclasses.is_dataclass(node):
                break  # a dict or list field: free-form below this point
            fields = schema_fields(node)
            if part not in fields:
                problems.append(_not_a_field(arg, parts, depth, fields))
                break
            node = fields[part]
    return problems


def unknown_keys(config: dict[str, Any], schema: type = TrainConfig, path: str = "") -> list[str]:
    """Keys of the composed config that the schema lacks: a `+key=...` override added them, and nothing reads them."""
    problems = []
    fields = schema_fields(schema)
    for key, value in config.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            parts = where.split(".")
            problems.append(_not_a_field(f"+{where}", parts, len(parts) - 1, fields) + " Nothing reads it: remove it.")
        elif dataclasses.is_dataclass(fields[key]) and isinstance(value, dict):
            problems += unknown_keys(value, fields[key], where)
    return problems


# --- `seeds=N`: every configuration of a sweep, N times ---------------------------------------------------------

# What a seed repeat varies: everything Lightning seeds (dropout, ...) and the adapters' initialisation. The data
# order stays: data.seed also draws the validation split, and repeats compared on different held-out sets would
# mix the split's noise into the seed noise.
SEED_KEYS = ("trainer.seed", "lora.init_seed")


def expand_seeds(argv: list[str]) -> tuple[list[str], list[str]]:
    """`seeds=N` -> `trainer.seed=range(N)` with `lora.init_seed` following it; (arguments, problems)."""
    given = [a for a in argv if a.split("=", 1)[0] == "seeds"]
    if not given:
        return argv, []
    value = given[-1].split("=", 1)[1]
    keys = {a.lstrip("+").split("=", 1)[0] for a in argv}
    if not value.isdigit() or int(value) < 1:
        return argv, [
            f"seeds={value}: the number of seeds to repeat every configuration with, a whole number >= 1 (seeds 0 to "
            "N-1), e.g. seeds=3; for other seeds sweep trainer.seed itself, e.g. trainer.seed=11,12,13."
        ]
    if not {"-m", "--multirun"} & set(argv):
        return argv, [
            f"seeds={value} repeats every configuration of a sweep: add -m (python -m exp.train -m seeds={value} ...)."
        ]
    if clash := sorted(keys & set(SEED_KEYS)):
        return argv, [
            f"seeds={value} with {', '.join(clash)} on the same command line: seeds=N sets trainer.seed to 0..N-1 and "
            "lora.init_seed to follow it. Fix: drop one of them (sweep trainer.seed=... yourself for other seeds)."
        ]
    rest = [a for a in argv if a.split("=", 1)[0] != "seeds"]
    # lora.init_seed follows trainer.seed by interpolation; left out of the job directories' names, which would
    # otherwise carry a literal `${trainer.seed}` (the seed is in them as trainer.seed). A command line's own
    # exclusion list is extended; one from a config file would be replaced, so it is extended here too.
    exclude = "hydra.job.config.override_dirname.exclude_keys"
    given_exclude = [a for a in rest if a.split("=", 1)[0] == exclude]
    keys_excluded = given_exclude[-1].split("=", 1)[1].strip("[]") if given_exclude else ""
    rest = [a for a in rest if a.split("=", 1)[0] != exclude]
    excluded = ",".join(filter(None, [keys_excluded, "lora.init_seed"]))
    return [*rest, f"trainer.seed=range({value})", "lora.init_seed=${trainer.seed}", f"{exclude}=[{excluded}]"], []


# --- the whole command line, composed as Hydra will compose it --------------------------------------------------


def check_command_line(
    argv: list[str], caller: str, config_path: str, config_name: str, launch: str | None = None
) -> tuple[list[str], list[str]]:
    """Problems with `python -m exp.train <argv>` (empty: none), and the arguments to hand Hydra.

    `caller`, `config_path`, `config_name`: those of the `@hydra.main` function. Nothing is instantiated, written or
    run. The arguments returned pin a single run's directory (`hydra.run.dir`, its `${now:...}` resolved once), so
    that the directory the caller claims (`exp.run.dirs.claim_run_dir`, which moves to `<dir>_N` when the directory
    holds a run or another process is claiming it) is the one Hydra writes its record and log into.
    `launch`: this process is one rank of a torchrun / SLURM launch with that id (`exp.run.dirs.shared_launch_id`):
    its ranks share the run directory, so none moves to `<dir>_N`; a directory holding another launch's run is
    refused instead.
    """
    # Hydra's own parser (not a public API; hydra-core is pinned to 1.3): the flags exactly as Hydra will read them.
    from hydra._internal.utils import get_args_parser
    from hydra.types import RunMode

    args, unknown = get_args_parser().parse_known_args(argv)
    problems, values = [], []
    for i, arg in enumerate(argv):
        if arg in unknown:
            problems.append(
                unknown_flag("exp.train", arg, flag_value(argv, i), config_key)
                + " python -m exp.train --help lists the config; --hydra-help lists Hydra's flags (-m, --cfg, ...)."
            )
            values.append(flag_value(argv, i))
    problems += check_cli_overrides([a for a in args.overrides if a not in values])
    if args.experimental_rerun:
        problems.append(
            "--experimental-rerun: exp does not re-run pickled configs (unpickling a file can run any code). Run the "
            "overrides again instead: they are in <run dir>/.hydra/overrides.yaml."
        )
    if problems:
        return problems, argv
    if args.help or args.hydra_help:  # they print, but configure logging from the config first
        try:
            configs = _compose_all(args, caller, config_path, config_name, RunMode.RUN)
        except Exception:  # noqa: BLE001 (Hydra fails on it the same way, before it configures anything)
            return [], argv
        return list(dict.fromkeys(p for cfg in configs for p in target_problems(cfg))), argv
    if args.cfg or args.info or args.shell_completion:
        return problems, argv  # the modes that only print compose and instantiate nothing
    mode = RunMode.MULTIRUN if args.multirun else RunMode.RUN
    try:
        configs = _compose_all(args, caller, config_path, config_name, mode)
    except Exception as e:  # noqa: BLE001 (every composition error is the user's to fix: report it, no traceback)
        configs, error = [], e
    # As Hydra decides: without -m, a config's own `hydra.mode: MULTIRUN` makes it a sweep.
    if mode == RunMode.RUN and (not configs or configs[0].hydra.mode == RunMode.MULTIRUN):
        try:
            swept = _compose_all(args, caller, config_path, config_name, RunMode.MULTIRUN)
            if swept[0].hydra.mode == RunMode.MULTIRUN:
                configs, mode = swept, RunMode.MULTIRUN
        except Exception:  # noqa: BLE001 (the first error is the one to report)
            pass
    if not configs:
        return [composition_error(error, args.overrides)], argv

    for cfg in configs:
        problems += target_problems(cfg, multirun=mode == RunMode.MULTIRUN)
        problems += name_length_problems(cfg)
        record = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
        assert isinstance(record, dict)
        record.pop("hydra")
        problems += unknown_keys(record)
        problems += _secret_value_problems(cfg, record)
        problems += _data_problems(cfg)
    if mode == RunMode.RUN and not problems:
        problems += _typed_problems(configs[0])
    key = "hydra.sweep.dir" if mode == RunMode.MULTIRUN else "hydra.run.dir"
    run_dir = _resolved(configs[0], key)
    if run_dir is not None and any(len(os.fsencode(part)) > NAME_MAX for part in run_dir.parts):
        return list(dict.fromkeys(problems)), argv  # not a path the file system can look up (named above)
    if run_dir is not None:
        problems += run_dir_problems(key, run_dir)
        # A run never writes into a directory of something else. The ranks of a launch share theirs: one may find
        # any of a run's files that another rank wrote.
        own = BEFORE_STATUS if launch is None else RUN_ENTRIES
        if mode == RunMode.RUN and (entries := foreign_entries(run_dir, own)):
            problems.append(foreign_dir_message(key, run_dir, entries))
    problems = list(dict.fromkeys(problems))  # each sweep choice repeats the problems of the others
    if problems or mode == RunMode.MULTIRUN or run_dir is None:
        return problems, argv
    if launch is None:
        return [], with_run_dir(argv, run_dir)
    if (run_dir / STATUS_FILE).exists():
        status = read_status(run_dir)
        if status.get("launch") != launch:
            return [
                f"hydra.run.dir={run_dir} already holds a run ({status.get('status', 'unknown status')}, launch "
                f"{status.get('launch', 'of a single process')}), and the ranks of this launch ({launch}) cannot move "
                "to a new directory together. Pass a new hydra.run.dir, the same for every rank, or continue that "
                f"run with trainer.resume={run_dir} and a new hydra.run.dir."
            ], argv
    return [], argv  # a new directory, or another rank of this launch got there first


def _typed_problems(cfg: DictConfig) -> list[str]:
    """The typed config's own checks (the schema's cross-field rules, model.path, model.adapter, the model family's
    rules: exp.run.typed.to_typed) on a single run's composed config, run here, before the training stack loads:
    a bad value is refused in well under a second instead of after torch's and Lightning's imports, and no run
    directory is claimed for it. A sweep's jobs are checked each in its own job, so that one bad combination fails
    that job alone."""
    job = copy.deepcopy(cfg)
    with open_dict(job):
        del job["hydra"]
    try:
        # The launch directory: Hydra has not changed it yet. Quiet: a warning here would come before Hydra sets up
        # the run's log, and the run's own composition (once only: exp.run.start_adapter) would then stay silent.
        to_typed(job, Path.cwd(), quiet=True)
    except ConfigError as e:
        return [str(e)]
    return []


def _data_problems(cfg: DictConfig) -> list[str]:
    """A data path that does not exist or a file without the format's columns, found before torch loads."""
    # Only when the command line names data; both are torch-free (this check runs before torch loads).
    from exp.core.config import DataConfig
    from exp.data.files import early_problems

    try:
        data = OmegaConf.to_object(cfg.data)
    except Exception:  # noqa: BLE001 (an unresolvable value: the typed config names it later)
        return []
    return early_problems(data, Path.cwd()) if isinstance(data, DataConfig) else []


def with_run_dir(argv: list[str], run_dir: Path) -> list[str]:
    """`argv` with `hydra.run.dir` set to `run_dir` (quoted for Hydra's override grammar)."""
    keep = [a for a in argv if a.lstrip("+").split("=", 1)[0] != "hydra.run.dir"]
    quoted = str(run_dir).replace("\\", "\\\\").replace('"', '\\"')
    return [*keep, f'hydra.run.dir="{quoted}"']


def config_loader(args: Any, caller: str, config_path: str) -> Any:
    """Hydra's config loader as `_run_hydra` builds it for these parsed arguments (--config-dir included)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.utils import setup_globals

    setup_globals()  # the ${now:...} resolver of run directory names
    search_path = create_automatic_config_search_path(caller, None, args.config_path or config_path)
    if args.config_dir is not None:
        config_dir = os.path.abspath(args.config_dir)
        if not os.path.isdir(config_dir):
            raise FileNotFoundError(f"--config-dir {args.config_dir}: {config_dir} is not a directory")
        search_path.prepend("command-line", f"file://{config_dir}", anchor=SearchPathQuery(provider="schema"))
    return ConfigLoaderImpl(config_search_path=search_path)


def _compose_all(args: Any, caller: str, config_path: str, config_name: str, mode: Any) -> list:
    """The config Hydra will compose (as `_run_hydra` builds it), plus one per choice of a swept config group
    (`experiment=a,b`, on the command line or in `hydra.sweeper.params`): the files a sweep selects are read by its
    jobs too (their logging, their record)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import MissingConfigException
    from hydra.types import RunMode

    loader = config_loader(args, caller, config_path)
    name = args.config_name or config_name

    def compose(overrides: list[str]):
        cfg = loader.load_configuration(config_name=name, overrides=overrides, run_mode=mode, from_shell=True)
        # An `optional` group (experiment) skips an option it cannot find: a misspelt experiment would run the
        # default config. The options are those of the repository this composition read (`hydra.searchpath` adds
        # directories to it).
        _, repo = loader._parse_overrides_and_create_caching_repo(name, overrides)
        for group, option in cfg.hydra.runtime.choices.items():
            if isinstance(option, str) and option not in (options := repo.get_group_options(group)):
                raise MissingConfigException(
                    f"no {group}/{option}", missing_cfg_file=f"{group}/{option}", options=options
                )
        return cfg

    configs = [compose(args.overrides)]
    if mode == RunMode.MULTIRUN:
        # As the basic sweeper reads them: the params first, then the command line's overrides.
        parser = OverridesParser.create()
        params = OmegaConf.select(configs[0], "hydra.sweeper.params", default=None) or {}
        try:
            swept = [f"{k}={v}" for k, v in params.items()]
            parsed = parser.parse_overrides(swept)
        except Exception:  # noqa: BLE001 (a sweeper's own syntax: its groups, if any, are not enumerable here)
            swept, parsed = [], []
        swept += args.overrides
        parsed += parser.parse_overrides(args.overrides)
        for i, override in enumerate(parsed):
            if not override.is_sweep_override() or "." in override.key_or_group:
                continue  # a swept value (lora.r=4,8) selects no file
            prefix = swept[i].split("=", 1)[0]
            others = [o for o in args.overrides if o.split("=", 1)[0] != prefix]
            try:
                choices = list(override.sweep_string_iterator())
            except Exception:  # noqa: BLE001 (glob / interval sweeps: not enumerable here)
                continue
            configs += [compose([*others, f"{prefix}={choice}"]) for choice in choices]
    return configs


# Hydra settings whose resolved values become directory and file names (and so reach every record of the run).
NAMED_BY_HYDRA = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.job.name")


def _secret_value_problems(cfg: Any, record: dict[str, Any]) -> list[str]:
    """Keys whose resolved value is a secret environment variable's: of the training config, and of the Hydra
    settings that name the run's directories and files."""

    try:
        resolved = OmegaConf.to_container(OmegaConf.create(record), resolve=True)
    except Exception:  # noqa: BLE001 (an interpolation only Hydra can resolve: the typed config checks it again)
        resolved = record
    named = {}
    for key in NAMED_BY_HYDRA:
        try:
            named[key] = OmegaConf.select(cfg, key)
        except Exception:  # noqa: BLE001 (${hydra:...}: resolvable only once Hydra runs the job)
            continue
    return secret_value_problems(resolved) + secret_value_problems(named, "the run directory's name")


def _resolved(cfg: Any, key: str) -> Path | None:
    try:
        value = OmegaConf.select(cfg, key)
    except Exception:  # noqa: BLE001 (e.g. ${hydra:...}, resolvable only once Hydra runs the job)
        return None
    return Path(str(value)) if value else None


# The longest file name (one path component) Linux file systems take, in bytes.
NAME_MAX = 255


def name_length_problems(cfg: Any) -> list[str]:
    """Hydra settings that become a directory or file name longer than the file system takes: Hydra would fail
    after making the run directory (the job's log file is `<hydra.job.name>.log`), with a traceback."""
    problems = []
    for key in NAMED_BY_HYDRA:
        value = _resolved(cfg, key)
        if value is None:
            continue
        names = [value.name + ".log"] if key == "hydra.job.name" else list(value.parts)
        if too_long := [n for n in names if len(os.fsencode(n)) > NAME_MAX]:
            problems.append(
                f"{key}={str(value)[:60]}...: the name '{too_long[0][:40]}...' is {len(os.fsencode(too_long[0]))} "
                f"bytes, longer than the file system allows ({NAME_MAX} per file or directory name"
                f"{', with .log added for the log file' if key == 'hydra.job.name' else ''}). Fix: a shorter name."
            )
    return problems


def run_dir_problems(key: str, path: Path) -> list[str]:
    """A run (or sweep) directory that cannot be created: it, or a directory above it, is an existing file, or the
    nearest existing directory cannot be written (permissions, a read-only file system)."""
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            below = "" if p == path else "/" + str(path.relative_to(p))
            return [
                f"{key}={path}: {p} is an existing file, not a directory: a run directory cannot be created "
                f"{'there' if p == path else 'below it'}. Pass a new directory, e.g. {key}={p}_run{below}."
            ]
        if p.is_dir():
            if not os.access(p, os.W_OK | os.X_OK):
                return [
                    f"{key}={path}: {p} cannot be written (permissions, or a read-only file system), so the run "
                    f"directory cannot be {'written' if p == path else 'created'}. Pass a directory you can write, "
                    f"e.g. {key}=$HOME/exp-runs/{path.name}."
                ]
            break
    return []


def composition_error(e: Exception, overrides: list[str]) -> str:
    """One paragraph for a failed composition: the override, what is wrong with it, and an example of a fix."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(e, OverrideParseException):
        message = override_syntax_message(e.override, e.message)
    elif isinstance(e, MissingConfigException) and e.options and "/" in (e.missing_cfg_file or ""):
        group, _, choice = e.missing_cfg_file.rpartition("/")
        close = difflib.get_close_matches(choice, e.options, n=1)
        hint = f" Did you mean {group}={close[0]}?" if close else ""
        message = f"{group}={choice}: there is no option '{choice}' in group '{group}'.{hint} Available: "
        message += ", ".join(e.options) + "."
    else:
        cause = e.__cause__ if e.__cause__ is not None else e
        # OmegaConf appends the key and the node types on indented lines; Hydra the config search path.
        text = "\n".join(ln for ln in str(cause).split("Config search path:")[0].splitlines() if ln[:1] != " ")
        merging = re.match(r"Error merging override (.+)", str(e))
        message = (f"'{merging.group(1)}': {text.strip()}" if merging else text.strip()).rstrip(".")
        key = getattr(cause, "full_key", None)
        example = _example(key) if key else None
        if example:
            message += f". Fix: give {key} a value of its type, e.g. {example}."
        elif key and "not in struct" in text:  # a key new to a free-form mapping (model.arch.vocab_size=...)
            message = f"{key}: not a key of {key.rpartition('.')[0] or 'the config'} yet. Fix: add it with +{key}=..."
    for secret in secret_values(overrides):
        message = message.replace(secret, REDACTED)
    return message


def override_syntax_message(override: str, reason: str) -> str:
    """An argument Hydra's override grammar cannot read: its key, the parser's reason, and the quoting that fixes it."""
    key, sep, value = override.partition("=")
    reason = reason.splitlines()[0].strip() if reason.strip() else "not an override"
    if not sep or not key.strip(" +~"):
        return (
            f"'{override}': not a key=value override ({reason}). Fix: write it as key=value, e.g. lora.r=16, or "
            "group=option, e.g. model=gemma_2b."
        )
    key = key.strip()
    name = key.lstrip("+~")
    if not re.fullmatch(r"[\w.@/-]+", name):
        return f"'{override}': {name!r} is not a config key ({reason}). Fix: a key is dotted words, e.g. lora.r=16."
    if value.count("${") and value.count("{") > value.count("}"):
        closed = value + "}" * (value.count("{") - value.count("}"))
        return (
            f"'{override}': the interpolation in the value of {name} is not closed ({reason}). Fix: close it, "
            f"'{key}={closed}' (in single quotes, so that the shell leaves the $ alone)."
        )
    listed = f" or close the list, e.g. {key}=[1,2]" if value.lstrip().startswith("[") else ""
    return (
        f"'{override}': Hydra cannot read the value of {name} ({reason}): '=', brackets, braces, spaces and commas "
        f"have a meaning in an override. Fix: quote the value for Hydra inside the shell's quotes, "
        f"\"{key}='{value}'\"{listed}."
    )


def _example(key: str) -> str | None:
    """`key=<its schema default>`, written as an override."""
    try:
        value = OmegaConf.select(OmegaConf.structured(TrainConfig), key)
    except Exception:  # noqa: BLE001 (not a schema key)
        return None
    if value is None or isinstance(value, DictConfig):
        return None
    if isinstance(value, ListConfig):
        value = "[" + ",".join(map(str, value)) + "]"
    elif isinstance(value, bool):
        value = str(value).lower()
    elif isinstance(value, enum.Enum):
        value = value.value
    return f"{key}={value}"


def join_launch(argv: list[str], launch: str) -> list[str]:
    """The command line of one rank of a torchrun / SLURM launch (`launch`: its shared id): the launch's id in the
    environment (status.json records it) and, unless given, `hydra.run.dir=outputs/<launch id>` for every rank."""
    if not launch:
        raise ConfigError(
            "this is one of several processes started by torchrun, which gives them no shared launch id "
            "(TORCHELASTIC_RUN_ID=none), so they cannot agree on a run directory. Start torchrun with --standalone "
            "(one machine) or --rdzv-id=<id> (several machines), or run under SLURM (srun)."
        )
    os.environ[LAUNCH_ID_ENV] = launch
    if not any(a.lstrip("+").split("=", 1)[0] == "hydra.run.dir" for a in argv):
        argv = [*argv, f"hydra.run.dir=outputs/{launch}"]
    return argv


def claim_pinned_run_dir(argv: list[str]) -> list[str]:
    """Claim the run directory `check_command_line` pinned (a sweep pins none) before Hydra writes into it: a
    directory holding a run, or being claimed by a launch started at the same moment, gives way to `<dir>_N`."""
    pinned = [a for a in argv if a.startswith('hydra.run.dir="')]
    if not pinned:
        return argv
    wanted = Path(pinned[-1].split("=", 1)[1][1:-1].replace('\\"', '"').replace("\\\\", "\\"))
    claimed = claim_run_dir(wanted)  # ConfigError: the directory cannot be made
    if claimed != wanted:
        print(f"exp: {wanted} already holds a run; this one goes to {claimed}", file=sys.stderr)
    return with_run_dir(argv, claimed)
