"""A study's plan before anything runs: `python -m exp.train -m ... --plan`.

For every job of the sweep: whether it runs or reuses a completed attempt, its memory as its preflight will
resolve it (exp.study.cost), its time per step and in all from recorded throughput; then how the launcher
would place the jobs (exp.study.placement.simulate, the launcher's own packer) and the study's wall-clock. Nothing
is written or started. The `gpus` launcher makes the same plan when it launches and records it in the sweep
directory (`placements.jsonl`), where `python -m exp.report` compares it with what happened.

The wall-clock is given as a range, because jobs sharing a GPU slow each other by an amount no record holds: from
"jobs on one GPU do not slow each other" (each job alone leaves most of the GPU idle) to "they share its compute
evenly" (each job alone keeps it busy). The report shows where the study landed.
"""

from __future__ import annotations

import copy
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict, read_write

from exp.core.config import Accelerator, ConfigError, TrainConfig
from exp.core.secrets import mask_secrets
from exp.hardware.memory import GiB
from exp.hardware.preflight import PREFLIGHT_EXIT, Gpu, gpu_memory, visible_gpus
from exp.run.compose import config_dict, to_typed
from exp.run.overrides import config_loader
from exp.study.cost import (
    DEFAULT_HEADROOM,
    MemoryDemand,
    StepRecord,
    TimeEstimate,
    estimate_time,
    find_records,
    resolve_alone,
)
from exp.study.cost import memory_demand as job_memory
from exp.study.grouping import group_jobs, shared_config, split_group, with_micro_batch
from exp.study.placement import JobDemand, Simulation, simulate
from exp.study.records import SweepConflict, earlier_result, job_name

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
GPU_LAUNCHER = "hydra_plugins.exp_gpu_launcher.launcher.GpuPoolLauncher"
SEQUENTIAL = "this machine"  # the one slot of Hydra's basic launcher


@dataclass
class PlannedJob:
    num: int
    name: str  # the job's directory under the sweep
    overrides: list[str]
    cfg: TrainConfig | None = None  # None: the config fails its checks (`error`)
    error: str = ""
    reuse: str | None = None  # a completed attempt with this config: nothing to run
    memory: MemoryDemand | None = None
    time: TimeEstimate | None = None

    @property
    def runs(self) -> bool:
        return self.cfg is not None and self.reuse is None


@dataclass
class Pool:
    """Where the launcher puts jobs."""

    kind: str  # "sequential" (Hydra's basic launcher), "gpus" (one job per GPU), "packed" (by memory)
    capacities: dict[str, int]  # device -> memory the launcher may fill (free at launch)
    gpu: Gpu | None  # the GPU the jobs' choices are resolved against (the smallest named); None: none known
    headroom: float = DEFAULT_HEADROOM
    where: str = ""  # where the memory figures come from

    @property
    def max_jobs_per_gpu(self) -> int | None:
        return None if self.kind == "packed" else 1


@dataclass
class PlannedGroup:
    """Jobs that train together over one base (`hydra.launcher.share_base=true`, exp.study.grouping), or one job
    that runs alone (`reason`: why it could not join a group; None for a group of one that had no partner)."""

    name: str
    jobs: list[PlannedJob]
    memory: MemoryDemand | None = None  # the group's: one base, every job's rows of a step
    reason: str | None = None

    @property
    def shared(self) -> bool:
        return len(self.jobs) > 1


@dataclass
class StudyPlan:
    pool: Pool
    jobs: list[PlannedJob]
    best: Simulation
    worst: Simulation
    unknown_time: list[str] = field(default_factory=list)  # jobs to run without a recorded throughput
    groups: list[PlannedGroup] | None = None  # share_base: what the launcher starts, a process per group

    def demands(self) -> list[JobDemand]:
        return packer_demands(self.jobs, self.pool, self.groups)


def build_pool(kind: str, devices: list[str], memory_gib: list[float], headroom: float) -> tuple[Pool, str]:
    """The launcher's devices with their memory: `memory_gib` when given (one figure per device), else what NVML
    reports free now. The second value is a problem, for a packed pool whose memory cannot be known."""
    if kind == "sequential":
        smi = gpu_memory()
        gpu = Gpu(smi[0].name, smi[0].total_bytes, smi[0].free_bytes, smi[0].capability) if smi else None
        return Pool(kind, {SEQUENTIAL: 1 << 62}, gpu, headroom, "one job at a time"), ""
    if memory_gib:
        if len(memory_gib) != len(devices):
            return Pool(kind, {}, None, headroom), (
                f"hydra.launcher.memory_gib={list(memory_gib)} names {len(memory_gib)} figure(s) for "
                f"{len(devices)} device(s) ({','.join(devices)}): give one GiB figure per device, e.g. "
                f"hydra.launcher.memory_gib=[{','.join(['80'] * len(devices))}], or leave it empty to read the "
                "free memory from nvidia-smi."
            )
        caps = {d: int(float(m) * GiB) for d, m in zip(devices, memory_gib, strict=True)}
        smallest = min(caps.values())
        gpu = Gpu("hydra.launcher.memory_gib", smallest, smallest, (9, 0))
        return Pool(kind, caps, gpu, headroom, "hydra.launcher.memory_gib"), ""
    smi = {g.index: g for g in gpu_memory()} | {g.uuid: g for g in gpu_memory()}
    known = {d: smi[d] for d in devices if d in smi}
    if len(known) < len(devices):
        if kind == "packed":
            missing = ",".join(d for d in devices if d not in known)
            return Pool(kind, {}, None, headroom), (
                f"hydra.launcher.pack=true places jobs by each GPU's free memory, and nvidia-smi reports none for "
                f"device(s) {missing} (no NVIDIA driver, or ids it does not list). Nothing was run or written. Fix: "
                "name the GPUs as nvidia-smi lists them (index or UUID) in hydra.launcher.devices, or give each "
                "one's memory with hydra.launcher.memory_gib=[...] (GiB, one per device)."
            )
        return Pool(kind, dict.fromkeys(devices, 1 << 62), None, headroom, "one job per GPU"), ""
    small = min(known.values(), key=lambda g: g.total_bytes)
    gpu = Gpu(small.name, small.total_bytes, small.free_bytes, small.capability)
    return Pool(kind, {d: g.free_bytes for d, g in known.items()}, gpu, headroom, "free memory (nvidia-smi)"), ""


def packer_demands(jobs: list[PlannedJob], pool: Pool, groups: list[PlannedGroup] | None = None) -> list[JobDemand]:
    """What the packer counts per job to run (per group, with share_base): the reservation when packing, nothing
    otherwise (one per GPU)."""
    if groups is not None:
        return [JobDemand(g.name, g.memory.reserve_bytes if pool.kind == "packed" and g.memory else 0) for g in groups]
    return [
        JobDemand(j.name, j.memory.reserve_bytes if pool.kind == "packed" and j.memory else 0) for j in jobs if j.runs
    ]


def plan_groups(jobs: list[PlannedJob], pool: Pool, records: list[StepRecord]) -> list[PlannedGroup]:
    """The runnable jobs grouped by what their base depends on (exp.study.grouping), each group's memory estimated
    on its shape; a group whose reservation no GPU holds (or that the preflight would refuse) is halved until its
    parts fit, down to single jobs."""
    runnable = [j for j in jobs if j.runs]
    found = group_jobs(runnable, cfg_of=lambda j: j.cfg, name_of=lambda j: j.name)
    largest = max(pool.capacities.values(), default=0)
    out: list[PlannedGroup] = []
    todo = list(found)
    while todo:
        g = todo.pop(0)
        members: list[PlannedJob] = list(g.members)
        if len(members) == 1:
            out.append(PlannedGroup(members[0].name, members, members[0].memory, g.reason))
            continue
        try:
            cfgs = [j.cfg for j in members]
            alone = resolve_alone(cfgs[0], pool.gpu).cfg.hardware
            shared = shared_config(with_micro_batch(cfgs, alone.micro_batch_size, alone.micro_batch_tokens))
            memory = job_memory(shared, pool.gpu, pool.headroom, records)
        except ConfigError:
            memory = None
        too_big = (
            memory is None or bool(memory.problem) or (pool.kind != "sequential" and memory.reserve_bytes > largest)
        )
        if too_big:
            first, second = split_group(g)
            todo[:0] = [first, second]
            continue
        out.append(PlannedGroup(g.name, members, memory))
    return out


def estimate_jobs(jobs: list[PlannedJob], pool: Pool, records: list[StepRecord], share_base: bool = False) -> StudyPlan:
    """Each job's memory and time, and the launch simulated with the launcher's packer (`share_base`: of the
    groups sharing one base, exp.study.grouping)."""
    device = pool.gpu.name if pool.gpu is not None else "cpu"
    for job in jobs:
        if not job.runs:
            continue
        assert job.cfg is not None
        try:
            job.memory = job_memory(job.cfg, pool.gpu, pool.headroom, records)
        except ConfigError as e:  # what the estimate refuses (a LoRA target the family lacks): this job fails alone
            job.cfg, job.error = None, str(e)
            continue
        on = "cpu" if job.cfg.hardware.accelerator == Accelerator.cpu else device
        job.time = estimate_time(job.cfg, on, records)
    unknown = [j.name for j in jobs if j.runs and (j.time is None or j.time.job_s is None)]
    # Without a time for every job the placement is still worth showing (which jobs share a GPU, in what order),
    # so the packer is run on jobs of equal length, and the plan gives no wall-clock.
    seconds = {j.name: 1.0 if unknown else float(j.time.job_s) for j in jobs if j.runs and j.time is not None}
    groups = plan_groups(jobs, pool, records) if share_base else None
    if groups is not None:
        # A group's time is counted as its jobs' times together: the same tokens go through the GPU, and no record
        # yet tells how much sharing the base saves.
        seconds = {g.name: sum(seconds.get(j.name, 0.0) for j in g.jobs) for g in groups}
    demands = packer_demands(jobs, pool, groups)
    kwargs: dict[str, Any] = {"max_jobs_per_gpu": pool.max_jobs_per_gpu}
    best = simulate(pool.capacities, demands, seconds, **kwargs)
    worst = simulate(pool.capacities, demands, seconds, shared_compute=True, **kwargs)
    return StudyPlan(pool, jobs, best, worst, unknown, groups)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _short(name: str) -> str:
    """A job's number, as the placement lines name it; a group's is its first job's and the count of the others
    (exp.study.grouping.Group.name: 0+3)."""
    others = re.search(r"\+\d+$", name)
    return name.split("_", 1)[0] + (others.group() if others else "")


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}" if x < 10 else f"{x:.0f}"


def format_plan(plan: StudyPlan) -> str:
    pool, jobs = plan.pool, plan.jobs
    to_run = [j for j in jobs if j.runs]
    where = {
        "sequential": "one after the other on this machine (Hydra's basic launcher)",
        "gpus": f"one job per GPU on {len(pool.capacities)} GPU(s): {', '.join(pool.capacities)}",
        "packed": f"packed by memory on {len(pool.capacities)} GPU(s) ("
        + ", ".join(f"{d}: {c / GiB:.1f} GiB" for d, c in pool.capacities.items())
        + f", from {pool.where}); reservation = estimate + {pool.headroom:.0%}",
    }[pool.kind]
    lines = [
        f"study plan: {len(jobs)} job(s), {len(to_run)} to run, {sum(1 for j in jobs if j.reuse)} reused, "
        f"{sum(1 for j in jobs if j.cfg is None)} failing their config checks; {where}"
    ]
    if pool.gpu is not None:
        lines.append(
            f"memory resolved as each job's preflight would on {pool.gpu.name} ({pool.gpu.total_bytes / GiB:.1f} GiB)"
        )
    header = ["job", "estimate GiB", "reserve GiB", "budget GiB", "resolves to", "s/step", "job s", "time from"]
    rows = []
    for j in jobs:
        if j.reuse:
            rows.append([j.name, "-", "-", "-", f"reused: {Path(j.reuse).name}", "-", "0", "-"])
        elif j.cfg is None:
            rows.append([j.name, "-", "-", "-", f"fails: {j.error.splitlines()[-1].strip()}", "-", "-", "-"])
        else:
            m, t = j.memory, j.time
            assert m is not None and t is not None
            budget = "-" if m.budget_gib is None else f"{m.budget_gib:g}"
            what = m.choices + (f" (preflight: {m.problem})" if m.problem else "")
            if m.measured_from:
                what += f"; reserve from the peak measured in {Path(m.measured_from).name}"
            rows.append(
                [
                    j.name,
                    _gib(m.estimate_bytes),
                    _gib(m.reserve_bytes),
                    budget,
                    what,
                    _s(t.step_s),
                    _s(t.job_s),
                    t.source,
                ]
            )
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if plan.groups is not None:
        lines.append("groups sharing one base (hydra.launcher.share_base=true), a process each:")
        for g in plan.groups:
            if g.shared:
                m = g.memory
                assert m is not None
                lines.append(
                    f"  jobs {', '.join(_short(j.name) for j in g.jobs)}: one base, estimate {_gib(m.estimate_bytes)} "
                    f"GiB, reserve {_gib(m.reserve_bytes)} GiB (all {len(g.jobs)} jobs' rows together: {m.choices})"
                )
            else:
                why = f": {g.reason}" if g.reason else " (no other job shares its base)"
                lines.append(f"  job {_short(g.name)}: alone{why}")
    timed = not plan.unknown_time
    lines.append(
        "placement (simulated with the launcher's packer; "
        + (
            "times as if jobs on one GPU do not slow each other):"
            if timed
            else "no recorded time for every job, so as if all took equally long; [n]: the n-th start):"
        )
    )
    for gpu in pool.capacities:
        on = [s for s in plan.best.jobs if s.gpu == gpu]
        if on:
            starts = sorted({s.start_s for s in on})
            spans = ", ".join(
                f"{_short(s.job)} "
                + (f"[{s.start_s:.0f}-{s.end_s:.0f} s]" if timed else f"[{starts.index(s.start_s) + 1}]")
                for s in on
            )
            most = max(1, *(sum(1 for o in on if o.start_s <= s.start_s < o.end_s) for s in on))
            lines.append(f"  {gpu}: {spans}; at most {most} at once")
    for name in plan.best.rejected:
        lines.append(
            f"  {name}: fits no GPU (its reservation exceeds every GPU's memory): it would be recorded as failed"
        )
    lo, hi = plan.best.makespan_s, plan.worst.makespan_s
    if timed:
        span = (
            f"{lo:.0f} s"
            if abs(hi - lo) < 1
            else f"{lo:.0f} s (jobs on a GPU do not slow each other) to {hi:.0f} s (they share its compute evenly)"
        )
        lines.append(f"estimated wall-clock: {span}")
    else:
        lines.append(
            f"estimated wall-clock: unknown, {len(plan.unknown_time)} job(s) without a recorded throughput "
            f"({', '.join(n.split('_', 1)[0] for n in plan.unknown_time)}); a completed run of the same model on the "
            "same device (in the sweep directory, outputs/ or multirun/) or an exp.bench result gives one"
        )
    return "\n".join(lines)


def plan_record(plan: StudyPlan) -> dict[str, Any]:
    """The plan as the launcher records it (one line of placements.jsonl)."""
    jobs = []
    for j in plan.jobs:
        row: dict[str, Any] = {"job": j.name, "runs": j.runs, "reuse": j.reuse, "error": j.error or None}
        if j.memory is not None:
            m = j.memory
            row.update(
                estimate_gib=round(m.estimate_bytes / GiB, 3),
                estimate_allocated_gib=round(m.allocated_bytes / GiB, 3),
                reserve_gib=round(m.reserve_bytes / GiB, 3),
                budget_gib=m.budget_gib,
                resolves_to=m.choices,
                reserve_from=m.measured_from or "estimate",
            )
        if j.time is not None:
            row.update(step_s=j.time.step_s, job_s=j.time.job_s, time_from=j.time.source)
        jobs.append(row)
    groups = None
    if plan.groups is not None:
        groups = [
            {
                "group": g.name,
                "jobs": [j.name for j in g.jobs],
                "estimate_gib": round(g.memory.estimate_bytes / GiB, 3) if g.shared and g.memory else None,
                "reserve_gib": round(g.memory.reserve_bytes / GiB, 3) if g.shared and g.memory else None,
                "alone": g.reason,
            }
            for g in plan.groups
        ]
    return {
        "event": "plan",
        "launcher": plan.pool.kind,
        "groups": groups,
        "gpus": {d: round(c / GiB, 2) for d, c in plan.pool.capacities.items()},
        "memory_from": plan.pool.where,
        "headroom": plan.pool.headroom,
        "jobs": jobs,
        "wall_clock_s": None
        if plan.unknown_time
        else [round(plan.best.makespan_s, 1), round(plan.worst.makespan_s, 1)],
        "without_time": plan.unknown_time,
    }


# --- `python -m exp.train -m ... --plan` ---------------------------------------------------------------------


def job_configs(master: Any, loader: Any, job_overrides: list[list[str]], initial: int = 0) -> list[tuple]:
    """(number, overrides, Hydra's job config, its directory) per job, composed as the launchers compose them."""
    out = []
    sweep_dir = Path(str(master.hydra.sweep.dir))
    for i, overrides in enumerate(job_overrides):
        num = initial + i
        job_cfg = loader.load_sweep_config(master, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.num = num
        sub = OmegaConf.select(job_cfg, "hydra.sweep.subdir", throw_on_missing=False)
        out.append((num, list(overrides), job_cfg, sweep_dir / str(sub if sub is not None else num)))
    return out


def planned_job(num: int, overrides: list[str], job_cfg: Any, job_dir: Path, launch_dir: Path) -> PlannedJob:
    """The typed config of one job and the attempt it would reuse; SweepConflict as a launch would raise it."""
    task = copy.deepcopy(job_cfg)
    with read_write(task), open_dict(task):
        sweep_dir = Path(str(task.hydra.sweep.dir))
        del task["hydra"]
    try:
        cfg = to_typed(task, launch_dir)
    except ConfigError as e:
        return PlannedJob(num, job_name(job_dir, sweep_dir), overrides, error=str(e))
    reuse = earlier_result(job_dir, config_dict(cfg), sweep_dir)
    return PlannedJob(num, job_name(job_dir, sweep_dir), overrides, cfg, reuse=str(reuse) if reuse else None)


def sweep_overrides(master: Any, loader: Any) -> list[list[str]]:
    """The jobs' overrides, as Hydra's basic sweeper expands them (grid sweeps)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    # Read unresolved, as Hydra hands them to its sweeper: an override's own interpolation (`seeds=N` adds
    # lora.init_seed=${trainer.seed}) is each job's to resolve, not the master config's.
    params = OmegaConf.to_container(master.hydra.sweeper.get("params") or OmegaConf.create({}), resolve=False)
    task = OmegaConf.to_container(master.hydra.overrides.task, resolve=False)
    arguments = [f"{k}={v}" for k, v in params.items()] + list(task)
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
    return BasicSweeper.split_arguments(parsed, None)[0]


def print_plan(argv: list[str], caller: str, config_path: str, config_name: str) -> int:
    """The `--plan` of exp.train: the plan of the launch these arguments would make. Exit status 0, or 2 / 3 as
    the launch would stop."""
    from hydra._internal.utils import get_args_parser
    from hydra.types import RunMode

    args, _ = get_args_parser().parse_known_args(argv)
    loader = config_loader(args, caller, config_path)
    mode = RunMode.MULTIRUN if args.multirun else RunMode.RUN
    master = loader.load_configuration(
        config_name=args.config_name or config_name, overrides=args.overrides, run_mode=mode, from_shell=True
    )
    if mode == RunMode.MULTIRUN:
        target = str(master.hydra.sweeper.get("_target_"))
        if target != BASIC_SWEEPER:
            print(
                f"exp: error: --plan lists a sweep's jobs before they run, and hydra/sweeper={target.rsplit('.', 1)[-1]} "
                "draws each trial from the results of the trials before it, so its jobs are not known in advance. "
                "Fix: plan a grid of the same settings with Hydra's basic sweeper (key=a,b,c on the command line), "
                "or run the study without --plan.",
                file=sys.stderr,
            )
            return 2
        overrides = sweep_overrides(master, loader)
    else:
        overrides = [list(args.overrides)]
    try:
        jobs = [planned_job(*job, Path.cwd()) for job in job_configs(master, loader, overrides)]
    except SweepConflict as e:
        print(f"exp: error: {mask_secrets(str(e))}", file=sys.stderr)
        return 2
    launcher = master.hydra.launcher
    share_base = False
    if str(launcher.get("_target_")) == GPU_LAUNCHER:
        share_base = bool(launcher.get("share_base"))
        kind = "packed" if launcher.get("pack") else "gpus"
        devices = [str(d) for d in launcher.devices] or visible_gpus()[0]
        if not devices:
            print(
                f"exp: error: hydra/launcher=gpus: {visible_gpus()[1]}, so there is no GPU to plan for.",
                file=sys.stderr,
            )
            return PREFLIGHT_EXIT
        pool, problem = build_pool(kind, devices, list(launcher.get("memory_gib") or []), float(launcher.headroom))
    else:
        if "_target_" in launcher and "BasicLauncher" not in str(launcher._target_):
            print(
                f"note: hydra/launcher={launcher._target_}: jobs run where its scheduler puts them; planned one at a time"
            )
        pool, problem = build_pool("sequential", [], [], DEFAULT_HEADROOM)
    if problem:
        print(f"exp: error: {problem}", file=sys.stderr)
        return PREFLIGHT_EXIT
    sweep_dir = Path(str(master.hydra.sweep.dir))
    records = find_records([sweep_dir, Path.cwd() / "outputs", Path.cwd() / "multirun"])
    print(format_plan(estimate_jobs(jobs, pool, records, share_base)))
    print("nothing was started or written (--plan)")
    return 0
