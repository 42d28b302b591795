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

from cltrain.data.datamodules.image_base import ImageDataModule
from cltrain.data.errors import DataError
from cltrain.data.hf_dataset import HFImageDataset, HFStreamingDataset, rank_of
from cltrain.data.hf_source import READS, URL_FIX, columns, open_dataset, split_names
from cltrain.data.prefetch import PrefetchDataLoader
from cltrain.data.settings import HF

__all__ = ["HFImageDataModule"]


class HFImageDataModule(ImageDataModule):
    """A Hugging Face image dataset as normalised channels_last batches.

    Made of ``cltrain.data.settings.HF``: the image groups of
    [`ImageDataModule`][cltrain.data.datamodules.image_base.ImageDataModule], then ``HFSource``
    (``streaming``, ``train_split``, ``val_split``, ``image_column``, ``label_column``,
    ``shuffle_buffer``, ``shuffle_seed``); each argument is documented in its group. ``root`` is a
    folder written by ``save_to_disk``, a folder of Parquet files (any folder ``datasets.load_dataset``
    reads: the splits by file name), or a Hub id (downloaded into the Hugging Face cache on first
    use; offline, ``HF_HUB_OFFLINE=1``, from that cache). Needs ``pip install 'cltrain[hf]'``. With
    ``bad_files="skip"`` a row whose image cannot be read (named by its index) is replaced by the
    next readable row, as in ``ImageFolderDataModule``.

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

    settings = HF
    url_fix = f"{READS}: {URL_FIX}"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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
        self._join_trainer()
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
                            f"rows, fewer than batch_size={self.batch_size}"
                            " (the app's data.batch_size); the training loader drops partial batches.")
        return self._loader(self.train_set, train=True)
