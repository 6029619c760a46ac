"""The preflight: every finding triggered by a simulated environment, plus the real CLI on this CPU machine."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
from conftest import compose_typed

from exp.hardware.preflight import PREFLIGHT_EXIT, Environment, Gpu, check, probe_environment

H200 = Gpu("NVIDIA H200", 143 * 2**30, 140 * 2**30, (9, 0))
T4 = Gpu("Tesla T4", 15 * 2**30, 14 * 2**30, (7, 5))
GPU_ENV = dict(torch_cuda="13.0", driver_version="580.159", driver_cuda="13.0")


def keys(result) -> list[str]:
    return [f.key for f in result.findings]


def test_gpu_requested_on_a_machine_without_gpu():
    result = check(compose_typed(["hardware=gpu"]), Environment(torch_cuda="13.0", cuda_visible_devices=""))
    assert keys(result) == ["hardware.accelerator"]
    msg = str(result.findings[0])
    assert "sees no GPU" in msg and "hardware=cpu" in msg and "CUDA_VISIBLE_DEVICES=''" in msg


def test_gpu_requested_with_a_cpu_build_of_torch():
    result = check(compose_typed(["hardware=ddp"]), Environment(torch_cuda=None))
    assert keys(result) == ["hardware.accelerator"] and "CPU-only build" in result.findings[0].message


def test_more_devices_than_visible_is_caught_before_cuda():
    cfg = compose_typed(["hardware=ddp", "hardware.devices=4", "trainer.global_batch_size=16"])
    result = check(cfg, Environment(gpus=[H200], cuda_visible_devices="1", **GPU_ENV), memory_check=False)
    assert keys(result) == ["hardware.devices"]
    msg = result.findings[0].message
    assert "hardware.devices=4" in msg and "1 GPU(s)" in msg and "hardware.devices=1" in msg
    assert "INTERNAL ASSERT" in msg and "cuda:0" in msg  # explains the renumbering


def test_fsdp_on_one_gpu_runs_as_one_process_on_it():
    # hardware=fsdp asks for every visible GPU: on a machine with one, nothing is sharded.
    for memory_check in (False, True):
        cfg = compose_typed(["hardware=fsdp", "model=gemma_2b"])
        result = check(cfg, Environment(gpus=[H200], **GPU_ENV), memory_check=memory_check)
        hw = result.cfg.hardware
        assert result.ok and (hw.strategy.value, hw.devices) == ("single_device", 1)
        assert any("hardware.strategy=fsdp with 1 GPU" in n for n in result.notes)
    two = check(compose_typed(["hardware=fsdp", "model=gemma_2b", "trainer.global_batch_size=16"]),
                Environment(gpus=[H200, H200], **GPU_ENV))  # fmt: skip
    assert two.ok and (two.cfg.hardware.strategy.value, two.cfg.hardware.devices) == ("fsdp", 2)


def test_cuda_visible_devices_changed_after_cuda_init():
    env = Environment(
        gpus=[H200],
        cuda_visible_devices="1",
        cuda_initialized=True,
        cvd_at_init="0,1",
        cached_device_count=2,
        **GPU_ENV,
    )
    result = check(compose_typed(["hardware=gpu"]), env, memory_check=False)
    assert "CUDA_VISIBLE_DEVICES" in keys(result)
    msg = result.findings[0].message
    assert "'0,1'" in msg and "'1'" in msg and "restart" in msg


def test_unchanged_cuda_visible_devices_after_init_is_fine():
    env = Environment(
        gpus=[H200], cuda_visible_devices="0", cuda_initialized=True, cvd_at_init="0", cached_device_count=1, **GPU_ENV
    )
    assert check(compose_typed(["hardware=gpu"]), env, memory_check=False).ok


def test_mig_needs_exactly_one_mig_instance():
    env = Environment(gpus=[H200], mig_enabled=[True], cuda_visible_devices="0", **GPU_ENV)
    result = check(compose_typed(["hardware=gpu"]), env, memory_check=False)
    assert keys(result) == ["CUDA_VISIBLE_DEVICES"] and "MIG-<uuid>" in result.findings[0].message
    env.cuda_visible_devices = "MIG-4f1c2a7e-0000-0000-0000-000000000000"
    assert check(compose_typed(["hardware=gpu"]), env, memory_check=False).ok


def test_driver_older_than_the_cuda_runtime():
    env = Environment(gpus=[H200], torch_cuda="13.0", driver_version="535.104", driver_cuda="12.2")
    result = check(compose_typed(["hardware=gpu"]), env, memory_check=False)
    assert keys(result) == ["driver"] and "update the driver" in result.findings[0].message


def test_cuda_init_failure_from_the_probe_is_reported():
    env = Environment(torch_cuda="13.0", probe_error="RuntimeError: The NVIDIA driver on your system is too old")
    result = check(compose_typed(["hardware=gpu"]), env)
    assert keys(result) == ["hardware.accelerator"] and "update the NVIDIA driver" in result.findings[0].message


def test_forked_dataloader_workers_after_cuda_init():
    env = Environment(gpus=[H200], cuda_initialized=True, cached_device_count=1, start_method="fork", **GPU_ENV)
    result = check(compose_typed(["hardware=gpu", "hardware.num_workers=2"]), env, memory_check=False)
    assert keys(result) == ["hardware.num_workers"] and "hardware.num_workers=0" in result.findings[0].message


def test_missing_bitsandbytes_native_library():
    env = Environment(gpus=[H200], bnb_error="RuntimeError: libbitsandbytes_cuda130.so not found", **GPU_ENV)
    result = check(compose_typed(["hardware=gpu"]), env, memory_check=False)
    assert keys(result) == ["quantization"] and "libbitsandbytes_cuda130" in result.findings[0].message
    assert check(compose_typed(["hardware=gpu", "quantization=none"]), env, memory_check=False).ok


def test_several_findings_are_reported_together():
    env = Environment(gpus=[H200], mig_enabled=[True], torch_cuda="13.0", driver_cuda="12.2", driver_version="535")
    result = check(compose_typed(["hardware=gpu"]), env, memory_check=False)
    assert set(keys(result)) == {"driver", "CUDA_VISIBLE_DEVICES"}


def test_memory_estimate_above_free_memory_suggests_a_micro_batch():
    small = Gpu("NVIDIA L4", 24 * 2**30, 22 * 2**30, (8, 9))
    cfg = compose_typed(
        [
            "model=gemma_7b",
            "hardware=gpu",
            "hardware.micro_batch_size=16",
            "trainer.global_batch_size=16",
            "data.max_seq_len=2048",
            "lora=all_linear",
            "hardware.auto_micro_batch=false",
        ]
    )
    result = check(cfg, Environment(gpus=[small], **GPU_ENV))
    assert keys(result) == ["memory"]
    msg = result.findings[0].message
    assert "GiB per GPU" in msg and "hardware.micro_batch_size=" in msg and "logits" in msg.lower()


def _gemma_7b_on(micro_batch: int, *extra: str):
    return compose_typed(
        [
            "model=gemma_7b",
            "hardware=gpu",
            f"hardware.micro_batch_size={micro_batch}",
            f"trainer.global_batch_size={micro_batch}",
            "data.max_seq_len=2048",
            "lora=all_linear",
            "hardware.auto_micro_batch=false",  # these tests are about the layer choice at a given micro-batch
            *extra,
        ]
    )


@pytest.mark.parametrize("micro_batch", [4, 8, 32])
def test_auto_checkpoint_layers_recomputes_the_fewest_layers_that_fit(micro_batch):
    from exp.hardware.memory import estimate_for_config
    from exp.hardware.preflight import AUTO_CHECKPOINT_HEADROOM

    result = check(_gemma_7b_on(micro_batch), Environment(gpus=[H200], **GPU_ENV))
    assert result.ok, result.findings
    hw = result.cfg.hardware
    k = 0 if not hw.gradient_checkpointing else hw.checkpoint_layers or 28
    budget = H200.free_bytes * (1 - AUTO_CHECKPOINT_HEADROOM)

    def total(layers: int) -> int:
        trial = copy.deepcopy(result.cfg)
        trial.hardware.gradient_checkpointing, trial.hardware.checkpoint_layers = layers > 0, layers
        return estimate_for_config(trial).total

    assert total(k) <= budget and (k == 0 or total(k - 1) > budget)  # fits, and one layer fewer would not
    assert any(f"{'none' if k == 0 else f'the first {k}'} of 28 decoder layers recompute" in n for n in result.notes)
    if micro_batch == 4:
        assert k == 0  # 8k tokens of Gemma-7B train without recomputation in 140 GiB


def test_auto_checkpoint_layers_keeps_explicit_choices_and_the_cpu_alone():
    env = Environment(gpus=[H200], **GPU_ENV)
    explicit = check(_gemma_7b_on(8, "hardware.checkpoint_layers=28"), env).cfg.hardware
    assert (explicit.gradient_checkpointing, explicit.checkpoint_layers) == (True, 28)
    off = check(_gemma_7b_on(4, "hardware.gradient_checkpointing=false"), env).cfg.hardware
    assert (off.gradient_checkpointing, off.checkpoint_layers) == (False, None)
    cpu = check(
        compose_typed(["hardware=cpu", "hardware.gradient_checkpointing=true", "hardware.auto_checkpoint_layers=true"]),
        Environment(torch_cuda=None),
    )
    assert cpu.ok and (cpu.cfg.hardware.gradient_checkpointing, cpu.cfg.hardware.checkpoint_layers) == (True, None)


def test_auto_checkpoint_layers_is_not_decided_per_rank_under_torchrun(monkeypatch):
    monkeypatch.setenv("EXP_LAUNCH_ID", "torchrun-0faad671")
    result = check(_gemma_7b_on(4), Environment(gpus=[H200], **GPU_ENV))
    hw = result.cfg.hardware
    assert result.ok and (hw.gradient_checkpointing, hw.checkpoint_layers) == (True, None)
    assert any("not applied in a torchrun / SLURM rank" in n for n in result.notes)


def test_nothing_fits_leaves_full_checkpointing_and_explains():
    small = Gpu("NVIDIA L4", 24 * 2**30, 22 * 2**30, (8, 9))
    result = check(_gemma_7b_on(64, "hardware.loss_impl=hf"), Environment(gpus=[small], **GPU_ENV))
    assert keys(result) == ["memory"] and result.cfg.hardware.checkpoint_layers is None
    assert result.cfg.hardware.gradient_checkpointing


def test_fast_loss_is_what_the_estimate_counts_on_a_gpu():
    # 64 x 2048 tokens of Gemma-7B: transformers' loss needs ~12 bytes per token and vocabulary entry (~400 GiB),
    # the chunked / fused loss a few hundred tokens' worth. The preflight estimates the loss that will run.
    env = Environment(gpus=[H200], **GPU_ENV)
    assert check(_gemma_7b_on(64), env).ok
    assert keys(check(_gemma_7b_on(64, "hardware.loss_impl=hf"), env)) == ["memory"]


def test_auto_without_gpu_picks_the_cpu():
    result = check(compose_typed(["hardware=auto"]), Environment(torch_cuda=None))
    hw = result.cfg.hardware
    assert result.ok and (hw.accelerator.value, hw.strategy.value, hw.devices, hw.precision) == (
        "cpu",
        "single_device",
        1,
        "32-true",
    )


def test_auto_without_gpu_runs_what_hardware_cpu_runs_and_says_so():
    """hardware=auto inherits hardware=gpu's defaults (checkpointing, padding-free, micro-batch 4, ...); on a CPU
    those give way to hardware=cpu's, except for what the command line set."""
    cpu = check(compose_typed(["hardware=cpu"]), Environment(torch_cuda=None)).cfg.hardware
    auto = check(compose_typed(["hardware=auto"]), Environment(torch_cuda=None))
    assert auto.cfg.hardware == cpu
    assert any(n.startswith("hardware=auto: no GPU visible -> hardware=cpu (") for n in auto.notes), auto.notes
    assert "padding_free: true -> false" in " ".join(auto.notes)
    kept = check(compose_typed(["hardware=auto", "hardware.micro_batch_size=2"]), Environment(torch_cuda=None))
    assert kept.cfg.hardware.micro_batch_size == 2 and kept.cfg.hardware.padding_free is False


def test_auto_with_gpus_picks_ddp_when_a_replica_fits():
    result = check(
        compose_typed(["hardware=auto", "model=gemma_2b", "trainer.global_batch_size=16"]),
        Environment(gpus=[H200, H200], **GPU_ENV),
    )
    hw = result.cfg.hardware
    assert result.ok and (hw.accelerator.value, hw.strategy.value, hw.devices, hw.precision) == (
        "gpu",
        "ddp",
        2,
        "bf16-mixed",
    )
    assert any("strategy=ddp" in n for n in result.notes)
    one = check(compose_typed(["hardware=auto", "model=gemma_2b"]), Environment(gpus=[H200], **GPU_ENV))
    assert one.cfg.hardware.strategy.value == "single_device" and one.cfg.hardware.devices == 1


def test_no_bf16_before_ampere():
    result = check(compose_typed(["hardware=gpu", "model=gemma_2b"]), Environment(gpus=[T4], **GPU_ENV))
    assert result.ok and result.cfg.hardware.precision == "16-mixed"
    assert any("no bf16" in n and "16-mixed" in n for n in result.notes)
    refused = check(compose_typed(["hardware=gpu", "model=gemma2_2b"]), Environment(gpus=[T4], **GPU_ENV))
    assert keys(refused) == ["hardware.precision"] and "overflows in fp16" in refused.findings[0].message


def test_devices_all_visible_is_resolved_and_checks_the_global_batch():
    cfg = compose_typed(["hardware=ddp", "trainer.global_batch_size=12"])  # micro 4 x 2 GPUs = 8 per step
    result = check(cfg, Environment(gpus=[H200, H200], **GPU_ENV), memory_check=False)
    assert result.cfg.hardware.devices == 2
    assert keys(result) == ["trainer.global_batch_size"]


def test_probe_on_this_machine_does_not_initialise_cuda():
    import torch

    env = probe_environment(need_gpus=True)
    assert not torch.cuda.is_initialized()
    if torch.version.cuda is None:
        assert env.gpus == [] and env.torch_cuda is None


def test_a_probe_started_ahead_is_read_only_for_the_devices_it_was_started_for(monkeypatch):
    """exp.train starts the CUDA probe before importing torch and Lightning; the preflight reads that probe's output
    (the same report as one run then), unless CUDA_VISIBLE_DEVICES changed in between: then it probes again."""
    import shutil

    from exp.hardware import preflight

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    preflight.start_probe("cpu", "nf4")
    assert preflight._started_probes == {}  # a CPU run probes nothing
    preflight.start_probe("gpu", "nf4")
    (started,) = preflight._started_probes.values()
    out, _ = preflight._probe_output(check_bitsandbytes=True)
    assert started.returncode is not None and preflight._started_probes == {}  # consumed, not run again
    assert json.loads(out.split("EXP_PROBE ", 1)[1])["torch_cuda"] == __import__("torch").version.cuda
    preflight.start_probe("gpu", "nf4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the devices changed after the probe started
    out, _ = preflight._probe_output(check_bitsandbytes=True)
    assert "EXP_PROBE " in out and len(preflight._started_probes) == 1  # a fresh probe; the stale one unread
    preflight.discard_started_probes()
    assert preflight._started_probes == {}


@pytest.mark.slow
def test_cli_refuses_a_gpu_run_on_a_cpu_machine(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", "hardware=gpu", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == PREFLIGHT_EXIT, proc.stderr[-2000:]
    assert "preflight found 1 problem" in proc.stderr and "hardware=cpu" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before it trained: no run directory is left behind


def test_doctor_reports_and_exits_by_verdict():
    ok = subprocess.run([sys.executable, "-m", "exp.doctor"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "== environment ==" in ok.stdout and "torch" in ok.stdout and "GPUs visible" in ok.stdout
    assert "memory estimate" in ok.stdout and "OK:" in ok.stdout
    import torch

    if not torch.cuda.is_available():
        bad = subprocess.run(
            [sys.executable, "-m", "exp.doctor", "hardware=ddp", "hardware.devices=4", "trainer.global_batch_size=16"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert bad.returncode == PREFLIGHT_EXIT and "PROBLEM" in bad.stdout


def test_auto_resolving_to_the_cpu_still_refuses_what_the_cpu_cannot_run():
    result = check(compose_typed(["hardware=auto", "quantization=int8"]), Environment(torch_cuda=None))
    assert keys(result) == ["hardware=auto"]
    assert "quantization=int8 needs a GPU" in result.findings[0].message


def test_auto_resolving_to_the_cpu_accepts_a_valid_config():
    result = check(compose_typed(["hardware=auto"]), Environment(torch_cuda=None))
    assert result.ok and result.cfg.hardware.accelerator.value == "cpu"


def test_a_warmup_longer_than_the_run_is_a_note_not_an_error():
    """A whole number of warmup steps longer than the run runs as asked; the preflight says that the learning rate
    never reaches its peak."""
    result = check(compose_typed(["trainer.max_steps=20", "trainer.warmup_steps=100"]), Environment())
    assert result.ok
    assert any("trainer.warmup_steps=100 >= trainer.max_steps=20" in n for n in result.notes)


@pytest.mark.parametrize(("max_steps", "warmup"), [(3000, 90), (50, 2), (1, 0)])
def test_the_default_warmup_is_a_fraction_of_the_run(max_steps: int, warmup: int):
    """trainer=tiny warms up for 3% of the run (rounded up), so `python -m exp.train trainer.max_steps=50` and short
    sweeps reach the peak learning rate and decay from it, with nothing to say about it."""
    result = check(compose_typed([f"trainer.max_steps={max_steps}"]), Environment())
    assert result.cfg.trainer.warmup_step_count == warmup
    assert not any("warmup" in n for n in result.notes)
    from exp.training.module import lr_lambda

    t = result.cfg.trainer
    multipliers = [lr_lambda(s, t.warmup_step_count, t.max_steps, t.lr_schedule) for s in range(t.max_steps)]
    assert max(multipliers) == 1.0 and multipliers.index(1.0) == warmup


def test_compile_auto_is_on_for_a_gpu_and_off_on_the_cpu(monkeypatch):
    import importlib.util

    import exp.hardware.preflight as preflight

    assert (
        check(compose_typed(["hardware=gpu", "hardware.accelerator=cpu"]), Environment()).cfg.hardware.compile is False
    )
    env = Environment(torch_cuda="13.0", gpus=[Gpu("NVIDIA H200", 140 * 2**30, 139 * 2**30, (9, 0))])
    monkeypatch.setattr(preflight, "compile_problem", lambda env: None)
    assert check(compose_typed(["hardware=gpu"]), env, memory_check=False).cfg.hardware.compile is True
    # Fallbacks: no Triton, or a GPU older than Volta: eager, and the preflight says why.
    monkeypatch.undo()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    result = check(compose_typed(["hardware=gpu"]), env, memory_check=False)
    assert result.cfg.hardware.compile is False
    assert any("Triton is not installed" in n and "eagerly" in n for n in result.notes)
    monkeypatch.undo()
    old = Environment(torch_cuda="13.0", gpus=[Gpu("Tesla P100", 16 * 2**30, 15 * 2**30, (6, 0))])
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real_find_spec(name, *a)
    )
    result = check(compose_typed(["hardware=gpu", "hardware.compile=true"]), old, memory_check=False)
    assert result.cfg.hardware.compile is False and any("Triton needs 7.0" in n for n in result.notes)


def test_memory_budget_caps_the_checkpointing_choice():
    """hardware.memory_budget_gib: the preflight plans within it instead of the free memory (an H200 shared with
    other jobs, or the footprint of another program)."""
    env = Environment(torch_cuda="13.0", gpus=[Gpu("NVIDIA H200", 140 * 2**30, 139 * 2**30, (9, 0))])
    base = ["model=gemma_7b", "model.random_init=true", "hardware=gpu", "data.max_seq_len=2048",
            "hardware.micro_batch_size=8", "trainer.global_batch_size=8", "hardware.compile=true",
            "hardware.auto_micro_batch=false"]  # fmt: skip
    whole = check(compose_typed(base), env).cfg.hardware
    capped = check(compose_typed([*base, "hardware.memory_budget_gib=60"]), env)
    hw = capped.cfg.hardware
    assert capped.ok and hw.gradient_checkpointing and hw.checkpoint_layers is not None
    layers_whole = (whole.checkpoint_layers or 0) if whole.gradient_checkpointing else 0
    assert hw.checkpoint_layers > layers_whole
    assert any("hardware.memory_budget_gib=60" in n for n in capped.notes)
    from exp.hardware.memory import estimate_for_config

    assert estimate_for_config(capped.cfg).total <= 60 * 2**30
    # One layer fewer would not fit: the fewest recomputed layers within the budget.
    capped.cfg.hardware.checkpoint_layers -= 1
    assert estimate_for_config(capped.cfg).total > 60 * 2**30
    tight = check(compose_typed([*base, "hardware.memory_budget_gib=5"]), env)
    assert not tight.ok and "allowed (hardware.memory_budget_gib" in str(tight.findings[0])


def test_auto_micro_batch_prefers_a_smaller_micro_batch_to_recomputing():
    """hardware=gpu: the largest micro-batch (dividing the global batch) that fits without recomputed layers, not
    below AUTO_MICRO_BATCH_MIN_TOKENS tokens; only then layers recompute. The global batch never changes."""
    from exp.hardware.memory import estimate_for_config
    from exp.hardware.preflight import AUTO_MICRO_BATCH_MIN_TOKENS

    env = Environment(torch_cuda="13.0", gpus=[Gpu("NVIDIA H200", 140 * 2**30, 139 * 2**30, (9, 0))])
    base = ["model=gemma_7b", "model.random_init=true", "hardware=gpu", "data.max_seq_len=2048",
            "trainer.global_batch_size=8", "hardware.compile=true", "hardware.padding_free=false"]  # fmt: skip

    def resolved(*extra: str):
        result = check(compose_typed([*base, *extra]), env)
        assert result.ok, result.findings
        return result

    whole = resolved().cfg  # the whole GPU: all 8 rows in one micro-batch, nothing recomputed
    assert (whole.hardware.micro_batch_size, whole.hardware.gradient_checkpointing) == (8, False)
    capped = resolved("hardware.memory_budget_gib=60")
    hw = capped.cfg.hardware
    assert (hw.micro_batch_size, hw.gradient_checkpointing, capped.cfg.accumulate_grad_batches) == (4, False, 2)
    assert estimate_for_config(capped.cfg).total <= 60 * 2**30
    twice = copy.deepcopy(capped.cfg)
    twice.hardware.micro_batch_size = 8
    assert estimate_for_config(twice).total > 60 * 2**30  # the next larger divisor would not fit
    assert any("hardware.auto_micro_batch: micro-batch 4 x 2048 tokens (was 4), 2 micro-batch(es)" in n
               for n in capped.notes)  # fmt: skip
    # Below the token floor the micro-batch stops shrinking and the fewest layers recompute instead.
    lean = resolved("hardware.memory_budget_gib=15").cfg.hardware
    assert lean.micro_batch_size * 2048 >= AUTO_MICRO_BATCH_MIN_TOKENS and lean.micro_batch_size == 2
    assert lean.gradient_checkpointing and 0 < (lean.checkpoint_layers or 28) <= 28
    # An explicit choice is kept: auto_micro_batch=false (or the CPU, where the preflight does not choose).
    kept = resolved("hardware.memory_budget_gib=60", "hardware.auto_micro_batch=false",
                    "hardware.micro_batch_size=8").cfg.hardware  # fmt: skip
    assert kept.micro_batch_size == 8 and kept.gradient_checkpointing
    cpu = check(compose_typed(["hardware=gpu", "hardware.accelerator=cpu"]), Environment(torch_cuda=None))
    assert cpu.ok and cpu.cfg.hardware.micro_batch_size == 4


def test_padding_free_token_budget_is_the_most_the_memory_holds():
    """hardware=gpu (padding-free): the token budget is m x max_seq_len for the largest m, divisor of the global
    batch or not, whose estimate fits without recomputing; micro_batch_size is the largest divisor up to m."""
    from exp.hardware.memory import estimate_for_config

    env = Environment(torch_cuda="13.0", gpus=[Gpu("NVIDIA H200", 140 * 2**30, 139 * 2**30, (9, 0))])
    base = ["model=gemma_7b", "model.random_init=true", "hardware=gpu", "data.max_seq_len=2048",
            "trainer.global_batch_size=8", "hardware.compile=true"]  # fmt: skip
    whole = check(compose_typed(base), env)
    assert whole.ok and whole.cfg.hardware.micro_batch_tokens == 8 * 2048
    capped = check(compose_typed([*base, "hardware.memory_budget_gib=60"]), env)
    hw = capped.cfg.hardware
    m = hw.micro_batch_tokens // 2048
    assert not hw.gradient_checkpointing and 1 <= m < 8 and hw.micro_batch_size == max(d for d in (1, 2, 4) if d <= m)
    trial = copy.deepcopy(capped.cfg)
    trial.hardware.micro_batch_size = m
    assert estimate_for_config(trial).total <= 60 * 2**30
    trial.hardware.micro_batch_size = m + 1
    assert estimate_for_config(trial).total > 60 * 2**30  # one more example's worth would not fit
    assert any(f"padding-free micro-batches of at most {m * 2048} tokens ({m} x 2048)" in n for n in capped.notes)
    # An explicit budget is kept.
    kept = check(compose_typed([*base, "hardware.micro_batch_tokens=4096"]), env).cfg.hardware
    assert kept.micro_batch_tokens == 4096


def test_padding_free_gemma2_on_eager_takes_rows_capped_at_max_seq_len():
    """Gemma 2 (eager) keeps padding-free micro-batches on a GPU, as rows of at most data.max_seq_len tokens within
    the token budget the preflight fits from the padded estimate of as many rows; flex_attention keeps one row."""
    from exp.data.datamodule import flat_batching

    env = Environment(torch_cuda="13.0", gpus=[Gpu("NVIDIA H200", 140 * 2**30, 139 * 2**30, (9, 0))])
    gpu = check(compose_typed(["model=gemma2_2b", "model.random_init=true", "hardware=gpu"]), env)
    assert gpu.ok and gpu.cfg.model.attn_implementation == "eager" and gpu.cfg.hardware.padding_free
    budget = gpu.cfg.hardware.micro_batch_tokens
    assert budget is not None and budget % gpu.cfg.data.max_seq_len == 0
    assert any("eager attention (Gemma 2's, for its softcapping)" in n for n in gpu.notes)
    plan = flat_batching(gpu.cfg)
    assert plan.row_tokens == gpu.cfg.data.max_seq_len and plan.rows_per_micro_batch == budget // plan.row_tokens
    flex = check(compose_typed(["model=gemma2_2b", "model.random_init=true", "hardware=gpu",
                                "model.attn_implementation=flex_attention"]), env)  # fmt: skip
    assert flex.ok and flex.cfg.hardware.padding_free and flex.cfg.model.attn_implementation == "flex_attention"
    assert flat_batching(flex.cfg).row_tokens is None
    cpu = check(compose_typed(["model=gemma2_2b", "model.random_init=true", "hardware=gpu",
                               "hardware.accelerator=cpu"]), Environment())  # fmt: skip
    assert cpu.cfg.model.attn_implementation == "eager" and cpu.cfg.hardware.padding_free
    assert flat_batching(cpu.cfg).row_tokens == cpu.cfg.data.max_seq_len


def test_auto_dequantized_layers_spends_only_what_the_other_choices_leave():
    """hardware=gpu: after the micro-batch and the recomputed layers are chosen, as many layers keep their weights
    dequantized as the rest of the budget holds; the other choices are those made without it."""
    from exp.hardware.memory import estimate_for_config

    env = Environment(torch_cuda="13.0", gpus=[Gpu("NVIDIA H200", 140 * 2**30, 139 * 2**30, (9, 0))])
    base = ["model=gemma_7b", "model.random_init=true", "hardware=gpu", "data.max_seq_len=2048",
            "trainer.global_batch_size=8", "hardware.compile=true", "hardware.memory_budget_gib=60"]  # fmt: skip
    with_it = check(compose_typed(base), env)
    without = check(compose_typed([*base, "hardware.auto_dequantized_layers=false"]), env)
    assert with_it.ok and without.ok
    hw, plain = with_it.cfg.hardware, without.cfg.hardware
    assert (hw.micro_batch_size, hw.gradient_checkpointing, hw.checkpoint_layers) == (
        plain.micro_batch_size, plain.gradient_checkpointing, plain.checkpoint_layers)  # fmt: skip
    assert plain.dequantized_layers == 0 and 0 < hw.dequantized_layers < 28
    assert estimate_for_config(with_it.cfg).total <= 60 * 2**30
    one_more = copy.deepcopy(with_it.cfg)
    one_more.hardware.dequantized_layers += 1
    assert estimate_for_config(one_more).total > 60 * 2**30  # the most that fit
    assert any(f"the first {hw.dequantized_layers} of 28 decoder layers keep their weights dequantized" in n
               for n in with_it.notes)  # fmt: skip
    # An explicit count is kept.
    kept = check(compose_typed([*base, "hardware.dequantized_layers=3"]), env).cfg.hardware
    assert kept.dequantized_layers == 3
    whole = check(compose_typed(base[:-1]), env).cfg.hardware  # the whole GPU: every layer fits
    assert whole.dequantized_layers == 28


def test_num_nodes_without_a_multi_node_launcher_is_refused(monkeypatch):
    """Started on one machine, hardware.num_nodes=2 would wait for the other node forever."""
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "MASTER_ADDR", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    cfg = compose_typed(["hardware=ddp", "hardware.accelerator=cpu", "hardware.num_nodes=2"])
    result = check(cfg, Environment(torch_cuda=None))
    (finding,) = [f for f in result.findings if f.key == "hardware.num_nodes"]
    assert "hardware.num_nodes=1" in finding.message and "forever" in finding.message
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")  # a one-node SLURM job
    assert any(f.key == "hardware.num_nodes" for f in check(cfg, Environment(torch_cuda=None)).findings)
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    assert not any(f.key == "hardware.num_nodes" for f in check(cfg, Environment(torch_cuda=None)).findings)
