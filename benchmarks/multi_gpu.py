"""The multi-GPU strategies side by side on one machine with 2 GPUs, each run the command a user types:

    python benchmarks/multi_gpu.py --out DIR [--model gemma_7b] [--data alpaca_en_demo.json] [--steps 30]
    python benchmarks/multi_gpu.py --out DIR --cpu        # a rehearsal on this machine's CPU (tiny model)

Runs, one after another (a run whose summary is already in DIR is kept, so a second call goes on where the first
stopped):

  one_gpu         hardware=gpu                    the reference of DDP's scaling
  ddp             hardware=ddp hardware.devices=2 the same settings per GPU (global batch x 2): the fast defaults
  ddp_pinned      hardware=ddp, the memory choices pinned (micro-batch, every layer recomputed, no kept weights,
                  no compile) so that FSDP makes the same ones
  fsdp_pinned     hardware=fsdp, pinned the same way
  model_parallel  hardware=model_parallel         one process, the layers spread over both GPUs

and writes DIR/multi_gpu.json and DIR/multi_gpu.md: each run's command, exit status, steps, wall-clock, tokens/s of
all processes together and of each, each device's peak memory (torch.cuda.max_memory_allocated), where each rank's
weights lived, DDP's replica checksums, the final validation loss; then the checks:
  scaling   ddp tokens/s / one_gpu tokens/s (target >= 1.85)
  sharding  fsdp_pinned's peak per GPU / ddp_pinned's (target <= 0.6)
  replicas  DDP's ranks hold identical adapters
With --cpu the runs are gemma_tiny on the CPU with 2 gloo processes; FSDP and model parallelism are GPU strategies
in exp (`hardware.accelerator=cpu` refuses them), and CPU throughput is not a claim, so only the runs that exist there
run and no ratio is judged: it checks the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from exp.training.signals import REQUEUE_EXIT

ROOT = Path(__file__).resolve().parents[1]
SCALING_TARGET = 1.85
SHARDING_TARGET = 0.6

# What the preflight would otherwise choose by each GPU's free memory, which differs between DDP (a whole replica per
# GPU) and FSDP (a shard): pinned, so that the two hold the same micro-batch and activations and differ only in
# where the weights live.
PINNED = [
    "hardware.auto_micro_batch=false",
    "hardware.auto_checkpoint_layers=false",
    "hardware.auto_dequantized_layers=false",
    "hardware.fuse_lora=false",
    "hardware.compile=false",
]


def runs(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each run's overrides (besides `common`)."""
    per_gpu = args.global_batch
    if args.cpu:
        two = [
            "hardware=ddp",
            "hardware.accelerator=cpu",
            "hardware.devices=2",
            f"trainer.global_batch_size={2 * per_gpu}",
        ]
        return {
            "one_gpu": ["hardware=cpu", f"trainer.global_batch_size={per_gpu}"],
            "ddp": two,
            "ddp_pinned": [*two, f"hardware.micro_batch_size={args.micro_batch}"],
        }
    two = ["hardware.devices=2", f"trainer.global_batch_size={2 * per_gpu}"]
    pinned = [*PINNED, f"hardware.micro_batch_size={args.micro_batch}"]
    return {
        "one_gpu": ["hardware=gpu", f"trainer.global_batch_size={per_gpu}"],
        "ddp": ["hardware=ddp", *two],
        "ddp_pinned": ["hardware=ddp", *two, *pinned],
        "fsdp_pinned": ["hardware=fsdp", *two, *pinned],
        "model_parallel": ["hardware=model_parallel", f"trainer.global_batch_size={per_gpu}"],
    }


def common(args: argparse.Namespace) -> list[str]:
    model = "gemma_tiny" if args.cpu else args.model
    out = [f"model={model}", "trainer.warmup_steps=0", f"trainer.max_steps={args.steps}", "trainer.sample_count=0",
           "trainer.val_every_n_steps=100000", "trainer.checkpoint_every_n_steps=100000", "trainer.limit_val_batches=4",
           "logger=csv"]  # fmt: skip
    if model != "gemma_tiny":
        out.append("model.random_init=true")
    if args.data:
        out += ["data=alpaca", f"data.path={Path(args.data).resolve()}", f"data.max_seq_len={args.seq}"]
    return out


def run_one(name: str, overrides: list[str], out: Path) -> dict:
    run_dir = out / "runs" / name
    record_path = out / f"run_{name}.json"
    if record_path.exists() and json.loads(record_path.read_text()).get("returncode") == 0:
        print(f"[multi_gpu] {name}: kept from an earlier call", flush=True)
        return json.loads(record_path.read_text())
    cmd = [sys.executable, "-m", "exp.train", *overrides, f"hydra.run.dir={run_dir}"]
    if run_dir.exists():  # an earlier attempt that failed or was stopped: kept beside the new one
        run_dir.rename(run_dir.with_name(f"{name}_earlier_{int(time.time())}"))
    print(f"[multi_gpu] {name}: {shlex.join(cmd[1:])}", flush=True)
    t0 = time.time()
    log = out / f"run_{name}.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True)
        # A stage's time limit stops this script with SIGTERM: the run stops too (exp checkpoints and exits; its
        # workers follow their launcher), so that no orphaned run holds the GPUs when the next call starts.
        previous = signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
        try:
            returncode = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    if returncode < 0 or returncode == REQUEUE_EXIT:
        print(f"[multi_gpu] {name}: stopped (exit {returncode}); the next call runs it again", flush=True)
        sys.exit(returncode if returncode > 0 else 128 - returncode)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    record = {
        "name": name,
        "command": "python -m exp.train " + shlex.join(overrides),
        "returncode": returncode,
        "wall_s": round(time.time() - t0, 1),
        "summary": summary,
        "output_tail": log.read_text()[-2000:] if returncode else "",
    }
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"[multi_gpu] {name}: exit {returncode} after {record['wall_s']} s", flush=True)
    return record


def peaks(summary: dict) -> list[float | None]:
    """Each process's peak (one process spanning several GPUs: its figure is its first device's)."""
    ranks = summary.get("per_rank") or [summary] if summary else []
    return [r.get("peak_memory_gib") for r in ranks]


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def same_replicas(checksums: list | None) -> bool:
    """Both DDP ranks' adapter fingerprints (the summary's replica_adapter_checksums) are present and equal."""
    return checksums is not None and len(checksums) == 2 and checksums[0] == checksums[1]


def checks(records: dict[str, dict], cpu: bool) -> dict:
    s = {name: r["summary"] for name, r in records.items() if r["returncode"] == 0}
    tps = {name: x.get("tokens_per_s_median") for name, x in s.items()}
    scaling = ratio(tps.get("ddp"), tps.get("one_gpu"))
    fsdp_peak = max((p for p in peaks(s.get("fsdp_pinned", {})) if p), default=None)
    ddp_peak = max((p for p in peaks(s.get("ddp_pinned", {})) if p), default=None)
    sharding = ratio(fsdp_peak, ddp_peak)
    replicas = {
        name: same_replicas(x.get("replica_adapter_checksums")) for name, x in s.items() if name.startswith("ddp")
    }
    return {
        "scaling_ddp_over_one_gpu": scaling,
        "scaling_target": SCALING_TARGET,
        "scaling_met": None if cpu or scaling is None else scaling >= SCALING_TARGET,
        "peak_fsdp_over_ddp": sharding,
        "sharding_target": SHARDING_TARGET,
        "sharding_met": None if sharding is None else sharding <= SHARDING_TARGET,
        "ddp_replicas_identical": replicas,
        "failed": sorted(name for name, r in records.items() if r["returncode"] != 0),
    }


def markdown(records: dict[str, dict], result: dict, header: str) -> str:
    lines = [header, "", "| run | exit | steps | wall s | tokens/s (all) | tokens/s per process | peak GiB per process "
             "| weights (frozen) per rank | final val/loss |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in records.items():
        s = r["summary"]
        per = s.get("per_rank") or ([s] if s else [])
        frozen = [p.get("frozen") for p in s.get("placement_per_rank", [])]
        lines.append(
            f"| {name} | {r['returncode']} | {s.get('steps', '-')} | {r['wall_s']} | {s.get('tokens_per_s_median', '-')} "
            f"| {[p.get('tokens_per_s_median') for p in per]} | {peaks(s)} | {frozen} "
            f"| {(s.get('final_val') or {}).get('val/loss', '-')} |"
        )
    lines += ["", "```", json.dumps(result, indent=2), "```", "", "Commands:", ""]
    lines += [f"- {name}: `{r['command']}`" for name, r in records.items()]
    return "\n".join(lines) + "\n"


def environment() -> str:
    import importlib.metadata as md

    import torch

    names = ("torch", "transformers", "peft", "bitsandbytes", "lightning", "liger-kernel")

    def version(n: str) -> str:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            return "missing"

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    return f"commit {commit.strip() or 'unknown'}; GPUs {gpus or 'none'}; " + ", ".join(
        f"{n} {version(n)}" for n in names
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="gemma_7b")
    p.add_argument(
        "--data", default=os.environ.get("EXP_ALPACA") or None, help="an Alpaca JSON file (default: synthetic)"
    )
    p.add_argument("--seq", type=int, default=1024, help="data.max_seq_len with --data")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=16, help="per GPU: DDP and FSDP get twice this")
    p.add_argument("--micro-batch", type=int, default=4, help="the pinned runs' micro-batch")
    p.add_argument("--only", nargs="*", help="these runs only")
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args(argv)
    if args.cpu:
        args.steps, args.global_batch, args.micro_batch = min(args.steps, 6), 8, 4
    else:
        import torch

        if torch.cuda.device_count() < 2:
            print(f"multi_gpu: needs 2 CUDA devices, this process sees {torch.cuda.device_count()}", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    records = {}
    for name, overrides in runs(args).items():
        if args.only and name not in args.only:
            continue
        records[name] = run_one(name, [*common(args), *overrides], args.out)
    result = checks(records, args.cpu)
    header = f"# Multi-GPU strategies ({'CPU rehearsal' if args.cpu else args.model}); {environment()}"
    (args.out / "multi_gpu.json").write_text(json.dumps({"runs": records, "checks": result}, indent=2) + "\n")
    (args.out / "multi_gpu.md").write_text(markdown(records, result, header))
    print(json.dumps(result, indent=2))
    return 0 if not result["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
