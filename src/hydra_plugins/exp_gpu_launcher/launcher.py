"""`hydra/launcher=gpus`: run sweep jobs in parallel on one machine's GPUs; with `hydra.launcher.pack=true`, several
jobs per GPU, placed by exp's memory estimate.

Each job is a separate `python -m exp.training.worker job <run dir>` process started with `CUDA_VISIBLE_DEVICES` set
to its GPU: its own run directory, W&B run and CUDA context, so a job that fails (an OOM included) fails alone. The
launching process never initialises CUDA (GPUs are counted from CUDA_VISIBLE_DEVICES or `nvidia-smi -L`, their
memory read from NVML through nvidia-smi). Every job is planned before the first starts, as the default launcher
plans each (exp.training.sweep_job.plan_sweep_job): a job that completed with the same config is reused, and a job
directory that holds another config stops the launch before anything runs.

Which job starts where and when is decided by exp.run.placement.Packer: without packing, one job per GPU; with
packing, a job starts on a GPU when its reservation (exp's estimate of its peak plus `headroom`, exp.run.job_cost)
fits in what the jobs running there leave of the GPU's free memory; it waits otherwise, in sweep order. An OOM
makes that GPU back off. Every decision (the plan, each start with the GPU's room, each end with the job's
measured peak, each back-off) is a line of `placements.jsonl` in the sweep directory, appended per launch.
"""

# No `from __future__ import annotations`: Hydra imports plugins in a way under which dataclasses cannot resolve
# string annotations.
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
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)
PLACEMENTS = "placements.jsonl"


@dataclass
class GpuLauncherConf:
    _target_: str = "hydra_plugins.exp_gpu_launcher.launcher.GpuPoolLauncher"
    # Device ids to hand out; empty: every GPU this process may see.
    devices: list[str] = field(default_factory=list)
    # true: several jobs per GPU, placed by exp's memory estimate of each; false: one job per GPU.
    pack: bool = False
    # Reserved per job beyond its estimate, as a fraction of it (the estimator's error, the allocator's slack).
    headroom: float = 0.10
    # GiB each device may hold, one figure per device; empty: the free memory nvidia-smi reports at launch.
    memory_gib: list[float] = field(default_factory=list)


ConfigStore.instance().store(group="hydra/launcher", name="gpus", node=GpuLauncherConf, provider="exp")


class GpuPoolLauncher(Launcher):
    def __init__(
        self,
        devices: Sequence[str] = (),
        pack: bool = False,
        headroom: float = 0.10,
        memory_gib: Sequence[float] = (),
    ) -> None:
        self.devices = [str(d) for d in devices]
        self.pack = bool(pack)
        self.headroom = float(headroom)
        self.memory_gib = [float(m) for m in memory_gib]
        self.config = None
        self.hydra_context = None
        self.pool = None
        self.compile_threads: int | None = None  # set per launch: see compile_threads
        self._lock = threading.Lock()

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # Everything here runs before the sweeper writes anything: no sweep directory for a launch that cannot run.
        from exp.hardware.preflight import PREFLIGHT_EXIT, visible_gpus
        from exp.run.study_plan import build_pool

        self.config, self.hydra_context = config, hydra_context
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

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from exp.run.job_cost import find_records
        from exp.run.placement import Packer
        from exp.run.study_plan import PlannedJob, estimate_jobs, format_plan, plan_record
        from exp.training.sweep_job import SweepJob, plan_sweep_job

        assert self.config is not None and self.hydra_context is not None and self.pool is not None
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        launch_dir = Path.cwd()
        # Every job is planned first: a conflict stops the launch before any job has started.
        planned = []
        for i, overrides in enumerate(job_overrides):
            num = initial_job_idx + i
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(job_cfg):
                job_cfg.hydra.job.num = num
            job_dir = sweep_dir / str(OmegaConf.select(job_cfg, "hydra.sweep.subdir", throw_on_missing=False) or num)
            task = copy.deepcopy(job_cfg)
            with read_write(task), open_dict(task):
                del task["hydra"]
            planned.append((num, list(overrides), job_cfg, plan_sweep_job(task, job_dir, sweep_dir, launch_dir)))
        jobs = [
            PlannedJob(num, job.job_dir.name, ov, job.cfg, job.error, str(job.reuse) if job.reuse else None)
            for num, ov, _, job in planned
        ]
        records = find_records([sweep_dir, launch_dir / "outputs", launch_dir / "multirun"])
        plan = estimate_jobs(jobs, self.pool, records)
        launch_id = time.strftime("%Y-%m-%dT%H:%M:%S")
        self._record(sweep_dir, {**plan_record(plan), "launch": launch_id, "time": launch_id})
        how = "packed by memory" if self.pack else "one job per GPU"
        log.info(
            "Launching %d jobs on %d GPU(s): %s (%s)",
            len(job_overrides),
            len(self.devices),
            ",".join(self.devices),
            how,
        )
        for line in format_plan(plan).splitlines():
            log.info("plan: %s", line)

        results: list = [None] * len(planned)
        index = {pj.name: i for i, pj in enumerate(jobs)}
        for i, (num, overrides, job_cfg, job) in enumerate(planned):
            if job.cfg is not None and jobs[i].cfg is None:  # refused by its estimate: fails alone, the rest run
                job.cfg, job.error = None, jobs[i].error
            if job.reuse is not None or job.cfg is None:
                results[i] = self._without_gpu(num, overrides, job_cfg, job)
        self.compile_threads = compile_threads(plan.best.most_at_once)
        packer = Packer(self.pool.capacities, plan.demands(), self.pool.max_jobs_per_gpu)
        ended: queue.Queue = queue.Queue()
        started = time.time()
        while True:
            for p in packer.start_ready():
                i = index[p.job]
                num, overrides, job_cfg, job = planned[i]
                memory = jobs[i].memory
                self._record(
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
                args = (i, num, overrides, job_cfg, job, p.gpu, budget, results, ended)
                threading.Thread(target=self._run, args=args).start()
            for demand in packer.take_rejected():
                i = index[demand.job]
                num, overrides, job_cfg, job = planned[i]
                largest = max(self.pool.capacities.values())
                message = (
                    f"hydra/launcher=gpus: this job's memory reservation, {demand.reserve_bytes / 2**30:.2f} GiB (exp's "
                    f"estimate plus hydra.launcher.headroom={self.headroom:g}), is more than any GPU of this launch "
                    f"can hold ({largest / 2**30:.2f} GiB), so it was not started. Fix: a smaller "
                    "hardware.micro_batch_size or data.max_seq_len, hardware.memory_budget_gib=<GiB> (the preflight "
                    "then recomputes layers to fit), or a lower hydra.launcher.headroom."
                )
                self._record(
                    sweep_dir,
                    {
                        "event": "rejected",
                        "launch": launch_id,
                        "job": demand.job,
                        "reserve_gib": _gib(demand.reserve_bytes),
                    },
                )
                results[i] = self._without_gpu(num, overrides, job_cfg, SweepJob(job.job_dir, None, error=message))
            if packer.done:
                break
            name, run_dir, seconds = ended.get()
            from exp.run.sweep import ran_out_of_memory

            gpu = packer.where[name]
            oom = run_dir is not None and ran_out_of_memory(run_dir)
            packer.finish(name, out_of_memory=oom)
            memory = jobs[index[name]].memory
            status = _status(run_dir)
            self._record(
                sweep_dir,
                {
                    "event": "end",
                    "launch": launch_id,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "job": name,
                    "run_dir": run_dir.name if run_dir is not None else None,  # a re-run attempt: <job>_1, ...
                    "gpu": gpu,
                    "status": status,
                    "seconds": round(seconds, 1),
                    "peak_gib": _summary(run_dir).get("peak_memory_gib"),
                    "estimate_allocated_gib": _gib(memory.allocated_bytes) if memory else None,
                    "out_of_memory": oom,
                },
            )
            if status == "completed" and memory is not None:
                self._learn_peak(sweep_dir, launch_id, packer, jobs, index, name, run_dir)
            if oom:
                g, job_name, before, after = packer.backoffs[-1]
                log.warning(
                    "job %s ran out of memory on GPU %s: that GPU backs off from %.2f to %.2f GiB",
                    name,
                    g,
                    before / 2**30,
                    after / 2**30,
                )
                self._record(
                    sweep_dir,
                    {
                        "event": "backoff",
                        "launch": launch_id,
                        "gpu": g,
                        "job": job_name,
                        "capacity_before_gib": _gib(before),
                        "capacity_after_gib": _gib(after),
                    },
                )
        self._record(
            sweep_dir, {"event": "launch_end", "launch": launch_id, "wall_clock_s": round(time.time() - started, 1)}
        )
        return [r for r in results if r is not None]

    def _learn_peak(self, sweep_dir: Path, launch_id: str, packer, jobs: list, index: dict, name: str, run_dir) -> None:
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
                self._record(
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

    def _without_gpu(self, num: int, overrides: list, job_cfg: DictConfig, job) -> JobReturn:
        """A job that needs no GPU: reused (its value again), or failed before starting (recorded in its directory)."""
        from exp.run.sweep import final_metric
        from exp.training.sweep_job import start_sweep_job

        ret = JobReturn(overrides=overrides, cfg=self.config, hydra_cfg=None)
        ret.status = JobStatus.COMPLETED  # a failed job is recorded in its directory and returns +inf, not raised
        if job.reuse is not None:
            log.info("job #%d %s already completed with this config, skipped", num, job.reuse.name)
            ret.return_value = final_metric(job.reuse)
            return ret
        hydra_cfg = job_cfg.hydra
        start_sweep_job(job, job_cfg, hydra_cfg.job.override_dirname, Path(hydra_cfg.sweep.dir).name)
        ret.return_value = float("inf")
        return ret

    def _run(
        self,
        i: int,
        num: int,
        overrides: list,
        job_cfg: DictConfig,
        job,
        device: str,
        budget_gib,
        results: list,
        ended: queue.Queue,
    ) -> None:
        from exp.run.dirs import release_run
        from exp.training.launch import child_env
        from exp.training.sweep_job import start_sweep_job, sweep_job_result

        ret = JobReturn(overrides=overrides, cfg=self.config, hydra_cfg=None)
        ret.status = JobStatus.COMPLETED  # a failed job is recorded in its directory and returns +inf, not raised
        ret.return_value = float("inf")
        run_dir = None
        t0 = time.time()
        try:
            hydra_cfg = job_cfg.hydra
            run_dir = start_sweep_job(
                job,
                job_cfg,
                hydra_cfg.job.override_dirname,
                Path(hydra_cfg.sweep.dir).name,
                memory_budget_gib=budget_gib,
            )
            log.info("job #%d on GPU %s: %s", num, device, " ".join(overrides))
            env = child_env(dict(os.environ, CUDA_VISIBLE_DEVICES=device))
            if self.compile_threads is not None:
                env["TORCHINDUCTOR_COMPILE_THREADS"] = str(self.compile_threads)
            try:
                rc = subprocess.run(
                    [sys.executable, "-m", "exp.training.worker", "job", str(run_dir)], env=env
                ).returncode
            finally:
                release_run(run_dir)
            ret.return_value = sweep_job_result(run_dir, rc)
        finally:
            results[i] = ret
            ended.put((job.job_dir.name, run_dir, time.time() - t0))

    def _record(self, sweep_dir: Path, event: dict) -> None:
        """One decision, appended to the sweep's placements.jsonl (earlier launches' lines are kept)."""
        with self._lock, (sweep_dir / PLACEMENTS).open("a") as f:
            f.write(json.dumps(event, default=str) + "\n")


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


def _status(run_dir) -> str:
    from exp.run.dirs import read_status

    return read_status(run_dir).get("status", "unknown") if run_dir is not None else "not started"


def _summary(run_dir) -> dict:
    from exp.run.dirs import RunLayout

    try:
        return json.loads(RunLayout(run_dir).summary.read_text()) if run_dir is not None else {}
    except (OSError, ValueError):
        return {}


def _refuse(message: str, status: int) -> None:
    print(f"exp: error: {message}", file=sys.stderr)
    sys.exit(status)
