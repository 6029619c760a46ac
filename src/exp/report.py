"""`python -m exp.report <sweep dir or run dirs> [out=DIR] [metric=val/loss]`: one table and plots for a study.

Reads only what every run leaves on disk (status.json, summary.json, csv/metrics.csv, .hydra/overrides.yaml), so it
works while a sweep is running (unfinished jobs show as `running`, or `interrupted` once no process runs them) and
after jobs failed (`failed` with the error).
Writes report.md, report.csv and PNG plots (loss curves of all jobs; the metric against each swept parameter) into
the sweep or run directory it is given, or `out=` (required for several paths): never the current directory.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from exp.core.cli import Key, Parsed, Tool, run_tool
from exp.core.config import ConfigError
from exp.run.dirs import RunLayout, read_status, run_state

TOOL = Tool(
    "exp.report",
    __doc__,
    (
        Key(
            "out",
            None,
            "where report.md, report.csv and the plots go [default: the sweep directory]",
            placeholder="DIR",
        ),
        Key("metric", "val/loss", "the optimised metric (lower is better)"),
    ),
    positional="DIR",
)


@dataclass
class JobRow:
    name: str
    path: Path
    status: str
    overrides: dict[str, str] = field(default_factory=dict)
    final: float | None = None  # the optimised metric at the end of the run
    best: float | None = None  # its best value over all evaluations
    steps: int | None = None
    seconds: float | None = None
    tokens_per_s: float | None = None
    peak_memory_gib: float | None = None
    error: str = ""
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, train/loss)


def find_runs(paths: list[Path]) -> list[Path]:
    runs = []
    for p in paths:
        if RunLayout(p).is_run():
            runs.append(p)
        elif p.is_dir():
            runs += sorted(c for c in p.iterdir() if c.is_dir() and RunLayout(c).is_run())
    return runs


def _overrides(run: Path) -> dict[str, str]:
    path = RunLayout(run).hydra / "overrides.yaml"  # every attempt of a sweep job holds its own record
    if not path.exists():
        return {}
    from omegaconf import OmegaConf

    pairs = [str(o).split("=", 1) for o in OmegaConf.load(path)]
    return {k.lstrip("+~"): v for k, v in (p for p in pairs if len(p) == 2) if not k.startswith("hydra.")}


def read_run(run: Path, metric: str) -> JobRow:
    status = read_status(run)
    row = JobRow(run.name, run, run_state(run), _overrides(run), error=status.get("error", ""))
    metrics_csv = RunLayout(run).metrics
    if metrics_csv.exists():
        values = []
        for r in csv.DictReader(metrics_csv.open()):
            if r.get(metric):
                values.append(float(r[metric]))
            if r.get("train/loss"):
                row.curve.append((int(r["step"]), float(r["train/loss"])))
        if values:
            row.best, row.final = min(values), values[-1]
    summary_path = RunLayout(run).summary
    if summary_path.exists():
        s = json.loads(summary_path.read_text())
        row.final = s["final_val"].get(metric, row.final)
        row.steps, row.seconds = s.get("steps"), s.get("seconds")
        row.tokens_per_s, row.peak_memory_gib = s.get("tokens_per_s_median"), s.get("peak_memory_gib")
    return row


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def swept_keys(rows: list[JobRow]) -> list[str]:
    """Override keys whose value differs between jobs: the study's parameters."""
    known = [r for r in rows if r.overrides]
    return sorted({k for r in known for k in r.overrides if len({x.overrides.get(k) for x in known}) > 1})


def table(rows: list[JobRow], metric: str) -> tuple[list[str], list[list[str]]]:
    swept = swept_keys(rows)
    header = ["job", "status", *swept, f"final {metric}", f"best {metric}", "steps", "seconds", "tokens/s", "peak GiB"]
    body = [
        [
            _job_label(r.name) if swept else r.name,
            r.status,
            *(r.overrides.get(k, "") for k in swept),
            _fmt(r.final),
            _fmt(r.best),
            _fmt(r.steps),
            _fmt(r.seconds),
            _fmt(r.tokens_per_s),
            _fmt(r.peak_memory_gib),
        ]
        for r in rows
    ]
    return header, body


def _job_label(name: str) -> str:
    """`3_lora.r=8,...` -> `3`; a re-launched attempt `3_lora.r=8,..._1` -> `3 (retry 1)`."""
    retry = re.search(r"_(\d+)$", name)
    return name.split("_", 1)[0] + (f" (retry {retry.group(1)})" if retry and name.count("_") > 1 else "")


def sort_rows(rows: list[JobRow]) -> list[JobRow]:
    """Completed jobs by the metric (lower first), then running, then failed."""
    order = {"completed": 0, "running": 1, "interrupted": 1}
    return sorted(rows, key=lambda r: (order.get(r.status, 2), r.final if r.final is not None else math.inf, r.name))


def plot(rows: list[JobRow], metric: str, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        if r.curve:
            ax.plot(*zip(*r.curve, strict=True), label=f"{_job_label(r.name)} ({r.status})")
    ax.set(xlabel="step", ylabel="train/loss", title="training loss per job")
    if ax.lines:
        ax.legend(fontsize=7)
    fig.savefig(out / "loss_curves.png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    written.append(out / "loss_curves.png")
    done = [r for r in rows if r.final is not None]
    for key in swept_keys(rows):
        points = [(r.overrides.get(key), r.final) for r in done if key in r.overrides]
        try:
            xs = [float(x) for x, _ in points]
        except (TypeError, ValueError):  # categorical values: one position per distinct value
            labels = sorted({str(x) for x, _ in points})
            xs = [labels.index(str(x)) for x, _ in points]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter(xs, [y for _, y in points])
        ax.set(xlabel=key, ylabel=f"final {metric}", title=f"{metric} vs {key}")
        name = out / f"{metric.replace('/', '_')}_vs_{key.replace('/', '_')}.png"
        fig.savefig(name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(name)
    return written


def main(argv: list[str] | None = None) -> int:
    return run_tool(TOOL, _report, argv)


def _report(args: Parsed) -> int:
    paths = [Path(p) for p in args.positional]
    if not paths:
        raise ConfigError(
            "exp.report: name a sweep directory or run directories, e.g. python -m exp.report multirun/<date>/<time>"
        )
    missing = [str(x) for x in paths if not x.exists()]
    if missing:
        raise ConfigError(f"no such directory: {', '.join(missing)}")
    metric = args.values["metric"]
    runs = find_runs(paths)
    if not runs:
        raise ConfigError(f"no run directories (with status.json or .hydra/) under {', '.join(map(str, paths))}")
    if not args.values["out"] and len(paths) > 1:
        raise ConfigError(
            f"{len(paths)} paths and no out=: the report of one sweep or run goes into its directory, and several "
            "have no directory of their own. Fix: say where it goes, e.g. out=outputs/comparison."
        )
    rows = sort_rows([read_run(r, metric) for r in runs])
    # Never the current directory: a report lands beside what it reports on.
    out = Path(args.values["out"]) if args.values["out"] else paths[0]
    out.mkdir(parents=True, exist_ok=True)
    header, body = table(rows, metric)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for b in body:
        print("  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)))
    for r in rows:
        if r.status == "failed":
            print(f"failed {r.name}: {r.error.splitlines()[0] if r.error else ''}")
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(b) + " |" for b in body]
    (out / "report.md").write_text("\n".join(md) + "\n")
    with (out / "report.csv").open("w", newline="") as f:
        csv.writer(f).writerows([header, *body])
    for png in plot(rows, metric, out):
        print(f"wrote {png}")
    print(f"wrote {out / 'report.md'} and {out / 'report.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
