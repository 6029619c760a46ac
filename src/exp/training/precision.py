"""Lightning's mixed-precision plugin, made to clip the gradients of fused optimizers.

torch's fused AdamW (`fused=True`, one kernel over every adapter tensor) declares that it unscales fp16 gradients
itself (`_step_supports_amp_scaling`). Lightning's `MixedPrecision` then skips `GradScaler.unscale_` and refuses
gradient clipping outright ("does not allow for gradient clipping because it performs unscaling of gradients
internally"), for bf16 too, where no scaler exists and nothing needs unscaling.

`torch.amp.GradScaler` does support unscaling such an optimizer early: after `unscale_`, its `step` hands the fused
kernel the inf/NaN flag it found and no scale (`optimizer.grad_scale` stays None), so the kernel divides by nothing
and still skips a step with non-finite gradients. So this plugin always unscales before the
`on_before_optimizer_step` hooks and clipping (as Lightning does for every other optimizer), and then clips
normally: with fp16 the clip threshold is compared with the true gradient norm, with bf16 nothing changes but the
refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.optim import LBFGS


class FusedOptimizerMixedPrecision(MixedPrecision):
    """`MixedPrecision` ("bf16-mixed" / "16-mixed") that unscales and clips fused optimizers too."""

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:  # bf16: no scaling, Lightning's plain path (closure, hooks, clipping, step)
            return Precision.optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            return super().optimizer_step(optimizer, model, closure, **kwargs)  # raises Lightning's own error
        closure_result = closure()
        # Manual optimisation returns nothing from the closure: there is no gradient of ours to step on.
        if closure_result is None and model.automatic_optimization:
            return closure_result
        self.scaler.unscale_(optimizer)  # every optimizer, fused ones included: see the module docstring
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping, on true gradients
        step_output = self.scaler.step(optimizer, **kwargs)  # skipped when unscale_ found inf/NaN
        self.scaler.update()
        return step_output

    def clip_gradients(
        self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM
    ) -> None:
        # The gradients are unscaled by now (or were never scaled): clip as for any optimizer.
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


def build_precision_plugin(precision: str, accelerator: str) -> FusedOptimizerMixedPrecision | None:
    """The plugin for a resolved `hardware.precision` on `accelerator` ("cpu" / "gpu"); None for full precision."""
    if precision not in ("bf16-mixed", "16-mixed"):
        return None
    return FusedOptimizerMixedPrecision(precision, device="cpu" if accelerator == "cpu" else "cuda")
