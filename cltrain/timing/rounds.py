"""Cases run in interleaved rounds: the one way cltrain and its benchmarks compare things by time.

A machine gets busier or quieter while it measures; running the cases in turn, round after round, the order
rotating (A B, B A, ... for two; A B C, B C A, C A B for three), lets the drift fall on every case alike. What
each case gave is kept per round, and :func:`cltrain.timing.stats.spread` says its median and its range.

* :func:`interleaved`: each case a callable that makes one measurement (a loader pass, a whole fit, a child
  process) and returns it; ``warmup`` rounds first, not kept.
* :func:`time_steps`: each case a step (one training step, one call); ``warmup`` untimed steps per case, then
  the steps of a round sized so that the fastest case's window lasts ``min_window`` seconds (every case the same
  number of steps; ``size_each``: each case's own window that long, for cases of very different cost), each window timed
  by :mod:`cltrain.timing.clock` with the device synchronised at both ends. A case whose step raises one of
  ``catch`` is dropped with its error, the others go on.
* :func:`rate_after_first`: items per second of an iterator after its first item (a loader's workers start
  with the first batch).

Example, two steps compared::

    >>> from cltrain.timing.rounds import time_steps
    >>> timing = time_steps({"a": lambda: sum(range(100)), "b": lambda: sum(range(200))}, rounds=3)
    >>> sorted(timing.seconds), timing.steps, len(timing.seconds["a"])
    (['a', 'b'], {'a': 1, 'b': 1}, 3)
    >>> timing.per_step()["a"].median > 0
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from cltrain.timing.clock import Stopwatch, Sync, sync_hook, timed
from cltrain.timing.stats import Spread, spread

__all__ = ["StepTimes", "Throughput", "interleaved", "rate_after_first", "rotated", "time_steps"]

K = TypeVar("K")
T = TypeVar("T")

#: Steps timed per case to size the rounds, and the margin on the window they give: a round that runs faster than
#: its probe (the machine's other load drops) still lasts ``min_window``.
PROBE_STEPS, WINDOW_MARGIN = 3, 1.5


def rotated(items: Sequence[K], r: int) -> list[K]:
    """Round ``r``'s order of ``items``: each first in turn (A B, B A, A B, ... for two)."""
    k = r % len(items) if items else 0
    return [*items[k:], *items[:k]]


def interleaved(cases: Mapping[K, Callable[..., T]], rounds: int, *, warmup: int = 0, rotate: bool = True,
                with_round: bool = False) -> dict[K, list[T]]:
    """What each case returns, one call per case per round, the order :func:`rotated` (``rotate=False``: the
    order of ``cases``); ``warmup`` rounds run first and are not kept. ``with_round``: each case is called with the
    round's index (0, 1, ..., the warm-up rounds first), e.g. the seed that gives every case the same samples.

    Raises:
        ValueError: ``rounds`` < 1 or ``warmup`` < 0.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"interleaved: need rounds >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}.")
    out: dict[K, list[T]] = {key: [] for key in cases}
    for r in range(warmup + rounds):
        for key in rotated(list(cases), r - warmup) if rotate else list(cases):
            value = cases[key](r) if with_round else cases[key]()
            if r >= warmup:
                out[key].append(value)
    return out


@dataclass
class StepTimes(Generic[K]):
    """What :func:`time_steps` measured: per case, seconds per step of each round it ran, and the steps in its
    window; the first line of the error that dropped a case."""

    seconds: dict[K, list[float]]
    steps: dict[K, int]
    errors: dict[K, str] = field(default_factory=dict)

    def per_step(self) -> dict[K, Spread]:
        """Seconds per step of each case that kept a round."""
        return {k: spread(v) for k, v in self.seconds.items() if v}

    def rates(self, units: float = 1.0) -> dict[K, Spread]:
        """``units`` per second (samples in a step: images/s) of each case that kept a round, round by round."""
        return {k: spread(units / s for s in v) for k, v in self.seconds.items() if v}


def time_steps(steps: Mapping[K, Callable[[], object]], *, rounds: int = 3, warmup: int = 1, min_steps: int = 1,
               min_window: float = 0.0, max_steps: int = 1000, size_each: bool = False, sync: Sync = None,
               catch: tuple[type[BaseException], ...] = ()) -> StepTimes[K]:
    """Each case's step timed in interleaved rounds (the module docstring says how).

    Args:
        steps: the cases, each one step (it may return anything: a loss left on the device costs no sync).
        rounds: timed rounds; each case runs one window per round, the order rotating.
        warmup: untimed steps of each case first (allocator, kernel selection, caches, cuDNN's autotuning).
        min_steps: steps in a window, at least.
        min_window: seconds a window lasts, at least: the steps of a round are sized on the fastest case
            (``PROBE_STEPS`` timed steps each, ``WINDOW_MARGIN`` on top), up to ``max_steps``; 0: ``min_steps``.
        max_steps: steps in a window, at most.
        size_each: size each case's window on its own steps (cases of very different cost), not on the fastest.
        sync: run before each clock read (:data:`cltrain.timing.clock.Sync`: the device).
        catch: exceptions that drop a case (its error kept, the other cases go on); any other propagates.

    Raises:
        ValueError: ``rounds`` < 1, ``warmup`` < 0, ``min_steps`` < 1, ``max_steps`` < ``min_steps`` or
            ``min_window`` < 0.
    """
    if rounds < 1 or warmup < 0 or min_steps < 1 or max_steps < min_steps or min_window < 0:
        raise ValueError(f"time_steps: need rounds >= 1, warmup >= 0, 1 <= min_steps <= max_steps and min_window >= 0; "
                         f"got {rounds}, {warmup}, {min_steps}, {max_steps}, {min_window}.")
    hook, live, errors = sync_hook(sync), dict(steps), {}

    def window(key: K, n: int) -> float | None:
        def run() -> None:
            for _ in range(n):
                live[key]()
        try:
            return timed(run, hook)
        except catch as err:
            errors[key] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            del live[key]
            return None

    for key in list(live):
        if warmup:
            window(key, warmup)
    n = dict.fromkeys(steps, min_steps)
    if min_window > 0 and live:
        probes = {key: s / PROBE_STEPS for key in list(live) if (s := window(key, PROBE_STEPS)) is not None}
        for key in probes:
            per_step = probes[key] if size_each else min(probes.values())
            n[key] = max(min_steps, min(max_steps, math.ceil(WINDOW_MARGIN * min_window / max(per_step, 1e-9))))
    seconds: dict[K, list[float]] = {key: [] for key in steps}
    for r in range(rounds):
        for key in rotated(list(steps), r):
            if key in live and (took := window(key, n[key])) is not None:
                seconds[key].append(took / n[key])
    return StepTimes(seconds, n, errors)


@dataclass(frozen=True)
class Throughput:
    """Items counted over a timed window."""

    items: int
    seconds: float

    @property
    def per_second(self) -> float | None:
        """Items per second; ``None`` when nothing was counted."""
        return self.items / self.seconds if self.items and self.seconds > 0 else None


def rate_after_first(items: Iterable[T], count: Callable[[T], int] = lambda item: 1, *, limit: int | None = None,
                     sync: Sync = None) -> Throughput:
    """``count`` of each item of ``items`` after the first, over the seconds from the first item's end to the last's.

    The first item is taken untimed (worker start-up, a pipeline's first batch); ``count`` runs on every item
    (the first too), inside the window for the others: make it do what a consumer of the item would
    (normalise a batch, copy it to the device). ``limit``: at most this many items after the first.
    """
    it, watch, seen, taken = iter(items), Stopwatch(sync), 0, 0
    for item in it:
        count(item)
        break
    else:
        return Throughput(0, 0.0)
    watch.start()
    for item in it:
        seen += count(item)
        taken += 1
        if limit is not None and taken >= limit:
            break
    return Throughput(seen, watch.elapsed())
