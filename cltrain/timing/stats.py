"""The statistics of the timings: what a case's rounds say (median, range), and whether one case is faster than
another beyond the noise of their own samples.

* :func:`spread`: a case's values over rounds, the median to quote with the lowest and highest beside it;
* :func:`log_ratio`: the ratio of two cases' medians on a log scale, with a Student's t bound from the spread of
  the samples themselves;
* :func:`paired_log_ratio`: the same from samples taken in rounds, each round's ``b`` against its own ``a``, so a
  machine that drifts over the rounds cancels out (what ``LayoutRace`` decides by).

Example::

    >>> from cltrain.timing.stats import log_ratio, spread
    >>> spread([3.0, 1.0, 2.0]).cell(1)
    '2.0 (1.0-3.0)'
    >>> r = log_ratio([1.0, 1.01, 0.99, 1.0], [2.0, 2.02, 1.98, 2.0])
    >>> round(r.factor, 2), r.log - r.bound(0.999) > 0   # b twice a's time, beyond doubt
    (2.0, True)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Ratio", "Spread", "log_ratio", "paired_log_ratio", "spread", "t_quantile"]


@dataclass(frozen=True)
class Spread:
    """A case's values over rounds: the median to quote, the lowest and highest beside it."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        """The median value: the figure to quote."""
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        """The lowest value."""
        return min(self.values)

    @property
    def high(self) -> float:
        """The highest value."""
        return max(self.values)

    def cell(self, digits: int = 1, thousands: bool = False) -> str:
        """``"median (low-high)"`` with ``digits`` decimals (``thousands``: with a comma every three digits)."""
        f = f"{{:{',' if thousands else ''}.{digits}f}}".format
        return f"{f(self.median)} ({f(self.low)}-{f(self.high)})"


def spread(values: Iterable[float]) -> Spread:
    """The :class:`Spread` of ``values``.

    Raises:
        ValueError: no values.
    """
    kept = tuple(float(v) for v in values)
    if not kept:
        raise ValueError("spread: no values (no round was kept)")
    return Spread(kept)


@dataclass(frozen=True)
class Ratio:
    """``b``'s median over ``a``'s, on a log scale: ``log``, its standard error ``width`` (the samples' pooled
    spread, at least the floor asked) and the degrees of freedom ``df`` of that spread; ``medians`` of ``a``, ``b``."""

    log: float
    width: float
    df: int
    medians: tuple[float, float]

    @property
    def factor(self) -> float:
        """``b``'s median over ``a``'s."""
        return math.exp(self.log)

    def bound(self, level: float) -> float:
        """The one-sided ``level`` (0.999, 0.99 or 0.975) confidence bound on ``log``: Student's t times ``width``."""
        return t_quantile(self.df, level) * self.width


def log_ratio(a: Sequence[float], b: Sequence[float], *, spread_only: Iterable[float] = (),
              floor: float = 0.01) -> Ratio:
    """How much slower ``b`` is than ``a`` (seconds, positive): ``log(median b / median a)`` with the standard
    error of that log from the spread of each side's log-times around its mean, pooled (``spread_only``: more of
    ``a``'s samples that widen the spread, not the medians), never below ``floor`` per sample.

    Raises:
        ValueError: ``a`` or ``b`` empty.
    """
    if not a or not b:
        raise ValueError(f"log_ratio: need samples on both sides, got {len(a)} and {len(b)}.")
    medians = (statistics.median(a), statistics.median(b))
    groups = [[math.log(t) for t in [*a, *spread_only]], [math.log(t) for t in b]]
    df = sum(len(g) - 1 for g in groups)
    pooled = math.sqrt(sum((x - statistics.fmean(g)) ** 2 for g in groups for x in g) / df) if df > 0 else 0.0
    width = max(floor, pooled) * math.sqrt(1 / len(a) + 1 / len(b))
    return Ratio(math.log(medians[1] / medians[0]), width, df, medians)


def paired_log_ratio(a: Sequence[tuple[int, float]], b: Sequence[tuple[int, float]], *, around: bool = False,
                     floor: float = 0.01) -> Ratio:
    """How much slower ``b`` is than ``a`` from ``(round, seconds)`` samples: the mean over the rounds that hold
    both of ``mean log b - mean log a`` within the round, its standard error from the rounds' spread (never below
    ``floor`` per round), ``df`` one less than the rounds; ``medians`` of all of ``a`` and ``b``. A slow drift of
    the machine (another process starting, the clock changing) moves both sides of a round alike: it widens
    neither the ratio nor its bound, as it does where the samples are pooled. ``around``: the rounds run
    ``a a b b``, one after another, so a round's ``b`` samples are compared with its own ``a`` samples and the
    following round's together (``a a b b | a a``: ``b`` in the middle; a round with none after it, with its own
    alone), and a steady drift cancels too.

    Raises:
        ValueError: no round holds samples of both.

    Example::

        >>> drift = [1.0, 1.3, 1.6, 1.9]  # the machine slows down round by round; b is 10% slower throughout
        >>> r = paired_log_ratio([(i, d) for i, d in enumerate(drift)], [(i, 1.1 * d) for i, d in enumerate(drift)])
        >>> round(r.factor, 3), r.log - r.bound(0.999) > 0
        (1.1, True)
    """
    def by_round(samples: Sequence[tuple[int, float]]) -> dict[int, list[float]]:
        rounds: dict[int, list[float]] = {}
        for r, t in samples:
            rounds.setdefault(r, []).append(math.log(t))
        return rounds

    ra, rb = by_round(a), by_round(b)
    diffs = [statistics.fmean(rb[r]) - statistics.fmean([*ra[r], *ra.get(r + 1, ())] if around else ra[r])
             for r in sorted(ra.keys() & rb.keys())]
    if not diffs:
        raise ValueError(f"paired_log_ratio: no round holds samples of both ({len(a)} and {len(b)} samples).")
    sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    # around: neighbouring differences share a round's a samples (a correlation of 1/6 between them), so the mean's
    # variance is 4/3 of the independent rounds'
    width = max(floor, sd) / math.sqrt(len(diffs)) * (math.sqrt(4 / 3) if around and len(diffs) > 1 else 1.0)
    medians = (statistics.median(t for _, t in a), statistics.median(t for _, t in b))
    return Ratio(statistics.fmean(diffs), width, len(diffs) - 1, medians)


#: Student's t quantiles (one-sided) by degrees of freedom: few steps make a wide bound.
_T = {0.999: (318.3, 22.33, 10.21, 7.173, 5.893, 5.208, 4.785, 4.501, 4.297, 4.144, 4.025, 3.930, 3.852, 3.787, 3.733),
      0.99: (31.82, 6.965, 4.541, 3.747, 3.365, 3.143, 2.998, 2.896, 2.821, 2.764, 2.718, 2.681, 2.650, 2.624, 2.602),
      0.975: (12.71, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)}
_T_LIMIT = {0.999: 3.09, 0.99: 2.326, 0.975: 1.96}


def t_quantile(df: int, level: float) -> float:
    """The one-sided ``level`` (0.999, 0.99 or 0.975) quantile of Student's t with ``df`` degrees of freedom (the
    normal's beyond 30; ten times the first entry where there is no degree of freedom)."""
    table = _T[level]
    if df < 1:
        return table[0] * 10
    if df <= len(table):
        return table[df - 1]
    return table[-1] + (_T_LIMIT[level] - table[-1]) * min(1.0, (df - len(table)) / 15)
