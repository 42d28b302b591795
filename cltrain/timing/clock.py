"""The one clock of cltrain's timing and of every benchmark: wall seconds, the device synchronised at each read.

``sync`` says what runs before each clock read: ``None`` (nothing), a device (``torch.cuda.synchronize`` on a CUDA
device, nothing on another), or any callable. On CUDA a step returns once its kernels are queued; without the sync
a window would time the launches, not the work.

Example::

    >>> from cltrain.timing.clock import Stopwatch, timed
    >>> seconds = timed(lambda: sum(range(1000)), sync="cpu")
    >>> with Stopwatch() as watch:
    ...     _ = sum(range(1000))
    >>> seconds > 0 and watch.seconds > 0
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Union

import torch

__all__ = ["Stopwatch", "Sync", "sync_hook", "synchronize", "timed"]

#: What runs before each clock read: nothing, a device's synchronisation, or a callable.
Sync = Union[Callable[[], object], torch.device, str, None]


def synchronize(device: torch.device | str) -> None:
    """Wait for the kernels queued on ``device`` (CUDA; nothing elsewhere), so a wall-clock read follows the work."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_hook(sync: Sync) -> Callable[[], object] | None:
    """The callable ``sync`` stands for; ``None`` where there is nothing to wait for (no sync, a CPU device)."""
    if sync is None or callable(sync):
        return sync
    device = torch.device(sync)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


class Stopwatch:
    """Seconds since :meth:`start`; as a context manager, the seconds of the block in :attr:`seconds`.

    Args:
        sync: what runs before each clock read (:data:`Sync`).
    """

    def __init__(self, sync: Sync = None) -> None:
        self.sync = sync_hook(sync)
        self.began = 0.0
        self.seconds = 0.0

    def start(self) -> Stopwatch:
        """Start (or restart) the watch; returns it."""
        if self.sync is not None:
            self.sync()
        self.began = time.perf_counter()
        return self

    def elapsed(self) -> float:
        """Seconds since the start; the watch keeps running."""
        if self.sync is not None:
            self.sync()
        return time.perf_counter() - self.began

    def lap(self) -> float:
        """Seconds since the start or the last lap, and the watch restarted at that same reading (back-to-back
        intervals, none of the time between them lost)."""
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        seconds, self.began = now - self.began, now
        return seconds

    def __enter__(self) -> Stopwatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.seconds = self.elapsed()


def timed(fn: Callable[[], object], sync: Sync = None) -> float:
    """Seconds of one call of ``fn``, ``sync`` run before each of the two clock reads."""
    with Stopwatch(sync) as watch:
        fn()
    return watch.seconds
