"""The packing decisions of `hydra/launcher=gpus` (exp.run.placement) against simulated GPUs: never more reserved
on a GPU than it holds, jobs started in sweep order, a GPU backing off after an OOM, jobs too large for every GPU
rejected rather than waited for, and reused jobs never placed. Pure Python: no CUDA, no processes."""

from __future__ import annotations

import itertools
import random

import pytest

from exp.hardware.memory import GiB
from exp.hardware.preflight import Gpu
from exp.run.placement import JobDemand, Packer, simulate
from exp.run.study_plan import PlannedJob, Pool, packer_demands


def _jobs(*gib: float) -> list[JobDemand]:
    return [JobDemand(f"{i}_job", int(g * GiB)) for i, g in enumerate(gib)]


def _peak_reserved(sim, jobs: list[JobDemand]) -> dict[str, int]:
    """The most any GPU ever had reserved, from the simulated timeline (checked at every start)."""
    size = {j.job: j.reserve_bytes for j in jobs}
    peak: dict[str, int] = {}
    for s in sim.jobs:
        live = [o for o in sim.jobs if o.gpu == s.gpu and o.start_s <= s.start_s < o.end_s]
        peak[s.gpu] = max(peak.get(s.gpu, 0), sum(size[o.job] for o in live))
    return peak


def test_no_gpu_is_ever_oversubscribed_in_random_studies():
    rng = random.Random(0)
    for _ in range(200):
        gpus = {str(i): int(rng.choice([24, 40, 80, 141]) * GiB) for i in range(rng.randint(1, 4))}
        largest = max(gpus.values()) / GiB
        jobs = _jobs(*(rng.uniform(1, largest) for _ in range(rng.randint(1, 16))))
        seconds = {j.job: rng.uniform(10, 100) for j in jobs}
        for shared in (False, True):
            sim = simulate(gpus, jobs, seconds, shared_compute=shared)
            assert sorted(s.job for s in sim.jobs) == sorted(j.job for j in jobs)  # every job ran, once
            for gpu, peak in _peak_reserved(sim, jobs).items():
                assert peak <= gpus[gpu]


def test_jobs_start_in_sweep_order_and_a_large_job_is_not_overtaken():
    # One 80 GiB GPU: 3 x 25 GiB run at once. The 70 GiB job waits for them, and the 5 GiB jobs behind it wait too,
    # although one would fit in the 5 GiB left: slipping past could starve the large job for ever in a long sweep.
    jobs = _jobs(25, 25, 25, 70, 5, 5)
    sim = simulate({"0": 80 * GiB}, jobs, dict.fromkeys((j.job for j in jobs), 10.0))
    start = {s.job: s.start_s for s in sim.jobs}
    order = [s.job for s in sorted(sim.jobs, key=lambda s: (s.start_s, s.job))]
    assert order == [j.job for j in jobs]
    assert start["0_job"] == start["1_job"] == start["2_job"] == 0
    assert start["3_job"] == start["4_job"] == start["5_job"] == 10  # 70 + 5 + 5 = 80: all fit once the GPU is free
    assert sim.makespan_s == 20
    assert sim.most_at_once == 3


def test_packed_jobs_share_the_hosts_cores_for_compiling(monkeypatch):
    from hydra_plugins.exp_gpu_launcher.launcher import compile_threads

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert compile_threads(1) is None  # one job at a time: torch's own default
    assert compile_threads(4) == 4
    assert compile_threads(16) == 1
    assert compile_threads(40) == 1
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")
    assert compile_threads(4) is None  # the user's setting is passed on untouched


def test_jobs_spread_over_gpus_before_doubling_up():
    packer = Packer({"0": 80 * GiB, "1": 80 * GiB}, _jobs(10, 10, 10))
    placed = packer.start_ready()
    assert [p.gpu for p in placed] == ["0", "1", "0"]  # the second GPU before a second job on the first
    assert [p.running_before for p in placed] == [0, 0, 1]


def test_without_packing_one_job_per_gpu():
    jobs = _jobs(1, 1, 1)
    sim = simulate({"0": 80 * GiB, "1": 80 * GiB}, jobs, dict.fromkeys((j.job for j in jobs), 5.0), max_jobs_per_gpu=1)
    assert [(s.job, s.gpu, s.start_s) for s in sim.jobs] == [("0_job", "0", 0), ("1_job", "1", 0), ("2_job", "0", 5)]


def test_an_out_of_memory_job_makes_its_gpu_back_off():
    # Two 30 GiB jobs share an 80 GiB GPU; the first runs out of memory. The GPU now plans with 50 GiB: the third
    # job starts there only when it fits next to the second, and the fourth (40 GiB) only once that one ends.
    packer = Packer({"0": 80 * GiB}, _jobs(30, 30, 30, 40))
    assert [p.job for p in packer.start_ready()] == ["0_job", "1_job"]
    packer.finish("0_job", out_of_memory=True)
    assert packer.backoffs == [("0", "0_job", 80 * GiB, 50 * GiB)]
    assert packer.gpus["0"].capacity_bytes == 50 * GiB
    assert packer.start_ready() == []  # 30 + 30 > 50: the third waits
    packer.finish("1_job")
    assert [p.job for p in packer.start_ready()] == ["2_job"]
    packer.finish("2_job")
    assert [p.job for p in packer.start_ready()] == ["3_job"]
    packer.finish("3_job")
    assert packer.done


def test_back_off_in_simulation_and_the_other_gpu_keeps_its_memory():
    jobs = _jobs(40, 40, 40, 40, 40, 40)
    seconds = dict.fromkeys((j.job for j in jobs), 10.0)
    sim = simulate({"0": 80 * GiB, "1": 80 * GiB}, jobs, seconds, out_of_memory={"0_job"})
    assert sim.backoffs == [("0", "0_job", 80 * GiB, 40 * GiB)]
    assert [s.out_of_memory for s in sim.jobs].count(True) == 1
    assert all(peak <= 80 * GiB for peak in _peak_reserved(sim, jobs).values())
    after = [s for s in sim.jobs if s.gpu == "0" and s.start_s >= 10]
    for a, b in itertools.combinations(after, 2):  # GPU 0 never again runs two 40 GiB jobs at once
        assert a.end_s <= b.start_s or b.end_s <= a.start_s


def test_a_job_larger_than_every_gpu_is_rejected_and_the_rest_run():
    jobs = _jobs(10, 200, 10)
    sim = simulate({"0": 80 * GiB}, jobs, dict.fromkeys((j.job for j in jobs), 1.0))
    assert sim.rejected == ["1_job"] and sorted(s.job for s in sim.jobs) == ["0_job", "2_job"]


def test_after_a_back_off_to_nothing_the_waiting_jobs_are_rejected_not_waited_for():
    packer = Packer({"0": 10 * GiB}, _jobs(10, 5))
    assert [p.job for p in packer.start_ready()] == ["0_job"]
    packer.finish("0_job", out_of_memory=True)  # the GPU held less than 10 GiB: nothing is planned there
    assert packer.start_ready() == [] and [d.job for d in packer.take_rejected()] == ["1_job"] and packer.done


def test_a_relaunch_places_only_the_jobs_that_did_not_complete():
    pool = Pool("packed", {"0": 80 * GiB}, Gpu("sim", 80 * GiB, 80 * GiB, (9, 0)))
    jobs = [PlannedJob(0, "0_a", [], cfg=None, error="bad value"), PlannedJob(1, "1_b", [], cfg=object(), reuse="1_b")]
    jobs.append(PlannedJob(2, "2_c", [], cfg=object()))
    assert [d.job for d in packer_demands(jobs, pool)] == ["2_c"]  # the reused and the refused need no GPU


@pytest.mark.parametrize("headroom", [0.0, 0.1, 0.5])
def test_a_jobs_reservation_is_its_estimate_plus_headroom_and_its_budget_its_resolved_estimate(headroom):
    from conftest import compose_typed

    from exp.hardware.memory import estimate_for_config
    from exp.hardware.preflight import Environment, check
    from exp.run.job_cost import memory_demand

    cfg = compose_typed(["model=gemma_2b", "model.random_init=true", "hardware=gpu", "data.max_seq_len=512"])
    h200 = Gpu("NVIDIA H200", int(139.8 * GiB), int(139.8 * GiB), (9, 0))
    demand = memory_demand(cfg, h200, headroom)
    resolved = check(cfg, Environment(torch_cuda="13.0", gpus=[h200])).cfg
    assert demand.estimate_bytes == estimate_for_config(resolved).total
    assert demand.reserve_bytes == int(demand.estimate_bytes * (1 + headroom))
    assert demand.budget_gib * GiB >= demand.estimate_bytes > (demand.budget_gib - 0.01) * GiB
    # Given that budget, the job's own preflight makes the same choices (it never plans into others' memory).
    cfg.hardware.memory_budget_gib = demand.budget_gib
    again = check(cfg, Environment(torch_cuda="13.0", gpus=[h200])).cfg
    assert estimate_for_config(again).total == demand.estimate_bytes
    assert again.hardware.micro_batch_size == resolved.hardware.micro_batch_size
    assert again.hardware.dequantized_layers == resolved.hardware.dequantized_layers
