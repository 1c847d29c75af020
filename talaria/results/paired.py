"""Paired comparisons over seeds (pure statistics, no I/O).

Two policies run on the same traces (one per seed) give one difference per
seed; the figure is the median of those differences and its 95% interval a
percentile bootstrap over seeds (resampling seeds with replacement, the
median of each resample). The resampling draws from a seeded generator, so a
table is reproducible bit for bit.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True, slots=True)
class Paired:
    n: int
    median: float
    low: float   # 95% percentile-bootstrap interval of the median
    high: float


def relative_differences(subject: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Per seed, (subject - reference) / reference: negative where the subject is faster."""
    if len(subject) != len(reference):
        raise ValueError(f"unpaired: {len(subject)} against {len(reference)} values")
    if any(r <= 0 for r in reference):
        raise ValueError("reference values must be positive")
    return [s / r - 1.0 for s, r in zip(subject, reference)]


def bootstrap_median(values: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                     confidence: float = 0.95, seed: int = BOOTSTRAP_SEED) -> Paired:
    """The median of `values` and its percentile-bootstrap interval."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - confidence) / 2
    lo = meds[int(tail * (resamples - 1))]
    hi = meds[int(round((1 - tail) * (resamples - 1)))]
    return Paired(n=n, median=statistics.median(values), low=lo, high=hi)


def paired(subject: Sequence[float], reference: Sequence[float], **kw: object) -> Paired:
    """Median relative difference of subject against reference over seeds, with its interval."""
    return bootstrap_median(relative_differences(subject, reference), **kw)  # type: ignore[arg-type]


def meets(p: Paired, upper: float = 0.01) -> bool:
    """The target: the median difference <= 0 and the interval's upper end <= `upper`."""
    return p.median <= 0 and p.high <= upper
