"""Integrity of what exp keeps on disk: checkpoints carry a content hash checked on load (a flipped bit is damage,
and `trainer.resume_fallback` takes the newest intact checkpoint); cache entries (random-weight models, tokenised
data) are verified on use and rebuilt with a message naming the entry; half-built entries are removed."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SHORT, compose_typed

import exp.core.cache
from exp.core.config import ConfigError
from exp.run.checkpoints import CONTENT_HASH, AtomicCheckpointIO, candidates, first_intact, read_checkpoint


def flip_a_bit_in_a_lora_tensor(path: Path) -> str:
    """Flip one bit inside the stored bytes of a LoRA weight (the zip holds tensors uncompressed); its name."""
    ckpt = torch.load(path, weights_only=True)
    name, tensor = next((k, v) for k, v in ckpt["state_dict"].items() if "lora_A" in k)
    data = path.read_bytes()
    at = data.index(tensor.contiguous().view(torch.uint8).numpy().tobytes()[:64]) + 5
    path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])
    changed = torch.load(path, weights_only=True)  # loads without complaint: only the hash tells
    assert not torch.equal(changed["state_dict"][name], tensor)
    return name


@pytest.fixture
def run_copy(short_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(short_run.output_dir, run)
    return run


def test_every_checkpoint_carries_a_hash_that_its_content_matches(run_copy):
    for path in (run_copy / "checkpoints").glob("*.ckpt"):
        assert CONTENT_HASH in torch.load(path, weights_only=True)
        assert read_checkpoint(path)["global_step"] > 0


def test_a_flipped_bit_is_damage_and_the_fallback_takes_the_newest_intact_checkpoint(run_copy):
    paths = candidates(run_copy)  # last.ckpt (step 30), step-000030, step-000015
    assert [p.name for p in paths][:2] == ["last.ckpt", "step-000030.ckpt"]
    flip_a_bit_in_a_lora_tensor(paths[0])
    with pytest.raises(ValueError, match="does not match the hash written with it"):
        read_checkpoint(paths[0])
    with pytest.raises(ConfigError) as info:
        first_intact(paths, fallback=False)
    assert f"checkpoint {paths[0]} is damaged (its content does not match" in str(info.value)
    assert "trainer.resume_fallback=true" in str(info.value)
    flip_a_bit_in_a_lora_tensor(paths[1])
    chosen, state = first_intact(paths, fallback=True)
    assert chosen == paths[2] and state["global_step"] == 15


def test_a_checkpoint_without_a_hash_is_not_trusted(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "exp": {}, "global_step": 3}, path)
    with pytest.raises(ValueError, match="carries no content hash"):
        read_checkpoint(path)
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "exp": {}, "global_step": 3}, path)
    io.commit()
    assert read_checkpoint(path)["global_step"] == 3


def test_resuming_from_an_altered_checkpoint_is_refused_by_the_cli(run_copy, tmp_path):
    flip_a_bit_in_a_lora_tensor(run_copy / "checkpoints" / "last.ckpt")
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", *SHORT, f"trainer.resume={run_copy}", "hydra.run.dir=next"],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "last.ckpt is damaged (its content does not match the hash" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- cache entries ------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    """An empty exp cache, and a process that has verified nothing yet (as a new run would be)."""
    monkeypatch.setenv("EXP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(exp.core.cache, "_verified", set())
    return tmp_path / "cache"


def build_model_entry() -> Path:
    from exp.model.local import build_random_checkpoint

    m = compose_typed([]).model
    return build_random_checkpoint(m.family, dict(m.arch), m.seed)


DAMAGE = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "bit flipped": lambda p: p.write_bytes(p.read_bytes()[:-9] + bytes([p.read_bytes()[-9] ^ 4]) + p.read_bytes()[-8:]),
    "deleted": lambda p: p.unlink(),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_model_entry_is_named_and_rebuilt(fresh_cache, caplog, damage: str):
    from safetensors.torch import load_file

    entry = build_model_entry()
    weights = entry / "model.safetensors"
    before = {k: v.clone() for k, v in load_file(weights).items()}  # not backed by the file damaged below
    DAMAGE[damage](weights)
    exp.core.cache._verified.clear()  # the next run
    with caplog.at_level(logging.WARNING, logger="exp.core.cache"):
        assert build_model_entry() == entry
    assert f"{entry} is damaged (model.safetensors" in caplog.text and "rebuilding it" in caplog.text
    after = load_file(weights)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # nothing left aside


def test_an_entry_without_a_manifest_is_rebuilt(fresh_cache, caplog):
    entry = build_model_entry()
    (entry / exp.core.cache.MANIFEST).unlink()
    exp.core.cache._verified.clear()
    with caplog.at_level(logging.WARNING, logger="exp.core.cache"):
        build_model_entry()
    assert "no readable exp_entry.json" in caplog.text and (entry / exp.core.cache.MANIFEST).is_file()


def test_a_damaged_tokenisation_entry_is_named_and_rebuilt(fresh_cache, caplog):
    from exp.data.datamodule import InstructionDataModule
    from exp.model.build import build_tokenizer

    cfg = compose_typed(["data.num_examples=100"])
    tokenizer = build_tokenizer(cfg.model)
    first = InstructionDataModule(cfg.data, tokenizer, micro_batch_size=4)
    (entry,) = [p for p in (fresh_cache / "tokenized").iterdir()]
    rows = entry / "rows.arrow"
    rows.write_bytes(rows.read_bytes()[:-100])
    exp.core.cache._verified.clear()
    with caplog.at_level(logging.WARNING, logger="exp.core.cache"):
        second = InstructionDataModule(cfg.data, tokenizer, micro_batch_size=4)
    assert f"tokenisation of synthetic {entry} is damaged (rows.arrow has" in caplog.text
    assert [e.input_ids for e in second.train_set] == [e.input_ids for e in first.train_set]


def test_half_built_entries_of_dead_processes_are_removed(fresh_cache):
    """A build killed before its rename leaves `.<entry>.<host>.<pid>.partial`; the next build removes it, and
    leaves a live process's build alone."""
    entry = build_model_entry()
    shutil.rmtree(entry)
    exp.core.cache._verified.clear()
    prefix = exp.core.cache._partial_prefix(entry)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned = entry.with_name(f"{prefix}{dead.pid}.partial")
    live = entry.with_name(f"{prefix}{os.getppid()}.partial")
    for d in (abandoned, live):
        (d / "half").mkdir(parents=True)
    build_model_entry()
    assert not abandoned.exists() and live.exists() and (entry / "config.json").is_file()


def test_a_build_interrupted_by_an_exception_leaves_nothing(fresh_cache):
    def build(tmp: Path) -> None:
        (tmp / "part").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        exp.core.cache.ensure_entry(fresh_cache / "x" / "entry", build, "test entry")
    assert list((fresh_cache / "x").iterdir()) == []
