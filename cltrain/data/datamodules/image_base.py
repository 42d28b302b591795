"""``ImageDataModule``: what the image DataModules share on top of ``BatchDataModule``.

The training and evaluation transforms (crop size, resize, interpolation, EXIF orientation, the
JPEG decoder and the training ``Augmentation``), built in the constructor so that a bad setting
fails there and not in a worker; the samples of a batch decoded on ``decode_threads`` threads of
each loading process; ``NHWCCollate`` batches, normalised while collated when the trainer runs
on the CPU (uint8 to a GPU: 4x fewer bytes to copy); and the device-side augmentation of
training batches (random erasing, mixup/cutmix) after the normalisation.
``ImageFolderDataModule`` reads an ImageNet-layout folder, ``ShardsDataModule`` a pack of
shards, and so on: each is made of these settings groups and its source's own.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from cltrain.data.augment_group import Augmentation
from cltrain.data.augment_ops import MixupCutmix
from cltrain.data.collate import NHWCCollate
from cltrain.data.datamodules.base import BatchDataModule
from cltrain.data.loader_threads import loading_plan
from cltrain.data.normalize import ImageNormalizer
from cltrain.data.settings import IMAGES
from cltrain.data.transforms import eval_transform, size_pair

__all__ = ["ImageDataModule"]


class ImageDataModule(BatchDataModule):
    """Base of the image DataModules (see the module docstring); not used on its own.

    Made of ``cltrain.data.settings.IMAGES``: ``Loading``, ``Crop``, ``Pixels``, ``Decoding``,
    ``Augmentation`` and ``BadFilePolicy``, whose fields are its keyword arguments (each documented
    there); ``ImageFolderDataModule``, ``ShardsDataModule`` and the others add their source's own
    group. ``num_workers="auto"`` with ``decode_threads="auto"`` follow
    ``cltrain.data.loader_threads.loading_plan``: one process with a decode thread per core up to 4
    cores. ``augmentation=Augmentation(...)`` gives the augmentation as one group instead of its
    fields (not both).

    Raises:
        ValueError: a bad argument, quoted (also ``mean``/``std`` in 0-255 units).
        TypeError: an argument it does not take (one line naming it).
    """

    settings = IMAGES
    augmentation: Augmentation

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.decode_threads == "auto":
            self.decode_threads = loading_plan(self.num_workers)[1]
        self.image_size = size_pair(self.image_size, "image_size")
        decoding = self.decoding
        self.train_transform = self.augmentation.train_transform(self.image_size, self.channels, decoding.interpolation,
                                                                 decoding.exif_transpose, decoding.decoder)
        self.eval_transform = eval_transform(self.image_size, self.val_resize_size, channels=self.channels,
                                             interpolation=decoding.interpolation,
                                             exif_transpose=decoding.exif_transpose, decoder=decoding.decoder,
                                             reduce=decoding.val_reduce)
        self.random_erasing = self.augmentation.erasing()
        self._mixup: MixupCutmix | None = None

    def _auto_workers(self) -> int:
        return loading_plan()[0]

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        """``(batch_size, channels, height, width)`` of a training batch."""
        return (self.batch_size, self.channels, *self.image_size)

    @override
    def _collate(self, pin_memory: bool) -> NHWCCollate:
        # On the CPU the loader normalises each image into the batch as it is collated (in the
        # worker or on the decode threads, in cache); for a GPU it hands over uint8 (4x fewer bytes).
        on_cpu = self._device is not None and self._device.type == "cpu" and self.channels_last
        normalizer = ImageNormalizer(self.mean, self.std, self.dtype) if on_cpu else None
        return NHWCCollate(pin_memory=pin_memory, normalize=normalizer, threads=self.decode_threads)

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Normalise the images of ``(images, targets)`` on their device (the loader did it on a CPU);
        then the device-side augmentation of training batches."""
        batch = super().on_after_batch_transfer(batch, dataloader_idx)
        trainer = self.trainer
        if trainer is None or not trainer.training or not isinstance(batch, (tuple, list)) or len(batch) < 2:
            return batch
        images, targets = batch[0], batch[1]
        if not (isinstance(images, torch.Tensor) and images.dim() == 4):
            return batch
        if self.random_erasing is not None:
            images = self.random_erasing(images)
        self._mixup = self._mixup or self.augmentation.mixup(self.num_classes)
        if self._mixup is not None:
            images, targets = self._mixup(images, targets)
        return self._replace_head(batch, images, targets)

