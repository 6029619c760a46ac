"""torch.compile's work kept in exp's cache, and what compiling cost a run.

Compiling the decoder layers costs tens of seconds on a fresh machine. Inductor's FX-graph cache and AOTAutograd's
cache (both on by default in torch) and Triton's kernel cache make a second run of the same shape mostly cache
hits, but they default to a directory under /tmp that every sweep job on another node, and every cleaned /tmp,
starts empty. They go under `<exp cache>/compile/` instead (EXP_CACHE, shared like the tokenisation cache), unless
the user named their own directories.

Varying micro-batch lengths (padding-free rows) do not compile once per length: Dynamo's automatic dynamic shapes
compile a static graph at the first length and a graph with a symbolic length at the second, which serves every
later one; padding-free rows are rounded to `exp.data.padding_free.PAD_MULTIPLE` tokens besides. The first
micro-batch whose number of examples differs from the earlier ones' compiles once more (a guard on the size of
`cu_seq_lens_q`): at most three graphs per compiled frame and kind of layer (exp.model.build.LAYER_GRAPHS). On one
H100, a 200-step Gemma-7B-shape run on `alpaca_en_demo.json` compiled 4 graphs in 34.5 s, about what its first two
steps took beyond two median steps (35.0 s), and no later step was slow but the one that wrote a checkpoint
(benchmarks/results/padding_free_h100_20261206/); on `alpaca_zh_demo.json` the example count first changed at
step 16, whose third compile took 11.65 s (6 graphs; benchmarks/results/real200zh_h100_20261206/).
"""

from __future__ import annotations

import os
from pathlib import Path

from exp.core.cache import cache_dir

# The variables torch (Inductor, AOTAutograd) and Triton read for their on-disk caches.
CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def use_compile_cache() -> dict[str, str]:
    """Point the compile caches into exp's cache (each variable the user has not set); returns the directories.
    Call before the first compilation: Inductor and Triton read the variables when they need a path.

    Importing torch's Inductor (Lightning and liger-kernel do, long before a model is built) writes its default,
    `<tmp>/torchinductor_<user>`, into TORCHINDUCTOR_CACHE_DIR: that value counts as unset."""
    import sys

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    root = cache_dir() / "compile"
    chosen = {}
    for variable, name in CACHE_VARIABLES.items():
        current = os.environ.get(variable)
        if not current or (variable == "TORCHINDUCTOR_CACHE_DIR" and current == os.path.abspath(default_cache_dir())):
            path = root / name
            path.mkdir(parents=True, exist_ok=True)
            os.environ[variable] = str(path)
            if "torch._inductor.utils" in sys.modules:  # paths Inductor derived from the old directory
                sys.modules["torch._inductor.utils"].clear_caches()
        chosen[variable] = os.environ[variable]
    return chosen


def compile_summary() -> dict[str, float | int | str | None]:
    """What compiling cost this process so far: Dynamo's compiled graphs (`graphs`: one per distinct graph and
    shape it compiled; a recompilation for a new length counts again), the frames it compiled, and the seconds spent
    compiling (Dynamo's tracing with Inductor's forward code generation, and the backward graphs AOTAutograd
    compiles at their first use), with the cache directory used."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(compilation_time_metrics.get("_compile.compile_inner", []))
    seconds += sum(v for k, values in compilation_time_metrics.items() if k.endswith("bw_compiler") for v in values)
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "frames": int(counters["frames"]["ok"]),
        "seconds": round(seconds, 2),
        "cache_dir": str(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parent)
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        else None,
    }
