"""W&B tracking with the real `wandb` package (offline: no server exists here) and secret redaction.

wandb 0.31 writes an offline run as `<run dir>/wandb/offline-run-<time>-<id>/` holding `run-<id>.wandb` (the
transaction log: run record with the config, history rows, summary updates, exit record), `files/output.log`,
`files/requirements.txt` and `logs/debug*.log`. It writes no `files/config.yaml` or `files/wandb-summary.json`
offline (those appear only once the run is synced), so config and summary are read from the transaction log.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from conftest import SHORT, compose_typed

from exp.core.config import ConfigError
from exp.core.secrets import REDACTED, redact
from exp.run.tracking import resolve_wandb_mode

FAKE_SECRETS = {"HF_TOKEN": "hf_FAKESECRET123", "MY_SERVICE_PASSWORD": "pw_FAKESECRET456"}
WANDB_SHORT = SHORT + ["logger=wandb", "trainer.max_steps=5", "trainer.val_every_n_steps=5", "data.num_examples=120"]


# --- reading an offline run ------------------------------------------------------------------------------------


def wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` transaction log (LevelDB log framing: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    # Header: ":W&B", magic 0xBEE1 (little-endian), format version 0.
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:  # zeros: nothing was written past here
            break
        if kind == 1:  # FULL
            pending, raw = b"", chunk
        elif kind == 2:  # FIRST
            pending = chunk
            continue
        elif kind == 3:  # MIDDLE
            pending += chunk
            continue
        else:  # LAST
            raw, pending = pending + chunk, b""
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def _items(updates) -> dict:
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in updates}


def read_offline_run(run_dir: Path) -> dict:
    """Config, history rows, final summary and exit code of the one offline W&B run under `run_dir`."""
    records = wandb_records(next(run_dir.glob("run-*.wandb")))
    kinds = [r.WhichOneof("record_type") for r in records]
    config: dict = {}
    summary: dict = {}
    history: list[dict] = []
    for r, kind in zip(records, kinds, strict=True):
        if kind == "run":
            config.update(_items(r.run.config.update))
        elif kind == "config":
            config.update(_items(r.config.update))
        elif kind == "summary":
            summary.update(_items(r.summary.update))
        elif kind == "history":
            history.append(_items(r.history.item))
    exits = [r.exit.exit_code for r, k in zip(records, kinds, strict=True) if k == "exit"]
    return {"config": config, "summary": summary, "history": history, "exit_codes": exits, "kinds": kinds}


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory):
    """One short wandb run with no W&B credentials, launched from an empty directory, fake secrets in the env."""
    from exp.train import run

    launch = tmp_path_factory.mktemp("launch")
    home = tmp_path_factory.mktemp("home")  # no ~/.netrc, no ~/.config/wandb: a machine that never logged in
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(launch)
        for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_DIR"):
            mp.delenv(name, raising=False)
        mp.setenv("HOME", str(home))
        for name, value in FAKE_SECRETS.items():
            mp.setenv(name, value)
        result = run(WANDB_SHORT, output_dir=tmp_path_factory.mktemp("wandb_run") / "run")
    return result, launch


@pytest.mark.slow
def test_offline_run_lands_in_the_run_dir(offline_run):
    result, launch = offline_run
    import wandb

    assert wandb.run is None, "the W&B run is finished when training ends"
    runs = sorted((result.output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].is_dir(), runs
    run_dir = runs[0]
    log_files = list(run_dir.glob("run-*.wandb"))
    assert len(log_files) == 1 and log_files[0].stat().st_size > 0
    assert log_files[0].name == f"run-{run_dir.name.rsplit('-', 1)[1]}.wandb"  # offline-run-<time>-<id>
    assert (run_dir / "files" / "output.log").exists()
    assert "val loss" in (run_dir / "files" / "output.log").read_text()  # the console summary is captured
    assert (run_dir / "logs" / "debug.log").exists()
    # Nothing of W&B (nor of the run) lands in the directory the run was launched from.
    assert list(launch.iterdir()) == []
    assert not (Path(launch) / "wandb").exists()


@pytest.mark.slow
def test_offline_run_records_the_resolved_config(offline_run):
    result, _ = offline_run
    rec = read_offline_run(next((result.output_dir / "wandb").glob("offline-run-*")))
    config = rec["config"]
    assert config["model"]["name"] == "gemma_tiny"
    assert config["lora"]["r"] == 8 and config["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert config["trainer"]["max_steps"] == 5  # the override, not the default
    assert config["logger"]["wandb"] is True and config["logger"]["mode"] == "auto"
    # The same resolved config the run dir's config.yaml holds.
    from omegaconf import OmegaConf

    on_disk = OmegaConf.to_container(OmegaConf.load(result.output_dir / "config.yaml"))
    assert {k: v for k, v in config.items() if k != "_wandb"} == on_disk
    assert rec["exit_codes"] == [0]


@pytest.mark.slow
def test_offline_run_summary_holds_final_metrics(offline_run):
    result, _ = offline_run
    rec = read_offline_run(next((result.output_dir / "wandb").glob("offline-run-*")))
    summary, history = rec["summary"], rec["history"]
    # W&B stores logged tensors as float32: equal to the float64 result to float32 precision.
    assert summary["val/loss"] == pytest.approx(result.final_val["val/loss"], rel=1e-6)
    assert summary["val/token_accuracy"] == pytest.approx(result.final_val["val/token_accuracy"], rel=1e-6)
    train_losses = [row["train/loss"] for row in history if "train/loss" in row]
    assert len(train_losses) == 5
    assert summary["train/loss"] == pytest.approx(train_losses[-1])
    # The step-0 evaluation is in the history too, and agrees with the result.
    val_rows = [row for row in history if "val/loss" in row]
    assert val_rows[0]["trainer/global_step"] == 0
    assert val_rows[0]["val/loss"] == pytest.approx(result.initial_val["val/loss"], rel=1e-6)


@pytest.mark.slow
def test_no_secret_from_the_environment_reaches_any_file(offline_run):
    result, launch = offline_run
    files = [p for p in result.output_dir.rglob("*") if p.is_file()]
    wandb_files = [p for p in files if "wandb" in p.parts]
    assert any(p.suffix == ".wandb" for p in wandb_files) and any(p.name == "debug.log" for p in wandb_files)
    # The scan sees what the files hold: the model name is in the binary log, the checkpoint and the config.
    assert b"gemma_tiny" in next(p for p in wandb_files if p.suffix == ".wandb").read_bytes()
    for path in files + [p for p in launch.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        for secret in FAKE_SECRETS.values():
            assert secret.encode() not in data, f"{secret} leaked into {path}"


# --- redaction -----------------------------------------------------------------------------------------------


def test_redact_replaces_secret_values_in_nested_dicts_and_lists():
    config = {
        "api_key": "k-1",
        "WANDB_API_KEY": "k-2",
        "hf_token": "hf_abc",
        "password": "p-1",
        "secret": "s-1",
        "model": {"name": "gemma_tiny", "hub-api-key": "k-3", "arch": {"hidden_size": 128}},
        "services": [{"db_password": "p-2", "host": "db"}, {"Client_Secret": "s-2"}, "plain"],
        "credentials": {"user": "me", "passwd": "p-3"},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
        "hf_token_unset": None,  # nothing to hide: the config still says no token was given
    }
    before = json.dumps(config, sort_keys=True)
    out = redact(config)
    assert json.dumps(config, sort_keys=True) == before, "redact returns a copy"
    for key in ("api_key", "WANDB_API_KEY", "hf_token", "password", "secret", "credentials"):
        assert out[key] == REDACTED, key
    assert out["model"] == {"name": "gemma_tiny", "hub-api-key": REDACTED, "arch": {"hidden_size": 128}}
    assert out["services"] == [{"db_password": REDACTED, "host": "db"}, {"Client_Secret": REDACTED}, "plain"]
    assert out["lora"] == config["lora"]
    assert out["hf_token_unset"] is None
    assert not any(s in json.dumps(out) for s in ("k-1", "k-2", "k-3", "hf_abc", "p-1", "p-2", "p-3", "s-1", "s-2"))


def test_redact_leaves_the_real_training_config_alone():
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.structured(compose_typed(["logger=wandb"])), enum_to_str=True)
    assert redact(config) == config


@pytest.mark.parametrize("key", ["tokenizer", "tokenizer_name", "max_new_tokens", "tokens_per_s", "max_tokens"])
def test_redact_keeps_innocent_token_count_keys(key):
    assert redact({key: 128}) == {key: 128}


# --- choosing the W&B mode -------------------------------------------------------------------------------------


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # netrc looks for ~/.netrc: there is none
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)


def test_auto_mode_without_credentials_is_offline(no_credentials):
    assert resolve_wandb_mode(compose_typed(["logger=wandb"]).logger) == "offline"


def test_online_mode_without_credentials_is_a_config_error(no_credentials):
    cfg = compose_typed(["logger=wandb", "logger.mode=online"]).logger
    with pytest.raises(ConfigError, match="WANDB_API_KEY"):
        resolve_wandb_mode(cfg)


def test_auto_mode_with_a_key_but_no_server_is_offline_quickly(no_credentials, monkeypatch: pytest.MonkeyPatch):
    from exp.run import tracking

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    assert tracking._has_wandb_credentials(), "the key is seen, so the reachability check is what decides"
    # Quickly: the one network call is a connection attempt bounded by a timeout of seconds (the bound is what is
    # checked, not the wall-clock, which a busy machine stretches).
    timeouts = []
    real_connect = tracking.socket.create_connection

    def connect(address, timeout=None, **kwargs):
        timeouts.append(timeout)
        return real_connect(address, timeout=timeout, **kwargs)

    monkeypatch.setattr(tracking.socket, "create_connection", connect)
    assert resolve_wandb_mode(compose_typed(["logger=wandb"]).logger) == "offline"
    assert timeouts and all(t is not None and 0 < t <= 5 for t in timeouts)
    with pytest.raises(ConfigError, match="127.0.0.1:9"):
        resolve_wandb_mode(compose_typed(["logger=wandb", "logger.mode=online"]).logger)


def test_wandb_mode_offline_in_the_environment_wins(no_credentials, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_wandb_mode(compose_typed(["logger=wandb", "logger.mode=online"]).logger) == "offline"


# --- the CLI as a user runs it -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_default_runs_offline_without_prompting(default_run):
    # conftest's `default_run`: `python -m exp.train` as the README gives it, no WANDB_* variable, a HOME with no
    # ~/.netrc (a machine that never ran `wandb login`); test_default_run reads what the same run learned.
    proc, run_dir, launch = default_run
    steps = compose_typed([]).trainer
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb")), list((run_dir / "wandb").iterdir())
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert f"{steps.max_steps} steps" in proc.stdout
    output = proc.stdout + proc.stderr
    assert "Create a W&B account" not in output and "Enter your choice" not in output  # W&B's login prompt
    assert list(launch.iterdir()) == []  # no wandb/, no outputs/: nothing lands where the run was launched
    # The console is concise: no Lightning or W&B boilerplate; the step-0 evaluation is named as such.
    assert "GPU available" not in output and "wandb: WARNING" not in output and "v_num" not in output
    assert "Step-0 evaluation" in proc.stdout and "Sanity Checking" not in proc.stdout
    # train.log holds everything: third-party INFO lines, the metrics of every logged step, the summary.
    log = (run_dir / "train.log").read_text()
    assert "GPU available: False" in log and "W&B: offline run" in log
    assert "step 0: val/exact_match=0" in log  # the step-0 evaluation
    every = steps.log_every_n_steps
    for step in range(every, steps.max_steps + 1, every):
        assert f"step {step}: train/grad_norm=" in log, step
    assert "train/loss=" in log
    assert f"step {steps.max_steps}: val/exact_match=" in log
    assert f"summary\nexp: {steps.max_steps} steps in" in log and "adapter " in log


def test_without_the_wandb_package_metrics_still_go_to_csv(tmp_path, monkeypatch, caplog):
    """A GPU image or cluster node without wandb: a warning and the CSV, not a crash; online insists."""
    import exp.run.tracking as tracking
    from exp.core.config import ConfigError, LoggerConfig, WandbMode

    monkeypatch.setattr(tracking, "wandb_installed", lambda: False)
    with caplog.at_level("WARNING", logger="exp.run.tracking"):
        ids: dict = {}
        loggers = tracking.build_loggers(LoggerConfig(wandb=True), tmp_path, "run", {}, tracking_ids=ids)
    assert [type(lg).__name__ for lg in loggers] == ["AtomicCSVLogger"]
    assert "wandb package is not installed" in caplog.text and "pip install wandb" in caplog.text
    run_id = ids["wandb"]  # still chosen: the run resumed where wandb is installed gets one W&B run
    assert len(run_id) == 8 and run_id.isalnum() and run_id == run_id.lower()
    with pytest.raises(ConfigError, match="logger.mode=online: the wandb package is not installed"):
        tracking.build_loggers(LoggerConfig(wandb=True, mode=WandbMode.online), tmp_path, "run", {})
