"""`hydra/launcher=gpus`: run sweep jobs in parallel on one machine, one GPU each.

Each job is a separate `python -m exp.train <its overrides> hydra.run.dir=<its sweep subdir>` process started with
`CUDA_VISIBLE_DEVICES` set to one free GPU; a job starts when a GPU frees up. The launching process never
initialises CUDA (GPUs are counted from CUDA_VISIBLE_DEVICES or `nvidia-smi -L`). Jobs whose run directory already
says `completed` are skipped, as with the default launcher.
"""

# No `from __future__ import annotations`: Hydra imports plugins in a way under which dataclasses cannot resolve
# string annotations.
import json
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
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class GpuLauncherConf:
    _target_: str = "hydra_plugins.exp_gpu_launcher.launcher.GpuPoolLauncher"
    # Device ids to hand out, one per concurrent job; empty: every GPU this process may see.
    devices: list[str] = field(default_factory=list)


ConfigStore.instance().store(group="hydra/launcher", name="gpus", node=GpuLauncherConf, provider="exp")


def visible_gpus() -> list[str]:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [d.strip() for d in cvd.split(",") if d.strip()]
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30).stdout
    return [str(i) for i, _ in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


class GpuPoolLauncher(Launcher):
    def __init__(self, devices: Sequence[str] = ()) -> None:
        self.devices = [str(d) for d in devices]
        self.config = None
        self.hydra_context = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        devices = self.devices or visible_gpus()
        if not devices:
            raise RuntimeError(
                "hydra/launcher=gpus found no GPU (CUDA_VISIBLE_DEVICES is empty or nvidia-smi lists none). Use the "
                "default launcher, or name devices with hydra.launcher.devices=[0,1]."
            )
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        free: queue.Queue[str] = queue.Queue()
        for d in devices:
            free.put(d)
        log.info("Launching %d jobs on %d GPU(s): %s", len(job_overrides), len(devices), ",".join(devices))
        results: list = [None] * len(job_overrides)
        threads = []
        for i, overrides in enumerate(job_overrides):
            num = initial_job_idx + i
            job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(job_cfg):
                job_cfg.hydra.job.num = num
            run_dir = Path(OmegaConf.to_container(job_cfg.hydra.sweep, resolve=True)["dir"]) / str(
                OmegaConf.select(job_cfg, "hydra.sweep.subdir", throw_on_missing=False) or num
            )
            t = threading.Thread(target=self._run, args=(i, num, list(overrides), run_dir, free, results))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        return [r for r in results if r is not None]

    def _run(
        self, i: int, num: int, overrides: list[str], run_dir: Path, free: "queue.Queue[str]", results: list
    ) -> None:
        from exp.run_dir import read_status

        ret = JobReturn(overrides=overrides, cfg=self.config, hydra_cfg=None)
        if read_status(run_dir).get("status") == "completed":
            log.info("job #%d %s already completed, skipped", num, run_dir.name)
            ret.status, ret.return_value = JobStatus.COMPLETED, _final_metric(run_dir)
            results[i] = ret
            return
        device = free.get()  # wait for a GPU
        try:
            log.info("job #%d on GPU %s: %s", num, device, " ".join(overrides))
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=device)
            # Quoted: job directory names hold the overrides' '=' and ','.
            cmd = [sys.executable, "-m", "exp.train", *overrides, f'hydra.run.dir="{run_dir}"']
            rc = subprocess.run(cmd, env=env).returncode
        finally:
            free.put(device)
        if rc != 0 and read_status(run_dir).get("status") != "failed":  # died before it could record why
            from exp.run_dir import write_status

            run_dir.mkdir(parents=True, exist_ok=True)
            write_status(run_dir, "failed", error=f"the job process exited with status {rc}")
        value = _final_metric(run_dir) if rc == 0 else float("inf")
        ret.status, ret.return_value = JobStatus.COMPLETED, value  # a failed job is recorded, not raised
        results[i] = ret


def _final_metric(run_dir: Path) -> float:
    try:
        return json.loads((run_dir / "summary.json").read_text())["final_val"]["val/loss"]
    except (FileNotFoundError, KeyError):
        return float("inf")
