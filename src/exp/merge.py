"""`python -m exp.merge run=<run dir> out=<dir>`: fold the LoRA adapter into the base, save a plain checkpoint.

The base is brought to the run's compute dtype, the adapter's delta (B @ A * alpha / r) is added with PEFT's
`merge_and_unload` (never into 4-bit weights, which would round the merged result to 4 bits again), Gemma's tied
embedding / output head is checked, and the model is written with
`save_pretrained` (safetensors) next to the run's tokenizer. The result loads with
`AutoModelForCausalLM.from_pretrained(out)`, no exp, PEFT or bitsandbytes code needed.

Which base weights (`base=`):
- `dequantized` (default): the 4-bit weights the adapter was trained against, dequantized. The merged model
  computes what the trained model computed (4-bit base + adapter), up to float round-off.
- `original`: the base checkpoint's own weights, unquantized. The adapter learned to correct the 4-bit weights, so
  the merged model differs from the trained one by the quantization error (the parity report measures how much).

The proof, printed and saved as `<out>/parity.json`, on the run's held-out examples:
- merge: the merged model vs the same unquantized base with the adapter unmerged (max |logit difference|; the
  merge is exact up to float round-off);
- reload: the checkpoint as written and read back vs the merged model in memory;
- quantized_vs_merged: the model that trained (4-bit base + adapter) vs the merged model: KL divergence per
  response token, both perplexities, top-1 agreement. Nonzero by the 4-bit quantization error of the base.

Nothing written is lost: every merge output is marked (`exp_merge.json`), and a non-empty `out` is replaced only
when it carries that mark and `overwrite=true` is given; a training run, or any other directory with files in it, is
refused either way. The checkpoint is written beside `out` first and moved into place only once complete, over an
earlier output in one step.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import math
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from exp.core.cli import Key, Tool
from exp.core.config import ConfigError, TrainConfig
from exp.core.constants import IGNORE_INDEX
from exp.data.batching import collate
from exp.data.splits import build_splits
from exp.model.build import compute_dtype
from exp.run.dirs import ADAPTER_DIR, CHECKPOINT_DIR, CONFIG_FILE, STATUS_FILE, SUMMARY_FILE, write_json
from exp.run.inference import (
    MODEL_PATH_HELP,
    RUN_KEYS,
    VERBOSE_KEY,
    adapter_dir_of,
    default_device,
    load_adapter,
    load_base,
    load_checkpoint_adapter,
    load_run,
    load_tokenizer,
    parse_args,
    passes_model_path,
    resolve_run_dir,
    run_cli,
    run_config,
)

BASES = ("dequantized", "original")
TOOL = Tool(
    "exp.merge",
    __doc__,
    (
        *RUN_KEYS,
        Key("out", None, "where the merged checkpoint goes (a new or empty directory)", placeholder="DIR"),
        Key("overwrite", False, "replace an existing non-empty out"),
        Key("examples", 16, "held-out examples of the parity report", at_least=1),
        Key("base", "dequantized", "which base weights the adapter's delta is added to", choices=BASES),
        VERBOSE_KEY,
    ),
    passes=passes_model_path,
    passes_help=MODEL_PATH_HELP,
)
# Max |logit difference| allowed between the merged model and the unmerged one (and its reloaded copy), by compute
# dtype: float round-off of adding B @ A into W once instead of at every forward. Above it the merge is wrong.
MERGE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


# In every directory exp.merge writes: what `overwrite=true` may replace.
MERGE_MARKER = "exp_merge.json"
# What a training run's directory holds (exp.run.dirs): a directory with any of them is never written over.
RUN_FILES = (STATUS_FILE, CONFIG_FILE, SUMMARY_FILE, CHECKPOINT_DIR, ADAPTER_DIR)


def check_out_dir(out: str | None, overwrite: bool) -> Path:
    """The resolved `out`: a new or empty directory, or (with `overwrite=true`) an earlier merge output. Anything
    else with files in it is refused, with overwrite or without: a training run above all."""
    if not out:
        raise ConfigError("exp.merge: say where the merged checkpoint goes: out=<new directory>")
    path = Path(out).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"out={out}: exists and is a file. Pass a directory path.")
    entries = sorted(p.name + "/" * p.is_dir() for p in path.iterdir()) if path.is_dir() else []
    if not entries:
        return path
    given = Path(out).expanduser()
    beside = _beside(given if given.name else path)  # a free directory to suggest, written as `out` was
    run_files = [e for e in entries if e.rstrip("/") in RUN_FILES]
    if run_files:
        raise ConfigError(
            f"out={out}: the directory holds a training run ({', '.join(run_files)}), and exp.merge never writes over "
            "a run, with overwrite=true or without; nothing was written. Pick a new directory for the merged "
            f"checkpoint, e.g. out={beside}."
        )
    if not (path / MERGE_MARKER).is_file():
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise ConfigError(
            f"out={out}: the directory exists and is not empty ({shown}), and it is not an earlier output of exp.merge "
            f"(no {MERGE_MARKER}), so it is not replaced, with overwrite=true or without; nothing was written. Pick a "
            f"new or empty directory, e.g. out={beside}."
        )
    if not overwrite:
        raise ConfigError(
            f"out={out}: the directory holds an earlier merged checkpoint ({MERGE_MARKER}); nothing was written. Pick "
            "a new directory, or pass overwrite=true to replace that checkpoint."
        )
    return path


def _beside(path: Path) -> Path:
    """`<path>_merged`, or the first `<path>_mergedN` (N = 2, 3, ...) that does not exist."""
    names = (f"{path.name}_merged{n if n > 1 else ''}" for n in range(1, 10_000))
    return next(p for name in names if not (p := path.with_name(name)).exists())


def install(partial: Path, out: Path, overwrite: bool) -> None:
    """Put the complete checkpoint in `partial` at `out`. A new or empty `out` is renamed onto; an earlier merge
    output is swapped with `partial` in one step where the system can (Linux's renameat2), else moved aside first,
    and removed once the new checkpoint is in place, so `out` never holds half of one. `out` is checked again: the
    merge took a while, and something else may have been written there since."""
    try:
        check_out_dir(str(out), overwrite)
    except ConfigError as e:
        raise ConfigError(f"{e} The merged checkpoint is kept in {partial}.") from None
    if not out.is_dir() or not any(out.iterdir()):
        os.replace(partial, out)  # onto an empty directory too
        return
    if not _exchange(partial, out):
        aside = out.with_name(f".{out.name}.{os.getpid()}.replaced")
        os.replace(out, aside)
        os.replace(partial, out)
        partial = aside
    shutil.rmtree(partial)  # now the earlier merge output


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one rename (renameat2 with RENAME_EXCHANGE); False where the system has none."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EXDEV):
        return False  # not supported here (an old kernel, some file systems): the caller moves the old one aside
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(b))


def heldout_batches(cfg: TrainConfig, tokenizer: Any, n: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """The first `n` examples of the run's held-out split (`build_splits`: the examples training validated on, in
    the run's data format), batched."""
    # Response-only labels whatever the run trained on: the comparison is about answers. The split does not depend
    # on train_on_prompt (only the labels do), so these are the same examples in the same order.
    data = replace(cfg.data, train_on_prompt=False)
    examples = build_splits(data, tokenizer).val[:n]
    return [collate(examples[i : i + batch_size], tokenizer.pad_token_id) for i in range(0, len(examples), batch_size)]


@torch.no_grad()
def response_logits(model, batches: list[dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """fp32 logits at every response position (the positions that predict a response token), on the CPU."""
    out = []
    for b in batches:
        logits = model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)).logits
        mask = (b["labels"][:, 1:] != IGNORE_INDEX).to(device)
        out.append(logits[:, :-1][mask].float().cpu())
    return torch.cat(out)


def response_targets(batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([b["labels"][:, 1:][b["labels"][:, 1:] != IGNORE_INDEX] for b in batches])


def compare(reference: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """KL(reference || other) per token, both perplexities, top-1 agreement, max |logit difference|."""
    log_p, log_q = F.log_softmax(reference, -1), F.log_softmax(other, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    ppl_ref = math.exp(F.nll_loss(log_p, targets).item())
    ppl_other = math.exp(F.nll_loss(log_q, targets).item())
    return {
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "perplexity_reference": ppl_ref,
        "perplexity_other": ppl_other,
        "perplexity_gap_relative": ppl_other / ppl_ref - 1,
        "top1_agreement": (reference.argmax(-1) == other.argmax(-1)).float().mean().item(),
        "max_abs_logit_diff": (reference - other).abs().max().item(),
    }


def restore_tied_embeddings(model) -> str:
    """Gemma ties the output head to the input embedding. Keep the tie when the head still equals the embedding
    (LoRA on attention / MLP layers leaves both alone); untie, and say so, when the adapter changed one of them."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not getattr(model.config, "tie_word_embeddings", False):
        return "untied in the base config: kept separate"
    if head.weight is emb.weight:
        return "tied (output head shares the input embedding)"
    if torch.equal(head.weight, emb.weight):
        model.tie_weights()
        return "re-tied (output head equal to the input embedding)"
    model.config.tie_word_embeddings = False
    return "untied: the adapter changed the embedding or the head, so both are saved"


def merge(argv: list[str]) -> dict[str, Any]:
    """Merge, save, reload and compare; returns the parity report."""
    from transformers import AutoModelForCausalLM

    args = parse_args(argv, TOOL)
    run_dir = resolve_run_dir(args["run"], args["ckpt"], "exp.merge")
    out = check_out_dir(args["out"], args["overwrite"])
    ckpt = Path(args["ckpt"]).expanduser() if args["ckpt"] else None
    adapter_dir = adapter_dir_of(run_dir)
    started = time.time()
    device = default_device()
    dequantize = args["base"] == "dequantized"
    cfg = run_config(run_dir, device, args, quantized=dequantize)
    dtype = compute_dtype(cfg.hardware.precision)
    tokenizer = load_tokenizer(adapter_dir)
    batches = heldout_batches(cfg, tokenizer, args["examples"], cfg.hardware.micro_batch_size)
    targets = response_targets(batches)

    # 1. The base in the compute dtype (its 4-bit weights dequantized, or the original weights) with the adapter applied at every forward, then merged into the weights.
    base = load_base(cfg, run_dir, device)
    if dequantize and getattr(base, "hf_quantizer", None) is not None:  # a run trained without quantization has none
        base = base.dequantize(dtype=dtype)
    model = load_adapter(base, adapter_dir)
    if ckpt is not None:
        load_checkpoint_adapter(model, ckpt)
    unmerged = response_logits(model, batches, device)
    model = model.merge_and_unload()
    tie = restore_tied_embeddings(model)
    merged = response_logits(model, batches, device)

    # 2. Written beside `out`, then read back with plain transformers.
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")  # per process: two merges never share one
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    del model
    gc.collect()
    reloaded_model = AutoModelForCausalLM.from_pretrained(partial, dtype=dtype, device_map={"": device})
    reloaded = response_logits(reloaded_model, batches, device)
    del reloaded_model
    gc.collect()

    # 3. The model as trained: the 4-bit base + the adapter.
    quantized = response_logits(load_run(run_dir, ckpt=ckpt, overrides=args, device=device).model, batches, device)

    tolerance = MERGE_TOLERANCE[dtype]
    merge_diff = (merged - unmerged).abs().max().item()
    reload_diff = (reloaded - merged).abs().max().item()
    report = {
        "run": str(run_dir),
        "weights": str(ckpt) if ckpt else str(adapter_dir),
        "out": str(out),
        "dtype": str(dtype).removeprefix("torch."),
        "base": args["base"],
        "examples": sum(len(b["input_ids"]) for b in batches),
        "response_tokens": int(targets.numel()),
        "tied_embeddings": tie,
        "merge": {"max_abs_logit_diff_vs_unmerged": merge_diff, "tolerance": tolerance},
        "reload": {"max_abs_logit_diff_vs_in_memory": reload_diff, "tolerance": tolerance},
        # reference = the 4-bit base + adapter (the trained model), other = the merged checkpoint.
        "quantized_vs_merged": compare(quantized, reloaded, targets),
        "ok": merge_diff <= tolerance and reload_diff <= tolerance,
        "seconds": round(time.time() - started, 1),
    }
    write_json(partial / "parity.json", report)
    write_json(partial / MERGE_MARKER, {"tool": "exp.merge", "run": str(run_dir), "weights": report["weights"]})
    install(partial, out, args["overwrite"])
    print_report(report)
    if not report["ok"]:
        raise SystemExit(
            f"exp: merge check failed: logits differ by {merge_diff:.2e} (merge) / {reload_diff:.2e} (reload), "
            f"above {tolerance:.0e}. The checkpoint in {out} should not be trusted; see parity.json."
        )
    return report


def print_report(r: dict[str, Any]) -> None:
    q = r["quantized_vs_merged"]
    print(
        f"exp: merged {r['weights']} -> {r['out']} ({r['dtype']}, embeddings {r['tied_embeddings']})\n"
        f"  parity on {r['examples']} held-out examples ({r['response_tokens']} response tokens):\n"
        f"  merge exact       max |logit diff| merged vs unmerged     {r['merge']['max_abs_logit_diff_vs_unmerged']:.2e}"
        f" (tolerance {r['merge']['tolerance']:.0e})\n"
        f"  reload exact      max |logit diff| saved vs in memory     {r['reload']['max_abs_logit_diff_vs_in_memory']:.2e}\n"
        f"  4-bit vs merged   KL per token {q['kl_mean']:.2e} (max {q['kl_max']:.2e}), top-1 agreement "
        f"{q['top1_agreement']:.3f}, max |logit diff| {q['max_abs_logit_diff']:.2e}\n"
        f"  perplexity        4-bit + adapter {q['perplexity_reference']:.4f}, merged {q['perplexity_other']:.4f} "
        f"({100 * q['perplexity_gap_relative']:+.2f}%)\n"
        f"  report            {Path(r['out']) / 'parity.json'}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    run_cli(TOOL, merge, argv)


if __name__ == "__main__":
    main()
