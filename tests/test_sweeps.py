"""Multirun studies on the CPU: failures recorded and counted, re-launch skips, isolated jobs, Optuna, submitit,
the report, and the manifest every run leaves."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
from conftest import Together

from exp.study.records import job_groups

ROOT = Path(__file__).resolve().parents[1]
FAST = [
    "trainer.max_steps=3",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=3",
    "trainer.log_every_n_steps=1",
    "data.num_examples=120",
    "trainer.sample_count=0",  # no test here reads the samples: 2 s less per job
    "logger=csv",
]


def exp(
    args: list[str], cwd: Path, timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, HYDRA_FULL_ERROR="0", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def sweep_and_relaunch(cwd: Path):
    """Three jobs, the third made to fail (a target module that does not exist), then the same sweep again, then
    another study into its directory."""
    args = [
        "exp.train",
        "-m",
        "lora.target_modules=[q_proj,v_proj],[v_proj],[q_proj,nope_proj]",
        *FAST,
        "hydra.sweep.dir=study",
        "hydra.job.config.override_dirname.exclude_keys=[" + ",".join(a.split("=")[0] for a in FAST) + "]",
    ]
    first = exp(args, cwd)
    adapters = sorted((cwd / "study").glob("*/adapter/adapter_model.safetensors"))
    stamps = {p: p.stat().st_mtime_ns for p in adapters}
    second = exp(args, cwd)
    # A second study into the same directory, afterwards: other swept keys, the same fixed settings.
    before = _files(cwd / "study")
    other = [a if not a.startswith("lora.target_modules=") else "trainer.learning_rate=1e-3,2e-3" for a in args]
    third = (exp(other, cwd), before, _files(cwd / "study"))
    return cwd / "study", first, second, stamps, third


def path_sweep_and_relaunch(cwd: Path):
    """A sweep whose overrides hold a relative data path (`data.path=data/x/y/a.json`): Hydra's job names nest
    (`0_data.path=data/x/y/a.json,...` is `0_data.path=data` / `x` / `y` / `a.json,...`). Two jobs, the second made
    to fail; its report; the same sweep again."""
    (cwd / "data" / "x" / "y").mkdir(parents=True)
    rows = [{"instruction": f"Add {i} and {i + 1}.", "input": "", "output": str(2 * i + 1)} for i in range(60)]
    (cwd / "data" / "x" / "y" / "a.json").write_text(json.dumps(rows))
    args = ["exp.train", "-m", "data=alpaca", "data.path=data/x/y/a.json", "lora.target_modules=[q_proj],[nope_proj]",
            *FAST[:-3], "trainer.sample_count=0", "logger=csv", "hydra.sweep.dir=study",
            "hydra.job.config.override_dirname.exclude_keys=[" + ",".join(a.split("=")[0] for a in FAST) + "]"]  # fmt: skip
    first = exp(args, cwd)
    report = exp(["exp.report", "study"], cwd)
    second = exp(args, cwd)
    return cwd / "study", first, report, second


def isolated_jobs(cwd: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """Two identical jobs in one sweep, W&B, TensorBoard and MLflow on."""
    trackers = "logger=[wandb,tensorboard,mlflow]"
    return cwd, exp(["exp.train", "-m", "trainer.seed=0,0", *FAST[:-1], trackers, "hydra.sweep.dir=iso"], cwd)


OPTUNA = ["exp.train", "-m", "--config-dir", str(ROOT / "sweeps"), "--config-name", "optuna_lr_rank"]


def optuna_and_relaunches(cwd: Path):
    """The shipped Optuna study, 2 trials of 3 steps, in `opt/`; then re-launched with other settings (job 0 asked
    for another config) and with the same ones, the files before and after each re-launch."""
    args = [*OPTUNA, "hydra.sweeper.n_trials=2", *FAST, "hydra.sweep.dir=opt"]
    first = exp(args, cwd)
    if first.returncode != 0:
        return first, None, None, None
    # What the study found, read before the re-launches.
    found = (
        (cwd / "opt" / "optimization_results.yaml").read_text(),
        [json.loads(p.read_text())["final_val"]["val/loss"] for p in (cwd / "opt").glob("*/summary.json")],
    )
    before = _files(cwd)
    other = exp([*args, "trainer.max_steps=4", "lora.alpha=16"], cwd)
    other = (other, before, _files(cwd), sorted(p.name for p in (cwd / "opt").iterdir()))
    results = (cwd / "opt" / "optimization_results.yaml").read_text()
    before = _files(cwd, but=("train.log", "optimization_results.yaml"))
    same = exp(args, cwd)
    after = _files(cwd, but=("train.log", "optimization_results.yaml"))
    same = (same, before, after, results, (cwd / "opt" / "optimization_results.yaml").read_text())
    return first, found, other, same


def grid_file_sweep(cwd: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """The shipped grid file, narrowed to one job."""
    args = ["--config-dir", str(ROOT / "sweeps"), "--config-name", "lora_rank_grid", "lora.r=4"]
    return cwd, exp(["exp.train", "-m", *args, "trainer.learning_rate=5e-3", *FAST, "hydra.sweep.dir=grid"], cwd)


def submitit_sweep(cwd: Path) -> tuple[Path, subprocess.CompletedProcess]:
    args = ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", "lora.r=4,8"]
    return cwd, exp(["exp.train", "-m", *args, *FAST, "hydra.sweep.dir=sub"], cwd)


def gpus_sweep_and_relaunches(cwd: Path):
    """Two jobs on two named devices (their manifests, read then); the same launch again; once more with job 1's
    record changed (as if a config default had changed since), the files before and after that last launch."""
    args = ["exp.train", "-m", "hydra/launcher=gpus", "hydra.launcher.devices=[0,1]", "lora.r=4,8", *FAST]
    args.append("hydra.sweep.dir=gp")
    env = {"OMP_NUM_THREADS": "1"}  # two jobs share this machine's cores
    first = exp(args, cwd, env=env)
    if first.returncode != 0:
        return first, None, None, None
    manifests = [json.loads(p.read_text()) for p in sorted((cwd / "gp").glob("*/manifest.json"))]
    again = exp(args, cwd, env=env)
    record = next((cwd / "gp").glob("1_*/sweep_job.json"))
    job = json.loads(record.read_text())
    job["config"]["trainer"]["seed"], job["fingerprint"] = 7, "0" * 64
    record.write_text(json.dumps(job))
    before = _files(cwd)
    refused = exp(args, cwd, env=env)
    return first, manifests, again, (refused, before, _files(cwd))


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """Every launch of this module, each in a directory of its own; a sweep and its re-launches are one step."""
    functions = {
        "sweep": sweep_and_relaunch,
        "isolated": isolated_jobs,
        "optuna": optuna_and_relaunches,
        "grid": grid_file_sweep,
        "submitit": submitit_sweep,
        "gpus": gpus_sweep_and_relaunches,
        "paths": path_sweep_and_relaunch,
    }
    # The directories are made here, in pytest's thread: the steps' threads only run commands in them.
    steps = {name: partial(f, tmp_path_factory.mktemp(name)) for name, f in functions.items()}
    uses = {
        "sweep": [
            "test_failed_job_is_recorded_and_counted_and_the_sweep_goes_on",
            "test_relaunch_skips_completed_jobs_and_keeps_their_files",
            "test_report_matches_the_jobs_own_files",
            "test_report_shows_a_running_job",
            "test_report_of_one_run_goes_into_that_run_never_the_current_directory",
            "test_a_second_study_launched_afterwards_is_refused_and_changes_nothing",
        ],
        "isolated": ["test_jobs_are_isolated"],
        "optuna": [
            "test_optuna_sweep_minimises_the_returned_metric",
            "test_a_relaunched_study_with_other_settings_is_refused_and_changes_nothing",
            "test_a_relaunched_study_with_the_same_settings_reuses_every_trial",
        ],
        "grid": ["test_grid_sweep_file_composes_and_runs"],
        "submitit": ["test_submitit_local_launcher_runs_jobs"],
        "gpus": ["test_gpu_launcher_gives_each_parallel_job_its_own_device"],
        "paths": ["test_jobs_whose_overrides_hold_a_path_are_found_counted_reported_and_skipped"],
    }
    with Together(request, steps, uses) as together:
        yield together


@pytest.fixture
def sweep(launches):
    return launches.get("sweep")


@pytest.mark.slow
def test_failed_job_is_recorded_and_counted_and_the_sweep_goes_on(sweep):
    study, first, *_ = sweep
    assert first.returncode == 1, first.stderr[-3000:]  # one job failed
    groups = job_groups(study)
    status = {job.split("_", 1)[0]: json.loads((dirs[0] / "status.json").read_text()) for job, dirs in groups.items()}
    assert [status[k]["status"] for k in ("0", "1", "2")] == ["completed", "completed", "failed"]
    assert "nope_proj" in status["2"]["error"] and "Allowed" in status["2"]["error"]
    assert "1 failed" in first.stdout + first.stderr


@pytest.mark.slow
def test_jobs_whose_overrides_hold_a_path_are_found_counted_reported_and_skipped(launches):
    """Each job's directory is nested under its number's: the sweep's count, its exit status, exp.report and the
    re-launch's skip find every job there, named by its path under the sweep directory."""
    study, first, report, second = launches.get("paths")
    assert first.returncode == 1, first.stderr[-3000:]  # one job failed
    assert "2 job(s), 1 completed, 1 failed" in first.stdout + first.stderr
    groups = job_groups(study)
    assert sorted(groups) == [
        "0_data.path=data/x/y/a.json,data=alpaca,lora.target_modules=[q_proj]",
        "1_data.path=data/x/y/a.json,data=alpaca,lora.target_modules=[nope_proj]",
    ]
    assert [json.loads((d[0] / "status.json").read_text())["status"] for _, d in sorted(groups.items())] == [
        "completed",
        "failed",
    ]
    assert report.returncode == 0, report.stderr[-3000:]
    rows = [line.split()[:2] for line in report.stdout.splitlines()[1:3]]
    assert rows == [["0", "completed"], ["1", "failed"]]
    # The completed job's step time reaches the launchers' plans of later studies.
    from exp.study.cost import find_records

    assert [r.source for r in find_records([study]) if "/0_data.path=data/" in r.source] == [
        str(groups["0_data.path=data/x/y/a.json,data=alpaca,lora.target_modules=[q_proj]"][0].resolve())
    ]
    assert (second.stdout + second.stderr).count("already completed with this config, skipped") == 1
    assert second.returncode == 1
    assert len(job_groups(study)["1_data.path=data/x/y/a.json,data=alpaca,lora.target_modules=[nope_proj]"]) == 2


@pytest.mark.slow
def test_relaunch_skips_completed_jobs_and_keeps_their_files(sweep):
    study, _, second, stamps, _ = sweep
    assert second.returncode == 1
    assert (second.stdout + second.stderr).count("already completed with this config, skipped") == 2
    assert stamps and all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    failed_job = next(dirs for job, dirs in job_groups(study).items() if job.startswith("2_"))
    assert len(failed_job) == 2  # the retry ran in its own directory; the first attempt's files are kept


@pytest.mark.slow
def test_a_second_study_launched_afterwards_is_refused_and_changes_nothing(sweep):
    study, *_, (proc, before, after) = sweep
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr.split("exp: error: ", 1)[1]
    assert message.startswith("hydra.sweep.dir=study already holds another study, 3 job(s) of other settings")
    assert (
        "(lora.target_modules: swept there, " in message
        and "; trainer.learning_rate: 0.005 there, swept now)" in message
    )
    assert "Fix: give this study its own directory, hydra.sweep.dir=study_2" in message
    assert after == before and not (study.parent / "study_2").exists()


@pytest.mark.slow
def test_report_matches_the_jobs_own_files(sweep):
    study, *_ = sweep
    proc = exp(["exp.report", str(study)], study.parent)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader((study / "report.csv").open()))
    assert [r["status"] for r in rows] == ["completed", "completed", "failed", "failed"]
    for r in rows[:2]:
        job = next(d for d in study.iterdir() if d.name.startswith(r["job"] + "_"))
        summary = json.loads((job / "summary.json").read_text())
        assert float(r["final val/loss"]) == pytest.approx(summary["final_val"]["val/loss"], rel=1e-3)
        assert int(r["steps"]) == summary["steps"] == 3
    assert rows[0]["final val/loss"] <= rows[1]["final val/loss"]  # sorted by the metric
    png = study / "loss_curves.png"
    assert png.exists() and png.stat().st_size > 5000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (study / "val_loss_vs_lora.target_modules.png").exists()
    assert "lora.target_modules" in (study / "report.md").read_text()


@pytest.mark.slow
def test_report_shows_a_running_job(tmp_path, sweep):
    study, *_ = sweep
    running = tmp_path / "study"
    (running / "0_x").mkdir(parents=True)
    (running / "0_x" / ".hydra").mkdir()
    proc = exp(["exp.report", str(running)], tmp_path)
    assert proc.returncode == 0 and "running" in proc.stdout


@pytest.mark.slow
def test_report_of_one_run_goes_into_that_run_never_the_current_directory(tmp_path, sweep, monkeypatch):
    from exp.report import main

    study, *_ = sweep
    run = shutil.copytree(next(d for d in study.iterdir() if d.name.startswith("0_")), tmp_path / "run")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main([str(run)]) == 0
    assert (run / "report.md").exists() and (run / "report.csv").exists() and (run / "loss_curves.png").exists()
    assert list((tmp_path / "here").iterdir()) == []
    assert main([str(run), str(study)]) == 2  # several paths: no directory of their own, --out is required
    assert list((tmp_path / "here").iterdir()) == []


@pytest.mark.slow
def test_jobs_are_isolated(launches):
    """Two identical jobs: a leak of any state from the first (RNG, W&B run, model, globals) would change the second."""
    tmp_path, proc = launches.get("isolated")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted((tmp_path / "iso").glob("*/summary.json"))
    assert len(jobs) == 2
    a, b = (json.loads(p.read_text()) for p in jobs)
    assert a["final_val"] == b["final_val"] and a["initial_val"] == b["initial_val"]
    runs = [next((p.parent / "wandb").glob("offline-run-*")).name for p in jobs]
    assert runs[0] != runs[1]  # each job its own W&B run
    # ... its own TensorBoard events and MLflow store, in its run directory, with the same final loss as its CSV.
    from test_trackers import csv_metrics, mlflow_metrics, mlflow_runs, tensorboard_metrics

    mlflow_ids = []
    for job in (p.parent for p in jobs):
        final = csv_metrics(job)["val/loss"][3]
        assert tensorboard_metrics(job / "tensorboard")["val/loss"][3] == pytest.approx(final, rel=1e-6)
        client, [run] = mlflow_runs(job / "mlruns")
        assert dict(mlflow_metrics(client, run.info.run_id)["val/loss"])[3] == final
        mlflow_ids.append(run.info.run_id)
    assert mlflow_ids[0] != mlflow_ids[1]
    first_log = (jobs[0].parent / "train.log").read_text()
    assert str(jobs[1].parent) not in first_log


def _files(root: Path, but: tuple[str, ...] = ()) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in but
    }


@pytest.mark.slow
def test_optuna_sweep_minimises_the_returned_metric(launches):
    proc, found, _, _ = launches.get("optuna")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from omegaconf import OmegaConf

    text, finals = found
    result = OmegaConf.create(text)
    assert len(finals) == 2 and result.best_value == pytest.approx(min(finals))
    assert set(result.best_params) == {"trainer.learning_rate", "lora.r", "lora.alpha", "lora.dropout"}


@pytest.mark.slow
def test_a_relaunched_study_with_other_settings_is_refused_and_changes_nothing(launches):
    """Job 0 of the re-launch is asked for other settings: reusing opt/0 would report its results for them."""
    first, _, other, _ = launches.get("optuna")
    assert first.returncode == 0, first.stderr[-3000:]
    proc, before, after, names = other
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr.split("exp: error: ", 1)[1]
    assert message.startswith("hydra.sweep.dir=opt already holds another study, 2 job(s) of other settings")
    assert "lora.alpha: swept there, 16 now" in message and "trainer.max_steps: 3 there, 4 now" in message
    assert "Fix: give this study its own directory, hydra.sweep.dir=opt_2" in message
    assert "Traceback" not in proc.stderr and "Best value" not in proc.stdout + proc.stderr
    assert after == before  # optimization_results.yaml, every job's files and records: as they were
    assert names == [".lock", "0", "1", "optimization_results.yaml", "study.json"]


@pytest.mark.slow
def test_a_relaunched_study_with_the_same_settings_reuses_every_trial(launches):
    first, _, _, same = launches.get("optuna")
    assert first.returncode == 0, first.stderr[-3000:]
    proc, before, after, results, results_after = same
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count("already completed with this config, skipped") == 2
    assert after == before
    assert results_after == results  # the same study, the same best


def test_a_job_fingerprint_leaves_out_names_and_nothing_that_changes_results(tmp_path):
    from conftest import compose_typed

    from exp.core.config import ConfigError
    from exp.run.compose import config_dict
    from exp.run.dirs import write_status
    from exp.study.records import SweepConflict, earlier_result, fingerprint, record_job

    base = config_dict(compose_typed([]))
    renamed = config_dict(compose_typed(["logger.group=elsewhere", "logger.run_name=x", "trainer.resume=auto"]))
    assert fingerprint(renamed) == fingerprint(base)
    for changed in (["hardware.micro_batch_size=4"], ["trainer.max_steps=40"], ["data.seed=1"]):
        assert fingerprint(config_dict(compose_typed(changed))) != fingerprint(base), changed
    job = tmp_path / "sweep" / "0"
    job.mkdir(parents=True)
    record_job(job, base)
    write_status(job, "failed")
    assert earlier_result(job, renamed, job.parent) is None  # failed with this config: it runs again
    (job.parent / "0_1").mkdir()
    record_job(job.parent / "0_1", base)
    write_status(job.parent / "0_1", "completed")
    assert earlier_result(job, renamed, job.parent) == job.parent / "0_1"
    other = config_dict(compose_typed(["lora.r=16"]))
    with pytest.raises(SweepConflict, match="lora.r: 8 there, 16 now") as e:
        earlier_result(job, other, job.parent)
    assert isinstance(e.value, ConfigError)


TRAIN_PY = str(ROOT / "src" / "exp" / "train.py")


def claim(argv: list[str]) -> list[str]:
    """`claim_study` as `python -m exp.train` calls it before Hydra starts."""
    from exp.run.compose import CONF_DIR
    from exp.study.claim import claim_study

    return claim_study(argv, TRAIN_PY, str(CONF_DIR), "train")


def study_with_a_job(tmp_path: Path, argv: list[str]) -> Path:
    """The sweep directory `S` that the launch `argv` claimed, with one completed job; the claim released."""
    from exp.run.dirs import write_status
    from exp.study.claim import release_studies

    assert claim(argv)[-1] == 'hydra.sweep.dir="S"'
    job = tmp_path / "S" / "0_lora.r=4"
    job.mkdir()
    (job / "sweep_job.json").write_text("{}")
    write_status(job, "completed")
    release_studies()  # a directory holding a job stays
    return tmp_path / "S"


def test_a_second_study_in_a_sweep_dir_is_refused_and_the_same_one_resumes(tmp_path, monkeypatch):
    """The first study's jobs are never mixed with another's: other fixed settings or other swept keys are refused,
    before anything is written; more values of the same keys extend the study."""
    from exp.core.config import ConfigError
    from exp.study.claim import release_studies

    monkeypatch.chdir(tmp_path)
    first = ["-m", "lora.r=4,8", "trainer.max_steps=3", "hydra.sweep.dir=S"]
    study = study_with_a_job(tmp_path, first)
    before = _files(study)
    others = {
        "another fixed value": (
            ["-m", "lora.r=4,8", "trainer.max_steps=40", "hydra.sweep.dir=S"],
            "trainer.max_steps: 3 there, 40 now",
        ),
        "another swept key": (
            ["-m", "trainer.learning_rate=1e-3,2e-3", "trainer.max_steps=3", "hydra.sweep.dir=S"],
            "lora.r: swept there, 8 now; trainer.learning_rate: 0.005 there, swept now",
        ),
        "one more swept key": (
            ["-m", "lora.r=4,8", "lora.alpha=8,16", "trainer.max_steps=3", "hydra.sweep.dir=S"],
            "lora.alpha: 16 there, swept now",
        ),
    }
    for name, (argv, differs) in others.items():
        with pytest.raises(ConfigError) as info:
            claim(argv)
        message = str(info.value)
        assert message.startswith("hydra.sweep.dir=S already holds another study, 1 job(s) of other settings"), name
        assert f"({differs})" in message, (name, message)
        assert "Fix: give this study its own directory, hydra.sweep.dir=S_2" in message
        assert _files(study) == before and not (tmp_path / "S_2").exists(), name
    # The same study again, with more values: resumed in its own directory (its jobs are reused job by job).
    try:
        assert claim([*first[:1], "lora.r=4,8,16", *first[2:]])[-1] == 'hydra.sweep.dir="S"'
    finally:
        release_studies()


def test_jobs_without_the_record_of_their_study_are_never_adopted(tmp_path, monkeypatch):
    """A sweep directory whose study.json is gone or damaged: its jobs may be any study's, so even a launch with the
    same settings is refused (nothing written); the time-stamped default passes it over."""
    from exp.core.config import ConfigError
    from exp.study.claim import release_studies

    monkeypatch.chdir(tmp_path)
    first = ["-m", "lora.r=4,8", "trainer.max_steps=3", "hydra.sweep.dir=S"]
    study = study_with_a_job(tmp_path, first)
    for state, damage in {"is missing": Path.unlink, "cannot be read": lambda p: p.write_text("{")}.items():
        damage(study / "study.json")
        before = _files(study)
        with pytest.raises(ConfigError) as info:
            claim(first)
        message = str(info.value)
        assert message.startswith("hydra.sweep.dir=S holds 1 job(s), but S/study.json, the record of their study")
        assert f"{state}, so whether they are this launch's study cannot be told" in message
        assert "Fix: give this study its own directory, hydra.sweep.dir=S_2" in message
        assert _files(study) == before and not (tmp_path / "S_2").exists(), state
    stamped = tmp_path / "M" / time.strftime("%Y")
    shutil.copytree(study, stamped)
    try:
        assert claim(["-m", "lora.r=4,8", "hydra.sweep.dir=M/${now:%Y}"])[-1] == f'hydra.sweep.dir="M/{stamped.name}_2"'
    finally:
        release_studies()
    assert (stamped / "study.json").read_text() == "{"


HOLD = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_sweeps import claim
print(claim(sys.argv[2:])[-1], flush=True)
sys.stdin.read()  # holds the sweep directory until the test closes stdin, as a launch does until it ends
"""


def hold(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen, str]:
    """Another launch, claiming `argv`'s sweep directory and holding it; returns once it holds it, with the
    `hydra.sweep.dir="..."` it pinned."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(ROOT / "tests"), *argv],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pinned = proc.stdout.readline().strip()
    assert pinned.startswith("hydra.sweep.dir="), pinned
    return proc, pinned


def test_a_sweep_dir_that_a_live_launch_holds_is_refused_or_passed_over(tmp_path, monkeypatch):
    """Two launches at once: the second is refused (a named directory) or given its own (the time-stamped default),
    whichever study it is; once the first has ended, the same study resumes there."""
    from exp.core.config import ConfigError
    from exp.study.claim import release_studies

    monkeypatch.chdir(tmp_path)
    argv = ["-m", "lora.r=4,8", "hydra.sweep.dir=S"]
    holder, _ = hold(tmp_path, argv)
    try:
        with pytest.raises(ConfigError) as info:
            claim(argv)
        message = str(info.value)
        assert message.startswith(
            f"hydra.sweep.dir=S is being written by another launch right now (process {holder.pid} holds S/.lock)"
        )
        assert "Fix: wait for that launch to end" in message and "hydra.sweep.dir=S_2" in message
        assert sorted(p.name for p in (tmp_path / "S").iterdir()) == [".lock", "study.json"]
        # The time-stamped default: a launch in the same second (here: the same year) gets a directory of its own.
        stamped = ["-m", "lora.r=4,8", "hydra.sweep.dir=M/${now:%Y}"]
        first, held = hold(tmp_path, stamped)
        try:
            assert claim(stamped)[-1] == held[:-1] + '_2"'
            assert sorted(p.name for p in (tmp_path / "M").iterdir()) == [
                f"{time.strftime('%Y')}{n}" for n in ("", "_2")
            ]
        finally:
            release_studies()
            first.stdin.close()
            first.wait(timeout=60)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    try:
        assert claim(argv)[-1] == 'hydra.sweep.dir="S"'
    finally:
        release_studies()


def test_the_cli_refuses_a_sweep_dir_that_is_not_a_study_or_is_held_and_writes_nothing(tmp_path):
    mine = tmp_path / "mine"
    (mine / "0_lora.r=4").mkdir(parents=True)  # a job's name, but no job's record in it
    (mine / "notes.txt").write_text("keep me")
    before = _files(mine)
    proc = exp(["exp.train", "-m", "lora.r=4,8", "hydra.sweep.dir=mine"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("exp: error: hydra.sweep.dir=mine: the directory exists and holds files that are not")
    assert "(0_lora.r=4/, notes.txt)" in proc.stderr and "hydra.sweep.dir=mine_2" in proc.stderr
    assert _files(mine) == before and sorted(p.name for p in mine.iterdir()) == ["0_lora.r=4", "notes.txt"]

    holder, _ = hold(tmp_path, ["-m", "lora.r=4,8", "hydra.sweep.dir=S"])
    try:
        proc = exp(["exp.train", "-m", "lora.r=4,8", "hydra.sweep.dir=S"], tmp_path)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("exp: error: hydra.sweep.dir=S is being written by another launch right now")
    assert sorted(p.name for p in (tmp_path / "S").iterdir()) == [".lock", "study.json"]


@pytest.mark.slow
def test_grid_sweep_file_composes_and_runs(launches):
    tmp_path, proc = launches.get("grid")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list((tmp_path / "grid").glob("*/summary.json"))) == 1


@pytest.mark.slow
def test_submitit_local_launcher_runs_jobs(launches):
    tmp_path, proc = launches.get("submitit")
    assert proc.returncode == 0, proc.stderr[-3000:]
    statuses = [json.loads(p.read_text())["status"] for p in (tmp_path / "sub").glob("*/status.json")]
    assert statuses == ["completed", "completed"]


def test_slurm_launcher_config_composes(tmp_path):
    proc = exp(
        [
            "exp.train",
            "hydra/launcher=slurm",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.timeout_min=30",
            "--cfg",
            "hydra",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for expected in ("SlurmLauncher", "partition: gpu", "gpus_per_node: 1", "timeout_min: 30", "tasks_per_node: 1"):
        assert expected in proc.stdout


@pytest.mark.slow
def test_gpu_launcher_gives_each_parallel_job_its_own_device(launches):
    """Devices named explicitly so the test runs without GPUs: each job must see exactly its own one. Re-launched,
    the completed jobs are reused; with one job's record changed (as if a config default had changed since), the
    launch is refused before any job starts."""
    proc, manifests, again, last = launches.get("gpus")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(m["hardware"]["cuda_visible_devices"] for m in manifests) == ["0", "1"]
    assert "Launching 2 jobs on 2 GPU(s)" in proc.stdout + proc.stderr

    assert again.returncode == 0 and (again.stdout + again.stderr).count("already completed with this config") == 2
    refused, before, after = last
    assert refused.returncode == 2 and "trainer.seed: 7 there, 0 now" in refused.stderr, refused.stderr[-3000:]
    assert "Launching" not in refused.stdout + refused.stderr and after == before


def test_gpu_launcher_without_a_gpu_says_so_and_writes_nothing(tmp_path):
    proc = exp(
        ["exp.train", "-m", "hydra/launcher=gpus", "lora.r=4,8", "hydra.sweep.dir=gp"],
        tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.startswith("exp: error: hydra/launcher=gpus runs each job on a GPU of its own")
    assert "CUDA_VISIBLE_DEVICES is ''" in proc.stderr and "hydra.launcher.devices=[0,1]" in proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_manifest_records_how_the_run_was_made(short_run):
    m = json.loads((short_run.output_dir / "manifest.json").read_text())
    assert m["packages"]["torch"] and m["packages"]["bitsandbytes"] and m["python"]
    assert m["data_fingerprint"].startswith("generated:") and len(m["tokenizer_sha256"]) == 64
    assert m["hardware"]["cpus"] >= 1 and "git" in m and m["command"]


def test_per_step_lr_and_grad_norm_are_logged(short_run):
    rows = list(csv.DictReader((short_run.output_dir / "csv" / "metrics.csv").open()))
    lrs = [float(r["train/lr"]) for r in rows if r.get("train/lr")]
    norms = [float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")]
    assert len(lrs) == 30 and len(norms) == 30 and all(n > 0 for n in norms)
