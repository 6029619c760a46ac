"""A group of a study's jobs trained together in one process over one shared 4-bit base
(`hydra.launcher.share_base=true`; which jobs may share one: exp.study.grouping).

The base is loaded once, with one LoRA adapter per job (exp.model.adapters). Each optimiser step takes one
micro-batch from every job's own data stream (its split and order from its own seed), runs the base once over all of
them, each adapter over its job's rows only, and sums the jobs' losses: each adapter's gradient is its job's alone.
Then each job steps its own optimiser, schedule and clipping, validates on its own held-out split when its config
says, and writes its own run directory: config.yaml, status.json, train.log, csv/metrics.csv (and W&B), the adapter
in PEFT's format, manifest.json and summary.json, as a job run alone does.

A job whose loss or gradients turn NaN/Inf does what its `trainer.on_nonfinite` says (skip the update, or fail); a
failed job leaves the group with status `failed` and its message, and the others go on. Dropout draws from one
generator per job (seeded by its `trainer.seed`), so a job's masks do not depend on which jobs share its group.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exp.core.config import ConfigError, LossImpl, NonFinite, TrainConfig
from exp.core.constants import IGNORE_INDEX
from exp.data.batching import sequence_boundaries
from exp.data.datamodule import build_run_datamodule
from exp.model.adapters import RowRouter, adapter_parameters, save_adapter
from exp.model.build import build_model, build_tokenizer, quiet_third_party_logs
from exp.model.compile_cache import compile_summary
from exp.model.loss import chunked_linear_cross_entropy, head_inputs, liger_linear_cross_entropy, resolve_loss_impl
from exp.model.metrics import add_sums, chunked_response_metrics, example_ids, response_metrics, validation_rates
from exp.run.checkpoints import read_checkpoint
from exp.run.compose import config_dict, read_resume_record
from exp.run.dirs import RunLayout, write_json
from exp.run.tracking import build_loggers, write_manifest
from exp.study.group_member import Member, SeededDropout
from exp.training.lifecycle import RunLifecycle
from exp.training.module import build_optimizer, gradient_norm, lr_lambda
from exp.training.pipeline import print_summary
from exp.training.samples import build_sample_callbacks
from exp.training.signals import GUARD, Preempted

log = logging.getLogger("exp.train")


def train_group(members: list[Member], shared: TrainConfig, device: torch.device) -> None:
    """Train every member to its `trainer.max_steps` (or its failure), writing each one's run directory. `shared`:
    the group's config as the preflight resolved it (exp.study.grouping.shared_config), which the base is built
    from; each member's `cfg` carries the same resolved hardware with its own micro-batch."""
    quiet_third_party_logs(members[0].cfg.verbose)
    with contextlib.ExitStack() as stack:
        for m in members:
            m.resumed_from = read_resume_record(m.run_dir)
            m.lifecycle = stack.enter_context(RunLifecycle(m.run_dir, resume=m.resumed_from))
        GUARD.stop_now()
        GUARD.phase = "model build"
        tokenizer = build_tokenizer(shared.model)
        GUARD.phase = "data preparation"
        for m in members:
            m.datamodule = build_run_datamodule(m.cfg, tokenizer, num_workers=0)
            m.token_weighted = m.token_weighted or m.datamodule.step_weighted
        GUARD.phase = "start-up"
        model = build_model(shared, device, adapters={m.adapter: m.cfg.lora for m in members})
        impl = resolve_loss_impl(shared, model, device).impl
        _own_dropout(model, members, device)
        for m in members:
            _start_member(m, model, tokenizer)
        router = RowRouter(model)
        stack.callback(router.remove)
        GUARD.phase = "training"
        _validate(model, router, [m for m in members if m.resumed_from is None], impl, step=0, device=device)
        try:
            while any(m.training for m in members):
                active = [m for m in members if m.training]
                _group_step(model, router, active, impl, tokenizer.pad_token_id, device)
                due = [m for m in active if m.failed is None and _validation_due(m)]
                _validate(model, router, due, impl, step=None, device=device)
                for m in active:
                    if m.failed is None and m.step % m.cfg.trainer.checkpoint_every_n_steps == 0:
                        with GUARD.shielded():
                            m.save_checkpoint(model, periodic=True)
                GUARD.stop_now()
        except Preempted as stop:
            # Every unfinished job keeps its place, a checkpoint of the step it reached (which resume=auto
            # continues), named in its own status.
            with GUARD.shielded():
                for m in members:
                    if m.training:
                        own = Preempted(stop.signum, step=m.step, checkpoint=m.save_checkpoint(model))
                        m.lifecycle.end("preempted", f"Preempted: {own}")
            raise
        GUARD.phase = "saving the results"
        _validate(model, router, [m for m in members if m.failed is None and m.last_val_step != m.step], impl,
                  step=None, device=device)  # fmt: skip
        router.remove()
        for m in members:
            if m.failed is None:
                with GUARD.shielded():
                    m.save_checkpoint(model)  # last.ckpt of the finished job, as a single run leaves one
                    _finish_member(m, model, tokenizer, members, device)


def _own_dropout(model: nn.Module, members: list[Member], device: torch.device) -> None:
    """Give each job's LoRA dropout a generator of its own, seeded by the job's trainer.seed."""
    for m in members:
        if m.cfg.lora.dropout == 0:
            continue
        m.dropout_rng = torch.Generator(device=device).manual_seed(m.cfg.trainer.seed)
        for module in model.modules():
            dropouts = getattr(module, "lora_dropout", None)
            if isinstance(dropouts, nn.ModuleDict) and m.adapter in dropouts:
                dropouts[m.adapter] = SeededDropout(m.cfg.lora.dropout, m.dropout_rng)


def _start_member(m: Member, model: nn.Module, tokenizer: Any) -> None:
    t = m.cfg.trainer
    m.params = adapter_parameters(model, m.adapter)
    m.optimizer = build_optimizer(t, m.params, fused=m.cfg.hardware.fused_adamw)
    m.scheduler = torch.optim.lr_scheduler.LambdaLR(
        m.optimizer, lambda step, t=t: lr_lambda(step, t.warmup_step_count, t.max_steps, t.lr_schedule)
    )
    name = m.cfg.logger.run_name or "-".join(filter(None, [m.cfg.experiment_name, m.cfg.model.name, m.run_dir.name]))
    if m.resumed_from is not None:  # the tracker runs go on
        m.tracking_ids = dict(m.resumed_from.get("tracking_ids") or {})
    m.loggers = build_loggers(
        m.cfg.logger,
        m.run_dir,
        name,
        config_dict(m.cfg),
        m.cfg.experiment_name,
        m.tracking_ids,
        steps_done=lambda m=m: m.step,
        beside_others=True,
        resumed_at=m.resumed_from["step"] if m.resumed_from is not None else None,
    )
    m.lifecycle.track(m.loggers)
    write_manifest(m.run_dir, tokenizer, m.cfg.data)
    if m.resumed_from is not None:
        m.load_checkpoint(model, read_checkpoint(m.resumed_from["checkpoint"]))
        m.datamodule.resume_at(m.batches_seen)
        log.info("%s: continuing from %s (step %d)", m.run_dir.name, m.resumed_from["checkpoint"], m.step)
    m.batches = iter(m.datamodule.train_dataloader())
    if samplers := build_sample_callbacks(m.cfg, m.run_dir):
        m.sampler = samplers[0]
        m.sampler.prepare(m.datamodule)
    m.started = time.time()


def _validation_due(m: Member) -> bool:
    every = m.cfg.trainer.val_every_n_steps
    return bool(every) and m.step % every == 0 and m.last_val_step != m.step


@dataclass(frozen=True)
class Layout:
    """Where each job's part of a combined batch sits: consecutive rows (`axis` 0) or consecutive tokens of its
    single row (`axis` 1, padding-free micro-batches laid end to end); `counts` in the jobs' order."""

    counts: list[int]
    axis: int
    length: int  # tokens per row

    def index(self, j: int) -> tuple[slice, ...]:
        """Job j's part of a [rows, tokens, ...] tensor."""
        a = sum(self.counts[:j])
        return (slice(None),) * self.axis + (slice(a, a + self.counts[j]),)

    def flat(self, j: int) -> slice:
        """Job j's part of the batch's positions, rows flattened end to end."""
        scale = self.length if self.axis == 0 else 1
        a = sum(self.counts[:j])
        return slice(a * scale, (a + self.counts[j]) * scale)


def _combine(batches: list[dict[str, torch.Tensor]], pad_id: int) -> tuple[dict[str, torch.Tensor], Layout]:
    """The micro-batches of several jobs as one batch. Padding-free micro-batches of one row each (examples end to
    end, position ids restarting at 0) are laid end to end in one row: the row's examples keep attending to
    themselves only, and no job pads to another's length. Other micro-batches are stacked by rows, each padded on
    the right to the longest (a causal model's real positions never see later ones, and padded labels take no
    loss). Position-id rows get the boundaries of the combined row (exp.data.batching.sequence_boundaries)."""
    fill = {"input_ids": pad_id, "labels": IGNORE_INDEX, "attention_mask": 0, "position_ids": 0}
    flat_rows = all("position_ids" in b and "attention_mask" not in b for b in batches)
    if len({"attention_mask" in b for b in batches}) > 1:
        raise ConfigError("a group's micro-batches disagree on carrying an attention mask")
    if flat_rows and all(b["input_ids"].shape[0] == 1 for b in batches):
        out = {k: torch.cat([b[k] for b in batches], dim=1) for k in fill if k in batches[0]}
        layout = Layout([b["input_ids"].shape[1] for b in batches], axis=1, length=out["input_ids"].shape[1])
    else:
        length = max(b["input_ids"].shape[1] for b in batches)
        out = {
            k: torch.cat([F.pad(b[k], (0, length - b[k].shape[1]), value=fill[k]) for b in batches])
            for k in fill
            if k in batches[0]
        }
        layout = Layout([b["input_ids"].shape[0] for b in batches], axis=0, length=length)
    if flat_rows:
        out |= sequence_boundaries(out["position_ids"])
    return out, layout


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _member_losses(model: nn.Module, batch: dict[str, Any], layout: Layout, impl: LossImpl) -> list[torch.Tensor]:
    """Each job's mean next-token loss over its own part's loss-bearing tokens, from one forward pass of all parts.
    A job's last position never takes the next part's first label: every part begins an example, whose first label
    is ignored (padding-free) or lies in another row (stacked rows)."""
    jobs = range(len(layout.counts))
    if impl == LossImpl.hf:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs, use_cache=False).logits
        # As transformers' ForCausalLMLoss: fp32 logits, labels shifted by one, mean over the loss-bearing tokens.
        targets = F.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
        return [
            F.cross_entropy(
                logits[layout.index(j)].float().reshape(-1, logits.shape[-1]),
                targets[layout.index(j)].reshape(-1).to(logits.device),
                ignore_index=IGNORE_INDEX,
            )
            for j in jobs
        ]
    h = head_inputs(model, batch)
    loss = liger_linear_cross_entropy if impl == LossImpl.liger else chunked_linear_cross_entropy
    return [loss(h.hidden[layout.flat(j)], h.weight, h.targets[layout.flat(j)], h.softcap) for j in jobs]


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "16-mixed":
        raise ConfigError(
            "hardware.precision=16-mixed: a group of jobs sharing one base trains in bf16-mixed or full precision "
            "(fp16's loss scaling would be one scaler per job). Fix: hardware.precision=bf16-mixed, or run the "
            "study without hydra.launcher.share_base."
        )
    return contextlib.nullcontext()


def _group_step(
    model: nn.Module, router: RowRouter, active: list[Member], impl: LossImpl, pad_id: int, device: torch.device
) -> None:
    """One optimiser step of every active member: their micro-batches in lockstep, then each member's own update.

    A member's micro-batch losses are weighted as its run alone weights them: by their share of the step's
    loss-bearing tokens where that run is padding-free or length-grouped by step (`Member.token_weighted`), else
    equally (Lightning's accumulation)."""
    started = time.perf_counter()
    # Padding-free data decides its micro-batches per step (each job's own count, from its own order).
    steps = [[next(m.batches) for _ in range(m.datamodule.flat_accumulation or m.cfg.accumulate_grad_batches)]
             for m in active]  # fmt: skip
    weights = []
    real = [0] * len(active)
    slots = [0] * len(active)
    for j, (m, batches) in enumerate(zip(active, steps, strict=True)):
        for b in batches:
            b.pop("step_loss_tokens", None)  # recounted below from the step's own micro-batches
            mask = b.get("attention_mask")
            tokens = b.pop("real_tokens", None)  # padding-free rows say how many of their tokens are real
            if tokens is None:
                tokens = mask.sum() if mask is not None else b["input_ids"].numel()
            real[j] += int(tokens)
            slots[j] += b["input_ids"].numel()
        counts = [int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches]
        if m.token_weighted:
            total = sum(counts)
            weights.append([c / total if total else 0.0 for c in counts])
        else:
            weights.append([1 / len(batches)] * len(batches))
        m.batches_seen += len(batches)
    values: list[list[torch.Tensor]] = [[] for _ in active]
    for i in range(max(len(batches) for batches in steps)):
        part = [j for j, batches in enumerate(steps) if i < len(batches)]
        batch, layout = _combine([steps[j][i] for j in part], pad_id)
        router.route([(active[j].adapter, n) for j, n in zip(part, layout.counts, strict=True)], axis=layout.axis)
        with _autocast(device, active[0].cfg.hardware.precision):
            per_member = _member_losses(model, _to(batch, device), layout, impl)
        total = 0
        for j, loss in zip(part, per_member, strict=True):
            values[j].append(loss.detach().float())
            total = total + loss * weights[j][i]
        total.backward()
    # One read of every member's losses per step (a read per loss would stall the device once per member).
    read = torch.cat([torch.stack(v) for v in values]).cpu().split([len(v) for v in values])
    seconds = time.perf_counter() - started
    for j, m in enumerate(active):
        bad = not bool(torch.isfinite(read[j]).all())
        # train/loss is the step's last micro-batch loss, as Lightning logs a job run alone.
        _update(m, bad, float(read[j][-1]))
        m.step_tokens_per_s.append(real[j] / seconds)
        m.tokens_trained += real[j]
        m.step_padding.append(1 - real[j] / slots[j] if slots[j] else 0.0)
        if m.failed is None and (m.step % m.cfg.trainer.log_every_n_steps == 0 or not m.training):
            _log(m, {"train/tokens_per_s": m.step_tokens_per_s[-1], "train/padding": m.step_padding[-1]})


def _update(m: Member, loss_bad: bool, loss: float) -> None:
    """The member's optimiser step, as Lightning takes one for a job alone: the gradient norm before clipping (a
    NaN/Inf loss or gradient skips the update or fails the job, as trainer.on_nonfinite says), clipping, the step,
    the schedule."""
    t = m.cfg.trainer
    norm = gradient_norm(m.params)
    lr = m.optimizer.param_groups[0]["lr"]
    finite = not loss_bad and (norm is None or bool(torch.isfinite(norm)))
    metrics: dict[str, float] = {"train/loss": loss, "train/lr": lr}
    if not finite:
        m.optimizer.zero_grad(set_to_none=True)
        if t.on_nonfinite == NonFinite.skip and m.skipped_steps < t.max_skipped_steps:
            m.skipped_steps += 1
            metrics["train/skipped_steps"] = float(m.skipped_steps)
            log.warning("%s step %d: NaN/Inf loss or gradients, update skipped", m.run_dir.name, m.step + 1)
        else:
            _fail(
                m,
                f"NonFiniteError: step {m.step + 1}: the loss or the gradients are NaN/Inf; this job left its group "
                "and the others went on. Lower trainer.learning_rate or raise trainer.warmup_steps, or set "
                "trainer.on_nonfinite=skip to drop such steps.",
            )
            return
    else:
        if norm is not None:
            metrics["train/grad_norm"] = float(norm)
        if t.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(m.params, t.max_grad_norm)
        m.optimizer.step()
        m.optimizer.zero_grad(set_to_none=True)
    m.scheduler.step()
    m.step += 1
    if m.step % t.log_every_n_steps == 0 or not m.training:
        _log(m, metrics)


def _log(m: Member, metrics: dict[str, float]) -> None:
    for logger in m.loggers:
        logger.log_metrics(metrics, step=m.step)
        logger.save()


def _fail(m: Member, message: str) -> None:
    m.failed = message
    for p in m.params:  # frozen from now on: the shared backward leaves its tensors alone
        p.requires_grad_(False)
        p.grad = None
    log.error("%s failed: %s", m.run_dir.name, message)
    m.lifecycle.end("failed", message)


VAL_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")


# Eager, as a single run validates: without gradients every compiled part would compile again.
@torch.compiler.set_stance("force_eager")
@torch.no_grad()
def _validate(
    model: nn.Module, router: RowRouter, members: list[Member], impl: LossImpl, step: int | None, device: torch.device
) -> None:
    """Every member's held-out split through its own adapter, in one pass: the i-th validation batch of every member
    in one forward of the base (as a training step), each member's sums from its own rows (step 0: the untrained
    adapters' evaluation). Then each member's samples, when its config asks."""
    if not members:
        return
    model.eval()
    started = time.perf_counter()
    try:
        pad_id = members[0].datamodule.tokenizer.pad_token_id
        streams = []
        for m in members:
            limit = m.cfg.trainer.limit_val_batches
            batches = iter(m.datamodule.val_dataloader())
            streams.append(itertools.islice(batches, limit) if limit is not None else batches)
        sums: list[dict[str, torch.Tensor]] = [{} for _ in members]
        counts = [0] * len(members)
        while True:
            part = [(j, next(s, None)) for j, s in enumerate(streams)]
            part = [(j, {k: v for k, v in b.items() if k in VAL_KEYS}) for j, b in part if b is not None]
            if not part:
                break
            batch, layout = _combine([b for _, b in part], pad_id)
            router.route([(members[j].adapter, n) for (j, _), n in zip(part, layout.counts, strict=True)],
                         axis=layout.axis)  # fmt: skip
            with _autocast(device, members[0].cfg.hardware.precision):
                per_member = _member_metrics(model, _to(batch, device), layout, impl)
            for (j, _), metrics in zip(part, per_member, strict=True):
                add_sums(sums[j], metrics)
                counts[j] += 1
        seconds = time.perf_counter() - started
        for m, s, batches in zip(members, sums, counts, strict=True):
            metrics = {f"val/{k}": v for k, v in validation_rates(s).items()}
            at = m.step if step is None else step
            sampled = 0.0
            if m.sampler is not None and (at or m.cfg.trainer.sample_at_start) and at not in m.sampler.done_steps:
                router.route_all(m.adapter)
                with _autocast(device, m.cfg.hardware.precision):
                    sampled = m.sampler.sample(model, at, device, m.loggers)
            m.validation_times.append(
                {
                    "step": at,
                    "seconds": round(seconds, 2),  # the pass shared by `shared_by` jobs
                    "shared_by": len(members),
                    "samples_seconds": round(sampled, 2),
                    "examples": int(s["examples"]),
                    "micro_batches": batches,
                }
            )
            m.last_val, m.last_val_step = metrics, at
            if at == 0 and m.initial_val is None:
                m.initial_val = metrics
            _log(m, metrics)
    finally:
        model.train()


def _member_metrics(
    model: nn.Module, batch: dict[str, Any], layout: Layout, impl: LossImpl
) -> list[dict[str, torch.Tensor]]:
    """Each member's summed validation metrics from its own part of one forward pass (exp.model.metrics)."""
    jobs = range(len(layout.counts))

    def part(j: int) -> dict[str, torch.Tensor]:
        return {k: batch[k][layout.index(j)] for k in VAL_KEYS if k in batch}

    if impl == LossImpl.hf:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**inputs, use_cache=False).logits
        return [
            response_metrics(logits[layout.index(j)], part(j)["labels"], example_ids(part(j)).to(logits.device))
            for j in jobs
        ]
    h = head_inputs(model, batch)
    return [
        chunked_response_metrics(
            h.hidden[layout.flat(j)],
            h.weight,
            h.targets[layout.flat(j)],
            example_ids(part(j)).to(h.targets.device),
            h.softcap,
        )
        for j in jobs
    ]


def _finish_member(m: Member, model: nn.Module, tokenizer: Any, members: list[Member], device: torch.device) -> None:
    """The member's adapter (whole or absent), its summary and its console lines."""
    layout = RunLayout(m.run_dir)
    tmp = layout.adapter.with_name(f".{layout.adapter.name}.{os.getpid()}.partial")
    try:
        save_adapter(model, m.adapter, tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, layout.adapter)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    timed = m.step_tokens_per_s[2:] or m.step_tokens_per_s
    summary = {
        "steps": m.step,
        "seconds": round(time.time() - m.started, 1),
        "initial_val": m.initial_val or {},
        "final_val": m.last_val,
        "chance_token_accuracy": m.datamodule.majority_token_accuracy(),
        "tokens_per_s_median": round(statistics.median(timed), 1) if timed else None,
        "tokens_trained": m.tokens_trained,  # real (non-padding) input tokens of every training step
        "padding_fraction": round(statistics.fmean(m.step_padding), 4) if m.step_padding else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "device": str(device),
        "world_size": 1,
        "epochs": round(m.batches_seen / m.datamodule.batches_per_epoch, 3),
        "skipped_steps": m.skipped_steps,
        "resumed_from": m.resumed_from,
        "data": m.datamodule.stats,
        "validation_seconds": m.validation_times,
        "compile": compile_summary() if m.cfg.hardware.compile is True else None,  # the group's process'
        # The jobs this one trained beside over one base (throughput and peak memory are the group's process').
        "group": {"size": len(members), "jobs": [o.run_dir.name for o in members], "adapter": m.adapter},
    }
    write_json(layout.summary, summary)
    print_summary(summary, m.run_dir)
