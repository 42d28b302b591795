"""Hugging Face ``datasets`` image datasets through the NHWC path: each row's encoded bytes go to the loader's decoder.

An image dataset on the Hub (ImageNet-1k among them) is Parquet files whose image column holds each
file's encoded bytes, and a ``ClassLabel`` column. ``HFImageDataset`` reads the bytes undecoded
(``datasets.Image(decode=False)``) and hands them to cltrain's transforms, which decode a JPEG with
libjpeg-turbo straight into the batch (no Pillow image on the way) and any other format with Pillow,
as for a folder (``cltrain.data.image_samples``); the labels and class names come from the
``ClassLabel``. ``HFStreamingDataset`` does the same for a streamed dataset
(``load_dataset(..., streaming=True)``), which is read in order and never downloaded whole. A row
that cannot be read is named by its index under the ``bad_files`` policy of every source
(``cltrain.data.bad_samples``).

``open_dataset(root)`` opens what users have: a folder written by ``save_to_disk``, a folder of
Parquet files (or any folder ``datasets.load_dataset`` reads), or a Hub id (downloaded into the
Hugging Face cache on first use, read from it after; with ``HF_HUB_OFFLINE=1`` only the cache).
Needs ``pip install 'cltrain[hf]'`` (``datasets``).

Example::

    >>> from cltrain.data import eval_transform
    >>> from cltrain.data.hf_dataset import HFImageDataset, open_dataset, split_names
    >>> splits = open_dataset("/data/imagenet-hf")             # doctest: +SKIP
    >>> train, val = split_names(splits, "/data/imagenet-hf")  # doctest: +SKIP
    >>> ds = HFImageDataset(splits[val], eval_transform(224))  # doctest: +SKIP
    >>> image, label = ds[0]                                   # HWC uint8, int
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from cltrain.data.bad_samples import SkipsBadSamples
from cltrain.data.errors import BadImageError, DataError
from cltrain.data.image_samples import ImageSamples
from cltrain.data.loader_threads import load_batch

__all__ = ["VAL_SPLITS", "HFImageDataset", "HFStreamingDataset", "columns", "is_hub_id", "open_dataset", "rank_of",
           "split_names"]

#: The splits evaluated on, in the order they are looked for when ``val_split`` is not given.
VAL_SPLITS = ("validation", "val", "valid", "test")


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("Hugging Face datasets need the datasets package: pip install 'cltrain[hf]'.") from None
    return datasets


def is_hub_id(root: str | os.PathLike) -> bool:
    """Whether ``open_dataset`` takes ``root`` for a Hub id: no such local path, and ``name`` or ``owner/name``."""
    text = str(root)
    return not Path(os.path.expanduser(text)).exists() and re.fullmatch(r"[\w][\w.-]*(/[\w][\w.-]*)?", text) is not None


def open_dataset(root: str | os.PathLike, streaming: bool = False) -> Mapping[str, Any]:
    """The splits of ``root`` (a ``DatasetDict``, or an ``IterableDatasetDict`` when ``streaming``): a folder
    written by ``save_to_disk`` (a single ``Dataset`` is the split ``"train"``), any other local folder
    through ``datasets.load_dataset`` (a folder of Parquet files: the splits by file name), else a Hub id.

    Raises:
        DataError: ``datasets`` is not installed, or ``root`` cannot be opened (the reason in one line).
    """
    datasets = _datasets()
    folder = Path(os.path.expanduser(str(root)))
    try:
        if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
            loaded = datasets.load_from_disk(str(folder))
            splits = loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded)
            if streaming:  # contiguous shards, enough for the DataLoader's workers to share
                return datasets.IterableDatasetDict({k: v.to_iterable_dataset(num_shards=max(1, min(len(v), 64)))
                                                     for k, v in splits.items()})
            return splits
        return datasets.load_dataset(str(folder) if folder.is_dir() else str(root), streaming=streaming)
    except Exception as err:  # a missing Hub id, no network, a folder datasets does not read
        reason = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        if is_hub_id(root):
            raise DataError(f"{root}: cannot be opened as a Hub dataset ({reason}); a Hub id is read from the local "
                            "Hugging Face cache or downloaded (HF_HUB_OFFLINE=1: the cache only).") from None
        raise DataError(f"{root}: cannot be opened as a Hugging Face dataset ({reason}); pass a folder written by "
                        "save_to_disk or a folder of Parquet files.") from None


def split_names(splits: Mapping[str, Any], root: str | os.PathLike, train_split: str = "train",
                val_split: str | None = None) -> tuple[str, str]:
    """``(train, validation)`` split names of ``splits``; ``val_split=None`` takes the first of ``VAL_SPLITS`` there.

    Raises:
        DataError: a split is missing (the splits there are named).
    """
    have = sorted(splits)
    if train_split not in splits:
        raise DataError(f"{root}: no split {train_split!r} (it has {have}); pass train_split=<one of them>.")
    val = val_split if val_split is not None else next((s for s in VAL_SPLITS if s in splits), None)
    if val is None or val not in splits:
        raise DataError(f"{root}: no split {val or ' or '.join(VAL_SPLITS)!r} to evaluate on (it has {have}); "
                        "pass val_split=<one of them>.")
    return train_split, val


def columns(features: Mapping[str, Any], image_column: str | None = None, label_column: str | None = None,
            where: str = "the dataset") -> tuple[str, str, list[str]]:
    """``(image column, label column, class names)``: the named columns, or the first ``Image`` and the
    first ``ClassLabel`` feature.

    Raises:
        DataError: no such column, or not of that type (the features are named).
    """
    datasets = _datasets()
    kinds = {name: type(f).__name__ for name, f in features.items()}

    def pick(given: str | None, kind: type, what: str) -> str:
        if given is None:
            found = next((n for n, f in features.items() if isinstance(f, kind)), None)
            if found is None:
                raise DataError(f"{where} has no {kind.__name__} column (columns: {kinds}); pass {what}=<the {what[:-7]}>.")
            return found
        if given not in features or not isinstance(features[given], kind):
            raise DataError(f"{where}: {what}={given!r} is not a {kind.__name__} column (columns: {kinds}).")
        return given

    image = pick(image_column, datasets.Image, "image_column")
    label = pick(label_column, datasets.ClassLabel, "label_column")
    return image, label, list(features[label].names)


def _undecoded(dataset: Any, image: str, label: str) -> Any:
    """``dataset`` with only the two columns, the images as ``{"bytes", "path"}`` (not decoded by ``datasets``)."""
    return dataset.select_columns([image, label]).cast_column(image, _datasets().Image(decode=False))


def _row_source(row: Mapping[str, Any], image: str, label: str) -> tuple[bytes | str, int]:
    """The encoded bytes (or the local path) of a row's image, and its label."""
    value, target = row[image], row[label]
    if value is None:
        raise ValueError("the row has no image")
    data = value.get("bytes") or value.get("path")
    if not data:
        raise ValueError("the row's image has neither bytes nor a path")
    if target is None or target < 0:
        raise ValueError(f"the row has no label ({target})")
    return data, int(target)


def _row_name(index: int | str, row: Mapping[str, Any], image: str) -> str:
    """``row <index> (<file name>)`` (the file name when the row has one)."""
    value = row.get(image)
    name = value.get("path") if isinstance(value, Mapping) else None
    return f"row {index}" + (f" ({name})" if name else "")


class HFImageDataset(ImageSamples):
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
        self.threads, self.transform, self.split, self.where = threads, transform, split, str(where)
        self.image_column, self.label_column, self.classes = columns(dataset.features, image_column, label_column,
                                                                     f"{where} ({split})")
        self.dataset = _undecoded(dataset, self.image_column, self.label_column)

    def __len__(self) -> int:
        return len(self.dataset)

    def source(self, index: int) -> tuple[bytes | str, int]:
        """The encoded bytes (or the local path) of row ``index``'s image, and its label."""
        return _row_source(self.dataset[index], self.image_column, self.label_column)

    def sample_name(self, index: int) -> str:
        """``row <index>``, with the image's file name when the row has one."""
        return _row_name(index, self.dataset[index], self.image_column)

    @property
    def split_name(self) -> str:
        """The split, as the skipped-files list names it."""
        return self.split

    @property
    def source_name(self) -> str:
        """The dataset and split, for errors."""
        return f"{self.where} ({self.split})"

    def unreadable_message(self, index: int, reason: str) -> str:
        """The one line of ``BadImageError`` for row ``index``."""
        return (f"{self.source_name} {self.sample_name(index)}: cannot be read as an image ({reason}). "
                "Pass bad_files='skip' to leave such rows out, or mend the row in the dataset.")


class HFStreamingDataset(SkipsBadSamples, IterableDataset):
    """A streamed split (``datasets.IterableDataset``) as ``(transform(image), label)`` samples, in the
    stream's order (shuffled within ``shuffle_buffer`` rows, a new order each epoch, ``set_epoch``). A
    stream has no row index: a bad row is named by its place in the epoch's stream and its file name.

    The DataLoader's workers share the stream's shards (``datasets`` gives each worker its own). With
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
        seed: the shuffle's seed (the same on every rank: the DataModule passes the run's seed);
            epoch ``e`` shuffles with ``seed + e``.
    """

    def __init__(self, dataset: Any, transform: Callable[..., Any], image_column: str | None = None,
                 label_column: str | None = None, split: str = "train", where: str = "the dataset",
                 bad_files: str = "raise", skip_log: str | os.PathLike | None = None, threads: int = 1, rank: int = 0,
                 world_size: int = 1, equal: bool = False, shuffle_buffer: int | None = None, seed: int = 0) -> None:
        self._set_policy(bad_files, skip_log)
        self.transform, self.split, self.where, self.threads = transform, split, str(where), max(1, threads)
        self.image_column, self.label_column, self.classes = columns(dataset.features, image_column, label_column,
                                                                     f"{where} ({split})")
        self.dataset = _undecoded(dataset, self.image_column, self.label_column)
        self.rank, self.world_size, self.equal = rank, world_size, equal
        self.shuffle_buffer, self.seed, self.epoch = shuffle_buffer, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration gives (``PrefetchDataLoader`` sets it)."""
        self.epoch = epoch

    @property
    def split_name(self) -> str:
        """The split, as the skipped-files list names it."""
        return self.split

    @property
    def source_name(self) -> str:
        """The dataset and split, for errors."""
        return f"{self.where} ({self.split})"

    def _rows(self) -> Iterator[tuple[str, Mapping[str, Any]]]:
        """This rank's ``(name, row)`` pairs of this worker's part of the stream."""
        stream = self.dataset
        if self.shuffle_buffer:
            stream = stream.shuffle(seed=self.seed + self.epoch, buffer_size=self.shuffle_buffer)
        info = get_worker_info()
        # a stream has no row index: its position in this worker's part of this epoch's order, and the file name
        part = "" if info is None or info.num_workers == 1 else f" of worker {info.id}"
        world, rank = self.world_size, self.rank
        mine = None
        for j, row in enumerate(stream):
            if world == 1:
                yield _row_name(f"{j}{part} of epoch {self.epoch}'s stream", row, self.image_column), row
                continue
            if j % world == rank:
                mine = (_row_name(f"{j}{part} of epoch {self.epoch}'s stream", row, self.image_column), row)
                if not self.equal:
                    yield mine
            if self.equal and j % world == world - 1:  # the group is whole: every rank has its row
                yield mine

    def _load(self, item: tuple[str, Mapping[str, Any]]) -> tuple[Any, int]:
        name, row = item
        try:
            data, target = _row_source(row, self.image_column, self.label_column)
            return self.transform(data), target
        except Exception as err:  # any failure of this one row
            reason = f"{type(err).__name__}: {err}".replace("\t", " ").replace("\n", " ")
            raise BadImageError(f"{self.source_name} {name}: cannot be read as an image ({reason}). Pass bad_files='skip' "
                                "to leave such rows out, or mend the row in the dataset.", reason) from err

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        augment = getattr(self.transform, "augment", None)
        owed, last = 0, None  # bad rows skipped since the last good one, which stands in for them
        rows = self._rows()
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

            samples = load_batch(load, range(len(chunk)), self.threads, augment, retry=BadImageError,
                                 fallback=lambda k: None)  # each sample's crop from a seed of its own, augmented in order
            for k, sample in enumerate(samples):
                if k in errors:
                    if self.bad_files == "raise":
                        raise errors[k]
                    self.skip(chunk[k][0], errors[k].reason or str(errors[k]))
                    owed += 1
                    continue
                for _ in range(owed):  # the next readable sample stands in for the bad ones before it
                    yield self._load(chunk[k])
                owed, last = 0, chunk[k]
                yield sample
        for _ in range(owed if last is not None else 0):
            yield self._load(last)

    def __len__(self) -> int:
        raise TypeError("a streamed dataset has no length")


def rank_of(trainer: Any) -> tuple[int, int]:
    """``(global rank, world size)`` of a Trainer (``(0, 1)`` without one)."""
    return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
