"""Where a stream's epoch is, for an exact resume: the place reached in each part of the stream.

A streamed dataset (``HFStreamingDataset``) has no index to skip to: its epoch is split into parts, each DataLoader
worker reading its own parts in order. A worker publishes, before each sample it yields, its place in each part it has
read (``Place``); ``TaggedCollate`` hands each batch to the main process with those places and the worker that made
it, and ``StreamPlaces`` keeps the place of each part after the last batch a training step took. Resumed, each part is
read again up to its place without decoding it and goes on from there, whatever worker reads it; every sample's
randomness comes from ``sample_seed`` and the sample's part and place (``row_seed``), never from the order of draws.

Example::

    >>> places = StreamPlaces()
    >>> places.fetched(Tagged(1, {1: Place(row=7, copies=0, next=8)}, "batch"))
    'batch'
    >>> places.taken_positions(1)
    {1: (7, 0, 8, 0)}
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from torch.utils.data import get_worker_info

from cltrain.layout.batches import map_tensors

__all__ = ["READ_TO_END", "Place", "StreamPlaces", "Tagged", "TaggedCollate", "is_stream", "row_seed"]


class Place(NamedTuple):
    """A place in a part of an epoch's stream, after the sample yielded last from it.

    ``row``: that sample's row (its position in the part); ``copies``: how many more times the
    row is yielded (stand-ins for unreadable rows before it); ``next``: the position the stream goes on from after
    them; ``tail``: the copies stand in for unreadable rows at the stream's end (nothing is read after them).
    """

    row: int
    copies: int
    next: int
    tail: int = 0


#: A part's ``split_from`` once it was read to its end before a stop on another number of ranks: nothing of it is
#: read again.
READ_TO_END = 2**62

_MASK = (1 << 64) - 1


def row_seed(*key: int) -> int:
    """A 62-bit seed from ints (a sample's ``(sample_seed, epoch, part, row, copy, tail)``): splitmix64 over the
    key, about 3 us a row here where ``numpy.random.SeedSequence`` took 18 us."""
    h = 0x243F6A8885A308D3
    for k in key:
        z = (h ^ (int(k) & _MASK)) + 0x9E3779B97F4A7C15 & _MASK
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        h = z ^ (z >> 31)
    return h >> 2


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` publishes its place and can start from one (``HFStreamingDataset``)."""
    return all(hasattr(dataset, a) for a in ("position", "resume_at", "sample_seed", "set_epoch"))


class Tagged:
    """A batch on its way from a worker, with the worker's id and its place in each part it has read (part ->
    ``Place``)."""

    def __init__(self, worker: int, places: dict[int, Place], batch: Any) -> None:
        self.worker, self.places, self.batch = worker, places, batch

    def pin_memory(self) -> Tagged:
        """The DataLoader's pin thread calls this: the batch pinned, the tag kept."""
        return Tagged(self.worker, self.places, map_tensors(self.batch, lambda t: t.pin_memory()))


class TaggedCollate:
    """``collate`` whose batch carries the id and places of the worker that made it (``Tagged``)."""

    def __init__(self, collate: Callable[[list], Any], dataset: Any) -> None:
        self.collate, self.dataset = collate, dataset

    def __call__(self, samples: list) -> Tagged:
        info = get_worker_info()
        dataset = self.dataset if info is None else info.dataset  # a worker's own copy publishes its places
        return Tagged(0 if info is None else info.id, dict(dataset.position), self.collate(samples))


class StreamPlaces:
    """The places of the batches an epoch's iterator handed out, in order, and each part's place after the batches
    the training steps took (``taken_positions``).

    A DataLoader takes its workers' batches in turn from worker 0, skipping a worker whose part has ended; an epoch
    resumed after a batch of worker ``k`` goes on with worker ``k + 1``'s (``batches(first=k + 1)``)."""

    def __init__(self, start: dict[int, tuple] | None = None, last_worker: int = -1) -> None:
        self.start = {int(w): tuple(p) for w, p in (start or {}).items()}  # places the epoch went on from
        self._tags: list[tuple[int, dict[int, tuple]]] = []
        self._folded = 0  # tags folded into ``start`` (batches taken long ago)
        self._last_worker = last_worker  # the worker of the last folded batch (-1: none)
        self.ended = False  # the iterator has handed out its last batch

    def fetched(self, tagged: Tagged) -> Any:
        """Note ``tagged``'s worker and place; its batch."""
        self._tags.append((tagged.worker, {int(p): tuple(place) for p, place in tagged.places.items()}))
        return tagged.batch

    def batches(self, tagged: Iterator[Tagged], first: int = 0, workers: int = 1) -> Iterator[Any]:
        """The batches of ``tagged``, their places noted, in the workers' turns from worker ``first``; ``ended`` once
        it is through."""
        if first % max(workers, 1) == 0:
            for item in tagged:
                yield self.fetched(item)
        else:
            yield from map(self.fetched, _turns(tagged, first % workers, workers))
        self.ended = True

    def fold(self, taken: int) -> None:
        """Forget the tags of all but the last few taken batches (a long stream's epoch keeps no list)."""
        keep = max(taken - 4, 0) - self._folded
        if keep > 64:
            self.start, self._last_worker = self.taken_positions(self._folded + keep), self._tags[keep - 1][0]
            del self._tags[:keep]
            self._folded += keep

    def taken_positions(self, taken: int) -> dict[int, tuple]:
        """Each part's place after the first ``taken`` batches of the epoch."""
        places = dict(self.start)
        for _, parts in self._tags[: max(taken - self._folded, 0)]:
            places.update(parts)
        return places

    def last_worker(self, taken: int) -> int:
        """The worker that made the ``taken``-th batch of the epoch (-1: none)."""
        tags = self._tags[: max(taken - self._folded, 0)]
        return tags[-1][0] if tags else self._last_worker

    def finished(self, taken: int) -> bool:
        """Whether the first ``taken`` batches are all the epoch has."""
        return self.ended and taken - self._folded >= len(self._tags)


def _turns(tagged: Iterator[Tagged], first: int, workers: int) -> Iterator[Tagged]:
    """``tagged`` (a DataLoader's turns from worker 0) in the turns it would take from worker ``first``: a worker whose
    turn the DataLoader skipped has ended, so it is skipped here too; at most a round of batches waits."""
    queues: dict[int, deque] = {w: deque() for w in range(workers)}
    ended: set[int] = set()
    turn, seen = first, workers - 1
    for item in tagged:
        k = (seen + 1) % workers
        while k != item.worker:  # the DataLoader went past these: their parts have ended
            ended.add(k)
            k = (k + 1) % workers
        seen = item.worker
        queues[item.worker].append(item)
        for _ in range(2 * workers):
            if queues[turn]:
                yield queues[turn].popleft()
            elif turn not in ended:
                break
            turn = (turn + 1) % workers
    while any(queues.values()):
        if queues[turn]:
            yield queues[turn].popleft()
        turn = (turn + 1) % workers
