"""`hydra/launcher=gpus`: a study's jobs run in parallel on one machine's GPUs; with `pack`, several jobs per GPU,
placed by exp's memory estimate. `GpuScheduler` is the whole launch; the Hydra plugin
(`hydra_plugins.exp_gpu_launcher.launcher`) only composes each job's config and hands the values back to Hydra.

Each job is a separate `python -m exp.training.worker job <run dir>` process started with `CUDA_VISIBLE_DEVICES` set
to its GPU: its own run directory, W&B run and CUDA context, so a job that fails (an OOM included) fails alone. The
launching process never initialises CUDA (GPUs are counted from CUDA_VISIBLE_DEVICES or `nvidia-smi -L`, their
memory read from NVML through nvidia-smi). Every job is planned before the first starts, as the default launcher
plans each (exp.study.job.plan_sweep_job): a job that completed with the same config is reused, and a job
directory that holds another config stops the launch before anything runs.

Which job starts where and when is decided by exp.study.placement.Packer: without packing, one job per GPU; with
packing, a job starts on a GPU when its reservation (exp's estimate of its peak plus `headroom`, exp.study.cost)
fits in what the jobs running there leave of the GPU's free memory; it waits otherwise, in sweep order. An OOM
makes that GPU back off. Every decision (the plan, each start with the GPU's room, each end with the job's
measured peak, each back-off) is a line of the sweep's journal (exp.study.journal).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from exp.hardware.preflight import PREFLIGHT_EXIT, visible_gpus
from exp.run.dirs import RunLayout, read_status, release_run
from exp.study.cost import DEFAULT_HEADROOM, find_records
from exp.study.job import SweepJob, plan_sweep_job, start_sweep_job, sweep_job_result
from exp.study.journal import append_event
from exp.study.placement import Packer, Placement
from exp.study.plan import PlannedGroup, PlannedJob, Pool, build_pool, estimate_jobs, format_plan, plan_record
from exp.study.records import final_metric, job_name, ran_out_of_memory
from exp.training.launch import child_env, worker_command

log = logging.getLogger("exp.sweep")


@dataclass
class LaunchJob:
    """One job of the launch as the sweeper gave it."""

    num: int  # Hydra's job number
    overrides: list[str]
    job_cfg: DictConfig  # the job's config as Hydra composes it, its `hydra` node included


class GpuScheduler:
    """One launch of a study's jobs on this machine's GPUs: `open` before the sweeper writes anything, then `run`."""

    def __init__(
        self,
        devices: Sequence[str] = (),
        pack: bool = False,
        headroom: float = DEFAULT_HEADROOM,
        memory_gib: Sequence[float] = (),
        share_base: bool = False,
    ) -> None:
        self.devices = [str(d) for d in devices]  # empty: every GPU this process may see
        self.pack = bool(pack)
        self.share_base = bool(share_base)  # jobs that can share one base train together (exp.study.grouping)
        self.headroom = float(headroom)
        self.memory_gib = [float(m) for m in memory_gib]
        self.pool: Pool | None = None
        self.compile_threads: int | None = None  # set per launch: see compile_threads
        self._names: list[str] = []  # set per launch: each job's name (exp.study.records.job_name)

    def open(self) -> None:
        """The devices and their memory; a launch that cannot run stops here (one message, exit status 2 or 3), before
        the sweeper writes anything: no sweep directory for it."""
        if not self.devices:
            self.devices, where = visible_gpus()
            if not self.devices:
                _refuse(
                    f"hydra/launcher=gpus runs each job on a GPU of its own, and this machine has none to give: {where}. "
                    "Nothing was run or written. Fix: drop hydra/launcher=gpus to run the jobs one after the other here (on "
                    "the CPU: hardware=cpu), or name the devices with hydra.launcher.devices=[0,1].",
                    PREFLIGHT_EXIT,
                )
        if not 0 <= self.headroom < 10:
            _refuse(
                f"hydra.launcher.headroom={self.headroom}: the memory reserved per job beyond its estimate, as a "
                "fraction of it (0.1 reserves 10% more), so >= 0. Nothing was run or written. Fix: e.g. "
                "hydra.launcher.headroom=0.1.",
                2,
            )
        self.pool, problem = build_pool("packed" if self.pack else "gpus", self.devices, self.memory_gib, self.headroom)
        if problem:
            _refuse(problem, 2 if self.memory_gib else PREFLIGHT_EXIT)

    def run(self, launch_jobs: list[LaunchJob], sweep_dir: Path, launch_dir: Path) -> list[float]:
        """Run the jobs; each one's value for the sweeper (its final val/loss, +inf for a failed job), in their order."""
        assert self.pool is not None, "GpuScheduler.open first"
        sweep_dir.mkdir(parents=True, exist_ok=True)
        # Every job is planned first: a conflict stops the launch before any job has started.
        planned = []
        for lj in launch_jobs:
            subdir = OmegaConf.select(lj.job_cfg, "hydra.sweep.subdir", throw_on_missing=False)
            job_dir = sweep_dir / str(subdir or lj.num)
            task = copy.deepcopy(lj.job_cfg)
            with read_write(task), open_dict(task):
                del task["hydra"]
            planned.append(plan_sweep_job(task, job_dir, sweep_dir, launch_dir))
        # Each job's name in the plan, the packer and the journal.
        self._names = [job_name(job.job_dir, sweep_dir) for job in planned]
        jobs = [
            PlannedJob(lj.num, name, lj.overrides, job.cfg, job.error, str(job.reuse) if job.reuse else None)
            for lj, job, name in zip(launch_jobs, planned, self._names, strict=True)
        ]
        records = find_records([sweep_dir, launch_dir / "outputs", launch_dir / "multirun"])
        plan = estimate_jobs(jobs, self.pool, records, self.share_base)
        groups = {g.name: g for g in plan.groups or () if g.shared}
        launch_id = time.strftime("%Y-%m-%dT%H:%M:%S")
        append_event(sweep_dir, {**plan_record(plan), "launch": launch_id, "time": launch_id})
        how = ("packed by memory" if self.pack else "one job per GPU") + (
            f"; {len(groups)} group(s) sharing one base" if groups else ""
        )
        log.info(
            "Launching %d jobs on %d GPU(s): %s (%s)",
            len(launch_jobs),
            len(self.devices),
            ",".join(self.devices),
            how,
        )
        for line in format_plan(plan).splitlines():
            log.info("plan: %s", line)

        values: list[float] = [float("inf")] * len(planned)
        index = {pj.name: i for i, pj in enumerate(jobs)}
        for i, (lj, job) in enumerate(zip(launch_jobs, planned, strict=True)):
            if job.cfg is not None and jobs[i].cfg is None:  # refused by its estimate: fails alone, the rest run
                job.cfg, job.error = None, jobs[i].error
            if job.reuse is not None or job.cfg is None:
                values[i] = self._without_gpu(lj, job)
        self.compile_threads = compile_threads(plan.best.most_at_once)
        packer = Packer(self.pool.capacities, plan.demands(), self.pool.max_jobs_per_gpu)
        ended: queue.Queue = queue.Queue()
        started = time.time()
        while True:
            for p in packer.start_ready():
                if p.job in groups:
                    self._start_group(
                        groups[p.job], p, launch_jobs, planned, index, values, ended, sweep_dir, launch_id
                    )
                    continue
                i = index[p.job]
                memory = jobs[i].memory
                append_event(
                    sweep_dir,
                    {
                        "event": "start",
                        "launch": launch_id,
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "job": p.job,
                        "gpu": p.gpu,
                        "estimate_gib": _gib(memory.estimate_bytes) if memory else None,
                        "reserve_gib": _gib(p.reserve_bytes),
                        "budget_gib": memory.budget_gib if memory and self.pack else None,
                        "gpu_room_gib": _gib(p.room_before_bytes) if self.pack else None,
                        "running_before": p.running_before,
                        "compile_threads": self.compile_threads,
                    },
                )
                budget = memory.budget_gib if memory and self.pack else None
                args = (i, launch_jobs[i], planned[i], p.gpu, budget, values, ended)
                threading.Thread(target=self._run, args=args).start()
            for demand in packer.take_rejected():
                i = index[demand.job]
                largest = max(self.pool.capacities.values())
                message = (
                    f"hydra/launcher=gpus: this job's memory reservation, {demand.reserve_bytes / 2**30:.2f} GiB (exp's "
                    f"estimate plus hydra.launcher.headroom={self.headroom:g}), is more than any GPU of this launch "
                    f"can hold ({largest / 2**30:.2f} GiB), so it was not started. Fix: a smaller "
                    "hardware.micro_batch_size or data.max_seq_len, hardware.memory_budget_gib=<GiB> (the preflight "
                    "then recomputes layers to fit), or a lower hydra.launcher.headroom."
                )
                append_event(
                    sweep_dir,
                    {
                        "event": "rejected",
                        "launch": launch_id,
                        "job": demand.job,
                        "reserve_gib": _gib(demand.reserve_bytes),
                    },
                )
                values[i] = self._without_gpu(launch_jobs[i], SweepJob(planned[i].job_dir, None, error=message))
            if packer.done:
                break
            name, run_dir, seconds = ended.get()
            gpu = packer.where[name]
            group = groups.get(name)
            ends = list(run_dir) if group is not None else [(name, run_dir)]  # a group: (job, run dir) per job
            oom = any(d is not None and ran_out_of_memory(d) for _, d in ends)
            packer.finish(name, out_of_memory=oom)
            for ended_job, job_dir in ends:
                memory = group.memory if group is not None else jobs[index[ended_job]].memory
                append_event(
                    sweep_dir,
                    {
                        "event": "end",
                        "launch": launch_id,
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "job": ended_job,
                        # a re-run attempt: <job>_1, ...
                        "run_dir": job_name(job_dir, sweep_dir) if job_dir is not None else None,
                        "gpu": gpu,
                        "status": _status(job_dir),
                        "seconds": round(seconds, 1),
                        "peak_gib": _summary(job_dir).get("peak_memory_gib"),
                        "estimate_allocated_gib": _gib(memory.allocated_bytes) if memory else None,
                        "out_of_memory": oom,
                        **({"group": name} if group is not None else {}),
                    },
                )
            memory = None if group is not None else jobs[index[name]].memory
            if group is None and _status(run_dir) == "completed" and memory is not None:
                self.learn_peak(sweep_dir, launch_id, packer, jobs, index, name, run_dir)
            if oom:
                g, backed_off, before, after = packer.backoffs[-1]
                log.warning(
                    "job %s ran out of memory on GPU %s: that GPU backs off from %.2f to %.2f GiB",
                    name,
                    g,
                    before / 2**30,
                    after / 2**30,
                )
                append_event(
                    sweep_dir,
                    {
                        "event": "backoff",
                        "launch": launch_id,
                        "gpu": g,
                        "job": backed_off,
                        "capacity_before_gib": _gib(before),
                        "capacity_after_gib": _gib(after),
                    },
                )
        append_event(
            sweep_dir, {"event": "launch_end", "launch": launch_id, "wall_clock_s": round(time.time() - started, 1)}
        )
        return values

    def learn_peak(
        self,
        sweep_dir: Path,
        launch_id: str,
        packer: Packer,
        jobs: list[PlannedJob],
        index: dict[str, int],
        name: str,
        run_dir: Path,
    ) -> None:
        """A completed job measured more than its estimate: the waiting jobs of its shape reserve what it measured."""
        peak_gib = _summary(run_dir).get("peak_memory_gib")
        done = jobs[index[name]].memory
        if not peak_gib or done is None or not self.pack:
            return
        peak = int(float(peak_gib) * 2**30)
        for waiting in list(packer.pending):
            planned = jobs[index[waiting.job]]
            m = planned.memory
            if m is None or m.shape is None or done.shape is None or not m.shape.matches(done.shape):
                continue
            raised = m.measured(peak, str(run_dir), self.headroom)
            if packer.raise_reservation(waiting.job, raised.reserve_bytes):
                planned.memory = raised
                log.warning(
                    "job %s measured a %.2f GiB allocation peak (estimated %.2f): job %s now reserves %.2f GiB",
                    name,
                    peak / 2**30,
                    done.allocated_bytes / 2**30,
                    waiting.job,
                    raised.reserve_bytes / 2**30,
                )
                append_event(
                    sweep_dir,
                    {
                        "event": "reserve_raised",
                        "launch": launch_id,
                        "job": waiting.job,
                        "from_job": name,
                        "peak_gib": _gib(peak),
                        "reserve_before_gib": _gib(m.reserve_bytes),
                        "reserve_gib": _gib(raised.reserve_bytes),
                    },
                )

    def _start_group(
        self,
        group: PlannedGroup,
        p: Placement,
        launch_jobs: list[LaunchJob],
        planned: list[SweepJob],
        index: dict[str, int],
        values: list[float],
        ended: queue.Queue,
        sweep_dir: Path,
        launch_id: str,
    ) -> None:
        """Start a group of jobs sharing one base on its GPU: the journal's start line, then its process's thread."""
        memory = group.memory
        append_event(
            sweep_dir,
            {
                "event": "start",
                "launch": launch_id,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "job": group.name,
                "group": [j.name for j in group.jobs],
                "gpu": p.gpu,
                "estimate_gib": _gib(memory.estimate_bytes) if memory else None,
                "reserve_gib": _gib(p.reserve_bytes),
                "gpu_room_gib": _gib(p.room_before_bytes) if self.pack else None,
                "running_before": p.running_before,
            },
        )
        members = [index[j.name] for j in group.jobs]
        args = (group.name, members, launch_jobs, planned, p.gpu, values, ended)
        threading.Thread(target=self._run_group, args=args).start()

    def _run_group(
        self,
        name: str,
        members: list[int],
        launch_jobs: list[LaunchJob],
        planned: list[SweepJob],
        device: str,
        values: list[float],
        ended: queue.Queue,
    ) -> None:
        """One group's process (exp.study.group_worker) on `device`, in a thread of its own; each job's value goes
        into `values`, the group's end to `ended` with every job's run directory."""
        run_dirs: list[tuple[int, Path]] = []
        t0 = time.time()
        try:
            for i in members:
                lj = launch_jobs[i]
                run_dir = start_sweep_job(
                    planned[i], lj.job_cfg, lj.job_cfg.hydra.job.override_dirname, Path(lj.job_cfg.hydra.sweep.dir).name
                )
                if run_dir is not None:
                    run_dirs.append((i, run_dir))
            log.info("group %s on GPU %s: %d jobs over one base", name, device, len(run_dirs))
            env = child_env(dict(os.environ, CUDA_VISIBLE_DEVICES=device))
            try:
                command = [sys.executable, "-m", "exp.study.group_worker", *(str(d) for _, d in run_dirs)]
                rc = subprocess.run(command, env=env).returncode if run_dirs else 0
            finally:
                for _, d in run_dirs:
                    release_run(d)
            for i, d in run_dirs:
                # The group's exit status stands for a job only where the job did not complete.
                values[i] = sweep_job_result(d, 0 if _status(d) == "completed" else rc or 1)
        finally:
            ended.put((name, [(self._names[i], d) for i, d in run_dirs], time.time() - t0))

    def _without_gpu(self, lj: LaunchJob, job: SweepJob) -> float:
        """A job that needs no GPU: reused (its value again), or failed before starting (recorded in its directory)."""
        if job.reuse is not None:
            log.info("job #%d %s already completed with this config, skipped", lj.num, job.reuse.name)
            return final_metric(job.reuse)
        hydra_cfg = lj.job_cfg.hydra
        start_sweep_job(job, lj.job_cfg, hydra_cfg.job.override_dirname, Path(hydra_cfg.sweep.dir).name)
        return float("inf")

    def _run(
        self,
        i: int,
        lj: LaunchJob,
        job: SweepJob,
        device: str,
        budget_gib: float | None,
        values: list[float],
        ended: queue.Queue,
    ) -> None:
        """One job's process on `device`, in a thread of its own; its value goes into `values[i]`, its end to `ended`
        (a failed job is recorded in its directory and gives +inf, never raises)."""
        run_dir = None
        t0 = time.time()
        try:
            hydra_cfg = lj.job_cfg.hydra
            run_dir = start_sweep_job(
                job,
                lj.job_cfg,
                hydra_cfg.job.override_dirname,
                Path(hydra_cfg.sweep.dir).name,
                memory_budget_gib=budget_gib,
            )
            log.info("job #%d on GPU %s: %s", lj.num, device, " ".join(lj.overrides))
            env = child_env(dict(os.environ, CUDA_VISIBLE_DEVICES=device))
            if self.compile_threads is not None:
                env["TORCHINDUCTOR_COMPILE_THREADS"] = str(self.compile_threads)
            try:
                rc = subprocess.run(worker_command("job", run_dir), env=env).returncode
            finally:
                release_run(run_dir)
            values[i] = sweep_job_result(run_dir, rc)
        finally:
            ended.put((self._names[i], run_dir, time.time() - t0))


def compile_threads(jobs_at_once: int) -> int | None:
    """Inductor's compile workers per job when several jobs share this host (None: leave torch's default).

    Each compiling process starts a pool of one worker per CPU core, each a Python process with torch loaded: 16
    packed jobs on a 16-core host would start 256 of them, several GiB of host memory each few. The host's cores
    are split between the jobs that run at once instead; TORCHINDUCTOR_COMPILE_THREADS set by the user wins.
    """
    if jobs_at_once <= 1 or "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // jobs_at_once)


def _gib(n: int) -> float:
    return round(n / 2**30, 3)


def _status(run_dir: Path | None) -> str:
    return read_status(run_dir).get("status", "unknown") if run_dir is not None else "not started"


def _summary(run_dir: Path | None) -> dict:
    try:
        return json.loads(RunLayout(run_dir).summary.read_text()) if run_dir is not None else {}
    except (OSError, ValueError):
        return {}


def _refuse(message: str, status: int) -> None:
    print(f"exp: error: {message}", file=sys.stderr)
    sys.exit(status)
