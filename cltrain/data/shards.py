"""WebDataset shards as NHWC batches, each sample exactly once per epoch under DDP x workers.

Pack an ImageNet-layout folder once (``cltrain.data.pack``), then train from the shards::

    python -m cltrain.data.pack /data/imagenet /data/imagenet-shards
    python train.py data=shards data.root=/data/imagenet-shards

``ShardsDataModule`` and ``ImageFolderDataModule`` are both ``ImageDataModule``s: the same
transforms (the JPEG bytes go to ``train_transform`` / ``eval_transform`` as they are), the same
``NHWCCollate`` batches built in the workers, the same normalisation and augmentation on the device.
The folder's own arguments (``bad_files``, ``check_val``, ``exclude_files``, ``index_cache``,
``allow_missing_val_classes``) are not taken: ``cltrain.data.pack`` checks every file when it packs.

Every epoch all ranks draw the same permutation of the sample indices (``seed + epoch``); rank
``r`` takes the ``r``-th of ``world_size`` contiguous slices and cuts it into batches
(``ShardBatchSampler``). Every sample is read once per epoch, by one worker of one rank; with
uneven counts every rank makes the same number of steps and some get a smaller last batch.
Samples are read by offset (the pack's ``.idx.npy``), so a worker reads only its own images' bytes.
Why WebDataset's tars and not LitData: docs/guides/data.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from typing_extensions import override

from cltrain.data.augmentation import Augmentation
from cltrain.data.collate import NHWCCollate
from cltrain.data.constants import IMAGENET_MEAN, IMAGENET_STD
from cltrain.data.dataset import BadImageError
from cltrain.data.decode_pool import load_batch
from cltrain.data.images import ImageDataModule
from cltrain.data.shard_sampler import ShardBatchSampler, check_window, rank_batch_sizes

__all__ = ["MANIFEST", "ShardBatchSampler", "ShardsDataModule", "ShardsDataset", "rank_batch_sizes", "read_manifest"]

#: Written last into a complete pack (by ``cltrain.data.pack``): classes, shards and counts per split.
MANIFEST = "shards.json"


class ShardsDataset(Dataset):
    """One split of a pack (``cltrain.data.pack``): ``dataset[i]`` is ``(HWC uint8, label)``,
    ``dataset[[i, j, ...]]`` a collated batch ``(images, targets)`` (or ``(images, targets, ids)``
    with ``with_ids``), built in the worker that reads it.

    Args:
        root: the pack's folder (holds ``shards.json``).
        split: ``"train"``, ``"val"``, ...
        transform: JPEG bytes -> HWC uint8 (``cltrain.data.train_transform`` and
            ``eval_transform`` take bytes).
        collate: makes a batch of ``(image, label)`` pairs.
        with_ids: batches also carry the int64 sample indices.
        threads: decode the samples of a batch on this many threads of the reading process
            (``cltrain.data.decode_pool``); 1 decodes them one by one.

    Raises:
        FileNotFoundError: no complete pack at ``root``.
        KeyError: the pack has no ``split``.
    """

    def __init__(self, root: str | os.PathLike, split: str, transform: Callable[[bytes], np.ndarray],
                 collate: Callable[[list], Any] | None = None, with_ids: bool = False, threads: int = 1) -> None:
        if not (isinstance(threads, int) and threads >= 1):
            raise ValueError(f"ShardsDataset: threads={threads!r} must be an int >= 1.")
        self.root, self.split, self.threads = Path(root), split, threads
        manifest = read_manifest(self.root)
        if split not in manifest["splits"]:
            raise KeyError(f"ShardsDataset: the pack at {self.root} has no split {split!r} (it has {sorted(manifest['splits'])}).")
        self.classes: list[str] = manifest["classes"]
        self.shards = [str(self.root / s) for s in manifest["splits"][split]["shards"]]
        indexes = [np.load(Path(s).with_suffix(".idx.npy"), allow_pickle=False) for s in self.shards]  # no pickle
        self.index = np.concatenate(indexes) if indexes else np.zeros((0, 3), np.int64)  # offset, size, label
        self.shard_sizes = [len(i) for i in indexes]
        self.shard_of = np.repeat(np.arange(len(indexes)), self.shard_sizes)
        self.transform, self.with_ids = transform, with_ids
        self.collate = collate if collate is not None else NHWCCollate()
        self._files: dict[int, int] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_files"] = {}  # file descriptors are per process
        return state

    def __del__(self) -> None:
        for fd in getattr(self, "_files", {}).values():
            os.close(fd)

    def __len__(self) -> int:
        return len(self.index)

    def read(self, i: int) -> bytes:
        """The stored bytes of sample ``i`` (the image file as it was packed)."""
        shard = int(self.shard_of[i])
        fd = self._files.get(shard)
        if fd is None:
            fd = self._files[shard] = os.open(self.shards[shard], os.O_RDONLY)
        offset, size, _ = self.index[i]
        return os.pread(fd, int(size), int(offset))

    def load(self, i: int) -> tuple[np.ndarray, int]:
        """``(HWC uint8, label)`` of sample ``i``; ``BadImageError`` names the shard and sample."""
        try:
            return self.transform(self.read(i)), int(self.index[i, 2])
        except Exception as err:
            raise BadImageError(f"{self.shards[int(self.shard_of[i])]}: sample {i} of {self.split!r} cannot be read as an image "
                                f"({type(err).__name__}: {err}); pack the folder again.") from err

    def __getitem__(self, index: int | Sequence[int]) -> Any:
        if isinstance(index, (int, np.integer)):
            return self.load(int(index))
        # each sample's crop from a seed of its own, whatever the number of threads (as ImageFolderDataset)
        samples = load_batch(self.load, index, self.threads, getattr(self.transform, "augment", None))
        batch = self.collate(samples)
        return (*batch, torch.as_tensor(index, dtype=torch.int64)) if self.with_ids else batch


def read_manifest(root: str | os.PathLike) -> dict:
    """The ``shards.json`` of a complete pack; ``FileNotFoundError`` saying how to make one."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {root} is not a complete cltrain pack. Make one with "
                                f"`python -m cltrain.data.pack IMAGEFOLDER {root}` (run it again to finish an interrupted one).")
    return json.loads(path.read_text())


class ShardsDataModule(ImageDataModule):
    """A pack of WebDataset shards (``cltrain.data.pack``) as normalised channels_last batches.

    Takes the arguments of ``ImageFolderDataModule`` that do not concern files on disk (those
    a pack settles when it is made: ``bad_files``, ``check_val``, ``exclude_files``,
    ``index_cache``, ``allow_missing_val_classes``, are refused with Python's ``TypeError``);
    a bad sample raises ``BadImageError`` naming its shard. Besides:

    Args:
        root: the pack's folder (``OUT`` of ``python -m cltrain.data.pack ROOT OUT``).
        decode_threads: threads that decode a batch's samples in each loading process (``"auto"``:
            ``cltrain.data.decode_pool.loading_plan``).
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

    def __init__(self, root: str | os.PathLike, batch_size: int = 64, num_workers: int | str = "auto", persistent_workers: bool = True,
                 pin_memory: bool | None = None, image_size: int | tuple[int, int] = 224, val_resize_size: int | None = 256,
                 channels: int = 3, *, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32, channels_last: bool = True, cuda_prefetch: bool = False,
                 interpolation: str = "bilinear", exif_transpose: bool = False, decode_threads: int | str = "auto",
                 decoder: str = "auto", augmentation: Augmentation | None = None, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), hflip: float = 0.5, augment: str = "none",
                 random_erasing: float = 0.0, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
                 mixup_prob: float = 1.0, mixup_switch_prob: float = 0.5, seed: int = 0,
                 shuffle_window: int | None = None) -> None:
        super().__init__(root, batch_size=batch_size, num_workers=num_workers, persistent_workers=persistent_workers,
                         pin_memory=pin_memory, image_size=image_size, val_resize_size=val_resize_size, channels=channels,
                         mean=mean, std=std, dtype=dtype, channels_last=channels_last, cuda_prefetch=cuda_prefetch,
                         interpolation=interpolation, exif_transpose=exif_transpose, decode_threads=decode_threads,
                         decoder=decoder, augmentation=augmentation, scale=scale, ratio=ratio, hflip=hflip, augment=augment,
                         random_erasing=random_erasing, mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha,
                         mixup_prob=mixup_prob, mixup_switch_prob=mixup_switch_prob)
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
        trainer = self.trainer
        self._world = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        # The dataset collates its batch in the worker that reads it; workers: the loader pins.
        collate = self._collate(pin_memory=self._pin and self.num_workers == 0)
        if stage == "fit" and self.train_set is None:
            self.train_set = ShardsDataset(self.root, "train", self.train_transform, collate, threads=self.decode_threads)
        if self.val_set is None:
            self.val_set = ShardsDataset(self.root, "val", self.eval_transform, collate, threads=self.decode_threads)

    @override
    def _batching(self, dataset: ShardsDataset, train: bool, drop_last: bool | None) -> dict[str, Any]:  # type: ignore[override]
        # batch_size=None: the sampler yields whole batches and the dataset collates them in the worker;
        # nothing is dropped: the sampler keeps the ranks in step, each sample once (see ShardBatchSampler).
        sampler = ShardBatchSampler(dataset, self.batch_size, *self._world, shuffle=train, seed=self.seed,
                                    shuffle_window=self.shuffle_window)
        return dict(batch_size=None, sampler=sampler)
