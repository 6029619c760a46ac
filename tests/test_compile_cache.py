"""torch.compile of the decoder layers: its caches in exp's cache (unless the user chose a directory), and layers
that recompute their activations compiled whole."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from exp.model.compile_cache import use_compile_cache


def test_compile_caches_go_to_exps_cache_unless_the_user_chose(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("EXP_CACHE", str(tmp_path / "cache"))
    # What importing Inductor leaves in the environment counts as unset.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    chosen = use_compile_cache()
    assert chosen == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "compile" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "cache" / "compile" / "triton"),
    }
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == chosen["TORCHINDUCTOR_CACHE_DIR"]
    own = str(tmp_path / "mine")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", own)
    assert use_compile_cache()["TORCHINDUCTOR_CACHE_DIR"] == own


RECOMPUTED_COMPILED_STEP = """
import sys

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, "tests")
from conftest import compose_typed
from exp.model.build import build_model, compile_decoder_layers

cfg = compose_typed(["hardware.gradient_checkpointing=true", "hardware.precision=32-true"])
model = build_model(cfg)
compile_decoder_layers(model)
ids = torch.randint(3, 200, (2, 24))
model(input_ids=ids, labels=ids).loss.backward()
breaks = sum(counters["graph_break"].values())
graphs = counters["stats"]["unique_graphs"]
print(f"graph breaks {breaks}, graphs {graphs}")
sys.exit(0 if breaks == 0 and graphs >= 1 else 1)
"""


@pytest.mark.slow
def test_recomputed_layers_compile_whole(tmp_path):
    """A decoder layer that recomputes its activations (gradient checkpointing inside the compiled call, as recent
    transformers place it) compiles as one graph with no break: the 4-bit tiny model on the CPU, one step."""
    env = {**os.environ, "EXP_CACHE": str(tmp_path / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = subprocess.run(
        [sys.executable, "-c", RECOMPUTED_COMPILED_STEP], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "graph breaks 0" in proc.stdout
