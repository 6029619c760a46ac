"""The command line of every `python -m exp.<tool>`: `key=value` arguments, `-h`/`--help`, `-v`/`--verbose`.

One style for every tool, Hydra's. exp.train, exp.doctor and exp.preview take exp.train's config overrides
(`group=option`, `a.b=value`, composed and checked by Hydra) besides their own keys; exp.evaluate, exp.generate,
exp.merge, exp.report and exp.bench take their own keys, and pass on the dotted keys they name (`data.<field>=` to the
run's data config, exp overrides to exp.bench's exp side). `-h`/`--help` prints the tool's keys; `-v`/`--verbose` is
`verbose=true`. Anything else is refused with one paragraph that names the argument and the fix, exit status 2.
No argparse: its `--flag value` style is the one exp does not use, and its messages name neither keys nor fixes.
"""

from __future__ import annotations

import difflib
import errno
import math
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from exp.core.config import ConfigError, config_key

USAGE_EXIT = 2
HELP_FLAGS = ("-h", "--help")
VERBOSE_FLAGS = ("-v", "--verbose")
WIDTH = 118  # the help's line length, as the code's
VERBOSE_HELP = "also show third-party logs and progress bars (transformers, Lightning, W&B); -v is the same"
KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number"}  # what a bad value was expected to be


class UsageError(ConfigError):
    """An argument the tool does not take: exit status 2, like every configuration error."""


@dataclass(frozen=True)
class Key:
    """One `name=value` argument of a tool. The default's type types the value (`kind` where the default is None
    or a list)."""

    name: str
    default: Any
    help: str
    kind: type = str
    choices: tuple[str, ...] = ()
    many: bool = False  # a list: the key may be repeated, and (with `split`) a value may be comma-separated
    split: bool = True
    hidden: bool = False  # internal (a worker process's argument): not in --help
    placeholder: str = ""  # what --help shows after `name=` (default: from the type)
    # Bounds of a number (`above`: strictly greater); a float is always finite. `name_only`: a file name the tool
    # writes inside a directory of its own choosing, so no '/'.
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    name_only: bool = False

    @property
    def type(self) -> type:
        return self.kind if self.default is None or self.many else type(self.default)

    @property
    def metavar(self) -> str:
        if self.placeholder:
            return self.placeholder
        if self.choices:
            return "|".join(self.choices)
        names = {bool: "true|false", int: "N", float: "X"}
        return names.get(self.type, "TEXT") + (",..." if self.many and self.split else "")


@dataclass(frozen=True)
class Tool:
    """A command: its name, what it does (the module docstring) and its keys.

    `passes(key)`: keys passed on untouched (their help line is `passes_help`); `hydra`: those are exp.train config
    overrides, so `~key` deletions pass too; `positional`: what a bare word is (exp.report's directories).
    """

    name: str
    doc: str
    keys: tuple[Key, ...] = ()
    passes: Callable[[str], bool] = field(default=lambda key: False)
    passes_help: tuple[str, str] | None = None
    hydra: bool = False
    positional: str = ""

    def key(self, name: str) -> Key | None:
        return next((k for k in self.keys if k.name == name), None)


@dataclass
class Parsed:
    values: dict[str, Any]  # every key of the tool, typed (the default where not given)
    passed: list[str]  # the `key=value` arguments passed on, in order
    positional: list[str]


def dotted(key: str) -> bool:
    """A config override's key (`hardware.loss_impl`), as opposed to a tool's own."""
    return "." in key.lstrip("+~")


def help_text(tool: Tool) -> str:
    usage = f"usage: python -m {tool.name}" + (f" [{tool.positional} ...]" if tool.positional else "")
    usage += " [key=value ...]" + (" [-v]" if tool.hydra or tool.key("verbose") else "")
    rows = [
        (f"{k.name}={k.metavar}", k.help + (f" [default: {_shown(k.default)}]" if k.default not in (None, []) else ""))
        for k in tool.keys
        if not k.hidden
    ]
    if tool.passes_help:
        rows.append(tool.passes_help)
    if tool.hydra:
        rows += [
            ("group=option", "any config override of exp.train: pick a config option (model=gemma_7b, hardware=gpu)"),
            ("a.b=value", "... or set a field (lora.r=16, data.path=my.jsonl); python -m exp.train --help lists them"),
            ("verbose=true", VERBOSE_HELP),
        ]
    rows.append(("-h, --help", "this text"))
    width = max(len(r[0]) for r in rows) + 2
    lines = [usage, "", tool.doc.strip(), "", "Arguments:"]
    for name, text in rows:
        wrapped = textwrap.wrap(text, WIDTH - width - 2) or [""]
        lines += [f"  {name.ljust(width)}{wrapped[0]}", *(" " * (width + 2) + w for w in wrapped[1:])]
    return "\n".join(lines)


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return str(value) if value != "" else '""'


def parse(tool: Tool, argv: list[str]) -> Parsed:
    """The tool's arguments, typed; `-h`/`--help` prints the help and exits 0. Raises UsageError (one paragraph
    naming the argument and the fix) for anything the tool does not take."""
    if any(a in HELP_FLAGS for a in argv):
        print(help_text(tool))
        raise SystemExit(0)
    values = {k.name: list(k.default) if k.many else k.default for k in tool.keys}
    given: set[str] = set()
    passed: list[str] = []
    positional: list[str] = []
    for i, arg in enumerate(argv):
        if arg in VERBOSE_FLAGS and (tool.hydra or tool.key("verbose")):
            arg = "verbose=true"
        key, sep, value = arg.partition("=")
        if arg.startswith("-"):
            flag = unknown_flag(tool.name, arg, flag_value(argv, i), lambda k: _key_for(tool, k))
            raise UsageError(f"{flag} {_keys_hint(tool)}")
        if not sep or not key:
            if tool.positional:
                positional.append(arg)
                continue
            if tool.hydra and arg.startswith("~"):
                passed.append(arg)
                continue
            raise UsageError(not_key_value(tool.name, arg, tool))
        own = tool.key(key)
        if own is None:
            if tool.hydra or tool.passes(key):
                passed.append(arg)
                continue
            raise UsageError(unknown_key(tool, key, arg))
        typed = [_typed(tool.name, own, v) for v in (value.split(",") if own.many and own.split else [value])]
        if own.many:
            values[key] = (values[key] if key in given else []) + typed
        else:
            values[key] = typed[0]
        given.add(key)
    return Parsed(values, passed, positional)


def _typed(tool: str, key: Key, value: str) -> Any:
    kind = key.type
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        typed = kind(value)
    except ValueError:
        example = _shown(key.default) if key.default not in (None, "", []) else {int: "1", float: "0.5"}.get(kind, "x")
        raise UsageError(
            f"{tool}: {key.name}={value}: expected {KIND_NAMES.get(kind, 'text')} "
            f"({key.help}). Fix: e.g. {key.name}={example.split(',')[0]}."
        ) from None
    if key.choices and typed not in key.choices:
        raise UsageError(
            f"{tool}: {key.name}={value}: not one of {', '.join(key.choices)}. Fix: e.g. {key.name}={key.choices[0]}."
        )
    if problem := _out_of_bounds(key, typed):
        example = _shown(key.default) if key.default not in (None, "", []) else "..."
        raise UsageError(f"{tool}: {key.name}={value}: {problem} ({key.help}). Fix: e.g. {key.name}={example}.")
    return typed


def _out_of_bounds(key: Key, typed: Any) -> str:
    """What is wrong with a value of the right type ('' when nothing)."""
    if isinstance(typed, float) and not math.isfinite(typed):
        return "expected a finite number"
    if isinstance(typed, (int, float)) and not isinstance(typed, bool):
        if key.at_least is not None and typed < key.at_least:
            return f"must be at least {key.at_least:g}"
        if key.above is not None and typed <= key.above:
            return f"must be greater than {key.above:g}"
        if key.at_most is not None and typed > key.at_most:
            return f"must be at most {key.at_most:g}"
    if key.name_only and isinstance(typed, str) and ("/" in typed or typed in (".", "..") or "\0" in typed):
        return "a name, not a path (no '/'): the tool chooses the directory it goes into"
    return ""


def _key_for(tool: Tool, name: str) -> str | None:
    if tool.key(name) and not tool.key(name).hidden:
        return name
    if tool.hydra:
        return config_key(name)
    return None


def _keys_hint(tool: Tool) -> str:
    names = [k.name for k in tool.keys if not k.hidden]
    text = f"Its keys: {', '.join(names)}" if names else "It has no keys of its own"
    if tool.passes_help:
        text += f", and {tool.passes_help[0]}"
    if tool.hydra:
        text += ", and any exp.train config override (group=option, a.b=value)"
    return text + f". python -m {tool.name} --help says what each one does."


def unknown_flag(name: str, arg: str, following: str | None, key_for: Callable[[str], str | None]) -> str:
    """The paragraph for a `--flag`: exp tools take `key=value`, so name the key the flag most likely meant
    (`key_for("max_steps")` -> "trainer.max_steps", or None)."""
    flag, sep, value = arg.lstrip("-").partition("=")
    key = key_for(flag.replace("-", "_")) if arg.startswith("--") and flag else None  # `-x`: nothing to go on
    if not sep:
        value = following if following is not None and "=" not in following and not following.startswith("-") else ""
    fix = f": write {key}={value or '...'}" if key else ""
    return (
        f"{name}: unknown option '{arg}'. exp's tools take key=value arguments, not --options{fix} (only -h/--help "
        "and -v/--verbose are flags)."
    )


def flag_value(argv: list[str], i: int) -> str | None:
    """The argument after `argv[i]` when it reads as that flag's value (`--out dir`): not reported on its own."""
    nxt = argv[i + 1] if i + 1 < len(argv) else None
    return nxt if nxt is not None and "=" not in nxt and not nxt.startswith("-") and "=" not in argv[i] else None


def not_key_value(name: str, arg: str, tool: Tool | None = None) -> str:
    text = f"{name}: argument '{arg}' is not key=value. Give each argument as key=value (e.g. {_example(tool)})."
    return text + (" " + _keys_hint(tool) if tool else "")


def _example(tool: Tool | None) -> str:
    if tool is None or tool.hydra:
        return "model=gemma_7b or lora.r=16"
    key = next((k for k in tool.keys if not k.hidden), None)
    return f"{key.name}={_shown(key.default) if key.default not in (None, '', []) else '...'}" if key else "key=value"


def unknown_key(tool: Tool, key: str, arg: str) -> str:
    names = [k.name for k in tool.keys if not k.hidden]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" Did you mean {close[0]}=...?" if close else ""
    return f"{tool.name}: unknown key '{key}' (in '{arg}').{hint} {_keys_hint(tool)}"


def run_tool(tool: Tool, body: Callable[[Parsed], int | None], argv: list[str] | None = None) -> int:
    """Parse, run `body`, and turn a ConfigError into one `exp: error: ...` paragraph with exit status 2."""
    try:
        return body(parse(tool, sys.argv[1:] if argv is None else argv)) or 0
    except ConfigError as e:
        print(f"exp: error: {e}", file=sys.stderr)
        return USAGE_EXIT
    except OSError as e:
        if (message := os_error_message(tool.name, e)) is None:
            raise
        print(f"exp: error: {message}", file=sys.stderr)
        return USAGE_EXIT


# The file-system errors that are the machine's or the argument's, not exp's: each gets one paragraph.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: `ulimit -f` (Python ignores SIGXFSZ, so write fails)


def os_error_message(name: str, e: OSError) -> str | None:
    """The paragraph for an OSError that bad input or a full disk raises (None: a bug, to be raised as it is)."""
    path = e.filename or "the output directory"
    if e.errno in NO_SPACE:
        return (
            f"{name}: no space left on {path} ({e.strerror}: the disk is full, a quota or `ulimit -f` is reached). "
            "Files exp replaces are written whole, so what was there before is intact. Fix: free space (or raise the "
            "limit), or write elsewhere, then run the command again."
        )
    if e.errno == errno.ENAMETOOLONG:
        return (
            f"{name}: {path}: a file name longer than the file system allows ({e.strerror}). Fix: a shorter name "
            "(at most 255 bytes per path component)."
        )
    if e.errno in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
        return (
            f"{name}: {path}: {e.strerror} (a file stands where a directory is needed, or a directory where a file "
            "is). Fix: name another path."
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{name}: {path}: {e.strerror}. Fix: name a path you can write, or fix its permissions."
    return None
