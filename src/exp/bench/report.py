"""The bench's result: each row's figures (tokens/s, MFU, peak memory), the comparison with the plain baseline
(speed-up, loss parity), earlier baseline rows taken over (`reference=`, parts of one run joined) and the facts of
the machine it ran on. exp.bench.markdown writes it as text; benchmarks/join_bench.py joins results with it too."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from exp.bench.variants import Settings

# Dense bf16 matmul throughput an H200 reaches (8192^3 products through PyTorch, measured at 769-798 TFLOP/s):
# MFU's denominator. Pass peak_tflops= for another GPU.
H200_BF16_TFLOPS = 790.0
PARITY_STEPS = 30  # the first steps whose losses are compared with the baseline's


def model_flops_per_token(arch: dict[str, Any], seq: int) -> dict[str, Any]:
    """Model FLOPs of one trained token of a LoRA run on a frozen base: 4 N + attention.

    Forward 2 N (a multiply-add per weight), backward 2 N for the gradients of the activations; the frozen weights
    get no weight gradient (the 2 N of full fine-tuning's 6 N), and the adapters' own FLOPs (rank r) are left out.
    N counts every weight a token's matmuls touch: the decoder projections and the head; Gemma ties the head to the
    embedding, whose lookup costs nothing, so the table is counted once. Attention adds, per layer, QK^T and AV over
    on average seq/2 keys (causal): forward 2 x 2 x d x seq/2 = 2 d seq with d = heads x head_dim, backward twice
    that: 6 d seq per layer. Recomputation (gradient checkpointing) is not counted: these are *model* FLOPs, so
    MFU does not reward recomputing. Gemma-7B shape at seq 2048: 34.15 G + 1.41 G = 35.6 GFLOP per token.
    """
    hidden, inter, layers = arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"]
    heads = arch["num_attention_heads"]
    kv_heads = arch.get("num_key_value_heads", heads)
    head_dim = arch.get("head_dim", 256)
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter
    n = layers * per_layer + arch["vocab_size"] * hidden
    attention = 6 * layers * q * seq
    return {"n_params": n, "linear": 4 * n, "attention": attention, "per_token": 4 * n + attention}


def versions() -> dict[str, str | None]:
    """The versions of Python and of the packages a step's speed depends on, as the result records them."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "lightning", "liger-kernel", "triton"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    out["cuda"] = torch.version.cuda
    return out


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's with the threads torch uses."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def summarise(row: dict[str, Any], settings: Settings, flops: dict[str, Any], peak_tflops: float | None) -> None:
    """Add tokens/s, peak GiB, MFU and the warm-up's extra time to a worker's row.

    Random tokens: tokens/s from the median timed step (every step has micro-batch x seq tokens). Real data: real
    (non-padding) tokens of the timed steps over their summed time (steps differ in size), and the same over all
    steps, warm-up and compilation included (`all_steps_*`); with a preference objective also pairs/s. `warmup_extra_s`: what the untimed first steps took
    beyond as many typical steps (compilation, allocator and kernel warm-up): what a short run pays once.
    """
    steps = row.get("step_s", [])
    timed = steps[settings.warmup :]
    if row["status"] != "ok" or not timed:
        return
    median = statistics.median(timed)
    row["step_s_median"] = round(median, 5)
    row["warmup_extra_s"] = round(sum(steps[: settings.warmup]) - settings.warmup * median, 2)
    real = row.get("real_tokens")
    if settings.data_path and real:
        row["tokens_per_s"] = round(sum(real[settings.warmup :]) / sum(timed), 1)
        row["all_steps_s"] = round(sum(steps), 2)
        row["all_steps_real_tokens"] = sum(real)
        row["all_steps_tokens_per_s"] = round(sum(real) / sum(steps), 1)
        if settings.objective != "sft":  # every step is `micro_batch` pairs
            row["pairs_per_s"] = round(settings.micro_batch * len(timed) / sum(timed), 3)
            row["all_steps_pairs_per_s"] = round(settings.micro_batch * len(steps) / sum(steps), 3)
    else:
        row["tokens_per_s"] = round(settings.micro_batch * settings.seq / median, 1)
    peak = row.get("peak_memory_bytes")
    row["peak_memory_gib"] = round(peak / 2**30, 2) if peak is not None else None
    # Real data has no fixed sequence length (attention FLOPs per token vary): no MFU.
    mfu_ok = peak_tflops and not settings.data_path
    row["mfu"] = round(row["tokens_per_s"] * flops["per_token"] / (peak_tflops * 1e12), 6) if mfu_ok else None


def compare(rows: list[dict[str, Any]], parity_steps: int, tol: float, val_tol: float = 0.02) -> None:
    """Each row against the plain baseline of its micro-batch: speed-up, loss parity, identical LoRA init.

    Random tokens and preference pairs: both sides train on the very same batches, so the per-step losses are
    compared (the speed-up of pairs in pairs per second). Real data: exp batches the examples its own way (steps
    hold other examples), so the validation loss after the same examples is compared instead (within `val_tol`),
    and the speed-up is in real tokens per second.
    """
    for row in rows:
        ref = next((r for r in rows if r["is_reference"] and r["micro_batch"] == row["micro_batch"]), None)
        if ref is None or ref is row or ref["status"] != "ok" or row["status"] != "ok":
            continue
        row["speedup"] = round(row["tokens_per_s"] / ref["tokens_per_s"], 3) if ref.get("tokens_per_s") else None
        if row.get("pairs_per_s") and ref.get("pairs_per_s"):  # the same pairs each step: the same ratio, in pairs
            row["speedup"] = round(row["pairs_per_s"] / ref["pairs_per_s"], 3)
        if row.get("all_steps_s") and ref.get("all_steps_s") and row.get("real_tokens") == ref.get("real_tokens"):
            # the same examples step by step: the whole run's wall-clock, compilation and warm-up included
            row["all_steps_speedup"] = round(ref["all_steps_s"] / row["all_steps_s"], 3)
        if ref.get("parts") and not row.get("same_steps"):
            continue  # a baseline joined from parts has no validation loss of the run, and these steps differ
        if row.get("val_loss") is not None and ref.get("val_loss") is not None:
            diff = abs(row["val_loss"] - ref["val_loss"]) / abs(ref["val_loss"])
            row["parity"] = {
                "val_loss": row["val_loss"],
                "baseline_val_loss": ref["val_loss"],
                "max_rel_loss_diff": diff,
                "ok": diff <= val_tol,
                "same_lora_init": row.get("lora_fingerprint") == ref.get("lora_fingerprint"),
            }
            if row.get("same_steps"):  # padding-free: the steps hold the baseline's examples
                k = min(parity_steps, len(ref["losses"]), len(row["losses"]))
                steps = [abs(a - b) / abs(b) for a, b in zip(row["losses"][:k], ref["losses"][:k], strict=True)]
                row["parity"]["steps"] = k
                row["parity"]["max_rel_step_loss_diff"] = max(steps) if steps else None
                row["parity"]["ok"] = row["parity"]["ok"] and bool(steps) and max(steps) <= tol
            continue
        k = min(parity_steps, len(ref["losses"]), len(row["losses"]))
        diffs = [abs(a - b) / abs(b) for a, b in zip(row["losses"][:k], ref["losses"][:k], strict=True)]
        row["parity"] = {
            "steps": k,
            "max_rel_loss_diff": max(diffs) if diffs else None,
            "ok": bool(diffs) and max(diffs) <= tol,
            "same_lora_init": row.get("lora_fingerprint") == ref.get("lora_fingerprint"),
        }


def reference_rows(
    paths: list[Path],
    settings: Settings,
    micro_batches: list[int],
    flops: dict[str, Any],
    peak_tflops: float | None,
    device: str | None = None,
) -> list[dict[str, Any]]:
    """The plain baseline's rows of earlier results, if they were measured with these settings on this `device`
    (for split runs): a row of another card would make the speed-up a comparison of cards.

    Several files are parts of one real-data run (`first_step`): together their steps must be this invocation's
    steps, each part starting where the one before ended; their rows are joined (`join_parts`) and summarised over
    the whole run."""
    # The memory budget and profiling are exp's alone: the baseline ran the same whatever they were.
    exp_only = {"micro_batch": None, "memory_budget": None, "profile": None}
    span = {"first_step": None, "steps": None} if len(paths) > 1 else {}
    mine = {**asdict(settings), **exp_only, **span, "data_path": _data_name(settings.data_path)}
    earlier = []
    for path in paths:
        report = json.loads(path.read_text())
        if device is not None and report.get("device") != device:
            raise ValueError(
                f"reference={path}: measured on {report.get('device')}, this run is on {device}: run the baseline "
                "here (leave reference= out)"
            )
        theirs = {**Settings().__dict__, **report["settings"]}
        compared = {**theirs, **exp_only, **span, "data_path": _data_name(theirs["data_path"])}
        if mine != compared:
            diff = {k: (compared.get(k), v) for k, v in mine.items() if compared.get(k) != v}
            raise ValueError(f"reference={path}: measured with other settings (theirs, ours): {diff}")
        rows = [
            {**r, "reference_from": str(path)}
            for r in report["rows"]
            if r["is_reference"] and r["micro_batch"] in micro_batches and r["status"] == "ok"
        ]
        missing = sorted(set(micro_batches) - {r["micro_batch"] for r in rows})
        if missing:
            raise ValueError(f"reference={path}: no successful plain-baseline row for micro-batch {missing}")
        earlier.append((theirs["first_step"], theirs["steps"], path, rows))
    if len(earlier) == 1:
        return earlier[0][3]
    earlier.sort(key=lambda e: e[0])
    at = settings.first_step
    for first, steps, path, _ in earlier:
        if first != at:
            raise ValueError(
                f"reference={path}: starts at step {first}, where the parts before it end at step {at}: the parts "
                f"must follow each other from first_step={settings.first_step}"
            )
        at += steps
    if at != settings.first_step + settings.steps:
        raise ValueError(
            f"reference: the parts cover steps {settings.first_step}-{at - 1}, this invocation's steps are "
            f"{settings.first_step}-{settings.first_step + settings.steps - 1}: give steps={at - settings.first_step} "
            "or the missing parts"
        )
    joined = []
    for mb in micro_batches:
        row = join_parts([next(r for r in e[3] if r["micro_batch"] == mb) for e in earlier])
        summarise(row, Settings(**{**asdict(settings), "micro_batch": mb}), flops, peak_tflops)
        joined.append(row)
    return joined


def _data_name(path: str | None) -> str | None:
    """The data a run read, by file name: the bench writes its preference pairs into its own out_dir (a temporary
    folder on another machine), named after their source and seed. Both sides' per-step losses are compared besides,
    so other data under the same name shows as a loss difference."""
    return Path(path).name if path else path


def join_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One baseline row from the rows of consecutive parts of a run: their steps' times and real tokens end to end
    (what the whole run's wall-clock is made of), the highest peak. Each part started from fresh adapters, so only
    the first part's losses belong to the run (the per-step comparison uses those) and no part's validation loss
    is the run's."""
    fingerprints = {p.get("lora_fingerprint") for p in parts}
    if len(fingerprints) > 1:
        raise ValueError("reference: the parts' LoRA inits differ (another seed or LoRA setting)")
    peaks = [p["peak_memory_bytes"] for p in parts if p.get("peak_memory_bytes") is not None]
    joined = {
        **{k: v for k, v in parts[0].items() if not isinstance(v, (list, dict))},
        "step_s": [t for p in parts for t in p["step_s"]],
        "real_tokens": [n for p in parts for n in p.get("real_tokens") or []] or None,
        "losses": list(parts[0]["losses"]),
        "val_loss": None,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "wall_s": round(sum(p.get("wall_s") or 0 for p in parts), 1),
        "reference_from": ", ".join(p["reference_from"] for p in parts),
        "parts": len(parts),
    }
    for derived in ("step_s_median", "warmup_extra_s", "tokens_per_s", "all_steps_s", "all_steps_real_tokens",
                    "all_steps_tokens_per_s", "peak_memory_gib", "mfu"):  # fmt: skip
        joined.pop(derived, None)  # summarise computes them again over the whole run
    return joined
