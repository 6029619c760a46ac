"""`python -m exp.bench`: exp's training step against the hand-written QLoRA loop, on the same tokens.

    python -m exp.bench                                   # the headline: Gemma-7B shape, seq 2048 x 8, baseline vs exp
    python -m exp.bench ablate=true                       # + exp without each of its levers, the baseline with one
    python -m exp.bench model=gemma_tiny seq=64 micro_batch=2 steps=6 warmup=2      # CPU smoke test
    python -m exp.bench variant=exp micro_batch=8,16,32                             # capacity
    python -m exp.bench objective=dpo data=alpaca_en_demo.json seq=1024 micro_batch=8   # DPO on real pairs

Each variant runs in a fresh process (a monkey-patching lever or a compiled graph cannot leak into the next one,
and every process's peak memory is its own) on the same model shape, LoRA settings, optimiser and token batches:
step i is `exp.bench.baseline_loop.token_batch(i, seed, ...)`, labels = inputs, for both sides. The model (random
weights in the published architecture, `model.random_init=true`) is built once into exp's cache by the first variant.

* `baseline` is exp.bench.baseline_loop: the plain transformers + PEFT + bitsandbytes loop a user
  writes by hand; `baseline prepare=false` etc. switch its levers.
* `objective=dpo|orpo` (with `data=`): preference tuning. The pairs are built from the Alpaca file (its own output
  chosen, another example's rejected: exp.bench.pairs) or read from a {prompt, chosen, rejected} file; each step is
  `micro_batch` pairs in exp's seeded order, the baseline scoring them with exp.bench.preference_loop (the
  reference by switching its adapter off), exp with `objective=...` (liger-kernel's chunked loss on a GPU).
* `exp` is `python -m exp.train`'s code: the config composed from conf/ (hardware=gpu on a GPU, cpu otherwise) plus
  the bench's settings, checked by exp's preflight, `QLoRAModule` (model built by `exp.model.build.build_model` in
  `configure_model`, its `training_step`, `configure_optimizers`) driven by the Trainer of
  `exp.training.trainer.build_trainer` with a CSV logger, put together by `exp.training.fit.build_fit` as exp.train
  puts them together, fed these batches instead of a data module. `exp hardware.loss_impl=hf` etc. add overrides.

Writes <out_dir>/bench-<model>-<seq>x<micro-batch>-<time>.json and .md (after every variant, so an interrupted
run keeps what it measured). Exit status 1 when a variant failed (out of memory is a result, not a failure) or an exp
variant's losses left the baseline's by more than parity_tol.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from exp.bench.baseline_loop import ALL_PROJECTIONS
from exp.bench.markdown import markdown
from exp.bench.memory_check import memory_figures, memory_problem
from exp.bench.pairs import preference_file
from exp.bench.report import (
    H200_BF16_TFLOPS,
    PARITY_STEPS,
    compare,
    device_name,
    model_flops_per_token,
    reference_rows,
    versions,
)
from exp.bench.runner import run_variants
from exp.bench.variants import ABLATION, ROOT, Settings, Variant, check_overrides
from exp.core.cli import USAGE_EXIT, Key, Tool, dotted, parse
from exp.core.config import ConfigError
from exp.hardware.memory import config_arch
from exp.run.tracking import _git_state


def bench_tool() -> Tool:
    d = Settings()
    return Tool(
        "exp.bench",
        __doc__,
        (
            Key("model", d.model, "a conf/model option (random weights)"),
            Key("seq", d.seq, "tokens per row (data.max_seq_len in real-data mode)", at_least=1),
            Key(
                "micro_batch",
                [d.micro_batch],
                "rows per step; several (8,16,32) measure capacity",
                kind=int,
                many=True,
                at_least=1,
            ),
            Key("steps", d.steps, "optimiser steps per variant (the loss of each is kept)", at_least=1),
            Key(
                "first_step",
                d.first_step,
                "real-data mode: start at this step of the seeded order (fresh adapters): a long run timed in parts",
                at_least=0,
            ),
            Key("warmup", d.warmup, "untimed first steps", at_least=0),
            Key("lora_r", d.lora_r, "LoRA rank", at_least=1),
            Key("lora_alpha", d.lora_alpha, "LoRA alpha", above=0),
            Key("lora_dropout", d.lora_dropout, "LoRA dropout", at_least=0, at_most=0.99),
            Key("lora_targets", "all", "'all' (the 7 projections) or a comma-separated list of module names"),
            Key("lr", d.lr, "learning rate", above=0),
            Key("seed", d.seed, "token batches (seed + step) and LoRA initialisation", at_least=0),
            Key("device", "auto", "where to run", choices=("auto", "cuda", "cpu")),
            Key(
                "variant",
                [],
                "'baseline [prepare|ckpt|liger|compile=true|false ...]' or 'exp [override ...]' (quoted); repeat the "
                "key for more. Default: baseline and exp",
                many=True,
                split=False,
                placeholder="SPEC",
            ),
            Key("profile", False, "profile two timed steps of each exp variant: device time per kind of kernel"),
            Key("ablate", False, "run the ablation set (+ any variant=): " + "; ".join(ABLATION)),
            Key(
                "parity_steps",
                PARITY_STEPS,
                "the first steps whose losses are compared with the baseline's",
                at_least=0,
            ),
            Key("parity_tol", 0.01, "max relative loss difference from the baseline", above=0),
            Key("peak_tflops", H200_BF16_TFLOPS, "MFU's denominator (GPU only)", above=0),
            Key(
                "reference",
                None,
                "take the plain baseline's rows from this earlier result (same settings) instead of running it again; "
                "several (comma-separated): parts of one real-data run (first_step) whose steps make this one's",
                placeholder="JSON[,JSON...]",
            ),
            Key(
                "memory_budget",
                None,
                "GPU memory exp's preflight may plan for (hardware.memory_budget_gib): GiB, or 'baseline' for the "
                "plain baseline's measured peak (the baseline then runs first)",
                placeholder="GiB|baseline",
            ),
            Key(
                "data",
                None,
                "real-data mode: an Alpaca-format file; micro_batch is the examples per step, seq data.max_seq_len",
                placeholder="FILE",
            ),
            Key(
                "objective",
                d.objective,
                "sft, or a preference objective on pairs (needs data=: an Alpaca file, made into pairs, or a "
                "{prompt, chosen, rejected} file); micro_batch is then pairs per step, seq data.max_seq_len per row",
                choices=("sft", "dpo", "orpo"),
            ),
            Key("out_dir", str(ROOT / "benchmarks" / "results"), "where the .json and .md results go"),
            Key("worker", None, "internal: run one variant from its spec file", hidden=True),
        ),
        passes=dotted,
        passes_help=("a.b=value", "an exp config override for every exp variant (hardware.loss_impl=chunked, ...)"),
    )


def parse_args(argv: list[str]) -> SimpleNamespace:
    """The bench's `key=value` arguments, checked; its exp overrides are `.overrides`."""
    parsed = parse(bench_tool(), argv)
    a = SimpleNamespace(**parsed.values, overrides=parsed.passed)
    if a.steps <= a.warmup:
        raise ConfigError(f"steps={a.steps} must be larger than warmup={a.warmup}: no step would be timed")
    if a.memory_budget not in (None, "baseline"):
        try:
            if float(a.memory_budget) <= 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"memory_budget={a.memory_budget}: a positive number of GiB, or 'baseline'") from None
    if a.data:
        a.data = str(Path(a.data).resolve())
        if not Path(a.data).is_file():
            raise ConfigError(f"data={a.data}: no such file")
    elif a.objective != "sft":
        raise ConfigError(f"objective={a.objective}: preference tuning trains on pairs; add data=<an Alpaca file>")
    elif a.first_step:
        raise ConfigError(
            f"first_step={a.first_step}: only real-data mode has an order of steps to start in; add data=<file> or "
            "drop first_step"
        )
    return a


def plan(a: SimpleNamespace, argv: list[str]) -> tuple[Settings, list[Variant], dict[str, Any]]:
    """The settings, the variants to run and the report they go into (with any baseline rows taken from earlier
    results), everything checked before a worker starts: bad options and overrides, a LoRA target the model lacks,
    a model this machine cannot hold, an earlier result of other settings (ValueError or ConfigError)."""
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    targets = ALL_PROJECTIONS if a.lora_targets == "all" else a.lora_targets.split(",")
    texts = list(dict.fromkeys([*(ABLATION if a.ablate else []), *a.variant])) or ["baseline", "exp"]
    check_overrides(a.overrides)
    variants = [Variant.parse(t) for t in texts]
    for v in variants:
        if v.side == "exp":  # the name keeps the variant's own options; the run gets the common ones too
            v.options = [*a.overrides, *v.options]
    fixed_budget = float(a.memory_budget) if a.memory_budget not in (None, "baseline") else None
    data = a.data
    if a.objective != "sft":  # the pairs both sides train on, written beside the results
        data = str(preference_file(Path(a.data), Path(a.out_dir), a.seed))
    base = Settings(a.model, a.seq, a.micro_batch[0], a.steps, a.warmup, a.lora_r, a.lora_alpha,
                    a.lora_dropout, list(targets), a.lr, a.seed, device, fixed_budget, data,
                    a.profile, a.first_step, a.objective)  # fmt: skip
    # Bad overrides and LoRA targets the model lacks fail here, before any worker starts.
    cfg = base.exp_config(a.overrides)
    if problem := memory_problem(cfg, device, memory_figures(device)):
        raise ConfigError(problem)
    arch = config_arch(cfg)
    flops = model_flops_per_token(arch, a.seq)
    peak_tflops = a.peak_tflops if device == "cuda" else None
    reused: list[dict[str, Any]] = []
    if a.reference:
        paths = [Path(p) for p in a.reference.split(",")]
        reused = reference_rows(paths, base, a.micro_batch, flops, peak_tflops, device_name(device))
        variants = [v for v in variants if not v.is_reference]
    report: dict[str, Any] = {
        "command": "python -m exp.bench " + " ".join(shlex.quote(x) for x in argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": device_name(device),
        "versions": versions(),
        "git": _git_state(ROOT),
        "settings": {**asdict(base), "micro_batch": a.micro_batch, "memory_budget": a.memory_budget},
        "arch": arch,
        "flops": {**flops, "formula": model_flops_per_token.__doc__.split("\n\n")[0].strip()},
        "peak_tflops": peak_tflops,
        "parity_steps": a.parity_steps,
        "parity_tol": a.parity_tol,
        "rows": reused,
    }
    return base, variants, report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parse_args(argv)
    except ConfigError as e:
        print(f"exp: error: {e}", file=sys.stderr)
        return USAGE_EXIT
    if a.worker:
        # The measuring code (Lightning, transformers, PEFT) loads in the worker processes only: not for --help, a
        # bad argument or the parent, which only starts the workers and writes the report.
        from exp.bench.worker import worker_main

        worker_main(Path(a.worker))
        return 0
    try:
        base, variants, report = plan(a, argv)
    except (ValueError, ConfigError) as e:
        print(f"exp: error: exp.bench: {e}", file=sys.stderr)
        return USAGE_EXIT
    stamp = time.strftime("%Y%m%d-%H%M%S")
    mbs = "-".join(map(str, a.micro_batch))
    kind = "" if a.objective == "sft" else f"{a.objective}-"
    out = Path(a.out_dir) / f"bench-{a.model}-{kind}{a.seq}x{mbs}-{stamp}"
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after every variant: an interrupted run keeps what it measured
        compare(report["rows"], a.parity_steps, a.parity_tol)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(markdown(report))

    write()
    print(f"exp.bench: {len(variants)} variant(s) x micro-batch {a.micro_batch} on {report['device']}", flush=True)
    logs = out.with_name(out.name + "-logs")
    run_variants(report, base, variants, a.micro_batch, a.memory_budget == "baseline", write, logs)
    print(markdown(report).split("\nPer-step losses:")[0], flush=True)
    print(f"exp.bench: wrote {out}.json and {out}.md", flush=True)
    failed = [r["variant"] for r in report["rows"] if r["status"] == "failed"]
    off = [r["variant"] for r in report["rows"] if r["side"] == "exp" and not r.get("parity", {}).get("ok", True)]
    if failed or off:
        print(f"exp.bench: failed: {failed}; losses off the baseline: {off}", file=sys.stderr)
        return 1
    return 0
