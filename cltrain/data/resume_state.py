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

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = ["ResumableSampler", "SeededIndex", "is_resumable", "loader_state_mismatch"]

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


class ResumableSampler(DistributedSampler):
    """The samples ``0..n-1`` of one epoch for one rank, shuffled (or in order) by ``(seed, epoch)`` alone, each with
    its own seed; ``start`` skips this rank's first ones once (a resumed epoch), then is back to 0.

    Under DDP every rank draws the same order and takes every ``num_replicas``-th sample from ``rank`` on, the order
    padded with its first samples to a multiple of the ranks, as ``DistributedSampler(drop_last=False)`` does; it is
    a ``DistributedSampler``, so Lightning keeps it and calls ``set_epoch``.

    Args:
        n: how many samples.
        seed: the run's seed; ``None`` draws one from the torch RNG when first needed (``seed_everything`` repeats it),
            or under DDP takes ``seed_everything``'s (``PL_GLOBAL_SEED``, else 0): every rank must draw the same.
        shuffle: a new order each epoch; ``False``: ``0..n-1``.
        num_replicas: the DDP world size; rank: this process's rank.
    """

    def __init__(self, n: int, seed: int | None = None, shuffle: bool = True, num_replicas: int = 1,
                 rank: int = 0) -> None:
        super().__init__(range(n), num_replicas=num_replicas, rank=rank, shuffle=shuffle, drop_last=False)
        self.n = n
        if seed is None and num_replicas > 1:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        self._seed = None if seed is None else int(seed)
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

    def skip(self, batches: int, batch_size: int | None) -> None:
        """Leave out this rank's first ``batches`` batches of the next epoch served (``ResumableLoader``)."""
        self.start = min(len(self), batches * (batch_size or 1))

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[SeededIndex]:
        g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch)
        order = torch.randperm(self.n, generator=g).tolist() if self.shuffle else list(range(self.n))
        seeds = torch.randint(0, 2**62, (self.n,), generator=g).tolist()
        # padded with the first samples to a multiple of the ranks, as DistributedSampler pads
        padded = [k % self.n for k in range(self.total_size)] if self.n else []
        mine = [padded[k] for k in range(self.rank, self.total_size, self.num_replicas)]
        start, self.start = self.start, 0
        for k in mine[start:]:
            yield SeededIndex(order[k], seeds[k])


def is_resumable(sampler: Any) -> bool:
    """Whether ``sampler`` can serve an epoch from a place in it: a ``ResumableSampler``, or a batch sampler with the
    same ``skip``, ``seed``, ``epoch``, ``n`` and ``num_replicas`` (``shard_sampler.ShardBatchSampler``)."""
    return all(hasattr(sampler, a) for a in ("skip", "seed", "epoch", "n", "num_replicas"))


def loader_state_mismatch(state: dict[str, Any], samples: int, batch_size: int | None, drop_last: bool,
                          ranks: int = 1) -> str | None:
    """What changed since ``state`` was saved (``None``: nothing that moves the samples), in a few words."""
    if state.get("format") != STATE_FORMAT:
        return f"its format {state.get('format')!r}, this version reads {STATE_FORMAT}"
    changed = [f"{name} {state.get(key, 1 if key == 'ranks' else None)!r} -> {now!r}" for name, key, now in
               (("samples", "samples", samples), ("batch size", "batch_size", batch_size),
                ("drop_last", "drop_last", drop_last), ("ranks", "ranks", ranks))
               if state.get(key, 1 if key == "ranks" else None) != now]
    return ", ".join(changed) or None
