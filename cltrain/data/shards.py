"""WebDataset shards as NHWC batches, each sample exactly once per epoch under DDP x workers.

Pack an ImageNet-layout folder once (``cltrain.data.pack``), then train from the shards::

    python -m cltrain.data.pack /data/imagenet /data/imagenet-shards
    python train.py data=shards data.root=/data/imagenet-shards

``ShardsDataModule`` is ``ImageFolderDataModule`` reading shards instead of files: the same
transforms (the JPEG bytes go to ``train_transform`` / ``eval_transform`` as they are), the same
``NHWCCollate`` batches built in the workers, the same normalisation on the device.

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

from cltrain.data.collate import NHWCCollate
from cltrain.data.datamodule import ImageFolderDataModule
from cltrain.data.dataset import BadImageError
from cltrain.data.prefetch import PrefetchDataLoader
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

    Raises:
        FileNotFoundError: no complete pack at ``root``.
        KeyError: the pack has no ``split``.
    """

    def __init__(self, root: str | os.PathLike, split: str, transform: Callable[[bytes], np.ndarray],
                 collate: Callable[[list], Any] | None = None, with_ids: bool = False) -> None:
        self.root, self.split = Path(root), split
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
        batch = self.collate([self.load(i) for i in index])
        return (*batch, torch.as_tensor(index, dtype=torch.int64)) if self.with_ids else batch


def read_manifest(root: str | os.PathLike) -> dict:
    """The ``shards.json`` of a complete pack; ``FileNotFoundError`` saying how to make one."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {root} is not a complete cltrain pack. Make one with "
                                f"`python -m cltrain.data.pack IMAGEFOLDER {root}` (run it again to finish an interrupted one).")
    return json.loads(path.read_text())


class ShardsDataModule(ImageFolderDataModule):
    """A pack of WebDataset shards (``cltrain.data.pack``) as normalised channels_last batches.

    Takes ``ImageFolderDataModule``'s arguments (``bad_files`` aside: a
    bad sample raises ``BadImageError`` naming its shard), plus:

    Args:
        root: the pack's folder (``OUT`` of ``python -m cltrain.data.pack ROOT OUT``).
        seed: seed of the per-epoch training order (the same on every rank).
        shuffle_window: ``None`` (default): each epoch is one permutation of all samples;
            ``k``: shards permuted, samples shuffled within runs of ``k`` shards (fewer
            files per rank per epoch; see ``ShardBatchSampler``).

    Under DDP (``trainer.world_size`` ranks) each rank reads its own slice of every
    epoch's permutation: each sample exactly once per epoch, the same step count on
    every rank (see the module docstring). Test and predict use ``val``.

    Example::

        >>> from cltrain.data import ShardsDataModule, make_demo_dataset
        >>> from cltrain.data.pack import pack
        >>> _ = pack(make_demo_dataset("/tmp/cltrain-demo"), "/tmp/cltrain-demo-shards", progress=False)
        >>> dm = ShardsDataModule("/tmp/cltrain-demo-shards", batch_size=32, num_workers=2)
        >>> dm.num_classes, dm.input_shape
        (10, (32, 3, 224, 224))
    """

    def __init__(self, root: str | os.PathLike, *args: Any, seed: int = 0, shuffle_window: int | None = None,
                 **kwargs: Any) -> None:
        if kwargs.get("bad_files", "raise") != "raise":
            raise ValueError(f"ShardsDataModule: bad_files={kwargs['bad_files']!r} is not supported; shards are checked "
                             "when packed, so a bad sample raises (bad_files='raise').")
        super().__init__(root, *args, **kwargs)
        self.seed, self.shuffle_window = seed, check_window(shuffle_window, "ShardsDataModule")
        self.train_set: ShardsDataset | None = None  # type: ignore[assignment]
        self.val_set: ShardsDataset | None = None  # type: ignore[assignment]
        self._world = (1, 0)

    @property
    def classes(self) -> list[str]:
        """Class names of the pack, in label order."""
        if self._classes is None:
            self._classes = list(read_manifest(self.root)["classes"])
        return self._classes

    @override
    def setup(self, stage: str) -> None:
        trainer = self.trainer
        self._device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        self._pin = self._device.type == "cuda" if self.pin_memory is None else bool(self.pin_memory)
        self._world = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        collate = NHWCCollate(pin_memory=self._pin and self.num_workers == 0)  # workers: the loader pins
        if stage == "fit" and self.train_set is None:
            self.train_set = ShardsDataset(self.root, "train", self.train_transform, collate)
        if self.val_set is None:
            self.val_set = ShardsDataset(self.root, "val", self.eval_transform, collate)

    @override
    def _loader(self, dataset: ShardsDataset | None, train: bool) -> PrefetchDataLoader:  # type: ignore[override]
        # Nothing is dropped, also in training: the sampler keeps ranks in step exactly once (see ShardBatchSampler).
        if dataset is None:
            raise RuntimeError("ShardsDataModule: call setup() (the Trainer does) before asking for a dataloader.")
        workers = self.num_workers
        prefetch = self._device if (self.cuda_prefetch and self._device is not None and self._device.type == "cuda") else None
        sampler = ShardBatchSampler(dataset, self.batch_size, *self._world, shuffle=train, seed=self.seed,
                                    shuffle_window=self.shuffle_window)
        # batch_size=None: the sampler yields whole batches and the dataset collates them in the worker.
        return PrefetchDataLoader(dataset, batch_size=None, sampler=sampler, num_workers=workers,
                                  pin_memory=self._pin and workers > 0, persistent_workers=self.persistent_workers and workers > 0,
                                  prefetch_device=prefetch)
