"""profile=true: torch.profiler over the first timed steps of an exp variant, and where their device time went
(kernels, or on the CPU operators, summed by what they do)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

PROFILED_STEPS = 2  # the first timed steps profiled

# Kernel (or, on the CPU, operator) names by what they do, first match wins: the profile's summary.
PROFILE_CATEGORIES = (
    ("dequantize 4-bit", re.compile(r"dequant", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|_efficient_attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm\d+_|::mm|::addmm|::bmm|::linear|matmul", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
    ("fused loss (liger / chunked)", re.compile(r"liger|cross_entropy|element_mul|log_softmax", re.I)),
    ("compiled (Triton)", re.compile(r"^triton_|triton", re.I)),
    ("copy / cast / fill", re.compile(r"copy|cast|memcpy|memset|fill|to_copy|cat|clone", re.I)),
)


def profile_summary(
    events: list[tuple[str, float, int]],
    steps: int,
    top: int = 25,
    wall_s: list[float] | None = None,
) -> dict[str, Any]:
    """Where the time of `steps` profiled steps went: per category and the `top` names, in ms per step.
    `events`: (name, self time in microseconds, calls) per kernel (CUDA) or operator (CPU). `wall_s`: the steps'
    wall-clock times; the device is idle for the part of them its kernels do not fill."""
    by_name: dict[str, list[float]] = {}
    for name, us, calls in events:
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += calls
    total = sum(v[0] for v in by_name.values()) or 1.0
    categories: dict[str, float] = {}
    for name, (us, _) in by_name.items():
        cat = next((c for c, rx in PROFILE_CATEGORIES if rx.search(name)), "other")
        categories[cat] = categories.get(cat, 0.0) + us
    ms = lambda us: round(us / 1000 / steps, 3)  # noqa: E731
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    wall_ms = round(sum(wall_s) * 1000 / len(wall_s), 3) if wall_s else None
    return {
        "steps": steps,
        "total_ms_per_step": ms(total),
        "wall_ms_per_step": wall_ms,
        "categories": {
            c: {"ms_per_step": ms(us), "share": round(us / total, 4)}
            for c, us in sorted(categories.items(), key=lambda kv: -kv[1])
        },  # fmt: skip
        "top": [
            {
                "name": n[:160],
                "ms_per_step": ms(us),
                "calls_per_step": round(k / steps, 1),
                "share": round(us / total, 4),
            }
            for n, (us, k) in ranked
        ],  # fmt: skip
    }


def start_profiler(cuda: bool) -> torch_profile:
    """A running profiler of the host's operators and, with `cuda`, the GPU's kernels."""
    profiler = torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    profiler.__enter__()
    return profiler


def stop_profiler(profiler: torch_profile, cuda: bool, wall_s: list[float]) -> dict[str, Any]:
    """Stop `profiler` (started by `start_profiler` before the profiled steps) and summarise its `PROFILED_STEPS`
    steps, whose wall-clock times are `wall_s`."""
    profiler.__exit__(None, None, None)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [
        (e.name, e.self_device_time_total if cuda else e.self_cpu_time_total, 1)
        for e in profiler.events()
        # Ranges the code marks (Optimizer.step: Lightning runs the whole closure inside it) would count their
        # kernels twice.
        if e.device_type == kind and not e.is_user_annotation
    ]
    return profile_summary(events, PROFILED_STEPS, wall_s=wall_s)
