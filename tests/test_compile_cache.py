"""torch.compile's caches in exp's cache, unless the user chose a directory. (Layers that recompute their activations
compile whole: tests/test_gpu_twin.py::test_gpu_defaults_train_on_the_cpu counts the graph breaks of its compiled
run.)"""

from __future__ import annotations

import os

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
