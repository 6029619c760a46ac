"""`python -m exp.doctor [overrides]`: what this machine offers, and whether the composed run fits it.

Prints the library versions, every GPU (name, memory, compute capability, MIG mode) and CUDA_VISIBLE_DEVICES,
then runs the training preflight and the memory estimate for the config the same overrides would give
`exp.train`. Exit status 0 when the run would start, 3 when the preflight found problems, 2 for a config error.
Nothing is trained, no run directory is written, and CUDA is not initialised in this process.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys

from exp.core.cli import Parsed, Tool, run_tool
from exp.core.config import Accelerator, QuantType
from exp.core.strategies import strategy_traits
from exp.hardware.memory import estimate_for_config
from exp.hardware.preflight import PREFLIGHT_EXIT, check, probe_environment
from exp.run.compose import compose_config

TOOL = Tool("exp.doctor", __doc__, hydra=True)


def _version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


def report_environment(env) -> str:
    lines = [
        f"python        {platform.python_version()} ({sys.executable})",
        *(
            f"{n:<13} {_version(n)}"
            for n in ("torch", "transformers", "peft", "bitsandbytes", "lightning", "hydra-core")
        ),
        f"torch CUDA    {env.torch_cuda or 'none (CPU build)'}",
        f"driver        {env.driver_version or 'none found'}"
        + (f" (CUDA <= {env.driver_cuda})" if env.driver_cuda else ""),
        f"CUDA_VISIBLE_DEVICES={env.cuda_visible_devices!r}",
        f"CUDA initialised in this process: {env.cuda_initialized}",
    ]
    if env.mig_enabled:
        lines.append(f"MIG mode per physical GPU: {['on' if m else 'off' for m in env.mig_enabled]}")
    if env.probe_error:
        lines.append(f"CUDA probe error: {env.probe_error}")
    if env.bnb_error:
        lines.append(f"bitsandbytes GPU kernel: FAILED ({env.bnb_error})")
    lines.append(f"GPUs visible: {len(env.gpus)}")
    for i, g in enumerate(env.gpus):
        lines.append(
            f"  cuda:{i}  {g.name}  {g.total_bytes / 2**30:.1f} GiB total, {g.free_bytes / 2**30:.1f} GiB free, "
            f"compute capability {g.capability[0]}.{g.capability[1]}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_tool(TOOL, _doctor, argv)


def _doctor(args: Parsed) -> int:
    cfg = compose_config(args.passed)
    # The doctor always looks at the GPUs, whatever the config asks for.
    env = probe_environment(check_bitsandbytes=cfg.quantization.quant_type != QuantType.none, need_gpus=True)
    print("== environment ==")
    print(report_environment(env))
    result = check(cfg, env)
    hw = result.cfg.hardware
    print("\n== run ==")
    print(
        f"model={cfg.model.name} quantization={cfg.quantization.quant_type.value} lora.r={cfg.lora.r} "
        f"hardware: accelerator={hw.accelerator.value} devices={hw.devices} strategy={hw.strategy.value} "
        f"precision={hw.precision} micro_batch_size={hw.micro_batch_size} "
        f"gradient_checkpointing={hw.gradient_checkpointing}"
        f"{f' checkpoint_layers={hw.checkpoint_layers}' if hw.gradient_checkpointing and hw.checkpoint_layers is not None else ''}"
        f" loss_impl={result.cfg.hardware.loss_impl.value} data.max_seq_len={cfg.data.max_seq_len}"
    )
    for note in result.notes:
        print(f"note: {note}")
    shards = strategy_traits(hw.strategy).weight_shards(hw.devices)
    estimate = estimate_for_config(result.cfg, num_shards=shards)
    print(f"\n== memory estimate per {'GPU' if hw.accelerator == Accelerator.gpu else 'device'} ==")
    print(estimate.as_table())
    print("\n== verdict ==")
    if result.ok:
        print("OK: the preflight found no problem; `python -m exp.train` with these overrides would start.")
        return 0
    for f in result.findings:
        print(f"PROBLEM {f}")
    return PREFLIGHT_EXIT


if __name__ == "__main__":
    sys.exit(main())
