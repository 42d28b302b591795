"""Copy the next batch to the GPU on a side stream while the current one trains.

Lightning moves a batch to the device when its step starts, on the compute
stream, so the copy waits behind the previous step's kernels and the step waits
for the copy: no overlap. ``PrefetchDataLoader`` does what apex's
``data_prefetcher`` does instead: when batch i is taken it makes the compute
stream wait for batch i's copy (issued one batch earlier) and starts batch i+1's
copy on a side stream. Lightning then finds the batch on its device already and
its own transfer is a no-op. It is a ``DataLoader`` subclass, so Lightning can
still re-create it with a ``DistributedSampler`` under DDP.

As timm fixed it (timm#2781, PR #2784): one side stream per loader (not one per
epoch, which kept growing reserved memory), the side stream waits for the
compute stream before each copy (so the copy cannot overwrite memory the compute
stream still reads, nor race it), ``record_stream`` tells the caching allocator
the compute stream uses the copied tensors, and a batch in pageable memory is
warned about once (its ``non_blocking`` copy is synchronous).

Its worker processes let SIGTERM and SIGINT pass (a handler that does nothing, so a program a worker starts gets
the default again): a signal sent to the whole process group (SLURM's ``scancel``, a preemption, Ctrl+C, a second
one while the stopping run writes its checkpoint) reaches the workers too, and a worker killed by it was an error in
the main process (``DataLoader worker ... is killed by signal: Terminated``), raised from its SIGCHLD handler
wherever the main process was, a checkpoint's ``torch.save`` included. The main process decides: it ends its
workers when it stops: its loaders shut them down, and at exit (before ``multiprocessing``'s own exit handler, whose
SIGTERM a worker lets pass while that handler waited for it) every worker still alive is shut down as its iterator
would, or killed. A worker whose main process is gone ends by itself (PyTorch's watchdog, within seconds).
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing.util  # noqa: F401 - its exit handler registered before ours, which then runs first
import signal
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from cltrain.data.collate import NHWCCollate
from cltrain.data.resume_state import STATE_FORMAT, consumed_samples, is_resumable, loader_state_mismatch
from cltrain.data.stream_place import READ_TO_END, Place, StreamPlaces, TaggedCollate, is_stream
from cltrain.layout.batches import map_tensors

__all__ = ["PrefetchDataLoader", "ResumableLoader"]


class _CudaPrefetcher:
    """The side stream of one loader and one device, and the copy logic (CUDA only)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.warned_unpinned = False

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and not t.is_pinned() and not self.warned_unpinned:
            self.warned_unpinned = True
            warnings.warn(f"PrefetchDataLoader: a batch tensor of shape {tuple(t.shape)} is in pageable memory, so its "
                          "copy to the GPU blocks the host and does not overlap; use pin_memory=True (ImageFolderDataModule "
                          "pins on a GPU by default).", stacklevel=4)
        return t.to(self.device, non_blocking=True)

    def send(self, batch: Any) -> Any:
        """Start copying ``batch`` on the side stream, after the work already queued on the compute stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            return map_tensors(batch, self._copy)

    def take(self, batch: Any) -> Any:
        """Make the compute stream wait for ``batch``'s copy; hand it over."""
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)
        # The caching allocator must not reuse these blocks while the compute stream reads them.
        map_tensors(batch, lambda t: t.record_stream(compute) if t.is_cuda else None)
        return batch

    def iterate(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` one ahead on the device."""
        try:
            ahead = self.send(next(batches))
        except StopIteration:
            return
        for batch in batches:
            current = self.take(ahead)
            ahead = self.send(batch)
            yield current
        yield self.take(ahead)


def _decodes_ahead(loader: DataLoader) -> bool:
    """Whether ``loader`` loads in this process from a dataset that can start a batch (``start_items``)."""
    return (loader.num_workers == 0 and loader.batch_sampler is not None
            and callable(getattr(loader.dataset, "start_items", None)))


def _one_batch_ahead(loader: DataLoader) -> Iterator[Any]:
    """The batches of ``loader`` (no worker processes), the next one decoding on the dataset's
    threads while the current one is used; images go straight into their slots when the collate is an
    ``NHWCCollate``. Everything random (the sampler, each sample's seed) is drawn in this thread,
    batch after batch, so a seeded run repeats."""
    dataset, collate = loader.dataset, loader.collate_fn
    slots = collate if isinstance(collate, NHWCCollate) else None
    ahead = getattr(dataset, "threads", 1) > 1  # one thread: no thread to decode on while this one waits
    pending = None
    for indices in loader.batch_sampler:
        started = dataset.start_items(indices, slots)
        if not ahead:
            yield _finish(loader, started)
            continue
        if pending is not None:
            yield _finish(loader, pending)
        pending = started
    if pending is not None:
        yield _finish(loader, pending)


def _not_empty(loader: DataLoader, batches: Iterator[Any]) -> Iterator[Any]:
    """``batches``; where an epoch read from its start gave none, a ``DataError`` at its end: a run would otherwise
    train on nothing and say it completed (an empty stream of shards, fewer samples than a batch with drop_last)."""
    given = False
    for batch in batches:
        given = True
        yield batch
    if not given and not getattr(loader, "resumed", False):  # a resumed epoch may have had nothing left
        from cltrain.data.errors import DataError

        dataset = loader.dataset
        name = getattr(dataset, "source_name", None) or type(dataset).__name__
        try:
            samples = len(dataset)
        except TypeError:  # a stream
            samples = None
        if samples:
            raise DataError(f"{name}: its {samples} sample(s) make no whole batch of {loader.batch_size} (the last "
                            "partial batch is dropped); lower data.batch_size.")
        raise DataError(f"{name}: no sample to read (every shard or file there is empty, or each of its samples was "
                        "unreadable and skipped: see the warnings); check what was written there.")


def _finish(loader: DataLoader, pending: Any) -> Any:
    batch = loader.collate_fn(pending())
    if loader.pin_memory and torch.cuda.is_available():
        batch = map_tensors(batch, lambda t: t if t.is_pinned() else t.pin_memory())
    return batch


def _worker_start(user_init: Callable[[int], Any] | None, worker_id: int) -> None:
    """The worker lets SIGTERM and SIGINT pass (the module docstring); then ``user_init``."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _let_pass)
    if user_init is not None:
        user_init(worker_id)


def _let_pass(signum: int, frame: Any) -> None:
    """Nothing: the main process ends the worker (not ``SIG_IGN``, which a program the worker starts would inherit)."""


#: the worker-holding iterators of these loaders, and their workers (which outlive a collected iterator), ended at
#: exit (``_end_workers``)
_ITERATORS: weakref.WeakSet[Any] = weakref.WeakSet()
_WORKERS: weakref.WeakSet[Any] = weakref.WeakSet()


@functools.cache
def _end_workers_at_exit() -> None:
    atexit.register(_end_workers)  # after multiprocessing's (imported above): runs before it


def _end_workers() -> None:
    """At exit: the workers still alive (a persistent loader's, an iterator an interrupted run kept) shut down as
    their iterators would, then any left killed (an iterator collected before, whose shutdown's SIGTERM the worker let
    pass), without PyTorch's SIGCHLD handler calling that a worker's failure."""
    for iterator in list(_ITERATORS):
        iterator._shutdown_workers()
    left = [w for w in list(_WORKERS) if w.is_alive()]
    if left:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for worker in left:
        worker.kill()
        worker.join(5)


class PrefetchDataLoader(DataLoader):
    """A ``DataLoader`` whose batches come out already on ``prefetch_device`` when it is a
    CUDA device (copied on a side stream, one batch ahead); any other value, or no
    CUDA, gives a plain ``DataLoader``. Use it with pinned memory (a warning says when a
    batch is not pinned). The side stream is made once per loader and reused by every
    epoch's iterator.

    With no worker processes and a dataset that decodes on threads (``ImageFolderDataset(threads=2)``),
    the next batch decodes while the current one is used, and an ``NHWCCollate``'s images are written
    straight into the batch (``decode_ahead=False``: batch by batch, as a plain ``DataLoader``).

    An iterable dataset with a ``set_epoch`` (a stream, ``HFStreamingDataset``) is told each new
    iteration's epoch (0, 1, ...) before its workers start, so every epoch has its own order."""

    def __init__(self, *args: Any, prefetch_device: str | torch.device | None = None, decode_ahead: bool = True,
                 **kwargs: Any) -> None:
        init = kwargs.get("worker_init_fn")
        if len(args) <= 10 and getattr(init, "func", None) is not _worker_start:  # not as re-made by Lightning
            kwargs["worker_init_fn"] = functools.partial(_worker_start, init)
            _end_workers_at_exit()
        super().__init__(*args, **kwargs)
        self.prefetch_device, self.decode_ahead = prefetch_device, decode_ahead
        self._prefetcher: _CudaPrefetcher | None = None
        self._epochs = 0

    def _get_iterator(self) -> Any:
        iterator = super()._get_iterator()
        if getattr(iterator, "_workers", None):
            _ITERATORS.add(iterator)
            _WORKERS.update(iterator._workers)
        return iterator

    def _cuda_device(self) -> torch.device | None:
        device = None if self.prefetch_device is None else torch.device(self.prefetch_device)
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            return None
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

    def __iter__(self) -> Iterator[Any]:
        return self._on_device(self._batches())

    def _batches(self) -> Iterator[Any]:
        """This epoch's batches, on the CPU."""
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if isinstance(self.dataset, IterableDataset) and callable(set_epoch):
            set_epoch(self._epochs)
            self._epochs += 1
        if self.decode_ahead and _decodes_ahead(self):
            # A DataLoader's iterator draws its workers' base seed from the global RNG when it is made:
            # so does this one, so that a seeded epoch gives a plain DataLoader's batches.
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            return _not_empty(self, _one_batch_ahead(self))
        return _not_empty(self, super().__iter__())

    def _on_device(self, it: Iterator[Any]) -> Iterator[Any]:
        """``it``'s batches, copied ahead to the CUDA ``prefetch_device`` (as they are on any other)."""
        device = self._cuda_device()
        if device is None:
            return it
        if self._prefetcher is None or self._prefetcher.device != device:
            self._prefetcher = _CudaPrefetcher(device)
        return self._prefetcher.iterate(it)


class ResumableLoader(PrefetchDataLoader):
    """A ``PrefetchDataLoader`` over a ``ResumableSampler`` (or shards' ``ShardBatchSampler``), or over a stream that
    publishes its place (``HFStreamingDataset``: ``cltrain.data.stream_place``), that keeps its place in the epoch for
    Lightning's stateful-loader protocol (``cltrain.data.resume_state``): a run resumed from a checkpoint saved
    anywhere in an epoch reads the epoch's remaining samples, in its order, with their augmentation, and the torch RNG
    goes on from where it was. Any other loader is a plain ``PrefetchDataLoader``, which Lightning calls not
    resumable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: a stream: each worker's place in its part of it is the epoch's place
        self.stream = isinstance(self.dataset, IterableDataset) and is_stream(self.dataset)
        #: False where Lightning rebuilt it around another sampler (a DistributedSampler): no state then
        self.resumable = self.stream or is_resumable(self.sampler)
        if self.stream and not isinstance(self.collate_fn, TaggedCollate):
            self.collate_fn = TaggedCollate(self.collate_fn, self.dataset)
        self._places = StreamPlaces()
        self._parts, self._split_from = 1, {}  # a stream's epoch: its parts, and where each is split over the ranks
        self.taken = 0  # batches of this epoch its training steps took (``note_taken``)
        #: how many taken batches' steps have not ended (a step that raised): ``BatchDataModule`` reads Lightning's
        self.unfinished: Callable[[], int] = lambda: 0
        #: the batches an epoch takes (``limit_train_batches`` ends it before the loader's end): the DataModule's Trainer
        self.epoch_batches: Callable[[], float] = lambda: float("inf")
        self.resumed = False  # this epoch's iterator went on from a checkpoint's state
        self.refused = False  # a checkpoint's state did not fit this data (said when it was loaded)
        self._rng_at_take: torch.Tensor | None = None
        self._resume: dict[str, Any] | None = None
        # the state the last iterator went on from while none of its batches is taken: Lightning can make an
        # iterator it never reads (a fit resumed inside a validation makes one at setup, then one for the next epoch),
        # and the one it reads must start from the saved RNG too
        self._unread: dict[str, Any] | None = None
        self._offset = 0  # samples of the epoch's order taken before ``taken`` began counting (another rank count)

    def _splits(self) -> bool:
        """Whether the sampler splits the rest of an epoch over any number of ranks (``ResumableSampler``)."""
        return hasattr(self.sampler, "skip_samples")

    def _reads(self) -> bool:
        """Whether the sampler serves the part of an epoch a stop left unread on any number of ranks (shards)."""
        return hasattr(self.sampler, "read_after")

    def _same_split(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` was saved with this loader's ranks and batch size (its batches go on as they were)."""
        return state.get("ranks") == self.sampler.num_replicas and state.get("batch_size") == _batch_size(self)

    def _epoch_left(self, state: dict[str, Any]) -> bool:
        """Whether the epoch ``state`` stopped in has batches left for this loader."""
        if state.get("finished"):
            return False
        if self._reads() and "read" in state:
            if not self._same_split(state):
                return sum(stop - start for start, stop in state["read"]) < self.sampler.n
            return state["taken"] < self.sampler.batches([tuple(run) for run in state["read_before"]])
        if not self._splits():
            return state["taken"] < len(self)
        samples, size = self.sampler.remaining(consumed_samples(state)), _batch_size(self) or 1
        return (samples // size if self.drop_last else -(-samples // size)) > 0

    def __iter__(self) -> Iterator[Any]:
        resume = self._resume if self._resume is not None else self._unread
        self.taken, self._offset, self._resume, self._unread = 0, 0, None, resume
        self.resumed = resume is not None
        if resume is not None:  # the torch RNG where the stopped run was when this iterator was made
            torch.set_rng_state(resume["rng"])
            if resume.get("cuda_rng") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(resume["cuda_rng"])
        if self.stream:
            return self._stream_iter(resume)
        sampler = self.sampler
        if resume is not None and self.resumable and self._epoch_left(resume):
            # the stopped epoch (stopped after its last batch: the next starts as usual): its remaining batches,
            # and the RNG as at the save (this iterator draws no seed)
            sampler.epoch = resume["epoch"]
            if self._splits():
                consumed, ranks = consumed_samples(resume), sampler.num_replicas
                self.taken = resume["taken"] if self._same_split(resume) else 0
                self._offset = consumed - self.taken * (_batch_size(self) or 1) * ranks
                sampler.skip_samples(consumed)
            elif self._reads() and not self._same_split(resume):  # another rank count or batch size: what is left
                self.taken = 0
                sampler.resume(resume["read"], resume["epoch"])
            else:
                self.taken = resume["taken"]
                if self._reads():  # the stopped run's own split (itself of what a resume had left)
                    sampler.resume(resume.get("read_before", []), resume["epoch"])
                sampler.skip(self.taken, self.batch_size)
            rng = torch.get_rng_state()
            it = super().__iter__()
            torch.set_rng_state(rng)
            return it
        return super().__iter__()

    def _stream_iter(self, resume: dict[str, Any] | None) -> Iterator[Any]:
        """A stream's epoch: from the first row, or each part from its place in ``resume``'s epoch."""
        dataset = self.dataset
        if dataset.sample_seed is None:  # drawn once, as a sampler draws its seed: seed_everything repeats it
            dataset.sample_seed = int(torch.randint(0, 2**62, ()).item())
        if resume is None or resume["finished"]:
            self._parts, self._split_from = dataset.parts_for(self.num_workers), {}
            self._places = StreamPlaces()
            return self._on_device(self._places.batches(self._batches()))
        self._epochs, self.taken = resume["epoch"], resume["taken"]
        self._parts, self._split_from = resume["parts"], dict(resume["split_from"])
        self._places = StreamPlaces(resume["positions"], resume["last_worker"])
        dataset.resume_at, dataset.resume_parts, dataset.split_from = (dict(resume["positions"]), self._parts,
                                                                       self._split_from)
        rng = torch.get_rng_state()
        try:
            batches = self._batches()  # its workers (or this process's iterator) take their places now
        finally:
            dataset.resume_at, dataset.resume_parts, dataset.split_from = None, None, {}
        torch.set_rng_state(rng)
        # the stopped run's turns go on with the worker after the last batch's, with the same workers
        first = resume["last_worker"] + 1 if resume["workers"] == self.num_workers else 0
        return self._on_device(self._places.batches(batches, first, self.num_workers))

    # ---- Lightning's stateful-loader protocol (cltrain.data.resume_state) -----------------------------------------

    def note_taken(self) -> None:
        """A training step took this epoch's next batch (``BatchDataModule`` calls it as the batch reaches the
        device: Lightning fetches a batch ahead, so the batches handed out are one more than those trained on)."""
        self.taken += 1
        self._unread = None
        self._rng_at_take = torch.get_rng_state()  # the RNG a step that raises started from (about 1 us)
        if self.stream:
            self._places.fold(self.taken)

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch is, for the checkpoint (empty where it is not ``resumable``)."""
        if not self.resumable:
            return {}
        unfinished = self.unfinished()  # its batch is read again on resume, from the RNG it started from
        taken, size = self.taken - unfinished, _batch_size(self)
        state = {"format": STATE_FORMAT, "batch_size": size, "drop_last": self.drop_last, "taken": taken,
                 "rng": self._rng_at_take if unfinished and self._rng_at_take is not None else torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
                 "finished": taken >= self.epoch_batches()}  # the epoch's last batch: the next epoch starts as usual
        if self.stream:  # each part's place in the stream
            dataset = self.dataset
            return {**state, "samples": "stream", "workers": self.num_workers, "ranks": dataset.world_size,
                    "seed": dataset.sample_seed, "epoch": max(self._epochs - 1, 0), "parts": self._parts,
                    "split_from": dict(self._split_from), "positions": self._places.taken_positions(taken),
                    "last_worker": self._places.last_worker(taken),
                    "finished": state["finished"] or self._places.finished(taken)}
        sampler = self.sampler
        state.update(samples=sampler.n, ranks=sampler.num_replicas, seed=sampler.seed, epoch=sampler.epoch)
        if self._splits():  # the samples of the epoch's order taken on all ranks: resumable on any rank count
            state["consumed"] = self._offset + taken * (size or 1) * sampler.num_replicas
        if self._reads():  # the runs of the epoch's order read on all ranks, and those read before this run took it up
            state["read"], state["read_before"] = sampler.read_after(taken), [list(run) for run in sampler.read_before()]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Go on from ``state_dict``'s batch: the epoch's remaining samples, in its order, with its randomness, and
        the torch RNG as it was; a state that no longer fits the data is one line, and its epoch starts again."""
        if not state_dict or not self.resumable:
            return
        key = tuple(repr(state_dict.get(k)) for k in ("samples", "batch_size", "seed", "epoch", "taken", "positions"))
        if key == getattr(self, "_loaded", None):  # the DataModule's copy and Lightning's loop both hand it over
            return
        self._loaded = key
        if self.stream:
            self._load_stream_state(state_dict)
            return
        sampler, size = self.sampler, _batch_size(self)
        anew = self._splits() or "read" in state_dict  # what the epoch has left is split anew: any ranks, any batch
        changed = loader_state_mismatch(state_dict, sampler.n, state_dict.get("batch_size") if anew else size,
                                        self.drop_last, None if anew else sampler.num_replicas)
        if changed:
            self.refused = True  # said here: not "holds no place" again at the first batch
            warnings.warn(f"cltrain: the checkpoint's loader state does not fit this data ({changed}): the epoch "
                          "it stopped in is read again from its first batch (Lightning's loop still counts the "
                          "batches trained before the stop: the epoch ends short of them).", stacklevel=2)
            return
        ranks, left = state_dict.get("ranks"), self._epoch_left(state_dict)
        if not self._same_split(state_dict) and left:
            read = (sum(stop - start for start, stop in state_dict["read"]) if "read" in state_dict
                    else min(consumed_samples(state_dict), sampler.n))
            now, was = (", ".join(filter(None, [f"{r} rank(s)" if ranks != sampler.num_replicas else "",
                                                f"batch size {b}" if state_dict.get("batch_size") != size else ""]))
                        for r, b in ((sampler.num_replicas, size), (ranks, state_dict.get("batch_size"))))
            warnings.warn(f"cltrain: resumed with {now} from a run with {was}: the {sampler.n - read} samples left "
                          f"in epoch {state_dict['epoch']} are split over the {sampler.num_replicas} rank(s) in "
                          f"batches of {size}, each read once with its own augmentation; the batches, so the "
                          "weights, are not the uninterrupted run's.", stacklevel=2)
        sampler.seed = state_dict["seed"]
        # the epoch the next iterator serves (Lightning may make it before it calls set_epoch on a restart)
        sampler.epoch = state_dict["epoch"] + (not left)
        self._resume = dict(state_dict)  # applied by the next iterator: the RNG as it was there

    def _load_stream_state(self, state: dict[str, Any]) -> None:
        """A stream's place: each part goes on from its own. With another number of workers the epoch keeps its
        parts; with another number of ranks the rows each part has left are split over the new ranks (one line).
        A state that does not fit is one line, and the epoch starts again."""
        dataset = self.dataset
        changed = loader_state_mismatch(state, "stream", _batch_size(self), self.drop_last, None)
        if not changed and "parts" not in state:
            changed = "it was written before a stream's epoch was split into parts"
        dataset.sample_seed = state.get("seed", dataset.sample_seed)
        self._epochs = int(state.get("epoch", 0))
        if changed:
            warnings.warn(f"cltrain: the checkpoint's loader state does not fit this stream ({changed}): epoch "
                          f"{self._epochs} starts again from its first row.", stacklevel=2)
            return
        self._epochs += bool(state["finished"])  # stopped after the epoch's last batch: the next starts as usual
        state = dict(state, split_from={int(p): int(row) for p, row in state["split_from"].items()})
        ranks, workers = state["ranks"], state["workers"]
        if not state["finished"] and ranks != dataset.world_size:
            # every rank stopped at the end of a group of rows: what each part has left is split anew from there
            split = state["split_from"]
            for part, place in state["positions"].items():
                split[int(part)] = READ_TO_END if Place(*place).tail else Place(*place).next
            state["positions"] = {}
        if not state["finished"] and (ranks, workers) != (dataset.world_size, self.num_workers):
            warnings.warn(f"cltrain: resumed with {self.num_workers} worker(s) on {dataset.world_size} rank(s) from "
                          f"{workers} on {ranks}: the rows left in epoch {self._epochs} of the stream's "
                          f"{state['parts']} parts are read once each, with their own augmentation; the batches, so "
                          "the weights, are not the uninterrupted run's.", stacklevel=2)
        self._resume = state  # applied by the next iterator: the RNG as it was there


def _batch_size(loader: DataLoader) -> int | None:
    """Samples per batch: the loader's, or its batch-yielding sampler's (shards)."""
    return loader.batch_size if loader.batch_size is not None else getattr(loader.sampler, "batch_size", None)
