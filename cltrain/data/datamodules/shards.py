"""``ShardsDataModule``: WebDataset shards as NHWC batches, each sample exactly once per epoch under DDP x workers.

Pack an ImageNet-layout folder once (``cltrain.data.pack``), then train from the shards, on a local disk or
from object storage (the pack uploaded as it is; docs/guides/object-storage.md)::

    python -m cltrain.data.pack /data/imagenet /data/imagenet-shards
    python train.py data=shards data.root=/data/imagenet-shards
    python train.py data=shards data.root=s3://bucket/imagenet-shards data.shuffle_window=16

``ShardsDataModule`` and ``ImageFolderDataModule`` are both ``ImageDataModule``s: the same
transforms (the JPEG bytes go to ``train_transform`` / ``eval_transform`` as they are), the same
``NHWCCollate`` batches built in the workers, the same normalisation and augmentation on the device,
the same ``bad_files`` policy (a bad sample named by the file it was packed from). The folder's own
arguments (``check_val``, ``exclude_files``, ``index_cache``, ``allow_missing_val_classes``) are not
taken: ``cltrain.data.pack`` checks every file when it packs.

Every epoch all ranks draw the same permutation of the sample indices (``seed + epoch``); rank
``r`` takes the ``r``-th of ``world_size`` contiguous slices and cuts it into batches
(``ShardBatchSampler``). Every sample is read once per epoch, by one worker of one rank; with
uneven counts every rank makes the same number of steps and some get a smaller last batch.
Samples are read by offset (``ShardsDataset``, ``cltrain.data.shard_dataset``), so a worker reads
only its own images' bytes. Why WebDataset's tars and not LitData: docs/guides/data.md.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from cltrain.data.datamodules.image_base import ImageDataModule
from cltrain.data.settings import SHARDS
from cltrain.data.shard_dataset import ShardsDataset
from cltrain.data.shard_sampler import ShardBatchSampler
from cltrain.data.shard_source import LocalPack, RemotePack, open_pack

__all__ = ["ShardsDataModule"]


class ShardsDataModule(ImageDataModule):
    """A pack of WebDataset shards (``cltrain.data.pack``) as normalised channels_last batches.

    Made of ``cltrain.data.settings.SHARDS``: the image groups of
    [`ImageDataModule`][cltrain.data.datamodules.image_base.ImageDataModule], then ``PackReading``
    (``seed``, ``shuffle_window``, ``fetch``) and ``ShardCache`` (``cache_dir``, ``cache_limit``); each
    argument is documented in its group. ``root`` is the pack's folder (``OUT`` of
    ``python -m cltrain.data.pack ROOT OUT``) or its URL in object storage (``s3://bucket/pack``,
    ``gs://``, ``az://``, ``https://``: ``cltrain.data.shard_source``). The folder's own arguments
    (those a pack settles when it is made: ``check_val``, ``exclude_files``, ``index_cache``,
    ``allow_missing_val_classes``) are refused with a one-line ``TypeError``. With
    ``bad_files="skip"`` a sample that cannot be read (named by the file it was packed from) is
    replaced by the next readable one, as in ``ImageFolderDataModule``.

    Under DDP (``trainer.world_size`` ranks) each rank reads its own slice of every
    epoch's permutation: each sample exactly once per epoch, the same step count on
    every rank (see the module docstring); nothing is dropped, in training either.
    Test and predict use ``val``.

    Example::

        >>> from cltrain.data import ShardsDataModule, make_demo_dataset
        >>> from cltrain.data.pack import pack
        >>> _ = pack(make_demo_dataset("/tmp/cltrain-demo"), "/tmp/cltrain-demo-shards", progress=False)
        >>> dm = ShardsDataModule("/tmp/cltrain-demo-shards", batch_size=32, num_workers=2)
        >>> dm.num_classes, dm.input_shape
        (10, (32, 3, 224, 224))
    """

    root_hint = "a pack cltrain-pack wrote (its shards.json), or its URL"
    settings = SHARDS
    takes_urls = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pack: LocalPack | None = None
        self.train_set: ShardsDataset | None = None
        self.val_set: ShardsDataset | None = None
        self._world = (1, 0)

    @property
    def pack(self) -> LocalPack:
        """Where the pack's bytes come from (``cltrain.data.shard_source``)."""
        if self._pack is None:
            self._pack = open_pack(self.root, self.cache_dir, self.cache_limit, self.fetch)
        return self._pack

    @property
    @override
    def classes(self) -> list[str]:
        """Class names of the pack, in label order."""
        if self._classes is None:
            self._classes = list(self.pack.manifest()["classes"])
        return self._classes

    @override
    def setup(self, stage: str) -> None:
        self._join_trainer()
        trainer = self.trainer
        self._world = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        # The dataset collates its batch in the worker that reads it; workers: the loader pins.
        collate = self._collate(pin_memory=self._pin and self.num_workers == 0)
        policy = dict(threads=self.decode_threads, bad_files=self.bad_files, skip_log=self._skip_log, source=self.pack)
        # built here, once the trainer's ranks exist: each rank's sampler takes its own part (LitData #250)
        if stage == "fit" and self.train_set is None:
            self.train_set = ShardsDataset(self.root, "train", self.train_transform, collate, **policy)
            self._warn_if_cache_too_small(self.train_set)
        if self.val_set is None:
            self.val_set = ShardsDataset(self.root, "val", self.eval_transform, collate, **policy)

    def _warn_if_cache_too_small(self, dataset: ShardsDataset) -> None:
        """A full permutation reads every shard in every stretch of batches: with a cache smaller than the split,
        shards are fetched again and again."""
        pack = self.pack
        if not (isinstance(pack, RemotePack) and pack.fetch == "shards" and self.shuffle_window is None):
            return
        size = int((dataset.index[:, 0] + dataset.index[:, 1]).max(initial=0)) * len(dataset.shard_names)
        if size > pack.cache.limit:
            need, limit = _sizes(size, pack.cache.limit)
            rank_zero_warn(f"ShardsDataModule: {pack.where} ({dataset.split}, about {need}) does not fit "
                           f"the shard cache ({limit} in {pack.cache.folder}) and "
                           "shuffle_window=None reads every shard in every stretch of batches: shards will be fetched "
                           "more than once per epoch. Set shuffle_window (e.g. 16), a larger cache_limit, or fetch='ranges'.")

    @override
    def _batching(self, dataset: ShardsDataset, train: bool, drop_last: bool | None) -> dict[str, Any]:  # type: ignore[override]
        # batch_size=None: the sampler yields whole batches and the dataset collates them in the worker;
        # nothing is dropped: the sampler keeps the ranks in step, each sample once (see ShardBatchSampler).
        sampler = ShardBatchSampler(dataset, self.batch_size, *self._world, shuffle=train, seed=self.seed,
                                    shuffle_window=self.shuffle_window)
        return dict(batch_size=None, sampler=sampler)


def _sizes(*sizes: int) -> list[str]:
    """Bytes as the warnings give them: GiB, MiB, else KiB (a small pack or limit is not "0.0 GiB"), with the digits
    that tell them apart (a split larger than the limit is never "0.3 MiB" beside "0.3 MiB")."""
    units = ((2**30, "GiB"), (2**20, "MiB"), (1, "KiB"))
    for digits in (1, 2, 3):
        shown = [next(f"{n / max(u, 2**10):.{digits}f} {name}" for u, name in units if n >= u or u == 1) for n in sizes]
        if len(set(shown)) == len(set(sizes)):
            break
    return shown
