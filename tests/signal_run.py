"""`python -m exp.train` held at one moment of its start, for tests/test_signals.py to send it a signal there.

Usage: python signal_run.py <point> <marker dir> <exp.train arguments...>

At <point> the process touches `<marker dir>/reached` and waits until `<marker dir>/go` exists, doing nothing else:
the test sends its signal once `reached` appears, then creates `go`. Whatever the signal does (stop the process
there, or be noted and acted on later) happens while the run is inside that moment, as if the work took long.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def hold(marker: Path) -> None:
    (marker / "reached").touch()
    while not (marker / "go").exists():
        time.sleep(0.01)


def wrap(owner, name: str, marker: Path) -> None:
    original = getattr(owner, name)

    def held(*args, **kwargs):
        hold(marker)
        return original(*args, **kwargs)

    setattr(owner, name, held)


def install(point: str, marker: Path) -> None:
    import exp.run.security
    import exp.train

    points = {
        "before-run-dir": lambda: wrap(exp.train, "check_command_line", marker),
        "hydra-start": lambda: wrap(exp.run.security.RunRecord, "on_job_start", marker),
    }
    points[point]()


if __name__ == "__main__":
    install(sys.argv[1], Path(sys.argv[2]))
    sys.argv = ["exp.train", *sys.argv[3:]]
    from exp.train import cli

    cli()
