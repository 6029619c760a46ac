"""Where a run's start-up and validation time goes on a GPU.

    python benchmarks/val_profile.py [exp.train overrides]

Times the imports exp.train pays and the preflight's CUDA probe alone, then trains with the overrides given
(`exp.train.run`) with every validation batch timed (CUDA synchronised before and after) and batches 2-4 of the
first validation profiled (torch.profiler: device and host time per operator), and the samples' greedy answers
timed at every validation, the first call profiled (host and device time per operator of a whole `generate`).
Prints everything; nothing is changed in exp.
"""

from __future__ import annotations

import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

t_torch = time.perf_counter() - t0
from exp.training import pipeline  # noqa: E402, F401  (what exp.train imports before training)

t_pipeline = time.perf_counter() - t0
from exp.hardware import preflight  # noqa: E402
from exp.training.module import QLoRAModule  # noqa: E402

t1 = time.perf_counter()
env = preflight.probe_environment(check_bitsandbytes=True)
t_probe = time.perf_counter() - t1
print(
    f"import torch {t_torch:.1f} s, + exp.training.pipeline {t_pipeline:.1f} s; CUDA probe {t_probe:.1f} s: {env.gpus}"
)

PROFILED = (2, 3, 4)
CUDA = torch.cuda.is_available()
sync = torch.cuda.synchronize if CUDA else (lambda: None)  # the CPU: a smoke test of this script
timings: list[tuple[int, tuple[int, ...], float]] = []
original = QLoRAModule.validation_step


def timed_validation_step(self, batch, batch_idx):
    sync()
    start = time.perf_counter()
    if batch_idx in PROFILED and len(timings) < max(PROFILED) + 1:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if CUDA else [])
        with torch.profiler.profile(activities=acts) as prof:
            original(self, batch, batch_idx)
            sync()
        if batch_idx == PROFILED[0]:
            table = prof.key_averages()
            if CUDA:
                print(table.table(sort_by="self_cuda_time_total", row_limit=18))
            print(table.table(sort_by="self_cpu_time_total", row_limit=18))
    else:
        original(self, batch, batch_idx)
    sync()
    timings.append((batch_idx, tuple(batch["input_ids"].shape), time.perf_counter() - start))
    print(f"validation batch {batch_idx}: input_ids {timings[-1][1]}, {timings[-1][2] * 1000:.0f} ms", flush=True)


QLoRAModule.validation_step = timed_validation_step

from exp.training.samples import SampleGenerations  # noqa: E402

original_greedy = SampleGenerations._greedy
greedy_calls: list[float] = []


def timed_greedy(self, model, prompts, device):
    sync()
    start = time.perf_counter()
    if not greedy_calls:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if CUDA else [])
        with torch.profiler.profile(activities=acts) as prof:
            answers = original_greedy(self, model, prompts, device)
            sync()
        table = prof.key_averages()
        if CUDA:
            print(table.table(sort_by="self_cuda_time_total", row_limit=12))
        print(table.table(sort_by="self_cpu_time_total", row_limit=18))
    else:
        answers = original_greedy(self, model, prompts, device)
    sync()
    greedy_calls.append(time.perf_counter() - start)
    print(f"samples' generate call {len(greedy_calls)}: {len(prompts)} prompts, {greedy_calls[-1]:.2f} s", flush=True)
    return answers


SampleGenerations._greedy = timed_greedy
from exp.train import run  # noqa: E402

run(sys.argv[1:])
