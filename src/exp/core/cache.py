"""Entries of exp's cache (random-weight models, tokenised datasets): built once, verified on every use.

An entry is a directory built by one process in a temporary directory of its own (`.<name>.<host>.<pid>.partial`)
and renamed into place when complete, with a manifest of every file's size and sha256 (`MANIFEST`). Every process
that uses an entry checks it against the manifest first (once per process): an entry that was truncated (a full
disk), altered, or left without a manifest is reported by name and rebuilt. A build killed before its rename
leaves its temporary directory behind; the next build of that entry on the same host removes the ones whose process
is gone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "exp_entry.json"
_verified: set[Path] = set()  # entries this process has checked: a run opens its model entry more than once


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def entry_problem(entry: Path) -> str | None:
    """Why `entry` cannot be used as it is (None: intact)."""
    if not entry.is_dir():
        return "missing"
    try:
        files = json.loads((entry / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST} (an entry from an earlier exp, or one written only in part)"
    for name, expected in files.items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{name} has {path.stat().st_size} bytes, {expected['size']} were written"
        if file_sha256(path) != expected["sha256"]:
            return f"{name} does not match the sha256 written with it"
    return None


def _write_manifest(directory: Path) -> None:
    files = {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


def _partial_prefix(entry: Path) -> str:
    return f".{entry.name}.{socket.gethostname()}."


def _remove_abandoned(entry: Path) -> None:
    """Temporary directories of builds of `entry` on this host whose process no longer runs."""
    prefix = _partial_prefix(entry)
    for path in entry.parent.glob(f"{prefix}*"):
        pid = path.name[len(prefix) :].split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            log.info("cache: removing %s, left by a build that did not finish", path)
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _discard(entry: Path, reason: str, what: str) -> None:
    log.warning("cache: %s %s is damaged (%s); rebuilding it", what, entry, reason)
    aside = entry.with_name(f"{_partial_prefix(entry)}{os.getpid()}.damaged")
    try:
        entry.rename(aside)  # atomic: a process opening the entry now sees it whole or not at all
    except OSError:  # another process moved it first
        return
    shutil.rmtree(aside, ignore_errors=True)


def ensure_entry(entry: Path, build: Callable[[Path], None], what: str) -> Path:
    """`entry`, verified; built by `build(<temporary directory>)` when missing, rebuilt when damaged."""
    if entry in _verified:
        return entry
    problem = entry_problem(entry)
    if problem is None:
        _verified.add(entry)
        return entry
    if problem != "missing":
        _discard(entry, problem, what)
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(entry)
    tmp = entry.with_name(f"{_partial_prefix(entry)}{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build(tmp)
        _write_manifest(tmp)
        try:
            tmp.rename(entry)
        except OSError:  # another process finished the same entry first: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if (problem := entry_problem(entry)) is not None:
        raise RuntimeError(f"cache: {what} {entry} was just built but fails its check ({problem})")
    _verified.add(entry)
    return entry


def cache_dir() -> Path:
    """Where exp keeps what it builds once (random-weight models, tokenizers, tokenised datasets): $EXP_CACHE, else
    ~/.cache/exp."""
    return Path(os.environ.get("EXP_CACHE", Path.home() / ".cache" / "exp")).expanduser()
