"""``SkippedFilesReport``, which counts what ``bad_files="skip"`` left out, and the list it reads.

Every DataModule takes ``bad_files`` (``cltrain.data.settings.BadFilePolicy``); under a Trainer with
``bad_files="skip"`` its workers append one ``split<TAB>name<TAB>reason`` line per skipped sample to
a list in the run directory (``SKIPPED_FILES_NAME``, ``datamodule.skipped_files_path``;
``cltrain.data.bad_samples``). The callback reads the new lines at each epoch's end.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override


__all__ = ["SKIPPED_FILES_NAME", "SkippedFilesReport"]

#: The list of skipped files in the run directory (``rank<r>.skipped_files.tsv`` per rank under DDP).
SKIPPED_FILES_NAME = "skipped_files.tsv"


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
            stage = _stages(trainer.datamodule)  # the list names a split as its source does ("validation")
            for split in ("train", "val"):
                n = sum(count for name, count in counts.items() if stage.get(name, name) == split)
                pl_module.log(f"data/skipped_{split}", float(n), reduce_fx="sum", sync_dist=True)

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


def _stages(datamodule: object) -> dict[str, str]:
    """``{split name in the list: "train" or "val"}``: the names the DataModule's training and validation sets give."""
    stages = {}
    for stage, attribute in (("train", "train_set"), ("val", "val_set")):
        name = getattr(getattr(datamodule, attribute, None), "split_name", None)
        if isinstance(name, str):
            stages[name] = stage
    return stages
