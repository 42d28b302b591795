"""``ImageDataModule``: what the image DataModules share on top of ``BatchDataModule``.

The training and evaluation transforms (crop size, resize, interpolation, EXIF orientation, the
JPEG decoder and the training ``Augmentation``), built in the constructor so that a bad setting
fails there and not in a worker; the samples of a batch decoded on ``decode_threads`` threads of
each loading process; ``NHWCCollate`` batches, normalised while collated when the trainer runs
on the CPU (uint8 to a GPU: 4x fewer bytes to copy); and the device-side augmentation of
training batches (random erasing, mixup/cutmix) after the normalisation.
``ImageFolderDataModule`` reads an ImageNet-layout folder, ``ShardsDataModule`` a pack of
shards.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from cltrain.data.augment import MixupCutmix
from cltrain.data.augmentation import AUGMENTATION_FIELDS, Augmentation
from cltrain.data.batches import BatchDataModule
from cltrain.data.collate import NHWCCollate
from cltrain.data.decode_pool import loading_plan
from cltrain.data.decoders import get_decoder
from cltrain.data.normalize import ImageNormalizer
from cltrain.data.transforms import eval_transform, size_pair

__all__ = ["ImageDataModule"]


class ImageDataModule(BatchDataModule):
    """Base of the image DataModules (see the module docstring); not used on its own.

    Args:
        image_size: training crop and evaluation crop (int or (height, width)).
        val_resize_size: shorter side before the evaluation centre crop (``None``: no resize).
        interpolation: the resampling, ``"bilinear"`` or ``"bicubic"`` (training and evaluation).
        exif_transpose: turn photos upright by their EXIF orientation (off, as torchvision).
        decode_threads: threads that decode a batch's images in each loading process (``"auto"``:
            ``cltrain.data.decode_pool.loading_plan``, the fastest measured split of the cores)
            (``cltrain.data.decode_pool``): with ``num_workers=0`` and 2 threads, two cores
            load in one process; 1 decodes them one by one.
        decoder: the JPEG decoder of both transforms (``cltrain.data.decoders``): ``"auto"`` (the
            first back end installed), ``"turbojpeg"``, ``"simplejpeg"``, or ``"pillow"`` (every file
            through Pillow).
        augmentation: the training augmentation (``Augmentation``); ``None``: the one made of
            ``Augmentation``'s fields given as keywords (``hflip=0.0``), defaults for the others.
        **kwargs: ``Augmentation``'s fields, and ``BatchDataModule``'s arguments.

    Raises:
        ValueError: a bad argument, quoted.
    """

    def __init__(self, *args: Any, image_size: int | tuple[int, int], val_resize_size: int | None, interpolation: str,
                 exif_transpose: bool, decode_threads: int | str, decoder: str, augmentation: Augmentation | None,
                 **kwargs: Any) -> None:
        fields = {name: kwargs.pop(name) for name in AUGMENTATION_FIELDS if name in kwargs}
        augmentation = Augmentation.build(augmentation, type(self).__name__, **fields)
        if kwargs.get("num_workers") == "auto":
            kwargs["num_workers"] = loading_plan()[0]
        super().__init__(*args, **kwargs)
        if decode_threads == "auto":
            decode_threads = loading_plan(self.num_workers)[1]
        if not (isinstance(decode_threads, int) and decode_threads >= 1):
            raise ValueError(f"{type(self).__name__}: decode_threads={decode_threads!r} must be an int >= 1 or 'auto'.")
        try:
            get_decoder(decoder)
        except ValueError as err:  # an unknown name, or a back end not installed here
            raise ValueError(f"{type(self).__name__}: {err}") from None
        self.image_size = size_pair(image_size, "image_size")
        self.val_resize_size, self.decode_threads, self.augmentation = val_resize_size, decode_threads, augmentation
        self.decoder = decoder
        self.train_transform = augmentation.train_transform(self.image_size, self.channels, interpolation, exif_transpose,
                                                            decoder)
        self.eval_transform = eval_transform(self.image_size, val_resize_size, channels=self.channels,
                                             interpolation=interpolation, exif_transpose=exif_transpose, decoder=decoder)
        self.random_erasing = augmentation.erasing()
        self._mixup: MixupCutmix | None = None

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

