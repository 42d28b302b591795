"""The datasets other streaming engines wrote, as NHWC batches: ``LitDataModule`` (``litdata.optimize``),
``MDSModule`` (Mosaic's ``MDSWriter``) and ``WebDatasetModule`` (WebDataset tar shards of any writer).

::

    python train.py data=litdata data.root=s3://bucket/imagenet-litdata data.num_classes=1000
    python train.py data=mds data.root=s3://bucket/imagenet-mds data.num_classes=1000
    python train.py data=webdataset data.root=s3://bucket/imagenet-wds data.num_classes=1000

``root`` holds one dataset per split (``root/train``, ``root/val``: ``train_split`` / ``val_split``), a local folder
or a URL. Each item's image file bytes go to the loader's decoder undecoded (``cltrain.data.litdata_source``,
``cltrain.data.mds_source``), and the items are read by index, so these are ``ImageDataModule``s like the others: the same transforms,
``NHWCCollate`` batches, normalisation and augmentation on the device, the same ``bad_files`` policy, and the same
sampler (``cltrain.data.resume_state.ResumableSampler``): each sample once per epoch over the ranks (padded to a
multiple of the ranks, as ``DistributedSampler`` pads), built in ``setup`` once the ranks exist, and an exact resume
mid-epoch from the checkpoint, also on another number of ranks. LitData's own downloader and chunk cache fetch its
bytes; MDS shards come through the node's shard cache (``cltrain.data.shard_cache``). These formats hold no class names: ``num_classes`` says how many.

WebDataset shards have no index: ``WebDatasetModule`` streams them (``cltrain.data.webdataset_source``), every rank in
step whatever the number of shards; WebDataset keeps no place in an epoch, so a run resumed mid-epoch starts that
epoch again from its first batch.
"""

from __future__ import annotations

import warnings
from typing import Any

from typing_extensions import override

from cltrain.data.datamodules.image_base import ImageDataModule
from cltrain.data.errors import DataError
from cltrain.data.remote import join
from cltrain.data.settings import LITDATA, MDS, WEBDATASET

__all__ = ["LitDataModule", "MDSModule", "WebDatasetModule"]


class _SplitsDataModule(ImageDataModule):
    """What the engines' DataModules share: ``root/<train_split>`` and ``root/<val_split>`` (``Splits``), a URL."""

    takes_urls = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._classes = [str(k) for k in range(self.splits.num_classes)]

    @property
    @override
    def classes(self) -> list[str]:
        """``"0" .. str(num_classes - 1)``: the format keeps no class names."""
        return self._classes  # type: ignore[return-value]

    def _open(self, split: str, transform: Any, train: bool) -> Any:
        raise NotImplementedError

    @override
    def setup(self, stage: str) -> None:
        self._join_trainer()
        if stage == "fit" and self.train_set is None:
            self.train_set = self._open(self.train_split, self.train_transform, True)
        if self.val_set is None:
            self.val_set = self._open(self.val_split, self.eval_transform, False)
        for split in (self.train_set, self.val_set):  # a label of no class is a bad sample (``class_index``)
            if split is not None:
                split.num_classes = self.splits.num_classes


class LitDataModule(_SplitsDataModule):
    """LitData optimized datasets (``root/<train_split>``, ``root/<val_split>``) as normalised channels_last batches.

    Made of ``cltrain.data.settings.LITDATA``: the image groups of
    [`ImageDataModule`][cltrain.data.datamodules.image_base.ImageDataModule], then ``Splits``
    (``num_classes``, ``train_split``, ``val_split``) and ``LitDataSource`` (``image_key``,
    ``label_key``, ``cache_dir``, ``max_cache_size``), with ``root`` a folder or a URL (``s3://``,
    ``gs://``, ``azure://``). Needs ``pip install 'cltrain[litdata]'``.

    Raises:
        ValueError: a bad argument (at construction).
        DataError: ``litdata`` missing, a split that is not an optimized dataset, items without an image file or a
            label (in ``setup``).

    Example::

        >>> from cltrain.data.datamodules.engines import LitDataModule
        >>> dm = LitDataModule("s3://bucket/imagenet-litdata", num_classes=1000, batch_size=256)  # doctest: +SKIP
    """

    settings = LITDATA

    def _open(self, split: str, transform: Any, train: bool) -> Any:
        from cltrain.data.litdata_source import LitDataImages

        return LitDataImages(join(str(self.root), split), transform, self.image_key, self.label_key, split=split,
                             cache_dir=self.cache_dir, max_cache_size=self.max_cache_size, bad_files=self.bad_files,
                             skip_log=self._skip_log, threads=self.decode_threads)

    @override
    def train_dataloader(self) -> Any:
        if self.train_set is not None and len(self.train_set) < self.batch_size:
            raise DataError(f"{type(self).__name__}: {self.train_set.source_name} has {len(self.train_set)} items, fewer "
                            f"than batch_size={self.batch_size}"
                            " (the app's data.batch_size); the training loader drops partial batches.")
        return self._loader(self.train_set, train=True)


class MDSModule(_SplitsDataModule):
    """Mosaic MDS datasets (``root/<train_split>/index.json``, ``root/<val_split>/index.json``, uncompressed shards)
    as normalised channels_last batches (see the module docstring).

    Made of ``cltrain.data.settings.MDS``: the image groups of
    [`ImageDataModule`][cltrain.data.datamodules.image_base.ImageDataModule], then ``Splits``,
    ``MDSColumns`` (``image_key``, ``label_key``) and ``ShardCache`` (``cache_dir``, ``cache_limit``),
    with ``root`` a folder or a URL. Needs ``pip install 'cltrain[mds]'`` (mosaicml-streaming).

    Example::

        >>> from cltrain.data.datamodules.engines import MDSModule
        >>> dm = MDSModule("s3://bucket/imagenet-mds", num_classes=1000, batch_size=256)  # doctest: +SKIP
    """

    settings = MDS

    def _open(self, split: str, transform: Any, train: bool) -> Any:
        from cltrain.data.mds_source import MDSImages

        return MDSImages(str(self.root), split, transform, self.image_key, self.label_key, cache_dir=self.cache_dir,
                         cache_limit=self.cache_limit, bad_files=self.bad_files, skip_log=self._skip_log,
                         threads=self.decode_threads)

    train_dataloader = LitDataModule.train_dataloader


class WebDatasetModule(_SplitsDataModule):
    """WebDataset tar shards (``root/<train_split>/*.tar``, ``root/<val_split>/*.tar``: ``<key>.jpg`` and
    ``<key>.cls``) streamed as normalised channels_last batches (see the module docstring).

    Made of ``cltrain.data.settings.WEBDATASET``: the image groups of
    [`ImageDataModule`][cltrain.data.datamodules.image_base.ImageDataModule], then ``Splits``,
    ``StreamOrder`` (``shuffle_buffer``, ``seed``) and ``ShardCache`` (``cache_dir``, ``cache_limit``),
    with ``root`` a folder or a URL. Needs ``pip install 'cltrain[shards]'`` (webdataset).

    Example::

        >>> from cltrain.data.datamodules.engines import WebDatasetModule
        >>> dm = WebDatasetModule("s3://bucket/imagenet-wds", num_classes=1000, batch_size=256)  # doctest: +SKIP
    """

    settings = WEBDATASET

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.persistent_workers = False  # each epoch's workers take the loader's new epoch (its order)
        self._started = False
        self._epoch: int | None = None  # the epoch the training batches come from

    @override
    def state_dict(self) -> dict[str, Any]:
        """The epoch of the training batches as a place that holds no position: ``ResumeMidEpoch`` counts a checkpoint
        of its middle (a ``max_steps`` stop's ``last.ckpt``, which Lightning counts done) as that epoch started, and
        the resumed run reads it again from its first batch, saying so, as after a signal's stop."""
        progress = getattr(getattr(getattr(self.trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
        if self._epoch is None or progress is None:
            return {}
        return {"train_loader": {"epoch": self._epoch, "finished": bool(progress.is_last_batch)}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the epoch starts again (``state_dict``)."""

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if getattr(trainer, "training", False):
            self._epoch = trainer.current_epoch
        if self._epoch is not None and not self._started:
            self._started = True
            progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
            done = getattr(getattr(progress, "current", None), "completed", 0)
            if getattr(trainer, "ckpt_path", None) and isinstance(done, int) and done > 0:
                warnings.warn(f"cltrain: WebDataset keeps no place in an epoch: epoch {trainer.current_epoch} is read "
                              f"again from its first batch, after {done} batch(es) of it were trained on (its "
                              "samples, so the weights, are not the uninterrupted run's; data=shards, litdata and mds "
                              "resume where they stopped).", stacklevel=2)
        return super().on_after_batch_transfer(batch, dataloader_idx)

    def _open(self, split: str, transform: Any, train: bool) -> Any:
        from cltrain.data.hf_dataset import rank_of
        from cltrain.data.webdataset_source import WebDatasetImages

        rank, world = rank_of(self.trainer) if train else (0, 1)
        return WebDatasetImages(str(self.root), split, transform, rank=rank, world_size=world,
                                shuffle_buffer=self.shuffle_buffer if train else None, seed=self.seed,
                                cache_dir=self.cache_dir, cache_limit=self.cache_limit, bad_files=self.bad_files,
                                skip_log=self._skip_log, threads=self.decode_threads)

    @override
    def _batching(self, dataset: Any, train: bool, drop_last: bool | None) -> dict[str, Any]:
        batching = super()._batching(dataset, train, drop_last)
        batching.pop("shuffle", None)  # a stream is shuffled by the dataset
        return batching
