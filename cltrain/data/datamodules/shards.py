"""``ShardsDataModule``: WebDataset shards as NHWC batches, each sample exactly once per epoch under DDP x workers.

Pack an ImageNet-layout folder once (``cltrain.data.pack``), then train from the shards::

    python -m cltrain.data.pack /data/imagenet /data/imagenet-shards
    python train.py data=shards data.root=/data/imagenet-shards

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

from typing_extensions import override

from cltrain.data.datamodules.base import takes_arguments_of
from cltrain.data.datamodules.image_base import ImageDataModule
from cltrain.data.datamodules.skipped_files import TakesBadFiles
from cltrain.data.shard_dataset import ShardsDataset, read_manifest
from cltrain.data.shard_sampler import ShardBatchSampler, check_window

__all__ = ["ShardsDataModule"]


class ShardsDataModule(TakesBadFiles, ImageDataModule):
    """A pack of WebDataset shards (``cltrain.data.pack``) as normalised channels_last batches.

    Takes [`ImageDataModule`][cltrain.data.datamodules.image_base.ImageDataModule]'s arguments,
    with ``root`` the pack's folder (``OUT`` of ``python -m cltrain.data.pack ROOT OUT``), then
    these. The folder's own arguments (those a pack settles when it is made: ``check_val``,
    ``exclude_files``, ``index_cache``, ``allow_missing_val_classes``) are refused with a one-line
    ``TypeError``.

    Args:
        bad_files: ``"raise"``: a sample that cannot be read stops with an error naming the file it
            was packed from; ``"skip"``: it is replaced by the next readable one, listed in the run
            directory's ``skipped_files.tsv`` and counted per epoch (as ``ImageFolderDataModule``).
        seed: seed of the per-epoch training order (the same on every rank).
        shuffle_window: ``None`` (default): each epoch is one permutation of all samples;
            ``k``: shards permuted, samples shuffled within runs of ``k`` shards (fewer
            files per rank per epoch; see ``ShardBatchSampler``).

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

    @takes_arguments_of(ImageDataModule)
    def __init__(self, *args: Any, bad_files: str = "raise", seed: int = 0, shuffle_window: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, bad_files=bad_files, **kwargs)
        self.seed, self.shuffle_window = seed, check_window(shuffle_window, "ShardsDataModule")
        self.train_set: ShardsDataset | None = None
        self.val_set: ShardsDataset | None = None
        self._world = (1, 0)

    @property
    @override
    def classes(self) -> list[str]:
        """Class names of the pack, in label order."""
        if self._classes is None:
            self._classes = list(read_manifest(self.root)["classes"])
        return self._classes

    @override
    def setup(self, stage: str) -> None:
        self._choose_device()
        self._open_skip_log()
        trainer = self.trainer
        self._world = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        # The dataset collates its batch in the worker that reads it; workers: the loader pins.
        collate = self._collate(pin_memory=self._pin and self.num_workers == 0)
        policy = dict(threads=self.decode_threads, bad_files=self.bad_files, skip_log=self._skip_log)
        if stage == "fit" and self.train_set is None:
            self.train_set = ShardsDataset(self.root, "train", self.train_transform, collate, **policy)
        if self.val_set is None:
            self.val_set = ShardsDataset(self.root, "val", self.eval_transform, collate, **policy)

    @override
    def _batching(self, dataset: ShardsDataset, train: bool, drop_last: bool | None) -> dict[str, Any]:  # type: ignore[override]
        # batch_size=None: the sampler yields whole batches and the dataset collates them in the worker;
        # nothing is dropped: the sampler keeps the ranks in step, each sample once (see ShardBatchSampler).
        sampler = ShardBatchSampler(dataset, self.batch_size, *self._world, shuffle=train, seed=self.seed,
                                    shuffle_window=self.shuffle_window)
        return dict(batch_size=None, sampler=sampler)
