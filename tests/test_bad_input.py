"""Bad input, systematically: a table of invalid command lines thrown at the real `python -m exp.train`.

Every row must exit non-zero with a message that names the key and says how to fix it, print no traceback, leave a
finished run directory it is aimed at (`hydra.run.dir=<that run>`: status, checkpoint, adapter) exactly as it was,
and leave no new directory behind (the one a run claims before its checks is removed again). Most rows fail before Hydra starts (well under a second); the
cross-field checks fail in the typed config (an unknown LoRA target there too, against its model family's row), and a
missing model.path before anything loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from conftest import Together

# Cheap defaults for the rows that fail late (no W&B, a small generated dataset).
BASE = ["logger=csv", "data.num_examples=200"]

# id, overrides ({file}: an existing file, {empty}: an empty directory), what the message must name, how to fix it.
CASES = [
    ("rank-zero", ["lora.r=0"], "lora.r=0", "e.g. lora.r=8"),
    ("rank-negative", ["lora.r=-4"], "lora.r=-4", "e.g. lora.r=8"),
    ("alpha-zero", ["lora.alpha=0"], "lora.alpha=0", "e.g. lora.alpha=16"),
    ("alpha-negative", ["lora.alpha=-16"], "lora.alpha=-16", "e.g. lora.alpha=16"),
    ("dropout-one", ["lora.dropout=1.0"], "lora.dropout=1.0", "e.g. lora.dropout=0.05"),
    ("dropout-negative", ["lora.dropout=-0.1"], "lora.dropout=-0.1", "e.g. lora.dropout=0.05"),
    (
        "unknown-target-module",
        ["lora.target_modules=[q_proj,qv_proj]"],
        "lora.target_modules=['q_proj', 'qv_proj']: ['qv_proj'] match no linear layer",
        "e.g. lora.target_modules=[q_proj,v_proj]",
    ),
    ("lr-zero", ["trainer.learning_rate=0"], "trainer.learning_rate=0.0", "e.g. trainer.learning_rate=2e-4"),
    ("lr-negative", ["trainer.learning_rate=-1e-4"], "trainer.learning_rate=-0.0001", "e.g. trainer.learning_rate="),
    ("max-steps-zero", ["trainer.max_steps=0"], "trainer.max_steps=0", "e.g. trainer.max_steps=1000"),
    (
        "micro-batch-over-global",
        ["hardware.micro_batch_size=16"],
        "hardware.micro_batch_size=16 x data-parallel processes (1) = 16 is larger than trainer.global_batch_size=8",
        "Use e.g. hardware.micro_batch_size=8, or trainer.global_batch_size=16",
    ),
    ("unknown-model", ["model=gemma_tny"], "there is no option 'gemma_tny' in group 'model'", "model=gemma_tiny"),
    ("unknown-hardware", ["hardware=tpu"], "hardware=tpu", "Available: auto, cpu, ddp, fsdp, gpu, model_parallel"),
    # `experiment` is an optional group: Hydra alone would skip the misspelt file and run the default config.
    ("unknown-experiment", ["experiment=guanaco7b"], "experiment=guanaco7b", "Did you mean experiment=guanaco_7b?"),
    ("unknown-key", ["lora.rank=16"], "'rank' is not a field of lora", "Did you mean 'lora.r'?"),
    ("added-unknown-key", ["+lora.rank=16"], "'rank' is not a field of lora", "Did you mean 'lora.r'?"),
    ("added-root-key", ["+foo=1"], "'+foo': 'foo' is not a field of the root config", "remove it"),
    ("wrong-type-int", ["lora.r=abc"], "'lora.r=abc'", "e.g. lora.r=8"),
    ("wrong-type-int-float", ["lora.r=1.5"], "'lora.r=1.5'", "e.g. lora.r=8"),
    ("wrong-type-float", ["trainer.learning_rate=fast"], "'trainer.learning_rate=fast'", "e.g. trainer.learning_rate="),
    ("wrong-type-bool", ["data.packing=maybe"], "'data.packing=maybe'", "e.g. data.packing=false"),
    (
        "wrong-type-list",
        ["lora.target_modules=q_proj"],
        "'lora.target_modules=q_proj'",
        "e.g. lora.target_modules=[q_proj,v_proj]",
    ),
    ("wrong-type-null", ["trainer.max_steps=null"], "'trainer.max_steps=null'", "e.g. trainer.max_steps=3000"),
    ("wrong-enum", ["quantization.quant_type=nf5"], "quantization.quant_type=nf5", "expected one of [nf4, fp4"),
    ("sweep-without-multirun", ["lora.r=4,8"], "'lora.r=4,8'", "add --multirun"),
    # Values Hydra's override grammar cannot read: the key named, and the quoting that reads them.
    ("grammar-equals", ["lora.r=16=3"], "Hydra cannot read the value of lora.r", "\"lora.r='16=3'\""),
    ("grammar-open-list", ["trainer.max_steps=[1"], "value of trainer.max_steps", "trainer.max_steps=[1,2]"),
    ("grammar-brackets", ["data.path=set[1].jsonl"], "value of data.path", "\"data.path='set[1].jsonl'\""),
    ("grammar-not-a-key", ["lora r=1"], "'lora r' is not a config key", "e.g. lora.r=16"),
    (
        "grammar-open-interpolation",
        ["lora.r=${{lora.alpha"],  # doubled: the rows are str.format templates
        "interpolation in the value of lora.r is not closed",
        "'lora.r=${lora.alpha}'",
    ),
    # The 4-bit compute dtype is not a key: it follows hardware.precision (float32 on the CPU, bf16 on a GPU).
    (
        "compute-dtype-float32",
        ["quantization.compute_dtype=float32"],
        "'quantization.compute_dtype=float32': the compute dtype is not a setting of its own",
        "hardware.precision=bf16-mixed",
    ),
    ("int8-on-cpu", ["quantization=int8"], "quantization=int8 needs a GPU", "use nf4 or fp4"),
    (
        "int8-with-fsdp",
        ["quantization=int8", "hardware=fsdp"],
        "quantization=int8 with hardware.strategy=fsdp",
        "Use quantization=nf4 with hardware=fsdp",
    ),
    (
        "fsdp-on-cpu",
        ["hardware=fsdp", "hardware.accelerator=cpu", "hardware.precision=32-true"],
        "hardware.strategy=fsdp needs GPUs",
        "on the CPU use single_device or ddp",
    ),
    (
        "fp16-on-cpu",
        ["hardware.precision=16-mixed"],
        "hardware.precision=16-mixed on the CPU",
        "use hardware.precision=32-true",
    ),
    ("paged-optimizer-on-cpu", ["trainer.optimizer=paged_adamw_8bit"], "trainer.optimizer=", "trainer.optimizer=adamw"),
    (
        "missing-model-path",
        ["model.path=/nonexistent/gemma-2b"],
        "model.path=/nonexistent/gemma-2b: no config.json there: the path does not exist",
        "directory written by save_pretrained",
    ),
    (
        "model-path-without-config",
        ["model.path={empty}"],
        "no config.json there",
        "directory written by save_pretrained",
    ),
    (
        "missing-start-adapter",
        ["objective=dpo", "model.adapter=/nonexistent/sft-run"],
        "model.adapter=/nonexistent/sft-run: /nonexistent/sft-run does not exist",
        "drop model.adapter to start from a fresh LoRA",
    ),
    ("run-dir-is-a-file", ["hydra.run.dir={file}"], "is an existing file, not a directory", "hydra.run.dir="),
    ("run-dir-below-a-file", ["hydra.run.dir={file}/run"], "is an existing file", "/run."),
    (
        "arch-key-without-plus",
        ["model.arch.vocab_size=300"],
        "model.arch.vocab_size: not a key of model.arch yet",
        "add it with +model.arch.vocab_size=",
    ),
    # Names over the file system's limit (255 bytes): Hydra would fail after making the run directory.
    ("run-dir-name-too-long", ["hydra.run.dir=outputs/" + "a" * 300], "is 300 bytes, longer than", "a shorter name"),
    ("job-name-too-long", ["hydra.job.name=" + "j" * 300], "is 304 bytes, longer than", "with .log added"),
]


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() + f"@{p.stat().st_mtime_ns}"
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def make_workspace(root: Path) -> dict[str, Path]:
    """A launch directory holding a finished run (status, config, Hydra record, checkpoint, adapter), a file and an
    empty directory."""
    import torch
    from safetensors.torch import save_file

    run = root / "outputs" / "finished"
    (run / "checkpoints").mkdir(parents=True)
    (run / "adapter").mkdir()
    (run / ".hydra").mkdir()
    (run / "status.json").write_text(json.dumps({"status": "completed"}))
    (run / "config.yaml").write_text("lora:\n  r: 8\n")
    (run / ".hydra" / "overrides.yaml").write_text("- lora.r=8\n")
    (run / "train.log").write_text("finished\n")
    torch.save({"state_dict": {"lora_A": torch.ones(2, 2)}, "global_step": 30}, run / "checkpoints" / "last.ckpt")
    save_file({"lora_A": torch.ones(2, 2)}, str(run / "adapter" / "adapter_model.safetensors"))
    (run / "adapter" / "adapter_config.json").write_text('{"r": 8}')
    (root / "a_file").write_text("not a directory")
    (root / "empty").mkdir()
    return {"root": root, "run": run, "file": root / "a_file", "empty": root / "empty"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_workspace(tmp_path_factory.mktemp("bad_input"))


def refuse(workspace: dict[str, Path], overrides: list[str]):
    """`python -m exp.train` with a row's overrides in `workspace`; the process, and the finished run's digest and
    the workspace's directories from before it."""
    root, run = workspace["root"], workspace["run"]
    args = [o.format(file=workspace["file"], empty=workspace["empty"]) for o in overrides]
    if not any(a.startswith("hydra.run.dir=") for a in args):
        args.append(f"hydra.run.dir={run}")  # aimed at the finished run: it must stay as it is
    before = _digest(run)
    dirs = sorted(p for p in root.rglob("*") if p.is_dir())
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", *BASE, *args],
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return proc, before, dirs


def refused_in(workspace: dict[str, Path], overrides: list[str]):
    return (workspace, *refuse(workspace, overrides))


# The rows refused only once Hydra has started (the typed config's checks, model.path, the LoRA target): their
# process imports torch, transformers and Lightning first, seconds a row, so they run in the slow tier; the rest are
# refused in well under a second.
LATE = {
    "rank-zero",
    "rank-negative",
    "alpha-zero",
    "alpha-negative",
    "dropout-one",
    "dropout-negative",
    "unknown-target-module",
    "lr-zero",
    "lr-negative",
    "max-steps-zero",
    "micro-batch-over-global",
    "int8-on-cpu",
    "int8-with-fsdp",
    "fsdp-on-cpu",
    "fp16-on-cpu",
    "paged-optimizer-on-cpu",
    "missing-model-path",
    "model-path-without-config",
    "missing-start-adapter",
}
ROWS = [pytest.param(*c[1:], id=c[0], marks=pytest.mark.slow if c[0] in LATE else ()) for c in CASES]
TEST = "test_bad_input_is_refused_clearly_and_touches_nothing"


@pytest.fixture(scope="module")
def late_rows(request, tmp_path_factory: pytest.TempPathFactory) -> Together:
    """The LATE rows' commands, side by side (each is seconds of imports on one core), each in a workspace of its
    own: what one of them leaves behind is found in its own row."""
    rows = {c[0]: c[1] for c in CASES if c[0] in LATE}
    workspaces = {name: make_workspace(tmp_path_factory.mktemp(f"bad_input_{name}")) for name in rows}
    steps = {name: partial(refused_in, workspaces[name], rows[name]) for name in rows}
    with Together(request, steps, {name: [f"{TEST}[{name}]"] for name in rows}) as together:
        yield together


@pytest.mark.parametrize(("overrides", "key", "fix"), ROWS)
def test_bad_input_is_refused_clearly_and_touches_nothing(request, overrides: list[str], key: str, fix: str):
    row = request.node.callspec.id
    if row in LATE:
        workspace, proc, before, dirs = request.getfixturevalue("late_rows").get(row)
    else:
        workspace = request.getfixturevalue("workspace")
        proc, before, dirs = refuse(workspace, overrides)
    root, run = workspace["root"], workspace["run"]
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "exp: error:" in proc.stderr, output[-3000:]
    assert key in output, output[-3000:]
    assert fix in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert _digest(run) == before, "the finished run directory was modified"
    finished = [p.parent for p in root.rglob("status.json") if json.loads(p.read_text()).get("status") == "completed"]
    assert finished == [run], finished
    assert sorted(p for p in root.rglob("*") if p.is_dir()) == dirs  # no half-empty run directory left
    assert workspace["file"].read_text() == "not a directory"
