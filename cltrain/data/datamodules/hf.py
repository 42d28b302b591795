"""``HFImageDataModule``: a Hugging Face image dataset (a Hub id, a ``save_to_disk`` folder, Parquet files) as NHWC batches.

::

    python train.py data=hf data.root=/data/imagenet-parquet        # or a Hub id, or a save_to_disk folder

The rows' encoded image bytes go straight to the NHWC path (``cltrain.data.hf_dataset``): a JPEG is
decoded by libjpeg-turbo into its batch slot, any other format by Pillow, as from a folder; labels
and class names come from the ``ClassLabel`` column. It is an ``ImageDataModule``: the same
transforms, ``NHWCCollate`` batches, normalisation and augmentation on the device, the same
``bad_files`` policy (a bad row named by its index). A map-style dataset is read as a folder is:
whole batches decoded on the decode threads of each worker, Lightning's ``DistributedSampler``
under DDP. A streamed one (``streaming=True``) is read in order, shuffled in a buffer (see
``HFStreamingDataset`` for how ranks share it).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from cltrain.data.datamodules.base import takes_arguments_of
from cltrain.data.datamodules.image_base import ImageDataModule
from cltrain.data.datamodules.skipped_files import TakesBadFiles
from cltrain.data.errors import DataError
from cltrain.data.hf_dataset import HFImageDataset, HFStreamingDataset, rank_of
from cltrain.data.hf_source import columns, open_dataset, split_names
from cltrain.data.prefetch import PrefetchDataLoader

__all__ = ["HFImageDataModule"]


class HFImageDataModule(TakesBadFiles, ImageDataModule):
    """A Hugging Face image dataset as normalised channels_last batches.

    Takes [`ImageDataModule`][cltrain.data.datamodules.image_base.ImageDataModule]'s arguments, with
    ``root`` a folder written by ``save_to_disk``, a folder of Parquet files (any folder
    ``datasets.load_dataset`` reads: the splits by file name), or a Hub id (downloaded into the
    Hugging Face cache on first use; offline, ``HF_HUB_OFFLINE=1``, from that cache), then these.
    Needs ``pip install 'cltrain[hf]'``.

    Args:
        bad_files: ``"raise"``: a row whose image cannot be read stops with an error naming its index;
            ``"skip"``: the next readable row stands in for it, and the row is listed in the run
            directory's ``skipped_files.tsv`` and counted per epoch (as ``ImageFolderDataModule``).
        streaming: read the splits as streams (``load_dataset(..., streaming=True)``): nothing is
            downloaded or converted first; samples come in the stream's order, shuffled in a buffer.
        train_split: the split trained on.
        val_split: the split evaluated on (also for test and predict); ``None``: the first of
            ``validation``, ``val``, ``valid``, ``test`` the dataset has.
        image_column: the image column; ``None``: the first ``datasets.Image`` feature.
        label_column: the label column; ``None``: the first ``datasets.ClassLabel`` feature.
        shuffle_buffer: with ``streaming``, rows shuffled together for training (``None``: stream order).
        shuffle_seed: with ``streaming``, the seed of the training order: epoch ``e`` shuffles with
            ``shuffle_seed + e``, the same on every rank.

    Raises:
        ValueError: a bad argument (at construction).
        DataError: ``datasets`` missing, a root it cannot open, a missing split or column (when the
            classes are first asked for, or in ``setup``); fewer training images than a batch.

    Example::

        >>> from cltrain.data import HFImageDataModule
        >>> dm = HFImageDataModule("/data/imagenet-parquet", batch_size=256)    # doctest: +SKIP
        >>> dm.num_classes                                                      # doctest: +SKIP
        1000
    """

    #: What ``root`` may be, for the app's error when it cannot be opened.
    root_hint = "a folder written by save_to_disk, a folder of Parquet files, or a Hub id <owner>/<name>"

    @takes_arguments_of(ImageDataModule)
    def __init__(self, *args: Any, bad_files: str = "raise", streaming: bool = False, train_split: str = "train",
                 val_split: str | None = None, image_column: str | None = None, label_column: str | None = None,
                 shuffle_buffer: int | None = 10_000, shuffle_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, bad_files=bad_files, **kwargs)
        owner = type(self).__name__
        if shuffle_buffer is not None and not (isinstance(shuffle_buffer, int) and shuffle_buffer >= 1):
            raise ValueError(f"{owner}: shuffle_buffer={shuffle_buffer!r} must be an int >= 1 or None.")
        if not (isinstance(shuffle_seed, int) and 0 <= shuffle_seed < 2**32):
            raise ValueError(f"{owner}: shuffle_seed={shuffle_seed!r} must be an int in [0, 2**32).")
        for name, value in (("train_split", train_split), ("val_split", val_split), ("image_column", image_column),
                            ("label_column", label_column)):
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{owner}: {name}={value!r} must be a name (or None).")
        self.root_name = str(args[0] if args else kwargs.get("root"))  # a Hub id is not a path: kept as given
        self.streaming, self.train_split, self.val_split = bool(streaming), train_split, val_split
        self.image_column, self.label_column = image_column, label_column
        self.shuffle_buffer, self.shuffle_seed = shuffle_buffer, shuffle_seed
        if self.streaming:
            self.persistent_workers = False  # each epoch's workers take the loader's new epoch (its shuffle seed)
        self._splits: Any = None
        self._names: tuple[str, str] | None = None

    def _open(self) -> tuple[Any, tuple[str, str]]:
        if self._splits is None:
            self._splits = open_dataset(self.root_name, self.streaming)
            self._names = split_names(self._splits, self.root_name, self.train_split, self.val_split)
        return self._splits, self._names  # type: ignore[return-value]

    @property
    @override
    def classes(self) -> list[str]:
        """The names of the training split's ``ClassLabel``, in label order."""
        if self._classes is None:
            splits, (train, _) = self._open()
            self._classes = columns(splits[train].features, self.image_column, self.label_column,
                                    f"{self.root_name} ({train})")[2]
        return self._classes

    @override
    def setup(self, stage: str) -> None:
        self._choose_device()
        self._open_skip_log()
        splits, (train, val) = self._open()
        common = dict(image_column=self.image_column, label_column=self.label_column, where=self.root_name,
                      bad_files=self.bad_files, skip_log=self._skip_log, threads=self.decode_threads)
        rank, world = rank_of(self.trainer)
        for name, transform, is_train in ((train, self.train_transform, True), (val, self.eval_transform, False)):
            if (is_train and (stage != "fit" or self.train_set is not None)) or (not is_train and self.val_set is not None):
                continue
            if self.streaming:
                dataset = HFStreamingDataset(splits[name], transform, split=name, rank=rank, world_size=world, equal=is_train,
                                             shuffle_buffer=self.shuffle_buffer if is_train else None,
                                             seed=self.shuffle_seed, **common)
            else:
                dataset = HFImageDataset(splits[name], transform, split=name, **common)
            if dataset.classes != self.classes:
                raise DataError(f"{self.root_name}: the split {name!r} has the classes {dataset.classes[:5]}..., the "
                                f"training split {self.classes[:5]}...; both need the same ClassLabel.")
            if is_train:
                self.train_set = dataset
            else:
                self.val_set = dataset

    @override
    def _batching(self, dataset: Any, train: bool, drop_last: bool | None) -> dict[str, Any]:
        batching = super()._batching(dataset, train, drop_last)
        if isinstance(dataset, HFStreamingDataset):
            batching.pop("shuffle", None)  # a stream is shuffled in its buffer, by the dataset
            batching.pop("sampler", None)
        return batching

    @override
    def train_dataloader(self) -> PrefetchDataLoader:
        if isinstance(self.train_set, HFImageDataset) and len(self.train_set) < self.batch_size:
            raise DataError(f"{type(self).__name__}: {self.root_name} ({self.train_set.split}) has {len(self.train_set)} "
                            f"rows, fewer than batch_size={self.batch_size}; the training loader drops partial batches.")
        return self._loader(self.train_set, train=True)
