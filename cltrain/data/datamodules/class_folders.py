"""``ClassFolders``: the class folders of ``root/train`` and ``root/val``, as the folder DataModules read them.

``ImageFolderDataModule`` (images) and ``ClipFolderDataModule`` (clips) read ``root/train/<class>/...``
and ``root/val/<class>/...``; each holds a ``ClassFolders`` (``dm.folders``) for the split folders, the
class names of ``root/train`` (label order; of ``root/val`` where there is no ``train/``), the one-line error for a missing root, and the line saying what
``exclude_files`` left out.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from cltrain.data.errors import DataError, MissingDataError
from cltrain.data.image_folder_dataset import find_classes, read_file_list

__all__ = ["ClassFolders"]


class ClassFolders:
    """The split folders and classes under ``root``.

    Args:
        root: the folder holding ``train/`` and ``val/``.
        owner: the DataModule's name, for the error.
        layout_hint: how ``root`` should look, and how to make one, for the error when it is missing.
    """

    def __init__(self, root: Path, owner: str, layout_hint: str) -> None:
        self.root, self.owner, self.layout_hint = root, owner, layout_hint
        self._classes: list[str] | None = None

    def split(self, name: str) -> Path:
        """``root/<name>``.

        Raises:
            FileNotFoundError: ``root`` is not a folder (naming it and ``layout_hint``).
        """
        if not self.root.is_dir():
            raise MissingDataError(f"{self.owner}: root {self.root} does not exist or is not a folder. "
                                    f"Point root at {self.layout_hint}.")
        return self.root / name

    @property
    def classes(self) -> list[str]:
        """Class folder names of ``root/train``, in label order; of ``root/val`` where there is no ``train/`` (a
        folder to evaluate on: a checkpoint's classes are compared with them as it loads)."""
        if self._classes is None:
            train, val = self.split("train"), self.split("val")
            self._classes = find_classes(val if not train.exists() and val.is_dir() else train)
        return self._classes

    @staticmethod
    def exclusions(exclude_files: str | os.PathLike | None) -> frozenset[str]:
        """The files ``exclude_files`` lists (``read_file_list``); none where it is ``None``.

        Raises:
            DataError: no such file (one line: the app ends on it with exit status 2).
        """
        if exclude_files is None:
            return frozenset()
        try:
            return read_file_list(exclude_files)
        except FileNotFoundError as err:
            raise DataError(str(err)) from None

    def tell_excluded(self, exclude_files: Path, listed: int, sets: dict[str, Any], what: str) -> None:
        """How many ``what`` (``"image"``, ``"clip"``) of each split in ``sets`` (name -> dataset with ``excluded``)
        the ``listed`` file(s) of ``exclude_files`` left out; a warning where none of them is under the root."""
        sets = {name: s for name, s in sets.items() if s is not None}
        left = sum(s.excluded for s in sets.values())
        split = ", ".join(f"{name} {s.excluded}" for name, s in sets.items())
        if left:
            rank_zero_info(f"{self.owner}: left out {left} {what}(s) of the {listed} file(s) listed in {exclude_files} "
                           f"({split}).")
        else:
            rank_zero_warn(f"{self.owner}: none of the {listed} file(s) listed in {exclude_files} is under "
                           f"{self.root} (a relative path in the list is read from the working directory, "
                           f"{os.getcwd()}); write the list again with 'python -m cltrain.data.check {self.root}'.")
