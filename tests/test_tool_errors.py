"""Unexpected input at a tool's boundary: one `exp: error:` paragraph naming the key, the value and the fix, exit
status 2, no traceback (#25, class 5). Bad tool arguments, damaged run files given to exp.evaluate / exp.merge /
exp.generate / a resume, a damaged job in exp.report, LoRA targets the memory estimate does not know, a full disk.
In-process calls of the tools' main functions; one subprocess for `ulimit -f`."""

from __future__ import annotations

import errno
import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_typed
from test_cli import exit_status  # the tool's main() as `python -m <module>` runs it

from exp.core.cli import Tool, run_tool
from exp.core.config import ConfigError


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("exp.generate", ["run=x", "prompt=hi", "temperature=nan"], "temperature=nan: expected a finite number"),
        ("exp.generate", ["run=x", "prompt=hi", "temperature=0"], "temperature=0: must be greater than 0"),
        ("exp.generate", ["run=x", "prompt=hi", "max_new_tokens=-3"], "max_new_tokens=-3: must be at least 1"),
        ("exp.generate", ["run=x", "prompt=hi", "top_p=1.5"], "top_p=1.5: must be at most 1"),
        ("exp.evaluate", ["run=x", "batch_size=-2"], "batch_size=-2: must be at least 0"),
        ("exp.evaluate", ["run=x", "name=a/b"], "name=a/b: a name, not a path (no '/')"),
        ("exp.merge", ["run=x", "out=m", "examples=0"], "examples=0: must be at least 1"),
        ("exp.preview", ["n=0"], "n=0: must be at least 1"),
        ("exp.bench", ["micro_batch=8,-8"], "micro_batch=-8: must be at least 1"),
        ("exp.bench", ["lr=inf"], "lr=inf: expected a finite number"),
    ],
)  # fmt: skip
def test_a_bad_tool_value_is_refused_before_anything_runs(module, argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert exit_status(module, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("exp: error:") and message in err and "Fix: e.g." in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def _raises(e: BaseException):
    def body(_args) -> None:
        raise e

    return body


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (OSError(errno.ENOSPC, "No space left on device", "/runs/x/eval.json"), "no space left on /runs/x/eval.json"),
        (OSError(errno.EFBIG, "File too large", "/runs/x/report.md"), "no space left on /runs/x/report.md"),
        (OSError(errno.ENAMETOOLONG, "File name too long", "/runs/" + "a" * 300), "longer than the file system allows"),
        (FileExistsError(errno.EEXIST, "File exists", "out"), "out: File exists"),
    ],
)
def test_a_file_system_error_is_one_paragraph(error, message, capsys):
    assert run_tool(Tool("exp.x", "doc"), _raises(error), []) == 2
    err = capsys.readouterr().err
    assert err.startswith("exp: error: exp.x: ") and message in err and "Fix:" in err, err


def test_another_os_error_is_not_hidden():
    with pytest.raises(ConnectionResetError):
        run_tool(Tool("exp.x", "doc"), _raises(ConnectionResetError(errno.ECONNRESET, "reset")), [])


def test_ulimit_f_says_no_space_not_a_traceback(tmp_path):
    """A real file-size limit: Python ignores SIGXFSZ, so the write fails with EFBIG and the tool says so."""
    run = _run_dir(tmp_path / "job")
    (run / "csv").mkdir()
    (run / "csv" / "metrics.csv").write_text(
        "step,train/loss,val/loss\n" + "".join(f"{i},1.0,1.0\n" for i in range(300))
    )
    script = "import sys; from exp.report import main; sys.exit(main(sys.argv[1:]))"

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))

    proc = subprocess.run(
        [sys.executable, "-c", script, str(run), f"out={tmp_path / 'out'}"],
        preexec_fn=small_files,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "exp: error: exp.report: no space left on " in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def _run_dir(path: Path, config: str = "lora:\n  r: 8\n") -> Path:
    """A run directory's files, as far as reading them back goes (no weights)."""
    (path / "adapter").mkdir(parents=True)
    (path / ".hydra").mkdir()
    (path / "config.yaml").write_text(config)
    (path / "status.json").write_text(json.dumps({"status": "completed"}))
    (path / ".hydra" / "overrides.yaml").write_text("- lora.r=8\n")
    (path / "adapter" / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return path


@pytest.mark.parametrize("module", ["exp.evaluate", "exp.generate", "exp.merge"])
@pytest.mark.parametrize("config", ["lora: [\n  r: 8\n", "lora:\n  r: eight\n", "- a list\n"])
def test_a_damaged_config_yaml_is_named(module, config, tmp_path, capsys):
    run = _run_dir(tmp_path / "run", config)
    argv = [f"run={run}", "prompt=hi"] if module == "exp.generate" else [f"run={run}", f"out={tmp_path / 'm'}"]
    assert exit_status(module, argv if module != "exp.evaluate" else [f"run={run}"]) == 2
    err = capsys.readouterr().err
    assert f"exp: error: run={run}: its config.yaml cannot be read (" in err and ".hydra/config.yaml" in err, err
    assert "Traceback" not in err


def _tiny_base():
    from transformers import GemmaConfig, GemmaForCausalLM

    arch = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    return GemmaForCausalLM(GemmaConfig(**arch, num_key_value_heads=1, head_dim=8, vocab_size=64))


@pytest.mark.parametrize("damage", ["config-cut", "weights-cut", "config-missing"])
def test_a_damaged_adapter_is_named(damage, tmp_path):
    from peft import LoraConfig, get_peft_model

    from exp.run.inference import load_adapter

    get_peft_model(_tiny_base(), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path)
    config, weights = tmp_path / "adapter_config.json", tmp_path / "adapter_model.safetensors"
    if damage == "config-cut":
        config.write_text(config.read_text()[:40])
    elif damage == "weights-cut":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        config.unlink()
    with pytest.raises(ConfigError, match=r"the adapter in .* cannot be read \(\w+: .*\)\. Fix: restore adapter/"):
        load_adapter(_tiny_base(), tmp_path)


@pytest.mark.parametrize("config", [None, "lora: [\n", "just text\n"])
def test_resume_from_a_run_without_a_readable_config_is_refused(config, tmp_path):
    """Without config.yaml nothing says the checkpoint fits (a changed lora.r failed deep in the weight loading)."""
    from exp.run.compose import config_dict
    from exp.run.resume import resolve

    run = tmp_path / "old"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"not read")
    if config is not None:
        (run / "config.yaml").write_text(config)
    cfg = compose_typed(["lora.r=16", f"trainer.resume={run}"])
    with pytest.raises(ConfigError, match=rf"trainer.resume={run}: {run}/config.yaml (cannot be read|holds no config)"):
        resolve(cfg, config_dict(cfg), tmp_path / "new", tmp_path)


def test_report_shows_the_other_jobs_and_names_the_damaged_one(tmp_path, capsys):
    from exp.report import main

    sweep = tmp_path / "sweep"
    rows = "step,train/loss,val/loss\n0,,2.0\n1,1.5,\n2,1.2,1.1\n"
    summary = {"final_val": {"val/loss": 1.1}, "steps": 2, "seconds": 3.0}
    for name in ("0_good", "1_cut_summary", "2_bad_csv", "3_bad_overrides"):
        run = _run_dir(sweep / name)
        (run / "csv").mkdir()
        (run / "csv" / "metrics.csv").write_text(rows)
        (run / "summary.json").write_text(json.dumps(summary))
    (sweep / "1_cut_summary" / "summary.json").write_text(json.dumps(summary)[:30])
    (sweep / "2_bad_csv" / "csv" / "metrics.csv").write_bytes(rows.encode() + b"3,\xff\xfe,1\n")
    (sweep / "3_bad_overrides" / ".hydra" / "overrides.yaml").write_text("- [unclosed\n")
    assert main([str(sweep)]) == 0
    out = capsys.readouterr().out
    for name in ("0_good", "1_cut_summary", "2_bad_csv", "3_bad_overrides"):
        assert f"\n{name} " in out or out.startswith(f"{name} ") or f" {name} " in out, out
    assert "damaged 1_cut_summary: summary.json (JSONDecodeError: " in out
    assert "damaged 2_bad_csv: csv/metrics.csv (UnicodeDecodeError: " in out
    assert "damaged 3_bad_overrides: .hydra/overrides.yaml (" in out
    assert "damaged 0_good" not in out
    assert "damaged 1_cut_summary" in (sweep / "report.md").read_text()


def test_an_unknown_lora_target_fails_its_own_job_in_a_plan():
    """--plan and the packing launcher estimate each job's memory: a target the estimate does not know (in a config
    made without composing it, which refuses it first) fails that job, with the message composing would give, and
    the other jobs are still planned."""
    from exp.study.plan import PlannedJob, build_pool, estimate_jobs

    bad, good = compose_typed([]), compose_typed([])
    bad.lora.target_modules = ["q_proj", "qv_proj"]
    jobs = [PlannedJob(0, "0_bad", [], bad), PlannedJob(1, "1_good", [], good)]
    estimate_jobs(jobs, build_pool("sequential", [], [], 0.1)[0], [])
    assert jobs[0].cfg is None and not jobs[0].runs
    assert "lora.target_modules=['q_proj', 'qv_proj']: ['qv_proj'] match no linear layer" in jobs[0].error
    assert "Fix: e.g. lora.target_modules=[q_proj,v_proj]" in jobs[0].error
    assert jobs[1].runs and jobs[1].memory is not None


def test_doctor_names_an_unknown_lora_target(capsys):
    assert exit_status("exp.doctor", ["lora.target_modules=[q_proj,qv_proj]"]) == 2
    err = capsys.readouterr().err
    assert "exp: error: lora.target_modules=['q_proj', 'qv_proj']: ['qv_proj'] match no linear layer" in err, err
    assert "Traceback" not in err


def test_report_out_a_file_is_refused(tmp_path, capsys):
    from exp.report import main

    run = _run_dir(tmp_path / "run")
    (tmp_path / "f").write_text("a file")
    assert main([str(run), f"out={tmp_path / 'f'}"]) == 2
    err = capsys.readouterr().err
    assert f"exp: error: exp.report: {tmp_path / 'f'}: File exists" in err and "Fix: name another path" in err, err
    shutil.rmtree(run)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"layer_types": ["x"]}, "transformers' GemmaConfig refuses it (StrictDataclassClassValidationError: "),
        ({"rope_scaling": {"rope_type": "foo"}}, "model.arch="),
    ],
)
def test_an_architecture_transformers_rejects_is_a_config_error(extra, message):
    from exp.core.config import TINY_ARCH, ModelFamily
    from exp.model.local import build_random_checkpoint

    with pytest.raises(ConfigError, match="Fix the architecture fields") as e:
        build_random_checkpoint(ModelFamily.gemma, {**TINY_ARCH, "num_hidden_layers": 1, **extra}, 0)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_random_init_out_of_host_memory_says_so_not_that_the_architecture_is_wrong(monkeypatch, tmp_path):
    from exp.core.config import TINY_ARCH, ModelFamily
    from exp.model import local

    monkeypatch.setenv("EXP_CACHE", str(tmp_path))

    class Starved:
        def __init__(self, config):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
                               "tried to allocate 1200000000 bytes")  # fmt: skip

    monkeypatch.setattr(local, "_model_class", lambda family: Starved)
    with pytest.raises(ConfigError, match="the host has too little free memory") as e:
        local.build_random_checkpoint(ModelFamily.gemma, {**TINY_ARCH, "num_hidden_layers": 1}, 0)
    assert "Fix the architecture fields" not in str(e.value) and "model=gemma_tiny" in str(e.value)


def test_random_init_too_large_for_the_gpu_is_drawn_on_the_cpu(monkeypatch, tmp_path, caplog):
    """A shape stored in bf16 is drawn on the GPU; when the GPU is too small for it in bf16 (out of memory), on the
    CPU instead: the checkpoint is built, not refused as a bad architecture."""
    import torch

    from exp.core.config import TINY_ARCH, ModelFamily
    from exp.model import local

    monkeypatch.setenv("EXP_CACHE", str(tmp_path))
    devices = []
    draw = local._draw_model

    def small_gpu(family, config, arch, seed, device):
        devices.append(device)
        if device == "cuda":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
        return draw(family, config, arch, seed, device)

    monkeypatch.setattr(local, "_draw_model", small_gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # A vocabulary large enough that the shape counts as large (bf16, drawn on the GPU first).
    arch = {**TINY_ARCH, "num_hidden_layers": 1, "vocab_size": 400_000}  # 51M parameters
    path = local.build_random_checkpoint(ModelFamily.gemma, arch, 0)
    assert devices == ["cuda", "cpu"] and (path / "config.json").exists()
    assert "does not fit on the GPU in bf16; drawing its weights on the CPU" in caplog.text


def test_bench_refuses_an_unknown_lora_target_before_any_worker(tmp_path, capsys):
    from exp.bench.cli import main

    argv = ["model=gemma_tiny", "lora_targets=qv_proj", "steps=2", "warmup=0", "device=cpu", f"out_dir={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "exp: error: exp.bench: lora.target_modules=['qv_proj']: ['qv_proj'] match no linear layer" in err, err
    assert not list(tmp_path.iterdir())  # no result file, no worker run


@pytest.mark.parametrize(
    ("device", "built", "host_gib", "gpu_gib", "says"),
    [
        ("cpu", False, 8, None, "its random weights alone take 15.9 GiB (bf16) and this machine has 8.0 GiB available"),
        ("cpu", True, 8, None, "its random weights alone take 15.9 GiB"),  # the host trains it: cached or not
        ("cuda", False, 64, 12, "its random weights are drawn on the GPU in bf16 (once, into exp's cache) and take"),
        ("cuda", False, 2, 40, "writing its random weights into exp's cache takes 4.7 GiB of host memory"),
        ("cuda", True, 64, 3, "it needs at least 6.4 GiB on the GPU before any activation (exp.hardware.memory), and "),
        ("cuda", True, 2, 12, ""),  # built: nothing drawn or written; the 4-bit model fits
        ("cuda", False, 64, 40, ""),
        ("cuda", True, None, None, ""),  # no figures: nothing to go on
    ],
)
def test_bench_refuses_a_model_this_machine_cannot_hold_before_any_worker(
    tmp_path, capsys, monkeypatch, device, built, host_gib, gpu_gib, says
):
    """gemma_7b (8.5 B parameters: 15.9 GiB in bf16, 6.4 GiB resident in 4-bit with its adapters) against faked
    memory figures, through `exp.bench.cli.main`: the CUDA side runs on a machine without a GPU."""
    import exp.bench.cli
    import exp.bench.memory_check
    from exp.bench.memory_check import MemoryFigures, memory_problem
    from exp.bench.variants import Settings

    gib = 2**30
    figures = MemoryFigures(host_gib and host_gib * gib, gpu_gib and gpu_gib * gib)
    monkeypatch.setattr(exp.bench.cli, "memory_figures", lambda d: figures if d == device else pytest.fail(d))
    if built:  # the random checkpoint is in exp's cache already
        monkeypatch.setattr(exp.bench.memory_check, "random_checkpoint_dir", lambda *a: tmp_path)
    if not says:  # past the check the bench would start its workers: the check alone is asked
        cfg = Settings(model="gemma_7b", device=device).exp_config()
        assert memory_problem(cfg, device, figures) == ""
        return
    out = tmp_path / "results"
    argv = ["model=gemma_7b", "steps=2", "warmup=0", f"device={device}", f"out_dir={out}"]
    assert exp.bench.cli.main(argv) == 2
    (message,) = capsys.readouterr().err.strip().splitlines()
    assert message.startswith("exp: error: exp.bench: model=gemma_7b: ") and says in message, message
    assert "Fix: " in message and "model=gemma_tiny" in message
    assert not out.exists()  # no result file, no worker run
