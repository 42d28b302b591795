"""``bad_files`` for every DataModule, and ``SkippedFilesReport``, which counts what ``bad_files="skip"`` left out.

``TakesBadFiles`` gives a DataModule (folders, clips, packs, Hugging Face datasets) the
``bad_files`` argument and, under a Trainer with ``bad_files="skip"``, the list in the run
directory that its workers append one ``split<TAB>name<TAB>reason`` line per skipped sample to
(``SKIPPED_FILES_NAME``, ``datamodule.skipped_files_path``; ``cltrain.data.bad_samples``). The
callback reads the new lines at each epoch's end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from cltrain.data.bad_samples import check_bad_files

__all__ = ["SKIPPED_FILES_NAME", "SkippedFilesReport", "TakesBadFiles"]

#: The list of skipped files in the run directory (``rank<r>.skipped_files.tsv`` per rank under DDP).
SKIPPED_FILES_NAME = "skipped_files.tsv"


class TakesBadFiles:
    """The ``bad_files`` argument of a DataModule (a base listed before the ``BatchDataModule``):
    ``"raise"``: an unreadable sample stops the run with an error naming it; ``"skip"``: it is
    replaced by the next readable one and, under a Trainer, listed in the run directory's
    ``skipped_files.tsv`` (``SkippedFilesReport`` counts them per epoch). The DataModule calls
    ``_open_skip_log`` in ``setup`` and hands ``self.bad_files`` and ``self._skip_log`` to its Datasets.
    """

    def __init__(self, *args: Any, bad_files: str = "raise", **kwargs: Any) -> None:
        self.bad_files = check_bad_files(bad_files, type(self).__name__)
        self._skip_log: Path | None = None
        super().__init__(*args, **kwargs)

    @property
    def skipped_files_path(self) -> Path | None:
        """With ``bad_files="skip"`` under a Trainer: the list the workers append skipped samples to
        (``SkippedFilesReport`` counts and reports them); else ``None``."""
        return self._skip_log

    def _open_skip_log(self) -> None:
        """With ``bad_files="skip"`` under a Trainer: the skipped-files list in the run directory (one per rank)."""
        trainer = self.trainer  # type: ignore[attr-defined]
        if self.bad_files != "skip" or trainer is None:
            return
        run_dir = Path(trainer.default_root_dir)  # the run directory, not the logger's folder
        run_dir.mkdir(parents=True, exist_ok=True)
        name = SKIPPED_FILES_NAME if trainer.world_size == 1 else f"rank{trainer.global_rank}.{SKIPPED_FILES_NAME}"
        self._skip_log = run_dir / name
        if not any(isinstance(cb, SkippedFilesReport) for cb in trainer.callbacks):
            rank_zero_warn(f"{type(self).__name__}(bad_files='skip'): skipped files are listed in {self._skip_log}; "
                           "add cltrain.data.SkippedFilesReport() to the Trainer's callbacks to count them per epoch.")


class SkippedFilesReport(L.Callback):
    """Counts the samples a DataModule with ``bad_files="skip"`` left out, per split and epoch:
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
