"""``ImageFolderDataModule``: an ImageNet-layout folder as NHWC batches for Lightning.

``root/train/<class>/<image>`` and ``root/val/<class>/<image>``; test and predict
use ``val``. Workers decode and crop with ``train_transform`` /
``eval_transform`` and collate with ``NHWCCollate``, so uint8 NHWC
buffers cross the process boundary and the host-to-device copy; the batch is
normalised on the device in ``on_after_batch_transfer``, so every step
(training, validation, test, predict) receives ``(images, targets)`` with
images normalised float, channels_last (or contiguous NCHW with
``channels_last=False``). Under DDP Lightning swaps in its DistributedSampler.

Example::

    >>> import lightning as L
    >>> from cltrain.data import ImageFolderDataModule, make_demo_dataset
    >>> dm = ImageFolderDataModule(make_demo_dataset("/tmp/cltrain-demo"), batch_size=32, num_workers=2)
    >>> dm.num_classes, dm.input_shape
    (10, (32, 3, 224, 224))
    >>> # L.Trainer(max_epochs=1).fit(model, datamodule=dm)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from cltrain.data.augment import MixupCutmix, RandomErasing
from cltrain.data.collate import NHWCCollate
from cltrain.data.constants import CHECK_MODES, IMAGENET_MEAN, IMAGENET_STD
from cltrain.data.dataset import BadImageError, ImageFolderDataset, check_bad_files, read_file_list
from cltrain.data.folders import SKIPPED_FILES_NAME, ClassFolderDataModule
from cltrain.data.normalize import NORMALIZE_DTYPES, ImageNormalizer, check_statistics, normalize
from cltrain.data.prefetch import PrefetchDataLoader
from cltrain.data.transforms import size_pair, eval_transform, train_transform

__all__ = ["SKIPPED_FILES_NAME", "ImageFolderDataModule"]

#: Name of the file (in the run directory) the skipped bad files are listed in.
class ImageFolderDataModule(ClassFolderDataModule):
    """Train/val image folders in the ImageNet layout, as normalised channels_last batches.

    Args:
        root: folder holding ``train/`` and ``val/``, each ``<class>/<image>``.
        batch_size: images per batch. The training loader drops the last partial batch
            (as timm and torchvision's references do: no batch of 1 reaches BatchNorm, and
            shapes stay fixed for ``cudnn.benchmark`` and ``torch.compile``); validation,
            test and predict keep every image.
        num_workers: DataLoader worker processes (0: load in the main process).
        decode_threads: threads that decode a batch's images in each loading process
            (``cltrain.data.decode_pool``): with ``num_workers=0`` and 2 threads, two cores
            load in one process; 1 decodes them one by one.
        persistent_workers: keep workers between epochs (when ``num_workers > 0``).
        pin_memory: ``None`` pins only when the trainer runs on a GPU.
        image_size: training crop and evaluation crop (int or (height, width)).
        val_resize_size: shorter side before the evaluation centre crop.
        channels: 3 (RGB) or 1 (grayscale).
        bad_files: ``"raise"``: an unreadable file stops with an error naming it;
            ``"skip"``: it is replaced by the next readable sample, the count is
            logged each epoch (``data/skipped_train``, ``data/skipped_val``) and the
            paths are appended to ``<run dir>/skipped_files.tsv`` (the trainer's
            ``default_root_dir``).
        allow_missing_val_classes: accept training classes with no folder in ``val/``
            (by default that is an error naming them).
        exclude_files: a list of files to leave out from the start: the output of
            ``python -m cltrain.data.check ROOT``, or a ``skipped_files.tsv``.
        check_val: check the validation files in ``setup`` before training starts:
            ``"quick"`` (headers and JPEG end markers),
            ``"full"`` (decode every file) or ``"off"`` (see ``cltrain.data.check``).
            Bad files stop the run (``bad_files="raise"``) or are left out and listed
            (``"skip"``).
        index_cache: reuse the file index of an unchanged tree between runs and
            ranks (``cltrain.data.index``), kept in the user cache folder
            (``cltrain.data.index.default_cache_dir``), never in ``root``; a path
            keeps it there instead; ``False`` walks the tree every run.
        mean: per-channel normalisation mean (0-1 units).
        std: per-channel normalisation standard deviation (0-1 units).
        dtype: dtype of the normalised images (float32, bfloat16 or float16).
        channels_last: ``False`` gives contiguous NCHW batches (the baseline).
        cuda_prefetch: on a CUDA device, copy the next batch on a side stream
            (``PrefetchDataLoader``); off: Lightning copies each batch when its step starts.
        scale: the training crop's RandomResizedCrop range of area.
        ratio: the training crop's range of aspect ratio.
        hflip: the training flip probability.
        interpolation: the resampling, ``"bilinear"`` or ``"bicubic"``.
        exif_transpose: turn photos upright by their EXIF orientation (off, as torchvision).
        augment: ``"none"``, ``"trivialaugment"`` or ``"randaugment"`` on each training crop,
            in the workers (``HWCAugment``).
        random_erasing: probability of timm's per-image random erasing of the normalised
            training batch on the device (0: off).
        mixup_alpha: timm's mixup on the training batch on the device (0: off); targets become
            probabilities ``(N, classes)``, which the module's loss takes as they are and its
            accuracy reads by ``argmax`` (the dominant label). Needs an even batch.
        cutmix_alpha: timm's cutmix, as ``mixup_alpha`` (both 0: off).
        mixup_prob: the chance that a batch is mixed at all.
        mixup_switch_prob: with both on, the chance of cutmix rather than mixup.

    Raises:
        ValueError: a bad argument (at construction); a split without class
            folders, an empty class folder, or classes that differ (in ``setup``);
            ``mean``/``std`` in 0-255 units.
        BadImageError: a bad validation file found by ``check_val`` (``bad_files="raise"``).
        FileNotFoundError: a missing root or split (in ``setup``, or on reading
            ``classes``).
    """

    layout_hint = ("a folder with train/ and val/ (ImageNet layout), or make one with "
                   "cltrain.data.make_demo_dataset(root)")
    collate_class = NHWCCollate


    def __init__(self, root: str | os.PathLike, batch_size: int = 64, num_workers: int = 4, persistent_workers: bool = True,
                 pin_memory: bool | None = None, image_size: int | tuple[int, int] = 224, val_resize_size: int | None = 256,
                 channels: int = 3, bad_files: str = "raise", mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD, dtype: torch.dtype = torch.float32, channels_last: bool = True,
                 cuda_prefetch: bool = False, allow_missing_val_classes: bool = False,
                 exclude_files: str | os.PathLike | None = None, check_val: str = "quick", index_cache: bool | str | os.PathLike = True,
                 scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = (3 / 4, 4 / 3), hflip: float = 0.5,
                 interpolation: str = "bilinear", exif_transpose: bool = False, augment: str = "none",
                 random_erasing: float = 0.0, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
                 mixup_prob: float = 1.0, mixup_switch_prob: float = 0.5, decode_threads: int = 1) -> None:
        super().__init__()
        if not (isinstance(decode_threads, int) and decode_threads >= 1):
            raise ValueError(f"ImageFolderDataModule: decode_threads={decode_threads!r} must be an int >= 1.")
        self.decode_threads = decode_threads
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"ImageFolderDataModule: batch_size={batch_size!r} must be an int >= 1.")
        if not (isinstance(num_workers, int) and num_workers >= 0):
            raise ValueError(f"ImageFolderDataModule: num_workers={num_workers!r} must be an int >= 0.")
        check_bad_files(bad_files, "ImageFolderDataModule")
        if dtype not in NORMALIZE_DTYPES:
            raise ValueError(f"ImageFolderDataModule: dtype={dtype!r} must be one of {NORMALIZE_DTYPES}.")
        if len(mean) not in (1, channels) or len(std) not in (1, channels):
            raise ValueError(f"ImageFolderDataModule: mean={tuple(mean)} and std={tuple(std)} need 1 or {channels} values each.")
        check_statistics(mean, std, "ImageFolderDataModule")
        if check_val not in CHECK_MODES:
            raise ValueError(f"ImageFolderDataModule: check_val={check_val!r} must be one of {CHECK_MODES}.")
        self.root = Path(root)
        self.batch_size, self.num_workers = batch_size, num_workers
        self.persistent_workers, self.pin_memory = persistent_workers, pin_memory
        self.image_size = size_pair(image_size, "image_size")
        self.val_resize_size, self.channels = val_resize_size, channels
        self.bad_files, self.mean, self.std, self.dtype = bad_files, tuple(mean), tuple(std), dtype
        self.channels_last, self.cuda_prefetch = channels_last, cuda_prefetch
        self.allow_missing_val_classes, self.check_val, self.index_cache = allow_missing_val_classes, check_val, index_cache
        self.exclude_files = None if exclude_files is None else Path(exclude_files)
        # Build the transforms now so that bad sizes/channels fail here, not in a worker.
        self.train_transform = train_transform(self.image_size, tuple(scale), tuple(ratio), hflip, channels=channels,
                                               interpolation=interpolation, exif_transpose=exif_transpose,
                                               augment=augment)
        self.eval_transform = eval_transform(self.image_size, val_resize_size, channels=channels,
                                             interpolation=interpolation, exif_transpose=exif_transpose)
        self.random_erasing = RandomErasing(random_erasing) if random_erasing > 0 else None
        self.mixup_args = (dict(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, prob=mixup_prob,
                                switch_prob=mixup_switch_prob) if mixup_alpha > 0 or cutmix_alpha > 0 else None)
        if self.mixup_args is not None:
            MixupCutmix(2, **self.mixup_args)  # checks the arguments here, not at the first batch
        self._mixup: MixupCutmix | None = None
        self.train_set: ImageFolderDataset | None = None
        self.val_set: ImageFolderDataset | None = None
        self._classes: list[str] | None = None
        self._pin = False
        self._device: torch.device | None = None
        self._skip_log: Path | None = None

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        """``(batch_size, channels, height, width)`` of a training batch."""
        return (self.batch_size, self.channels, *self.image_size)

    @override
    def setup(self, stage: str) -> None:
        self._choose_device()
        self._open_skip_log()
        # Everything is checked here, before the first step: root, splits, classes, images.
        exclude = read_file_list(self.exclude_files) if self.exclude_files is not None else frozenset()
        if stage == "fit" and self.train_set is None:
            self.train_set = ImageFolderDataset(self._split_dir("train"), self.train_transform, None, self.bad_files,
                                                self._skip_log, exclude=exclude, index_cache=self.index_cache,
                                                threads=self.decode_threads)
            self._classes = self.train_set.classes
        if self.val_set is None:
            self.val_set = ImageFolderDataset(self._split_dir("val"), self.eval_transform, self.classes, self.bad_files,
                                              self._skip_log, self.allow_missing_val_classes, exclude, self.index_cache,
                                              threads=self.decode_threads)
            if stage == "fit":
                self._check_val_files(self.val_set)

    def _check_val_files(self, dataset: ImageFolderDataset) -> None:
        """Find bad validation files now, not after a training epoch (every rank checks, so all stop together)."""
        from cltrain.data.check import check_files  # here: `python -m cltrain.data.check` must not find it imported

        paths = [p for p, _ in dataset.samples]
        bad = check_files(paths, self.check_val, workers=self.num_workers if len(paths) >= 2000 else 0)
        if not bad:
            return
        listed = "; ".join(f"{p} ({r})" for p, r in sorted(bad.items())[:3]) + (" ..." if len(bad) > 3 else "")
        if self.bad_files == "raise":
            raise BadImageError(f"{dataset.split_dir}: {len(bad)} unreadable file(s) found before training: {listed}. "
                                f"List them all with 'python -m cltrain.data.check {self.root}' and pass exclude_files=<that list>, "
                                "or pass bad_files='skip'.")
        dataset.samples = [s for s in dataset.samples if s[0] not in bad]
        if not dataset.samples:
            raise BadImageError(f"{dataset.split_dir}: every file is unreadable: {listed}.")
        for path, reason in bad.items():
            dataset.skip(path, reason)
        rank_zero_warn(f"ImageFolderDataModule: left out {len(bad)} unreadable validation file(s) before training: {listed}.")

    @override
    def train_dataloader(self) -> PrefetchDataLoader:
        if self.train_set is not None and len(self.train_set) < self.batch_size:
            raise ValueError(f"ImageFolderDataModule: {self.train_set.split_dir} has {len(self.train_set)} images, fewer than "
                             f"batch_size={self.batch_size}; the training loader drops partial batches, so it would be empty.")
        return self._loader(self.train_set, train=True)

    def _collate(self, pin_memory: bool) -> NHWCCollate:
        # On the CPU the loader normalises each image into the batch as it is collated (in the
        # worker or on the decode threads, in cache); for a GPU it hands over uint8 (4x fewer bytes).
        on_cpu = self._device is not None and self._device.type == "cpu" and self.channels_last
        normalizer = ImageNormalizer(self.mean, self.std, self.dtype) if on_cpu else None
        return NHWCCollate(pin_memory=pin_memory, normalize=normalizer, threads=self.decode_threads)

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Normalise the uint8 images of ``(images, targets)`` on their device (the loader did it on a CPU);
        then the device-side augmentations of training batches."""
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].dim() == 4:
            images = batch[0]
            if images.dtype == torch.uint8:
                fmt = torch.channels_last if self.channels_last else torch.contiguous_format
                images = normalize(images, self.mean, self.std, self.dtype, memory_format=fmt)
            trainer = self.trainer
            if trainer is not None and trainer.training:  # device-side augmentation, training batches only
                if self.random_erasing is not None:
                    images = self.random_erasing(images)
                if self.mixup_args is not None:
                    self._mixup = self._mixup or MixupCutmix(self.num_classes, **self.mixup_args)
                    images, targets = self._mixup(images, batch[1])
                    batch = type(batch)((images, targets, *batch[2:])) if isinstance(batch, tuple) else [images, targets, *batch[2:]]
            return type(batch)((images, *batch[1:])) if isinstance(batch, tuple) else [images, *batch[1:]]
        return batch
