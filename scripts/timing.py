"""The scripts' wall-clock timing: one call, a median of calls, interleaved rounds, and a stopwatch.

``sync`` is what runs before each clock read: ``None`` (nothing), a device (``torch.cuda.synchronize`` on a
CUDA device, nothing on another) or any callable. Example, two layouts' steps timed A B, B A, ... ::

    rates = interleaved(5, {"nchw": lambda: 10 / timed(lambda: steps(a, 10), sync=device),
                            "nhwc": lambda: 10 / timed(lambda: steps(b, 10), sync=device)}, rotate=True)
    speedup = statistics.median(rates["nhwc"]) / statistics.median(rates["nchw"])
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, Union

if TYPE_CHECKING:
    import torch

K = TypeVar("K")
T = TypeVar("T")
Sync = Union[Callable[[], object], "torch.device", str, None]


def _hook(sync: Sync) -> Callable[[], object] | None:
    """The callable ``sync`` stands for; ``None`` when there is nothing to wait for."""
    if sync is None or callable(sync):
        return sync
    import torch

    device = torch.device(sync)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


class Stopwatch:
    """Seconds since :meth:`start`; as a context manager, the seconds of the block in ``seconds``."""

    def __init__(self, sync: Sync = None) -> None:
        self.sync = _hook(sync)
        self.began = 0.0
        self.seconds = 0.0

    def start(self) -> Stopwatch:
        if self.sync is not None:
            self.sync()
        self.began = time.perf_counter()
        return self

    def elapsed(self) -> float:
        """Seconds since the start; the watch keeps running."""
        if self.sync is not None:
            self.sync()
        return time.perf_counter() - self.began

    def __enter__(self) -> Stopwatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.seconds = self.elapsed()


def timed(fn: Callable[[], object], sync: Sync = None) -> float:
    """Seconds of one call of ``fn`` (nothing else runs between the clock reads when ``sync`` is ``None``)."""
    hook = _hook(sync)
    if hook is None:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    hook()
    start = time.perf_counter()
    fn()
    hook()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 0, sync: Sync = None) -> float:
    """Median seconds of ``repeats`` calls of ``fn``, each timed alone, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, sync) for _ in range(repeats))


def rotated(items: Sequence[K], r: int) -> list[K]:
    """Round ``r``'s order of ``items``: each first in turn (A B, B A, A B, ... for two)."""
    k = r % len(items) if items else 0
    return [*items[k:], *items[:k]]


def interleaved(rounds: int, cases: Mapping[K, Callable[[], T]], rotate: bool = False) -> dict[K, list[T]]:
    """What each case returns, one call per case per round, in the order of ``cases`` (or :func:`rotated`)."""
    out: dict[K, list[T]] = {key: [] for key in cases}
    for r in range(rounds):
        for key in rotated(list(cases), r) if rotate else list(cases):
            out[key].append(cases[key]())
    return out
