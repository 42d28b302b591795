"""Each sample exactly once per epoch under DDP x workers, with every rank in step.

Every epoch, all ranks draw the same order of the sample indices (``seed + epoch``);
rank ``r`` takes the ``r``-th of ``world_size`` contiguous slices (sizes differ by at
most one) and cuts it into batches with ``rank_batch_sizes``. The sampler is a
``DistributedSampler``, so Lightning keeps it under DDP (it injects no sampler of its
own) and calls its ``set_epoch``. Used by ``ShardsDataModule``,
whose dataset reads a whole batch per index list.

Example::

    >>> s = ShardBatchSampler(range(33), batch_size=4, num_replicas=2, rank=1)
    >>> [len(b) for b in s]
    [4, 4, 4, 2, 2]
    >>> rank_batch_sizes(21, 4, 1, 0)  # no batch of one image (BatchNorm in training) where it can be helped
    [4, 4, 4, 4, 3, 2]

A resumed epoch serves the positions of its order that the stopped run had not read (``read``): on the same number
of ranks that is the stopped run's own split, skipped to its place; on another number, the positions left are split
anew over the ranks, each sample once with its own seed (``read_after`` says what a stop leaves read).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from cltrain.data.resume_state import SeededIndex

__all__ = ["EveryImageOnce", "ShardBatchSampler", "check_window", "rank_batch_sizes"]


def rank_batch_sizes(num_samples: int, batch_size: int, num_replicas: int, rank: int) -> list[int]:
    """Batch sizes of rank ``rank`` when ``num_samples`` are split over ``num_replicas`` ranks:
    every rank gets the same number of batches and every sample exactly once.

    Raises:
        ValueError: the split cannot keep ranks in step (fewer samples than ranks, or
            ``batch_size=1`` with ``num_samples`` not a multiple of ``num_replicas``).
    """
    if num_samples < num_replicas:
        raise ValueError(f"{num_samples} samples cannot be split over {num_replicas} ranks with each sample exactly once; "
                         "use fewer devices or more samples.")
    base, extra = divmod(num_samples, num_replicas)
    mine = base + (rank < extra)
    steps = math.ceil((base + (extra > 0)) / batch_size)
    if mine < steps:  # batch_size=1, a rank one sample short
        raise ValueError(f"batch_size=1 with {num_samples} samples on {num_replicas} ranks gives the ranks different "
                         "step counts; use batch_size >= 2 or a sample count divisible by the number of ranks.")
    # full batches, then the fewest last batches that share the rest with two or more images each (a batch of one
    # trains BatchNorm on the statistics of one image), or all of them evenly where none can
    for k in range(1, steps + 1):
        rest = mine - batch_size * (steps - k)
        if rest >= 2 * k:
            break
    share, more = divmod(rest, k)
    return [batch_size] * (steps - k) + [share + 1] * more + [share] * (k - more)


def check_window(shuffle_window: int | None, owner: str) -> int | None:
    """``shuffle_window`` if it is None or an int >= 1; a ValueError naming ``owner`` otherwise."""
    if shuffle_window is not None and not (isinstance(shuffle_window, int) and shuffle_window >= 1):
        raise ValueError(f"{owner}: shuffle_window={shuffle_window!r} must be None (null) or an int >= 1 (shards).")
    return shuffle_window


class ShardBatchSampler(DistributedSampler):
    """Lists of sample indices, one per batch, for one rank (see the module docstring).

    Args:
        dataset: anything with ``len``: the number of samples.
        batch_size: samples per batch (the last of a rank's batches may be smaller).
        num_replicas: the DDP world size.
        rank: this process's rank.
        shuffle: a new permutation every epoch (``seed + epoch``), identical on every rank.
        seed: the seed the permutations are drawn from.
        shuffle_window: ``None``: one permutation of all samples. ``k``: the shards are
            permuted, then the samples within each run of ``k`` consecutive shards, so a
            rank reads about ``num_shards / world_size + k`` shards per epoch instead of
            all of them (for storage where reading few files in long runs is faster).
            Needs ``dataset.shard_sizes``.
    """

    def __init__(self, dataset: Any, batch_size: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0, shuffle_window: int | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.batch_size, self.shuffle_window = batch_size, check_window(shuffle_window, "ShardBatchSampler")
        self.sizes = rank_batch_sizes(len(dataset), batch_size, num_replicas, rank)  # fails here, not in the loop
        self.n = len(dataset)
        self.start = 0  # batches of this rank to skip once (a resumed epoch)
        #: ``[start, stop)`` runs of epoch ``read_epoch``'s order read before this run took it up (a resumed epoch)
        self.read: list[tuple[int, int]] = []
        self.read_epoch: int | None = None

    def resume(self, read: list[tuple[int, int]], epoch: int) -> None:
        """Serve what epoch ``epoch`` has left once ``read`` (runs of its order) were read (``ResumableLoader``)."""
        self.read, self.read_epoch = [(int(a), int(b)) for a, b in read], epoch

    def read_before(self) -> list[tuple[int, int]]:
        """The runs of this epoch's order read before this run took it up."""
        return self.read if self.read_epoch == self.epoch else []

    def skip(self, batches: int, batch_size: int | None = None) -> None:
        """Leave out this rank's first ``batches`` batches of the next epoch served (``ResumableLoader``)."""
        self.start = min(batches, self.batches(self.read_before()))

    def batches(self, read: list[tuple[int, int]]) -> int:
        """This rank's batches in an epoch whose runs ``read`` were read before."""
        return len(self._parts(self._left(read))[self.rank][1]) if read else len(self.sizes)

    def _left(self, read: list[tuple[int, int]]) -> np.ndarray:
        """The positions of the order not in ``read``, in order."""
        keep = np.ones(self.n, dtype=bool)
        for start, stop in read:
            keep[start:stop] = False
        return np.flatnonzero(keep)

    def _parts(self, left: np.ndarray) -> list[tuple[np.ndarray, list[int]]]:
        """Each rank's contiguous part of ``left`` and its batch sizes; ``left`` padded with its first positions,
        as ``DistributedSampler`` pads, where the ranks could not stay in step otherwise (fewer left than ranks)."""
        ranks = self.num_replicas
        try:
            sizes = [rank_batch_sizes(len(left), self.batch_size, ranks, r) for r in range(ranks)]
        except ValueError:
            count = max(ranks, -(-len(left) // ranks) * ranks)
            left = np.resize(left, count)  # repeats its first positions
            sizes = [rank_batch_sizes(count, self.batch_size, ranks, r) for r in range(ranks)]
        parts, start = [], 0
        for rank_sizes in sizes:
            parts.append((left[start:start + sum(rank_sizes)], rank_sizes))
            start += sum(rank_sizes)
        return parts

    def read_after(self, batches: int) -> list[tuple[int, int]]:
        """The runs of this epoch's order read once every rank has taken ``batches`` batches of the iterator last
        made, with those read before this run took the epoch up: what a checkpoint saved there has read, on any number
        of ranks."""
        before = self.read_before()
        taken = [part[:sum(sizes[:batches])] for part, sizes in self._parts(self._left(before))]
        done = np.zeros(self.n, dtype=bool)
        for start, stop in before:
            done[start:stop] = True
        for positions in taken:
            done[positions] = True
        edges = np.flatnonzero(np.diff(np.concatenate([[0], done.astype(np.int8), [0]])))
        return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]

    def order(self) -> np.ndarray:
        """This epoch's order of all sample indices (the same on every rank)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.shuffle_window is None:
            return torch.randperm(n, generator=g).numpy()
        sizes = np.asarray(self.dataset.shard_sizes)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        shards = torch.randperm(len(sizes), generator=g).numpy()
        runs = []
        for w in range(0, len(shards), self.shuffle_window):
            ids = np.concatenate([np.arange(starts[k], starts[k] + sizes[k]) for k in shards[w:w + self.shuffle_window]])
            runs.append(ids[torch.randperm(len(ids), generator=g).numpy()])
        return np.concatenate(runs)

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.dataset)
        order = self.order()
        # one seed per sample from (seed, epoch) alone: its augmentation is the same in any worker or resumed run
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch + 1)
        seeds = torch.randint(0, 2**62, (n,), generator=g).tolist()
        skip, self.start = self.start, 0
        mine, sizes = self._parts(self._left(self.read_before()))[self.rank]
        mine, starts = order[mine], np.cumsum([0, *sizes])
        plan = getattr(self.dataset, "plan_reads", None)  # a pack in object storage fetches its shards ahead
        reached = plan([mine[starts[k]:starts[k + 1]] for k in range(skip, len(sizes))]) if plan else None
        for k in range(skip, len(sizes)):
            if reached is not None:
                reached(k - skip)
            yield [SeededIndex(i, seeds[i]) for i in mine[starts[k]:starts[k + 1]].tolist()]

    def __len__(self) -> int:
        return len(self.sizes)


class EveryImageOnce(BatchSampler):
    """Evaluation batches of one rank, in order: every sample once over the ranks, each rank as many batches
    (``rank_batch_sizes``), where Lightning's ``DistributedSampler`` repeats samples to pad the ranks' shares, and
    so counts them twice in the accuracy. Under DDP Lightning injects its ``DistributedSampler`` as ``sampler``: its
    ranks and dataset are taken, its padded order left. Where the ranks cannot stay in step so (fewer samples than
    ranks, batches of one), the injected sampler's batches, as Lightning would make them.
    """

    def __init__(self, sampler: Sampler | Any, batch_size: int, drop_last: bool = False) -> None:
        super().__init__(sampler, batch_size, drop_last)
        ranks = isinstance(sampler, DistributedSampler)
        world, rank = (sampler.num_replicas, sampler.rank) if ranks else (1, 0)
        n = len(sampler.dataset) if ranks else len(sampler)
        try:
            sizes = [rank_batch_sizes(n, batch_size, world, r) for r in range(world)]
        except ValueError:
            self.sizes, self.start = None, 0
            return
        self.sizes, self.start = sizes[rank], sum(map(sum, sizes[:rank]))

    def __iter__(self) -> Iterator[list[int]]:
        if self.sizes is None:
            yield from super().__iter__()
            return
        start = self.start
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return super().__len__() if self.sizes is None else len(self.sizes)
