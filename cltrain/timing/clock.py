"""The one clock of cltrain's timing and of every benchmark: wall seconds, read two ways.

* ``Stopwatch`` / ``timed`` (benchmarks, a timed window): ``sync`` says what runs before each clock read: ``None``
  (nothing), a device (``torch.cuda.synchronize`` on a CUDA device, nothing on another), or any callable. On CUDA
  a step returns once its kernels are queued; without the sync a window would time the launches, not the work.
* ``StepTimer`` (a run's own steps, the hot loop): never waits for the device; on CUDA the step is bracketed by
  events whose time is read only when asked, long after.
* ``cpu_seconds``: CPU seconds (user + system) used so far by this process, its ended children or another process:
  what a window cost the cores, beside its wall seconds.

Example::

    >>> from cltrain.timing.clock import Stopwatch, timed
    >>> seconds = timed(lambda: sum(range(1000)), sync="cpu")
    >>> with Stopwatch() as watch:
    ...     _ = sum(range(1000))
    >>> seconds > 0 and watch.seconds > 0
    True
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from typing import Any, Union

import torch

__all__ = ["EventReading", "StepTimer", "Stopwatch", "Sync", "cpu_seconds", "sync_hook", "synchronize", "timed"]

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


def cpu_seconds(of: int | str = "self") -> float:
    """CPU seconds (user + system) used so far by ``of``: ``"self"`` (this process), ``"children"`` (its children
    that have ended and been waited for, DataLoader workers once joined) or a process id (Linux ``/proc``)."""
    if isinstance(of, int):
        with open(f"/proc/{of}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    used = resource.getrusage({"self": resource.RUSAGE_SELF, "children": resource.RUSAGE_CHILDREN}[of])
    return used.ru_utime + used.ru_stime


class StepTimer:
    """One step's wall time on ``device`` without waiting for it: ``time.perf_counter`` on the CPU; CUDA events on a
    GPU, read only when asked (``float(reading)`` waits for that event alone), so a step never waits for the device."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._start: Any = None

    def start(self) -> None:
        """Mark the step's start (an event queued behind the work already launched, on CUDA)."""
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> float | EventReading:
        """The time since ``start``: seconds, or a reading that gives them when asked."""
        if not self.cuda:
            return time.perf_counter() - self._start
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return EventReading(self._start, end)


class EventReading:
    """Seconds between two CUDA events, worked out when first asked (``float(reading)``)."""

    def __init__(self, start: Any, end: Any) -> None:
        self.start, self.end, self.seconds = start, end, None

    def __float__(self) -> float:
        if self.seconds is None:
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        return self.seconds
