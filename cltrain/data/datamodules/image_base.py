"""``ImageDataModule``: what the image DataModules share on top of ``BatchDataModule``.

The training and evaluation transforms (crop size, resize, interpolation, EXIF orientation, the
JPEG decoder and the training ``Augmentation``), built in the constructor so that a bad setting
fails there and not in a worker; the samples of a batch decoded on ``decode_threads`` threads of
each loading process; ``NHWCCollate`` batches, normalised while collated when the trainer runs
on the CPU (uint8 to a GPU: 4x fewer bytes to copy); and the device-side augmentation of
training batches (random erasing, mixup/cutmix) after the normalisation.
``ImageFolderDataModule`` reads an ImageNet-layout folder, ``ShardsDataModule`` a pack of
shards; both take this constructor's arguments, written here once, and add their own.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from cltrain.data.augment_group import Augmentation
from cltrain.data.augment_ops import MixupCutmix
from cltrain.data.collate import NHWCCollate
from cltrain.data.constants import IMAGENET_MEAN, IMAGENET_STD
from cltrain.data.datamodules.base import BatchDataModule
from cltrain.data.loader_threads import loading_plan
from cltrain.data.decoders import get_decoder
from cltrain.data.normalize import ImageNormalizer
from cltrain.data.transforms import eval_transform, size_pair

__all__ = ["ImageDataModule"]


class ImageDataModule(BatchDataModule):
    """Base of the image DataModules (see the module docstring); not used on its own. Its arguments
    are theirs: ``ImageFolderDataModule`` and ``ShardsDataModule`` add their own after them
    (``takes_arguments_of``).

    Args:
        root: where the images are (the subclass says how they are laid out).
        batch_size: images per batch.
        num_workers: DataLoader worker processes (0: load in the main process; ``"auto"``, with
            ``decode_threads="auto"``: ``cltrain.data.loader_threads.loading_plan``, one process with a
            decode thread per core up to 4 cores).
        persistent_workers: keep workers between epochs (when ``num_workers > 0``).
        pin_memory: ``None`` pins only when the trainer runs on a GPU.
        image_size: training crop and evaluation crop (int or (height, width)).
        val_resize_size: shorter side before the evaluation centre crop (``None``: no resize).
        channels: 3 (RGB) or 1 (grayscale).
        mean: per-channel normalisation mean (0-1 units).
        std: per-channel normalisation standard deviation (0-1 units).
        dtype: dtype of the normalised images (float32, bfloat16 or float16).
        channels_last: ``False`` gives contiguous NCHW batches (the baseline).
        cuda_prefetch: on a CUDA device, copy the next batch on a side stream
            (``PrefetchDataLoader``); off: Lightning copies each batch when its step starts.
        interpolation: the resampling, ``"bilinear"`` or ``"bicubic"`` (training and evaluation).
        exif_transpose: turn photos upright by their EXIF orientation (off, as torchvision).
        decode_threads: threads that decode a batch's images in each loading process
            (``cltrain.data.loader_threads``): with ``num_workers=0`` and 2 threads, two cores
            load in one process; 1 decodes them one by one; ``"auto"``: as ``num_workers``.
        decoder: the JPEG decoder of both transforms (``cltrain.data.decoders``): ``"auto"`` (the
            first back end installed), ``"turbojpeg"``, ``"simplejpeg"``, or ``"pillow"`` (every file
            through Pillow).
        val_reduce: decode evaluation JPEGs at least twice the resize target at 1/2, 1/4 or 1/8
            scale (libjpeg's DCT scaling, as training crops are): faster on large photos, but not
            torchvision's pixels. Off: evaluation equals torchvision's decode + ``Resize`` +
            ``CenterCrop`` within one level (``ResizeCenterCrop``).
        augmentation: the training augmentation as one group (``Augmentation``), or ``None``
            and its fields as the keywords below (not both).
        scale: with ``ratio``, ``hflip``, ``augment``, ``random_erasing``, ``mixup_alpha``,
            ``cutmix_alpha``, ``mixup_prob`` and ``mixup_switch_prob``: the fields of
            ``Augmentation`` (see it), when ``augmentation`` is ``None``.

    Raises:
        ValueError: a bad argument, quoted (also ``mean``/``std`` in 0-255 units).
        TypeError: an argument it does not take (Python's one-line error names it).
    """

    def __init__(self, root: str | os.PathLike, batch_size: int = 64, num_workers: int | str = "auto",
                 persistent_workers: bool = True, pin_memory: bool | None = None,
                 image_size: int | tuple[int, int] = 224, val_resize_size: int | None = 256, channels: int = 3, *,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32, channels_last: bool = True, cuda_prefetch: bool = False,
                 interpolation: str = "bilinear", exif_transpose: bool = False, decode_threads: int | str = "auto",
                 decoder: str = "auto", val_reduce: bool = False, augmentation: Augmentation | None = None,
                 scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = (3 / 4, 4 / 3), hflip: float = 0.5,
                 augment: str = "none", random_erasing: float = 0.0, mixup_alpha: float = 0.0,
                 cutmix_alpha: float = 0.0, mixup_prob: float = 1.0, mixup_switch_prob: float = 0.5) -> None:
        augmentation = Augmentation.build(augmentation, type(self).__name__, scale=scale, ratio=ratio, hflip=hflip,
                                          augment=augment, random_erasing=random_erasing, mixup_alpha=mixup_alpha,
                                          cutmix_alpha=cutmix_alpha, mixup_prob=mixup_prob,
                                          mixup_switch_prob=mixup_switch_prob)
        if num_workers == "auto":
            num_workers = loading_plan()[0]
        super().__init__(root, batch_size=batch_size, num_workers=num_workers, persistent_workers=persistent_workers,
                         pin_memory=pin_memory, channels=channels, mean=mean, std=std, dtype=dtype,
                         channels_last=channels_last, cuda_prefetch=cuda_prefetch)
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
                                             interpolation=interpolation, exif_transpose=exif_transpose, decoder=decoder,
                                             reduce=val_reduce)
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

