"""What one decoder layer saves for backward, measured against exp's estimate, on the CPU twin of the GPU path.

    python benchmarks/saved_bytes_probe.py

Builds the tiny 4-bit Gemma with exp's own builder, runs one forward under `torch.autograd.graph.saved_tensors_hooks`
with 0 and then 1 recomputed layer. The difference is one layer's saved bytes (distinct storages). It compares
that with `exp.hardware.memory`'s `layer_saved_parts` for the same batch, for LoRA dropout 0 / 0.05 x compiled
layers off / on x fp32 / bf16 autocast. What only CUDA runs (bitsandbytes' CUDA kernels, Inductor's code for CUDA) is not seen here:
a gap on a GPU that this probe does not show lies there.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import compose_typed, encode  # noqa: E402  (the tests' own composition and encoding)

from exp.data.batching import collate  # noqa: E402
from exp.data.synthetic import generate_examples  # noqa: E402
from exp.hardware import memory  # noqa: E402
from exp.hardware.preflight import Environment, check  # noqa: E402
from exp.model.build import build_model, build_tokenizer  # noqa: E402


def saved_bytes(overrides: list[str], recomputed: int) -> tuple[int, object, tuple[int, int]]:
    cfg = compose_typed(
        ["hardware.gradient_checkpointing=true", f"hardware.checkpoint_layers={recomputed}", "logger=none", *overrides]
    )
    cfg = check(cfg, Environment()).cfg
    model = build_model(cfg, "cpu")
    model.train()
    tok = build_tokenizer(cfg.model)
    batch = collate([encode(tok, r, cfg.data.max_seq_len)[0] for r in generate_examples(4, seed=123)], tok.pad_token_id)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    bf16 = cfg.hardware.precision.startswith("bf16")
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16),
    ):
        loss = model(**batch).loss
    loss.backward()
    return sum(storages.values()), cfg, tuple(batch["input_ids"].shape)


def main() -> None:
    print("dropout  compile  precision   tokens   measured B/layer  estimated B/layer  measured/estimated")
    for dropout, compiled, precision in itertools.product(("0", "0.05"), ("false", "true"), ("32-true", "bf16-mixed")):
        overrides = [f"lora.dropout={dropout}", f"hardware.compile={compiled}", f"hardware.precision={precision}"]
        without, cfg, shape = saved_bytes(overrides, 0)
        with_one, _, _ = saved_bytes(overrides, 1)
        measured = without - with_one
        kwargs = memory._config_kwargs(cfg) | {"micro_batch_size": shape[0], "seq_len": shape[1]}
        parts = memory.estimate_memory(memory.config_arch(cfg), **kwargs).details["layer_saved_parts"]["global"]
        estimated = sum(parts.values())
        print(
            f"{dropout:<8} {compiled:<8} {precision:<11} {shape[0]}x{shape[1]:<5} {measured:>16} {estimated:>18} "
            f"{measured / estimated:>19.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
