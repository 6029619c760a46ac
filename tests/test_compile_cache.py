"""Compiled decoder layers: one graph for micro-batches of many lengths, and the caches in exp's cache."""

from __future__ import annotations

import os

import pytest
from conftest import compose_typed

from exp.model.build import build_model, compile_decoder_layers
from exp.model.compile_cache import lengths_vary, use_compile_cache


def _graphs_for_lengths(monkeypatch, dynamic: bool, lengths: list[int]) -> int:
    """Dynamo's graph count after the tiny model's compiled layers met `lengths` (eager backend: Dynamo's tracing
    and guards are the subject, not Inductor's code, which would take minutes on the CPU)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    counters.clear()
    model = build_model(compose_typed(["hardware=cpu", "hardware.loss_impl=chunked"]), "cpu").eval()
    compile_decoder_layers(model, dynamic=dynamic)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
            model(input_ids=ids, position_ids=torch.arange(n)[None])
    graphs = int(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return graphs


def test_dynamic_layers_compile_once_for_every_length(monkeypatch):
    """The static default compiles again at the second length (then goes symbolic); dynamic=True compiles once."""
    lengths = [40, 56, 72, 24]
    dynamic = _graphs_for_lengths(monkeypatch, True, lengths)
    static = _graphs_for_lengths(monkeypatch, False, lengths)
    assert dynamic >= 1
    assert static == 2 * dynamic  # a static graph, then a symbolic one, for each distinct layer graph


@pytest.mark.parametrize(
    "overrides,vary",
    [
        ([], False),  # the generated task's rows: fixed-length benchmark tokens use the same format
        (["data=alpaca", "data.path=x.json"], True),
        (["data=alpaca", "data.path=x.json", "data.packing=true"], False),  # every packed row is max_seq_len long
    ],
)
def test_which_runs_compile_with_a_symbolic_length(overrides, vary):
    assert lengths_vary(compose_typed(overrides).data) is vary


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
