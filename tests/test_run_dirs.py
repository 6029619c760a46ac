"""Run directories and `trainer.resume=auto`: directories are claimed atomically (simultaneous launches get distinct
ones), a run in use by a process is locked, and `auto` looks only where docs/resume.md says, never continues a
run whose continuation completed or that another process is running or continuing.

Runs here are stand-ins (a config.yaml, a status.json, checkpoint file names): which run `auto` picks depends only
on those. The locks are taken by real processes, synchronised on a line they print once they hold them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exp.core.config import ConfigError
from exp.run.dirs import release_runs
from exp.run.resume import find_auto, search_places

CONFIG = {"trainer": {"max_steps": 10, "resume": "auto"}, "lora": {"r": 8}}


@pytest.fixture(autouse=True)
def no_locks_left():
    yield
    release_runs()


def fake_run(path: Path, status: str = "preempted", step: int | None = 5, continues: Path | None = None, **config):
    """A run directory as exp leaves it: config.yaml, status.json, a periodic checkpoint, a resume.json."""
    path.mkdir(parents=True)
    merged = {**CONFIG, **config}
    (path / "config.yaml").write_text(json.dumps(merged))  # JSON is YAML
    (path / "status.json").write_text(json.dumps({"status": status}))
    if step is not None:
        (path / "checkpoints").mkdir()
        (path / "checkpoints" / f"step-{step:06d}.ckpt").write_bytes(b"stand-in")
        time.sleep(0.01)  # distinct modification times: the newest checkpoint decides
    if continues is not None:
        (path / "resume.json").write_text(json.dumps({"run": str(continues), "checkpoint": "x", "step": 5}))
    return path.resolve()


def test_auto_looks_at_siblings_of_a_flat_run_dir_and_never_above(tmp_path):
    """`hydra.run.dir=runs/new`: runs/* only, not the launch directory's other folders (another launch's runs)."""
    sibling = fake_run(tmp_path / "runs" / "old")
    fake_run(tmp_path / "elsewhere" / "newer")  # matches too, and is newer: not a place auto looks
    fake_run(tmp_path / "outputs" / "2026-01-01" / "10-00-00")  # the launch dir's outputs/: not either
    new = tmp_path / "runs" / "new"
    assert search_places(new) == [sibling]
    assert find_auto(CONFIG, new) == sibling


def test_auto_in_the_dated_layout_looks_at_every_date_under_the_same_root(tmp_path):
    root = tmp_path / "outputs"
    a = fake_run(root / "2026-01-01" / "10-00-00")
    b = fake_run(root / "2026-01-02" / "09-00-00_1")
    fake_run(root / "notes" / "10-00-00")  # not a date
    fake_run(tmp_path / "other-root" / "2026-01-03" / "10-00-00")  # another root
    assert search_places(root / "2026-01-03" / "12-00-00") == [a, b]
    assert find_auto(CONFIG, root / "2026-01-03" / "12-00-00") == b  # the newest checkpoint


def test_auto_skips_finished_and_different_runs(tmp_path):
    fake_run(tmp_path / "done", status="completed")
    fake_run(tmp_path / "other", lora={"r": 16})
    fake_run(tmp_path / "longer", trainer={"max_steps": 20, "resume": "auto"})
    fake_run(tmp_path / "no-checkpoint", step=None)
    assert find_auto(CONFIG, tmp_path / "new") is None


def test_a_run_whose_continuation_completed_is_not_continued_again(tmp_path):
    first = fake_run(tmp_path / "first", status="running")  # killed: it never said otherwise
    fake_run(tmp_path / "second", status="completed", step=10, continues=first)
    assert find_auto(CONFIG, tmp_path / "new") is None


def test_a_chain_of_continuations_continues_from_its_newest_checkpoint(tmp_path):
    first = fake_run(tmp_path / "first", step=5)
    second = fake_run(tmp_path / "second", step=8, continues=first)
    assert find_auto(CONFIG, tmp_path / "new") == second
    release_runs()
    # A continuation that died before its first checkpoint: the run it continued is where to go on from.
    third = fake_run(tmp_path / "x-third", status="failed", step=None, continues=second)
    assert third and find_auto(CONFIG, tmp_path / "new") == second


def hold_lock(path: Path) -> subprocess.Popen:
    """Another process that holds `path`'s run lock (as a running run or a continuation does) until killed."""
    code = (
        "import sys, time; from pathlib import Path; from exp.run.dirs import lock_run; "
        "assert lock_run(Path(sys.argv[1]), create=False); print('locked', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_run_in_use_by_another_process_is_never_continued(tmp_path):
    running = fake_run(tmp_path / "running", status="running")
    (running / ".lock").touch()
    holder = hold_lock(running)
    try:
        assert find_auto(CONFIG, tmp_path / "new") is None  # auto: skipped
        from exp.run.compose import compose_config, config_dict
        from exp.run.resume import resolve

        cfg = compose_config([f"trainer.resume={running}"])
        with pytest.raises(ConfigError, match="is in use by another process"):
            resolve(cfg, config_dict(cfg), tmp_path / "new", tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert find_auto(CONFIG, tmp_path / "new") == running  # the process is gone: its lock with it


@pytest.mark.slow
def test_two_continuations_of_one_run_cannot_both_start(tmp_path):
    """A run without a .lock (an older run, or one not to be touched) is locked through its directory."""
    preempted = fake_run(tmp_path / "preempted")
    assert find_auto(CONFIG, tmp_path / "a") == preempted  # this process continues it, and holds its lock
    code = (
        "import json, sys; from pathlib import Path; from exp.run.resume import find_auto; "
        "print(find_auto(json.loads(sys.argv[1]), Path(sys.argv[2])))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, json.dumps(CONFIG), str(tmp_path / "b")], capture_output=True, text=True
    )
    assert other.stdout.strip() == "None", other.stderr
    assert not (preempted / ".lock").exists()  # the continued run's files are untouched


CLAIM = """
import sys, time
from pathlib import Path
from exp.run.dirs import claim_run_dir
start = Path(sys.argv[2])
print("ready", flush=True)
while not start.exists():
    time.sleep(0.001)
print(claim_run_dir(Path(sys.argv[1])), flush=True)
"""


def test_a_directory_claimed_while_it_is_inspected_is_a_runs(tmp_path, monkeypatch):
    """Another process's claim can land between the check for status.json and the listing of the directory (its lock
    file, then its status.json): the directory then holds a run, and the next name is tried instead of refusing the
    path as someone else's files."""
    from exp.run import dirs

    run = tmp_path / "run"
    run.mkdir()
    (run / dirs.LOCK_FILE).touch()
    listing = Path.iterdir

    def claimed_meanwhile(self):
        if self == run:
            dirs.write_json(run / dirs.STATUS_FILE, {"status": "running"})
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", claimed_meanwhile)
    assert dirs.foreign_entries(run) == []
    assert dirs.claim_run_dir(run) == tmp_path / "run_1"


def test_simultaneous_claims_get_distinct_directories(tmp_path):
    start = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", CLAIM, str(tmp_path / "run"), str(start)], stdout=subprocess.PIPE)
        for _ in range(4)
    ]
    assert all(p.stdout.readline() == b"ready\n" for p in procs)  # all imported and waiting: they claim together
    start.touch()
    claimed = [p.communicate(timeout=60)[0].decode().strip() for p in procs]
    assert sorted(claimed) == [str(tmp_path / n) for n in ("run", "run_1", "run_2", "run_3")], claimed
    for d in claimed:
        assert json.loads((Path(d) / "status.json").read_text())["status"] == "running"


@pytest.mark.slow
def test_two_clis_started_together_write_into_two_directories(tmp_path):
    """`python -m exp.train` twice at once, same hydra.run.dir: each its own directory, record and log (both stop
    at the preflight, after the claim: they ask for 64 GPUs). The directories exist beforehand, empty: a run refused
    by its checks removes only a directory it made, and marks one that was there before as failed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    (tmp_path / "same").mkdir()
    (tmp_path / "same_1").mkdir()
    gpus = ["hardware=ddp", "hardware.devices=64", "trainer.global_batch_size=256"]  # a valid config no machine runs
    args = [sys.executable, "-m", "exp.train", *gpus, "logger=none", "hydra.run.dir=same"]
    procs = [
        subprocess.Popen([*args, f"trainer.seed={i}"], cwd=tmp_path, env=env, stderr=subprocess.PIPE) for i in (1, 2)
    ]
    errs = [p.communicate(timeout=120)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [3, 3], errs  # the preflight's exit status
    dirs = sorted(p.name for p in tmp_path.iterdir())
    assert dirs == ["same", "same_1"]
    seeds = set()
    for d in dirs:
        assert json.loads((tmp_path / d / "status.json").read_text())["status"] == "failed"
        overrides = (tmp_path / d / ".hydra" / "overrides.yaml").read_text()
        seeds.add(overrides.split("trainer.seed=")[1][0])
        assert (tmp_path / d / "train.log").exists()
    assert seeds == {"1", "2"}  # each record is its own run's


def test_a_run_dir_that_cannot_be_created_is_refused_clearly(tmp_path, monkeypatch):
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", "hydra.run.dir=/proc/exp-run/x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "/proc/exp-run/x" in proc.stderr and "cannot be created" in proc.stderr
    assert "hydra.run.dir=<a writable path>" in proc.stderr

    from exp.run.overrides import run_dir_problems

    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only file system, as root sees it
    (problem,) = run_dir_problems("hydra.run.dir", tmp_path / "ro" / "run")
    assert f"{tmp_path} cannot be written (permissions, or a read-only file system)" in problem


def test_a_full_disk_is_reported_without_a_traceback(capsys):
    import errno

    from exp.training.pipeline import exit_on_known_error

    full = OSError(errno.ENOSPC, "No space left on device", "/runs/x/checkpoints/.last.ckpt.7.1.partial")
    with pytest.raises(SystemExit) as info:
        exit_on_known_error(full)
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "No space left on device while writing /runs/x/checkpoints/.last.ckpt.7.1.partial" in err
    assert "continue with trainer.resume=auto" in err


def test_a_killed_run_reads_as_interrupted_while_a_running_one_reads_as_running(tmp_path):
    from exp.run.dirs import run_state

    killed = fake_run(tmp_path / "killed", status="running")
    (killed / ".lock").touch()  # it ran with a lock, and no process holds it now
    assert run_state(killed) == "interrupted" and status_of(killed) == "running"  # its own file is left as it is
    running = fake_run(tmp_path / "running", status="running")
    (running / ".lock").touch()
    holder = hold_lock(running)
    try:
        assert run_state(running) == "running"
    finally:
        holder.kill()
        holder.wait()


def status_of(run: Path) -> str:
    return json.loads((run / "status.json").read_text())["status"]


def test_a_sweep_job_with_long_overrides_gets_a_name_the_file_system_takes():
    from exp.run.compose import compose_config  # noqa: F401  (registers the resolver conf/train.yaml uses)
    from exp.run.dirs import NAME_MAX_BYTES, sweep_job_dir_name

    short = "lora.r=8,trainer.learning_rate=0.0002"
    assert sweep_job_dir_name(3, short) == f"3_{short}"  # Hydra's naming, unchanged
    assert sweep_job_dir_name(0, "") == "0"
    assert sweep_job_dir_name(1, "data.path=/data/a.json,lora.r=8") == "1_data.path=/data/a.json,lora.r=8"
    long = ",".join(f"trainer.key_{i}=value_{i}" for i in range(20)) + ",data.path=/" + "d" * 40 + "/a.json"
    name = sweep_job_dir_name(12, long)
    assert len(name.encode()) <= NAME_MAX_BYTES and "/" not in name and name.startswith("12_trainer.key_0=")
    assert sweep_job_dir_name(12, long) == name  # the same on a re-launch: the job is found again
    assert sweep_job_dir_name(12, long.replace("value_19", "value_X")) != name  # a different job, another name
    accents = sweep_job_dir_name(12, "x=" + "é" * 200)  # 2 bytes a character: cut on a character boundary
    assert len(accents.encode()) <= NAME_MAX_BYTES and accents.startswith("12_x=éé") and "\ufffd" not in accents


def test_the_sweep_config_names_jobs_through_the_resolver():
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from exp.run.compose import CONF_DIR
    from exp.run.dirs import sweep_job_dir_name

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("train", return_hydra_config=True)
    long = ",".join(f"trainer.key_{i}=value_{i}" for i in range(20))
    with open_dict(cfg):
        cfg.hydra.job.num, cfg.hydra.job.override_dirname = 7, long
    assert cfg.hydra.sweep.subdir == sweep_job_dir_name(7, long) != f"7_{long}"


def foreign_dir(path: Path) -> dict[str, bytes]:
    """A directory of something else than an exp run, with files of the names a run writes; its files' bytes."""
    (path / "data").mkdir(parents=True)
    (path / "config.yaml").write_text("my: own config\n")
    (path / "notes.txt").write_text("keep me\n")
    (path / "data" / "a.jsonl").write_text('{"x": 1}\n')
    return tree(path)


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_directory_that_is_not_an_exp_run_is_never_claimed(tmp_path):
    from exp import train
    from exp.run.dirs import claim_run_dir
    from exp.run.overrides import check_command_line

    mine = tmp_path / "mine"
    before = foreign_dir(mine)
    with pytest.raises(ConfigError) as info:
        claim_run_dir(mine)
    message = str(info.value)
    assert message.startswith(f"hydra.run.dir={mine}: the directory exists and holds files that are not an exp run's")
    assert "(config.yaml, data/, notes.txt)" in message and f"hydra.run.dir={mine / 'run'}" in message
    conf = str(Path(train.__file__).resolve().parents[2] / "conf")
    problems, _ = check_command_line([f"hydra.run.dir={mine}"], train.__file__, conf, "train")
    assert problems == [message]  # refused before Hydra starts, with the same paragraph
    with pytest.raises(ConfigError, match="not an exp run's"):
        train.run(["logger=none"], output_dir=mine)
    assert tree(mine) == before

    # The ranks of one torchrun launch share a directory: another rank's files are a run's, anything else is not.
    shared = fake_run(tmp_path / "shared", status="running")
    (shared / "status.json").unlink()
    (shared / "train.log").write_text("rank 0\n")
    problems, _ = check_command_line([f"hydra.run.dir={shared}"], train.__file__, conf, "train", launch="torchrun-1")
    assert problems == []
    problems, _ = check_command_line([f"hydra.run.dir={mine}"], train.__file__, conf, "train", launch="torchrun-1")
    assert problems and "not an exp run's" in problems[0]


def test_a_run_dir_may_be_new_empty_an_exp_run_or_a_claim_in_progress(tmp_path):
    from exp.run.dirs import claim_run_dir

    (tmp_path / "empty").mkdir()
    assert claim_run_dir(tmp_path / "empty") == tmp_path / "empty"
    (tmp_path / "claiming").mkdir()
    (tmp_path / "claiming" / ".lock").touch()  # another launch took the lock and has not written its status yet
    (tmp_path / "claiming" / ".status.json.77.tmp").touch()
    assert claim_run_dir(tmp_path / "claiming") == tmp_path / "claiming"
    done = fake_run(tmp_path / "done", status="completed")
    foreign_dir(tmp_path / "done_1")  # beside the named directory: passed over, not refused, not written
    assert claim_run_dir(done) == tmp_path / "done_2"
    assert sorted(p.name for p in (tmp_path / "done_1").iterdir()) == ["config.yaml", "data", "notes.txt"]
    assert status_of(done) == "completed"


@pytest.mark.slow
def test_the_cli_refuses_a_foreign_run_dir_and_writes_nothing_there(tmp_path):
    before = foreign_dir(tmp_path / "project")
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", "logger=none", "hydra.run.dir=project"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("exp: error: hydra.run.dir=project: the directory exists and holds files")
    assert "hydra.run.dir=project/run" in proc.stderr
    assert tree(tmp_path / "project") == before and sorted(p.name for p in tmp_path.iterdir()) == ["project"]


def test_a_failure_while_hydra_sets_the_run_up_marks_the_claimed_run_failed(tmp_path):
    """Hydra configures logging after exp has claimed the run directory (status `running`): a handler it cannot make
    stops it there, outside exp's code. The run says failed, why, and the message is one paragraph (exit 2)."""
    proc = subprocess.run(
        [sys.executable, "-m", "exp.train", "logger=none", "hydra.run.dir=run"]
        + ["+hydra.job_logging.handlers.console.level=NOPE"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (message,) = proc.stderr.strip().splitlines()
    assert message.startswith("exp: error: Hydra failed outside exp's code, setting the run up from its config")
    assert "Unable to configure handler 'console' (caused by ValueError: Unknown level: 'NOPE')" in message
    assert f"The run directory {tmp_path / 'run'} is marked failed" in message and "hydra.job_logging" in message
    record = json.loads((tmp_path / "run" / "status.json").read_text())
    assert record["status"] == "failed" and "Unknown level: 'NOPE'" in record["error"]


@pytest.mark.parametrize(
    ("stop", "status", "reason"),
    [
        (RuntimeError("a callback broke"), "failed", "RuntimeError: a callback broke"),
        (SystemExit(3), "failed", "the process exited with status 3 before the run recorded how it ended"),
        (ConfigError("lora.r=0: must be > 0"), "failed", "lora.r=0: must be > 0"),
        ("preempted", "preempted", "Preempted: stopped by SIGTERM during start-up"),
    ],
)
def test_whatever_stops_a_process_no_run_it_claimed_is_left_running(tmp_path, stop, status, reason):
    from exp.run.dirs import claim_run_dir, write_status
    from exp.training.signals import Preempted, ends_recorded

    if stop == "preempted":
        stop = Preempted(15, phase="start-up")
    finished = claim_run_dir(tmp_path / "finished")
    write_status(finished, "completed")
    with pytest.raises(type(stop)), ends_recorded() as marked:
        claimed = claim_run_dir(tmp_path / "run")
        raise stop
    assert marked == [claimed.resolve()] and status_of(finished) == "completed"
    record = json.loads((claimed / "status.json").read_text())
    assert record["status"] == status and record["error"].startswith(reason)


def test_a_run_from_python_that_fails_outside_the_pipelines_handling_says_failed(tmp_path, monkeypatch):
    import exp.training.pipeline
    from exp.train import run

    def broken(*args, **kwargs):
        raise RuntimeError("the resume record could not be read")

    monkeypatch.setattr(exp.training.pipeline, "prepare_resume", broken)  # after the preflight, before `train`
    with pytest.raises(RuntimeError):
        run(["logger=none", "trainer.max_steps=2"], output_dir=tmp_path / "run")
    record = json.loads((tmp_path / "run" / "status.json").read_text())
    assert record == {**record, "status": "failed", "error": "RuntimeError: the resume record could not be read"}


BROKEN_SWEEP_JOB = """
import sys
import exp.study.job

def broken(run_dir, env=None):
    raise RuntimeError("the job process could not be started")

exp.study.job.run_job_process = broken
sys.argv = ["exp.train", *sys.argv[1:]]
from exp.train import cli

cli()
"""


def test_a_sweep_job_that_fails_outside_the_pipeline_says_failed_and_is_not_blamed_on_hydra(tmp_path):
    """A sweep job's directory says running once claimed; an error of exp's own before its job process runs marks
    it failed, and is reported as exp's (its traceback), not as Hydra failing to set the run up."""
    proc = subprocess.run(
        [sys.executable, "-c", BROKEN_SWEEP_JOB, "-m", "lora.r=4", "logger=none", "hydra.sweep.dir=S"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "RuntimeError: the job process could not be started" in proc.stderr
    assert "Hydra failed outside exp's code" not in proc.stderr, proc.stderr
    (status,) = (tmp_path / "S").glob("*/status.json")
    record = json.loads(status.read_text())
    assert record["status"] == "failed" and record["error"] == "RuntimeError: the job process could not be started"
