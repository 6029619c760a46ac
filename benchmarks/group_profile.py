"""Where a group step's time goes: one group of the docs/sweeps.md study's jobs (`hydra.launcher.share_base=true`)
trained through exp.study.group_worker's own planning and exp.study.group_fit, with each step timed and steps
`--profile-from`..`--profile-to` under torch.profiler.

    python benchmarks/group_profile.py OUT_DIR --jobs 16 --steps 8 -- data.path=alpaca_en_demo.json [overrides]

Prints each step's seconds and tokens, then the profiled steps' operators by self device time (or CPU time on the
CPU), and writes the table and a Chrome trace under OUT_DIR.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from exp.run.compose import compose_config, write_run_config
from exp.run.dirs import claim_run_dir, release_run
from exp.study import group_fit
from exp.study.group_worker import plan_group

STUDY = [
    "model=gemma_2b",
    "model.random_init=true",
    "hardware=gpu",
    "hardware.memory_budget_gib=7.5",
    "data=alpaca",
    "data.max_seq_len=512",
    "trainer.val_every_n_steps=1000",
    "trainer.sample_count=0",
    "trainer.checkpoint_every_n_steps=1000",
    "trainer.limit_val_batches=1",
    "logger=csv",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile-from", type=int, default=4)
    parser.add_argument("--profile-to", type=int, default=6)
    parser.add_argument("overrides", nargs="*", help="after the study's settings (data.path=... is needed)")
    args = parser.parse_intermixed_args()

    # The study's grid: lora.r 8/16 x learning rate 1e-4/2e-4 x seeds.
    grid = [(r, lr, seed) for r in (8, 16) for lr in ("1e-4", "2e-4") for seed in range(4)][: args.jobs]
    run_dirs = []
    for i, (r, lr, seed) in enumerate(grid):
        overrides = [*STUDY, f"trainer.max_steps={args.steps}", *args.overrides]
        overrides += [f"lora.r={r}", f"trainer.learning_rate={lr}", f"trainer.seed={seed}", f"data.seed={seed}"]
        run_dir = claim_run_dir(args.out / f"job{i}")
        write_run_config(compose_config(overrides), run_dir)
        release_run(run_dir)
        run_dirs.append(run_dir)
    shared, members = plan_group(run_dirs)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities, record_shapes=False)
    step_of_group = group_fit._group_step
    times: list[tuple[float, int]] = []

    def timed_step(model, router, active, *rest):
        n = len(times) + 1
        if n == args.profile_from:
            profiler.start()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        before = sum(m.tokens_trained for m in active)
        step_of_group(model, router, active, *rest)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started, sum(m.tokens_trained for m in active) - before))
        print(f"step {n}: {times[-1][0]:.3f} s, {times[-1][1]} real tokens", flush=True)
        if n == args.profile_to:
            profiler.stop()

    group_fit._group_step = timed_step
    group_fit.train_group(members, shared, device)
    steady = times[1:] or times
    seconds, tokens = sum(t for t, _ in steady), sum(n for _, n in steady)
    print(
        f"{len(members)} jobs; steps 2..{len(times)}: {tokens / seconds:.0f} real tokens/s, {seconds / len(steady):.3f} s a step"
    )
    print(f"shared hardware: {shared.hardware}")
    if device.type == "cuda":
        print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort, row_limit=40)
    print(table)
    (args.out / "profile.txt").write_text(table)
    profiler.export_chrome_trace(str(args.out / "trace.json"))


if __name__ == "__main__":
    main()
