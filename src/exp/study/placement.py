"""Which sweep job runs on which GPU, and when: the packing decisions of `hydra/launcher=gpus`, as a pure class.

`Packer` is given each job's memory reservation (exp's estimate of its peak plus headroom, `exp.study.cost`) and
each GPU's memory (what was free at launch), and answers "which jobs start now, where" every time a job ends. It
never touches a device, so the same object drives the launcher, the `--plan` simulation (`simulate`) and the tests.

The rules, and why:
  * Never oversubscribe: a job starts on a GPU only when its reservation fits in what the jobs already running
    there leave of the GPU's capacity. Estimates are what stands between a sweep and a cascade of OOMs.
  * Fair start order: jobs start in sweep order. A job that fits nowhere yet waits, and the jobs behind it wait
    too, so a large job is never overtaken again and again by smaller ones (it would starve).
  * Spread: of the GPUs a job fits on, the one with the fewest running jobs (then the most room, then the first
    named). Jobs on one GPU share its compute; two GPUs each running one job finish sooner than one running two.
  * Back-off: a job that ran out of memory shows that the GPU held less than planned (the estimate was low, or
    another process took memory). That GPU's capacity shrinks by the failed job's reservation for the rest of
    the launch; jobs running there keep running, and new ones start there only within the smaller capacity.
  * Learning: a job that completed with an allocation peak above its estimate raises the reservation of the waiting
    jobs of the same shape to what it measured (the launcher calls `raise_reservation`): the estimator's error is
    paid once per launch, not once per job.
  * A job larger than every GPU's capacity would wait forever: it is rejected (the launcher records it as failed,
    with its estimate) and the jobs behind it go on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class JobDemand:
    """One job as the packer sees it."""

    job: str  # the job's name (its directory under the sweep)
    reserve_bytes: int  # counted against a GPU while the job runs: the estimate plus headroom


@dataclass
class GpuSlot:
    """One GPU: what the launcher may place on it, and what runs there now."""

    gpu: str
    capacity_bytes: int  # free memory at launch, lowered by back-offs
    max_jobs: int | None = None  # None: as many as fit in memory
    running: dict[str, int] = field(default_factory=dict)  # job -> reserved bytes

    @property
    def reserved_bytes(self) -> int:
        return sum(self.running.values())

    @property
    def room_bytes(self) -> int:
        return self.capacity_bytes - self.reserved_bytes

    def fits(self, demand: JobDemand) -> bool:
        if self.max_jobs is not None and len(self.running) >= self.max_jobs:
            return False
        return demand.reserve_bytes <= self.room_bytes

    def could_ever_fit(self, demand: JobDemand) -> bool:
        return demand.reserve_bytes <= self.capacity_bytes and (self.max_jobs is None or self.max_jobs > 0)


@dataclass(frozen=True)
class Placement:
    job: str
    gpu: str
    reserve_bytes: int
    room_before_bytes: int  # the GPU's room when the job started (for the log: why it fitted)
    running_before: int  # jobs already running on that GPU


class Packer:
    """Jobs -> GPUs over time. Call `start_ready()` at the start and after every `finish()`."""

    def __init__(self, gpus: dict[str, int], jobs: list[JobDemand], max_jobs_per_gpu: int | None = None) -> None:
        if not gpus:
            raise ValueError("Packer needs at least one GPU")
        self.gpus = {g: GpuSlot(g, int(cap), max_jobs_per_gpu) for g, cap in gpus.items()}
        self.pending: deque[JobDemand] = deque(jobs)
        self.where: dict[str, str] = {}  # running job -> GPU
        self.rejected: list[JobDemand] = []
        self.backoffs: list[tuple[str, str, int, int]] = []  # (GPU, job, capacity before, capacity after)

    def start_ready(self) -> list[Placement]:
        """Jobs to start now, in sweep order: the head of the queue as long as it fits somewhere."""
        started = []
        while self.pending:
            head = self.pending[0]
            if not any(slot.could_ever_fit(head) for slot in self.gpus.values()):
                self.rejected.append(self.pending.popleft())
                continue
            fitting = [slot for slot in self.gpus.values() if slot.fits(head)]
            if not fitting:
                break  # it waits for memory to free; so does everything behind it
            order = list(self.gpus)
            slot = min(fitting, key=lambda s: (len(s.running), -s.room_bytes, order.index(s.gpu)))
            started.append(Placement(head.job, slot.gpu, head.reserve_bytes, slot.room_bytes, len(slot.running)))
            slot.running[head.job] = head.reserve_bytes
            self.where[head.job] = slot.gpu
            self.pending.popleft()
        return started

    def finish(self, job: str, out_of_memory: bool = False) -> None:
        """A job ended; with `out_of_memory`, its GPU backs off by the job's reservation."""
        slot = self.gpus[self.where.pop(job)]
        reserved = slot.running.pop(job)
        if out_of_memory:
            before = slot.capacity_bytes
            slot.capacity_bytes = max(0, before - reserved)
            self.backoffs.append((slot.gpu, job, before, slot.capacity_bytes))

    def raise_reservation(self, job: str, reserve_bytes: int) -> bool:
        """A waiting job's reservation raised (a job of the same shape measured more than estimated); False when the
        job is not waiting or already reserves as much."""
        for i, demand in enumerate(self.pending):
            if demand.job == job:
                if reserve_bytes <= demand.reserve_bytes:
                    return False
                self.pending[i] = JobDemand(job, reserve_bytes)
                return True
        return False

    def take_rejected(self) -> list[JobDemand]:
        """Jobs found too large for every GPU since the last call (the caller records them as failed)."""
        out, self.rejected = self.rejected, []
        return out

    @property
    def done(self) -> bool:
        return not self.pending and not self.where


@dataclass(frozen=True)
class SimulatedJob:
    job: str
    gpu: str
    start_s: float
    end_s: float
    out_of_memory: bool = False


@dataclass
class Simulation:
    jobs: list[SimulatedJob]
    rejected: list[str]
    backoffs: list[tuple[str, str, int, int]]

    @property
    def makespan_s(self) -> float:
        return max((j.end_s for j in self.jobs), default=0.0)

    @property
    def most_at_once(self) -> int:
        """The most jobs running at one time, over all GPUs."""
        return max((sum(1 for o in self.jobs if o.start_s <= j.start_s < o.end_s) for j in self.jobs), default=0)


def simulate(
    gpus: dict[str, int],
    jobs: list[JobDemand],
    seconds: dict[str, float],
    *,
    max_jobs_per_gpu: int | None = None,
    shared_compute: bool = False,
    out_of_memory: frozenset[str] | set[str] = frozenset(),
) -> Simulation:
    """Run the packer against simulated GPUs: `seconds[job]` is how long the job takes alone on a GPU.

    shared_compute=False: jobs on one GPU do not slow each other (the best case for packing: each job leaves most
    of the GPU idle). True: the GPU's compute is shared evenly, so k jobs each progress at 1/k speed (the worst
    case: each job alone already kept the GPU busy). The truth lies between; the plan prints both.
    Jobs in `out_of_memory` fail at their end with an OOM, so the GPU backs off (for the tests).
    """
    packer = Packer(gpus, jobs, max_jobs_per_gpu)
    remaining: dict[str, float] = {}
    started: dict[str, tuple[str, float]] = {}
    done: list[SimulatedJob] = []
    rejected: list[str] = []
    now = 0.0
    while True:
        for p in packer.start_ready():
            remaining[p.job] = max(0.0, float(seconds[p.job]))
            started[p.job] = (p.gpu, now)
        rejected += [d.job for d in packer.take_rejected()]
        if not remaining:
            break

        def rate(job: str) -> float:
            return 1.0 / len(packer.gpus[packer.where[job]].running) if shared_compute else 1.0

        job = min(remaining, key=lambda j: (remaining[j] / rate(j), list(started).index(j)))
        step = remaining[job] / rate(job)
        for j in remaining:
            remaining[j] -= step * rate(j)
        now += step
        gpu, start = started.pop(job)
        del remaining[job]
        oom = job in out_of_memory
        packer.finish(job, out_of_memory=oom)
        done.append(SimulatedJob(job, gpu, start, now, oom))
    return Simulation(done, rejected, packer.backoffs)
