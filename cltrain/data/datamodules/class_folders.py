"""``ClassFolderDataModule``: what the folder DataModules share: class folders and the bad-file policy.

``ImageFolderDataModule`` (images) and ``ClipFolderDataModule`` (clips) read
``root/train/<class>/...`` and ``root/val/<class>/...``; ``ClassFolderDataModule`` adds to
``BatchDataModule`` the class folders of ``root/train`` (label order), the error for a missing
root, and ``bad_files``: with ``"skip"`` under a Trainer, the skipped samples are listed in the
run directory (``cltrain.data.datamodules.skipped_files.SkippedFilesReport`` counts them per epoch).

A subclass sets ``layout_hint`` and calls ``_choose_device`` and ``_open_skip_log`` in its ``setup``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from cltrain.data.datamodules.base import BatchDataModule
from cltrain.data.datamodules.skipped_files import SKIPPED_FILES_NAME, SkippedFilesReport
from cltrain.data.image_folder_dataset import check_bad_files, find_classes

__all__ = ["ClassFolderDataModule"]


class ClassFolderDataModule(BatchDataModule):
    """Base of the folder DataModules (see the module docstring); not used on its own.

    Args:
        bad_files: ``"raise"``: an unreadable sample stops with an error naming it;
            ``"skip"``: it is replaced by the next readable one, listed in the run
            directory's ``skipped_files.tsv`` and counted per epoch (``data/skipped_<split>``).
        **kwargs: ``BatchDataModule``'s arguments, and those of the other bases.
    """

    #: How the root should look, and how to make one, for the error when it is missing.
    layout_hint: ClassVar[str] = "train/ and val/ class folders"

    def __init__(self, *args: Any, bad_files: str = "raise", **kwargs: Any) -> None:
        self.bad_files = check_bad_files(bad_files, type(self).__name__)
        self._skip_log: Path | None = None
        super().__init__(*args, **kwargs)

    @property
    def skipped_files_path(self) -> Path | None:
        """With ``bad_files="skip"`` under a Trainer: the list the workers append skipped files to
        (``SkippedFilesReport`` counts and reports them); else ``None``."""
        return self._skip_log

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
    @override
    def classes(self) -> list[str]:
        """Class folder names of ``root/train``, in label order."""
        if self._classes is None:
            self._classes = find_classes(self._split_dir("train"))
        return self._classes
