"""What a researcher sees of a preference run (docs/objectives.md): `exp.preview` shows pairs with their loss masks
and the row numbers of what was skipped, dropped or cut; every preference metric reaches the progress bar,
csv/metrics.csv, W&B and summary.json; `exp.evaluate` scores held-out pairs with validation's numbers; `exp.report`
tabulates them; the memory estimate and the preflight count a pair as two rows plus a reference forward; a killed
DPO run resumes to the bitwise-identical result."""

from __future__ import annotations

import csv
import json
import logging
import math
import signal
from pathlib import Path

import pytest
import torch
from conftest import compose_typed

from exp.core.config import ConfigError, DataConfig, DataFormat
from exp.core.constants import IGNORE_INDEX
from exp.data.preference import collate_preference, encode_rows

SHORT = [
    "trainer.max_steps=4",
    "trainer.val_every_n_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.sample_count=0",
    "data.num_examples=96",
    "data.val_size=16",
]
RATES = ("accuracy", "rewards/chosen", "rewards/rejected", "rewards/margin", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def tokenizer():
    from exp.model.build import build_tokenizer

    return build_tokenizer(compose_typed([]).model)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def _pairs_file(path: Path) -> Path:
    """Chat pairs with a bad row at 1 (no rejected), one at 3 (conversations that share no prompt), a prompt too
    long at 4 and a completion cut at 5."""
    good = {
        "chosen": [_user("Name a colour."), _assistant("red")],
        "rejected": [_user("Name a colour."), _assistant("dog")],
    }
    long_prompt = [_user("word " * 300)]
    rows = [
        good,
        {"chosen": good["chosen"]},
        good,
        {"chosen": good["chosen"], "rejected": [_user("Other."), _assistant("x")]},
        {"chosen": [*long_prompt, _assistant("a")], "rejected": [*long_prompt, _assistant("b")]},
        {"chosen": [_user("Say it."), _assistant("long " * 300)], "rejected": [_user("Say it."), _assistant("no")]},
        *[good] * 6,
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- bad rows and their numbers ----------------------------------------------------------------------------------


def test_dropped_and_cut_rows_are_numbered(tokenizer, tmp_path, caplog):
    rows = [json.loads(line) for line in _pairs_file(tmp_path / "pairs.jsonl").read_text().splitlines()]
    cfg = DataConfig(format=DataFormat.preference, max_seq_len=128)
    with caplog.at_level(logging.WARNING, logger="exp.data.preference"):
        examples, counts = encode_rows(cfg, rows, tokenizer, "pairs.jsonl")
    assert [i for i, _ in counts["bad"]] == [1, 3] and counts["bad_rows"] == 2
    assert counts["too_long_rows"] == [4] and counts["truncated_rows"] == [5] and counts["truncated"] == 1
    assert [e.row for e in examples] == [0, 2, 5, 6, 7, 8, 9, 10, 11]
    assert "row 1: missing 'rejected'; row 3:" in caplog.text  # skipped, with why
    assert "data.max_seq_len=128: row 4" in caplog.text  # dropped, with its number
    with pytest.raises(ConfigError, match=r"2 of 12 rows .*row 1: missing 'rejected'; row 3: .*data\.on_bad_rows=skip"):
        encode_rows(DataConfig(format=DataFormat.preference, on_bad_rows="fail"), rows, tokenizer, "pairs.jsonl")


# --- exp.preview ---------------------------------------------------------------------------------------------------


def _preview(capsys, *args: str) -> tuple[int, str]:
    from exp.preview import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_preview_shows_pairs_their_masks_and_the_dropped_rows(tmp_path, capsys):
    path = _pairs_file(tmp_path / "pairs.jsonl")
    code, out = _preview(capsys, "objective=dpo", "data.format=preference", f"data.path={path}", "data.val_size=2")
    assert code == 0, out
    # The prompt carries no loss (marked), the completions do (unmarked), each as its training row masks it.
    assert "--- pair 0 (row " in out
    assert "  prompt      [[<bos><start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n]]" in out
    assert "  chosen      red<end_of_turn>" in out and "  rejected    dog<end_of_turn>" in out
    assert "bad rows          2 skipped (data.on_bad_rows=skip): row 1: missing 'rejected'; row 3: " in out
    assert "prompt too long   1: row 4 " in out and "truncated         1: row 5 " in out
    assert "pairs kept        9 (train 7, val 2)" in out
    assert "per train batch   14 rows for 7 pairs (2 rows per pair: chosen, then rejected)" in out

    code, out = _preview(
        capsys, "objective=dpo", "data.format=preference", f"data.path={path}", "data.on_bad_rows=fail"
    )
    assert code != 0 and "row 1: missing 'rejected'; row 3:" in out  # refused, with the row numbers


def test_preview_of_kto_shows_labelled_completions(capsys):
    code, out = _preview(capsys, "objective=kto", "data.num_examples=40", "data.val_size=8", "n=4")
    assert code == 0, out
    assert "--- example 0 (row " in out and "with loss" in out
    assert ("  desirable   " in out) or ("  undesirable " in out)
    assert "examples kept     40 (train 32, val 8)" in out and "desirable         " in out
    assert "KTO's reference point" in out


def test_preview_masks_are_the_collated_labels(tokenizer):
    """The preview cuts its completions from the collated rows: what it leaves unmarked is what has a label."""
    from exp.preview import render_pair

    (e,), _ = encode_rows(
        DataConfig(format=DataFormat.preference), [{"prompt": "Say red.", "chosen": "red", "rejected": "blue"}],
        tokenizer, "x",
    )  # fmt: skip
    lines = render_pair(tokenizer, e)
    assert lines[0].startswith("  prompt      [[<bos>Say red.]]")
    assert lines[1] == "  chosen      red<eos>" and lines[2] == "  rejected    blue<eos>"
    batch = collate_preference([e], tokenizer.pad_token_id)
    assert (batch["labels"][0][: len(e.prompt)] == IGNORE_INDEX).all()


# --- metrics: progress bar, metrics.csv, W&B, summary.json; exp.evaluate; exp.report -----------------------------------


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """A short DPO run under W&B (offline: no credentials here), which also writes csv/metrics.csv."""
    from exp.train import run

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path_factory.mktemp("launch"))
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_DIR"):
            mp.delenv(name, raising=False)
        return run(["objective=dpo", "logger=wandb", *SHORT], output_dir=tmp_path_factory.mktemp("dpo") / "run")


def _csv_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_every_preference_metric_reaches_the_progress_bar_csv_wandb_and_summary(dpo_run):
    from test_tracking import read_offline_run

    run_dir = dpo_run.output_dir
    rows = _csv_rows(run_dir)
    train = [r for r in rows if r.get("train/loss")]
    val = [r for r in rows if r.get("val/loss")]
    assert [int(r["step"]) for r in train] == [1, 2, 3, 4] and [int(r["step"]) for r in val] == [0, 2, 4]
    for rate in RATES:
        assert all(math.isfinite(float(r[f"train/{rate}"])) for r in train), rate
        assert all(math.isfinite(float(r[f"val/{rate}"])) for r in val), rate
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {f"val/{k}" for k in RATES} <= summary["final_val"].keys()
    assert float(val[-1]["val/accuracy"]) == pytest.approx(summary["final_val"]["val/accuracy"])
    # W&B (the offline run's transaction log): the same metrics in its history and its summary.
    wandb = read_offline_run(next((run_dir / "wandb").glob("offline-run-*")))
    logged = set().union(*(h.keys() for h in wandb["history"]))
    assert {f"train/{k}" for k in RATES} | {f"val/{k}" for k in RATES} <= logged
    assert wandb["summary"]["val/rewards/margin"] == pytest.approx(summary["final_val"]["val/rewards/margin"])
    # The progress bar: the loss, accuracy and margin, of training and validation.
    shown = dpo_run.module.trainer.progress_bar_metrics
    assert {"train/accuracy", "train/rewards/margin", "val/accuracy", "val/rewards/margin"} <= shown.keys()
    assert "train/logps/chosen" not in shown  # the rest go to the loggers only


@pytest.mark.slow
def test_evaluate_reports_the_runs_final_validation_numbers(dpo_run, tmp_path, capsys):
    from exp.evaluate import evaluate

    report = evaluate([f"run={dpo_run.output_dir}"])
    final = json.loads((dpo_run.output_dir / "summary.json").read_text())["final_val"]
    assert report["objective"] == "dpo" and report["pairs"] == 16
    for k in ("loss", *RATES):
        assert report[k] == pytest.approx(final[f"val/{k}"], rel=1e-5, abs=1e-6), k
    assert json.loads((dpo_run.output_dir / "eval.json").read_text())["accuracy"] == report["accuracy"]
    # A file of pairs in place of the held-out split: every usable row, the bad ones skipped.
    other = evaluate([f"run={dpo_run.output_dir}", f"data={_pairs_file(tmp_path / 'pairs.jsonl')}"])
    assert other["pairs"] == 9 and other["data"]["format"] == "preference" and 0 <= other["accuracy"] <= 1


@pytest.mark.slow
def test_report_tabulates_preference_metrics_and_ranks_accuracy_highest_first(dpo_run, tmp_path, capsys):
    import shutil

    from exp.report import main

    worse = tmp_path / "worse"
    shutil.copytree(dpo_run.output_dir, worse, ignore=shutil.ignore_patterns("wandb", "checkpoints"))
    summary = json.loads((worse / "summary.json").read_text())
    summary["final_val"]["val/accuracy"] = -1.0  # below any real run's
    (worse / "summary.json").write_text(json.dumps(summary))
    assert main([str(dpo_run.output_dir), str(worse), f"out={tmp_path / 'out'}", "metric=val/accuracy"]) == 0
    out = capsys.readouterr().out
    header, first, second = out.splitlines()[:3]
    for column in ("final val/accuracy", "val/rewards/margin", "val/rewards/chosen", "val/logps/rejected"):
        assert column in header
    assert first.startswith("run ") and second.startswith("worse ")  # higher accuracy first
    configs = (tmp_path / "out" / "configurations.csv").read_text()
    assert "mean val/accuracy" in configs and "val/rewards/margin mean ± sd" in configs


@pytest.mark.slow
def test_kto_evaluate_equals_its_validation(tmp_path):
    """KTO's reference point is estimated within a batch: evaluate batches as validation does, in the run's layout
    (padding-free rows here; the DPO run above is padded)."""
    from exp.evaluate import evaluate
    from exp.train import run

    result = run(["objective=kto", "logger=csv", "hardware.padding_free=true", *SHORT], output_dir=tmp_path / "kto")
    assert "padding_free: true" in (result.output_dir / "config.yaml").read_text()
    report = evaluate([f"run={result.output_dir}"])
    for k in ("loss", *RATES):
        assert report[k] == pytest.approx(result.final_val[f"val/{k}"], rel=1e-5, abs=1e-6), k


def test_preference_rates_are_the_same_from_tensors_and_floats():
    from exp.training.objectives import preference_rates, preference_split_rates

    sums = {"pairs": 4.0, "loss": 2.0, "accuracy": 3.0, "rewards_chosen": 0.4, "rewards_rejected": -0.2,
            "rewards_margin": 0.6, "logps_chosen": -40.0, "logps_rejected": -48.0, "desirable": 3.0}  # fmt: skip
    for s in (sums, {k: v for k, v in sums.items() if k != "desirable"}):
        floats = preference_rates(s)
        tensors = preference_rates({k: torch.tensor(v, dtype=torch.float64) for k, v in s.items()})
        assert all(isinstance(v, torch.Tensor) for v in tensors.values())
        assert preference_split_rates({k: torch.tensor(v) for k, v in s.items()}) == pytest.approx(floats)
        assert {k: float(v) for k, v in tensors.items()} == pytest.approx(floats)
    assert preference_rates(sums)["rewards/rejected"] == pytest.approx(-0.2)  # KTO: over its one undesirable


# --- memory estimate and preflight ---------------------------------------------------------------------------------


def _estimate(overrides: list[str]):
    from exp.hardware.memory import estimate_for_config

    cfg = compose_typed(["model=gemma_2b", "model.random_init=true", "hardware.precision=bf16-mixed",
                         "hardware.compile=false", *overrides])  # fmt: skip
    return estimate_for_config(cfg)


@pytest.mark.parametrize("loss_impl", ["hf", "chunked"])
def test_a_pair_is_two_rows_and_a_reference_forward(loss_impl):
    impl = [f"hardware.loss_impl={loss_impl}", "hardware.micro_batch_size=4", "trainer.global_batch_size=8"]
    sft = _estimate(impl)
    sft_twice = _estimate([*impl[:1], "hardware.micro_batch_size=8", "trainer.global_batch_size=8"])
    orpo, dpo = _estimate(["objective=orpo", *impl]), _estimate(["objective=dpo", *impl])
    kto = _estimate(["objective=kto", *impl])
    assert orpo.details["rows_per_example"] == 2 and orpo.details["tokens"] == sft_twice.details["tokens"]
    assert orpo.total == sft_twice.total  # no reference: 4 pairs cost what 8 examples do
    assert orpo.details["phase_reference_forward_bytes"] == 0
    assert dpo.details["phase_reference_forward_bytes"] > 0 and dpo.total >= orpo.total
    assert kto.total == dpo.total  # B examples + B KL rows, and a reference forward
    assert sft.details["rows_per_example"] == 1 and sft.total < orpo.total


def test_the_reference_forward_can_be_the_peak():
    """With an MLP narrower than 3 x hidden the reference forward (the policy's saved activations, its kept hidden
    states and the reference's transients) outgrows the last layer's backward."""
    from exp.hardware.memory import estimate_memory

    arch = {"vocab_size": 1024, "hidden_size": 2048, "intermediate_size": 4096, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256}  # fmt: skip
    kwargs = dict(quant_type="nf4", double_quant=True, lora_r=8, lora_targets=["q_proj", "v_proj"], seq_len=512,
                  micro_batch_size=4, gradient_checkpointing=False, loss_impl="chunked", rows_per_example=2)  # fmt: skip
    with_ref = estimate_memory(arch, reference_forward=True, **kwargs)
    without = estimate_memory(arch, reference_forward=False, **kwargs)
    assert with_ref.peak_phase == "reference_forward" and with_ref.total > without.total
    assert with_ref.logits_and_loss > 0


def test_preflight_keeps_pairs_padding_free_without_a_token_budget():
    from exp.hardware.preflight import Environment, check

    cpu_twin = check(compose_typed(["hardware=gpu", "hardware.accelerator=cpu", "objective=dpo"]), Environment())
    assert cpu_twin.ok, cpu_twin.findings
    assert cpu_twin.cfg.hardware.padding_free is True and cpu_twin.cfg.hardware.micro_batch_tokens is None
    assert not any("is not used" in n for n in cpu_twin.notes)
    sft = check(compose_typed(["hardware=gpu", "hardware.accelerator=cpu"]), Environment())
    assert sft.cfg.hardware.padding_free is True


def test_auto_micro_batch_counts_pairs_as_two_rows():
    from exp.hardware.memory import estimate_for_config
    from exp.hardware.preflight import Environment, Gpu, check

    env = Environment(torch_cuda="13.0", gpus=[Gpu("NVIDIA H200", 140 * 2**30, 139 * 2**30, (9, 0))])
    base = ["model=gemma_7b", "model.random_init=true", "hardware=gpu", "data.max_seq_len=2048",
            "trainer.global_batch_size=8", "hardware.compile=true", "hardware.memory_budget_gib=60"]  # fmt: skip
    sft = check(compose_typed([*base, "hardware.padding_free=false"]), env)
    dpo = check(compose_typed([*base, "objective=dpo"]), env)
    assert sft.ok and dpo.ok, (sft.findings, dpo.findings)
    assert dpo.cfg.hardware.padding_free is True and dpo.cfg.hardware.micro_batch_tokens is None
    assert dpo.cfg.hardware.micro_batch_size < sft.cfg.hardware.micro_batch_size
    assert estimate_for_config(dpo.cfg).total <= 60 * 2**30


# --- resume ----------------------------------------------------------------------------------------------------------

RESUME = [
    "objective=dpo",
    "trainer.max_steps=12",
    "trainer.val_every_n_steps=6",
    "trainer.checkpoint_every_n_steps=3",
    "trainer.log_every_n_steps=1",
    "trainer.sample_count=0",
    "data.num_examples=160",
    "data.val_size=16",
    "logger=csv",
]


@pytest.mark.slow
def test_a_killed_dpo_run_resumes_to_the_bitwise_identical_result(tmp_path):
    from test_resume import adapter, cli, whole_and_killed

    whole, killed = whole_and_killed(tmp_path, "step-000003.ckpt", *RESUME)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert killed.returncode == -signal.SIGKILL
    resumed = cli(tmp_path, *RESUME, "trainer.resume=auto", "hydra.run.dir=resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = json.loads((tmp_path / "resumed" / "resume.json").read_text())
    assert record["run"] == str((tmp_path / "killed").resolve()) and record["step"] >= 3

    def per_step(*dirs: Path) -> dict[int, dict[str, str]]:
        out: dict[int, dict[str, str]] = {}
        for d in dirs:
            out |= {int(r["step"]): r for r in _csv_rows(d) if r.get("train/loss")}
        return out

    keys = ["train/loss", *(f"train/{k}" for k in RATES)]
    ref, got = per_step(tmp_path / "whole"), per_step(tmp_path / "killed", tmp_path / "resumed")
    assert sorted(ref) == sorted(got) == list(range(1, 13))
    assert {s: [r[k] for k in keys] for s, r in got.items()} == {s: [r[k] for k in keys] for s, r in ref.items()}
    a, b = adapter(tmp_path / "whole"), adapter(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    final = [json.loads((tmp_path / d / "summary.json").read_text())["final_val"] for d in ("whole", "resumed")]
    assert final[0] == final[1]
