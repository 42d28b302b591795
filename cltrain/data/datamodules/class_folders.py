"""``ClassFolderDataModule``: what the folder DataModules share: class folders and the bad-file policy.

``ImageFolderDataModule`` (images) and ``ClipFolderDataModule`` (clips) read
``root/train/<class>/...`` and ``root/val/<class>/...``; ``ClassFolderDataModule`` adds to
``BatchDataModule`` the class folders of ``root/train`` (label order), the error for a missing
root, and ``bad_files`` (``cltrain.data.datamodules.skipped_files.TakesBadFiles``): with ``"skip"``
under a Trainer, the skipped samples are listed in the run directory.

A subclass sets ``layout_hint`` and calls ``_choose_device`` and ``_open_skip_log`` in its ``setup``.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from typing_extensions import override

from cltrain.data.datamodules.base import BatchDataModule
from cltrain.data.datamodules.skipped_files import TakesBadFiles
from cltrain.data.image_folder_dataset import find_classes

__all__ = ["ClassFolderDataModule"]


class ClassFolderDataModule(TakesBadFiles, BatchDataModule):
    """Base of the folder DataModules (see the module docstring); not used on its own.

    Args:
        bad_files: ``"raise"``: an unreadable sample stops with an error naming it;
            ``"skip"``: it is replaced by the next readable one, listed in the run
            directory's ``skipped_files.tsv`` and counted per epoch (``data/skipped_<split>``).
        **kwargs: ``BatchDataModule``'s arguments, and those of the other bases.
    """

    #: How the root should look, and how to make one, for the error when it is missing.
    layout_hint: ClassVar[str] = "train/ and val/ class folders"

    def _split_dir(self, split: str) -> Path:
        if not self.root.is_dir():
            raise FileNotFoundError(f"{type(self).__name__}: root {self.root} does not exist or is not a folder. "
                                    f"Point root at {self.layout_hint}.")
        return self.root / split

    @property
    @override
    def classes(self) -> list[str]:
        """Class folder names of ``root/train``, in label order."""
        if self._classes is None:
            self._classes = find_classes(self._split_dir("train"))
        return self._classes
