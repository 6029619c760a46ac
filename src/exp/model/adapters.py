"""Several LoRA adapters over one frozen base, trained together: each row of a batch goes through the base once and
through its own adapter only.

PEFT keeps any number of named adapters in one model (`add_adapter`). `RowRouter` turns PEFT's own adapter pass off
in every LoRA layer and adds each adapter's low-rank product after the base layer itself, over its rows only: the
rows of one job are contiguous, so each adapter reads and writes a slice of the batch (no gathered copies, no index
lists sent to the device per layer, as PEFT's inference-only mixed-adapter batches do). A loss summed over the jobs'
rows then gives each adapter the gradient of its own rows alone. The router stays installed for as long as the
routing is needed (backward's recomputation of checkpointed layers included).

Where a layer serves several adapters, their products are two matrix products over the whole batch rather than two per
adapter (`_StackedLora`): every present adapter's `A` (its scaling folded in) stacked into one `[sum of ranks, in]`
matrix, the result kept by a mask to each row's (or token's) own adapter's columns, then every `B` side by side. Why: a
group's step is bound by the host launching small kernels, not by the device. On an H200, 16 jobs of the Gemma-2B shape
(18 layers, LoRA on q_proj and v_proj, padding-free) took 2.27 s a step with about 1.23 s of it device time, and a step
launched about 7.5k matrix products, 16k copies (each adapter's fp32 weights cast to bf16 at each use), 5.7k products
and 4.9k additions by elements, most of them the adapters' own: per layer and adapter, two products forward, four
backward, the casts, the dropout, the scaling and the indexed addition. Stacked, a layer costs the same handful of
kernels forward and a few per adapter backward, whatever the number of adapters. What it adds, the other adapters'
masked columns, is arithmetic and memory of the order of tokens x sum of ranks per targeted layer: for those 16
adapters of rank 8, under 1% of a layer's base products and about 10 MB of saved activations per targeted layer and
40960-token micro-batch.

The backward is written out so that a job whose rows turn NaN/Inf fails alone: the input's gradient goes row by row,
and each adapter's weight gradients are reduced over its own rows only (a stacked reduction would add `0 * NaN` from a
diverged job's rows into every adapter's gradient). Each adapter's dropout runs over its own part, as in a run alone.
The stacking does not shield the other jobs from an adapter whose weights themselves are NaN/Inf (`0 * Inf` in the
stacked product): a diverging job's own products overflow (its loss turns NaN and it leaves the group) well before its
weights can, an AdamW update being bounded by the learning rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from exp.core.config import LoraConfig


def add_adapters(model: nn.Module, adapters: dict[str, LoraConfig], build_config) -> None:
    """Add the named adapters to a PEFT model, each drawn from its own `init_seed` on the CPU exactly as the first
    adapter (exp.model.build.build_model), so that an adapter is the one a run of its config alone starts from."""
    for name, lora in adapters.items():
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(lora.init_seed)
            model.add_adapter(name, build_config(lora))
    # PEFT marks only the active adapter trainable; every adapter trains here.
    for name in adapter_names(model):
        for p in adapter_parameters(model, name):
            p.requires_grad_(True)


def adapter_names(model: nn.Module) -> list[str]:
    return list(model.peft_config)


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The trainable tensors of adapter `name` (its A and B of every targeted layer), in the model's order."""
    marker = f".{name}."
    return [p for n, p in model.named_parameters() if marker in f"{n}." and ("lora_" in n)]


@dataclass(frozen=True)
class _Part:
    """One present adapter's share of a stacked product: its rows (or tokens) in the inputs flattened to
    [rows x tokens, features] (a slice where they are consecutive there, else their indices), its columns among the
    stacked ranks, its scaling."""

    rows: slice | torch.Tensor
    cols: slice
    scale: float


@dataclass(frozen=True)
class _Stack:
    """The routing of one layer's stacked product: `mask` [1 or rows, 1 or tokens, sum of ranks] keeps each row's
    (token's) own adapter's columns; `scale` [sum of ranks] (fp32) is each column's adapter's scaling."""

    parts: tuple[_Part, ...]
    mask: torch.Tensor
    scale: torch.Tensor


class _StackedLora(torch.autograd.Function):
    """`x @ (s A)^T`, masked to each row's own adapter's columns, `@ B^T`, with the A and B of every present adapter
    stacked: two products over the whole batch in place of two per adapter.

    The backward keeps each job's NaN to itself. The input's gradient is row-wise (a row's masked product with
    the stacked A). Each adapter's weight gradients are reduced over its own rows only: a stacked weight gradient
    would sum `0 * NaN` from another job's diverged rows into every adapter's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stack: _Stack, *weights: torch.Tensor) -> torch.Tensor:
        n = len(stack.parts)
        # The scalings folded into A before its one cast to the compute dtype (scaling a bf16 product by a bf16
        # scaling would round the scaling too).
        a = (torch.cat(weights[:n]) * stack.scale[:, None]).to(x.dtype)  # [sum of ranks, in]
        b = torch.cat(weights[n:], dim=1).to(x.dtype)  # [out, sum of ranks]
        hidden = x @ a.T
        ctx.save_for_backward(x, hidden, a, b)
        ctx.stack, ctx.dtypes = stack, [w.dtype for w in weights]
        # `where`, not a product with a 0/1 mask: a diverged adapter's Inf columns stay out of the other rows.
        return torch.where(stack.mask, hidden, 0) @ b.T

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, hidden, a, b = ctx.saved_tensors
        stack, n = ctx.stack, len(ctx.stack.parts)
        grad = grad.to(a.dtype)
        d_hidden = grad @ b  # [..., sum of ranks]: row-wise
        grad_x = torch.where(stack.mask, d_hidden, 0) @ a if ctx.needs_input_grad[0] else None
        grad2, x2, d_hidden2, hidden2 = (t.reshape(-1, t.shape[-1]) for t in (grad, x, d_hidden, hidden))
        grads: list[torch.Tensor | None] = [None] * (2 * n)
        for i, part in enumerate(stack.parts):
            if ctx.needs_input_grad[2 + i]:
                grad_a = d_hidden2[part.rows, part.cols].T @ x2[part.rows]
                grads[i] = grad_a.to(ctx.dtypes[i]).mul_(part.scale)
            if ctx.needs_input_grad[2 + n + i]:
                grads[n + i] = (grad2[part.rows].T @ hidden2[part.rows, part.cols]).to(ctx.dtypes[n + i])
        return grad_x, None, *grads


class RowRouter:
    """Route the next forward passes' rows (or tokens) to adapters: `router.route([("a", 4), ("b", 4)])` (each
    adapter with its count of consecutive rows), `router.route([("a", 900), ("b", 700)], axis=1)` (consecutive
    tokens of one row of examples laid end to end), or `router.route_all("a")`; set before each forward and kept
    until its backward is done. Installed on every LoRA layer of `model` until `remove()`."""

    def __init__(self, model: nn.Module) -> None:
        from peft.tuners.lora import LoraLayer  # the model is a PEFT model already: PEFT is loaded

        self.spans: list[tuple[str, tuple[slice, ...]]] = []
        self.axis = 0
        # The stacked products' routings for the current spans, per (present adapters with their ranks and
        # scalings, which a rank or alpha pattern sets per layer; input shape; device).
        self._stacks: dict[tuple, _Stack] = {}
        self._layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        trainable = [p for p in model.parameters() if p.requires_grad]
        for layer in self._layers:
            layer.enable_adapters(False)  # PEFT's pass off (it also clears requires_grad, restored below)
        for p in trainable:
            p.requires_grad_(True)
        self._handles = [layer.register_forward_hook(self._add_adapters) for layer in self._layers]

    def route(self, parts: list[tuple[str, int]], axis: int = 0) -> None:
        """`parts`: (adapter, count) in order along `axis` of the layers' inputs (0: rows, 1: tokens)."""
        spans, start = [], 0
        for name, count in parts:
            spans.append((name, (slice(None),) * axis + (slice(start, start + count),)))
            start += count
        self.spans, self.axis, self._stacks = spans, axis, {}

    def route_all(self, name: str) -> None:
        self.spans, self.axis, self._stacks = [(name, (slice(None),))], 0, {}

    def _add_adapters(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        # Under autocast the adapter's products run in the autocast dtype whatever their input's: casting the input
        # to the adapter's fp32 first (as PEFT does) would only add a copy of every targeted layer's input.
        autocast = torch.is_autocast_enabled(x.device.type)
        present = [(name, index) for name, index in self.spans if name in module.lora_A]  # not every layer each
        # In place, as PEFT adds its own pass: the base layer's backward keeps its input, not its output.
        if len(present) > 1 and all(_plain_linear(module, name) for name, _ in present):
            output += self._stacked_delta(module, x, present, autocast).to(output.dtype)
            return output
        for name, index in present:
            lora_a, lora_b = module.lora_A[name], module.lora_B[name]
            part = x[index] if autocast else x[index].to(lora_a.weight.dtype)
            delta = lora_b(lora_a(module.lora_dropout[name](part))) * module.scaling[name]
            output[index] += delta.to(output.dtype)
        return output

    def _stacked_delta(
        self, module: nn.Module, x: torch.Tensor, present: list[tuple[str, tuple[slice, ...]]], autocast: bool
    ) -> torch.Tensor:
        names = [name for name, _ in present]
        weight_dtype = module.lora_A[names[0]].weight.dtype
        x = x if autocast else x.to(weight_dtype)
        # Each adapter's dropout over its own part, from its own generator (a job's masks are those of its run
        # alone), the parts laid back in the input's order; the rows of adapters absent here pass as they are
        # (their columns are masked out).
        dropouts = {name: module.lora_dropout[name] for name in names}
        if any(_drops(d) for d in dropouts.values()):
            pieces = [dropouts[name](x[index]) if name in dropouts else x[index] for name, index in self.spans]
            end = self.spans[-1][1][-1].stop
            if end < x.shape[self.axis]:
                pieces.append(x[(slice(None),) * self.axis + (slice(end, None),)])
            x = torch.cat(pieces, self.axis)
        x = x.to(torch.get_autocast_dtype(x.device.type) if autocast else weight_dtype)
        stack = self._stack(module, present, x)
        weights = [module.lora_A[name].weight for name in names] + [module.lora_B[name].weight for name in names]
        return _StackedLora.apply(x, stack, *weights)

    def _stack(self, module: nn.Module, present: list[tuple[str, tuple[slice, ...]]], x: torch.Tensor) -> _Stack:
        columns = tuple((name, module.lora_A[name].weight.shape[0], module.scaling[name]) for name, _ in present)
        key = (columns, tuple(x.shape), x.device)
        if (stack := self._stacks.get(key)) is not None:
            return stack
        ranks = sum(rank for _, rank, _ in columns)
        shape = [1] * x.dim()
        shape[self.axis], shape[-1] = x.shape[self.axis], ranks
        # Filled on the device: a copy from host memory would wait for the device's queue once per micro-batch.
        mask = torch.zeros(shape, dtype=torch.bool, device=x.device)
        scale = torch.empty(ranks, dtype=torch.float32, device=x.device)
        parts, column = [], 0
        # Consecutive rows of the flattened input where every dimension before the routed one is 1, else indices.
        inner = math.prod(x.shape[self.axis + 1 : -1])
        consecutive = math.prod(x.shape[: self.axis]) == 1
        positions = None if consecutive else torch.arange(math.prod(x.shape[:-1]), device=x.device)
        for (_, rank, scaling), (_, index) in zip(columns, present, strict=True):
            cols = slice(column, column + rank)
            mask[index + (slice(None),) * (x.dim() - 1 - len(index)) + (cols,)] = True
            scale[cols] = scaling
            span = index[-1]
            if consecutive:
                rows = slice(span.start * inner, span.stop * inner)
            else:
                rows = positions.view(x.shape[:-1])[index].flatten()
            parts.append(_Part(rows, cols, float(scaling)))
            column += rank
        stack = _Stack(tuple(parts), mask, scale)
        self._stacks[key] = stack
        return stack

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _plain_linear(module: nn.Module, name: str) -> bool:
    """Adapter `name` of `module` is a plain `A` then `B` (no bias, no DoRA): what the stacked product computes."""
    a, b = module.lora_A[name], module.lora_B[name]
    plain = type(a) is nn.Linear and type(b) is nn.Linear and a.bias is None and b.bias is None
    return plain and not getattr(module, "use_dora", {}).get(name, False)


def _drops(dropout: nn.Module) -> bool:
    """The dropout module changes its input (an `nn.Dropout` or a job's own seeded one, training, p > 0)."""
    return not isinstance(dropout, nn.Identity) and dropout.training and getattr(dropout, "p", 1) > 0


def save_adapter(model: nn.Module, name: str, out_dir: Path) -> None:
    """Adapter `name` in PEFT's own format (adapter_config.json + adapter_model.safetensors, the keys of a model
    holding that adapter alone), loadable with `PeftModel.from_pretrained` like a single run's adapter."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(model, adapter_name=name)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(out_dir / "adapter_model.safetensors"))
    model.peft_config[name].save_pretrained(str(out_dir))
