"""``ImageFolderDataModule``: an ImageNet-layout folder as NHWC batches for Lightning.

``root/train/<class>/<image>`` and ``root/val/<class>/<image>``; test and predict
use ``val``. Workers decode and crop with ``train_transform`` /
``eval_transform`` and collate with ``NHWCCollate``, so uint8 NHWC
buffers cross the process boundary and the host-to-device copy; the batch is
normalised on the device in ``on_after_batch_transfer``, so every step
(training, validation, test, predict) receives ``(images, targets)`` with
images normalised float, channels_last (or contiguous NCHW with
``channels_last=False``). Under DDP the training order is split over the ranks as Lightning's
DistributedSampler splits it, and evaluation reads every image once (``EveryImageOnce``).

Example::

    >>> import lightning as L
    >>> from cltrain.data import ImageFolderDataModule, make_demo_dataset
    >>> dm = ImageFolderDataModule(make_demo_dataset("/tmp/cltrain-demo"), batch_size=32, num_workers=2)
    >>> dm.num_classes, dm.input_shape
    (10, (32, 3, 224, 224))
    >>> # L.Trainer(max_epochs=1).fit(model, datamodule=dm)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from cltrain.data.bad_samples import printable
from cltrain.data.datamodules.class_folders import ClassFolders
from cltrain.data.datamodules.image_base import ImageDataModule
from cltrain.data.errors import BadImageError, DataError
from cltrain.data.image_folder_dataset import ImageFolderDataset
from cltrain.data.prefetch import PrefetchDataLoader
from cltrain.data.settings import IMAGE_FOLDER

__all__ = ["ImageFolderDataModule"]


#: What starts after ``setup(stage)``, as the check of the validation files says it.
_BEFORE = {"fit": "training", "validate": "validation", "test": "testing", "predict": "prediction"}


class ImageFolderDataModule(ImageDataModule):
    """Train/val image folders in the ImageNet layout, as normalised channels_last batches.

    Made of ``cltrain.data.settings.IMAGE_FOLDER``: the image groups of
    [`ImageDataModule`][cltrain.data.datamodules.image_base.ImageDataModule] (``batch_size``,
    ``num_workers``, the crops, the decoder, the ``Augmentation``, ``bad_files``), then
    ``FolderChecks`` (``allow_missing_val_classes``, ``check_val``, ``index_cache``) and ``ExcludeList``
    (``exclude_files``); each argument is documented in its group. ``root`` holds ``train/`` and
    ``val/``, each ``<class>/<image>``. The training loader drops the last partial batch (as timm and
    torchvision's references do: no batch of 1 reaches BatchNorm, and shapes stay fixed for
    ``cudnn.benchmark`` and ``torch.compile``); validation, test and predict keep every image.
    With ``bad_files="skip"`` an unreadable file is replaced by the next readable sample, counted
    each epoch (``data/skipped_train``, ``data/skipped_val``) and listed in
    ``<run dir>/skipped_files.tsv`` (the trainer's ``default_root_dir``).

    Raises:
        ValueError: a bad argument (at construction); ``mean``/``std`` in 0-255 units.
        DataError: a split without class folders, a class folder without images, or classes
            that differ (in ``setup``); fewer training images than ``batch_size``.
        TypeError: an argument it does not take (a one-line error naming it).
        BadImageError: a bad validation file found by ``check_val`` (``bad_files="raise"``).
        FileNotFoundError: a missing root or split (in ``setup``, or on reading
            ``classes``).
    """

    layout_hint = ("a folder with train/ and val/ (ImageNet layout), or make one with "
                   "cltrain.data.make_demo_dataset(root)")

    settings = IMAGE_FOLDER

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exclude_files = None if self.exclude_files is None else Path(self.exclude_files)
        self.folders = ClassFolders(self.root, type(self).__name__, self.layout_hint)
        self.train_set: ImageFolderDataset | None = None
        self.val_set: ImageFolderDataset | None = None
        self._told_excluded = False

    @override
    def setup(self, stage: str) -> None:
        self._join_trainer()
        # Everything is checked here, before the first step: root, splits, classes, images.
        exclude = self.folders.exclusions(self.exclude_files)
        if stage == "fit" and self.train_set is None:
            self.train_set = ImageFolderDataset(self.folders.split("train"), self.train_transform, None, self.bad_files,
                                                self._skip_log, exclude=exclude, index_cache=self.index_cache,
                                                threads=self.decode_threads)
            self._classes = self.train_set.classes
        if self.val_set is None:
            self.val_set = ImageFolderDataset(self.folders.split("val"), self.eval_transform, self.classes, self.bad_files,
                                              self._skip_log, self.allow_missing_val_classes, exclude, self.index_cache,
                                              threads=self.decode_threads)
            if exclude and not self._told_excluded:
                self._told_excluded = True
                self.folders.tell_excluded(self.exclude_files, exclude.listed,
                                           {"train": self.train_set, "val": self.val_set}, "image")
            stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn
            self._check_val_files(self.val_set, _BEFORE.get(stage, "training"))  # evaluations too

    def _check_val_files(self, dataset: ImageFolderDataset, before: str) -> None:
        """Find bad validation files now, not after a training epoch or amid an evaluation (where a skipped file's
        stand-in would count twice); every rank checks, so all stop together. ``before``: what starts next."""
        from cltrain.data.check import check_files  # here: `python -m cltrain.data.check` must not find it imported

        paths = [p for p, _ in dataset.samples]
        bad = check_files(paths, self.check_val, workers=self.num_workers if len(paths) >= 2000 else 0,
                          decoder=self.decoder)
        if not bad:
            return
        listed = printable("; ".join(f"{p} ({r})" for p, r in sorted(bad.items())[:3]) + (" ..." * (len(bad) > 3)))
        if self.bad_files == "raise":
            raise BadImageError(f"{dataset.split_dir}: {len(bad)} unreadable file(s) found before {before}: {listed}. "
                                f"List them all with 'cltrain-data-check {self.root}' and pass exclude_files=<that list>, "
                                "or pass bad_files='skip'.")
        dataset.samples = [s for s in dataset.samples if s[0] not in bad]
        if not dataset.samples:
            raise BadImageError(f"{dataset.split_dir}: every file is unreadable: {listed}.")
        for path, reason in bad.items():
            dataset.skip(path, reason)
        rank_zero_warn(f"ImageFolderDataModule: left out {len(bad)} unreadable validation file(s) before {before}: {listed}.")

    @override
    def train_dataloader(self) -> PrefetchDataLoader:
        if self.train_set is not None and len(self.train_set) < self.batch_size:
            raise DataError(f"ImageFolderDataModule: {self.train_set.split_dir} has {len(self.train_set)} images, fewer than "
                             f"batch_size={self.batch_size}"
                             " (the app's data.batch_size); the training loader drops partial batches, so it would be "
                             "empty.")
        return self._loader(self.train_set, train=True)
