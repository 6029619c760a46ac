"""Signal or seed noise: the statistics `python -m exp.report` shows for a study whose configurations ran with
several seeds.

Jobs that differ only in their seed are one configuration: the study's swept keys (`swept_keys`, the override keys
whose value differs between jobs) except the seed's name it (`config_label`), and its completed jobs are grouped
under it (`config_groups`).

Per configuration: the mean of the final metric over its seeds, the sample standard deviation (n - 1), and a 95%
confidence interval of the mean from Student's t distribution (mean +- t(0.975, n - 1) x sd / sqrt(n)), which is
wide for few seeds, as it should be: with 2 seeds t is 12.7.

Which differences are larger than their seed noise: every configuration is compared with the best one (lowest
mean; highest for a metric where higher is better, `higher_better`, such as a preference accuracy) by Welch's two-sample t-test (two-sided; unequal variances, so a noisier configuration does not borrow the
other's spread), and the p-values of these comparisons are corrected for their number with Holm's step-down
method. A configuration "differs" when its corrected p-value is below 0.05. With one seed per configuration there
is no spread to compare against: no interval and no test, and the report says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, TypeVar

from scipy import stats

from exp.run.overrides import SEED_KEYS

ALPHA = 0.05
CONFIDENCE = 0.95
TEST_NAME = "Welch's t-test against the best configuration, two-sided, Holm-corrected, alpha 0.05"


@dataclass
class ConfigStats:
    """One configuration's final metric over its seeds."""

    config: str
    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / self.n

    @property
    def std(self) -> float | None:
        """Sample standard deviation (n - 1); None for one seed."""
        if self.n < 2:
            return None
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (self.n - 1))

    @property
    def interval(self) -> tuple[float, float] | None:
        """95% confidence interval of the mean (Student's t); None for one seed."""
        if self.std is None:
            return None
        half = stats.t.ppf(0.5 + CONFIDENCE / 2, self.n - 1) * self.std / math.sqrt(self.n)
        return self.mean - half, self.mean + half


@dataclass
class Comparison:
    """One configuration against the best."""

    config: str
    p: float | None  # Welch's two-sided p-value; None: not testable (one seed in either)
    p_holm: float | None  # after Holm's correction over all comparisons with the best
    differs: bool  # the difference is larger than the seed noise (p_holm < ALPHA)


def welch_p(a: list[float], b: list[float]) -> float | None:
    """Welch's two-sided t-test p-value; None with fewer than two values in either sample. Two samples without
    any spread are equal (p = 1) or certainly different (p = 0)."""
    if len(a) < 2 or len(b) < 2:
        return None
    sa, sb = ConfigStats("a", a), ConfigStats("b", b)
    if sa.std == 0 and sb.std == 0:
        return 1.0 if sa.mean == sb.mean else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment: the i-th smallest of m p-values times (m - i), kept monotone, capped at 1."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def _order(higher_better: bool):
    """Best first: the lowest mean, or the highest where higher is better (ties by name)."""
    return lambda g: (-g.mean if higher_better else g.mean, g.config)


def best_of(groups: list[ConfigStats], higher_better: bool = False) -> ConfigStats:
    return min(groups, key=_order(higher_better))


def compare_with_best(groups: list[ConfigStats], higher_better: bool = False) -> list[Comparison]:
    """Every configuration but the best, tested against it (Holm-corrected over these comparisons)."""
    if not groups:
        return []
    best = best_of(groups, higher_better)
    others = [g for g in groups if g is not best]
    raw = [welch_p(g.values, best.values) for g in others]
    testable = [i for i, p in enumerate(raw) if p is not None]
    corrected = holm([raw[i] for i in testable])  # type: ignore[misc]
    adjusted: list[float | None] = [None] * len(others)
    for i, p in zip(testable, corrected, strict=True):
        adjusted[i] = p
    return [
        Comparison(g.config, raw[i], adjusted[i], adjusted[i] is not None and adjusted[i] < ALPHA)
        for i, g in enumerate(others)
    ]


@dataclass
class Ranked:
    """One configuration in the study's ranking, with its verdict against the best."""

    stats: ConfigStats
    verdict: str  # "best", "differs", "within noise", or "untested" (one seed in it or in the best)
    p_holm: float | None  # the corrected p-value of its comparison with the best; None: the best, or untested


def rank(groups: list[ConfigStats], higher_better: bool = False) -> list[Ranked]:
    """Every configuration, best (lowest mean; `higher_better`: highest) first, with its verdict against the best."""
    if not groups:
        return []
    best = best_of(groups, higher_better)
    verdicts = {c.config: c for c in compare_with_best(groups, higher_better)}
    ranked = []
    for st in sorted(groups, key=_order(higher_better)):
        c = verdicts.get(st.config)
        if st is best:
            ranked.append(Ranked(st, "best", None))
        elif c is None or c.p_holm is None:
            ranked.append(Ranked(st, "untested", None))
        else:
            ranked.append(Ranked(st, "differs" if c.differs else "within noise", c.p_holm))
    return ranked


class JobResult(Protocol):
    """What grouping needs of a job (the report's rows): its state, final metric and overrides."""

    status: str
    final: float | None
    overrides: dict[str, str]


Job = TypeVar("Job", bound=JobResult)


def swept_keys(jobs: list[Job]) -> list[str]:
    """Override keys whose value differs between jobs: the study's parameters."""
    known = [r for r in jobs if r.overrides]
    return sorted({k for r in known for k in r.overrides if len({x.overrides.get(k) for x in known}) > 1})


def config_label(job: JobResult, swept: list[str]) -> str:
    """A configuration: the swept values of a job except its seed ("-" when the seed is all that varies)."""
    return ",".join(f"{k}={job.overrides.get(k, '')}" for k in swept if k not in SEED_KEYS) or "-"


def config_groups(jobs: list[Job]) -> dict[str, list[Job]]:
    """The completed jobs with a final metric, by configuration (repeats with other seeds together)."""
    swept = swept_keys(jobs)
    groups: dict[str, list[Job]] = {}
    for r in jobs:
        if r.status == "completed" and r.final is not None:
            groups.setdefault(config_label(r, swept), []).append(r)
    return groups
