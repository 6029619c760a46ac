"""Local data files: found, checked before `datasets` reads them, and diagnosed when it cannot.

`datasets` reads JSON, JSONL, CSV and Parquet into Arrow, and when a file is not what it expects it fails with an
error that names neither the file nor the line (a UTF-16 file, one broken JSONL line, a directory whose files have
different columns). The checks here read every file once, in chunks (a file of any size costs one pass and no
more than a chunk of memory): a text file must be UTF-8 (a UTF-8 byte-order mark is fine) and hold no NUL byte, a
Parquet file must carry Parquet's magic bytes, and at least one file must hold something. When `datasets` still
fails, `diagnose` reads the files again, line by line, to say which file and which line.
"""

from __future__ import annotations

import codecs
import csv
import difflib
import io
import json
import re
from pathlib import Path
from typing import Any

from exp.core.config import ConfigError, DataConfig
from exp.data.formats import field_key, required_columns

# `datasets` builders by file suffix.
READERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
CHUNK = 1 << 20
BOMS = {
    codecs.BOM_UTF32_LE: "UTF-32",  # before UTF-16: its BOM starts with UTF-16's
    codecs.BOM_UTF32_BE: "UTF-32",
    codecs.BOM_UTF16_LE: "UTF-16",
    codecs.BOM_UTF16_BE: "UTF-16",
}
PARQUET_MAGIC = b"PAR1"
JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}


def list_files(path_str: str, key: str) -> list[Path]:
    """The data files `key` names (a file, or the supported files of a directory, hidden ones skipped), checked."""
    path = Path(path_str).expanduser()
    if not path.exists():
        raise ConfigError(missing_path(path_str, key, path))
    if not (path.is_dir() or path.is_file()):  # a FIFO or a device would block the reader, or never end
        raise ConfigError(
            f"{key}={path_str}: not a regular file or a directory (a pipe, a socket or a device). Point {key} at a "
            "data file (.json, .jsonl, .csv, .parquet) or a directory of them."
        )
    if path.is_dir():
        # Hidden files are an editor's or an OS's (`._data.jsonl` from macOS holds binary metadata), not data.
        files = sorted(p for p in path.iterdir() if p.suffix in READERS and not p.name.startswith(".") and p.is_file())
    else:
        files = [path]
    if not files:
        raise ConfigError(f"{key}={path_str}: the directory holds no {', '.join(READERS)} file")
    kinds = {READERS.get(f.suffix) for f in files}
    if None in kinds:
        raise ConfigError(
            f"{key}={path_str}: unsupported file type '{path.suffix}'; use one of {', '.join(READERS)} "
            "(or convert it, e.g. to JSONL)"
        )
    if len(kinds) > 1:
        raise ConfigError(f"{key}={path_str}: mixes file types {sorted(kinds)}; keep one type per directory")
    empty = []
    for f in files:
        try:
            if not check_file(f, key):
                empty.append(f.name)
        except OSError as e:  # unreadable: permissions, a file removed meanwhile, an I/O error
            raise ConfigError(
                f"{key}: {f} cannot be read ({e.strerror or e}); check the file and its permissions"
            ) from None
    for f in files:
        if f.suffix == ".json" and (problem := _one_object_file(f)):
            raise ConfigError(f"{key}: {f}: {problem}")
    if len(empty) == len(files):
        raise ConfigError(f"{key}={path_str}: the data is empty ({', '.join(empty)}); point {key} at examples")
    return files


def missing_path(path_str: str, key: str, path: Path) -> str:
    """The paragraph for a data path that does not exist, with the nearest name in its directory when one is close."""
    names = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else []
    close = difflib.get_close_matches(path.name, names, n=1)
    hint = f" Did you mean {key}={path.parent / close[0] if path_str != path.name else close[0]}?" if close else ""
    return (
        f"{key}={path_str}: no such file or directory.{hint} Relative paths are resolved against the directory "
        "exp.train was launched from; pass an absolute path or launch from the data's parent directory."
    )


def missing_columns(cfg: DataConfig, name: str, columns: list[str]) -> str | None:
    """The paragraph for data without the columns `data.format` reads (as mapped by `data.<name>_field`)."""
    missing = [c for c in required_columns(cfg) if c not in columns]
    if not missing:
        return None
    fixes = ", ".join(f"{field_key(cfg, c)}=<column>" for c in missing)
    return (
        f"{name}: no column {', '.join(repr(c) for c in missing)} (needed by data.format={cfg.format.value}); the "
        f"data has columns {columns}. Map yours with e.g. {fixes}, or pick the data.format that matches the file."
    )


def early_problems(cfg: DataConfig, launch_dir: Path) -> list[str]:
    """What can be said of data.path / data.val_path before anything heavy loads (exp.run.overrides runs this before
    Hydra starts, so a typo costs no torch import): a path that does not exist, and a JSONL or CSV file whose first
    row lacks a column the format reads. The full checks (`list_files`, the reader) run later all the same."""
    problems = []
    for key in ("data.path", "data.val_path"):
        path_str = getattr(cfg, key.split(".")[1])
        if not path_str:
            continue
        path = Path(path_str).expanduser()
        path = path if path.is_absolute() else launch_dir / path
        if not path.exists():
            problems.append(missing_path(path_str, key, path))
        elif path.is_file() and (columns := _first_row_columns(path)) is not None:
            if problem := missing_columns(cfg, str(path), columns):
                problems.append(problem)
    return problems


def _first_row_columns(path: Path) -> list[str] | None:
    """The columns of a JSONL or CSV file's first row (None: another kind of file, or one its reader will judge)."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            if path.suffix == ".csv":
                return next(csv.reader(f), None)
            if path.suffix == ".jsonl":
                line = next((line for line in f if line.strip()), "")
                row = json.loads(line) if line else None
                return list(row) if isinstance(row, dict) else None
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON: list_files and the reader say which
        return None
    return None


def check_file(path: Path, key: str) -> bool:
    """Whether `path` holds anything; a file `datasets` could not decode is refused, naming the place and the fix."""
    if path.suffix == ".parquet":
        return _check_parquet(path, key)
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = lines = 0  # bytes and line breaks before the current chunk
    content = False
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            if offset == 0:
                _check_start(path, key, chunk)
                if chunk.startswith(codecs.BOM_UTF8):  # the readers skip a UTF-8 byte-order mark
                    offset, chunk = len(codecs.BOM_UTF8), chunk[len(codecs.BOM_UTF8) :]
            if (nul := chunk.find(b"\0")) >= 0:
                line = lines + chunk.count(b"\n", 0, nul) + 1
                raise ConfigError(
                    f"{key}: {path} holds binary data (a NUL byte on line {line}, byte {offset + nul}), not "
                    f"{path.suffix[1:].upper()} text. Point {key} at the data file itself, or convert the data to "
                    "UTF-8 text (JSONL: one JSON object per line)."
                )
            try:
                text = decoder.decode(chunk)
            except UnicodeDecodeError as e:
                line = lines + chunk.count(b"\n", 0, e.start) + 1
                raise ConfigError(
                    f"{key}: {path} is not UTF-8: line {line} (byte {offset + e.start}) holds the byte "
                    f"0x{chunk[e.start]:02x}, which UTF-8 does not allow there. Save the file as UTF-8, e.g. "
                    f"`iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}` (latin1 / cp1252: Western Windows "
                    "exports; use the encoding it was written in)."
                ) from None
            content = content or (bool(text) and not text.isspace())
            offset += len(chunk)
            lines += chunk.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ConfigError(
            f"{key}: {path} is not UTF-8: it ends in the middle of a character (truncated?). Save it again as UTF-8 "
            "text."
        ) from None
    return content


def _check_start(path: Path, key: str, head: bytes) -> None:
    for bom, encoding in BOMS.items():
        if head.startswith(bom):
            raise ConfigError(
                f"{key}: {path} is {encoding} text (it starts with a {encoding} byte-order mark); the readers take "
                f"UTF-8. Convert it, e.g. `iconv -f {encoding} -t UTF-8 {path.name} > utf8-{path.name}`, or save it "
                "as UTF-8 from the program that wrote it."
            )


def _check_parquet(path: Path, key: str) -> bool:
    size = path.stat().st_size
    if size == 0:
        return False
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, size - 4))
        tail = f.read(4)
    if head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
        raise ConfigError(
            f"{key}: {path} is not a Parquet file (it does not start and end with Parquet's magic bytes 'PAR1': "
            "truncated, or another format named .parquet). Write it again, or give it the suffix of its format."
        )
    return True


# ------------------------------------------------------------------------------------------------ diagnosis


def diagnose(files: list[Path], key: str) -> str | None:
    """What is wrong with files `datasets` could not read: a line that is not JSON or not an object, a value whose
    type differs from the column's earlier rows, a CSV row with the wrong number of fields, or files with different
    columns. None when nothing is found (the reader's own error is then all there is)."""
    columns: dict[Path, list[str]] = {}
    for path in files:
        reader = {".csv": _csv_columns, ".parquet": _parquet_columns}.get(path.suffix, _json_columns)
        found = reader(path)
        if isinstance(found, str):
            return f"{key}: {path}: {found}"
        columns[path] = found
    if len({tuple(sorted(c)) for c in columns.values()}) > 1:
        listing = "; ".join(f"{p.name}: {', '.join(c)}" for p, c in columns.items())
        return (
            f"{key}: the files have different columns ({listing}). One directory is one dataset: keep files with "
            f"the same columns together, or point {key} at one file."
        )
    return None


def _json_columns(path: Path) -> list[str] | str:
    """The columns of a JSON / JSONL file in order of appearance, or what is wrong with it."""
    with open(path, encoding="utf-8-sig") as f:
        start = f.read(CHUNK).lstrip()[:1]
        f.seek(0)
        if start == "[":
            text = f.read()
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                if _cut_short(e):
                    return truncated(path, e.lineno, f"column {e.colno}: {e.msg}")
                return f"not valid JSON: line {e.lineno}, column {e.colno}: {e.msg}"
            numbered = [(f"item {i}", row) for i, row in enumerate(rows)]
        else:
            numbered = _jsonl_rows(f, path)
            if isinstance(numbered, str):
                return _one_object(path) or numbered
    kinds: dict[str, str] = {}  # column -> the JSON type of its first non-null value
    order: dict[str, None] = {}
    for where, row in numbered:
        if not isinstance(row, dict):
            return f'{where} is {_json_type(row)}, not an object ({{"column": value, ...}})'
        for column, value in row.items():
            order.setdefault(column)
            if value is None:
                continue
            kind = _json_type(value)
            if kinds.setdefault(column, kind) != kind:
                return (
                    f"{where}: column '{column}' is {kind}, where earlier rows have {kinds[column]}; a column holds "
                    "one type (text fields: strings)"
                )
    return list(order)


def _one_object_file(path: Path) -> str | None:
    """A .json file that is one pretty-printed object (`datasets` would read it as one row whose columns are its
    keys): what is wrong with it, or None. Only a file whose first line is not a whole JSON object is parsed."""
    with open(path, encoding="utf-8-sig") as f:
        head = f.read(CHUNK)
    line = head.lstrip().split("\n", 1)[0]
    if not line.startswith("{") or len(line) == len(head.lstrip()) == CHUNK:
        return None
    try:
        json.loads(line)
        return None  # JSON lines in a .json file
    except ValueError:
        return _one_object(path)


def _one_object(path: Path) -> str | None:
    """A file that is one (pretty-printed) JSON object rather than rows: what is wrong with it, or None."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            whole = json.load(f)
    except (ValueError, OSError):
        return None
    if not isinstance(whole, dict):
        return None
    lists = [k for k, v in whole.items() if isinstance(v, list)]
    where = f" (the rows may be its '{lists[0]}' list: save that list as the file)" if lists else ""
    return (
        f"it holds one JSON object, not rows{where}; a data file is a JSON array of objects, or JSONL: one object "
        "per line"
    )


def _jsonl_rows(f: io.TextIOBase, path: Path) -> list[tuple[str, Any]] | str:
    rows = []
    for number, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            rows.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as e:
            if _cut_short(e) and not any(rest.strip() for rest in f):  # the last line, and it ends mid-record
                return truncated(path, number, f"column {e.colno}: {e.msg}")
            return f"line {number} is not valid JSON (column {e.colno}: {e.msg}); JSONL holds one JSON object per line"
    return rows


# What is left of a number or of true / false / null that a file ends inside of ("-", "1.", "1e-", "tr", "nul").
CUT_VALUE = re.compile(r"-?\d*\.?\d*(?:[eE][-+]?\d*)?|t(?:r(?:ue?)?)?|f(?:a(?:l(?:se?)?)?)?|n(?:u(?:ll?)?)?")


def _cut_short(e: json.JSONDecodeError) -> bool:
    """Whether JSON failed to parse because its text ended inside a value: nothing but the start of a value (or
    nothing at all) follows the place of the error, or a string is still open at the end (a `\\u` escape too)."""
    rest = e.doc[e.pos :].strip()
    if e.msg.startswith("Invalid \\uXXXX escape"):
        return bool(re.fullmatch(r"u[0-9a-fA-F]{0,4}", rest))  # json (C) says so of a whole escape at the end
    return e.msg.startswith("Unterminated string") or bool(CUT_VALUE.fullmatch(rest))


def truncated(path: Path, line: int, detail: str) -> str:
    """The paragraph's end for a JSON / JSONL file that stops in the middle of its last record."""
    return (
        f"it ends in the middle of a record (line {line}, {detail}): the file looks truncated, a copy cut short or a "
        "file whose writer stopped or ran out of disk space. Copy it again from its source, after checking the free "
        f"space where it is written (df -h {path.parent})."
    )


def _json_type(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return JSON_TYPES.get(type(value), type(value).__name__)


def _csv_columns(path: Path) -> list[str] | str:
    with open(path, encoding="utf-8-sig", newline="") as f:
        # Strict: a quoted field still open at the end of the file is an error, not a field running to the end.
        reader = csv.reader(f, strict=True)
        try:
            header = next(reader, [])
            for row in reader:
                if row and len(row) != len(header):
                    return (
                        f"line {reader.line_num} has {len(row)} fields, the header {len(header)} "
                        f"({', '.join(header)}); quote fields that contain commas or line breaks"
                    )
        except csv.Error as e:
            if "unexpected end of data" in str(e):
                return truncated(path, reader.line_num, "a quoted field is still open at the end of the file")
            return f'line {reader.line_num}: {e}; a field that holds a quote is quoted and doubles it ("")'
    return header


def _parquet_columns(path: Path) -> list[str] | str:
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path).names
    except Exception as e:  # noqa: BLE001 (pyarrow's errors for damaged files vary)
        return f"its Parquet metadata cannot be read ({type(e).__name__}: {e})"
