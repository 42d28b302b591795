"""What the folder DataModules share: class folders, the device, and loaders with the CUDA prefetch.

:class:`~cltrain.data.ImageFolderDataModule` (images) and
:class:`~cltrain.data.video.ClipFolderDataModule` (clips) differ in what a sample is and how a
batch is collated and normalised; the rest is here, once: the class folders of ``root/train``
(label order), the device and memory pinning chosen at ``setup``, and one loader builder
whose batches are copied to a CUDA device on a side stream
(:class:`~cltrain.data.prefetch.PrefetchDataLoader`), shuffled and cut to whole batches for
training, every sample kept for validation, test and predict.

A subclass sets :attr:`layout_hint` and :attr:`collate_class` and calls
:meth:`_choose_device` in its ``setup``.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import lightning as L
import torch
from torch.utils.data import Dataset
from typing_extensions import override

from cltrain.data.dataset import find_classes
from cltrain.data.prefetch import PrefetchDataLoader

__all__ = ["ClassFolderDataModule"]


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

    def _loader(self, dataset: Dataset | None, train: bool, drop_last: bool | None = None) -> PrefetchDataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() (the Trainer does) before asking for a dataloader.")
        workers = self.num_workers
        cuda = self.cuda_prefetch and self._device is not None and self._device.type == "cuda"
        return PrefetchDataLoader(
            dataset, batch_size=self.batch_size, shuffle=train, num_workers=workers,
            collate_fn=self.collate_class(pin_memory=self._pin and workers == 0),  # workers: the loader pins, here
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
