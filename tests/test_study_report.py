"""Seeds as a sweep axis and the study report: the statistics against values computed by hand, `seeds=N`, the
`--plan` of a study, and a real 4-job study (2 configurations x 2 seeds) on the CPU, packed two at a time by the
`gpus` launcher on a simulated GPU, through the report and a re-launch."""

from __future__ import annotations

import csv
import json
import math
import shutil
import statistics

import pytest
from test_sweeps import exp

from exp.run.overrides import expand_seeds
from exp.study.stats import ConfigStats, compare_with_best, holm, welch_p

# --- statistics, by hand --------------------------------------------------------------------------------------


def test_mean_sd_and_interval_of_two_seeds():
    st = ConfigStats("a", [1.0, 3.0])
    assert st.mean == 2.0 and st.std == pytest.approx(math.sqrt(2))  # ((1-2)^2 + (3-2)^2) / (2-1) = 2
    low, high = st.interval
    # t(0.975, 1) = 12.7062047 (tables); half-width = t x sd / sqrt(2) = 12.7062 x 1
    assert (low, high) == pytest.approx((2 - 12.7062047, 2 + 12.7062047))


def test_interval_of_three_seeds():
    st = ConfigStats("a", [4.0, 5.0, 6.0])  # sd 1; t(0.975, 2) = 4.30265273 (tables)
    assert st.interval == pytest.approx((5 - 4.30265273 / math.sqrt(3), 5 + 4.30265273 / math.sqrt(3)))


def test_one_seed_has_no_spread_interval_or_test():
    st = ConfigStats("a", [1.5])
    assert st.std is None and st.interval is None
    assert welch_p([1.5], [2.0, 2.1]) is None


def test_welch_p_value_against_the_closed_form():
    # a = [1, 3], b = [5, 7]: variances 2 and 2, se = sqrt(2/2 + 2/2) = sqrt(2), t = -4 / sqrt(2) = -2.828;
    # Welch's df = (1 + 1)^2 / (1^2 / 1 + 1^2 / 1) = 2. For df = 2, P(T > t) = (1 - t / sqrt(t^2 + 2)) / 2, so
    # p = 1 - sqrt(8) / sqrt(10) = 0.1055728.
    assert welch_p([1.0, 3.0], [5.0, 7.0]) == pytest.approx(1 - math.sqrt(8 / 10), rel=1e-6)
    assert welch_p([1.0, 1.0], [1.0, 1.0]) == 1.0 and welch_p([1.0, 1.0], [2.0, 2.0]) == 0.0  # no spread at all


def test_holm_adjustment():
    # sorted: 0.01 x 3 = 0.03; 0.03 x 2 = 0.06; 0.04 x 1 = 0.04 -> kept monotone at 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_differences_larger_than_the_seed_noise_are_marked():
    groups = [
        ConfigStats("best", [1.00, 1.02, 0.98]),
        ConfigStats("far", [2.00, 2.02, 1.98]),  # 50 standard deviations away
        ConfigStats("near", [1.01, 1.05, 0.97]),  # within the noise
    ]
    verdicts = {c.config: c for c in compare_with_best(groups)}
    assert set(verdicts) == {"far", "near"}
    assert verdicts["far"].differs and verdicts["far"].p_holm < 0.05
    assert not verdicts["near"].differs and verdicts["near"].p_holm > 0.05
    assert verdicts["far"].p_holm == pytest.approx(min(1, 2 * verdicts["far"].p))  # the smaller p, times 2


# --- seeds=N -------------------------------------------------------------------------------------------------


def test_seeds_shorthand_repeats_every_configuration():
    argv, problems = expand_seeds(["-m", "lora.r=4,8", "seeds=3", "hydra.job.config.override_dirname.exclude_keys=[a]"])
    assert not problems
    assert argv == [
        "-m",
        "lora.r=4,8",
        "trainer.seed=range(3)",
        "lora.init_seed=${trainer.seed}",
        "hydra.job.config.override_dirname.exclude_keys=[a,lora.init_seed]",
    ]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["seeds=2"], "add -m"),
        (["-m", "seeds=0"], "a whole number >= 1"),
        (["-m", "seeds=two"], "seeds=two"),
        (["-m", "seeds=2", "trainer.seed=5"], "drop one of them"),
    ],
)
def test_seeds_shorthand_bad_input(argv, expected):
    _, problems = expand_seeds(argv)
    assert len(problems) == 1 and expected in problems[0]


def test_seeds_on_the_command_line_says_what_is_wrong_and_writes_nothing(tmp_path):
    proc = exp(["exp.train", "seeds=2"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("exp: error: seeds=2 repeats every configuration")
    assert list(tmp_path.iterdir()) == []


# --- a real study ---------------------------------------------------------------------------------------------

STUDY = [
    "trainer.max_steps=20",
    "trainer.warmup_steps=0",
    "trainer.val_every_n_steps=10",
    "trainer.log_every_n_steps=1",
    "trainer.sample_count=0",
    "trainer.limit_val_batches=2",
    "data.num_examples=160",
    "logger=csv",
]
PACKED = ["hydra/launcher=gpus", "hydra.launcher.pack=true", "hydra.launcher.devices=[0]"]
# Two tiny CPU jobs (exp's estimate 0.55 GiB each, 0.61 GiB with 10% headroom) fit in the simulated GPU at once.
MEMORY = "hydra.launcher.memory_gib=[1.25]"
EXCLUDE = "hydra.job.config.override_dirname.exclude_keys=[" + ",".join(a.split("=")[0] for a in STUDY) + "]"


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("study")
    args = ["exp.train", "-m", *PACKED, MEMORY, "seeds=2", "trainer.learning_rate=2e-3,5e-3", *STUDY, EXCLUDE]
    args.append("hydra.sweep.dir=multirun/study")
    env = {"OMP_NUM_THREADS": "1"}  # two jobs share this machine's two cores
    first = exp(args, cwd, env=env)
    report = exp(["exp.report", "multirun/study"], cwd)
    again = exp(args, cwd, env=env)
    return cwd, cwd / "multirun" / "study", first, report, again


@pytest.mark.slow
def test_study_runs_packed_two_at_a_time_and_records_its_decisions(study):
    _, sweep, first, _, _ = study
    assert first.returncode == 0, first.stderr[-3000:]
    events = [json.loads(line) for line in (sweep / "placements.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    assert [e["running_before"] for e in starts] == [0, 1, 1, 1]  # two at once, the next as one ends
    assert all(e["reserve_gib"] == pytest.approx(1.1 * e["estimate_gib"], rel=0.01) for e in starts)
    ends = [e for e in events if e["event"] == "end"]
    assert len(ends) == 4 and {e["status"] for e in ends} == {"completed"}
    configs = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/sweep_job.json")}
    seeds = sorted((c["config"]["trainer"]["seed"], c["config"]["lora"]["init_seed"]) for c in configs.values())
    assert seeds == [(0, 0), (0, 0), (1, 1), (1, 1)]  # the adapters' initialisation follows the seed
    assert all("init_seed" not in name for name in configs)


@pytest.mark.slow
def test_report_groups_seeds_with_mean_sd_interval_and_test(study):
    _, sweep, _, report, _ = study
    assert report.returncode == 0, report.stderr[-3000:]
    rows = list(csv.DictReader((sweep / "configurations.csv").open()))
    assert [r["seeds"] for r in rows] == ["2", "2"]
    for r in rows:
        finals = [
            json.loads((d / "summary.json").read_text())["final_val"]["val/loss"]
            for d in sweep.iterdir()
            if d.is_dir()
            and r["configuration"].split("=")[1]
            in json.dumps(json.loads((d / "sweep_job.json").read_text())["config"]["trainer"]["learning_rate"])
        ]
        assert len(finals) == 2
        assert float(r["mean val/loss"]) == pytest.approx(statistics.mean(finals), rel=1e-3)
        assert float(r["std"]) == pytest.approx(statistics.stdev(finals), rel=1e-3)
    assert rows[0]["vs best"] == "best" and rows[1]["vs best"] in ("differs", "within noise")
    assert "Welch's t-test against the best configuration" in report.stdout
    assert "plan vs what happened" in report.stdout and "wall-clock: estimated" in report.stdout
    png = sweep / "loss_curves_by_config.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert not (sweep / "val_loss_vs_trainer.seed.png").exists()  # a seed is no parameter


@pytest.mark.slow
def test_report_of_one_seed_per_configuration_says_so(study, tmp_path):
    cwd, sweep, _, _, _ = study
    one = tmp_path / "one_seed"
    for d in sweep.iterdir():
        if d.is_dir() and "trainer.seed=0" in d.name:
            shutil.copytree(d, one / d.name)
    proc = exp(["exp.report", str(one)], cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "one seed per configuration: no standard deviation, interval or test" in proc.stdout
    rows = list(csv.DictReader((one / "configurations.csv").open()))
    assert [(r["seeds"], r["std"], r["95% interval"]) for r in rows] == [("1", "-", "-")] * 2


@pytest.mark.slow
def test_relaunch_reuses_every_job_and_starts_none(study):
    _, sweep, _, _, again = study
    assert again.returncode == 0, again.stderr[-3000:]
    assert (again.stdout + again.stderr).count("already completed with this config, skipped") == 4
    events = [json.loads(line) for line in (sweep / "placements.jsonl").read_text().splitlines()]
    launches = [e["launch"] for e in events if e["event"] == "plan"]
    assert len(launches) == 2  # the first launch's lines are kept
    assert not [e for e in events if e["event"] == "start" and e["launch"] == launches[1]]


@pytest.mark.slow
def test_plan_of_the_next_study_uses_the_recorded_throughput_and_writes_nothing(study):
    cwd, _, _, _, _ = study
    before = sorted(p for p in cwd.rglob("*"))
    args = ["exp.train", "-m", *PACKED, MEMORY, "seeds=2", "trainer.learning_rate=1e-3,3e-3", *STUDY, EXCLUDE]
    proc = exp([*args, "hydra.sweep.dir=multirun/next", "--plan"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "study plan: 4 job(s), 4 to run" in out and "packed by memory on 1 GPU(s) (0: 1.2 GiB" in out
    assert "estimated wall-clock:" in out and "without a recorded throughput" not in out
    assert "multirun/study/" in out  # the step time comes from the first study's runs
    assert "at most 2 at once" in out
    assert sorted(p for p in cwd.rglob("*")) == before
