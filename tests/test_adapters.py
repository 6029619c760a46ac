"""`exp.model.adapters.RowRouter`'s stacked product (several adapters in one layer): each row's (token's) output and
every gradient equal those of the per-adapter pass of each job alone (fp32, within 1e-6), with ranks, scalings,
targets and rank/alpha patterns that differ per adapter and each job's own dropout; a job whose rows turn NaN leaves
the others' gradients as they are."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from exp.model import adapters
from exp.model.adapters import RowRouter
from exp.study.group_member import SeededDropout

# Three adapters: different ranks and scalings, a rank and alpha pattern on fc2, and one adapter that leaves fc2 out
# (a layer where only some adapters are present).
CONFIGS = {
    "job0": LoraConfig(r=2, lora_alpha=4, target_modules=["fc1", "fc2"]),
    "job1": LoraConfig(
        r=4, lora_alpha=3, target_modules=["fc1", "fc2"], rank_pattern={"fc2": 3}, alpha_pattern={"fc2": 7}
    ),
    "job2": LoraConfig(r=5, lora_alpha=10, target_modules=["fc1"]),
}
DROPOUT = 0.25
COUNTS = [3, 2, 4]  # each adapter's rows (axis 0) or tokens (axis 1)
# (axis, rows): rows of tokens; tokens of one row laid end to end (padding-free); tokens of two rows (each job's
# tokens in both rows: not consecutive once the rows are flattened).
LAYOUTS = {"rows": (0, 1), "tokens": (1, 1), "tokens_of_two_rows": (1, 2)}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _model() -> tuple[nn.Module, RowRouter, dict[str, torch.Generator]]:
    torch.manual_seed(0)
    names = list(CONFIGS)
    for cfg in CONFIGS.values():
        cfg.init_lora_weights = False  # B random too: every gradient is non-zero
    model = get_peft_model(Tiny(), CONFIGS[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, CONFIGS[name])
    generators = {name: torch.Generator() for name in names}
    for module in model.modules():
        if isinstance(getattr(module, "lora_dropout", None), nn.ModuleDict):
            for name in module.lora_dropout:
                module.lora_dropout[name] = SeededDropout(DROPOUT, generators[name])
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model, RowRouter(model), generators


def _input(layout: str, bad: int | None = None) -> tuple[torch.Tensor, list[tuple[slice, ...]]]:
    torch.manual_seed(1)
    axis, rows = LAYOUTS[layout]
    shape = (sum(COUNTS), 5, 8) if axis == 0 else (rows, sum(COUNTS), 8)
    x = torch.randn(shape)
    spans, start = [], 0
    for count in COUNTS:
        spans.append((slice(None),) * axis + (slice(start, start + count),))
        start += count
    if bad is not None:
        x[spans[bad]] = float("nan")
    return x, spans


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _stacked(layout: str, bad: int | None = None, autocast: bool = False):
    """One forward of every job's rows, each through its own adapter, and the backward of the jobs' summed losses."""
    model, router, generators = _model()
    x, spans = _input(layout, bad)
    x.requires_grad_(True)
    for i, g in enumerate(generators.values()):
        g.manual_seed(10 + i)
    router.route(list(zip(CONFIGS, COUNTS, strict=True)), axis=LAYOUTS[layout][0])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    sum(out[s].float().square().mean() for s in spans).backward()
    return out.detach(), x.grad, _grads(model)


def _alone(layout: str, autocast: bool = False):
    """Each job's rows through its own adapter alone (the per-adapter pass), one job after another."""
    model, router, generators = _model()
    x, spans = _input(layout)
    x.requires_grad_(True)
    outs = []
    for i, (name, s) in enumerate(zip(CONFIGS, spans, strict=True)):
        generators[name].manual_seed(10 + i)
        router.route_all(name)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x[s])
        out.float().square().mean().backward()
        outs.append(out.detach())
    return torch.cat(outs, LAYOUTS[layout][0]), x.grad, _grads(model)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_stacked_product_equals_each_adapter_alone(layout, monkeypatch):
    calls = []
    apply = adapters._StackedLora.apply
    monkeypatch.setattr(adapters._StackedLora, "apply", lambda *a: calls.append(1) or apply(*a))
    out, grad_x, grads = _stacked(layout)
    assert len(calls) == 2  # fc1 (three adapters) and fc2 (two): both stacked
    ref_out, ref_grad_x, ref_grads = _alone(layout)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_x, ref_grad_x, rtol=1e-6, atol=1e-6)
    assert sorted(grads) == sorted(ref_grads) and len(grads) == 10
    for n in grads:
        assert grads[n].abs().sum() > 0, n
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_job_with_nan_rows_leaves_the_other_adapters_gradients_as_they_are(layout):
    clean_out, clean_grad_x, clean = _stacked(layout)
    out, grad_x, grads = _stacked(layout, bad=1)
    _, spans = _input(layout)
    assert out[spans[1]].isnan().all()
    for i in (0, 2):
        torch.testing.assert_close(out[spans[i]], clean_out[spans[i]], rtol=0, atol=0)
        torch.testing.assert_close(grad_x[spans[i]], clean_grad_x[spans[i]], rtol=1e-6, atol=1e-7)
    for n in grads:
        if ".job1." in n:
            assert grads[n].isnan().any(), n
        else:
            assert grads[n].isfinite().all(), n
            torch.testing.assert_close(grads[n], clean[n], rtol=1e-6, atol=1e-7, msg=n)


def test_under_autocast_the_stacked_product_runs_in_bf16_and_gives_the_weights_dtype():
    """bf16 autocast: the stacked product's output is bf16 as the per-adapter pass's, its gradients fp32 as the
    weights, both within bf16 rounding of the per-adapter pass."""
    out, grad_x, grads = _stacked("tokens", autocast=True)
    ref_out, ref_grad_x, ref_grads = _alone("tokens", autocast=True)
    assert out.dtype == ref_out.dtype
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad_x, ref_grad_x, rtol=2e-2, atol=2e-3)
    for n in grads:
        assert grads[n].dtype == torch.float32, n
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=2e-2, atol=2e-3, msg=n)
