"""The LightningModule: a 4-bit Gemma + LoRA, loaded in `configure_model` on the device the strategy chose."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import lightning as L
import torch

from exp.core.config import LossImpl, NonFinite, Optimizer, Schedule, TrainConfig, TrainerConfig
from exp.core.constants import IGNORE_INDEX
from exp.core.strategies import strategy_traits
from exp.model.build import build_model
from exp.model.compile_cache import compile_summary
from exp.model.loss import causal_lm_loss, resolve_loss_impl
from exp.model.loss_plan import LossChoice
from exp.model.metrics import add_sums, batch_response_metrics, validation_rates
from exp.training.faults import NonFiniteError
from exp.training.fsdp import clean_name
from exp.training.objectives import preference_loss, preference_rates, preference_split_rates
from exp.training.reference import precompute_reference

log = logging.getLogger("exp.module")

# A preference objective's rates shown in the progress bar beside the loss (train/ and val/): what says whether the
# policy separates chosen from rejected; the rest go to the loggers only.
PROGRESS_BAR_PREFERENCE = ("accuracy", "rewards/margin")

# Device types torch's fused AdamW has kernels for (and exp tests: CUDA on the GPU machine, the CPU in CI).
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def lr_lambda(step: int, warmup_steps: int, max_steps: int, schedule: Schedule) -> float:
    """Multiplier of the peak learning rate at optimiser step `step`: linear warmup, then the schedule."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == Schedule.constant:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == Schedule.linear:
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def continued_schedule_note(t: TrainerConfig, trained_max_steps: int, step: int) -> str | None:
    """What a continuation with a larger `trainer.max_steps` does to the learning rate (None: the same length).

    The scheduler is rebuilt from the new config and its step counter restored from the checkpoint, so the run follows
    the schedule of a fresh `max_steps`-step run from `step` on: the schedule is stretched, not restarted, and the
    learning rate moves to that schedule's value at `step`."""
    if trained_max_steps == t.max_steps:
        return None
    before = replace(t, max_steps=trained_max_steps)
    last = t.learning_rate * lr_lambda(max(step - 1, 0), before.warmup_step_count, trained_max_steps, t.lr_schedule)
    now = t.learning_rate * lr_lambda(step, t.warmup_step_count, t.max_steps, t.lr_schedule)
    return (
        f"trainer.max_steps {trained_max_steps} -> {t.max_steps}: the {t.lr_schedule.value} learning-rate schedule is "
        f"stretched to {t.max_steps} steps (warmup {t.warmup_step_count}), as a fresh {t.max_steps}-step run has it, "
        f"and continued from step {step}: the learning rate goes from {last:.3g} (step {max(step - 1, 0)}) to {now:.3g}"
    )


def step_token_weighted(
    mean_loss: torch.Tensor, labels: torch.Tensor, step_tokens: torch.Tensor, accumulate: int, world_size: int
) -> torch.Tensor:
    """A micro-batch's mean loss re-weighted so that its optimiser step's gradient is that of the mean over all the
    step's loss tokens (`step_tokens`, over every micro-batch of every rank), whatever each micro-batch holds.

    Lightning divides the returned loss by `accumulate`, and DDP / FSDP average the gradients over `world_size`
    ranks: the factor undoes both, so the summed contributions are (sum of token losses) / step_tokens.
    """
    tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
    return mean_loss * tokens * (accumulate * world_size) / step_tokens


def gradient_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """The 2-norm of all gradients together, in float32 (None when no parameter has one). One fused norm over the
    list (a few kernels, not two per tensor: on a short step the launches of hundreds of per-tensor norms are a
    measurable share of the host's time)."""
    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


def build_optimizer(
    t: TrainerConfig,
    params: list[torch.nn.Parameter],
    fused: bool = False,
    plus_lr_ratio: float | None = None,
    model: torch.nn.Module | None = None,
) -> torch.optim.Optimizer:
    """`fused`: torch's fused AdamW kernel, taken when every parameter is on a device it has a kernel for.
    `plus_lr_ratio` (lora.plus_lr_ratio): LoRA+ through PEFT's `create_loraplus_optimizer` over `model`'s trainable
    tensors: A (and full module copies) at trainer.learning_rate, B and 1-D tensors (biases, DoRA's magnitudes) at
    that times the ratio. The schedule scales every group's rate alike; the groups are in the optimiser's state, so
    a resumed run continues each at its own rate."""
    kwargs: dict[str, Any] = dict(lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay)
    if t.optimizer == Optimizer.adamw:
        if fused and params and all(p.device.type in FUSED_ADAMW_DEVICES for p in params):
            kwargs["fused"] = True
        cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    else:
        import bitsandbytes as bnb  # the paged optimisers only

        cls = {
            Optimizer.paged_adamw_32bit: bnb.optim.PagedAdamW32bit,
            Optimizer.paged_adamw_8bit: bnb.optim.PagedAdamW8bit,
        }[t.optimizer]
    if plus_lr_ratio is None:
        return cls(params, **kwargs)
    from peft.optimizers import create_loraplus_optimizer  # LoRA+ runs only

    assert model is not None, "LoRA+ groups the model's trainable tensors by name"
    # PEFT's weight decay of the groups is its own argument (default 0): exp's trainer.weight_decay holds for all.
    return create_loraplus_optimizer(
        model, cls, loraplus_lr_ratio=plus_lr_ratio, loraplus_weight_decay=t.weight_decay, **kwargs
    )


def capture_rng(device: torch.device) -> dict[str, Any]:
    """Every random state training draws from (dropout: torch's, on the CPU or the GPU), as plain types."""
    import numpy as np

    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _as_tuples(x: Any) -> Any:
    """random.setstate wants the tuples random.getstate gave (a checkpoint round trip may turn them into lists)."""
    return tuple(_as_tuples(v) for v in x) if isinstance(x, list | tuple) else x


class QLoRAModule(L.LightningModule):
    """Fine-tunes the LoRA adapters of a frozen (4-bit) causal LM.

    The model is built in `configure_model`, which Lightning calls once the strategy has picked the device, so the
    quantized weights are created where they will be used and never moved. Checkpoints hold only the trainable
    (adapter) tensors, not the frozen base.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        tracking_ids: dict[str, str] | None = None,
        last_good_checkpoint: Callable[[], str | None] | None = None,
    ):
        """`tracking_ids`: the tracking runs to continue (W&B's id), saved in every checkpoint.
        `last_good_checkpoint`: where to go back to after a NaN/Inf step (named in the message); none by default."""
        super().__init__()
        self.cfg = cfg
        self.model: torch.nn.Module | None = None
        # Checkpoints omit the frozen base, so loading them must not demand every key.
        self.strict_loading = False
        self.initial_val: dict[str, float] | None = None
        self.last_val: dict[str, float] = {}
        self.last_val_step: int | None = None  # the optimiser step `last_val` was measured after (fit's validations)
        # The training metrics logged during the current optimiser step (tensors, read only when exp logs them).
        self._step_logged: dict[str, Any] = {}
        self._val_sums: dict[str, torch.Tensor] = {}
        self._val_started = 0.0
        self._val_batches = 0
        # Seconds of the current validation spent on the samples' greedy answers (exp.training.samples adds them).
        self.samples_seconds = 0.0
        # Every validation's cost: step, seconds (samples included), the samples' share, examples, micro-batches.
        self.validation_times: list[dict[str, Any]] = []
        self._step_started: float | None = None
        self._step_tokens = 0
        self._batch_tokens = 0  # real tokens of the next training batch, counted before its transfer
        self._step_slots = 0  # token positions (real and padding) of the optimiser step so far
        self._batch_slots = 0
        self.step_tokens_per_s: list[float] = []
        self.step_padding: list[float] = []  # per optimiser step: the fraction of its token positions that pad
        self.step_seconds: list[float] = []  # per optimiser step: what a study plan's time estimate reads
        # Resume state (saved in every checkpoint under "exp"): micro-batches this rank has trained on (the data
        # position), steps skipped for NaN/Inf, and ids of the tracking runs to continue.
        self.batches_seen = 0
        self.skipped_steps = 0
        self.tracking_ids: dict[str, str] = dict(tracking_ids or {})
        self._rng_to_restore: dict[str, Any] | None = None
        # Any non-finite micro-batch loss since the last optimiser step, kept on the device (no host sync per
        # micro-batch); read once per optimiser step.
        self._loss_bad: torch.Tensor | bool = False
        self.last_good_checkpoint: Callable[[], str | None] = last_good_checkpoint or (lambda: None)
        # The training loss's implementation (hardware.loss_impl resolved for this device and model).
        self.loss_choice = LossChoice(LossImpl.hf, "not resolved yet")
        # objective.precompute_reference: where the reference log-probabilities came from, what they cost.
        self.reference_record: dict[str, Any] | None = None

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning may call this again (fit after validate): load once
            return
        device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
        self.model = build_model(self.cfg, device)
        self.loss_choice = resolve_loss_impl(self.cfg, self.model, device)
        log.info("training loss: %s (%s)", self.loss_choice.impl.value, self.loss_choice.reason)

    def on_fit_start(self) -> None:
        datamodule = self.trainer.datamodule
        if not self.cfg.objective.precompute_reference or datamodule is None:
            return
        # Under the steps' autocast (the values must be what a step's own reference pass gives), eager where the
        # layers are compiled (one pass without gradients: compiling its graphs would cost more than it saves).
        with self.trainer.precision_plugin.forward_context(), torch.compiler.set_stance("force_eager"):
            self.reference_record = precompute_reference(
                self.model,
                datamodule,
                self.cfg,
                self.loss_choice.impl,
                self.device,
                self._gather,
                self.trainer.global_rank,
                self.trainer.world_size,
            )

    def cpu(self) -> QLoRAModule:
        """Stay put. Lightning's teardown moves the module to the CPU after `fit`; a quantized model must stay on
        the device it was loaded on (moving 4-bit weights is what breaks QLoRA runs, and a final evaluation and the
        replica check follow on the same devices). Move explicitly with `.to("cpu")` if you must."""
        return self

    def forward(self, **batch: torch.Tensor) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.cfg.objective.preference:
            return self._preference_step(batch)
        step_tokens = batch.pop("step_loss_tokens", None)
        # transformers' `model(**batch).loss`, or the same loss without the full logits (exp.model.loss).
        with self._saved_tensors_place():
            loss = causal_lm_loss(self.model, batch, self.loss_choice.impl)
        value = loss.detach()
        self._loss_bad = ~torch.isfinite(value) | self._loss_bad
        self._log_train("train/loss", value, prog_bar=True)
        if step_tokens is not None:
            loss = step_token_weighted(loss, batch["labels"], step_tokens, self.trainer.accumulate_grad_batches,
                                       self.trainer.world_size)  # fmt: skip
        return loss

    def _preference_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A preference objective's mean loss over the micro-batch's pairs (exp.training.objectives); equal-sized
        micro-batches make Lightning's mean over them the step's mean over pairs."""
        with self._saved_tensors_place():
            loss, sums = preference_loss(self.model, batch, self.cfg.objective, self.loss_choice.impl)
        value = loss.detach()
        self._loss_bad = ~torch.isfinite(value) | self._loss_bad
        self._log_train("train/loss", value, prog_bar=True)
        # The micro-batch's rates, as validation computes them (tensors: read back only when logged).
        for name, rate in preference_rates(sums).items():
            if name != "loss":
                self._log_train(f"train/{name}", rate, prog_bar=name in PROGRESS_BAR_PREFERENCE)
        return loss

    def _saved_tensors_place(self) -> contextlib.AbstractContextManager:
        """hardware.offload_checkpoints: what autograd saves outside the recomputed layers (their inputs, the final
        norm's and the loss's tensors) goes to host memory (pinned on CUDA, so the copies back can overlap); inside a
        checkpointed layer, checkpointing's own hooks come first and save nothing."""
        if not self.cfg.hardware.offload_checkpoints:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # After unscaling and before clipping: the norm the clip threshold is compared with.
        norm = gradient_norm(self.model.parameters())
        has_grads = norm is not None
        if norm is None:
            norm = torch.zeros((), device=self.device)
        self._log_train("train/lr", optimizer.param_groups[0]["lr"])
        # fp16's loss scaler skips steps with inf gradients itself (and lowers the scale): only the loss counts there.
        check_grads = self.trainer.precision not in ("16-mixed", "16")
        bad = torch.as_tensor(self._loss_bad, device=norm.device)
        if check_grads:
            bad = bad | ~torch.isfinite(norm)
        bad = bad.float()  # one flag per rank; the only host sync of the step is reading it below
        self._loss_bad = False
        if self.trainer.world_size > 1:  # the loss differs per rank; every rank must take the same decision
            bad = self.trainer.strategy.reduce(bad, reduce_op="max")
        if bad.item():
            self._non_finite_step(optimizer)
            return
        if has_grads:
            self._log_train("train/grad_norm", norm)

    def _non_finite_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip the update (weights and optimizer state untouched) or stop, as trainer.on_nonfinite says."""
        t, step = self.cfg.trainer, self.trainer.global_step + 1
        good = self.last_good_checkpoint()
        where, then = (
            (f"the last good checkpoint is {good}", f"resume with trainer.resume={good}")
            if good
            else ("there is no checkpoint yet", "start again")
        )
        if t.on_nonfinite == NonFinite.skip and self.skipped_steps < t.max_skipped_steps:
            self.skipped_steps += 1
            # AdamW leaves parameters without a gradient alone, moments included.
            optimizer.zero_grad(set_to_none=True)
            self._log_train("train/skipped_steps", float(self.skipped_steps))
            log.warning("step %d: NaN/Inf loss or gradients, update skipped (%d so far)", step, self.skipped_steps)
            return
        limit = (
            f" after {self.skipped_steps} skipped steps (trainer.max_skipped_steps={t.max_skipped_steps})"
            if t.on_nonfinite == NonFinite.skip
            else ""
        )
        raise NonFiniteError(
            f"step {step}: the loss or the gradients are NaN/Inf{limit}; {where}. Training stopped before the bad "
            f"update, and no adapter was saved as final. Lower trainer.learning_rate or raise trainer.warmup_steps "
            f"and {then}, or set trainer.on_nonfinite=skip to drop such steps."
        )

    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Counted when a batch starts, so a checkpoint written at its end (or after the validation that follows)
        # counts it as consumed.
        self.batches_seen += 1
        if self._step_started is None:
            self._step_started = time.perf_counter()
        self._step_tokens += self._batch_tokens
        self._step_slots += self._batch_slots

    def on_before_batch_transfer(self, batch: dict[str, torch.Tensor], dataloader_idx: int) -> dict[str, torch.Tensor]:
        # The batch's real tokens are counted here, while it is still on the host: read back from a GPU, the sum
        # would wait for every kernel queued before it (a host sync per micro-batch).
        real = batch.pop("real_tokens", None)  # padding-free rows say how many of their tokens are real
        if self.trainer.training:
            mask = batch.get("attention_mask")
            self._batch_slots = batch["input_ids"].numel()
            if real is not None:
                self._batch_tokens = int(real)
            else:  # packed rows carry no attention mask: their positions are all taken by examples
                self._batch_tokens = int(mask.sum()) if mask is not None else self._batch_slots
        return batch

    def on_train_batch_end(self, outputs: Any, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches:
            return  # mid-accumulation: the optimiser step is not over yet
        elapsed = time.perf_counter() - self._step_started
        # Real (non-padding) input tokens per second over the optimiser step just finished.
        tokens_per_s = self._step_tokens / elapsed
        padding = 1 - self._step_tokens / self._step_slots if self._step_slots else 0.0
        self.step_tokens_per_s.append(tokens_per_s)
        self.step_seconds.append(elapsed)
        self.step_padding.append(padding)
        self._log_train("train/tokens_per_s", tokens_per_s, prog_bar=True)
        self._log_train("train/padding", padding, prog_bar=True)
        if self.device.type == "cuda":
            self._log_train("train/peak_memory_gib", torch.cuda.max_memory_allocated(self.device) / 2**30)
        self._step_started, self._step_tokens, self._step_slots = None, 0, 0
        if (
            self.trainer.global_step >= self.trainer.max_steps
            and self.trainer.global_step % self.trainer.log_every_n_steps
        ):
            self._log_final_step()
        self._step_logged = {}

    def _log_train(self, name: str, value: Any, prog_bar: bool = False) -> None:
        self.log(name, value, prog_bar=prog_bar)
        self._step_logged[name] = value

    def _log_final_step(self) -> None:
        """The last step's training metrics, to the loggers directly: Lightning hands them over every
        `trainer.log_every_n_steps` steps only, so a run whose length is no multiple of it (or which is shorter)
        would end without its last training row, and a short one without any training-loss curve."""
        metrics = {k: float(v) for k, v in self._step_logged.items()}
        for logger in self.loggers:
            # Lightning's step for training metrics is the steps done less one (W&B's axis); the CSV record
            # numbers its rows by steps done (exp.run.csv_record).
            logger.log_metrics(metrics, step=self.trainer.global_step - 1)
            logger.save()

    def throughput_summary(self) -> dict[str, float | None]:
        """Median real (non-padding) tokens/s over the steps after the first two (warm-up: allocator, kernels,
        compilation), what the warm-up cost beyond two median steps, the padding fraction of the run's
        micro-batches, peak memory and what compiling cost."""
        timed = self.step_tokens_per_s[2:] or self.step_tokens_per_s
        seconds = self.step_seconds[2:] or self.step_seconds
        median_s = statistics.median(seconds) if seconds else None
        warmup = self.step_seconds[:2]
        warmup_extra = sum(warmup) - len(warmup) * median_s if len(self.step_seconds) > 2 else None
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        return {
            "tokens_per_s_median": round(statistics.median(timed), 1) if timed else None,
            "step_seconds_median": round(median_s, 4) if median_s is not None else None,
            "warmup_extra_s": round(warmup_extra, 2) if warmup_extra is not None else None,
            "padding_fraction": round(statistics.mean(self.step_padding), 4) if self.step_padding else None,
            "peak_memory_gib": round(peak, 2) if peak is not None else None,
            "compile": compile_summary() if self.cfg.hardware.compile is True else None,
            "validation_seconds": self.validation_times,
        }

    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}
        self._val_started, self._val_batches, self.samples_seconds = time.perf_counter(), 0, 0.0

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Eager, also where the layers are compiled: without gradients every compiled layer would compile again
        # (a graph per grad mode and length), which on a fresh machine costs more than the whole validation of a
        # held-out split in eager mode.
        with torch.compiler.set_stance("force_eager"):
            if self.cfg.objective.preference:
                metrics = preference_loss(self.model, batch, self.cfg.objective, self.loss_choice.impl)[1]
            else:
                metrics = batch_response_metrics(self.model, batch, self.loss_choice.impl)
        add_sums(self._val_sums, metrics)
        self._val_batches += 1

    def on_validation_epoch_end(self) -> None:
        sums = {k: self.trainer.strategy.reduce(v, reduce_op="sum") for k, v in self._val_sums.items()}
        if not sums:
            return
        self._record_validation_time(int(sums["pairs" if self.cfg.objective.preference else "examples"]))
        rates = preference_split_rates(sums) if self.cfg.objective.preference else validation_rates(sums)
        metrics = {f"val/{k}": v for k, v in rates.items()}
        self.last_val = metrics
        if self.trainer.sanity_checking:
            # The sanity check runs on the untrained adapters: record it as the step-0 evaluation. Lightning
            # drops metrics logged during the sanity check, so they go to the loggers directly.
            self.initial_val = metrics
            for logger in self.loggers:
                logger.log_metrics(metrics, step=0)
            return
        self.last_val_step = self.trainer.global_step if self.trainer.state.fn == "fit" else None
        for k, v in metrics.items():
            self.log(
                k, v, prog_bar=k == "val/loss" or k.removeprefix("val/") in PROGRESS_BAR_PREFERENCE, sync_dist=False
            )

    def _record_validation_time(self, examples: int) -> None:
        """What this validation cost (read after the metrics' reduction, which waits for the device)."""
        seconds = time.perf_counter() - self._val_started
        step = 0 if self.trainer.sanity_checking else self.trainer.global_step
        self.validation_times.append(
            {
                "step": step,
                "seconds": round(seconds, 2),
                "samples_seconds": round(self.samples_seconds, 2),
                "examples": examples,
                "micro_batches": self._val_batches,
            }
        )
        log.info(
            "validation at step %d: %d examples in %d micro-batch(es), %.1f s (the samples' answers %.1f s of it)",
            step,
            examples,
            self._val_batches,
            seconds,
            self.samples_seconds,
        )

    def on_train_start(self) -> None:
        # Lightning restores the modes modules had before validation; make sure training mode (dropout,
        # gradient checkpointing) is what the adapters train in, whatever ran before.
        self.model.train()
        if self._rng_to_restore is not None:
            # The last thing before the first resumed step, so no draw in between (loading, setup) shifts it.
            restore_rng(self._rng_to_restore, self.device)
            self._rng_to_restore = None

    def configure_optimizers(self):
        t = self.cfg.trainer
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = build_optimizer(
            t, params, fused=self.cfg.hardware.fused_adamw, plus_lr_ratio=self.cfg.lora.plus_lr_ratio, model=self.model
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_lambda(step, t.warmup_step_count, t.max_steps, t.lr_schedule)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def placement(self) -> dict[str, Any]:
        """Where this process's weights live: every device holding a frozen or a trainable parameter."""
        frozen = sorted({str(p.device) for p in self.model.parameters() if not p.requires_grad})
        trainable = sorted({str(p.device) for p in self.model.parameters() if p.requires_grad})
        return {"root_device": str(self.trainer.strategy.root_device), "frozen": frozen, "trainable": trainable}

    def _gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (every rank must call this)."""
        if self.trainer.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.trainer.world_size
        dist.all_gather_object(out, obj)
        return out

    def gather_placements(self) -> list[dict[str, Any]]:
        """Every rank's `placement()` (rank order), for the run summary."""
        return self._gather(self.placement())

    def gather_throughput(self) -> dict[str, Any]:
        """The run's `throughput_summary()` over every rank: tokens/s summed (the ranks train their own
        micro-batches at the same time), the slowest rank's step time and the fullest device's peak, with each
        rank's own figures under `per_rank`. One process: its own summary."""
        ranks = self._gather(self.throughput_summary())
        if len(ranks) == 1:
            return ranks[0]

        def combine(key: str, how: Callable[[list[float]], float]) -> float | None:
            values = [r[key] for r in ranks]
            return None if None in values else round(how(values), 4)

        return {
            "tokens_per_s_median": combine("tokens_per_s_median", sum),
            "step_seconds_median": combine("step_seconds_median", max),
            "warmup_extra_s": combine("warmup_extra_s", max),
            "padding_fraction": combine("padding_fraction", statistics.mean),
            "peak_memory_gib": combine("peak_memory_gib", max),
            "compile": ranks[0]["compile"],
            "validation_seconds": ranks[0]["validation_seconds"],
            "per_rank": ranks,
        }

    def check_replicas_agree(self) -> list[list[float]] | None:
        """Data-parallel replicas must hold identical adapters: gather a fingerprint of each and compare.

        Returns the per-rank fingerprints (sum and sum of squares of the adapter weights); None with one process or
        with FSDP (which holds one sharded copy). A mismatch means the ranks trained different models.
        """
        if self.trainer.world_size == 1 or not strategy_traits(self.cfg.hardware.strategy).whole_weights_on_each_rank:
            return None
        weights = [p.detach().double().flatten() for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat(weights)
        mine = torch.stack([flat.sum(), (flat * flat).sum()])
        prints = self.trainer.strategy.all_gather(mine).reshape(-1, 2).tolist()
        if any(abs(a - b) > 1e-9 * max(1.0, abs(b)) for row in prints for a, b in zip(row, prints[0], strict=True)):
            raise RuntimeError(f"data-parallel replicas hold different adapters (fingerprints per rank: {prints})")
        return prints

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm=None
    ) -> None:
        if gradient_clip_val and strategy_traits(self.cfg.hardware.strategy).sharded:
            # Lightning's FSDP precision plugin refuses norm clipping; FSDP's own method computes the norm over
            # all shards (a per-shard norm would clip each rank differently).
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Plain names: under FSDP the module paths carry wrapper names, the (gathered) checkpoint does not.
        trainable = {clean_name(n) for n, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["exp"] = {
            "batches_seen": self.batches_seen,
            "skipped_steps": self.skipped_steps,
            "initial_val": self.initial_val,
            "tracking_ids": dict(self.tracking_ids),
            "rng": self._rng_per_rank(),
        }

    def _rng_per_rank(self) -> list[dict[str, Any]]:
        """Every rank's random states, in rank order. The ranks' states differ after the first step (each draws
        dropout masks for its own batch shapes), so each rank must get its own back. Lightning writes checkpoints on
        every rank at the same point, so the gather is collective-safe."""
        mine = capture_rng(self.device)
        if self._trainer is None or self.trainer.world_size == 1:
            return [mine]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.trainer.world_size
        dist.all_gather_object(gathered, {k: v.cpu() if torch.is_tensor(v) else v for k, v in mine.items()})
        return gathered

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["exp"]
        self.batches_seen = state["batches_seen"]
        self.skipped_steps = state["skipped_steps"]
        self.initial_val = state["initial_val"]
        per_rank = state["rng"]
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self._trainer is not None else (0, 1)
        if len(per_rank) != world:
            log.warning(
                "the checkpoint was written by %d process(es), this run has %d: dropout masks will differ from an "
                "uninterrupted run",
                len(per_rank),
                world,
            )
        self._rng_to_restore = per_rank[rank % len(per_rank)]
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if datamodule is not None:  # continue the data stream right after the last batch trained on
            datamodule.resume_at(self.batches_seen)
