"""The packing decisions of `hydra/launcher=gpus` (exp.study.placement) against simulated GPUs: never more reserved
on a GPU than it holds, jobs started in sweep order, a GPU backing off after an OOM, jobs too large for every GPU
rejected rather than waited for, and reused jobs never placed. Pure Python: no CUDA, no processes."""

from __future__ import annotations

import itertools
import random

import pytest

from exp.hardware.memory import GiB
from exp.hardware.preflight import Gpu
from exp.study.placement import JobDemand, Packer, simulate
from exp.study.plan import PlannedJob, Pool, packer_demands


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
    from exp.study.scheduler import compile_threads

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
    from exp.study.cost import memory_demand

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


def _study_job(r: int = 8, micro_batch: int | None = None):
    from conftest import compose_typed

    overrides = ["model=gemma_2b", "model.random_init=true", "hardware=gpu", "hardware.memory_budget_gib=7.5"]
    overrides += ["data.max_seq_len=512", f"lora.r={r}"]
    if micro_batch:
        overrides += ["hardware.auto_micro_batch=false", f"hardware.micro_batch_size={micro_batch}"]
    return compose_typed(overrides)


H200 = Gpu("NVIDIA H200", int(139.8 * GiB), int(139.8 * GiB), (9, 0))


def test_a_measured_peak_of_the_same_shape_sets_the_reservation():
    # The H200 study: Gemma-2B at 512 x 8 within 7.5 GiB, estimated to allocate 6.65 GiB, measured 11.75 GiB.
    from exp.study.cost import MemoryShape, StepRecord, memory_demand

    plain = memory_demand(_study_job(), H200, 0.1)
    assert plain.measured_from == "" and plain.reserve_bytes == int(plain.estimate_bytes * 1.1)
    peak = int(11.75 * GiB)
    record = StepRecord("runs/0_r8", "gemma_2b", "NVIDIA H200", 4096, 0.3, 20.0, peak, plain.shape)
    learnt = memory_demand(_study_job(r=16), H200, 0.1, [record])  # r=16: the same shape to the estimator
    outside = plain.estimate_bytes - plain.allocated_bytes  # CUDA context and cache slack, kept from the estimate
    assert learnt.measured_from == "runs/0_r8"
    assert learnt.reserve_bytes == int((peak + learnt.estimate_bytes - learnt.allocated_bytes) * 1.1)
    assert learnt.reserve_bytes > int((peak + outside) * 1.09)
    assert learnt.estimate_bytes == memory_demand(_study_job(r=16), H200, 0.1).estimate_bytes  # the estimate stays
    # Not learnt from: another GPU, another shape (a micro-batch of 1: another key, even with this job's very
    # estimate, since under a budget the preflight fills the budget and estimates of other shapes come close), the
    # same key with an estimate 20% apart (a rank large enough to matter), a peak within the estimate, or a run
    # without a peak.
    mb1_key = memory_demand(_study_job(micro_batch=1), H200, 0.1).shape.key
    assert mb1_key != plain.shape.key
    mb1 = MemoryShape(mb1_key, plain.allocated_bytes)
    big_rank = MemoryShape(plain.shape.key, int(plain.allocated_bytes * 1.2))
    for other in (
        StepRecord("a", "gemma_2b", "NVIDIA A100", 4096, 0.3, 20.0, peak, plain.shape),
        StepRecord("b", "gemma_2b", "NVIDIA H200", 4096, 0.3, 20.0, peak, mb1),
        StepRecord("c", "gemma_2b", "NVIDIA H200", 4096, 0.3, 20.0, peak, big_rank),
        StepRecord("d", "gemma_2b", "NVIDIA H200", 4096, 0.3, 20.0, plain.allocated_bytes - 1, plain.shape),
        StepRecord("e", "gemma_2b", "NVIDIA H200", 4096, 0.3, 20.0, None, None),
    ):
        assert memory_demand(_study_job(), H200, 0.1, [other]).reserve_bytes == plain.reserve_bytes, other.source


def test_a_completed_gpu_run_records_its_peak_and_the_estimate_of_its_config(tmp_path):
    import json

    from exp.hardware.memory import estimate_for_config
    from exp.hardware.preflight import Environment, check
    from exp.run.compose import write_run_config
    from exp.run.dirs import write_status
    from exp.study.cost import find_records, memory_shape

    resolved = check(_study_job(), Environment(torch_cuda="13.0", gpus=[H200])).cfg
    run = tmp_path / "study" / "0_lora.r=8"
    run.mkdir(parents=True)
    write_run_config(resolved, run)
    summary = {"steps": 100, "seconds": 60.0, "step_seconds_median": 0.3, "device": "cuda:0", "peak_memory_gib": 11.75}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "manifest.json").write_text(json.dumps({"hardware": {"gpus": ["NVIDIA H200"]}}))
    write_status(run, "completed")
    [record] = [r for r in find_records([tmp_path]) if r.source == str(run.resolve())]
    assert record.device == "NVIDIA H200" and record.peak_bytes == int(11.75 * GiB)
    assert (
        record.shape == memory_shape(resolved)
        and record.shape.allocated_bytes == estimate_for_config(resolved).allocated
    )


def test_waiting_jobs_of_the_measured_shape_reserve_more_and_wait_for_room():
    packer = Packer({"0": 100 * GiB}, _jobs(30, 30, 30, 30, 30))
    assert [p.job for p in packer.start_ready()] == ["0_job", "1_job", "2_job"]
    assert packer.raise_reservation("3_job", 60 * GiB) and not packer.raise_reservation("3_job", 50 * GiB)
    assert not packer.raise_reservation("0_job", 90 * GiB)  # running already: its reservation was taken
    packer.finish("0_job")
    assert packer.start_ready() == []  # 60 GiB does not fit beside two 30s; 30 would have
    packer.finish("1_job")
    assert [p.job for p in packer.start_ready()] == ["3_job"]


def test_the_launcher_raises_the_waiting_jobs_of_a_shape_after_a_measured_peak(tmp_path):
    import json

    from exp.study.cost import memory_demand
    from exp.study.scheduler import GpuScheduler

    scheduler = GpuScheduler(pack=True, headroom=0.1)
    small, other = memory_demand(_study_job(), H200, 0.1), memory_demand(_study_job(micro_batch=1), H200, 0.1)
    jobs = [PlannedJob(i, f"{i}_j", [], cfg=object(), memory=m) for i, m in enumerate([small, small, small, other])]
    packer = Packer({"0": int(139.8 * GiB)}, [JobDemand(j.name, j.memory.reserve_bytes) for j in jobs], 1)
    packer.start_ready()
    run = tmp_path / "0_j"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"peak_memory_gib": 11.75}))
    scheduler.learn_peak(tmp_path, "launch", packer, jobs, {j.name: i for i, j in enumerate(jobs)}, "0_j", run)
    reserve = {d.job: d.reserve_bytes for d in packer.pending}
    assert reserve["1_j"] == reserve["2_j"] > small.reserve_bytes * 1.5  # the same shape: raised
    assert jobs[1].memory.measured_from == str(run)
    assert reserve["3_j"] == other.reserve_bytes  # another micro-batch: another shape, left alone
    events = [json.loads(line) for line in (tmp_path / "placements.jsonl").read_text().splitlines()]
    assert [(e["event"], e["job"]) for e in events] == [("reserve_raised", "1_j"), ("reserve_raised", "2_j")]
