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

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from cltrain.data.augmentation import Augmentation
from cltrain.data.constants import CHECK_MODES, IMAGENET_MEAN, IMAGENET_STD
from cltrain.data.dataset import BadImageError, ImageFolderDataset, read_file_list
from cltrain.data.folders import SKIPPED_FILES_NAME, ClassFolderDataModule
from cltrain.data.images import ImageDataModule
from cltrain.data.prefetch import PrefetchDataLoader

__all__ = ["SKIPPED_FILES_NAME", "ImageFolderDataModule"]


class ImageFolderDataModule(ClassFolderDataModule, ImageDataModule):
    """Train/val image folders in the ImageNet layout, as normalised channels_last batches.

    Args:
        root: folder holding ``train/`` and ``val/``, each ``<class>/<image>``.
        batch_size: images per batch. The training loader drops the last partial batch
            (as timm and torchvision's references do: no batch of 1 reaches BatchNorm, and
            shapes stay fixed for ``cudnn.benchmark`` and ``torch.compile``); validation,
            test and predict keep every image.
        num_workers: DataLoader worker processes (0: load in the main process; ``"auto"``, with
            ``decode_threads="auto"``: ``cltrain.data.decode_pool.loading_plan``, one process with a
            decode thread per core up to 4 cores).
        persistent_workers: keep workers between epochs (when ``num_workers > 0``).
        pin_memory: ``None`` pins only when the trainer runs on a GPU.
        image_size: training crop and evaluation crop (int or (height, width)).
        val_resize_size: shorter side before the evaluation centre crop.
        channels: 3 (RGB) or 1 (grayscale).
        mean: per-channel normalisation mean (0-1 units).
        std: per-channel normalisation standard deviation (0-1 units).
        dtype: dtype of the normalised images (float32, bfloat16 or float16).
        channels_last: ``False`` gives contiguous NCHW batches (the baseline).
        cuda_prefetch: on a CUDA device, copy the next batch on a side stream
            (``PrefetchDataLoader``); off: Lightning copies each batch when its step starts.
        interpolation: the resampling, ``"bilinear"`` or ``"bicubic"``.
        exif_transpose: turn photos upright by their EXIF orientation (off, as torchvision).
        decode_threads: threads that decode a batch's images in each loading process
            (``cltrain.data.decode_pool``): with ``num_workers=0`` and 2 threads, two cores
            load in one process; 1 decodes them one by one; ``"auto"``: as ``num_workers``.
        decoder: the JPEG decoder of the transforms and of ``check_val="full"``
            (``cltrain.data.decoders``): ``"auto"``, ``"turbojpeg"``, ``"simplejpeg"`` or ``"pillow"``.
        augmentation: the training augmentation as one group (``Augmentation``), or ``None``
            and its fields as the keywords below (not both).
        scale: with ``ratio``, ``hflip``, ``augment``, ``random_erasing``, ``mixup_alpha``,
            ``cutmix_alpha``, ``mixup_prob`` and ``mixup_switch_prob``: the fields of
            ``Augmentation`` (see it), when ``augmentation`` is ``None``.
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
            ``"full"`` (decode every file, with ``decoder``) or ``"off"`` (see ``cltrain.data.check``).
            Bad files stop the run (``bad_files="raise"``) or are left out and listed
            (``"skip"``).
        index_cache: reuse the file index of an unchanged tree between runs and
            ranks (``cltrain.data.index``), kept in the user cache folder
            (``cltrain.data.index.default_cache_dir``), never in ``root``; a path
            keeps it there instead; ``False`` walks the tree every run.

    Raises:
        ValueError: a bad argument (at construction); a split without class
            folders, an empty class folder, or classes that differ (in ``setup``);
            ``mean``/``std`` in 0-255 units.
        TypeError: an argument it does not take (Python's one-line error names it).
        BadImageError: a bad validation file found by ``check_val`` (``bad_files="raise"``).
        FileNotFoundError: a missing root or split (in ``setup``, or on reading
            ``classes``).
    """

    layout_hint = ("a folder with train/ and val/ (ImageNet layout), or make one with "
                   "cltrain.data.make_demo_dataset(root)")

    def __init__(self, root: str | os.PathLike, batch_size: int = 64, num_workers: int | str = "auto", persistent_workers: bool = True,
                 pin_memory: bool | None = None, image_size: int | tuple[int, int] = 224, val_resize_size: int | None = 256,
                 channels: int = 3, *, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32, channels_last: bool = True, cuda_prefetch: bool = False,
                 interpolation: str = "bilinear", exif_transpose: bool = False, decode_threads: int | str = "auto",
                 decoder: str = "auto", augmentation: Augmentation | None = None, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), hflip: float = 0.5, augment: str = "none",
                 random_erasing: float = 0.0, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
                 mixup_prob: float = 1.0, mixup_switch_prob: float = 0.5, bad_files: str = "raise",
                 allow_missing_val_classes: bool = False, exclude_files: str | os.PathLike | None = None,
                 check_val: str = "quick", index_cache: bool | str | os.PathLike = True) -> None:
        if check_val not in CHECK_MODES:
            raise ValueError(f"ImageFolderDataModule: check_val={check_val!r} must be one of {CHECK_MODES}.")
        super().__init__(root, batch_size=batch_size, num_workers=num_workers, persistent_workers=persistent_workers,
                         pin_memory=pin_memory, image_size=image_size, val_resize_size=val_resize_size, channels=channels,
                         mean=mean, std=std, dtype=dtype, channels_last=channels_last, cuda_prefetch=cuda_prefetch,
                         interpolation=interpolation, exif_transpose=exif_transpose, decode_threads=decode_threads,
                         decoder=decoder, augmentation=augmentation, scale=scale, ratio=ratio, hflip=hflip, augment=augment,
                         random_erasing=random_erasing, mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha,
                         mixup_prob=mixup_prob, mixup_switch_prob=mixup_switch_prob, bad_files=bad_files)
        self.allow_missing_val_classes, self.check_val, self.index_cache = allow_missing_val_classes, check_val, index_cache
        self.exclude_files = None if exclude_files is None else Path(exclude_files)
        self.train_set: ImageFolderDataset | None = None
        self.val_set: ImageFolderDataset | None = None

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
        bad = check_files(paths, self.check_val, workers=self.num_workers if len(paths) >= 2000 else 0,
                          decoder=self.decoder)
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
