"""`hydra/launcher=gpus`: run sweep jobs in parallel on one machine, one GPU each.

Each job is a separate `python -m exp.training.launch job <run dir>` process started with `CUDA_VISIBLE_DEVICES` set to one
free GPU; a job starts when a GPU frees up. The launching process never initialises CUDA (GPUs are counted from
CUDA_VISIBLE_DEVICES or `nvidia-smi -L`). Every job is planned before the first starts, as the default launcher
plans each (exp.training.sweep_job.plan_sweep_job): a job that completed with the same config is reused, and a job directory
that holds another config stops the launch before anything runs.
"""

# No `from __future__ import annotations`: Hydra imports plugins in a way under which dataclasses cannot resolve
# string annotations.
import copy
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)


@dataclass
class GpuLauncherConf:
    _target_: str = "hydra_plugins.exp_gpu_launcher.launcher.GpuPoolLauncher"
    # Device ids to hand out, one per concurrent job; empty: every GPU this process may see.
    devices: list[str] = field(default_factory=list)


ConfigStore.instance().store(group="hydra/launcher", name="gpus", node=GpuLauncherConf, provider="exp")


def visible_gpus() -> tuple[list[str], str]:
    """The GPU ids this process may hand out, and where they were counted (for a message when there are none)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [d.strip() for d in cvd.split(",") if d.strip()], f"CUDA_VISIBLE_DEVICES is {cvd!r}"
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "CUDA_VISIBLE_DEVICES is not set and there is no nvidia-smi (no NVIDIA driver)"
    out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30).stdout
    gpus = [str(i) for i, _ in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]
    return gpus, "`nvidia-smi -L` lists no GPU"


class GpuPoolLauncher(Launcher):
    def __init__(self, devices: Sequence[str] = ()) -> None:
        self.devices = [str(d) for d in devices]
        self.config = None
        self.hydra_context = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        if not self.devices:
            # Here, before the sweeper writes anything: no sweep directory for a launch that cannot run.
            self.devices, where = visible_gpus()
            if not self.devices:
                from exp.hardware.preflight import PREFLIGHT_EXIT

                print(
                    f"exp: error: hydra/launcher=gpus runs each job on a GPU of its own, and this machine has none to "
                    f"give: {where}. Nothing was run or written. Fix: drop hydra/launcher=gpus to run the jobs one "
                    "after the other here (on the CPU: hardware=cpu), or name the devices with "
                    "hydra.launcher.devices=[0,1].",
                    file=sys.stderr,
                )
                sys.exit(PREFLIGHT_EXIT)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from exp.training.sweep_job import plan_sweep_job

        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
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
            planned.append((num, list(overrides), job_cfg, plan_sweep_job(task, job_dir, sweep_dir, Path.cwd())))
        free: queue.Queue[str] = queue.Queue()
        for d in self.devices:
            free.put(d)
        log.info("Launching %d jobs on %d GPU(s): %s", len(job_overrides), len(self.devices), ",".join(self.devices))
        results: list = [None] * len(job_overrides)
        threads = []
        for i, (num, overrides, job_cfg, job) in enumerate(planned):
            t = threading.Thread(target=self._run, args=(i, num, overrides, job_cfg, job, free, results))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        return [r for r in results if r is not None]

    def _run(
        self, i: int, num: int, overrides: list, job_cfg: DictConfig, job, free: "queue.Queue[str]", results: list
    ) -> None:
        from exp.run.dirs import release_run
        from exp.run.sweep import final_metric
        from exp.training.sweep_job import start_sweep_job, sweep_job_result

        ret = JobReturn(overrides=overrides, cfg=self.config, hydra_cfg=None)
        ret.status = JobStatus.COMPLETED  # a failed job is recorded in its directory and returns +inf, not raised
        if job.reuse is not None:
            log.info("job #%d %s already completed with this config, skipped", num, job.reuse.name)
            ret.return_value = final_metric(job.reuse)
            results[i] = ret
            return
        device = free.get()  # wait for a GPU; the job's directory is claimed when it starts
        try:
            hydra_cfg = job_cfg.hydra
            run_dir = start_sweep_job(job, job_cfg, hydra_cfg.job.override_dirname, Path(hydra_cfg.sweep.dir).name)
            if run_dir is None:  # its config failed the checks: recorded as failed
                ret.return_value = float("inf")
                results[i] = ret
                return
            log.info("job #%d on GPU %s: %s", num, device, " ".join(overrides))
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=device)
            try:
                rc = subprocess.run(
                    [sys.executable, "-m", "exp.training.worker", "job", str(run_dir)], env=env
                ).returncode
            finally:
                release_run(run_dir)
        finally:
            free.put(device)
        ret.return_value = sweep_job_result(run_dir, rc)
        results[i] = ret
