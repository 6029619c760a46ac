"""Jobs sharing one base (`hydra.launcher.share_base=true`): each job of a group trains as it would alone (the same
losses, validations and files, on the real 4-bit CPU path), a diverging job fails alone, a killed group continues
bitwise, and the launcher groups, plans and records the jobs."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import compose_typed
from test_sweeps import FAST

from exp.core.config import ConfigError
from exp.run.compose import compose_config, write_run_config
from exp.run.dirs import claim_run_dir, release_run
from exp.study.grouping import base_key, group_jobs, shared_config, why_alone

COMMON = [
    "hardware=cpu",
    "trainer.max_steps=4",
    "trainer.warmup_steps=1",
    "trainer.val_every_n_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.global_batch_size=8",
    "hardware.micro_batch_size=4",
    "data.num_examples=96",
    "logger=csv",
    "lora.dropout=0",
]
# Different ranks, learning rates, targets, seeds (the data order and split) and schedules.
JOBS = [
    ["lora.r=2", "trainer.learning_rate=5e-3"],
    ["lora.r=4", "trainer.learning_rate=1e-2", "trainer.seed=1", "data.seed=1", "trainer.lr_schedule=linear"],
    ["lora.r=8", "trainer.learning_rate=2e-3", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"],
]
PADDING_FREE = ["hardware.padding_free=true"]
# Diverges at once: its adapters' updates overflow fp32, and its loss turns NaN.
DIVERGING = ["lora.r=4", "trainer.learning_rate=1e30", "trainer.max_grad_norm=0"]


def _group_dirs(dirs_and_overrides: list[tuple[Path, list[str]]], common: list[str] = COMMON) -> list[str]:
    """Fresh run directories of these configs, for one `python -m exp.study.group_worker`. Composed in the calling
    thread: Hydra's compose state is one per process."""
    dirs = []
    for d, overrides in dirs_and_overrides:
        run_dir = claim_run_dir(d)
        write_run_config(compose_config(common + overrides), run_dir)
        release_run(run_dir)
        dirs.append(str(run_dir))
    return dirs


def _run_group(dirs: list[str], kill_at: str | None = None) -> int:
    proc = subprocess.Popen([sys.executable, "-m", "exp.study.group_worker", *dirs], stderr=subprocess.PIPE, text=True)
    if kill_at is not None:
        targets = [Path(d) / "checkpoints" / kill_at for d in dirs]
        while not all(t.exists() for t in targets) and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert kill_at is not None or proc.returncode == 0, err[-2000:]
    return proc.returncode


def _group(
    dirs_and_overrides: list[tuple[Path, list[str]]], kill_at: str | None = None, common: list[str] = COMMON
) -> int:
    """Run `python -m exp.study.group_worker` on fresh run directories of these configs; SIGKILL it once every job's
    checkpoint `kill_at` is there (the jobs save one after another)."""
    return _run_group(_group_dirs(dirs_and_overrides, common), kill_at)


def _groups_side_by_side(*groups: tuple[list[str], str | None]) -> list[int]:
    """`_run_group` of each (directories, kill_at), at once: a group worker spends most of its life importing on one
    core, and none of these reads another's directories."""
    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        return list(pool.map(lambda group: _run_group(*group), groups))


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def _losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["train/loss"]) for r in _rows(run_dir) if r.get("train/loss")}


def _val_losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["val/loss"]) for r in _rows(run_dir) if r.get("val/loss")}


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each job alone (exp.train's own path) and the three as one group, padded and padding-free, and the three
    beside a diverging fourth."""
    from exp.train import run

    out = tmp_path_factory.mktemp("group")
    groups = [
        _group_dirs([(out / f"group{i}", job) for i, job in enumerate(JOBS)]),
        _group_dirs([(out / f"group_flat{i}", job) for i, job in enumerate(JOBS)], common=COMMON + PADDING_FREE),
        _group_dirs([(out / f"mixed{i}", job) for i, job in enumerate([*JOBS, DIVERGING])]),
    ]
    # The group workers (processes, mostly imports) go on while this process trains the jobs alone.
    with ThreadPoolExecutor(max_workers=2) as pool:
        workers = [pool.submit(_run_group, dirs) for dirs in groups]
        for i, job in enumerate(JOBS):
            run(COMMON + job, output_dir=out / f"alone{i}")
            run(COMMON + PADDING_FREE + job, output_dir=out / f"alone_flat{i}")
        for worker in workers:
            worker.result()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("flat", ["", "_flat"], ids=["padded", "padding_free"])
@pytest.mark.parametrize("i", range(len(JOBS)))
def test_each_job_of_a_group_trains_as_it_would_alone(runs, i, flat):
    """Every training loss and every validation of a grouped job equals the same job run alone within 1e-5 (fp32, the
    4-bit CPU path): one forward of the base over every job's rows (padding-free: every job's examples end to end in
    one row), each adapter over its own part."""
    alone, grouped = runs / f"alone{flat}{i}", runs / f"group{flat}{i}"
    a, g = _losses(alone), _losses(grouped)
    assert sorted(a) == sorted(g) == [1, 2, 3, 4]
    for step in a:
        assert g[step] == pytest.approx(a[step], rel=1e-5), step
    sa, sg = _summary(alone), _summary(grouped)
    for when in ("initial_val", "final_val"):
        for k, v in sa[when].items():
            assert sg[when][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (when, k)
    assert sg["steps"] == sa["steps"] == 4
    assert sg["group"]["size"] == len(JOBS)
    if flat:  # the single run's padding: padding-free parts are laid end to end, not padded to each other
        assert sg["padding_fraction"] == pytest.approx(sa["padding_fraction"], abs=1e-4)


@pytest.mark.slow
def test_a_grouped_job_leaves_the_files_of_a_job_run_alone(runs):
    """The same run directory (less the best-by-val/loss checkpoint, which a group does not keep), the same CSV
    columns, and an adapter that plain PEFT loads onto the base, giving the single run's weights."""
    from peft import PeftModel
    from safetensors.torch import load_file

    alone, grouped = runs / "alone1", runs / "group1"
    names = {p.name for p in alone.iterdir()} - {".lock"}
    assert names <= {p.name for p in grouped.iterdir()}
    assert {p.name for p in (grouped / "checkpoints").iterdir()} >= {
        "last.ckpt",
        "step-000002.ckpt",
        "step-000004.ckpt",
    }
    assert set(_rows(alone)[0]) == set(_rows(grouped)[0])
    assert json.loads((grouped / "status.json").read_text())["status"] == "completed"
    # The group's start, which no job's summary holds, is in each job's train.log.
    start = re.search(r"group process: ([\d.]+) s since it started, ([\d.]+) s of it the configs and preflights",
                      (grouped / "train.log").read_text())  # fmt: skip
    assert start and float(start[1]) >= float(start[2]) > 0
    a = load_file(alone / "adapter" / "adapter_model.safetensors")
    g = load_file(grouped / "adapter" / "adapter_model.safetensors")
    assert sorted(a) == sorted(g)
    # A layer serving several adapters runs them as one stacked product (exp.model.adapters.RowRouter), whose sums
    # run in another order than a run alone's: the gradients agree to fp32 rounding (a few 1e-7 of their norm), and
    # the weights to the losses' 1e-5, except for the rare element whose gradient is about AdamW's eps (1e-8), there
    # a cancellation that the order decides, which the first steps' update lr * g / (|g| + eps) turns into a share
    # of one step at the learning rate (measured: 21 of 7168 elements beyond 1e-5, the largest 1.1e-4).
    off = sum(int((g[k] - a[k]).abs().gt(1e-5).sum()) for k in a)
    assert off <= 0.01 * sum(a[k].numel() for k in a)
    for k in a:
        torch.testing.assert_close(g[k], a[k], rtol=1e-4, atol=0.05 * 1e-2)  # 5% of one step at lr 1e-2
    from exp.model.build import build_tokenizer, load_base_model

    cfg = compose_typed(COMMON + JOBS[1])
    base = load_base_model(cfg, torch.device("cpu"))
    model = PeftModel.from_pretrained(base, grouped / "adapter")
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(g)
    assert build_tokenizer(cfg.model) is not None


@pytest.mark.slow
def test_a_diverging_job_fails_alone_and_the_others_go_on(runs):
    """The job whose loss turns NaN is `failed` with the reason (no adapter); the others complete with the losses
    they have alone."""
    bad = runs / f"mixed{len(JOBS)}"
    status = json.loads((bad / "status.json").read_text())
    assert status["status"] == "failed"
    assert "NaN/Inf" in status["error"] and "left its group" in status["error"]
    assert not (bad / "adapter").exists()
    for i in range(len(JOBS)):
        good = runs / f"mixed{i}"
        assert json.loads((good / "status.json").read_text())["status"] == "completed"
        a, g = _losses(runs / f"alone{i}"), _losses(good)
        for step in a:
            assert g[step] == pytest.approx(a[step], rel=1e-5), (i, step)
        assert _summary(good)["final_val"]["val/loss"] == pytest.approx(
            _summary(runs / f"alone{i}")["final_val"]["val/loss"], rel=1e-5
        )


@pytest.mark.slow
def test_a_killed_group_continues_bitwise(tmp_path):
    """SIGKILL after the step-2 checkpoints; the same group again with trainer.resume=auto continues every job from
    its own checkpoint (weights, optimiser, schedule, data position, dropout generator) to the adapters of the
    uninterrupted group, bit for bit."""
    from safetensors.torch import load_file

    jobs = [[*JOBS[0], "lora.dropout=0.1"], JOBS[1]]
    uninterrupted = _group_dirs([(tmp_path / "u" / f"job{i}", j) for i, j in enumerate(jobs)])
    killed = _group_dirs([(tmp_path / "k" / f"job{i}", j) for i, j in enumerate(jobs)])
    _, rc = _groups_side_by_side((uninterrupted, None), (killed, "step-000002.ckpt"))
    assert rc == -signal.SIGKILL
    _group([(tmp_path / "k" / f"job{i}", [*j, "trainer.resume=auto"]) for i, j in enumerate(jobs)])
    for i in range(len(jobs)):
        resumed = tmp_path / "k" / f"job{i}_1"
        record = json.loads((resumed / "resume.json").read_text())
        assert record["run"] == str(tmp_path / "k" / f"job{i}") and record["step"] >= 2
        u = load_file(tmp_path / "u" / f"job{i}" / "adapter" / "adapter_model.safetensors")
        r = load_file(resumed / "adapter" / "adapter_model.safetensors")
        assert all(torch.equal(u[k], r[k]) for k in u)
        assert _summary(resumed)["final_val"] == _summary(tmp_path / "u" / f"job{i}")["final_val"]


@pytest.mark.slow
def test_a_job_continued_beside_a_fresh_one_reaches_its_result_within_rounding(tmp_path):
    """A kill between two jobs' saves leaves them a step apart: the first continues from step 2 beside the second
    starting afresh, whose rows pad its steps differently, and still reaches the uninterrupted adapters within float
    rounding."""
    from safetensors.torch import load_file

    uninterrupted = _group_dirs([(tmp_path / "u" / f"job{i}", j) for i, j in enumerate(JOBS[:2])])
    killed = _group_dirs([(tmp_path / "k" / "job0", JOBS[0])])
    assert _groups_side_by_side((uninterrupted, None), (killed, "step-000002.ckpt"))[1] == -signal.SIGKILL
    _group([(tmp_path / "k" / "job0", [*JOBS[0], "trainer.resume=auto"]), (tmp_path / "k" / "job1", JOBS[1])])
    assert json.loads((tmp_path / "k" / "job0_1" / "resume.json").read_text())["step"] >= 2
    u = load_file(tmp_path / "u" / "job0" / "adapter" / "adapter_model.safetensors")
    r = load_file(tmp_path / "k" / "job0_1" / "adapter" / "adapter_model.safetensors")
    for k in u:
        torch.testing.assert_close(r[k], u[k], rtol=1e-4, atol=1e-6)
    assert not all(torch.equal(u[k], r[k]) for k in u)  # different neighbours: the same result, not the same bits


@pytest.mark.slow
def test_a_single_run_refuses_a_groups_checkpoint(runs, tmp_path):
    """A group's checkpoint holds no Lightning loop state: continuing it alone stops with a message saying how to
    continue it."""
    from exp.train import run

    with pytest.raises(ConfigError, match="share_base=true"):
        run(COMMON + JOBS[0] + [f"trainer.resume={runs / 'group0'}"], output_dir=tmp_path / "alone")


def test_a_group_probes_the_gpu_once_started_before_torch_loads(tmp_path, monkeypatch):
    """The preflight's CUDA probe (a fresh Python that initialises CUDA: seconds) starts before the group's process
    imports torch, and serves both of the group's preflights (the job alone, then every job's rows together)."""
    from exp.study import group_worker

    dirs = _group_dirs([(tmp_path / f"j{i}", JOBS[i]) for i in range(3)])
    script = (
        "import sys\n"
        "import exp.study.group_worker as g\n"
        "def probe(accelerator, quant_type):\n"
        "    print('torch' in sys.modules, accelerator, quant_type)\n"
        "    sys.exit(0)\n"
        "g.start_probe = probe\n"
        f"g.main([__import__('pathlib').Path({dirs[0]!r})])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["False", "cpu", "nf4"], out.stderr[-2000:]
    probes = []
    probe = group_worker.probe_environment
    monkeypatch.setattr(group_worker, "probe_environment", lambda **kw: probes.append(kw) or probe(**kw))
    shared, members = group_worker.plan_group([Path(d) for d in dirs])
    assert len(members) == 3 and len(probes) == 1


def test_jobs_group_by_what_their_base_depends_on():
    """Adapter, optimiser, schedule, seeds and logging may differ inside a group; the model, data shape and
    hardware may not; several devices and modules_to_save run alone."""
    base = compose_typed(["hardware=cpu"])
    same = [
        compose_typed(["hardware=cpu", o])
        for o in ["lora.r=32", "trainer.learning_rate=1e-3", "trainer.seed=3", "data.seed=2", "lora.dropout=0.2"]
    ]
    assert all(base_key(c) == base_key(base) for c in same)
    other = [compose_typed(["hardware=cpu", o]) for o in ["data.max_seq_len=64", "hardware.micro_batch_size=4"]]
    assert all(base_key(c) != base_key(base) for c in other)
    assert why_alone(base) is None
    assert "one device" in why_alone(compose_typed(["hardware=ddp", "hardware.accelerator=cpu", "hardware.devices=2"]))
    assert "modules_to_save" in why_alone(compose_typed(["hardware=cpu", "lora.modules_to_save=[lm_head]"]))
    assert why_alone(compose_typed(["hardware=cpu", "trainer.resume=auto"])) is None  # a group continues its jobs
    # LoRA variants: what the row router's plain products or one optimiser per job cannot express runs alone.
    for variant, reason in [("lora=dora", "use_dora"), ("lora=pissa", "lora.init=pissa"),
                            ("lora.plus_lr_ratio=16", "plus_lr_ratio")]:  # fmt: skip
        assert reason in why_alone(compose_typed(["hardware=cpu", variant]))
    assert why_alone(compose_typed(["hardware=cpu", "lora=rslora", "+lora.rank_pattern.q_proj=4"])) is None
    assert "objective=dpo" in why_alone(compose_typed(["hardware=cpu", "objective=dpo"]))
    jobs = [("a", base), ("b", same[0]), ("c", other[0]), ("d", same[1])]
    groups = group_jobs(jobs, cfg_of=lambda j: j[1], name_of=lambda j: j[0])
    assert [g.names for g in groups] == [["a", "b", "d"], ["c"]]
    assert [g.names for g in group_jobs(jobs, lambda j: j[1], lambda j: j[0], max_size=2)] == [
        ["a", "b"],
        ["c"],
        ["d"],
    ]
    shared = shared_config([base, same[0]])
    assert shared.hardware.micro_batch_size == 2 * base.hardware.micro_batch_size
    assert shared.lora.r == 8 + 32 and shared.hardware.compile is False and shared.hardware.padding_free is False


def test_a_groups_estimate_counts_every_jobs_adapter_state():
    """Eight Gemma-7B-shape jobs of rank 16 on every projection: their adapters' weights, gradients and AdamW state
    are eight times one job's, and the group's estimate holds them all (plus the stacked products' activations)."""
    from exp.hardware.memory import config_arch, estimate_for_config, lora_param_count

    jobs = [compose_typed(["model=gemma_7b", "hardware=cpu", "lora.r=16", f"trainer.seed={s}"]) for s in range(8)]
    jobs[0].lora.rank_pattern = {"q_proj": 32}
    alone, group = estimate_for_config(jobs[0]), estimate_for_config(shared_config(jobs))
    one = lora_param_count(config_arch(jobs[0]), 16, jobs[0].lora.target_modules)
    # fp32 weights, gradients and two AdamW moments of the seven other jobs at least.
    assert group.total - alone.total >= 7 * one * 16
    assert shared_config(jobs).lora.r == 32 + 7 * 16
    # Jobs on different projections: the estimate's adapter covers each job's, in the order they come.
    jobs[1].lora.target_modules = ["k_proj", "o_proj"]
    assert shared_config(jobs).lora.target_modules == ["q_proj", "v_proj", "k_proj", "o_proj"]


def test_a_bad_precision_for_a_group_is_refused():
    from exp.study.group_fit import _autocast

    with pytest.raises(ConfigError, match="16-mixed"):
        _autocast(torch.device("cpu"), "16-mixed")


SHARED = ["exp.train", "-m", "hydra/launcher=gpus", "hydra.launcher.devices=[0]", "hydra.launcher.share_base=true"]
GRID = ["hardware=cpu", "lora.r=2,4", "trainer.learning_rate=5e-3,1e-2", *FAST]


def _exp(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True)


def test_plan_shows_the_groups_and_splits_what_does_not_fit(tmp_path):
    """--plan lists each group with its estimate; with less memory than a group of four needs, the groups halve."""
    whole = _exp([*SHARED, *GRID, "hydra.sweep.dir=sw", "--plan"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert "jobs 0, 1, 2, 3: one base" in whole.stdout
    small = _exp([*SHARED, "hydra.launcher.memory_gib=[0.7]", *GRID, "hydra.sweep.dir=sw", "--plan"], tmp_path)
    assert small.returncode == 0, small.stderr[-2000:]
    groups = [line for line in small.stdout.splitlines() if ": one base" in line]
    assert [line.split(":")[0].strip() for line in groups] == ["jobs 0, 1", "jobs 2, 3"]
    assert all(float(line.split("reserve ")[1].split(" GiB")[0]) <= 0.7 for line in groups)
    assert not (tmp_path / "sw").exists()


@pytest.mark.slow
def test_the_gpus_launcher_trains_a_study_as_one_group(tmp_path):
    """One process trains the four jobs; each has its run directory, status and metrics; the journal records one
    start for the group and an end per job; the report reads the study; a re-launch reuses every job."""
    first = _exp([*SHARED, *GRID, "hydra.sweep.dir=sw"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    sweep = tmp_path / "sw"
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "config.yaml").exists())
    assert len(jobs) == 4
    for job in jobs:
        assert json.loads((job / "status.json").read_text())["status"] == "completed"
        assert _summary(job)["group"]["size"] == 4
    events = [json.loads(line) for line in (sweep / "placements.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 1 and len(starts[0]["group"]) == 4
    assert sum(e["event"] == "end" for e in events) == 4
    report = _exp(["exp.report", "sw"], tmp_path)
    assert report.returncode == 0, report.stderr[-2000:]
    assert report.stdout.count("completed") >= 4
    # exp.evaluate reloads a grouped job's adapter alone onto the base and scores its split as the run did.
    evaluated = _exp(["exp.evaluate", f"run={jobs[0]}"], tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    scored = json.loads((jobs[0] / "eval.json").read_text())["loss"]
    assert scored == pytest.approx(_summary(jobs[0])["final_val"]["val/loss"], rel=1e-5)
    again = _exp([*SHARED, *GRID, "hydra.sweep.dir=sw"], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (again.stdout + again.stderr).count("already completed with this config") == 4
    events = [json.loads(line) for line in (sweep / "placements.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "start" for e in events) == 1  # nothing started the second time


@pytest.mark.slow
def test_the_gpu_configuration_on_the_cpu_groups_as_alone(tmp_path):
    """CPU twin of `hardware=gpu` (padding-free alone, two micro-batches a step, compiled as on a GPU): the group
    trains padded rows, and weights each job's micro-batches by their loss tokens as the padding-free run does, so
    every validation agrees within 1e-5. Alone, each job compiles its whole decoder layers; the group compiles the
    parts of its layers without adapters (exp.model.build.compile_adapter_free_parts). (train/loss is the step's last
    micro-batch, and padding-free rows cut a step's examples into other micro-batches: that display value differs,
    the step's gradient does not.)"""
    from exp.train import run

    twin = ["hardware=gpu", "hardware.accelerator=cpu", "trainer.global_batch_size=8", "hardware.micro_batch_size=4",
            "hardware.compile=true"]  # fmt: skip
    jobs = [[*twin, *JOBS[0]], [*twin, *JOBS[1]]]
    group = _group_dirs([(tmp_path / f"group{i}", job) for i, job in enumerate(jobs)])
    with ThreadPoolExecutor(max_workers=1) as pool:  # the group's process goes on while this one trains them alone
        worker = pool.submit(_run_group, group)
        for i, job in enumerate(jobs):
            run(COMMON + job, output_dir=tmp_path / f"alone{i}")
        worker.result()
    for i in range(len(jobs)):
        a, g = _val_losses(tmp_path / f"alone{i}"), _val_losses(tmp_path / f"group{i}")
        assert sorted(a) == sorted(g) == [0, 2, 4]
        for step in a:
            assert g[step] == pytest.approx(a[step], rel=1e-5), (i, step)
        assert _summary(tmp_path / f"group{i}")["final_val"]["val/loss"] == pytest.approx(
            _summary(tmp_path / f"alone{i}")["final_val"]["val/loss"], rel=1e-5
        )
        assert _summary(tmp_path / f"group{i}")["compile"]["graphs"] >= 1  # compiled, not run eagerly
        train_log = (tmp_path / f"group{i}" / "train.log").read_text()
        # The MLP and the norms hold no adapter (LoRA on q_proj and v_proj); the attention's projections stay eager.
        assert "compiled in every decoder layer: mlp, input_layernorm, post_attention_layernorm " in train_log


@pytest.mark.slow
def test_each_job_of_a_group_has_its_own_tracker_runs(tmp_path, monkeypatch):
    """W&B (offline without credentials, the default logger), TensorBoard and MLflow: one run per job, in the job's
    own directory, several open at once in the group's process, each with its job's metrics."""
    for k in [k for k in os.environ if k.startswith("WANDB")]:
        monkeypatch.delenv(k)
    jobs = [["lora.r=2"], ["lora.r=4", "trainer.seed=1"]]
    common = [o for o in COMMON if o != "logger=csv"] + ["logger=[wandb,tensorboard,mlflow]"]
    dirs = []
    for i, job in enumerate(jobs):
        run_dir = claim_run_dir(tmp_path / f"job{i}")
        write_run_config(compose_config(common + job), run_dir)
        release_run(run_dir)
        dirs.append(run_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "exp.study.group_worker", *map(str, dirs)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = [sorted(p.name for p in (d / "wandb").glob("offline-run-*")) for d in dirs]
    assert all(len(r) == 1 for r in runs), runs
    assert runs[0][0].rsplit("-", 1)[1] != runs[1][0].rsplit("-", 1)[1]  # two W&B run ids
    from test_trackers import csv_metrics, mlflow_metrics, mlflow_runs, tensorboard_metrics

    for d, job in zip(dirs, jobs, strict=True):
        expected = csv_metrics(d)
        client, [run] = mlflow_runs(d / "mlruns")
        assert run.info.status == "FINISHED" and f"lora.r={run.data.params['lora.r']}" == job[0]
        assert {k: dict(v) for k, v in mlflow_metrics(client, run.info.run_id).items()} == expected
        tb = tensorboard_metrics(d / "tensorboard")
        assert set(tb) == set(expected)
        for name, points in expected.items():
            assert tb[name] == pytest.approx(points, rel=1e-6), name


def test_plan_reads_each_jobs_seed_interpolation_unresolved():
    """`seeds=2` adds lora.init_seed=${trainer.seed}: --plan gives each job its own init seed, as the launch does
    (resolved against the master config, every job planned init_seed 0 and a re-launch's plan saw a conflict)."""
    from hydra._internal.utils import get_args_parser
    from hydra.types import RunMode

    import exp.train
    from exp.run.overrides import config_loader, expand_seeds
    from exp.study.plan import job_configs, sweep_overrides

    argv, problems = expand_seeds(["-m", "seeds=2", "hardware=cpu", "hydra.sweep.dir=sw"])
    assert not problems
    args, _ = get_args_parser().parse_known_args(argv)
    loader = config_loader(args, exp.train.__file__, str(exp.train.CONF_DIR))
    master = loader.load_configuration(
        config_name="train", overrides=args.overrides, run_mode=RunMode.MULTIRUN, from_shell=True
    )
    jobs = job_configs(master, loader, sweep_overrides(master, loader))
    assert [(cfg.trainer.seed, cfg.lora.init_seed) for _, _, cfg, _ in jobs] == [(0, 0), (1, 1)]
