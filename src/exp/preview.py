"""`python -m exp.preview [overrides] [n=3]`: the data exactly as the model will see it, before any GPU hour.

Composes the config like `exp.train` (no run directory), builds the tokenizer and the DataModule, prints `n`
training examples token by token with the loss-free (prompt) tokens marked, and the statistics: examples kept /
dropped, bad rows, length distribution, truncation rate, loss-bearing fraction, padding, packing efficiency.

Tokens that carry no loss are wrapped in `[[ ]]` (dimmed instead on a colour terminal); everything outside the
brackets is what the model is trained to produce. Exit status 2 with the message on bad input.

Under a preference objective (`objective=dpo|orpo|simpo|kto`) the examples are pairs: the prompt, then the chosen
and the rejected completion (KTO: the completion and its label), cut from the rows the training batch holds
(exp.data.preference.collate_preference), so the marks are the masks the loss uses. The statistics add the row
numbers of the rows skipped or dropped, as `data.on_bad_rows` had them handled.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from exp.core.cli import Key, Parsed, Tool, run_tool
from exp.core.constants import IGNORE_INDEX
from exp.data.datamodule import InstructionDataModule
from exp.data.preference import PreferenceDataModule, PreferenceExample, collate_preference, row_list
from exp.data.streaming import StreamingDataModule

DIM, RESET = "\033[2m", "\033[0m"
TOOL = Tool("exp.preview", __doc__, (Key("n", 3, "training examples to print", at_least=1),), hydra=True)


def render_tokens(
    tokenizer: Any, input_ids: list[int], labels: list[int], color: bool = False, row_start: bool = True
) -> str:
    """The decoded text with runs of loss-free tokens marked: `[[...]]` (plain) or dimmed (colour terminal).

    A row's token 0 never carries loss (nothing predicts it), so it is always marked, whatever its label
    (`row_start=False`: the tokens are a row's later part, each marked by its own label).
    """
    out: list[str] = []
    run: list[int] = []
    run_masked: bool | None = None

    def flush() -> None:
        if not run:
            return
        text = tokenizer.decode(run, skip_special_tokens=False)
        if run_masked:
            out.append(f"{DIM}{text}{RESET}" if color else f"[[{text}]]")
        else:
            out.append(text)

    for k, (t, lab) in enumerate(zip(input_ids, labels, strict=True)):
        masked = (k == 0 and row_start) or lab == IGNORE_INDEX
        if masked != run_masked:
            flush()
            run, run_masked = [], masked
        run.append(t)
    flush()
    return "".join(out)


def _dist(values: list[int]) -> str:
    if not values:
        return "-"
    q = statistics.quantiles(values, n=20, method="inclusive") if len(values) > 1 else [values[0]] * 19
    return f"min {min(values)}, median {statistics.median(values):.0f}, p95 {q[18]:.0f}, max {max(values)}"


def report(dm: InstructionDataModule, n: int, color: bool = False, batch_size: int = 0) -> str:
    """The preview text: `n` training examples as the model sees them, then the statistics; a warning for each
    split that holds fewer examples than one batch (`batch_size`, trainer.global_batch_size)."""
    cfg, tok = dm.cfg, dm.tokenizer
    lines = [
        f"exp.preview: data.format={'mixture' if cfg.mixture else cfg.format.value} "
        f"source={cfg.path or cfg.hub_id or ('+'.join(m.label for m in cfg.mixture) if cfg.mixture else 'synthetic')} "
        f"max_seq_len={cfg.max_seq_len} train_on_prompt={cfg.train_on_prompt} packing={cfg.packing}",
        "Tokens in [[ ]] carry no loss (prompt, <bos>); the rest is what the model learns to produce.",
        "",
    ]
    if dm.stats.get("streaming"):
        return "\n".join(lines + _stream_report(dm, n, color))
    lines += _example_lines(tok, dm.train_set[:n], color)
    if dm.packed:
        row = dm.packed[0]
        starts = [k for k, p in enumerate(row.position_ids) if p == 0]
        lines += [f"--- packed row 0: {row.n_examples} examples, {len(row.input_ids)} tokens, starts at {starts}", ""]
    s = dm.stats
    tr, va = s["train"], s["val"]
    examples = tr["examples"] + va["examples"]
    kept = tr["kept"] + va["kept"]
    truncated = tr["truncated"] + va["truncated"]
    lengths = [len(e.input_ids) for e in dm.train_set + dm.val_set]
    tokens = tr["tokens"] + va["tokens"]
    lines += [
        "statistics",
        f"  rows              {examples + s['bad_rows']} ({s['bad_rows']} bad rows skipped)",
        f"  examples kept     {kept} of {examples} (train {tr['kept']}, val {va['kept']}); "
        f"dropped {tr['dropped'] + va['dropped']} whose response was truncated away",
        f"  truncated         {truncated} ({100 * truncated / max(examples, 1):.1f}%) at max_seq_len={cfg.max_seq_len}",
        f"  length (tokens)   {_dist(lengths)}",
        f"  loss-bearing      {100 * (tr['loss_tokens'] + va['loss_tokens']) / max(tokens, 1):.1f}% of tokens",
        f"  per train batch   {tr['loss_tokens_per_batch']} loss-bearing tokens, "
        f"{100 * tr['padding_fraction']:.1f}% padding (micro-batch {dm.micro_batch_size}"
        + (", length-grouped" if cfg.group_by_length and not cfg.packing else "")
        + ")",
    ]
    if "packing_efficiency" in tr:
        lines.append(
            f"  packing           {tr['packed_rows']} rows of {cfg.max_seq_len} from {tr['kept']} examples, "
            f"{100 * tr['packing_efficiency']:.1f}% of slots filled"
        )
    if "mixture" in s:
        lines.append(
            "  mixture           source: examples per epoch (share; weight's share), loss tokens (share), held out"
        )
        for m in s["mixture"]:
            lines.append(
                f"    {m['name']:<15} {m['epoch_examples']} ({100 * m['example_share']:.1f}%; {100 * m['target_share']:.1f}%) "
                f"from {m['train_rows']} training rows, {m['loss_tokens']} loss tokens ({100 * m['loss_token_share']:.1f}%), "
                f"{m['val_examples']} held out"
            )
    for split, kept in (("train", tr["kept"]), ("validation", va["kept"])):
        if kept < batch_size:
            lines.append(
                f"warning: the {split} split holds {kept} example(s), fewer than one batch "
                f"(trainer.global_batch_size={batch_size}): "
                + (
                    "each optimiser step repeats examples. Add data, or lower trainer.global_batch_size."
                    if split == "train"
                    else "every validation scores these few examples. Raise data.val_size or give data.val_path."
                )
            )
    return "\n".join(lines)


def render_pair(tokenizer: Any, e: PreferenceExample, color: bool = False) -> list[str]:
    """A preference example as its training rows hold it: the prompt (no loss), then each completion, each cut from
    its collated row at the prompt's end so that its marks are the loss mask of that row."""
    batch = collate_preference([e], tokenizer.pad_token_id)
    p = len(e.prompt)
    ids, labels = batch["input_ids"].tolist(), batch["labels"].tolist()
    lines = [f"  prompt      {render_tokens(tokenizer, ids[0][:p], labels[0][:p], color)}"]
    names = ["chosen", "rejected"] if e.rejected is not None else ["desirable" if e.desirable else "undesirable"]
    for r, (name, completion) in enumerate(zip(names, [e.chosen, e.rejected], strict=False)):
        end = p + len(completion)
        lines.append(
            f"  {name:<11} {render_tokens(tokenizer, ids[r][p:end], labels[r][p:end], color, row_start=False)}"
        )
    return lines


def preference_report(
    dm: PreferenceDataModule, objective: str, n: int, color: bool = False, batch_size: int = 0
) -> str:
    """The preview of preference data: `n` training pairs (KTO: labelled completions) with their loss masks, then
    what was read, dropped (with row numbers) and cut, the lengths and a training micro-batch's rows."""
    cfg, tok, d = dm.cfg, dm.tokenizer, dm.dropped
    paired = dm.stats["kind"] == "pairs"
    what = "pair" if paired else "example"
    lines = [
        f"exp.preview: objective={objective} data.format={cfg.format.value} source={cfg.path or cfg.hub_id or 'synthetic'} "
        f"max_seq_len={cfg.max_seq_len} on_bad_rows={cfg.on_bad_rows.value}",
        "Tokens in [[ ]] carry no loss (the prompt, <bos>); the completions' tokens are scored: their summed "
        "log-probabilities are what the objective compares.",
        "",
    ]
    for i, e in enumerate(dm.train_set[:n]):
        sizes = f"chosen {len(e.chosen)}, rejected {len(e.rejected)}" if paired else f"completion {len(e.chosen)}"
        cut = ", a completion truncated" if e.truncated else ""
        lines += [f"--- {what} {i} (row {e.row}; prompt {len(e.prompt)} tokens, {sizes} with loss{cut})"]
        lines += [*render_pair(tok, e, color), ""]
    examples = dm.train_set + dm.val_set
    completions = [c for e in examples for c in (e.chosen, e.rejected) if c is not None]
    prompt_tokens = sum(len(e.prompt) for e in examples) * (2 if paired else 1)
    loss_tokens = sum(map(len, completions))
    rows_per = (
        "2 rows per pair: chosen, then rejected"
        if paired
        else "its own, then a prompt with another's completion: KTO's reference point"
    )
    lines += [
        "statistics",
        f"  rows              {d['rows']} in {cfg.path or cfg.hub_id or 'the generated data'}",
        f"  bad rows          {_rows_and_why(d['bad'])}",
        f"  prompt too long   {len(d['too_long_rows'])}{': ' + row_list(d['too_long_rows']) if d['too_long_rows'] else ''}"
        f" (dropped: no completion token fits data.max_seq_len={cfg.max_seq_len})",
        f"  truncated         {len(d['truncated_rows'])}{': ' + row_list(d['truncated_rows']) if d['truncated_rows'] else ''}"
        " (a completion cut to fit; the prompt is kept whole)",
        f"  {what + 's kept':<18}{len(examples)} (train {len(dm.train_set)}, val {len(dm.val_set)})",
    ]
    if not paired:
        good = sum(e.desirable for e in examples)
        lines.append(f"  desirable         {good} of {len(examples)} ({100 * good / max(len(examples), 1):.1f}%)")
    if "val_path" in d:
        v = d["val_path"]
        lines.append(
            f"  data.val_path     {v['rows']} rows; bad {_rows_and_why(v['bad'])}; prompt too long {len(v['too_long_rows'])}"
        )
    lines += [
        f"  prompt (tokens)   {_dist([len(e.prompt) for e in examples])}",
        f"  chosen (tokens)   {_dist([len(e.chosen) for e in examples])}"
        if paired
        else f"  completion (tok.) {_dist([len(e.chosen) for e in examples])}",
    ]
    if paired:
        lines.append(f"  rejected (tokens) {_dist([len(e.rejected) for e in examples])}")
    first = dm.train_set[: dm.micro_batch_size]
    batch = collate_preference(first, tok.pad_token_id)
    real = int(batch["attention_mask"].sum())
    lines += [
        f"  loss-bearing      {100 * loss_tokens / max(loss_tokens + prompt_tokens, 1):.1f}% of the rows' tokens",
        f"  per train batch   {batch['input_ids'].shape[0]} rows for {len(first)} {what}s ({rows_per}), "
        f"{100 * (1 - real / batch['input_ids'].numel()):.1f}% padding in the first",
    ]
    for split, kept in (("train", len(dm.train_set)), ("validation", len(dm.val_set))):
        if kept < batch_size:
            lines.append(
                f"warning: the {split} split holds {kept} {what}(s), fewer than one batch "
                f"(trainer.global_batch_size={batch_size})"
            )
    return "\n".join(lines)


def _rows_and_why(bad: list[tuple[int, str]], shown: int = 5) -> str:
    if not bad:
        return "0"
    more = f"; and {len(bad) - shown} more" if len(bad) > shown else ""
    return (
        f"{len(bad)} skipped (data.on_bad_rows=skip): " + "; ".join(f"row {i}: {why}" for i, why in bad[:shown]) + more
    )


def _example_lines(tok: Any, examples: list, color: bool) -> list[str]:
    lines = []
    for i, e in enumerate(examples):
        n_loss = sum(t != IGNORE_INDEX for t in e.labels[1:])
        lines += [
            f"--- example {i} ({len(e.input_ids)} tokens, {n_loss} with loss{', truncated' if e.truncated else ''})",
            render_tokens(tok, e.input_ids, e.labels, color),
            "",
        ]
    return lines


def _stream_report(dm: Any, n: int, color: bool) -> list[str]:
    """data.streaming: the stream's first `n` training examples and what is known without reading it whole: the
    held-out split's statistics."""
    va, shown = dm.stats["val"], dm.train_examples(n)
    lengths = [len(e.input_ids) for e in dm.val_set]
    return _example_lines(dm.tokenizer, shown, color) + [
        "statistics (streaming: the training split is read as it trains; these are of the held-out split)",
        f"  held out          {va['kept']} examples: {dm.stats['validated_on']}",
        f"  truncated         {va['truncated']} at max_seq_len={dm.cfg.max_seq_len}",
        f"  length (tokens)   {_dist(lengths)}",
        f"  loss-bearing      {100 * va['loss_tokens'] / max(va['tokens'], 1):.1f}% of tokens",
        f"  shuffle buffer    {dm.cfg.shuffle_buffer} rows (data.seed={dm.cfg.seed})",
    ]


def main(argv: list[str] | None = None) -> int:
    return run_tool(TOOL, _preview, argv)


def _preview(args: Parsed) -> int:
    # the tokenizer stack loads once the arguments have passed their checks
    from exp.data.datamodule import build_datamodule, build_run_datamodule
    from exp.model.build import build_tokenizer, quiet_third_party_logs
    from exp.run.compose import compose_config

    cfg = compose_config(args.passed)
    quiet_third_party_logs(cfg.verbose)
    tokenizer = build_tokenizer(cfg.model)
    if cfg.objective.preference:
        dm = build_run_datamodule(cfg, tokenizer, num_workers=0)
        text = preference_report(dm, cfg.objective.kind.value, args.values["n"], sys.stdout.isatty(),
                                 cfg.trainer.global_batch_size)  # fmt: skip
        print(text)
        return 0
    step_micro_batches = cfg.accumulate_grad_batches * cfg.data_parallel_size
    if cfg.data.streaming:
        dm = StreamingDataModule(cfg.data, tokenizer, cfg.hardware.micro_batch_size)
    else:
        dm = build_datamodule(cfg.data, tokenizer, cfg.hardware.micro_batch_size, 0, step_micro_batches)
    print(report(dm, args.values["n"], color=sys.stdout.isatty(), batch_size=cfg.trainer.global_batch_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
