"""What one sweep job will cost before it runs: its memory on a GPU (exp's estimator, on the config the job's own
preflight will resolve) and its time (from the throughput earlier runs and benchmarks recorded). Torch-free.

Memory. On a GPU the preflight turns `auto` choices (micro-batch, recomputed layers, kept dequantized weights)
into the largest that fit the memory it may plan for, so a job's memory depends on that budget. A job of a packed
sweep gets a budget of its own: its `hardware.memory_budget_gib` when the config sets one, else the estimate of
the config resolved as if it had the whole GPU. The launcher passes that budget to the job (config.yaml), so the
job's preflight makes the same choices within it and never plans into memory another job holds; the budget is
a placement, like CUDA_VISIBLE_DEVICES, and stays out of the job's fingerprint (exp.study.records). The reservation
the packer counts is the estimate plus `headroom` (a fraction of it): room for the estimator's error and the
allocator's fragmentation, which the single-run preflight keeps as a share of the free memory.

Time. A step's time is taken from the closest record of the same model on the same kind of device (GPU name, or
"cpu"), scaled by the tokens per optimiser step (global batch x max_seq_len); a run record also gives the time
outside the steps (start-up, evaluations, saving). Records: completed runs (summary.json with
`step_seconds_median`) under the directories searched, and exp.bench results (benchmarks/results/bench-*.json).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from exp.core.config import Accelerator, ConfigError, TrainConfig
from exp.hardware.memory import GiB, estimate_for_config
from exp.hardware.preflight import Environment, Gpu, check
from exp.run.compose import config_dict, load_run_config
from exp.run.dirs import RunLayout, read_status, runs_under
from exp.study.journal import launcher_seconds

# The reservation's margin over the estimate. The estimator's allocated peak was within +0.6% of the H200
# measurements (docs/bench.md); the caching allocator's fragmentation with several processes on one GPU has not
# been measured, so the margin matches the single-run preflight's AUTO_CHECKPOINT_HEADROOM.
DEFAULT_HEADROOM = 0.10
SAME_SHAPE_TOLERANCE = 0.01  # lora.r 8 vs 16 on Gemma-2B moves the estimate by 0.3%; a micro-batch step by far more
BENCH_RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


@dataclass(frozen=True)
class MemoryShape:
    """What decides a job's memory, to tell whether one run's measured peak stands for another job.

    `key`: a hash of the resolved settings the memory follows (model and quantization, every hardware choice but the
    budget, the sequence length, the LoRA targets, dropout and extra trained modules). The rank is left out: it
    moves a 2B job's estimate by 0.3%, and a study over ranks should learn from its first run of any rank; the
    estimated allocations must agree within SAME_SHAPE_TOLERANCE as well, which catches a rank large enough to
    matter. A key alone would not do without the allocation either way: under a budget the preflight fills the
    budget, so jobs of different micro-batches can have estimates within 1% of each other.
    """

    key: str
    allocated_bytes: int  # exp's estimate of the allocation peak

    def matches(self, other: MemoryShape) -> bool:
        a, b = self.allocated_bytes, other.allocated_bytes
        return self.key == other.key and abs(a - b) <= SAME_SHAPE_TOLERANCE * max(a, b)


def memory_shape(cfg: TrainConfig, allocated_bytes: int | None = None) -> MemoryShape:
    """The shape of a resolved config (what the preflight wrote into config.yaml); `allocated_bytes`: its
    estimated allocation when the caller has it already."""
    d = config_dict(cfg)
    key = {
        "model": d["model"],
        "quantization": d["quantization"],
        "hardware": {k: v for k, v in d["hardware"].items() if k != "memory_budget_gib"},
        "max_seq_len": d["data"]["max_seq_len"],
        "lora": {k: d["lora"][k] for k in ("target_modules", "dropout", "modules_to_save", "bias")},
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    if allocated_bytes is None:
        allocated_bytes = estimate_for_config(cfg).allocated
    return MemoryShape(digest, allocated_bytes)


@dataclass
class MemoryDemand:
    """A job's memory on one kind of GPU (or on the CPU, where nothing is packed)."""

    estimate_bytes: int  # MemoryEstimate.total of the resolved config: what the device must hold
    allocated_bytes: int  # MemoryEstimate.allocated: comparable with the summary's peak_memory_gib
    reserve_bytes: int  # estimate plus headroom: what the packer counts against the GPU
    budget_gib: float | None  # hardware.memory_budget_gib the job runs with (None: left as the config says)
    choices: str  # what the preflight resolves, in words
    problem: str = ""  # why the job cannot run on this GPU (the preflight's finding)
    measured_from: str = ""  # the run whose measured peak sets the reservation (empty: the estimate does)
    shape: MemoryShape | None = None  # None on the CPU, where nothing is packed

    def measured(self, peak_bytes: int, source: str, headroom: float) -> MemoryDemand:
        """This demand with the reservation a measured allocation peak of the same shape calls for, when that
        peak is above the estimated allocation: the estimate's share outside the allocator (CUDA context, cache
        slack) added, then the headroom. A lower peak leaves the estimate's reservation as it is."""
        if peak_bytes <= self.allocated_bytes:
            return self
        total = peak_bytes + max(0, self.estimate_bytes - self.allocated_bytes)
        reserve = max(self.reserve_bytes, int(total * (1 + headroom)))
        return dataclasses.replace(self, reserve_bytes=reserve, measured_from=source)


def memory_demand(
    cfg: TrainConfig, gpu: Gpu | None, headroom: float = DEFAULT_HEADROOM, records: Sequence[StepRecord] = ()
) -> MemoryDemand:
    """The job's memory as its preflight will resolve it on `gpu` (None or a CPU config: the config as it is).

    `records`: completed runs on the same GPU of this job's `MemoryShape`: the highest allocation peak they measured
    sets the reservation where it exceeds the estimate, so a study learns from earlier runs what the estimator
    missed.
    """
    if gpu is None or cfg.hardware.accelerator == Accelerator.cpu:
        # No GPU to resolve against: the preflight resolves what it can on what this process sees (no GPU).
        resolved = check(copy.deepcopy(cfg), Environment()).cfg
        est = estimate_for_config(resolved)
        return MemoryDemand(est.total, est.allocated, int(est.total * (1 + headroom)), None, _choices(resolved))
    own_budget = cfg.hardware.memory_budget_gib
    result = resolve_alone(cfg, gpu)
    resolved = result.cfg
    est = estimate_for_config(resolved)
    problem = "; ".join(f.message.splitlines()[0] for f in result.findings)
    budget = own_budget if own_budget is not None else math.ceil(est.total / GiB * 100) / 100
    shape = memory_shape(resolved, est.allocated)
    demand = MemoryDemand(
        est.total,
        est.allocated,
        int(est.total * (1 + headroom)),
        budget,
        _choices(resolved),
        problem=problem,
        shape=shape,
    )
    peaks = [r for r in records if r.device == gpu.name and r.peak_bytes and r.shape and r.shape.matches(shape)]
    if peaks:
        top = max(peaks, key=lambda r: (r.peak_bytes, r.source))
        demand = demand.measured(top.peak_bytes, top.source, headroom)
    return demand


def resolve_alone(cfg: TrainConfig, gpu: Gpu | None):
    """The preflight's result for `cfg` as if the job were alone on `gpu` (None: on what this process sees): its
    budget then comes from the config, not from what others hold now, so a re-launch makes the same choices."""
    if gpu is None or cfg.hardware.accelerator == Accelerator.cpu:
        return check(copy.deepcopy(cfg), Environment())
    env = Environment(torch_cuda="probe", gpus=[Gpu(gpu.name, gpu.total_bytes, gpu.total_bytes, gpu.capability)])
    return check(copy.deepcopy(cfg), env)


def _choices(cfg: TrainConfig) -> str:
    hw = cfg.hardware
    layers = cfg.model.arch.get("num_hidden_layers", "?")
    recomputed = (
        0 if not hw.gradient_checkpointing else layers if hw.checkpoint_layers is None else hw.checkpoint_layers
    )
    kept = f", {hw.dequantized_layers} kept dequantized" if hw.dequantized_layers else ""
    return f"micro-batch {hw.micro_batch_size}, {recomputed}/{layers} layers recomputed{kept}"


@dataclass(frozen=True)
class StepRecord:
    """A measured step time of one model on one kind of device."""

    source: str  # the run directory or benchmark file it comes from
    model: str
    device: str  # GPU name, or "cpu"
    tokens_per_step: int  # global batch x max_seq_len: what a step computes at most (batches are padded)
    step_s: float  # median seconds per optimiser step
    overhead_s: float  # the run's wall-clock outside its steps (0 for a benchmark row)
    peak_bytes: int | None = None  # the run's measured allocation peak (torch.cuda.max_memory_allocated)
    shape: MemoryShape | None = None  # the run's resolved config as the memory sees it


@dataclass
class TimeEstimate:
    step_s: float | None
    job_s: float | None
    source: str  # which record, or why there is none


def tokens_per_step(cfg: TrainConfig) -> int:
    return cfg.trainer.global_batch_size * cfg.data.max_seq_len


def estimate_time(cfg: TrainConfig, device: str, records: list[StepRecord]) -> TimeEstimate:
    """Seconds per step and for the whole job from the record closest in tokens per step (same model, device)."""
    same = [r for r in records if r.model == cfg.model.name and r.device == device]
    if not same:
        return TimeEstimate(None, None, f"no recorded run of {cfg.model.name} on {device}")
    tokens = tokens_per_step(cfg)
    # Runs first (they hold the time outside the steps), then the nearest size.
    best = min(same, key=lambda r: (r.overhead_s == 0, abs(math.log(tokens / r.tokens_per_step)), r.source))
    step = best.step_s * tokens / best.tokens_per_step
    return TimeEstimate(step, best.overhead_s + step * cfg.trainer.max_steps, best.source)


def run_record(run: Path) -> StepRecord | None:
    """The step time a completed run recorded (None: not completed, or written before exp recorded step times)."""
    layout = RunLayout(run)
    if read_status(run).get("status") != "completed" or not layout.summary.exists():
        return None
    try:
        summary = json.loads(layout.summary.read_text())
        cfg = OmegaConf.load(layout.config)
        manifest = json.loads(layout.manifest.read_text()) if layout.manifest.exists() else {}
    except (OSError, ValueError):
        return None
    step_s = summary.get("step_seconds_median")
    if not step_s or not summary.get("steps"):
        return None
    gpus = manifest.get("hardware", {}).get("gpus") or []
    device = gpus[0] if str(summary.get("device", "cpu")).startswith("cuda") and gpus else "cpu"
    tokens = int(cfg.trainer.global_batch_size) * int(cfg.data.max_seq_len)
    # The summary's seconds start inside the job; the launcher's measure (placements.jsonl beside the job) also
    # holds the process's start (interpreter, imports), which a study pays per job too.
    seconds = launcher_seconds(run) or float(summary["seconds"])
    overhead = max(0.0, seconds - step_s * int(summary["steps"]))
    peak = shape = None
    if device != "cpu" and summary.get("peak_memory_gib"):
        try:  # config.yaml holds what the preflight resolved
            shape = memory_shape(load_run_config(run))
            peak = int(float(summary["peak_memory_gib"]) * GiB)
        except (OSError, ValueError, OmegaConfBaseException, ConfigError):  # an older schema: no shape to match
            pass
    return StepRecord(str(run), str(cfg.model.name), device, tokens, float(step_s), overhead, peak, shape)


def bench_records(folder: Path = BENCH_RESULTS) -> list[StepRecord]:
    """exp.bench results: the `exp` rows (the framework's own path) of each benchmark file."""
    found = []
    for path in sorted(folder.glob("bench-*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        settings = data.get("settings", {})
        for row in data.get("rows", []):
            if row.get("side") != "exp" or row.get("status") != "ok" or not row.get("step_s_median"):
                continue
            tokens = int(row["micro_batch"]) * int(row.get("accumulate") or 1) * int(settings["seq"])
            found.append(
                StepRecord(path.name, str(settings["model"]), str(data.get("device")), tokens, row["step_s_median"], 0)
            )
    return found


def find_records(folders: list[Path]) -> list[StepRecord]:
    """Step times of the completed runs in `folders` (a run, a sweep, outputs/ or multirun/: three levels deep, and
    a sweep's jobs nested by a path in their overrides: exp.run.dirs.runs_under), and exp.bench's results."""
    records: list[StepRecord] = []
    seen: set[Path] = set()
    for folder in folders:
        if not folder.is_dir():
            continue
        runs = [s.parent for depth in range(4) for s in folder.glob("/".join(["*"] * depth + ["summary.json"]))]
        for depth in range(3):  # the folder as a sweep, a date of multirun/, a sweep of multirun/
            for parent in folder.glob("/".join(["*"] * depth)) if depth else [folder]:
                runs += [r for r in runs_under(parent) if (r / "summary.json").exists()] if parent.is_dir() else []
        for run in (r.resolve() for r in runs):
            if run not in seen and (record := run_record(run)) is not None:
                seen.add(run)
                records.append(record)
    return records + bench_records()
