"""`hydra/launcher=gpus`: run sweep jobs in parallel on one machine's GPUs; with `hydra.launcher.pack=true`, several
jobs per GPU, placed by exp's memory estimate.

Hydra's side of the launcher only: its config (`GpuLauncherConf`) and the `Launcher` that composes each job's config
as Hydra's own launchers do and returns each job's value to the sweeper. The launch itself (planning every job,
placing them on the GPUs, running each in a process of its own, the journal in the sweep directory) is
exp.study.scheduler.GpuScheduler.
"""

# No `from __future__ import annotations`: Hydra imports plugins in a way under which dataclasses cannot resolve
# string annotations.
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict


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
    # true: jobs that differ only in their adapters, optimiser settings and seeds train together in one process
    # over one shared base (exp.study.grouping says which); each job still gets its own run directory.
    share_base: bool = False


ConfigStore.instance().store(group="hydra/launcher", name="gpus", node=GpuLauncherConf, provider="exp")


class GpuPoolLauncher(Launcher):
    def __init__(
        self,
        devices: Sequence[str] = (),
        pack: bool = False,
        headroom: float = 0.10,
        memory_gib: Sequence[float] = (),
        share_base: bool = False,
    ) -> None:
        # exp loads once Hydra makes this launcher, not whenever it scans its plugins (every exp.train, --help too).
        from exp.study.scheduler import GpuScheduler

        self.scheduler = GpuScheduler(devices, pack, headroom, memory_gib, share_base)
        self.config = None
        self.hydra_context = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.scheduler.open()  # before the sweeper writes anything: no sweep directory for a launch that cannot run

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from exp.study.scheduler import LaunchJob  # loaded with the scheduler (__init__)

        assert self.config is not None and self.hydra_context is not None
        jobs = []
        for i, overrides in enumerate(job_overrides):
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(job_cfg):
                job_cfg.hydra.job.num = initial_job_idx + i
            jobs.append(LaunchJob(initial_job_idx + i, list(overrides), job_cfg))
        values = self.scheduler.run(jobs, Path(self.config.hydra.sweep.dir), Path.cwd())
        returns = []
        for job, value in zip(jobs, values, strict=True):
            ret = JobReturn(overrides=job.overrides, cfg=self.config, hydra_cfg=None)
            ret.status = JobStatus.COMPLETED  # a failed job is recorded in its directory and returns +inf, not raised
            ret.return_value = value
            returns.append(ret)
        return returns
