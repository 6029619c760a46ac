"""Security: no secret in anything a run writes, only allow-listed callables instantiated by Hydra, remote code
off (and loud when on), and weights that load without unpickling code.

The secret test runs the real CLI with fake secrets in the environment and in Hydra overrides, and greps every byte
of every file the run wrote (W&B's binary transaction log and the checkpoints included).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import Together

from exp.core.config import ConfigError, ModelConfig
from exp.run.compose import CONF_DIR
from exp.run.overrides import check_command_line
from exp.run.security import REDACTED, redact_override

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = str(ROOT / "src" / "exp" / "train.py")

ENV_SECRETS = {
    "WANDB_API_KEY": "wk0FAKE0123456789abcdef0123456789abcdef01",  # 40 characters, as W&B's keys
    "HF_TOKEN": "hf_FAKEenvTOKEN0123456789",
    "MY_SERVICE_PASSWORD": "pw_FAKEenvPASSWORD42",
}
OVERRIDE_SECRETS = {"DB_PASSWORD": "pw_FAKEoverridePW77", "HF_TOKEN": "hf_FAKEoverrideTOKEN99"}
RUN = [
    "trainer.max_steps=5",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=5",
    "trainer.checkpoint_every_n_steps=5",
    "data.num_examples=200",
    "logger=[wandb,tensorboard,mlflow]",  # every tracker's files are searched
]


def _cli(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 240):
    return subprocess.run(
        [sys.executable, "-m", "exp.train", *args],
        cwd=cwd,
        env=env or dict(os.environ, OMP_NUM_THREADS="1"),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def secret_cli_run(launch: Path, home: Path, run_dir: Path, environ: dict[str, str]):
    """A short W&B (offline) run from the CLI with fake secrets in the environment and in Hydra overrides."""
    env = {k: v for k, v in environ.items() if not k.startswith("WANDB_")}
    env.update(ENV_SECRETS, OMP_NUM_THREADS="1", HOME=str(home))
    env["WANDB_BASE_URL"] = "http://127.0.0.1:9"  # a key but no server (nothing listens there): offline, at once
    overrides = [f"+hydra.job.env_set.{k}={v}" for k, v in OVERRIDE_SECRETS.items()]
    overrides.append("hydra.job.env_copy=[MY_SERVICE_PASSWORD]")  # Hydra copies the variable's value into its config
    # A secret's value under a name that does not look secret: found by its value.
    overrides.append(f"+hydra.job.env_set.INNOCENT_NAME={ENV_SECRETS['MY_SERVICE_PASSWORD']}")
    return run_dir, launch, _cli(launch, *RUN, *overrides, f"hydra.run.dir={run_dir}", env=env)


def sweep_with_a_secret(cwd: Path, launcher: str, environ: dict[str, str]):
    """A multirun with a secret in a Hydra override, its jobs failing their validation (lora.r=0) at once."""
    secret = OVERRIDE_SECRETS["DB_PASSWORD"]
    sweep = cwd / "sweep"
    args = ["-m", f"hydra/launcher={launcher}", f"+hydra.job.env_set.DB_PASSWORD={secret}", "lora.r=0,-1"]
    return sweep, _cli(cwd, *args, f"hydra.sweep.dir={sweep}", env=dict(environ, OMP_NUM_THREADS="1"))


def hydra_without_the_check(cwd: Path, environ: dict[str, str]) -> Path:
    """Hydra's own entry point (no exp.train.cli) given a YAML file whose callback makes a directory: the marker."""
    marker = cwd / "made_by_os_makedirs"
    config_dir = _evil_config_dir(cwd / "conf", marker)
    code = "import sys; from exp.train import main; main()"
    argv = ["--config-dir", str(config_dir), "experiment=evil", "lora.r=0", "logger=none"]
    subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, env=environ, capture_output=True, timeout=120)
    return marker


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory: pytest.TempPathFactory) -> Together:
    """The CLI runs of this module's slow tests, side by side. Their environment is the one they start from: the
    fast tests in between put secrets into it (monkeypatch)."""
    environ = dict(os.environ)
    secret = ["launch", "home", "secret_run"]
    launch, home, run_dir = (tmp_path_factory.mktemp(name) for name in secret)
    steps = {
        "secret": partial(secret_cli_run, launch, home, run_dir / "run", environ),
        "sweep-basic": partial(sweep_with_a_secret, tmp_path_factory.mktemp("sweep"), "basic", environ),
        "sweep-submitit": partial(sweep_with_a_secret, tmp_path_factory.mktemp("sweep"), "submitit_local", environ),
        "control": partial(hydra_without_the_check, tmp_path_factory.mktemp("control"), environ),
    }
    uses = {
        "secret": [
            "test_no_secret_reaches_any_file_the_run_writes",
            "test_the_hydra_record_is_kept_redacted_and_the_report_reads_it",
            "test_checkpoints_load_with_weights_only_and_hold_plain_types",
            "test_weights_are_safetensors",
        ],
        "sweep-basic": ["test_a_sweep_writes_no_secret_anywhere[basic]"],
        "sweep-submitit": ["test_a_sweep_writes_no_secret_anywhere[submitit_local]"],
        "control": ["test_without_the_check_hydra_would_have_run_it"],
    }
    with Together(request, steps, uses) as together:
        yield together


@pytest.fixture
def secret_run(launches):
    run_dir, launch, proc = launches.get("secret")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, launch, proc


@pytest.mark.slow
def test_no_secret_reaches_any_file_the_run_writes(secret_run):
    run_dir, launch, proc = secret_run
    files = [p for p in [*run_dir.rglob("*"), *launch.rglob("*")] if p.is_file()]
    names = {p.name for p in files}
    # The scan covers every kind of file a run writes.
    for expected in ("config.yaml", "hydra.yaml", "overrides.yaml", "manifest.json", "summary.json", "status.json"):
        assert expected in names, expected
    for expected in ("samples.txt", "metrics.csv", "last.ckpt", "adapter_model.safetensors", "train.log"):
        assert expected in names, expected
    wandb_log = next(
        p for p in files if p.suffix == ".wandb" and p.name.startswith("run-")
    )  # not MLflow's logger.wandb
    assert any(p.name == "debug.log" for p in files) and any(p.name == "output.log" for p in files)
    assert any("tfevents" in p.name for p in files) and any(p.parent.name == "params" for p in files)
    # W&B records the command line: the scan would see a secret typed there.
    assert b"trainer.max_steps=5" in wandb_log.read_bytes()
    secrets = [*ENV_SECRETS.values(), *OVERRIDE_SECRETS.values()]
    for path in files:
        data = path.read_bytes()
        for secret in secrets:
            assert secret.encode() not in data, f"{secret} leaked into {path}"
    for secret in secrets:
        assert secret not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_hydra_record_is_kept_redacted_and_the_report_reads_it(secret_run):
    from omegaconf import OmegaConf

    from exp.report import read_run

    run_dir, _, _ = secret_run
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    hydra = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra
    masked = {"DB_PASSWORD": REDACTED, "HF_TOKEN": REDACTED, "MY_SERVICE_PASSWORD": REDACTED}
    assert hydra.job.env_set == {**masked, "INNOCENT_NAME": REDACTED}  # the last by its value
    assert f"+hydra.job.env_set.DB_PASSWORD={REDACTED}" in hydra.overrides.hydra
    assert list(hydra.overrides.task) == RUN
    # The run's config.yaml holds what the preflight resolved (here the loss `auto` became on the CPU); the rest is
    # the composed config Hydra recorded.
    recorded, resolved = OmegaConf.load(run_dir / ".hydra" / "config.yaml"), OmegaConf.load(run_dir / "config.yaml")
    assert (recorded.hardware.loss_impl, resolved.hardware.loss_impl) == ("auto", "hf")
    recorded.hardware.loss_impl = resolved.hardware.loss_impl
    assert recorded == resolved
    assert read_run(run_dir, "val/loss").overrides["trainer.max_steps"] == "5"


@pytest.mark.parametrize("launcher", ["basic", "submitit_local"])
@pytest.mark.slow
def test_a_sweep_writes_no_secret_anywhere(launches, launcher: str):
    """A multirun's files (multirun.yaml, each job's record, the launcher's submission pickles) hold no secret.
    The jobs fail their validation (lora.r=0) at once: what a sweep writes is the same either way."""
    secret = OVERRIDE_SECRETS["DB_PASSWORD"]
    sweep, proc = launches.get("sweep-basic" if launcher == "basic" else "sweep-submitit")
    assert proc.returncode == 2, proc.stderr[-3000:]  # the exit status counts the failed jobs
    files = [p for p in sweep.rglob("*") if p.is_file()]
    assert (sweep / "multirun.yaml") in files and len(list(sweep.glob("*/.hydra/hydra.yaml"))) == 2
    assert [p for p in files if secret.encode() in p.read_bytes()] == []
    assert secret not in proc.stdout + proc.stderr


# A secret's value reaching the training config or a directory name under a name that does not look secret.
BY_VALUE = [
    (
        "logger.project=${oc.env:WANDB_API_KEY}",
        "logger.project holds the value of the environment variable WANDB_API_KEY",
    ),
    (f"trainer.sample_prompts=[{ENV_SECRETS['HF_TOKEN']}]", "trainer.sample_prompts[0] holds the value of"),
    ("logger.tags=[x${oc.env:MY_SERVICE_PASSWORD}]", "logger.tags[0] holds the value of the environment variable MY"),
    ("hydra.run.dir=outputs/${oc.env:HF_TOKEN}", "hydra.run.dir holds the value of the environment variable HF_TOKEN"),
    ("hydra.job.name=${oc.env:HF_TOKEN}", "hydra.job.name holds the value"),
]


@pytest.mark.parametrize(("override", "message"), BY_VALUE, ids=[o.split("=")[0] for o, _ in BY_VALUE])
def test_a_secret_value_under_an_innocent_name_is_refused(tmp_path, monkeypatch, override: str, message: str):
    for name, value in ENV_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    problems, _ = check_command_line([override], TRAIN_PY, str(CONF_DIR), "train")
    assert len(problems) == 1 and message in problems[0], problems
    assert not any(secret in problems[0] for secret in ENV_SECRETS.values())


def test_a_secret_value_is_refused_by_the_cli_without_writing_or_printing_it(tmp_path: Path):
    env = dict(os.environ, **ENV_SECRETS, OMP_NUM_THREADS="1")
    proc = _cli(tmp_path, f"trainer.sample_prompts=[{ENV_SECRETS['HF_TOKEN']}]", env=env)
    assert proc.returncode == 2 and "holds the value of the environment variable HF_TOKEN" in proc.stderr
    assert ENV_SECRETS["HF_TOKEN"] not in proc.stdout + proc.stderr and list(tmp_path.iterdir()) == []


def test_the_typed_config_refuses_a_secret_value_too(monkeypatch):
    """`exp.train.run` (no CLI check before it) composes through the same typed config."""
    from exp.run.compose import compose_config

    monkeypatch.setenv("HF_TOKEN", ENV_SECRETS["HF_TOKEN"])
    with pytest.raises(ConfigError, match="logger.run_name holds the value of the environment variable HF_TOKEN"):
        compose_config(["logger.run_name=${oc.env:HF_TOKEN}"])


def test_a_failed_jobs_exception_handed_to_its_launcher_holds_no_secret(monkeypatch):
    """What a failed sweep job hands back (pickled into submitit's result file) keeps the error, not the secrets in
    its message: the job's secret override values and secret environment values, down the exception chain."""
    import pickle

    from hydra.core.utils import JobReturn, JobStatus

    from exp.run.security import redact_job_return

    monkeypatch.setenv("EXP_TEST_API_KEY", "env-secret-value-42")
    try:
        try:
            raise OSError("the server refused env-secret-value-42")
        except OSError as cause:
            raise RuntimeError("login failed with override-secret-1234 at step 3") from cause
    except RuntimeError as e:
        failure = e
    job = JobReturn(overrides=["+logger.api_key=override-secret-1234", "lora.r=8"], status=JobStatus.FAILED)
    job.return_value = failure
    redact_job_return(job)
    blob = pickle.dumps(job)
    assert b"override-secret-1234" not in blob and b"env-secret-value-42" not in blob
    assert str(failure) == "login failed with ***redacted*** at step 3"
    assert str(failure.__cause__) == "the server refused ***redacted***"
    assert job.overrides == ["+logger.api_key=***redacted***", "lora.r=8"]


def test_redact_override():
    assert redact_override("+hydra.job.env_set.HF_TOKEN=hf_x") == f"+hydra.job.env_set.HF_TOKEN={REDACTED}"
    assert redact_override("hydra.job.env_set={API_KEY: k1, HOME: /h}") == f"hydra.job.env_set={REDACTED}"
    assert redact_override("lora.r=16") == "lora.r=16"
    assert redact_override("data.max_seq_len=512") == "data.max_seq_len=512"  # `tokens`-like names stay
    assert redact_override("trainer.sample_max_new_tokens=8") == "trainer.sample_max_new_tokens=8"


@pytest.mark.parametrize("arg", ["+wandb.api_key=SEKRET_1", "+model.arch.hf_token=SEKRET_1", "+db.password=SEKRET_1"])
def test_a_secret_in_the_training_config_is_refused_without_repeating_it(tmp_path: Path, arg: str):
    proc = _cli(tmp_path, arg)
    assert proc.returncode == 2, proc.stderr
    assert "looks like a secret" in proc.stderr and "environment" in proc.stderr
    assert arg.split("=")[0].lstrip("+") in proc.stderr
    assert "SEKRET_1" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_a_secret_looking_key_in_a_yaml_arch_is_refused():
    from conftest import compose_typed

    with pytest.raises(ConfigError) as info:
        compose_typed(["+model.arch.db_password=SEKRET_2"])
    assert "model.arch.db_password" in str(info.value) and "SEKRET_2" not in str(info.value)


# --- what Hydra may instantiate ------------------------------------------------------------------------------


def _evil_config_dir(root: Path, marker: Path) -> Path:
    """A config directory with an experiment that registers `os.makedirs(<marker>)` as a Hydra callback."""
    (root / "experiment").mkdir(parents=True)
    (root / "experiment" / "evil.yaml").write_text(
        f"# @package _global_\nhydra:\n  callbacks:\n    evil:\n      _target_: os.makedirs\n      name: {marker}\n"
    )
    return root


def test_a_disallowed_target_on_the_command_line_is_refused_before_it_runs(tmp_path: Path):
    marker = tmp_path / "made_by_os_makedirs"
    proc = _cli(tmp_path, "+hydra.callbacks.evil._target_=os.makedirs", f"+hydra.callbacks.evil.name={marker}")
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr
    assert "hydra.callbacks.evil._target_=os.makedirs" in message  # the key and the value
    assert "~hydra.callbacks.evil" in message and "exp.run.security.RunRecord" in message  # the fix, what is allowed
    assert "Traceback" not in message
    assert not marker.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "swept-experiment"])
def test_a_disallowed_target_in_a_yaml_file_is_refused(tmp_path: Path, sweep: bool):
    marker = tmp_path / "made_by_os_makedirs"
    config_dir = _evil_config_dir(tmp_path / "conf", marker)
    args = ["-m", "experiment=guanaco_7b,evil"] if sweep else ["experiment=evil"]
    proc = _cli(tmp_path, "--config-dir", str(config_dir), *args)
    assert proc.returncode == 2, proc.stderr
    assert "hydra.callbacks.evil._target_=os.makedirs" in proc.stderr
    assert not marker.exists() and not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


@pytest.mark.slow
def test_without_the_check_hydra_would_have_run_it(launches):
    """The control: Hydra's own entry point (no exp.train.cli) instantiates the YAML's callback."""
    assert launches.get("control").is_dir()


def test_a_config_that_sweeps_by_itself_is_checked_as_a_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`hydra.mode: MULTIRUN` in a config makes a sweep without -m (as Hydra decides); its swept values compose."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "swept.yaml").write_text("defaults:\n  - train\n  - _self_\nhydra:\n  mode: MULTIRUN\n")
    argv = ["--config-dir", str(tmp_path), "--config-name", "swept", "lora.r=4,8"]
    assert check_command_line(argv, TRAIN_PY, str(CONF_DIR), "train")[0] == []
    problems, _ = check_command_line([*argv, "+hydra.callbacks.x._target_=os.system"], TRAIN_PY, str(CONF_DIR), "train")
    assert len(problems) == 1 and "hydra.callbacks.x._target_=os.system" in problems[0]


# A `_target_` (or a logging `class` / `()`, an Optuna search-space function, an `ext://` import) is resolved as Hydra
# resolves it and the object it names is checked: its defining module and its kind. Each row: the overrides, what
# the message must name.
HOSTILE = [
    # Attribute paths through an allowed module reach anything that module imported.
    (["+hydra.callbacks.x._target_=exp.train.os.symlink"], "exp.train.os is module os"),
    (["+hydra.callbacks.x._target_=exp.train.os.system"], "exp.train.os is module os"),
    (["+hydra.callbacks.x._target_=exp.run.security.importlib.import_module"], "is module importlib"),
    (["+hydra.callbacks.x._target_=exp.train.sys.modules"], "is module sys"),
    (["+hydra.callbacks.x._target_=exp.train.Path"], "defined in pathlib"),
    (["+hydra.callbacks.x._target_=exp.run.security.Callback"], "defined in hydra.experimental.callback"),
    (["+hydra.callbacks.x._target_=exp.training.launch.subprocess.Popen"], "is module subprocess"),
    # exp's own functions are not callbacks (write_json would write any file it is given).
    (["+hydra.callbacks.x._target_=exp.run.dirs.write_json"], "which is not a Hydra callback"),
    (["+hydra.callbacks.x._target_=exp.study.records.SweepStatus.__class__"], "defined in builtins"),
    (["+hydra.callbacks.x._target_=exp.study.records.SweepStatus.on_multirun_end"], "which is not a Hydra callback"),
    (["+hydra.callbacks.x._target_=exp.${oc.env:HOME}"], "may not be an interpolation"),
    (["+hydra.callbacks.x._target_=builtins.eval"], "it would import module builtins"),
    (["+hydra.callbacks.x._target_=exp..train"], "not a dotted Python name"),
    (["+hydra.callbacks.x._target_=exp.no_such_module.X"], "cannot be imported"),
    (["hydra.launcher._target_=hydra._internal.core_plugins.basic_launcher.logging.Logger"], "is module logging"),
    (["hydra.launcher._target_=hydra._internal.utils._locate"], "module hydra._internal.utils"),
    (["hydra.sweeper._target_=exp.study.records.SweepStatus"], "it would import module exp;"),
    (["+hydra.callbacks.x.inner._target_=exp.train.os.system"], "is module os"),  # nested: instantiated first
    (["+model.arch._target_=os.system"], "it would import module os"),
    # logging.config: handler classes and factories, ext:// imports, log files outside the run directory.
    (["hydra.job_logging.handlers.console.class=logging.handlers.SocketHandler"], "not a logging handler"),
    (["hydra.job_logging.handlers.console.class=logging.config.dictConfig"], "logging.config"),
    (["+hydra.job_logging.root.class=logging.StreamHandler"], "only handlers, formatters and filters"),
    (["hydra.job_logging.handlers.console.stream=ext://antigravity"], "ext://antigravity"),
    (["hydra.job_logging.handlers.file.filename=/tmp/elsewhere.log"], "inside the run directory"),
    (["hydra.job_logging.handlers.file.filename=${hydra.runtime.output_dir}/../x.log"], "inside the run directory"),
    (["hydra.job.name=a/b"], "hydra.job.name=a/b"),
    # Hydra's own record holds overrides verbatim: exp writes it, redacted.
    (["hydra.output_subdir=.hydra"], "secrets included"),
    # The Optuna sweeper calls a search-space function by name.
    (
        ["-m", "hydra/sweeper=optuna", "hydra.sweeper.custom_search_space=exp.train.os.system", "lora.r=4,8"],
        "exp.train.os is module os",
    ),
]


@pytest.mark.parametrize(("argv", "names"), HOSTILE, ids=[" ".join(a)[:60] for a, _ in HOSTILE])
def test_a_callable_is_checked_as_hydra_resolves_it(tmp_path, monkeypatch, argv: list[str], names: str):
    monkeypatch.chdir(tmp_path)
    problems, _ = check_command_line(argv, TRAIN_PY, str(CONF_DIR), "train")
    assert len(problems) == 1, problems
    key = next(a for a in argv if "=" in a and not a.startswith(("-", "hydra/"))).split("=")[0].lstrip("+")
    assert key.rsplit(".", 1)[0] in problems[0] and names in problems[0], problems[0]
    assert "Nothing has been run" in problems[0] or "Fix:" in problems[0]


def test_logging_factories_in_a_yaml_file_are_checked_like_targets(tmp_path, monkeypatch):
    """`()` keys (factories) cannot be typed as overrides; an experiment file can set them."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "logs.yaml").write_text(
        "# @package _global_\nhydra:\n  job_logging:\n    formatters:\n      simple:\n"
        "        '()': exp.train.os.system\n    filters:\n      f:\n        '()': colorlog.escape_codes.sys.exit\n"
        "  hydra_logging:\n    formatters:\n      simple:\n        '()': colorlog.ColoredFormatter\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = ["--config-dir", str(tmp_path / "conf"), "experiment=logs"]
    problems, _ = check_command_line(argv, TRAIN_PY, str(CONF_DIR), "train")
    assert len(problems) == 2, problems  # colorlog's formatter is allowed
    assert (
        "hydra.job_logging.formatters.simple.()=exp.train.os.system" in problems[0]
        and "import module exp" in problems[0]
    )
    assert "hydra.job_logging.filters.f.()=colorlog.escape_codes.sys.exit" in problems[1]


def test_resolving_a_name_imports_nothing_outside_the_allowed_packages(tmp_path, monkeypatch):
    """A module with side effects on import, named as a target, is never imported by the check."""
    marker = tmp_path / "imported"
    (tmp_path / "side_effect_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass X: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for value in ("side_effect_mod.X", "exp.train.side_effect_mod.X"):
        problems, _ = check_command_line([f"+hydra.callbacks.x._target_={value}"], TRAIN_PY, str(CONF_DIR), "train")
        assert len(problems) == 1
    problems, _ = check_command_line(
        ["hydra.job_logging.handlers.console.stream=ext://side_effect_mod.X"], TRAIN_PY, str(CONF_DIR), "train"
    )
    assert len(problems) == 1
    assert not marker.exists()


def test_an_attribute_path_through_exp_creates_nothing(tmp_path: Path):
    """The example of a bypass by attribute path, through the real CLI: refused before Hydra runs it."""
    source, link = tmp_path / "source.txt", tmp_path / "link"
    source.write_text("x")
    args = ["+hydra.callbacks.x._target_=exp.train.os.symlink", f"+hydra.callbacks.x.src={source}"]
    proc = _cli(tmp_path, *args, f"+hydra.callbacks.x.dst={link}")
    assert proc.returncode == 2 and "exp.train.os is module os" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not link.exists() and not link.is_symlink() and not (tmp_path / "outputs").exists()


def test_the_allowed_callables_resolve_to_what_hydra_would_build():
    from hydra._internal.utils import _locate

    from exp.run.security import CALLBACK, HANDLER, LAUNCHER, SAMPLER, locate

    for name, slot in [
        ("exp.study.records.SweepStatus", CALLBACK),
        ("exp.run.security.RunRecord", CALLBACK),
        ("hydra._internal.core_plugins.basic_launcher.BasicLauncher", LAUNCHER),
        ("hydra_plugins.exp_gpu_launcher.launcher.GpuPoolLauncher", LAUNCHER),
        ("optuna.samplers.TPESampler", SAMPLER),
        ("logging.FileHandler", HANDLER),
    ]:
        assert locate(name, slot) is _locate(name)


def test_a_logging_handler_outside_logging_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    problems, _ = check_command_line(
        ["hydra.job_logging.handlers.console.class=os.system"], TRAIN_PY, str(CONF_DIR), "train"
    )
    assert len(problems) == 1 and "hydra.job_logging.handlers.console.class=os.system" in problems[0]


# --- after interpolation: what Hydra will build once `${...}` is resolved (issue #25) --------------------------


def _problems(argv: list[str]) -> list[str]:
    return check_command_line(argv, TRAIN_PY, str(CONF_DIR), "train")[0]


def _yaml_dir(root: Path, text: str, name: str = "evil") -> Path:
    """A config directory with `experiment/<name>.yaml` (a global package) holding `text`."""
    (root / "experiment").mkdir(parents=True, exist_ok=True)
    (root / "experiment" / f"{name}.yaml").write_text("# @package _global_\n" + text)
    return root


# A resolver that makes a node (`oc.create`, `oc.decode`) makes a `_target_` or a logging factory the unresolved
# config does not show. Each row: the overrides, the key the message must name.
MADE_BY_A_RESOLVER = [
    (["+hydra.callbacks.x='${oc.create:{_target_: os.makedirs, name: made}}'"], "hydra.callbacks.x._target_"),
    (["+hydra.callbacks.x=\"${oc.decode:'{_target_: os.symlink, src: a, dst: b}'}\""], "hydra.callbacks.x._target_"),
    # The callback node is written, its target made.
    (["+hydra.callbacks.x._target_='${oc.decode:os.system}'"], "hydra.callbacks.x._target_"),
    # An allowed name is refused too when an interpolation makes it: the check reads names as written.
    (["+hydra.callbacks.x='${oc.create:{_target_: exp.study.records.SweepStatus}}'"], "hydra.callbacks.x._target_"),
    (["+hydra.launcher.inner='${oc.create:{_target_: os.makedirs, name: made}}'"], "hydra.launcher.inner._target_"),
    (["+model.arch.x='${oc.create:{_target_: os.system}}'"], "model.arch.x._target_"),
    (["+hydra.job_logging.formatters.f='${oc.create:{class: exp.train.os.system}}'"], "formatters.f.class"),
    # A logging value that only resolution shows.
    (["hydra.job_logging.handlers.console.stream='${oc.decode:ext://antigravity}'"], "ext://antigravity"),
]


@pytest.mark.parametrize(("argv", "key"), MADE_BY_A_RESOLVER, ids=[a[0][:70] for a, _ in MADE_BY_A_RESOLVER])
def test_a_target_made_by_a_resolver_on_the_command_line_is_refused(tmp_path, monkeypatch, argv, key):
    monkeypatch.chdir(tmp_path)
    problems = _problems(argv)
    assert len(problems) == 1 and key in problems[0], problems
    assert "Nothing has been run" in problems[0] and "Fix:" in problems[0]
    assert not (tmp_path / "made").exists()


@pytest.mark.parametrize("route", ["config-dir", "searchpath"])
@pytest.mark.parametrize(
    "yaml",
    [
        "hydra:\n  callbacks:\n    evil: '${oc.create:{_target_: os.makedirs, name: made}}'\n",
        "hydra:\n  callbacks:\n    evil: \"${oc.decode:'{_target_: os.makedirs, name: made}'}\"\n",
        "hydra:\n  job_logging:\n    handlers:\n      file: '${oc.create:{class: logging.FileHandler, filename: ../v}}'\n",
    ],
    ids=["oc.create", "oc.decode", "logging-handler"],
)
def test_a_target_made_by_a_resolver_in_a_yaml_file_is_refused(tmp_path, monkeypatch, yaml: str, route: str):
    monkeypatch.chdir(tmp_path)
    config_dir = _yaml_dir(tmp_path / "conf", yaml)
    where = ["--config-dir", str(config_dir)] if route == "config-dir" else [f"hydra.searchpath=[file://{config_dir}]"]
    problems = _problems([*where, "experiment=evil"])
    key = "hydra.callbacks.evil._target_=os.makedirs" if "callbacks" in yaml else "handlers.file.class"
    assert problems and key in problems[0] and "interpolation" in problems[0], problems
    if "job_logging" in yaml:  # the file it would open is refused as well
        assert len(problems) == 2 and "resolves to" in problems[1]


# A log file name is checked as Hydra resolves it; each row leaves the run directory by a route the written name
# does not show.
LOG_FILE_ESCAPES = [
    ["hydra.job_logging.handlers.file.filename=${hydra.runtime.output_dir}/${oc.decode:'\"../../../v.log\"'}"],
    ["hydra.job_logging.handlers.file.filename=${hydra:runtime.output_dir}/${oc.env:UP_THREE}/v.log"],
    ["hydra.job_logging.handlers.file.filename=${hydra.runtime.output_dir}/${hydra.job.name}.log", "hydra.job.name=x"],
    ["hydra.run.dir=old", "hydra.job_logging.handlers.file.filename=old/train.log"],  # a run moved to old_1
    ["hydra.job_logging.handlers.file.filename=${oc.env:HOME}/v.log"],
    ["hydra.job_logging.handlers.file.filename=v.log"],  # relative to the launch directory
    ["-m", "lora.r=4,8", "hydra.job_logging.handlers.file.filename=${hydra.runtime.output_dir}/../1/v.log"],
    ["+hydra.hydra_logging.handlers.f='${oc.create:{class: logging.StreamHandler, filename: /tmp/v.log}}'"],
]


@pytest.mark.parametrize("argv", LOG_FILE_ESCAPES, ids=[a[-1][-60:] for a in LOG_FILE_ESCAPES])
def test_a_log_file_is_checked_after_resolution(tmp_path, monkeypatch, argv: list[str]):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("UP_THREE", "../../..")
    if "hydra.job.name=x" in argv:  # the name reaches `..` only through the job name
        argv = [argv[0], "hydra.job.name=${oc.decode:'\"../../../v\"'}"]
    problems = [p for p in _problems(argv) if "a log file must be inside the run directory" in p]
    assert len(problems) == 1, problems
    assert "resolves to" in problems[-1] and "${hydra.runtime.output_dir}/train.log" in problems[-1]


def test_a_log_file_through_a_link_out_of_the_run_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "out").symlink_to(tmp_path / "elsewhere")
    name = "${hydra.runtime.output_dir}/out/v.log"
    problems = _problems(["hydra.run.dir=run", f"hydra.job_logging.handlers.file.filename={name}"])
    assert any("by a symbolic link" in p and str(tmp_path / "elsewhere" / "v.log") in p for p in problems), problems


def test_log_files_inside_the_run_directory_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in (
        ["hydra.job_logging.handlers.file.filename=${hydra.runtime.output_dir}/logs/../${hydra.job.name}.log"],
        ["hydra.job_logging.handlers.file.filename=${hydra:runtime.output_dir}/a.log"],
        ["hydra.job.chdir=true", "hydra.job_logging.handlers.file.filename=train.log"],
        ["-m", "lora.r=4,8", "hydra.job_logging.handlers.file.filename=${hydra.runtime.output_dir}/x.log"],
    ):
        assert _problems(argv) == [], argv


def test_only_the_named_exp_classes_may_be_instantiated(tmp_path, monkeypatch):
    """exp's code is named by an explicit list: a class of exp's that would be made with the config's arguments
    (here a callback's nested `_target_`, made before the callback) is refused, and so is a Hydra callback defined
    under exp that the list does not name."""
    from hydra.experimental.callback import Callback

    import exp.study.records

    monkeypatch.chdir(tmp_path)
    nested = "+hydra.callbacks.sweep_status.inner._target_=exp.run.dirs.RunLayout"
    problems = _problems([nested, "+hydra.callbacks.sweep_status.inner.run_dir=elsewhere"])
    assert len(problems) == 1 and "exp.run.dirs.RunLayout, which is not on exp's list" in problems[0], problems
    assert "nothing may be named there" in problems[0]
    unlisted = type("Unlisted", (Callback,), {"__module__": "exp.study.records"})
    monkeypatch.setattr(exp.study.records, "Unlisted", unlisted, raising=False)
    problems = _problems(["+hydra.callbacks.x._target_=exp.study.records.Unlisted"])
    assert len(problems) == 1 and "exp.study.records.Unlisted, which is not on exp's list" in problems[0], problems
    assert "exp.study.records.SweepStatus, exp.run.security.RunRecord" in problems[0]
    problems = _problems(["-m", "hydra/sweeper=optuna", "hydra.sweeper.custom_search_space=exp.run.dirs.write_json"])
    assert len(problems) == 1 and "exp defines none" in problems[0], problems


@pytest.mark.parametrize(
    ("argv", "how"),
    [
        (["~hydra.callbacks.run_record"], "it is missing"),
        (["hydra.callbacks.run_record._target_=exp.study.records.SweepStatus"], "it is missing"),
        (["+hydra.callbacks.later._target_=exp.study.records.SweepStatus"], "hydra.callbacks.later comes after it"),
        (["+hydra.callbacks.run_record._partial_=true"], "holds more than _target_"),
        (["hydra.callbacks.run_record='${oc.create:{_target_: exp.run.security.RunRecord}}'"], "interpolation"),
    ],
    ids=["removed", "replaced", "followed", "partial", "made"],
)
def test_run_record_cannot_be_removed(tmp_path, monkeypatch, argv: list[str], how: str):
    monkeypatch.chdir(tmp_path)
    problems = _problems(argv)
    assert problems and how in "\n".join(problems), problems
    assert "hydra.callbacks.run_record: exp's callback exp.run.security.RunRecord must be the last" in problems[-1]
    # From YAML files: a primary config can remove it; an experiment (merged before conf/train.yaml's own values)
    # cannot, but naming it first moves it ahead of sweep_status.
    config_dir = _yaml_dir(tmp_path / "conf", "hydra:\n  callbacks:\n    run_record: null\n")
    (config_dir / "mine.yaml").write_text(
        "defaults:\n  - train\n  - _self_\nhydra:\n  callbacks:\n    run_record: null\n"
    )
    problems = _problems(["--config-dir", str(config_dir), "--config-name", "mine"])
    assert len(problems) == 1 and "it is missing" in problems[0]
    problems = _problems(["--config-dir", str(config_dir), "experiment=evil"])
    assert len(problems) == 1 and "hydra.callbacks.sweep_status comes after it" in problems[0]
    # Renamed, it is still RunRecord, last.
    assert _problems(["~hydra.callbacks.run_record", "+hydra.callbacks.rr._target_=exp.run.security.RunRecord"]) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["lora.r=${oc.env:EXP_TEST_UNSET}"],
        ["lora.r=${lora.alpha}", "lora.alpha=${lora.r}"],
        ["lora.r=${oc.decode:'[1'}"],
    ],
    ids=["unset variable", "cycle", "bad decode"],
)
def test_an_unresolvable_interpolation_is_one_paragraph(tmp_path, monkeypatch, argv: list[str]):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EXP_TEST_UNSET", raising=False)
    problems = _problems(argv)
    assert len(problems) == 1 and "\n" not in problems[0] and "the interpolation cannot be resolved" in problems[0]
    assert problems[0].startswith(argv[0].lstrip("+").split("=")[0])


def test_a_sweep_is_checked_as_its_jobs_read_it(tmp_path, monkeypatch):
    """A sweep's params become each job's overrides: a file they select, and Hydra settings they set, reach the
    jobs only."""
    monkeypatch.chdir(tmp_path)
    _yaml_dir(tmp_path / "conf", "hydra:\n  job_logging:\n    handlers:\n      file:\n        filename: /tmp/v.log\n")
    grid = "defaults:\n  - train\n  - _self_\nhydra:\n  sweeper:\n    params:\n"
    (tmp_path / "conf" / "grid.yaml").write_text(grid + "      experiment: guanaco_7b,evil\n")
    (tmp_path / "conf" / "hydra_param.yaml").write_text(grid + "      hydra.job.env_set.X: a,b\n")
    base = ["-m", "--config-dir", str(tmp_path / "conf"), "--config-name"]
    problems = _problems([*base, "grid"])
    assert len(problems) == 1 and "filename=/tmp/v.log" in problems[0], problems
    problems = _problems([*base, "hydra_param"])
    assert len(problems) == 1 and "hydra.sweeper.params.hydra.job.env_set.X=a,b" in problems[0], problems


def test_help_configures_logging_so_it_is_checked(tmp_path, monkeypatch):
    """--help and --hydra-help configure logging from the config before they print."""
    monkeypatch.chdir(tmp_path)
    for flag in ("--help", "--hydra-help"):
        problems = _problems([flag, "hydra.hydra_logging.handlers.console.class=logging.FileHandler", "+x=1"])
        assert problems == [], problems  # composition fails (+x): Hydra fails the same way, before logging
        problems = _problems([flag, "+hydra.hydra_logging.handlers.console.filename=/tmp/v.log"])
        assert len(problems) == 1 and "a log file must be inside the run directory" in problems[0]


def test_nothing_injected_runs_through_the_cli(tmp_path: Path):
    """The reported routes, through the real CLI: a callback made by oc.create would make a directory, a FileHandler
    made from a YAML file would empty a file three levels up. Refused, exit 2, no traceback, nothing touched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("kept")
    launch = tmp_path / "a" / "b"
    launch.mkdir(parents=True)
    config_dir = _yaml_dir(
        launch / "conf",
        "hydra:\n  job_logging:\n    handlers:\n      file:\n        class: logging.FileHandler\n        mode: w\n"
        "        filename: ${hydra.runtime.output_dir}/${oc.decode:'\"../../../victim.txt\"'}\n",
    )
    made = tmp_path / "made"
    args = ["--config-dir", str(config_dir), "experiment=evil", "hydra.run.dir=run"]
    proc = _cli(launch, *args, f"+hydra.callbacks.x='${{oc.create:{{_target_: os.makedirs, name: {made}}}}}'")
    assert proc.returncode == 2, proc.stderr
    assert "hydra.callbacks.x._target_=os.makedirs" in proc.stderr and "resolves to ../../victim.txt" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert victim.read_text() == "kept" and not made.exists() and not (launch / "run").exists()


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["experiment=guanaco_7b"],
        ["-m", "lora.r=4,8", "experiment=guanaco_7b"],
        ["-m", "hydra/launcher=gpus", "lora.r=4,8"],
        ["-m", "hydra/launcher=slurm", "lora.r=4,8"],
        ["-m", "hydra/launcher=submitit_local"],
        ["-m", "--config-dir", str(ROOT / "sweeps"), "--config-name", "optuna_lr_rank"],
        ["-m", "--config-dir", str(ROOT / "sweeps"), "--config-name", "lora_rank_grid"],
    ],
    ids=lambda argv: " ".join(a.replace(str(ROOT) + "/", "") for a in argv) or "default",
)
def test_the_project_configs_pass_the_allow_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]):
    monkeypatch.chdir(tmp_path)
    # The allow list alone: an experiment names no data file of this machine (the typed checks are test_config's).
    monkeypatch.setattr("exp.run.overrides._typed_problems", lambda cfg: [])
    problems, passed = check_command_line(argv, TRAIN_PY, str(CONF_DIR), "train")
    assert problems == [] and passed[: len(argv)] == argv
    if "-m" not in argv:  # a single run's directory is pinned, to be claimed before Hydra writes into it
        assert len(passed) == len(argv) + 1 and passed[-1].startswith('hydra.run.dir="outputs/')


def test_a_run_aimed_at_a_finished_run_goes_next_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    from exp.run.dirs import release_runs
    from exp.run.overrides import claim_pinned_run_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "status.json").write_text('{"status": "completed"}')
    problems, argv = check_command_line(["lora.r=16", "hydra.run.dir=done"], TRAIN_PY, str(CONF_DIR), "train")
    assert problems == [] and argv == ["lora.r=16", 'hydra.run.dir="done"']
    try:
        assert claim_pinned_run_dir(argv) == ["lora.r=16", 'hydra.run.dir="done_1"']
    finally:
        release_runs()
    assert "done already holds a run; this one goes to done_1" in capsys.readouterr().err
    assert json.loads((tmp_path / "done_1" / "status.json").read_text())["status"] == "running"


# --- remote code, weights and checkpoints ------------------------------------------------------------------------


def test_trust_remote_code_warns_naming_the_repository(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    from exp.model.build import resolve_checkpoint

    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="exp.model.build"):
        resolve_checkpoint(ModelConfig(path=str(local)))
        resolve_checkpoint(ModelConfig(hub_id="someone/remote-model", random_init=False))
        assert caplog.records == []  # off by default: silent
        resolve_checkpoint(ModelConfig(path=str(local), trust_remote_code=True))
        resolve_checkpoint(ModelConfig(hub_id="someone/remote-model", random_init=False, trust_remote_code=True))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("trust_remote_code=true" in m for m in messages)
    assert str(local) in messages[0] and "someone/remote-model" in messages[1]


def _calls(tree: ast.AST, module: str, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == name
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == module
    ]


def test_every_torch_load_in_the_source_uses_weights_only():
    loads = 0
    for path in (ROOT / "src").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for call in _calls(tree, "torch", "load"):
            loads += 1
            flags = {k.arg: k.value for k in call.keywords}
            assert isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True, (
                f"{path}:{call.lineno}: torch.load without weights_only=True"
            )
        for module, name in (("pickle", "load"), ("pickle", "loads"), ("dill", "load")):
            assert not _calls(tree, module, name), f"{path}: {module}.{name}"
        assert "safe_serialization=False" not in path.read_text(), path
    assert loads >= 1  # the scan sees the checkpoint readers


def _plain(value, where: str = "checkpoint") -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str | int), f"{where}: key {k!r}"
            _plain(v, f"{where}[{k!r}]")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _plain(v, f"{where}[{i}]")
    else:
        assert value is None or isinstance(value, str | int | float | bool | torch.Tensor), (
            f"{where}: {type(value).__module__}.{type(value).__name__}"
        )


@pytest.mark.slow
def test_checkpoints_load_with_weights_only_and_hold_plain_types(secret_run):
    run_dir, _, _ = secret_run
    checkpoints = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    assert checkpoints and any(p.name == "last.ckpt" for p in checkpoints)
    for path in checkpoints:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        _plain(ckpt, path.name)
        assert ckpt["state_dict"] and all("lora_" in k for k in ckpt["state_dict"])
        assert "hyper_parameters" not in ckpt  # no pickled config objects


@pytest.mark.slow
def test_weights_are_safetensors(secret_run):
    from omegaconf import OmegaConf
    from safetensors import safe_open

    from exp.model.build import resolve_checkpoint

    run_dir, _, _ = secret_run
    adapter = run_dir / "adapter"
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        assert any("lora_A" in k for k in f.keys())
    pickled = (".bin", ".pt", ".pth", ".pkl", ".pickle")
    assert not [p for p in adapter.iterdir() if p.suffix in pickled]
    model = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(run_dir / "config.yaml").model)
    )
    base = Path(resolve_checkpoint(model))
    assert list(base.glob("*.safetensors")) and not [p for p in base.iterdir() if p.suffix in pickled]


def test_a_job_whose_redacted_record_failed_is_not_trained(monkeypatch, tmp_path):
    """Hydra only warns about a callback's exception and runs the job anyway: when RunRecord cannot write the
    redacted record, the job refuses to run (one paragraph, no secret in it), and a full disk is said as one."""
    import errno as errno_codes

    from omegaconf import OmegaConf

    import exp.run.security as security
    from exp.train import check_run_record
    from exp.training.faults import TrainingFault

    config = OmegaConf.create({"hydra": {"mode": "RUN"}})

    def failing_write(cfg, run_dir=None):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".hydra" / "sk-live-abcdefghijklmnop"))

    monkeypatch.setattr(security, "write_hydra_record", failing_write)
    monkeypatch.setattr(sys, "argv", ["exp.train", "logger.api_key=sk-live-abcdefghijklmnop"])
    with pytest.raises(PermissionError):
        security.RunRecord().on_job_start(config)
    assert isinstance(security.run_record_failure(), PermissionError)
    with pytest.raises(TrainingFault, match="redacted record could not be written") as info:
        check_run_record(tmp_path)
    assert "hydra.run.dir" in str(info.value) and "sk-live-abcdefghijklmnop" not in str(info.value)

    def full_disk(cfg, run_dir=None):
        raise OSError(errno_codes.ENOSPC, "No space left on device", str(tmp_path / ".hydra"))

    monkeypatch.setattr(security, "write_hydra_record", full_disk)
    with pytest.raises(OSError):
        security.RunRecord().on_job_start(config)
    with pytest.raises(OSError, match="No space left"):
        check_run_record(tmp_path)
    # A job whose record was written runs.
    monkeypatch.setattr(security, "write_hydra_record", lambda cfg, run_dir=None: tmp_path)
    security.RunRecord().on_job_start(config)
    assert security.run_record_failure() is None
    check_run_record(tmp_path)
