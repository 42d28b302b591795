"""The loader's half of an exact resume: which samples an epoch has left, in which order, with which randomness.

``ResumableSampler`` draws an epoch's order and one seed per sample from ``(seed, epoch)`` alone, and hands each
index out as a ``SeededIndex`` that carries its sample's seed: the crop and flip of a sample are the same whatever
process, thread or worker count decodes it (``cltrain.data.loader_threads.start_batch`` reads the seed).
``PrefetchDataLoader`` keeps how many batches of the epoch its training steps took and gives it to Lightning's
stateful-loader protocol (``state_dict`` / ``load_state_dict``: the state travels in the checkpoint); resumed, the
epoch goes on from the next batch, and the main process's torch RNG is where it was at the save.

Example::

    >>> sampler = ResumableSampler(6, seed=3)
    >>> first = list(sampler)
    >>> sampler.start = 4                     # the first 4 were taken before the stop
    >>> list(sampler) == first[4:], first[0].seed == list(ResumableSampler(6, seed=3))[0].seed
    (True, True)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["ResumableSampler", "SeededIndex", "loader_state_mismatch"]

#: The version of ``PrefetchDataLoader.state_dict``'s layout.
STATE_FORMAT = 1


class SeededIndex(int):
    """A sample's index that carries the seed of the sample's randomness."""

    seed: int

    def __new__(cls, index: int, seed: int) -> SeededIndex:
        obj = super().__new__(cls, index)
        obj.seed = seed
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return SeededIndex, (int(self), self.seed)


class ResumableSampler(Sampler[int]):
    """The samples ``0..n-1`` of one epoch, shuffled (or in order) by ``(seed, epoch)`` alone, each with its own
    seed; ``start`` skips the first ones once (a resumed epoch), then is back to 0.

    Args:
        n: how many samples.
        seed: the run's seed; ``None`` draws one from the torch RNG (``seed_everything`` repeats it).
        shuffle: a new order each epoch; ``False``: ``0..n-1``.
    """

    def __init__(self, n: int, seed: int | None = None, shuffle: bool = True) -> None:
        self.n, self.shuffle = n, shuffle
        self._seed = None if seed is None else int(seed)
        self.epoch = 0
        self.start = 0

    @property
    def seed(self) -> int:
        """The run's seed: drawn from the torch RNG when first needed, unless given or restored."""
        if self._seed is None:
            self._seed = int(torch.randint(0, 2**62, ()).item())
        return self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._seed = int(value)

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this before every epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[SeededIndex]:
        g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch)
        order = torch.randperm(self.n, generator=g).tolist() if self.shuffle else list(range(self.n))
        seeds = torch.randint(0, 2**62, (self.n,), generator=g).tolist()
        start, self.start = self.start, 0
        for k in range(start, self.n):
            yield SeededIndex(order[k], seeds[k])


def loader_state_mismatch(state: dict[str, Any], samples: int, batch_size: int | None, drop_last: bool) -> str | None:
    """What changed since ``state`` was saved (``None``: nothing that moves the samples), in a few words."""
    if state.get("format") != STATE_FORMAT:
        return f"its format {state.get('format')!r}, this version reads {STATE_FORMAT}"
    changed = [f"{name} {state.get(key)!r} -> {now!r}" for name, key, now in
               (("samples", "samples", samples), ("batch size", "batch_size", batch_size),
                ("drop_last", "drop_last", drop_last)) if state.get(key) != now]
    return ", ".join(changed) or None
