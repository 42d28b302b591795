"""``ClassFolders``: the class folders of ``root/train`` and ``root/val``, as the folder DataModules read them.

``ImageFolderDataModule`` (images) and ``ClipFolderDataModule`` (clips) read ``root/train/<class>/...``
and ``root/val/<class>/...``; each holds a ``ClassFolders`` (``dm.folders``) for the split folders, the
class names of ``root/train`` (label order), and the one-line error for a missing root.
"""

from __future__ import annotations

from pathlib import Path

from cltrain.data.image_folder_dataset import find_classes

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
            raise FileNotFoundError(f"{self.owner}: root {self.root} does not exist or is not a folder. "
                                    f"Point root at {self.layout_hint}.")
        return self.root / name

    @property
    def classes(self) -> list[str]:
        """Class folder names of ``root/train``, in label order."""
        if self._classes is None:
            self._classes = find_classes(self.split("train"))
        return self._classes
