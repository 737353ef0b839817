"""An upper confidence bound on a high quantile of output lengths, from a small sample.

The question the estimator answers: what cap will every row of the job stay under with 95%
confidence, given the lengths of a random sample? Formally, a value U computed from the sample
such that P(U >= q_0.95) >= 0.95, where q_0.95 is the true 95th percentile of the job's lengths.

Two methods, chosen by sample size:

* ``order-statistic`` (distribution-free): the k-th smallest sample value, for the smallest k
  with P(Binomial(n, 0.95) <= k - 1) >= 0.95. It holds for any distribution, but needs n >= 93
  before k falls below n (for smaller n the only candidate is the sample max, or nothing).
* ``lognormal-tolerance``: output lengths are positive and right-skewed, so the log-lengths are
  modelled as normal and the one-sided (0.95, 0.95) tolerance bound exp(mean + k * sd) is used,
  with k from the noncentral t distribution. Exact for log-normal lengths and conservative for
  lighter tails (uniform, gamma, capped lengths), which is what generation lengths look like.
  A shape far from that (two separate clusters of lengths, say) can be under-covered, which
  is why the default sample (100 rows) is large enough for the distribution-free method; the
  sample's answers are reused by the real run, so the larger sample costs next to nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class LengthBound:
    value: int
    method: str


@lru_cache(maxsize=256)
def order_statistic_rank(n: int, quantile: float = 0.95, confidence: float = 0.95) -> int | None:
    """The 1-based rank k of the distribution-free bound, or None when no rank below n works."""
    from scipy import stats  # imported here: it takes seconds, and only a job that samples needs it

    for k in range(1, n):
        if stats.binom.cdf(k - 1, n, quantile) >= confidence:
            return k
    return None


@lru_cache(maxsize=256)
def tolerance_factor(n: int, quantile: float = 0.95, confidence: float = 0.95) -> float:
    """k such that mean + k * sd bounds the quantile of a normal population with that confidence."""
    from scipy import stats

    delta = stats.norm.ppf(quantile) * math.sqrt(n)
    return float(stats.nct.ppf(confidence, n - 1, delta) / math.sqrt(n))


def upper_bound(lengths: Sequence[int], quantile: float = 0.95, confidence: float = 0.95) -> LengthBound:
    """The bound for a sample of positive lengths (at least two values)."""
    n = len(lengths)
    if n < 2:
        raise ValueError("an upper bound needs a sample of at least two lengths")
    ordered = sorted(max(1, int(x)) for x in lengths)
    rank = order_statistic_rank(n, quantile, confidence)
    if rank is not None:
        return LengthBound(ordered[rank - 1], f"order-statistic (rank {rank} of {n})")
    logs = [math.log(x) for x in ordered]
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    factor = tolerance_factor(n, quantile, confidence)
    value = math.ceil(math.exp(mean + factor * sd))
    return LengthBound(value, f"lognormal-tolerance (k={factor:.3f}, n={n})")
