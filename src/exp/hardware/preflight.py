"""Preflight: compare what the config asks for with what this process can see, before any CUDA call.

The classic QLoRA failures (`device >= 0 && device < num_gpus INTERNAL ASSERT FAILED`, `DeferredCudaCallError`, a
4-bit model on the wrong device) come from a mismatch between the devices a run asks for and the devices CUDA
exposes to the process. This module gathers the facts without initialising CUDA here (environment variables,
NVML through nvidia-smi, and a throw-away subprocess that asks torch), then `check` turns them into one clear
finding per problem, each naming the key, the value and the fix. `check` is a pure function of a config and an
`Environment`, so every finding can be tested on a machine without a GPU.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from exp.core.config import (
    Accelerator,
    HardwareConfig,
    LossImpl,
    QuantType,
    TrainConfig,
    batch_problems,
    config_problems,
)
from exp.core.constants import CONF_DIR, LAUNCH_ID_ENV
from exp.core.strategies import Strategy, strategy_traits
from exp.hardware.memory import (
    GiB,
    config_arch,
    estimate_for_config,
    fewest_checkpoint_layers,
    most_dequantized_layers,
    suggest_micro_batch,
)
from exp.model.families import family_row
from exp.model.loss_plan import plan_loss_impl

# Exit status of a run stopped by the preflight (2 is a configuration error, 1 a crash).
PREFLIGHT_EXIT = 3
# hardware.auto_checkpoint_layers keeps this fraction of the free memory unplanned. Chosen, not measured: the
# estimator's allocated peak was within +0.6% of the H200 measurements (benchmarks/results/memory_calibration_*),
# but the caching allocator's fragmentation under pressure has not been measured.
AUTO_CHECKPOINT_HEADROOM = 0.10
# hardware.auto_micro_batch goes no lower than this many tokens per micro-batch: below it the work every micro-batch
# pays whatever its size (dequantising each 4-bit weight in the forward and again in the backward, the kernel
# launches) outweighs the activations saved. On the H200 a 7B micro-batch of 2,048 x 8 tokens ran at 13,954 tokens/s
# and real data in micro-batches of ~2,000 tokens at 4,093 (benchmarks/results/bench-gemma_7b-*).
AUTO_MICRO_BATCH_MIN_TOKENS = 4096
# CUDA_VISIBLE_DEVICES as it was when this process first ran the preflight with CUDA still uninitialised: if CUDA
# gets initialised after that and the variable changes (a notebook re-run), torch's cached device list is stale.
_cvd_before_cuda_init: list[str | None] = []


@dataclass
class Gpu:
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int]


@dataclass
class Environment:
    """What this process can see. Built by `probe_environment`, or by hand in tests."""

    cuda_visible_devices: str | None = None
    torch_cuda: str | None = None  # CUDA runtime torch was built with ("13.0"); None for a CPU build
    gpus: list[Gpu] = field(default_factory=list)  # as a fresh process sees them (after CUDA_VISIBLE_DEVICES)
    probe_error: str | None = None  # what initialising CUDA in the probe raised
    driver_version: str | None = None
    driver_cuda: str | None = None  # newest CUDA runtime the driver supports ("12.4")
    mig_enabled: list[bool] = field(default_factory=list)  # per physical GPU, from NVML
    cuda_initialized: bool = False  # CUDA already initialised in *this* process
    cached_device_count: int | None = None  # the count CUDA fixed at its initialisation in this process
    cvd_at_init: str | None = None  # CUDA_VISIBLE_DEVICES when this process initialised CUDA, if known
    bnb_error: str | None = None  # a 4-bit op on the GPU failed in the probe
    start_method: str = "fork"  # multiprocessing's default start method here (DataLoader workers)


@dataclass
class Finding:
    key: str
    message: str

    def __str__(self) -> str:
        return f"[{self.key}] {self.message}"


@dataclass
class PreflightResult:
    cfg: TrainConfig  # the config with `auto` choices and `devices=-1` resolved
    findings: list[Finding]
    notes: list[str]  # decisions and warnings worth printing

    @property
    def ok(self) -> bool:
        return not self.findings


_PROBE = r"""
import json, os, sys
out = {}
try:
    import torch
    out["torch_cuda"] = torch.version.cuda
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            gpus.append({"name": p.name, "total_bytes": total, "free_bytes": free, "capability": [p.major, p.minor]})
    out["gpus"] = gpus
    if gpus and "--bnb" in sys.argv:
        try:
            import bitsandbytes.functional as F
            F.quantize_4bit(torch.randn(4096, device="cuda", dtype=torch.bfloat16), quant_type="nf4")
        except Exception as e:
            out["bnb_error"] = f"{type(e).__name__}: {e}"
except Exception as e:
    out["probe_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
print("EXP_PROBE " + json.dumps(out))
"""


def _nvidia_smi() -> dict:
    """Driver version, its CUDA version and MIG modes from NVML (via nvidia-smi), without touching CUDA."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    info: dict = {}
    try:
        q = subprocess.run(
            [exe, "--query-gpu=driver_version,mig.mode.current", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        rows = [r.split(",") for r in q.stdout.strip().splitlines() if r.strip()]
        if rows:
            info["driver_version"] = rows[0][0].strip()
            info["mig_enabled"] = [len(r) > 1 and r[1].strip() == "Enabled" for r in rows]
        header = subprocess.run([exe], capture_output=True, text=True, timeout=20).stdout
        if "CUDA Version:" in header:
            info["driver_cuda"] = header.split("CUDA Version:")[1].split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return info


def visible_gpus() -> tuple[list[str], str]:
    """The GPU ids a launcher in this process may hand out (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`), and where
    they were counted (for a message when there are none). CUDA is not touched."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [d.strip() for d in cvd.split(",") if d.strip()], f"CUDA_VISIBLE_DEVICES is {cvd!r}"
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "CUDA_VISIBLE_DEVICES is not set and there is no nvidia-smi (no NVIDIA driver)"
    out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30).stdout
    gpus = [str(i) for i, _ in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]
    return gpus, "`nvidia-smi -L` lists no GPU"


@dataclass
class GpuMemory:
    """One GPU as NVML lists it: the ids CUDA_VISIBLE_DEVICES may name it by, and its memory now."""

    index: str
    uuid: str
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int]


def gpu_memory() -> list[GpuMemory]:
    """Every GPU's total and free memory from NVML (nvidia-smi), without touching CUDA: what a launcher that packs
    several jobs onto one GPU plans with. Empty without a driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = "index,uuid,name,memory.total,memory.free,compute_cap"
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for row in out.strip().splitlines():
        parts = [p.strip() for p in row.split(",")]
        if len(parts) != 6:
            continue
        try:
            major, minor = (int(x) for x in parts[5].split("."))
            mib = 2**20
            found.append(
                GpuMemory(parts[0], parts[1], parts[2], int(parts[3]) * mib, int(parts[4]) * mib, (major, minor))
            )
        except ValueError:
            continue
    return found


def probe_environment(check_bitsandbytes: bool = False, need_gpus: bool = True) -> Environment:
    """Facts about this process's view of the hardware; CUDA is initialised only in a throw-away subprocess."""
    import multiprocessing

    import torch

    env = Environment(
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        torch_cuda=torch.version.cuda,
        cuda_initialized=torch.cuda.is_initialized(),
        start_method=multiprocessing.get_start_method(allow_none=True) or "fork",
    )
    if env.cuda_initialized:
        # The count the CUDA runtime fixed at initialisation. torch.cuda.device_count() may re-read NVML with the
        # current CUDA_VISIBLE_DEVICES instead, which is exactly the disagreement behind the INTERNAL ASSERT.
        env.cached_device_count = torch._C._cuda_getDeviceCount()
        env.cvd_at_init = _cvd_before_cuda_init[0] if _cvd_before_cuda_init else None
    elif not _cvd_before_cuda_init:
        _cvd_before_cuda_init.append(env.cuda_visible_devices)
    else:
        _cvd_before_cuda_init[0] = env.cuda_visible_devices
    if not need_gpus or torch.version.cuda is None:
        discard_started_probes()  # a CPU build of torch: nothing to probe
        return env
    smi = _nvidia_smi()
    env.driver_version, env.driver_cuda = smi.get("driver_version"), smi.get("driver_cuda")
    env.mig_enabled = smi.get("mig_enabled", [])
    try:
        stdout, stderr = _probe_output(check_bitsandbytes)
        line = next((ln for ln in stdout.splitlines() if ln.startswith("EXP_PROBE ")), None)
        if line is None:
            env.probe_error = (stderr.strip().splitlines() or ["the probe printed nothing"])[-1]
        else:
            data = json.loads(line[len("EXP_PROBE ") :])
            env.gpus = [
                Gpu(g["name"], g["total_bytes"], g["free_bytes"], tuple(g["capability"])) for g in data.get("gpus", [])
            ]
            env.probe_error, env.bnb_error = data.get("probe_error"), data.get("bnb_error")
    except (OSError, subprocess.SubprocessError) as e:
        env.probe_error = f"{type(e).__name__}: {e}"
    return env


# Probes started ahead by `start_probe`, by (arguments, CUDA_VISIBLE_DEVICES): one is used only by a process that
# still sees the devices it was started for.
_started_probes: dict[tuple[tuple[str, ...], str | None], subprocess.Popen] = {}
PROBE_TIMEOUT_S = 180


def _probe_args(check_bitsandbytes: bool) -> list[str]:
    return [sys.executable, "-c", _PROBE] + (["--bnb"] if check_bitsandbytes else [])


def probe_wanted(accelerator: str, quant_type: str) -> tuple[bool, bool]:
    """(whether the run may use a GPU, whether its 4-bit kernels are checked on it): what the probe is asked."""
    wants_gpu = accelerator != Accelerator.cpu.value
    return wants_gpu, wants_gpu and quant_type != QuantType.none.value


def start_probe(accelerator: str, quant_type: str) -> None:
    """Start the CUDA probe of a GPU run now, in the background. The probe is a fresh Python that imports torch and
    bitsandbytes and initialises CUDA (seconds), which `probe_environment` would otherwise wait for after this
    process has imported torch and Lightning itself; started first, the two overlap. Nothing starts without an
    NVIDIA driver (no nvidia-smi) or for a CPU run."""
    need_gpus, check_bnb = probe_wanted(accelerator, quant_type)
    if not need_gpus or shutil.which("nvidia-smi") is None:
        return
    args = _probe_args(check_bnb)
    key = (tuple(args), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if key not in _started_probes:
        _started_probes[key] = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy()
        )


def _probe_output(check_bitsandbytes: bool) -> tuple[str, str]:
    """The probe's stdout and stderr: from the probe `start_probe` started for this view of the devices, else
    from one run now."""
    args = _probe_args(check_bitsandbytes)
    proc = _started_probes.pop((tuple(args), os.environ.get("CUDA_VISIBLE_DEVICES")), None)
    if proc is None:
        done = subprocess.run(args, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=os.environ.copy())
        return done.stdout, done.stderr
    try:
        return proc.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


def discard_started_probes() -> None:
    """Stop the probes `start_probe` started that no preflight will read."""
    while _started_probes:
        _, proc = _started_probes.popitem()
        proc.kill()
        proc.communicate()


def _version_tuple(v: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (v or "").split(".")[:2])
    except ValueError:
        return ()


def _multi_node_problem(num_nodes: int, environ) -> str | None:
    """Why a run asking for `num_nodes` machines would wait forever here (None when a launcher says how many
    nodes took part: SLURM, or torchrun's / a cluster's MASTER_ADDR with NODE_RANK or GROUP_RANK)."""
    slurm = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
    if slurm:
        if slurm.isdigit() and int(slurm) < num_nodes:
            return (
                f"hardware.num_nodes={num_nodes}, but this SLURM job has {slurm} node(s): the run would wait for the "
                f"missing ones forever. Fix: hardware.num_nodes={slurm}, or ask SLURM for {num_nodes} nodes "
                "(sbatch --nodes)."
            )
        return None
    if environ.get("MASTER_ADDR") and (environ.get("NODE_RANK") or environ.get("GROUP_RANK")):
        return None
    return (
        f"hardware.num_nodes={num_nodes}, but this process was not started by a multi-node launcher (no SLURM job, "
        "no MASTER_ADDR with NODE_RANK): started on one machine it would wait for the other nodes forever. Fix: "
        "hardware.num_nodes=1 here, or launch on every node with torchrun --nnodes / SLURM (docs/hardware.md)."
    )


def check(cfg: TrainConfig, env: Environment, memory_check: bool = True) -> PreflightResult:
    """Resolve `auto` choices against `env` and list every mismatch between the config and the machine."""
    cfg = copy.deepcopy(cfg)
    hw = cfg.hardware
    findings: list[Finding] = []
    notes: list[str] = []
    visible = len(env.gpus)
    cvd = env.cuda_visible_devices

    # Resolve the automatic choices first, so every later check sees concrete values.
    if hw.accelerator == Accelerator.auto:
        hw.accelerator = Accelerator.gpu if visible else Accelerator.cpu
        if visible:
            notes.append(f"hardware=auto: {visible} GPU(s) visible -> accelerator=gpu")
        else:
            notes.append(f"hardware=auto: no GPU visible -> hardware=cpu{_as_cpu(cfg)}")
    on_gpu = hw.accelerator == Accelerator.gpu
    if hw.num_nodes > 1 and (problem := _multi_node_problem(hw.num_nodes, os.environ)):
        findings.append(Finding("hardware.num_nodes", problem))

    # CUDA's device list is fixed at initialisation; a later CUDA_VISIBLE_DEVICES change is invisible to it.
    if env.cuda_initialized:
        changed = env.cvd_at_init is not None and env.cvd_at_init != cvd
        stale = env.cached_device_count is not None and not env.probe_error and env.cached_device_count != visible
        if changed or stale:
            findings.append(
                Finding(
                    "CUDA_VISIBLE_DEVICES",
                    f"CUDA was initialised in this process with CUDA_VISIBLE_DEVICES={env.cvd_at_init!r} "
                    f"({env.cached_device_count} device(s)) and the variable is now {cvd!r} ({visible} device(s)). CUDA "
                    "reads it only once, so torch's device numbering no longer matches it and the next CUDA call fails "
                    "with 'device >= 0 && device < num_gpus INTERNAL ASSERT FAILED'. Fix: restart the Python process "
                    "(notebook kernel) after changing CUDA_VISIBLE_DEVICES, or set it before anything imports torch.",
                )
            )
        if hw.num_workers > 0 and env.start_method == "fork":
            findings.append(
                Finding(
                    "hardware.num_workers",
                    f"hardware.num_workers={hw.num_workers} with CUDA already initialised in this process: DataLoader "
                    "workers are forked, and a forked child cannot use the parent's CUDA context (RuntimeError: Cannot "
                    "re-initialize CUDA in forked subprocess). Fix: hardware.num_workers=0, or run exp.train in a fresh "
                    "process.",
                )
            )

    if on_gpu:
        if env.torch_cuda is None:
            findings.append(
                Finding(
                    "hardware.accelerator",
                    "hardware.accelerator=gpu, but this torch is a CPU-only build (torch.version.cuda is None). Fix: "
                    "install a CUDA build of torch, or use hardware=cpu (or hardware=auto to pick what is there).",
                )
            )
        elif env.probe_error and not env.gpus:
            hint = ""
            if "too old" in env.probe_error or "driver" in env.probe_error.lower():
                hint = " The driver is older than the CUDA runtime torch was built with: update the NVIDIA driver."
            findings.append(
                Finding(
                    "hardware.accelerator",
                    f"hardware.accelerator=gpu, but initialising CUDA failed: {env.probe_error}.{hint} Fix: repair the "
                    "driver / CUDA setup (python -m exp.doctor shows the versions), or use hardware=cpu.",
                )
            )
        elif not env.gpus:
            findings.append(
                Finding(
                    "hardware.accelerator",
                    f"hardware.accelerator=gpu ({_strategy_name(cfg)}), but this process sees no GPU "
                    f"(CUDA_VISIBLE_DEVICES={cvd!r}). Fix: hardware=cpu, hardware=auto, or make a GPU visible "
                    "(an empty or wrong CUDA_VISIBLE_DEVICES hides them).",
                )
            )
        driver, runtime = _version_tuple(env.driver_cuda), _version_tuple(env.torch_cuda)
        if driver and runtime and driver < runtime:
            findings.append(
                Finding(
                    "driver",
                    f"the NVIDIA driver {env.driver_version} supports CUDA up to {env.driver_cuda}, but torch was built "
                    f"for CUDA {env.torch_cuda}. CUDA calls will fail (often as a DeferredCudaCallError at the first "
                    "one). Fix: update the driver, or install a torch build for CUDA <= "
                    f"{env.driver_cuda}.",
                )
            )
        if any(env.mig_enabled):
            mig_selected = [d for d in (cvd or "").split(",") if d.strip().startswith("MIG-")]
            if len(mig_selected) != 1:
                findings.append(
                    Finding(
                        "CUDA_VISIBLE_DEVICES",
                        f"MIG is enabled on this machine's GPU(s) and CUDA_VISIBLE_DEVICES={cvd!r} does not select "
                        "exactly one MIG instance. A process can use only one MIG instance, and device indices do not "
                        "address MIG slices. Fix: export CUDA_VISIBLE_DEVICES=MIG-<uuid> with one UUID from "
                        "`nvidia-smi -L`.",
                    )
                )
        if env.gpus and cfg.quantization.quant_type != QuantType.none and env.bnb_error:
            findings.append(
                Finding(
                    "quantization",
                    f"quantization={cfg.quantization.quant_type.value}, but bitsandbytes' GPU kernel failed in the probe "
                    f"({env.bnb_error}): its native library for this CUDA ({env.torch_cuda}) is missing or broken. Fix: "
                    "pip install -U bitsandbytes (a release built for your CUDA), or quantization=none.",
                )
            )

    # Devices: resolve -1, then compare with what is visible.
    if on_gpu and env.gpus:
        if hw.devices == -1:
            # auto may choose a strategy of several GPUs: it takes every visible one until it has chosen
            several = hw.strategy == Strategy.auto or strategy_traits(hw.strategy).uses_several_devices
            hw.devices = visible if several else 1
        if hw.devices > visible:
            findings.append(
                Finding(
                    "hardware.devices",
                    f"hardware.devices={hw.devices} ({_strategy_name(cfg)}) but this process sees {visible} GPU(s) "
                    f"(CUDA_VISIBLE_DEVICES={cvd!r}). Asking for more is what ends in 'device >= 0 && device < "
                    f"num_gpus INTERNAL ASSERT FAILED'. Fix: hardware.devices={visible}, or make more GPUs visible. "
                    "Note that CUDA_VISIBLE_DEVICES renumbers: with CUDA_VISIBLE_DEVICES=1 that GPU is cuda:0.",
                )
            )
    elif not on_gpu and hw.devices == -1:
        hw.devices = 1

    # Before the memory decisions: compiled layers save less (exp.hardware.memory), and the attention kernel decides
    # whether scores are held per token pair.
    _resolve_preference_batches(cfg, notes)
    _resolve_compile(cfg, env, on_gpu, notes)
    _resolve_fuse_lora(cfg, notes)
    _resolve_padding_free_attention(cfg, env, on_gpu, notes)
    if on_gpu and env.gpus and not findings:
        _resolve_strategy_and_precision(cfg, env, findings, notes, memory_check)
    if hw.strategy == Strategy.auto:
        # No GPU to choose among, or a problem found before the choice: one process. Everything after the
        # preflight asks what the strategy means (exp.core.strategies), which `auto` does not say.
        hw.strategy = Strategy.single_device
    if hw.precision == "auto":
        hw.precision = "32-true" if not on_gpu else "bf16-mixed"
    if hw.loss_impl == LossImpl.auto:  # after the strategy: FSDP keeps transformers' loss
        hw.loss_impl = plan_loss_impl(cfg, on_cuda=on_gpu).impl
    t = cfg.trainer
    if t.warmup_step_count >= t.max_steps:
        # Only a whole number of warmup steps can outlast the run (a fraction is < 1 of it): what was asked for runs.
        notes.append(
            f"trainer.warmup_steps={t.warmup_steps:g} >= trainer.max_steps={t.max_steps}: the learning rate rises for "
            f"the whole run and never reaches trainer.learning_rate={t.learning_rate:g}; lower the warmup, or give it "
            "as a fraction of the run (e.g. trainer.warmup_steps=0.03), for a full schedule"
        )
    # The schema's cross-field checks once more, on the resolved values: `hardware=auto` may have become the CPU,
    # where e.g. int8 quantization or a paged optimizer cannot run.
    batch = batch_problems(hw, cfg.trainer)
    resolved = [p for p in config_problems(cfg) if p not in batch]
    findings += [Finding("hardware=auto", f"resolved for this machine, the config is invalid: {p}") for p in resolved]
    findings += [Finding("trainer.global_batch_size", p) for p in batch]
    return PreflightResult(cfg, findings, notes)


def _as_cpu(cfg: TrainConfig) -> str:
    """Give `cfg.hardware` the values of hardware=cpu wherever it holds the GPU defaults that hardware=auto inherits
    (conf/hardware/auto.yaml); a value set on the command line stays. Says which fields changed (" (a: x -> y)")."""
    cpu, hw = HardwareConfig(), cfg.hardware
    changed = []
    for name, auto_value in _auto_group_values().items():
        value, cpu_value = getattr(hw, name), getattr(cpu, name)
        if value == auto_value and value != cpu_value and name != "accelerator":
            setattr(hw, name, cpu_value)
            changed.append(f"{name}: {_shown(value)} -> {_shown(cpu_value)}")
    return f" ({', '.join(changed)})" if changed else ""


def _shown(value: object) -> str:
    value = getattr(value, "value", value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _auto_group_values() -> dict[str, object]:
    """conf/hardware/auto.yaml as composed (its defaults list first), read as YAML: the preflight runs inside Hydra,
    where composing another config would replace the running one."""
    import yaml  # only for hardware=auto on a CPU

    def values(name: str) -> dict[str, object]:
        text = yaml.safe_load((CONF_DIR / "hardware" / f"{name}.yaml").read_text()) or {}
        merged: dict[str, object] = {}
        for parent in text.pop("defaults", []):
            merged.update(text if parent == "_self_" else values(parent))
        return merged | text

    return values("auto")


def compile_problem(env: Environment) -> str | None:
    """Why torch.compile cannot build GPU kernels here (None when it can): Inductor's GPU code is Triton, which
    needs compute capability >= 7.0."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (Inductor generates Triton kernels for GPUs)"
    old = [g for g in env.gpus if g.capability < (7, 0)]
    if old:
        return f"{old[0].name} has compute capability {old[0].capability[0]}.{old[0].capability[1]} (Triton needs 7.0)"
    return None


def _resolve_preference_batches(cfg: TrainConfig, notes: list[str]) -> None:
    """A preference micro-batch is `hardware.micro_batch_size` pairs (KTO: examples), each completion a row of its
    own scored apart. With `hardware.padding_free` (on in hardware=gpu) the micro-batch's rows are laid end to end in
    one row (exp.data.preference.collate_flat_preference), without a token budget: the pairs per micro-batch stay
    what the memory estimate of padded rows sized, and the rows cost their real tokens. Eager attention (Gemma 2's,
    for its softcapping) would compute every query-key pair of that one long row, so it keeps padded rows, with a
    note, before the choices that depend on it (the attention kernel, the memory estimate)."""
    hw = cfg.hardware
    if not cfg.objective.preference or not hw.padding_free:
        return
    hw.micro_batch_tokens = None
    if cfg.model.attn_implementation != "eager":
        return
    hw.padding_free = False
    notes.append(
        f"objective={cfg.objective.kind.value} with eager attention (model.attn_implementation=eager): "
        f"hardware.padding_free=true is not used. A micro-batch's {2 * hw.micro_batch_size} completion rows laid end "
        "to end would make eager attention score every token of the row against every other, so they stay padded "
        "rows; set hardware.padding_free=false to silence this note"
    )


def _resolve_compile(cfg: TrainConfig, env: Environment, on_gpu: bool, notes: list[str]) -> None:
    """hardware.compile: "auto" is on for a CUDA GPU and off on the CPU; on a GPU that cannot compile, off + a note."""
    hw = cfg.hardware
    wanted = hw.compile
    if wanted == "auto":
        hw.compile = on_gpu
    if hw.compile is True and on_gpu and env.gpus and (problem := compile_problem(env)):
        hw.compile = False
        notes.append(f"hardware.compile={wanted}: {problem}; the decoder layers run eagerly (slower, more memory)")


def _resolve_fuse_lora(cfg: TrainConfig, notes: list[str]) -> None:
    """hardware.fuse_lora: "auto" is on, except for an objective with a reference (DPO, KTO). That loss rests on the
    difference between the policy's log-probabilities and the reference's, which the two passes must round alike.
    PEFT's path rounds the base product alone, then adds the LoRA term: an output element whose LoRA term is below
    half a unit in the last place (ulp) of the base's stays the reference's exactly. The fused product rounds base
    and LoRA term together, so wherever the base's exact value lies near a rounding boundary the element moves by a
    whole ulp: the policy-reference difference of an output is off by about sqrt(ulp x |term|), far more than the
    term itself while the adapters are small (docs/objectives.md measures both). An explicit true is kept."""
    hw = cfg.hardware
    if hw.fuse_lora != "auto":
        return
    hw.fuse_lora = not cfg.objective.uses_reference
    if not hw.fuse_lora and (hw.dequantized_layers or hw.auto_dequantized_layers):  # where it would have acted
        notes.append(
            f"objective={cfg.objective.kind.value}: hardware.fuse_lora=auto -> false. The loss compares the policy "
            "with its reference, and LoRA's B inside the base product would round the two passes apart by more than "
            "the adapters move them (docs/objectives.md); the LoRA product is added after the base product"
        )


def _resolve_padding_free_attention(cfg: TrainConfig, env: Environment, on_gpu: bool, notes: list[str]) -> None:
    """Rows of several examples (padding-free micro-batches, packed rows) need an attention kernel that keeps the
    examples apart without computing attention across them.

    SDPA keeps them apart with a dense block-diagonal mask over the whole row, built by transformers from the
    position ids, and its kernel computes every block of the row: cost grows with the row's length squared. On a
    GPU with FlashAttention (compute capability >= 8.0, torch >= 2.10) Gemma and Gemma 3 take `varlen` instead
    (exp.model.varlen: each example's attention alone, sliding window included). Eager attention (Gemma 2's, for
    its logit softcapping, which SDPA and varlen lack) materialises heads x T x T scores for a row of T tokens, so
    Gemma 2's padding-free micro-batches are rows of at most data.max_seq_len tokens, as many as the token budget
    holds (exp.data.padding_free): no more scores than padded rows, and no padding but each row's tail.
    `flex_attention` (softcapping as its score modifier, the examples as its block mask) takes one row per
    micro-batch when chosen by hand. It is not chosen for the user: on one H100 its Gemma 2 2B run's first training
    step had not finished after 82 s (compiling), and its eager validation materialises the whole score matrix
    (benchmarks/results/families_h100_20261206). The CPU caps eager rows the same way (exp.data.datamodule's
    `flat_batching`), so the GPU configuration's CPU twin runs these micro-batches."""
    packed_rows = cfg.data.packing or cfg.hardware.padding_free
    if not packed_rows or not on_gpu:
        return
    attn = cfg.model.attn_implementation
    if attn == "sdpa" and not family_row(cfg.model.family).softcaps_attention:
        problem = _varlen_problem(env)
        if problem is None:
            cfg.model.attn_implementation = "varlen"
            notes.append(
                "rows of several examples: model.attn_implementation=varlen instead of sdpa (FlashAttention over each "
                "example alone; SDPA's block-diagonal mask computes attention across the whole row)"
            )
        else:
            notes.append(f"rows of several examples keep SDPA's block-diagonal mask: {problem}")
        return
    if cfg.data.packing:
        return
    if attn == "eager" and cfg.hardware.padding_free:
        notes.append(
            "rows of several examples: eager attention (Gemma 2's, for its softcapping) computes every query-key "
            "pair of a row, so padding-free micro-batches are rows of at most "
            f"data.max_seq_len={cfg.data.max_seq_len} tokens (no more scores than padded rows of that length)"
        )


def _varlen_problem(env: Environment) -> str | None:
    """Why exp.model.varlen's CUDA kernel cannot run here (None when it can), without importing torch."""
    import importlib.metadata

    try:
        major, minor = (int(x) for x in importlib.metadata.version("torch").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return "torch's version is unknown"
    if (major, minor) < (2, 10):
        return f"torch {major}.{minor} has no varlen FlashAttention (torch >= 2.10 has)"
    if env.gpus and min(g.capability for g in env.gpus) < (8, 0):
        return "FlashAttention needs compute capability >= 8.0"
    return None


def _strategy_name(cfg: TrainConfig) -> str:
    return f"hardware.strategy={cfg.hardware.strategy.value}"


def _resolve_strategy_and_precision(
    cfg: TrainConfig, env: Environment, findings: list[Finding], notes: list[str], memory_check: bool
) -> None:
    hw = cfg.hardware
    # auto chooses among strategies of one GPU per process; model parallelism's one process uses them all.
    spans = hw.strategy != Strategy.auto and strategy_traits(hw.strategy).spans_devices_in_one_process
    used = env.gpus if spans else env.gpus[: hw.devices]
    min_cc = min(g.capability for g in used)
    if hw.precision in ("auto", "bf16-mixed") and min_cc < (8, 0):
        # Ampere (8.0) is the first with bf16 tensor cores; torch.cuda.is_bf16_supported() can say yes regardless.
        if family_row(cfg.model.family).fp16_overflows:
            findings.append(
                Finding(
                    "hardware.precision",
                    f"{used[0].name} (compute capability {min_cc[0]}.{min_cc[1]}) has no bf16, and "
                    f"{cfg.model.family.value} overflows in fp16 (its activations exceed 65504). Fix: a GPU with compute "
                    "capability >= 8.0 (A100, L4, H100, RTX 30xx+), or hardware.precision=32-true with quantization "
                    "(slow but exact).",
                )
            )
            return
        notes.append(
            f"{used[0].name} (compute capability {min_cc[0]}.{min_cc[1]}) has no bf16: using 16-mixed (fp16 with loss "
            "scaling). Gemma can overflow in fp16; watch for NaN losses."
        )
        hw.precision = "16-mixed"
    elif hw.precision == "auto":
        hw.precision = "bf16-mixed"
    if hw.strategy == Strategy.fsdp and hw.devices * hw.num_nodes == 1:
        # One process shards nothing, and FSDP's one-process mode (NO_SHARD) fails on the 4-bit weights: torch
        # asserts "as_params=True type(prim_param)=<class 'torch.Tensor'>" after the first forward (seen on an H200).
        hw.strategy = Strategy.single_device
        notes.append(
            "hardware.strategy=fsdp with 1 GPU: nothing to shard, so one process on that GPU (as hardware=gpu); "
            "FSDP needs hardware.devices >= 2"
        )
    if not memory_check:
        if hw.strategy == Strategy.auto:
            hw.strategy = Strategy.ddp if hw.devices > 1 else Strategy.single_device
        return

    budget = _memory_budget(hw, [g.free_bytes for g in used])
    free = budget.allowed
    if hw.strategy == Strategy.auto:
        # A whole replica on each GPU (one GPU, or DDP) where it fits, else FSDP's shards. The replica is estimated
        # with the strategy that holds it, since the estimate asks what the strategy means.
        hw.strategy = Strategy.single_device if hw.devices == 1 else Strategy.ddp
        replica = estimate_for_config(cfg).total
        if hw.strategy == Strategy.ddp and replica > free:
            hw.strategy = Strategy.fsdp
        notes.append(
            f"hardware=auto: {len(env.gpus)} x {env.gpus[0].name}, estimated {replica / 2**30:.1f} GiB per replica "
            f"-> strategy={hw.strategy.value}, devices={hw.devices}, precision={hw.precision}"
        )
    strategy = strategy_traits(hw.strategy)
    shards = strategy.weight_shards(hw.devices)
    if strategy.spans_devices_in_one_process:
        budget = _memory_budget(hw, [sum(g.free_bytes for g in used)], len(used))  # spread over all of them
        free = budget.allowed
    # offload_checkpoints keeps every layer recomputed (its whole point is the memory of their inputs).
    auto_layers = (
        hw.auto_checkpoint_layers
        and hw.gradient_checkpointing
        and hw.checkpoint_layers is None
        and not hw.offload_checkpoints
    )
    if (auto_layers or hw.auto_micro_batch) and os.environ.get(LAUNCH_ID_ENV):
        # Each rank of a torchrun / SLURM launch runs its own preflight, and the free memory it sees changes as the
        # other ranks start: the ranks could choose differently. exp's own launcher decides once for all.
        notes.append(
            "hardware.auto_checkpoint_layers / auto_micro_batch: not applied in a torchrun / SLURM rank (the ranks "
            f"would each choose from the memory they see); micro-batch {hw.micro_batch_size}, every layer recomputes. "
            "Choose with hardware.micro_batch_size=N and hardware.checkpoint_layers=N."
        )
    else:
        if hw.auto_micro_batch:
            _fit_micro_batch(cfg, budget, shards, auto_layers, notes)
        if auto_layers:
            _fit_checkpointing(cfg, budget, shards, notes)
        if hw.auto_dequantized_layers and hw.dequantized_layers == 0:
            _fit_dequantized(cfg, budget, shards, notes)
    estimate = estimate_for_config(cfg, num_shards=shards)
    if estimate.total > free:
        fits = suggest_micro_batch(cfg, free, num_shards=shards)
        fix = (
            f"hardware.micro_batch_size={fits} (trainer.global_batch_size keeps the optimisation the same)"
            if fits
            else "hardware=fsdp or a shorter data.max_seq_len"
        )
        findings.append(
            Finding(
                "memory",
                f"the estimated peak is {estimate.total / 2**30:.1f} GiB per GPU but {free / 2**30:.1f} GiB is "
                f"{'allowed (hardware.memory_budget_gib, or the free memory)' if budget.capped else 'free'} on "
                f"{used[0].name}:\n{estimate.as_table()}\nFix: {fix}; or hardware.gradient_checkpointing=true.",
            )
        )


@dataclass
class _Budget:
    """The memory a run may plan for, per device: `allowed` for the memory check, `planned` for the choices made by
    memory, and where `planned` comes from."""

    allowed: int
    planned: int
    reason: str
    capped: bool  # hardware.memory_budget_gib is set


def _memory_budget(hw, free: list[int], devices: int = 1) -> _Budget:
    """From the free memory the process sees (per device, or one total for model parallelism over `devices`).

    An explicit hardware.memory_budget_gib is the run's own cap: no headroom is taken off it (the estimate's `total`
    already counts the CUDA context and the allocator's slack); the free memory keeps AUTO_CHECKPOINT_HEADROOM.
    """
    measured = min(free)
    planned = int(measured * (1 - AUTO_CHECKPOINT_HEADROOM))
    reason = f"the free memory less {AUTO_CHECKPOINT_HEADROOM:.0%} headroom"
    if hw.memory_budget_gib is None:
        return _Budget(measured, planned, reason, capped=False)
    cap = int(hw.memory_budget_gib * 2**30) * devices
    if cap <= planned:
        planned, reason = cap, f"hardware.memory_budget_gib={hw.memory_budget_gib:g}"
    return _Budget(min(measured, cap), planned, reason, capped=True)


def _fit_micro_batch(cfg: TrainConfig, budget: _Budget, shards: int, auto_layers: bool, notes: list[str]) -> None:
    """hardware.auto_micro_batch: the largest micro-batch (a divisor of the per-device global batch) that fits the
    budget without recomputing layers (with auto_checkpoint_layers; else with the checkpointing as configured), no
    smaller than AUTO_MICRO_BATCH_MIN_TOKENS tokens. When none fits, the smallest allowed one, and the layer choice
    (or the memory check) takes it from there."""

    hw, t = cfg.hardware, cfg.trainer
    per_device = t.global_batch_size // cfg.data_parallel_size
    if per_device < 1 or t.global_batch_size % cfg.data_parallel_size:
        return  # the batch checks explain it
    seq = cfg.data.max_seq_len
    if hw.padding_free and not cfg.data.packing and not cfg.objective.preference and hw.micro_batch_tokens is None:
        _fit_token_budget(cfg, budget, shards, auto_layers, notes)
        return
    divisors = [m for m in range(per_device, 0, -1) if per_device % m == 0]
    allowed = [m for m in divisors if m * seq >= AUTO_MICRO_BATCH_MIN_TOKENS] or divisors[:1]
    trial = copy.deepcopy(cfg)
    if auto_layers:
        trial.hardware.gradient_checkpointing, trial.hardware.checkpoint_layers = False, None
    chosen, fitted = allowed[-1], False
    for m in allowed:
        trial.hardware.micro_batch_size = m
        if estimate_for_config(trial, num_shards=shards).total <= budget.planned:
            chosen, fitted = m, True
            break
    before, hw.micro_batch_size = hw.micro_batch_size, chosen
    trial.hardware.micro_batch_size = chosen
    est = estimate_for_config(trial, num_shards=shards).total / GiB
    how = "no recomputed layer" if auto_layers else "the configured checkpointing"
    verdict = (
        f"the largest with {how} within {budget.planned / GiB:.1f} GiB ({budget.reason}; estimated {est:.1f} GiB)"
        if fitted
        else f"the smallest of at least {AUTO_MICRO_BATCH_MIN_TOKENS} tokens; even it needs {est:.1f} GiB with {how} "
        f"(within {budget.planned / GiB:.1f} GiB: {budget.reason})"
    )
    steps = per_device // chosen
    notes.append(
        f"hardware.auto_micro_batch: micro-batch {chosen} x {seq} tokens (was {before}), {steps} micro-batch(es) "
        f"per optimiser step: {verdict}"
    )


def _fit_token_budget(cfg: TrainConfig, budget: _Budget, shards: int, auto_layers: bool, notes: list[str]) -> None:
    """hardware.auto_micro_batch with padding_free: the token budget of one micro-batch, m x data.max_seq_len for
    the largest m (up to the per-device global batch, any whole number: padding-free micro-batches hold as many
    examples as fit, not a fixed count) whose estimate fits without recomputing layers. The estimate of m padded rows
    of max_seq_len bounds a row of m x max_seq_len tokens: the same tokens, and attention that never spans more than
    one example. micro_batch_size becomes the largest divisor of the per-device batch up to m (validation batches)."""

    hw, t = cfg.hardware, cfg.trainer
    per_device = t.global_batch_size // cfg.data_parallel_size
    seq = cfg.data.max_seq_len
    trial = copy.deepcopy(cfg)
    if auto_layers:
        trial.hardware.gradient_checkpointing, trial.hardware.checkpoint_layers = False, None
    chosen, fitted = 1, False
    for m in range(per_device, 0, -1):
        trial.hardware.micro_batch_size = m
        if estimate_for_config(trial, num_shards=shards).total <= budget.planned:
            chosen, fitted = m, True
            break
    hw.micro_batch_tokens = chosen * seq
    hw.micro_batch_size = max(d for d in range(1, chosen + 1) if per_device % d == 0)
    trial.hardware.micro_batch_size = chosen
    est = estimate_for_config(trial, num_shards=shards).total / GiB
    how = "no recomputed layer" if auto_layers else "the configured checkpointing"
    verdict = (
        f"the most with {how} within {budget.planned / GiB:.1f} GiB ({budget.reason}; estimated {est:.1f} GiB)"
        if fitted
        else f"one example's worth; even it needs {est:.1f} GiB with {how} (within {budget.planned / GiB:.1f} GiB: "
        f"{budget.reason})"
    )
    notes.append(
        f"hardware.auto_micro_batch: padding-free micro-batches of at most {hw.micro_batch_tokens} tokens "
        f"({chosen} x {seq}): {verdict}"
    )


def _fit_checkpointing(cfg: TrainConfig, budget: _Budget, shards: int, notes: list[str]) -> None:
    """hardware.auto_checkpoint_layers: recompute as few decoder layers as fit the budget (recomputing costs time)."""

    hw = cfg.hardware
    k = fewest_checkpoint_layers(cfg, budget.planned, num_shards=shards)
    layers = int(config_arch(cfg)["num_hidden_layers"])
    if k is None:  # nothing fits: recompute everything (as asked), and let the memory check explain
        return
    hw.gradient_checkpointing, hw.checkpoint_layers = k > 0, (k if 0 < k < layers else None)
    est = estimate_for_config(cfg, num_shards=shards).total / GiB
    choice = "none" if k == 0 else "all" if k == layers else f"the first {k}"
    notes.append(
        f"hardware.auto_checkpoint_layers: {choice} of {layers} decoder layers recompute their activations "
        f"(estimated peak {est:.1f} GiB, within {budget.planned / GiB:.1f} GiB: {budget.reason})"
    )


def _fit_dequantized(cfg: TrainConfig, budget: _Budget, shards: int, notes: list[str]) -> None:
    """hardware.auto_dequantized_layers: keep as many layers' 4-bit weights dequantized as the budget has room for
    once the micro-batch and the recomputed layers are chosen (so it never costs a recomputed layer). Only where each
    device holds the whole model (single device, DDP): FSDP holds no whole layer (the config check refuses an
    explicit count there), and model parallelism's budget is the sum over its GPUs."""

    hw = cfg.hardware
    if cfg.quantization.quant_type not in (QuantType.nf4, QuantType.fp4):
        return
    if not strategy_traits(hw.strategy).whole_model_on_each_device:
        return
    k = most_dequantized_layers(cfg, budget.planned, num_shards=shards)
    if k == 0:
        return
    hw.dequantized_layers = k
    layers = int(config_arch(cfg)["num_hidden_layers"])
    est = estimate_for_config(cfg, num_shards=shards)
    notes.append(
        f"hardware.auto_dequantized_layers: {'all' if k == layers else f'the first {k}'} of {layers} decoder layers "
        f"keep their weights dequantized ({est.dequantized_weights / GiB:.1f} GiB; estimated peak "
        f"{est.total / GiB:.1f} GiB, within {budget.planned / GiB:.1f} GiB: {budget.reason})"
    )


def run_preflight(cfg: TrainConfig, env: Environment | None = None) -> PreflightResult:
    """Probe (unless given an environment) and check. Cheap on the CPU: no subprocess when no GPU is involved."""
    wants_gpu, check_bnb = probe_wanted(cfg.hardware.accelerator.value, cfg.quantization.quant_type.value)
    if env is None:
        env = probe_environment(check_bitsandbytes=check_bnb, need_gpus=wants_gpu)
    return check(cfg, env)


def format_findings(result: PreflightResult) -> str:
    lines = [f"exp: preflight found {len(result.findings)} problem(s):"]
    lines += [f"  - {f}" for f in result.findings]
    return "\n".join(lines)
