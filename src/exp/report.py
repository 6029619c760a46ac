"""`python -m exp.report <sweep dir or run dirs> [out=DIR] [metric=val/loss]`: one table and plots for a study.

Reads only what every run leaves on disk (status.json, summary.json, csv/metrics.csv, .hydra/overrides.yaml), so it
works while a sweep is running (unfinished jobs show as `running`, or `interrupted` once no process runs them) and
after jobs failed (`failed` with the error).
Writes report.md, report.csv and PNG plots (loss curves of all jobs; the metric against each swept parameter) into
the sweep or run directory it is given, or `out=` (required for several paths): never the current directory.

Seeds: jobs that differ only in their seed (`seeds=N`, or trainer.seed swept) are repeats of one configuration.
Each configuration gets the mean, standard deviation and 95% interval of its final metric over its seeds, and a
mark where it differs from the best by more than the seed noise (exp.study.stats says which test);
configurations.csv holds the same, loss_curves_by_config.png the mean training loss with a band of one standard
deviation. A sweep launched by `hydra/launcher=gpus` also gets its plan compared with what happened
(placements.jsonl: estimated memory and time per job, and the study's wall-clock).

Preference runs (`objective=dpo|orpo|simpo|kto`): the table adds their final held-out preference accuracy, reward
margin, rewards of chosen and rejected, and the completions' log-probabilities; the configurations' table adds the
accuracy's and the margin's mean and standard deviation over the seeds. `metric=val/accuracy` (or a margin or a
reward) ranks with higher as better.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from exp.core.cli import Key, Parsed, Tool, run_tool
from exp.core.config import ConfigError
from exp.run.dirs import RunLayout, read_status, run_state, runs_under
from exp.run.overrides import SEED_KEYS
from exp.study.journal import last_launch
from exp.study.stats import TEST_NAME, ConfigStats, config_groups, rank, swept_keys

# A preference run's held-out metrics the job table shows beside the optimised one (docs/objectives.md).
PREFERENCE_METRICS = (
    "val/accuracy",
    "val/rewards/margin",
    "val/rewards/chosen",
    "val/rewards/rejected",
    "val/logps/chosen",
    "val/logps/rejected",
)
# Of those, what the configurations' table summarises over seeds.
PREFERENCE_SEED_METRICS = ("val/accuracy", "val/rewards/margin")
# Metrics where more is better (the rest, losses and perplexities, are minimised).
HIGHER_IS_BETTER = ("accuracy", "exact_match", "rewards/margin", "rewards/chosen")


def higher_is_better(metric: str) -> bool:
    return metric.split("/", 1)[-1] in HIGHER_IS_BETTER


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
        Key(
            "metric",
            "val/loss",
            "the optimised metric (lower is better; higher for accuracies, reward margins and rewards)",
        ),
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
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, val/loss)
    has_csv: bool = False  # csv/metrics.csv exists
    log_every: int | None = None  # trainer.log_every_n_steps of the run's config.yaml
    validated_on: str | None = None  # what its val/* metrics were measured on (summary.json's data.validated_on)
    damaged: list[str] = field(default_factory=list)  # its files that could not be read, and why
    preference: dict[str, float] = field(default_factory=dict)  # final PREFERENCE_METRICS (preference runs)


def find_runs(paths: list[Path]) -> list[tuple[Path, str]]:
    """Each run directory `paths` name or hold (a sweep's jobs, nested ones too: exp.run.dirs.runs_under), with its
    name in the report: its path under the directory given."""
    runs = []
    for p in paths:
        if RunLayout(p).is_run():
            runs.append((p, p.name))
        elif p.is_dir():
            runs += [(r, r.relative_to(p).as_posix()) for r in runs_under(p)]
    return runs


def _overrides(run: Path) -> dict[str, str]:
    path = RunLayout(run).hydra / "overrides.yaml"  # every attempt of a sweep job holds its own record
    if not path.exists():
        return {}
    from omegaconf import OmegaConf

    pairs = [str(o).split("=", 1) for o in OmegaConf.load(path)]
    return {k.lstrip("+~"): v for k, v in (p for p in pairs if len(p) == 2) if not k.startswith("hydra.")}


def read_run(run: Path, metric: str, name: str | None = None) -> JobRow:
    """What a job's files say, the row named `name` (default: the directory's name). A file that cannot be read (cut
    short, overwritten, not text) is named in `damaged` and the row keeps what the others hold: one bad job never
    hides the rest of a study."""
    row = JobRow(name or run.name, run, run_state(run))
    layout = RunLayout(run)

    def part(path: Path, read: Callable[[], object]) -> None:
        try:
            read()
        except Exception as e:  # JSON, YAML, CSV, UTF-8 or file-system errors: what a damaged file raises
            first = (str(e).strip().splitlines() or [""])[0][:160]
            row.damaged.append(f"{path.relative_to(run)} ({type(e).__name__}: {first})")

    def status() -> None:
        row.error = read_status(run).get("error", "")

    def overrides() -> None:
        row.overrides = _overrides(run)

    def log_every() -> None:
        row.log_every = _log_every(run)

    part(layout.status, status)
    part(layout.hydra / "overrides.yaml", overrides)
    part(layout.config, log_every)
    row.has_csv = layout.metrics.exists()
    if row.has_csv:
        part(layout.metrics, lambda: _read_metrics(row, layout.metrics, metric))
    if layout.summary.exists():
        part(layout.summary, lambda: _read_summary(row, layout.summary, metric))
    return row


def _read_metrics(row: JobRow, path: Path, metric: str) -> None:
    values: list[float] = []
    try:
        with path.open() as f:
            for r in csv.DictReader(f):
                if r.get(metric):
                    values.append(float(r[metric]))
                if r.get("train/loss"):
                    row.curve.append((int(r["step"]), float(r["train/loss"])))
                if r.get("val/loss"):
                    row.val_curve.append((int(r["step"]), float(r["val/loss"])))
                row.preference |= {k: float(r[k]) for k in PREFERENCE_METRICS if r.get(k)}
    finally:  # the rows before a damaged one still count
        if values:
            row.best, row.final = (max if higher_is_better(metric) else min)(values), values[-1]


def _read_summary(row: JobRow, path: Path, metric: str) -> None:
    s = json.loads(path.read_text())
    row.final = s["final_val"].get(metric, row.final)
    row.preference |= {k: v for k, v in s["final_val"].items() if k in PREFERENCE_METRICS}
    row.steps, row.seconds = s.get("steps"), s.get("seconds")
    row.tokens_per_s, row.peak_memory_gib = s.get("tokens_per_s_median"), s.get("peak_memory_gib")
    row.validated_on = (s.get("data") or {}).get("validated_on")


def _log_every(run: Path) -> int | None:
    """trainer.log_every_n_steps as the run recorded it (config.yaml), to say why a curve is missing."""
    path = RunLayout(run).config
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    value = OmegaConf.select(OmegaConf.load(path), "trainer.log_every_n_steps")
    return value if isinstance(value, int) else None


def missing_curves(rows: list[JobRow]) -> list[str]:
    """Why a job has no line in the loss plots: one note per job without a train/loss row."""
    notes = []
    for r in rows:
        if r.curve:
            continue
        if not r.has_csv:
            why = "no csv/metrics.csv (logger=none, or it stopped before its first logged metric)"
        elif r.status in ("running", "interrupted") or not r.steps:
            why = "no training step logged yet"
        elif r.log_every and r.steps < r.log_every:
            why = (
                f"no train/loss row in csv/metrics.csv: {r.steps} steps, fewer than trainer.log_every_n_steps="
                f"{r.log_every}, and no row for the final step"
            )
        else:
            why = "no train/loss row in csv/metrics.csv"
        notes.append(f"no loss curve for {r.name}: {why}")
    return notes


def validation_notes(rows: list[JobRow]) -> list[str]:
    """What the jobs' validation metrics were measured on (one line when they all share it)."""
    sources = {r.validated_on for r in rows if r.validated_on}
    if len(sources) == 1:
        return [f"val/* measured on: {sources.pop()}"]
    return [f"val/* of {r.name} measured on: {r.validated_on}" for r in rows if r.validated_on]


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def preference_columns(rows: list[JobRow], metric: str, among: tuple[str, ...] = PREFERENCE_METRICS) -> list[str]:
    """The preference metrics some job has, less the optimised one (its own columns)."""
    return [k for k in among if k != metric and any(k in r.preference for r in rows)]


def table(rows: list[JobRow], metric: str) -> tuple[list[str], list[list[str]]]:
    swept = swept_keys(rows)
    extra = preference_columns(rows, metric)
    header = ["job", "status", *swept, f"final {metric}", f"best {metric}", *extra]
    header += ["steps", "seconds", "tokens/s", "peak GiB"]
    body = [
        [
            _job_label(r.name) if swept else r.name,
            r.status,
            *(r.overrides.get(k, "") for k in swept),
            _fmt(r.final),
            _fmt(r.best),
            *(_fmt(r.preference.get(k)) for k in extra),
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


def sort_rows(rows: list[JobRow], metric: str = "val/loss") -> list[JobRow]:
    """Completed jobs by the metric (the best first), then running, then failed."""
    order = {"completed": 0, "running": 1, "interrupted": 1}
    sign = -1 if higher_is_better(metric) else 1
    return sorted(
        rows, key=lambda r: (order.get(r.status, 2), sign * r.final if r.final is not None else math.inf, r.name)
    )


def plot(rows: list[JobRow], metric: str, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    written = []
    swept = swept_keys(rows)
    for attr, name, title in (
        ("curve", "train/loss", "training loss per job"),
        ("val_curve", "val/loss", "validation loss per job"),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for r in rows:
            if curve := getattr(r, attr):
                # A curve of one or two points (a run shorter than its logging interval) would be an invisible line.
                marker = "o" if len(curve) < 3 else None
                ax.plot(*zip(*curve, strict=True), marker=marker, label=curve_label(r, swept))
        ax.set(xlabel="step", ylabel=name, title=title)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            _say_empty(ax, missing_curves(rows) if attr == "curve" else ["no validation-loss points"])
        path = out / ("loss_curves.png" if attr == "curve" else "val_loss_curves.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    done = [r for r in rows if r.final is not None]
    for key in [k for k in swept_keys(rows) if k not in SEED_KEYS]:  # a seed is no parameter to plot against
        points = [(r.overrides.get(key), r.final) for r in done if key in r.overrides]
        try:
            xs = [float(x) for x, _ in points]
        except (TypeError, ValueError):  # categorical values: one position per distinct value
            labels = sorted({str(x) for x, _ in points})
            xs = [labels.index(str(x)) for x, _ in points]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter(xs, [y for _, y in points])
        ax.set(xlabel=key, ylabel=f"final {metric}", title=f"{metric} vs {key}")
        if log_axis(key, xs):
            ax.set_xscale("log")
        name = out / f"{metric.replace('/', '_')}_vs_{key.replace('/', '_')}.png"
        fig.savefig(name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(name)
    return written


def curve_label(row: JobRow, swept: list[str]) -> str:
    """A curve's legend entry: the job, the values it was run with, its status (`3 lora.r=8 (completed)`)."""
    values = " ".join(f"{k}={row.overrides[k]}" for k in swept if k in row.overrides)
    return f"{_job_label(row.name) if swept else row.name}{' ' + values if values else ''} ({row.status})"


def log_axis(key: str, xs: list[float]) -> bool:
    """Learning rates (and other positive values spanning 10x or more) are compared on a log axis."""
    positive = bool(xs) and all(isinstance(x, float) and x > 0 for x in xs)
    return positive and ("learning_rate" in key or key.endswith(".lr") or max(xs) / min(xs) >= 10)


def _say_empty(ax, notes: list[str]) -> None:
    """An empty plot says why it is empty, in the figure itself."""
    import textwrap

    text = "\n".join(textwrap.fill(n, 80) for n in notes[:6]) or "no training-loss points"
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=8)


def config_table(groups: dict[str, list[JobRow]], metric: str) -> tuple[list[str], list[list[str]], list[str]]:
    """Header, rows (best first) and the lines that say what the marks mean."""
    stats = [ConfigStats(label, [r.final for r in rs if r.final is not None]) for label, rs in groups.items()]
    if not stats:
        return [], [], []
    extra = preference_columns([r for rs in groups.values() for r in rs], metric, PREFERENCE_SEED_METRICS)
    header = ["configuration", "seeds", f"mean {metric}", "std", "95% interval", "vs best", "p (Holm)"]
    header += [f"{k} mean ± sd" for k in extra]
    body = []
    for ranked in rank(stats, higher_is_better(metric)):
        st, interval = ranked.stats, ranked.stats.interval
        jobs = groups[st.config]
        body.append(
            [
                st.config,
                str(st.n),
                f"{st.mean:.4g}",
                _fmt(st.std),
                f"[{interval[0]:.4g}, {interval[1]:.4g}]" if interval else "-",
                ranked.verdict,
                "-" if ranked.p_holm is None else f"{ranked.p_holm:.3g}",
                *(_mean_sd([r.preference[k] for r in jobs if k in r.preference]) for k in extra),
            ]
        )
    notes = []
    if all(st.n < 2 for st in stats):
        notes.append(
            "one seed per configuration: no standard deviation, interval or test (the seed noise cannot be measured "
            "from one run; repeat every configuration with seeds=N)"
        )
    else:
        notes.append(f"differs / within noise: {TEST_NAME}; 95% interval: Student's t over the seeds")
        if any(st.n < 2 for st in stats):
            notes.append("untested: a configuration with one completed seed has no spread to test against")
    return header, body, notes


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    st = ConfigStats("", values)
    return f"{st.mean:.4g}" + (f" ± {st.std:.2g}" if st.std is not None else "")


def plot_configs(groups: dict[str, list[JobRow]], out: Path) -> Path:
    """Mean training loss per configuration over its seeds, with a band of +-1 standard deviation."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rs in sorted(groups.items()):
        curves = [dict(r.curve) for r in rs if r.curve]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        values = np.array([[c[s] for s in steps] for c in curves])
        mean = values.mean(axis=0)
        marker = "o" if len(steps) < 3 else None
        (line,) = ax.plot(steps, mean, marker=marker, label=f"{label} (n={len(curves)})")
        if len(curves) > 1:
            std = values.std(axis=0, ddof=1)
            ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.25)
    one = all(len(rs) < 2 for rs in groups.values())
    title = "training loss per configuration" + (" (one seed each: no band)" if one else ", mean ± 1 sd over seeds")
    ax.set(xlabel="step", ylabel="train/loss", title=title)
    if ax.lines:
        ax.legend(fontsize=7)
    else:
        _say_empty(ax, missing_curves([r for rs in groups.values() for r in rs]))
    path = out / "loss_curves_by_config.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def plan_comparison(sweep_dir: Path) -> list[str]:
    """The last launch's plan (placements.jsonl, written by hydra/launcher=gpus) against what happened."""
    if (launch := last_launch(sweep_dir)) is None:
        return []
    plan, starts, ends = launch.plan, launch.starts, launch.ends
    lines = [
        f"plan vs what happened (placements.jsonl, launch {plan.get('launch')}, {plan.get('launcher')} on "
        f"{', '.join(f'{g}: {m} GiB' for g, m in plan.get('gpus', {}).items())}):"
    ]
    header = ["job", "GPU", "est. GiB", "est. allocated", "peak GiB", "est. s", "actual s", "status"]
    rows = []
    for job in plan.get("jobs", []):
        if not job.get("runs"):
            continue
        end, start = ends.get(job["job"], {}), starts.get(job["job"], {})
        rows.append(
            [
                _job_label(job["job"]),
                str(start.get("gpu", "-")),
                _fmt(job.get("estimate_gib")),
                _fmt(job.get("estimate_allocated_gib")),
                _fmt(end.get("peak_gib")),
                _fmt(job.get("job_s")),
                _fmt(end.get("seconds")),
                str(end.get("status", "not ended")),
            ]
        )
    if rows:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lo, hi = plan.get("wall_clock_s") or [None, None]
    actual = launch.wall_clock_s
    unknown = len(plan.get("without_time") or [])
    if unknown or lo is None:
        estimate = f"unknown ({unknown} job(s) without a recorded throughput)"
    else:
        estimate = f"{lo:.0f} to {hi:.0f} s" if hi != lo else f"{lo:.0f} s"
    lines.append(f"  wall-clock: estimated {estimate}; actual {_fmt(actual)} s")
    lines.append(
        "  peak GiB is torch.cuda.max_memory_allocated (compare with est. allocated; est. GiB adds the CUDA context "
        "and allocator slack); '-' on the CPU"
    )
    for b in launch.backoffs:
        lines.append(
            f"  back-off: GPU {b['gpu']} after {_job_label(b['job'])} ran out of memory: {b['capacity_before_gib']} -> "
            f"{b['capacity_after_gib']} GiB"
        )
    return lines


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
    rows = sort_rows([read_run(r, metric, name) for r, name in runs], metric)
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
    damaged = [
        f"damaged {r.name}: {'; '.join(r.damaged)}; its row shows what its other files hold" for r in rows if r.damaged
    ]
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(b) + " |" for b in body]
    if labels := damaged + validation_notes(rows) + missing_curves(rows):
        print("\n".join(labels))
        md += ["", *(f"- {line}" for line in labels)]
    with (out / "report.csv").open("w", newline="") as f:
        csv.writer(f).writerows([header, *body])
    groups = config_groups(rows)
    c_header, c_body, notes = config_table(groups, metric)
    if c_body:
        print()
        widths = [max(len(h), *(len(b[i]) for b in c_body)) for i, h in enumerate(c_header)]
        print("  ".join(h.ljust(w) for h, w in zip(c_header, widths, strict=True)))
        for b in c_body:
            print("  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)))
        for note in notes:
            print(note)
        md += ["", "| " + " | ".join(c_header) + " |", "|" + "---|" * len(c_header)]
        md += ["| " + " | ".join(b) + " |" for b in c_body] + [""] + notes
        with (out / "configurations.csv").open("w", newline="") as f:
            csv.writer(f).writerows([c_header, *c_body])
    comparison = [line for p in paths for line in plan_comparison(p)]
    if comparison:
        print()
        print("\n".join(comparison))
        md += ["", "```", *comparison, "```"]
    (out / "report.md").write_text("\n".join(md) + "\n")
    for png in plot(rows, metric, out):
        print(f"wrote {png}")
    if groups:
        print(f"wrote {plot_configs(groups, out)}")
    print(f"wrote {out / 'report.md'} and {out / 'report.csv'}" + (" and configurations.csv" if c_body else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
