"""Hugging Face ``datasets`` image datasets through the NHWC path: each row's encoded bytes go to the loader's decoder.

An image dataset on the Hub (ImageNet-1k among them) is Parquet files whose image column holds each
file's encoded bytes, and a ``ClassLabel`` column. ``HFImageDataset`` reads the bytes undecoded
(``datasets.Image(decode=False)``) and hands them to cltrain's transforms, which decode a JPEG with
libjpeg-turbo straight into the batch (no Pillow image on the way) and any other format with Pillow,
as for a folder (``cltrain.data.image_samples``); the labels and class names come from the
``ClassLabel``. ``HFStreamingDataset`` does the same for a streamed dataset
(``load_dataset(..., streaming=True)``), which is read in order and never downloaded whole. A row
that cannot be read is named by its index (in a stream: its place and its file name) under the
``bad_files`` policy of every source (``cltrain.data.bad_samples``).

``cltrain.data.hf_source.open_dataset(root)`` opens what users have: a folder written by
``save_to_disk``, a folder of Parquet files, or a Hub id. Needs ``pip install 'cltrain[hf]'`` (``datasets``).

Example::

    >>> from cltrain.data import eval_transform
    >>> from cltrain.data.hf_dataset import HFImageDataset
    >>> from cltrain.data.hf_source import open_dataset, split_names
    >>> splits = open_dataset("/data/imagenet-hf")             # doctest: +SKIP
    >>> train, val = split_names(splits, "/data/imagenet-hf")  # doctest: +SKIP
    >>> ds = HFImageDataset(splits[val], eval_transform(224))  # doctest: +SKIP
    >>> image, label = ds[0]                                   # HWC uint8, int
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from cltrain.data.bad_samples import SkipsBadSamples, unreadable
from cltrain.data.errors import BadImageError
from cltrain.data.hf_source import columns, row_name, row_source, undecoded
from cltrain.data.image_samples import ImageSamples
from cltrain.data.loader_threads import load_batch
from cltrain.data.resume_state import SeededIndex
from cltrain.data.stream_place import READ_TO_END, Place, row_seed

__all__ = ["HFImageDataset", "HFStreamingDataset", "rank_of"]


class _Split:
    """What both datasets of a split share: its columns, its names in lists and errors."""

    split: str
    where: str

    def _open_split(self, dataset: Any, image_column: str | None, label_column: str | None, split: str,
                    where: str) -> None:
        self.split, self.where = split, str(where)
        self.image_column, self.label_column, self.classes = columns(dataset.features, image_column, label_column,
                                                                     self.source_name)
        self.dataset = undecoded(dataset, self.image_column, self.label_column)

    @property
    def split_name(self) -> str:
        """The split, as the skipped-files list names it."""
        return self.split

    @property
    def source_name(self) -> str:
        """The dataset and split, for errors."""
        return f"{self.where} ({self.split})"

    def _unreadable(self, name: str, reason: str) -> str:
        return (f"{self.source_name} {name}: cannot be read as an image ({reason}). "
                "Pass bad_files='skip' to leave such rows out, or mend the row in the dataset.")


class HFImageDataset(_Split, ImageSamples):
    """One split of a Hugging Face dataset (``datasets.Dataset``) as ``(transform(image), label)``: the
    rows' encoded bytes decoded by the loader (see the module docstring); batches are decoded on
    ``threads`` threads and written into the batch, as ``ImageFolderDataset`` does.

    Args:
        dataset: the split (``datasets.Dataset``; its images are read undecoded whatever its format).
        transform: bytes -> HWC uint8 (``cltrain.data.train_transform`` / ``eval_transform``).
        image_column: the image column; ``None``: the first ``datasets.Image`` feature.
        label_column: the label column; ``None``: the first ``datasets.ClassLabel`` feature.
        split: the split's name (in the skipped-files list).
        where: the dataset's name in errors (its root).
        bad_files: ``"raise"`` or ``"skip"`` (``cltrain.data.bad_samples``); a row is named by its index.
        skip_log: file the skipped rows are appended to (``"skip"`` only).
        threads: decode threads per loading process (``cltrain.data.loader_threads``).

    Attributes:
        classes: the ``ClassLabel``'s names, in label order.

    Raises:
        DataError: no image or label column (see ``columns``).
    """

    def __init__(self, dataset: Any, transform: Callable[..., Any], image_column: str | None = None,
                 label_column: str | None = None, split: str = "train", where: str = "the dataset",
                 bad_files: str = "raise", skip_log: str | os.PathLike | None = None, threads: int = 1) -> None:
        if not (isinstance(threads, int) and threads >= 1):
            raise ValueError(f"HFImageDataset: threads={threads!r} must be an int >= 1.")
        self._set_policy(bad_files, skip_log)
        self.threads, self.transform = threads, transform
        self._open_split(dataset, image_column, label_column, split, where)

    def __len__(self) -> int:
        return len(self.dataset)

    def source(self, index: int) -> tuple[bytes | str, int]:
        """The encoded bytes (or the local path) of row ``index``'s image, and its label."""
        return row_source(self.dataset[index], self.image_column, self.label_column)

    def sample_name(self, index: int) -> str:
        """``row <index>``, with the image's file name when the row has one."""
        return row_name(index, self.dataset[index], self.image_column)

    def unreadable_message(self, index: int, reason: str) -> str:
        """The one line of ``BadImageError`` for row ``index``."""
        return self._unreadable(self.sample_name(index), reason)


class HFStreamingDataset(_Split, SkipsBadSamples, IterableDataset):
    """A streamed split (``datasets.IterableDataset``) as ``(transform(image), label)`` samples, in the
    stream's order (shuffled within ``shuffle_buffer`` rows, a new order each epoch, ``set_epoch``). A
    stream has no row index: a bad row is named by its place in the epoch's stream and its file name.

    An epoch's stream is split into parts (``Dataset.shard(parts, p, contiguous=False)``, each shuffled alike): as
    many as the DataLoader has workers (at most the stream's shards), worker ``w`` reading parts ``w, w + workers,
    ...`` in turn; an epoch resumed with another number of workers keeps the parts it began with. With
    ``world_size > 1`` every rank reads the whole stream and keeps one row of every ``world_size``;
    for training (``equal=True``) only whole groups of ``world_size`` rows count, so every rank gets
    the same number of samples from every worker (the same step count under DDP; at most
    ``world_size - 1`` rows per worker and epoch are left out). A row that cannot be read is listed
    (``bad_files="skip"``) and the next readable one stands in for it, so the counts stay equal.

    Args:
        dataset: the streamed split.
        transform: bytes -> HWC uint8.
        image_column: as ``HFImageDataset``.
        label_column: as ``HFImageDataset``.
        split: the split's name (in the skipped-files list).
        where: the dataset's name in errors.
        bad_files: ``"raise"`` or ``"skip"``.
        skip_log: file the skipped rows are appended to (``"skip"`` only).
        threads: decode threads: rows are decoded ``threads * 8`` at a time.
        rank: this process's rank.
        world_size: the number of ranks.
        equal: drop the incomplete last group, so every rank yields as many samples.
        shuffle_buffer: rows shuffled together (``datasets``' buffer shuffle); ``None``: stream order.
        seed: the shuffle's seed, the same on every rank; epoch ``e`` shuffles with ``seed + e``.
    """

    def __init__(self, dataset: Any, transform: Callable[..., Any], image_column: str | None = None,
                 label_column: str | None = None, split: str = "train", where: str = "the dataset",
                 bad_files: str = "raise", skip_log: str | os.PathLike | None = None, threads: int = 1, rank: int = 0,
                 world_size: int = 1, equal: bool = False, shuffle_buffer: int | None = None, seed: int = 0) -> None:
        self._set_policy(bad_files, skip_log)
        self.transform, self.threads = transform, max(1, threads)
        self._open_split(dataset, image_column, label_column, split, where)
        self.rank, self.world_size, self.equal = rank, world_size, equal
        self.shuffle_buffer, self.seed, self.epoch = shuffle_buffer, seed, 0
        #: the seed of every sample's randomness (``None``: drawn from the torch RNG as an iteration starts;
        #: ``ResumableLoader`` draws it once and keeps it in the checkpoint)
        self.sample_seed: int | None = None
        #: part -> this process's place in that part of the stream, after the sample it yielded last from it
        #: (``stream_place.Place``)
        self.position: dict[int, Place] = {}
        #: part -> the place the next iteration starts that part after (``ResumableLoader`` sets it, with
        #: ``resume_parts``, the parts of the epoch it resumes, and ``split_from``, part -> the row from which the
        #: part's rows are split over the ranks: where a stop on another number of ranks left it)
        self.resume_at: dict[int, tuple] | None = None
        self.resume_parts: int | None = None
        self.split_from: dict[int, int] = {}

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration gives (``PrefetchDataLoader`` sets it)."""
        self.epoch = epoch

    def parts_for(self, workers: int) -> int:
        """The parts an epoch read by ``workers`` DataLoader workers (0: the main process) splits the stream into."""
        return max(1, min(workers, self.dataset.num_shards))

    def _rows(self, part: int, parts: int, base: int) -> Iterator[tuple[int, int, str, Mapping[str, Any]]]:
        """This rank's ``(row, next, name, row's cells)`` of ``part`` of ``parts`` of the epoch's stream: ``row`` its
        position there, ``next`` the position the stream goes on from after it; the rows before ``base`` are passed
        over (not decoded), and the rows from there are split over the ranks."""
        stream = self.dataset if parts == 1 else self.dataset.shard(num_shards=parts, index=part, contiguous=False)
        if self.shuffle_buffer:
            stream = stream.shuffle(seed=self.seed + self.epoch, buffer_size=self.shuffle_buffer)
        # a stream has no row index: its position in this part of this epoch's order, and the file name
        where = "" if parts == 1 else f" of part {part}"
        world, rank = self.world_size, self.rank
        mine = None
        # ``iter``, not ``for row in stream``: in a DataLoader worker ``datasets`` would split the part again
        for j, batch in enumerate(stream.iter(batch_size=1)):
            if j < base:
                continue
            row = {key: values[0] for key, values in batch.items()}
            name = f"{j}{where} of epoch {self.epoch}'s stream"
            if world == 1:
                yield j, j + 1, row_name(name, row, self.image_column), row
                continue
            if (j - base) % world == rank:
                mine = (j, j + 1, row_name(name, row, self.image_column), row)
                if not self.equal:
                    yield mine
            if self.equal and (j - base) % world == world - 1 and mine is not None:  # the group is whole
                yield mine[0], j + 1, mine[2], mine[3]

    def _load(self, item: tuple[int, int, str, Mapping[str, Any]]) -> tuple[Any, int]:
        name, row, data = item[2], item[3], None
        try:
            data, target = row_source(row, self.image_column, self.label_column)
            return self.transform(data), target
        except Exception as err:  # any failure of this one row
            reason = unreadable(err, data if isinstance(data, str) else None)  # a path: an empty file said so
            raise BadImageError(self._unreadable(name, reason), reason) from err

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        # taken now: the loader clears them once its workers have them
        resume_at, split_from = dict(self.resume_at or {}), dict(self.split_from)
        parts = self.resume_parts or self.parts_for(workers)
        seed = self.sample_seed if self.sample_seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.position = {}

        def samples() -> Iterator[tuple[Any, int]]:
            for part in range(worker, parts, workers):
                start = Place(*resume_at[part]) if part in resume_at else None
                base = split_from.get(part, 0)
                if base == READ_TO_END:
                    continue  # read to its end before a stop on another number of ranks: not read again
                yield from self._samples(part, parts, start, base,
                                         lambda *key, part=part: row_seed(seed, self.epoch, part, *key))

        return samples()

    def _samples(self, part: int, parts: int, start: Place | None, base: int,
                 seed_of: Callable[..., int]) -> Iterator[tuple[Any, int]]:
        """The samples of ``part`` after ``start`` (from its first row, or row ``base``: ``None``);
        ``seed_of(row, copy, tail)`` seeds each one. ``position[part]`` is set before each yield."""
        augment = getattr(self.transform, "augment", None)

        def one(item: tuple, copy: int, tail: int = 0) -> tuple[Any, int]:
            return load_batch(lambda _: self._load(item), [SeededIndex(0, seed_of(item[0], copy, tail))], 1,
                              augment)[0]

        owed, last = 0, None  # bad rows skipped since the last good one, which stands in for them
        rows = self._rows(part, parts, base)
        if start is not None:  # the rows read before the stop, not decoded again
            for item in rows:
                last = item
                if item[1] >= start.next:  # this rank's row at the place (under DDP: every rank stops at the same)
                    break
            copies = start.copies if last is not None and last[1] == start.next else 0
            for copy in range(copies - 1, -1, -1):  # the stand-ins the stop left owed
                try:
                    sample = one(last, copy, start.tail)
                except BadImageError:  # another rank's place: this rank's row there is bad, the next good one owes
                    owed = copy + 1
                    break
                self.position[part] = Place(last[0], copy, start.next, start.tail)
                yield sample
            if start.tail:
                return
            last = None if owed else last
        while True:
            chunk = [item for _, item in zip(range(self.threads * 8), rows)]
            if not chunk:
                break
            errors: dict[int, BadImageError] = {}

            def load(k: int, chunk: list = chunk, errors: dict = errors) -> tuple[Any, int]:
                try:
                    return self._load(chunk[k])
                except BadImageError as err:
                    errors[k] = err
                    raise

            indices = [SeededIndex(k, seed_of(item[0], 0, 0)) for k, item in enumerate(chunk)]
            # each sample's crop and augmentation from its own seed; a bad row is None here under "skip"
            samples = self.start_batch(load, indices, augment, refetch=lambda k: None)()
            for k, sample in enumerate(samples):
                item = chunk[k]
                if k in errors:
                    self.skip(item[2], errors[k].reason or str(errors[k]))
                    owed += 1
                    continue
                for copy in range(owed, 0, -1):  # the next readable sample stands in for the bad ones before it
                    self.position[part] = Place(item[0], copy, item[1])
                    yield one(item, copy)
                owed, last = 0, item
                self.position[part] = Place(item[0], 0, item[1])
                yield sample
        if last is not None:
            for copy in range(owed - 1, -1, -1):
                self.position[part] = Place(last[0], copy, last[1], 1)
                yield one(last, copy, 1)

    def __len__(self) -> int:
        raise TypeError("a streamed dataset has no length")


def rank_of(trainer: Any) -> tuple[int, int]:
    """``(global rank, world size)`` of a Trainer (``(0, 1)`` without one)."""
    return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
