"""The bench's result as Markdown: the table of variants, the real-data and profile tables, the per-step losses."""

from __future__ import annotations

from typing import Any


def checkpoint_cell(row: dict[str, Any]) -> str:
    """How many decoder layers recompute in the backward: `none`, `14/28`, `28/28` (`full` for the baseline)."""
    if "checkpoint_layers" in row:
        return f"{row['checkpoint_layers']}/{row['layers']}" if row["checkpoint_layers"] else "none"
    if "gradient_checkpointing" in row:
        return "full" if row["gradient_checkpointing"] else "none"
    return "-"


def fmt(v: Any, spec: str = "") -> str:
    """A table cell: `-` for a missing figure."""
    return "-" if v is None else format(v, spec)


def markdown(report: dict[str, Any]) -> str:
    """The whole result: what was run and how it is measured, the table of variants, the real-data table, each
    profile, the per-step losses."""
    lines = [*intro(report), *variants_table(report)]
    if report["settings"].get("data_path"):
        lines += real_data_table(report)
    for r in report["rows"]:
        if r.get("profile"):
            lines += profile_tables(r)
    lines += losses_table(report["rows"])
    return "\n".join(lines) + "\n"


def intro(report: dict[str, Any]) -> list[str]:
    """The title, where and with what it ran, and how each column is measured."""
    s = report["settings"]
    return [
        f"# exp.bench: {s['model']}, seq {s['seq']}, LoRA r={s['lora_r']} alpha={s['lora_alpha']} "
        f"dropout={s['lora_dropout']} on {', '.join(s['lora_targets'])}",
        "",
        f"Device: {report['device']}. Date: {report['date']}. Command: `{report['command']}`",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v) + ".",
        f"git: {report['git'].get('commit')}{' (dirty)' if report['git'].get('dirty') else ''}.",
        "",
        *(
            [
                f"Preference pairs, objective {s['objective']}: `{s['data_path']}`, "
                f"{', '.join(map(str, s['micro_batch']))} pairs per step "
                f"(their chosen and rejected rows), data.max_seq_len {s['seq']} per row; {s['steps']} steps per "
                f"variant, the first {s['warmup']} untimed; pairs/s = pairs of the timed steps / their time (real "
                "tokens/s in brackets); peak = `max_memory_allocated` after warm-up (CUDA). Both sides train the same "
                f"pairs each step: loss diff = max over the first {report['parity_steps']} steps of |loss - baseline| "
                f"/ baseline (tolerance {report['parity_tol']:.0%}).",
            ]
            if s.get("objective", "sft") != "sft"
            else [
                f"Real data: `{s['data_path']}`, {s['micro_batch']} examples per step, data.max_seq_len {s['seq']}; "
                f"{s['steps']} steps per variant, the first {s['warmup']} untimed; tokens/s = real (non-padding) "
                "tokens of the timed steps / their time; peak = `max_memory_allocated` after warm-up (CUDA). Loss diff "
                "= |validation loss - baseline's| / baseline's after the same steps (tolerance 2%). The baseline pads "
                "each step's examples to the longest; exp batches them with its defaults (micro-batch x accumulation "
                "in the micro-batch column).",
            ]
            if s.get("data_path")
            else [
                f"{s['steps']} steps per variant, the first {s['warmup']} untimed; tokens/s = micro-batch x seq / "
                "median timed step; peak = `max_memory_allocated` after warm-up (CUDA); MFU = tokens/s x "
                f"{report['flops']['per_token'] / 1e9:.4g} GFLOP/token (4N + attention) / "
                + (f"{report['peak_tflops']:g} TFLOP/s. " if report["peak_tflops"] else "the GPU's peak (none here). ")
                + f"Loss diff = max over the first {report['parity_steps']} steps of |loss - baseline| / baseline "
                f"(tolerance {report['parity_tol']:.0%}).",
            ]
        ),
        "Ckpt: decoder layers recomputed in the backward (exp: as its preflight chose"
        + (f", within hardware.memory_budget_gib={s['memory_budget']}" if s.get("memory_budget") else "")
        + "). Warm-up extra: the untimed first steps' time beyond as many median steps (compilation included).",
    ]


def rate_cell(row: dict[str, Any]) -> str:
    """tokens/s, or pairs/s with the tokens/s in brackets for a preference objective."""
    if row.get("pairs_per_s") is None:
        return fmt(row.get("tokens_per_s"), ",.0f")
    return f"{row['pairs_per_s']:.2f} ({fmt(row.get('tokens_per_s'), ',.0f')})"


def variants_table(report: dict[str, Any]) -> list[str]:
    """One line per row: its figures against the plain baseline's; then the rows taken from earlier results."""
    rate = "pairs/s (tokens/s)" if report["settings"].get("objective", "sft") != "sft" else "tokens/s"
    lines = [
        "",
        f"| variant | micro-batch | loss | ckpt | compile | {rate} | vs baseline | MFU | peak GiB | warm-up extra s "
        "| loss diff | same LoRA init | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        parity = r.get("parity") or {}
        diff = parity.get("max_rel_loss_diff")
        micro = (
            r["micro_batch"]
            if r.get("micro_batch_exp") in (None, r["micro_batch"])
            else (f"{r['micro_batch']} ({r['micro_batch_exp']} x {r.get('accumulate')})")
        )
        lines.append(
            f"| {r['variant']} | {micro} | {r.get('loss_impl', '-')} | {checkpoint_cell(r)} "
            f"| {'-' if 'compile' not in r else 'yes' if r['compile'] else 'no'} "
            f"| {rate_cell(r)} | {fmt(r.get('speedup'), '.2f')}{'x' if r.get('speedup') else ''} "
            f"| {fmt(r.get('mfu'), '.1%')} | {fmt(r.get('peak_memory_gib'))} | {fmt(r.get('warmup_extra_s'))} "
            f"| {'-' if diff is None else f'{diff:.2e}'} | {'-' if not parity else 'yes' if parity['same_lora_init'] else 'NO'} "
            f"| {r['status']} |"
        )
    lines += [f"\n{r['variant']} (micro-batch {r['micro_batch']}): reused from {r['reference_from']}"
              for r in report["rows"] if r.get("reference_from")]  # fmt: skip
    return lines


def real_data_table(report: dict[str, Any]) -> list[str]:
    """Real-data mode: the whole run of each row (warm-up and compilation included) and its validation loss."""
    rows = report["rows"]
    return [
        "",
        "| variant | all steps s | vs baseline, all steps | real tokens | real tokens/s, all steps | validation loss |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['variant']} | {fmt(r.get('all_steps_s'))} "
            f"| {fmt(r.get('all_steps_speedup'), '.2f')}{'x' if r.get('all_steps_speedup') else ''} "
            f"| {fmt(r.get('all_steps_real_tokens'), ',')} "
            f"| {fmt(r.get('all_steps_tokens_per_s'), ',.0f')} | {fmt(r.get('val_loss'), '.4f')} |"
            for r in rows
        ),
        *(
            f"\n{r['variant']}: {r['parts']} parts of one run joined end to end (each from fresh adapters: the "
            "per-step losses are the first part's, the validation loss is none of theirs; the loss diff above is "
            f"the largest per-step difference over the first {report['parity_steps']} steps)"
            for r in rows
            if r.get("parts")
        ),
    ]


def profile_tables(r: dict[str, Any]) -> list[str]:
    """A profiled row: its device time per step by kind of kernel, and the kernels that took the most."""
    prof = r["profile"]
    wall = prof.get("wall_ms_per_step")
    busy = (
        f" within {wall:,.1f} ms of wall-clock ({1 - prof['total_ms_per_step'] / wall:.0%} idle)"
        if wall and prof["total_ms_per_step"] <= wall
        else ""
    )
    return [
        "",
        f"Profile of {r['variant']} (micro-batch {r['micro_batch']}): {prof['total_ms_per_step']:,.1f} ms of "
        f"device time per step{busy} (the mean of {prof['steps']} profiled steps; the profiler's own cost included)",
        "",
        "| kind | ms per step | share |",
        "|---|---|---|",
        *(f"| {c} | {v['ms_per_step']:,.1f} | {v['share']:.1%} |" for c, v in prof["categories"].items()),
        "",
        "| kernel | ms per step | calls per step | share |",
        "|---|---|---|---|",
        *(
            f"| `{t['name'][:90]}` | {t['ms_per_step']:,.2f} | {t['calls_per_step']:g} | {t['share']:.1%} |"
            for t in prof["top"][:15]
        ),  # fmt: skip
    ]


def losses_table(rows: list[dict[str, Any]]) -> list[str]:
    """Every row's loss at every step."""
    lines = ["", "Per-step losses:", "", "| step | " + " | ".join(r["variant"] for r in rows) + " |"]
    lines.append("|---" * (len(rows) + 1) + "|")
    n = max((len(r.get("losses", [])) for r in rows), default=0)
    for i in range(n):
        cells = [f"{r['losses'][i]:.5f}" if i < len(r.get("losses", [])) else "-" for r in rows]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return lines
