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
    >>> sampler.skip_samples(4)               # the epoch's first 4 were taken before the stop
    >>> list(sampler) == first[4:], first[0].seed == list(ResumableSampler(6, seed=3))[0].seed
    (True, True)

Resumed on another number of ranks, the epoch's samples not yet taken are split over the new ranks: each is read
once (padded, as ``DistributedSampler`` pads, to a multiple of the ranks), with its own seed; the batches are not the
uninterrupted run's, so neither are the weights.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = ["ResumableSampler", "SeededIndex", "consumed_samples", "is_resumable", "loader_state_mismatch"]

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
    its own seed; ``consumed`` leaves out the epoch's first ones once (a resumed epoch), then is back to 0.

    Under DDP every rank draws the same order and takes every ``num_replicas``-th sample from ``rank`` on, the order
    padded with its first samples to a multiple of the ranks, as ``DistributedSampler(drop_last=False)`` does; it is
    a ``DistributedSampler``, so Lightning keeps it and calls ``set_epoch``. ``k`` batches of ``b`` on each of ``r``
    ranks are the order's first ``k * b * r`` samples, whatever ``r`` was: the rest of the epoch splits the same way
    over any number of ranks.

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
        self.consumed = 0  # samples of the epoch's order taken before this iterator (all ranks together)

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
        self.skip_samples(batches * (batch_size or 1) * self.num_replicas)

    def skip_samples(self, consumed: int) -> None:
        """Leave out the first ``consumed`` samples of the next epoch's order, over all ranks."""
        self.consumed = min(max(consumed, 0), self.n)

    def remaining(self, consumed: int) -> int:
        """How many samples this rank serves in an epoch whose first ``consumed`` were taken."""
        left = self.n - min(max(consumed, 0), self.n)
        return -(-left // self.num_replicas)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[SeededIndex]:
        g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch)
        order = torch.randperm(self.n, generator=g).tolist() if self.shuffle else list(range(self.n))
        seeds = torch.randint(0, 2**62, (self.n,), generator=g).tolist()
        consumed, self.consumed = self.consumed, 0
        # the rest, padded with the epoch's first samples to a multiple of the ranks, as DistributedSampler pads
        left = self.n - consumed
        positions = list(range(consumed, self.n)) + [k % self.n for k in range((-left) % self.num_replicas)]
        for k in positions[self.rank::self.num_replicas]:
            yield SeededIndex(order[k], seeds[k])


def is_resumable(sampler: Any) -> bool:
    """Whether ``sampler`` can serve an epoch from a place in it: a ``ResumableSampler``, or a batch sampler with the
    same ``skip``, ``seed``, ``epoch``, ``n`` and ``num_replicas`` (``shard_sampler.ShardBatchSampler``)."""
    return all(hasattr(sampler, a) for a in ("skip", "seed", "epoch", "n", "num_replicas"))


def loader_state_mismatch(state: dict[str, Any], samples: int, batch_size: int | None, drop_last: bool,
                          ranks: int | None = 1) -> str | None:
    """What changed since ``state`` was saved (``None``: nothing that moves the samples), in a few words;
    ``ranks=None``: a change in the number of ranks is not one (the sampler splits the rest of the epoch anew)."""
    if state.get("format") != STATE_FORMAT:
        return f"its format {state.get('format')!r}, this version reads {STATE_FORMAT}"
    checked = [("samples", "samples", samples), ("batch size", "batch_size", batch_size),
               ("drop_last", "drop_last", drop_last)] + ([("ranks", "ranks", ranks)] if ranks is not None else [])
    changed = [f"{name} {state.get(key)!r} -> {now!r}" for name, key, now in checked if state.get(key) != now]
    return ", ".join(changed) or None


def consumed_samples(state: dict[str, Any]) -> int:
    """The samples of the stopped epoch's order taken on all ranks together at ``state``'s save."""
    if "consumed" in state:
        return int(state["consumed"])
    return int(state["taken"]) * int(state["batch_size"] or 1) * int(state.get("ranks", 1))
