"""What the folder DataModules share: class folders, the device, and loaders with the opt-in CUDA prefetch.

``ImageFolderDataModule`` (images) and
``ClipFolderDataModule`` (clips) differ in what a sample is and how a
batch is collated and normalised; the rest is here, once: the class folders of ``root/train``
(label order), the device and memory pinning chosen at ``setup``, and one loader builder
whose batches are copied to a CUDA device on a side stream when ``cuda_prefetch=True``
(``PrefetchDataLoader``; off by default until a GPU run
measures it), shuffled and cut to whole batches for training, every sample kept for
validation, test and predict.

A subclass sets ``layout_hint`` and ``collate_class`` and calls
``_choose_device`` in its ``setup``; with ``bad_files="skip"`` it calls ``_open_skip_log``
too, so the skipped samples are listed in the run directory (``SkippedFilesReport`` counts them per epoch).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset
from typing_extensions import override

from cltrain.data.dataset import find_classes
from cltrain.data.prefetch import PrefetchDataLoader

__all__ = ["SKIPPED_FILES_NAME", "ClassFolderDataModule", "SkippedFilesReport"]

SKIPPED_FILES_NAME = "skipped_files.tsv"


class SkippedFilesReport(L.Callback):
    """Counts the files a folder DataModule with ``bad_files="skip"`` left out, per split and epoch:
    logs them as ``data/skipped_<split>`` and warns, naming the list they are in.

    Example::

        trainer = Trainer(callbacks=[SkippedFilesReport()])
        trainer.fit(model, datamodule=ImageFolderDataModule(root, bad_files="skip"))
    """

    def __init__(self) -> None:
        self.path: Path | None = None
        self._offset = 0

    def _new_counts(self, trainer: L.Trainer) -> dict[str, int]:
        path = getattr(trainer.datamodule, "skipped_files_path", None)
        if path != self.path:
            self.path, self._offset = path, 0
        if self.path is None or not self.path.is_file():
            return {}
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            lines = f.read().splitlines()
            self._offset = f.tell()
        # A file can be met more than once in an epoch (also as the replacement tried for
        # another bad file): count distinct files.
        seen = {tuple(line.split("\t", 2)[:2]) for line in lines if "\t" in line}
        counts: dict[str, int] = {}
        for split, _ in seen:
            counts[split] = counts.get(split, 0) + 1
        return counts

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, can_log: bool = True) -> None:
        counts = self._new_counts(trainer)
        for split, n in counts.items():
            rank_zero_warn(f"{type(trainer.datamodule).__name__}: skipped {n} unreadable file(s) of {split!r} in epoch "
                           f"{trainer.current_epoch}; their paths are in {self.path}.")
        if can_log and not trainer.sanity_checking:
            for split in ("train", "val"):
                pl_module.log(f"data/skipped_{split}", float(counts.get(split, 0)), reduce_fx="sum", sync_dist=True)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, pl_module)

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING:  # during fit the train epoch end reports both splits
            self._report(trainer, pl_module)

    @override
    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, pl_module)

    @override
    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._report(trainer, pl_module, can_log=False)


class ClassFolderDataModule(L.LightningDataModule):
    """Base of the folder DataModules (see the module docstring); not used on its own."""

    #: How the root should look, and how to make one, for the error when it is missing.
    layout_hint: ClassVar[str] = "train/ and val/ class folders"
    #: The collate (called with ``pin_memory=``) that builds a batch in the loader.
    collate_class: ClassVar[type]

    root: Path
    batch_size: int
    num_workers: int
    persistent_workers: bool
    pin_memory: bool | None
    cuda_prefetch: bool
    val_set: Dataset | None
    _classes: list[str] | None
    _pin: bool
    _device: torch.device | None
    bad_files: str
    _skip_log: Path | None

    @property
    def skipped_files_path(self) -> Path | None:
        """With ``bad_files="skip"`` under a Trainer: the list the workers append skipped files to
        (``SkippedFilesReport`` counts and reports them); else ``None``."""
        return getattr(self, "_skip_log", None)

    def _open_skip_log(self) -> None:
        """With ``bad_files="skip"`` under a Trainer: the skipped-files list in the run directory (one per rank)."""
        trainer = self.trainer
        if self.bad_files != "skip" or trainer is None:
            return
        run_dir = Path(trainer.default_root_dir)  # the run directory, not the logger's folder
        run_dir.mkdir(parents=True, exist_ok=True)
        name = SKIPPED_FILES_NAME if trainer.world_size == 1 else f"rank{trainer.global_rank}.{SKIPPED_FILES_NAME}"
        self._skip_log = run_dir / name
        if not any(isinstance(cb, SkippedFilesReport) for cb in trainer.callbacks):
            rank_zero_warn(f"{type(self).__name__}(bad_files='skip'): skipped files are listed in {self._skip_log}; "
                           "add cltrain.data.SkippedFilesReport() to the Trainer's callbacks to count them per epoch.")

    def _split_dir(self, split: str) -> Path:
        if not self.root.is_dir():
            raise FileNotFoundError(f"{type(self).__name__}: root {self.root} does not exist or is not a folder. "
                                    f"Point root at {self.layout_hint}.")
        return self.root / split

    @property
    def classes(self) -> list[str]:
        """Class folder names of ``root/train``, in label order."""
        if self._classes is None:
            self._classes = find_classes(self._split_dir("train"))
        return self._classes

    @property
    def num_classes(self) -> int:
        """Number of classes (class folders of ``root/train``)."""
        return len(self.classes)

    def _choose_device(self) -> torch.device:
        """The trainer's device (CPU without one); pin memory only for a GPU unless ``pin_memory`` says."""
        trainer = self.trainer
        self._device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        self._pin = self._device.type == "cuda" if self.pin_memory is None else bool(self.pin_memory)
        return self._device

    def _collate(self, pin_memory: bool) -> object:
        """The loader's ``collate_fn``."""
        return self.collate_class(pin_memory=pin_memory)

    def _loader(self, dataset: Dataset | None, train: bool, drop_last: bool | None = None) -> PrefetchDataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() (the Trainer does) before asking for a dataloader.")
        workers = self.num_workers
        cuda = self.cuda_prefetch and self._device is not None and self._device.type == "cuda"
        return PrefetchDataLoader(
            dataset, batch_size=self.batch_size, shuffle=train, num_workers=workers,
            collate_fn=self._collate(pin_memory=self._pin and workers == 0),  # workers: the loader pins, here
            pin_memory=self._pin and workers > 0, persistent_workers=self.persistent_workers and workers > 0,
            drop_last=train if drop_last is None else drop_last, prefetch_device=self._device if cuda else None)

    @override
    def val_dataloader(self) -> PrefetchDataLoader:
        return self._loader(self.val_set, train=False)

    @override
    def test_dataloader(self) -> PrefetchDataLoader:
        return self._loader(self.val_set, train=False)

    @override
    def predict_dataloader(self) -> PrefetchDataLoader:
        return self._loader(self.val_set, train=False)
