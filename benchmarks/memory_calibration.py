"""Measure the peak GPU memory of real training steps and set it next to `exp.hardware.memory`'s prediction.

    python benchmarks/memory_calibration.py [--models gemma_2b gemma_7b] [--quick] [--out benchmarks/results/memory_calibration]
    python benchmarks/memory_calibration.py --models gemma_2b --grid 1024x2 1024x4 1024x8 --ckpt none \
        --losses liger chunked --compile both            # the GPU fast path: fused losses, with and without compile
    python benchmarks/memory_calibration.py --dry-run      # the predictions only; no GPU, no model

For each model shape (the published architecture in conf/model/<name>.yaml, random weights built the project's
way) the model is loaded once through exp's own loader (`exp.model.build.build_model`: NF4 + double quant, bf16, LoRA r16
on all 7 projections, dropout 0), then for every (seq, batch) and checkpointing on / off a few training steps run
the way Lightning's training_step does (bf16 autocast, the model output dropped before backward, AdamW on the
adapters, zero_grad(set_to_none=True)), with the training loss of `exp.model.loss` (--losses: transformers' `hf`, exp's
`chunked`, liger-kernel's `liger`) and, with --compile, the decoder layers compiled as `hardware.compile` does
(the uncompiled combinations run first; compiling is in place). The measured peak is `torch.cuda.max_memory_allocated()` over the steps
after warm-up; it is compared with `MemoryEstimate.allocated` (the prediction without the CUDA context / allocator
slack, which that counter does not see). Combinations the estimator puts above --max-predicted-gib are skipped.

Writes <out>.json (every row, versions, GPU, the exact command) and <out>.md (the table).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata as md
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("gemma_2b", "gemma_7b")
# (seq, batch) grid, each with checkpointing on then off.
GRID = ((512, 8), (2048, 4), (2048, 8))
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R = 16
OVERRIDES = [
    "model.random_init=true",
    "hardware=gpu",
    "hardware.precision=bf16-mixed",  # what the preflight resolves `auto` to on an H200; build_model needs it resolved
    "lora=all_linear",
    f"lora.r={LORA_R}",
    "lora.dropout=0",
    "logger=csv",
]


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "lightning", "exp"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "missing"
    return out


def load_arch(model: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    node = OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml")
    return OmegaConf.to_container(node.arch, resolve=True)


CKPT = {"both": (True, False), "full": (True,), "none": (False,)}
COMPILE = {"both": (False, True), "on": (True,), "off": (False,)}


def combos(
    quick: bool, grid: list[tuple[int, int]], ckpts=(True, False), losses=("hf",), compiles=(False,)
) -> list[tuple[int, int, bool, str, bool]]:
    """(seq, batch, checkpointing, loss, compiled), uncompiled first (compiling the layers cannot be undone)."""
    out = [
        (seq, batch, ckpt, loss, comp) for comp in compiles for loss in losses for seq, batch in grid for ckpt in ckpts
    ]
    return out[:1] if quick else out


def predict(model: str, arch: dict[str, Any], seq: int, batch: int, ckpt: bool, loss: str = "hf", comp: bool = False):
    from exp.hardware.memory import estimate_memory

    node = _model_node(model)
    return estimate_memory(
        arch,
        quant_type="nf4",
        double_quant=True,
        lora_r=LORA_R,
        lora_targets=LORA_TARGETS,
        lora_dropout=0.0,
        micro_batch_size=batch,
        seq_len=seq,
        gradient_checkpointing=ckpt,
        loss_impl=loss,
        compiled=comp,
        compute_bytes=2,
        family=node.get("family", "gemma"),
        attn_implementation=node.get("attn_implementation", "sdpa"),
        padding_mask=False,  # random full-length batches: no mask, SDPA runs causal kernels
    )


def _model_node(model: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml"), resolve=True)


def compose_cfg(model: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from exp.run.compose import CONF_DIR, to_typed

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        dcfg = compose("train", overrides=[f"model={model}", *OVERRIDES])
    return to_typed(dcfg, ROOT)


def gib(x: float | None) -> float | None:
    return None if x is None else round(x / 2**30, 3)


def dry_run(models: list[str], grid_combos: list[tuple[int, int, bool]], limit_gib: float) -> None:
    from exp.hardware.memory import GiB

    print("| model | seq | batch | ckpt | loss | predicted allocated GiB | predicted total GiB | peak at | run? |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in models:
        arch = load_arch(model)
        for seq, batch, ckpt, loss, comp in grid_combos:
            e = predict(model, arch, seq, batch, ckpt, loss, comp)
            run = "yes" if e.total <= limit_gib * GiB else "skip"
            print(
                f"| {model} | {seq} | {batch} | {ckpt} | {loss}{' compiled' if comp else ''} | "
                f"{e.allocated / GiB:.2f} | {e.total / GiB:.2f} | {e.peak_phase} | {run} |",
                flush=True,
            )
    arch = load_arch(models[0])
    seq, batch, ckpt, loss, comp = grid_combos[0]
    print(f"\n{models[0]} seq {seq} x batch {batch}, checkpointing {ckpt}, {loss}:", flush=True)
    print(predict(models[0], arch, seq, batch, ckpt, loss, comp).as_table(), flush=True)


def measure_model(model: str, grid_combos, a: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from exp.core.config import LossImpl, ModelFamily
    from exp.hardware.memory import GiB, config_arch
    from exp.model.build import build_model, compile_decoder_layers, quiet_third_party_logs
    from exp.model.local import build_random_checkpoint
    from exp.model.loss import causal_lm_loss

    quiet_third_party_logs()
    cfg = compose_cfg(model)
    arch = config_arch(cfg)  # conf/model/<name>.yaml's arch (+ the local vocabulary size if it has none)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    print(f"[{model}] building / finding the random-weight checkpoint ...", flush=True)
    build_random_checkpoint(ModelFamily(cfg.model.family), dict(cfg.model.arch), cfg.model.seed)
    print(
        f"[{model}] checkpoint ready ({time.time() - t0:.0f} s); loading through exp.model.build.build_model",
        flush=True,
    )
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model_obj = build_model(cfg, torch.device("cuda"))
    torch.cuda.synchronize()
    loaded = torch.cuda.memory_allocated()
    print(f"[{model}] loaded in {time.time() - t0:.0f} s: {loaded / GiB:.2f} GiB allocated", flush=True)
    params = [p for p in model_obj.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    base = model_obj.base_model.model  # the transformers model under PEFT
    vocab = int(base.config.vocab_size)

    compiled = False
    for seq, batch, ckpt, loss_impl, comp in grid_combos:
        if comp and not compiled:
            compile_decoder_layers(model_obj)
            compiled = True
        e = predict(model, arch, seq, batch, ckpt, loss_impl, comp)
        row: dict[str, Any] = {
            "model": model,
            "seq": seq,
            "batch": batch,
            "gradient_checkpointing": ckpt,
            "loss_impl": loss_impl,
            "compiled": comp,
            "predicted_allocated_gib": gib(e.allocated),
            "predicted_total_gib": gib(e.total),
            "predicted_peak_phase": e.peak_phase,
            "predicted": {k: v for k, v in e.to_dict().items() if k != "details"},
            "predicted_details": e.details,
            "loaded_allocated_gib": gib(loaded),
            # What stays allocated between steps: weights + adapters + AdamW state (grads are set to None).
            "predicted_steady_gib": gib(e.weights + e.lora_params + e.optimizer_state),
        }
        if e.total > a.max_predicted_gib * GiB:
            row["status"] = "skipped"
            print(
                f"[{model}] seq {seq} x {batch} ckpt={ckpt} {loss_impl}: predicted {e.total / GiB:.1f} GiB > limit, "
                "skipped",
                flush=True,
            )
            rows.append(row)
            continue
        if ckpt:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_disable()
        model_obj.train()
        what = f"seq {seq} x {batch} ckpt={ckpt} {loss_impl}{' compiled' if comp else ''}"
        print(f"[{model}] {what}: predicted {e.allocated / GiB:.2f} GiB ...", flush=True)
        oom = False
        losses: list[float] = []
        step_s: list[float] = []
        try:
            gen = torch.Generator(device="cuda").manual_seed(0)
            for step in range(a.warmup + a.steps):
                if step == a.warmup:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                x = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
                torch.cuda.synchronize()
                t_step = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    # exp's training loss (as QLoRAModule.training_step): hf returns only `.loss` of the output.
                    loss = causal_lm_loss(model_obj, {"input_ids": x, "labels": x}, LossImpl(loss_impl))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                step_s.append(time.perf_counter() - t_step)
                losses.append(round(float(loss.detach()), 4))
                del loss, x
            row["measured_allocated_gib"] = gib(torch.cuda.max_memory_allocated())
            row["measured_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
            row["steady_allocated_gib"] = gib(torch.cuda.memory_allocated())  # weights + adapters + AdamW state
            row["status"] = "ok"
            row["losses"] = losses
            timed = step_s[a.warmup :]
            row["step_s_median"] = round(sorted(timed)[len(timed) // 2], 4)
            row["tokens_per_s"] = round(batch * seq / row["step_s_median"])
        except torch.cuda.OutOfMemoryError:
            oom = True
        if oom:  # outside the except block, so the traceback's frames (and their tensors) are gone
            row["status"] = "oom"
            row["measured_allocated_gib"] = None
            row["measured_reserved_gib"] = gib(torch.cuda.max_memory_reserved())
        opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        m, p = row.get("measured_allocated_gib"), row["predicted_allocated_gib"]
        row["error_pct"] = round(100 * (p - m) / m, 1) if m else None
        print(
            f"[{model}] {what}: {row['status']} measured {m} GiB, predicted {p} GiB"
            + (f" ({row['error_pct']:+.1f}%)" if row["error_pct"] is not None else ""),
            flush=True,
        )
        rows.append(row)

    del opt, params, model_obj, base
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [
        "# Memory estimator calibration",
        "",
        f"GPU: {header['gpu']}; {', '.join(f'{k} {v}' for k, v in header['versions'].items())}; {header['date']}.",
        f"Command: `{header['command']}`",
        "",
        "Measured: `torch.cuda.max_memory_allocated()` over the steps after warm-up. Predicted: "
        "`exp.hardware.memory.estimate_memory(...).allocated` (without the CUDA-context / allocator `workspace`). "
        "Error = (predicted - measured) / measured.",
        "",
        "| model | seq | batch | ckpt | loss | compiled | measured GiB | predicted GiB | error % | reserved GiB "
        "| tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = r.get("measured_allocated_gib")
        shown = measured if measured is not None else r["status"]
        err = f"{r['error_pct']:+.1f}" if r.get("error_pct") is not None else "-"
        lines.append(
            f"| {r['model']} | {r['seq']} | {r['batch']} | {'full' if r['gradient_checkpointing'] else 'none'} "
            f"| {r.get('loss_impl', 'hf')} | {'yes' if r.get('compiled') else 'no'} | {shown} | {r['predicted_allocated_gib']} | {err} | {r.get('measured_reserved_gib') or '-'} "
            f"| {r.get('tokens_per_s') or '-'} |"
        )
    return "\n".join(lines) + "\n"


def seq_batch(value: str) -> tuple[int, int]:
    seq, _, batch = value.lower().partition("x")
    if not (seq.isdigit() and batch.isdigit() and int(seq) > 0 and int(batch) > 0):
        raise argparse.ArgumentTypeError(f"{value!r}: expected SEQxBATCH, e.g. 2048x8")
    return int(seq), int(batch)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--quick", action="store_true", help="only the first combination per model (a smoke run)")
    p.add_argument("--dry-run", action="store_true", help="print the predictions; no GPU, no model")
    p.add_argument("--grid", nargs="+", type=seq_batch, metavar="SEQxBATCH", help="replace the (seq, batch) grid")
    p.add_argument("--ckpt", choices=list(CKPT), default="both", help="gradient checkpointing of every layer")
    p.add_argument("--losses", nargs="+", choices=["hf", "chunked", "liger"], default=["hf"])
    p.add_argument("--compile", choices=list(COMPILE), default="off", help="decoder layers torch.compile'd")
    p.add_argument("--max-predicted-gib", type=float, default=120.0, help="skip combinations predicted above this")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/memory_calibration", help="output path without extension")
    a = p.parse_args(argv)
    grid_combos = combos(a.quick, a.grid or list(GRID), CKPT[a.ckpt], tuple(a.losses), COMPILE[a.compile])

    if a.dry_run:
        dry_run(a.models, grid_combos, a.max_predicted_gib)
        return

    import torch

    if not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or use --dry-run for the predictions only")
    header = {
        "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
        "gpu": torch.cuda.get_device_name(0),
        "gpu_total_gib": gib(torch.cuda.get_device_properties(0).total_memory),
        "versions": versions(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "overrides": OVERRIDES,
    }
    print(json.dumps(header), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for model in a.models:
        rows += measure_model(model, grid_combos, a)
        # Written after every model, so a later failure keeps what was measured.
        out.with_suffix(".json").write_text(json.dumps({**header, "rows": rows}, indent=2) + "\n")
        out.with_suffix(".md").write_text(markdown(rows, header))
    print(markdown(rows, header), flush=True)


if __name__ == "__main__":
    main()
