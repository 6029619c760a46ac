"""Answers to a fixed set of prompts at every validation, so a user can watch them change across steps.

Not at the step-0 validation unless `trainer.sample_at_start` (the untrained adapters answer as the base model
does; config.py says why that is off by default).

Greedy decoding (deterministic: a change in the text is a change in the model) on rank zero, appended to
`<run>/samples.txt` and, with the W&B logger, logged as a `samples` table (step, prompt, answer) that grows with
every validation. The prompts are `trainer.sample_prompts` (instructions, put in the data's prompt format), or by
default the first `trainer.sample_count` held-out examples, cut where their response begins.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from exp.core.config import DataFormat, TrainConfig
from exp.core.constants import IGNORE_INDEX
from exp.core.strategies import strategy_traits
from exp.data.formats import format_prompt
from exp.model.build import build_tokenizer
from exp.run.dirs import RunLayout

log = logging.getLogger(__name__)


def build_sample_callbacks(cfg: TrainConfig, output_dir: Path) -> list[L.Callback]:
    """The sampling callback, or none when sampling is off or cannot run (no rank holds whole weights, as in FSDP)."""
    t = cfg.trainer
    generates = strategy_traits(cfg.hardware.strategy).whole_weights_on_each_rank  # generate() reads every weight
    if not (t.sample_prompts or t.sample_count) or not generates:
        return []
    return [SampleGenerations(cfg, RunLayout(output_dir).samples)]


def prompt_ids_from_heldout(datamodule: Any, count: int) -> list[list[int]]:
    """The prompt part (ids before the first loss-bearing token) of the first `count` held-out examples."""
    prompts = []
    for enc in getattr(datamodule, "val_set", [])[:count]:
        if hasattr(enc, "prompt"):  # a preference example: its prompt, as the pairs' completions follow it
            prompts.append(list(enc.prompt))
            continue
        first = next((i for i, t in enumerate(enc.labels) if t != IGNORE_INDEX), 0)
        if first > 0 and first < len(enc.input_ids):  # labels on the whole text (train_on_prompt, text format): none
            prompts.append(enc.input_ids[:first])
    return prompts


def prompt_ids_from_text(cfg: TrainConfig, tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """User prompts as instructions, in the data's prompt format (the chat template for chat data)."""

    out = []
    for p in prompts:
        if cfg.data.format in (DataFormat.chat, DataFormat.sharegpt):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = [tokenizer.bos_token_id] + tokenizer(format_prompt(p, ""), add_special_tokens=False)["input_ids"]
        out.append(ids)
    return out


class SampleGenerations(L.Callback):
    """Greedy answers to fixed prompts after every validation (step 0's with `trainer.sample_at_start`), to a
    text file and W&B."""

    def __init__(self, cfg: TrainConfig, path: Path):
        self.cfg, self.path = cfg, path
        self.prompts: list[list[int]] | None = None
        self.tokenizer: Any = None
        self.rows: list[list[Any]] = []  # every (step, prompt, answer) so far: W&B tables are logged whole
        self.done_steps: set[int] = set()

    def prepare(self, datamodule: Any) -> None:
        """The prompts, from the config or the data module's held-out split."""
        self.tokenizer = getattr(datamodule, "tokenizer", None)
        if self.tokenizer is None:
            self.tokenizer = build_tokenizer(self.cfg.model)
        t = self.cfg.trainer
        if t.sample_prompts:
            self.prompts = prompt_ids_from_text(self.cfg, self.tokenizer, list(t.sample_prompts))
        else:
            self.prompts = prompt_ids_from_heldout(datamodule, t.sample_count)
            if not self.prompts:
                log.warning(
                    "samples: no held-out prompt to sample from (the loss covers whole texts); set "
                    "trainer.sample_prompts=[...] to watch answers, or trainer.sample_count=0 to silence this"
                )

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        if trainer.sanity_checking and not self.cfg.trainer.sample_at_start:
            return  # the step-0 validation (Lightning's sanity check over the whole split)
        step = trainer.global_step
        if step in self.done_steps:  # the final trainer.validate repeats the last step's evaluation
            return
        if self.prompts is None:
            self.prepare(trainer.datamodule)
        pl_module.samples_seconds = self.sample(pl_module.model, step, pl_module.device, trainer.loggers)

    def sample(self, model: Any, step: int, device: torch.device, loggers: list) -> float:
        """The answers at `step`, appended to the file and logged to W&B; the seconds they took. `prepare` first."""
        if not self.prompts:
            return 0.0
        self.done_steps.add(step)
        started = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            # Eager, even with compiled decoder layers (hardware.compile): decoding with a KV cache changes what the
            # compiled graphs guard on at every layer and step, and the recompiles would use up Dynamo's cache
            # (8 graphs per function) that the training steps need.
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                answers = self._greedy(model, self.prompts, device)
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - started
        decode = self.tokenizer.decode
        new_rows = [[step, decode(p, skip_special_tokens=True), a] for p, a in zip(self.prompts, answers, strict=True)]
        self.rows += new_rows
        with self.path.open("a") as f:
            f.write(f"=== step {step} ===\n")
            for i, (_, prompt, answer) in enumerate(new_rows, 1):
                # Python literals of the exact texts (the prompt's final newline is part of the prompt format): a
                # prompt copied from here, after `<bos>`, gets this answer.
                f.write(f"[{i}] prompt: {prompt!r}\n    answer: {answer!r}\n")
        for logger in loggers:
            if type(logger).__name__ == "WandbLogger":
                logger.log_table(key="samples", columns=["step", "prompt", "answer"], data=self.rows, step=step)
        return seconds

    def _greedy(self, model: Any, prompts: list[list[int]], device: torch.device) -> list[str]:
        """Every prompt's greedy answer from one `generate` call: the prompts left-padded into one batch (masked
        out), so the answers take as many decoding steps as the longest one, not their sum."""
        tok = self.tokenizer
        stops = [tok.eos_token_id]
        turn_end = tok.convert_tokens_to_ids("<end_of_turn>")
        if isinstance(turn_end, int) and turn_end != tok.unk_token_id:
            stops.append(turn_end)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=self.cfg.trainer.sample_max_new_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=tok.pad_token_id,
            use_cache=True,  # training turned the config's cache off; generation wants it
        )
        return [tok.decode(row[width:], skip_special_tokens=True) for row in out]
