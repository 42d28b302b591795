"""``ImageSamples``: the base of the map-style image Datasets: each sample's image read from a path or
from the bytes of a file, the samples of a batch decoded on threads, written straight into the batch.

A subclass says where sample ``i`` is (``source``: a path or the bytes of an image file, and its
target) and how an unreadable one is named (``unreadable_message``); ``ImageFolderDataset`` reads a
folder's files, ``cltrain.data.hf_dataset.HFImageDataset`` the rows of a Hugging Face dataset. A
transform that takes paths (``takes_paths``, as cltrain's do) is handed the path or the bytes, so it
decodes JPEGs with libjpeg-turbo; any other transform gets the image opened lazily with Pillow. A
sample that cannot be read raises ``BadImageError`` or is skipped (``cltrain.data.bad_samples``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from cltrain.data.bad_samples import SkipsBadSamples, unreadable
from cltrain.data.errors import BadImageError, EmptyImageError, LabelFault, StorageError
from cltrain.data.loader_threads import start_batch
from cltrain.data.resume_state import SeededIndex

if TYPE_CHECKING:
    from cltrain.data.collate import NHWCCollate

__all__ = ["ImageSamples"]


class ImageSamples(SkipsBadSamples, Dataset):
    """Base of the map-style image Datasets (see the module docstring): ``dataset[i]`` is
    ``(transform(image), target)``; the DataLoader asks for whole batches (``__getitems__``), decoded
    on ``threads`` threads of the loading process (``cltrain.data.loader_threads``). Each sample draws
    its crop from a seed of its own, drawn from the torch RNG, so a seeded run gives the same samples
    whatever the number of threads. A subclass sets ``transform``, ``threads`` and the bad-file
    policy (``_set_policy``), and defines ``__len__``, ``source`` and ``unreadable_message``."""

    transform: Callable[..., Any]
    threads: int = 1

    def source(self, index: int) -> tuple[str | bytes, Any]:  # pragma: no cover - the subclass's
        """Where the image of sample ``index`` is (a path, or the bytes of an image file), and its target."""
        raise NotImplementedError

    def unreadable_message(self, index: int, reason: str) -> str:  # pragma: no cover - the subclass's
        """The one line of ``BadImageError`` for sample ``index``: what it is, why, what to do."""
        raise NotImplementedError

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[np.ndarray, int]]:
        """The samples of a batch, decoded on ``threads`` threads (see ``cltrain.data.loader_threads``)."""
        return self.start_items(indices)()

    def start_items(self, indices: Sequence[int], collate: NHWCCollate | None = None) -> Callable[[], list[tuple]]:
        """``__getitems__`` begun: with ``threads > 1`` the batch is decoding on the pool's threads when
        this returns, and calling the result waits for it. With ``collate``, each image is written
        straight into its slot of one batch buffer (normalised there if ``collate`` normalises) and the
        samples hold ``BatchSlot``s, which ``collate`` hands on without copying."""
        augment = getattr(self.transform, "augment", None)
        size = getattr(self.transform, "size", None)
        # A subclass's own __getitem__ (extra fields) or load (no out=) is what its samples are made by.
        own_getitem = type(self).__getitem__ is not SkipsBadSamples.__getitem__
        own_load = type(self).load is not ImageSamples.load
        if own_getitem:
            return start_batch(self.__getitem__, indices, self.threads, augment)
        if (collate is None or own_load or augment is not None or size is None
                or not getattr(self.transform, "takes_paths", False)):
            return self.start_batch(self.load, indices, augment, refetch=self.__getitem__)
        buffer = collate.new_batch(len(indices), (*size, self.transform.channels))

        def write(k: int, fetch: Callable[..., tuple]) -> tuple:
            sample = None

            def make(dest: torch.Tensor) -> Any:
                nonlocal sample
                sample = fetch(indices[k], out=dest)
                return sample[0]

            slot = collate.write(buffer, k, make)
            return (slot, *sample[1:])

        # slot k of the batch draws from sample k's seed where the sampler gave one (ResumableSampler)
        slots = [SeededIndex(k, i.seed) if isinstance(i, SeededIndex) else k for k, i in enumerate(indices)]
        return self.start_batch(lambda k: write(k, self.load), slots, refetch=lambda k: write(k, self.fetch))

    def load(self, index: int, out: torch.Tensor | None = None) -> tuple[Any, Any]:
        """The sample at ``index`` (its image written into ``out`` when given, see the transforms);
        raises ``BadImageError`` for an unreadable one."""
        src: str | bytes | None = None
        try:
            src, target = self.source(index)
            target = self.class_index(target)
            if out is not None:
                return self.transform(src, out=out), target
            if getattr(self.transform, "takes_paths", False):
                return self.transform(src), target
            if isinstance(src, bytes) and not src:
                raise EmptyImageError()
            with Image.open(io.BytesIO(src) if isinstance(src, bytes) else src) as img:
                return self.transform(img), target
        except StorageError:  # the bucket or the cache failed, not this sample: never skipped
            raise
        except Exception as err:  # any failure of reading, decoding or converting this one sample
            reason = unreadable(err, src if isinstance(src, (str, os.PathLike)) else None)
            if isinstance(err, LabelFault):
                raise BadImageError(self.label_message(self.sample_name(index), reason), reason) from err
            raise BadImageError(self.unreadable_message(index, reason), reason) from err
