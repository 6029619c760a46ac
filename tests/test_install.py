"""The README's install path: `make train` installs exp without the dev extra, `make test` with it, each once per
Python environment until pyproject.toml or constraints/ change; what the README's commands write is git-ignored."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_installs_what_each_command_needs_once(tmp_path):
    """A copy of the Makefile and what it reads, run with a Python that records `-m ...` calls instead of running
    them (the environment probe runs on this Python)."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path)
    shutil.copytree(ROOT / "constraints", tmp_path / "constraints")
    (tmp_path / "src" / "exp").mkdir(parents=True)
    (tmp_path / "src" / "exp" / "__init__.py").touch()
    calls = tmp_path / "calls.log"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ "$1" = "-m" ] && echo "$*" >> {calls} && exit 0\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)

    def make(target: str, here: bool = True) -> list[str]:
        calls.write_text("")
        # Not the settings of a `make test` this suite may run under (make passes them on in MAKEFLAGS).
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        env["PYTHONPATH"] = str(tmp_path / "src") if here else ""
        proc = subprocess.run(
            ["make", "-s", target, f"PYTHON={python}", "ARGS="], cwd=tmp_path, env=env, capture_output=True
        )
        assert proc.returncode == 0, proc.stderr.decode()
        return [line.split(" -c ")[0] for line in calls.read_text().splitlines()]

    assert make("train") == ["-m pip install -q -e .", "-m exp.train"]  # no dev extra
    assert make("train") == ["-m exp.train"]  # installed: not again
    assert make("test") == ["-m pip install -q -e .[dev]", "-m pytest"]
    assert make("train") == ["-m exp.train"]  # the dev install holds what training needs
    later = (tmp_path / "pyproject.toml").stat().st_mtime + 10
    os.utime(tmp_path / "pyproject.toml", (later, later))
    assert make("train") == ["-m pip install -q -e .", "-m exp.train"]  # the dependencies may have changed
    # This environment's `exp` is another checkout's: installed again, whatever the stamps say.
    assert make("train", here=False) == ["-m pip install -q -e .", "-m exp.train"]


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="needs a git checkout")
def test_what_the_readme_commands_write_is_git_ignored():
    written = ["outputs/x", "multirun/x", "merged/config.json", ".venv/bin/python", ".cache/make/x/train"]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.split() == written
