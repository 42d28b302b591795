"""``SkippedFilesReport``, which counts what ``bad_files="skip"`` left out, and the list it reads.

Every DataModule takes ``bad_files`` (``cltrain.data.settings.BadFilePolicy``); under a Trainer with
``bad_files="skip"`` its workers append one ``split<TAB>name<TAB>reason`` line per skipped sample to
a list in the run directory (``SKIPPED_FILES_NAME``, ``datamodule.skipped_files_path``;
``cltrain.data.bad_samples``). The callback reads the new lines at each epoch's end. Under DDP each rank appends to its
own list (``rank<r>.skipped_files.tsv``); at each epoch's end the ranks' new lines are gathered, rank 0 appends them to
the run directory's ``skipped_files.tsv`` (rewritten atomically), and the warning counts every rank's skips.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from cltrain.atomic import atomic_write_bytes


__all__ = ["SKIPPED_FILES_NAME", "SkippedFilesReport"]

#: The list of skipped files in the run directory: every rank's (each rank appends to ``rank<r>.skipped_files.tsv``
#: under DDP, and rank 0 gathers their lines into this one at each epoch's end).
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

    def _new_lines(self, trainer: L.Trainer) -> list[str]:
        """The lines appended to this rank's list since the last report."""
        path = getattr(trainer.datamodule, "skipped_files_path", None)
        if path != self.path:
            self.path, self._offset = path, 0
        if self.path is None or not self.path.is_file():
            return []
        with open(self.path, encoding="utf-8", errors="surrogateescape") as f:
            f.seek(self._offset)
            lines = f.read().splitlines()
            self._offset = f.tell()
        return [line for line in lines if "\t" in line]

    def _every_rank(self, trainer: L.Trainer, lines: list[str]) -> tuple[list[list[str]], Path | None]:
        """Every rank's new lines (this rank's alone without a process group) and the list that holds them all:
        under DDP rank 0 appends them to the run directory's ``skipped_files.tsv``, atomically. Every rank or none
        calls the collective: ``path`` is ``None`` on each rank alike (``bad_files`` is the same everywhere)."""
        if trainer.world_size == 1 or self.path is None or not (dist.is_available() and dist.is_initialized()):
            return [lines], self.path
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, lines)
        ranks = [rank_lines or [] for rank_lines in gathered]
        merged = self.path.with_name(SKIPPED_FILES_NAME)
        new = list(dict.fromkeys(line for rank_lines in ranks for line in rank_lines))
        if trainer.is_global_zero and new:
            before = merged.read_text(encoding="utf-8", errors="surrogateescape") if merged.is_file() else ""
            text = before + "".join(f"{line}\n" for line in new)
            atomic_write_bytes(merged, text.encode("utf-8", "surrogateescape"))
        return ranks, merged

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, can_log: bool = True) -> None:
        lines = self._new_lines(trainer)
        ranks, merged = self._every_rank(trainer, lines)
        # distinct files over every rank (each rank's check of the validation files lists the same ones), as the list
        total = _counts([line for rank_lines in ranks for line in rank_lines])
        per_rank = ("" if merged == self.path
                    else f" (every rank's; each rank's own are in rank<r>.{SKIPPED_FILES_NAME})")
        for split, n in total.items():
            rank_zero_warn(f"{type(trainer.datamodule).__name__}: skipped {n} unreadable file(s) of {split!r} in epoch "
                           f"{trainer.current_epoch}; their paths are in {merged}{per_rank}.")
        if can_log and not trainer.sanity_checking:
            stage = _stages(trainer.datamodule)  # the list names a split as its source does ("validation")
            for split in ("train", "val"):
                n = sum(count for name, count in total.items() if stage.get(name, name) == split)
                pl_module.log(f"data/skipped_{split}", float(n), reduce_fx="max", sync_dist=True)  # the same on each

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


def _counts(lines: list[str]) -> dict[str, int]:
    """``{split: distinct files}`` of a list's lines: a file can be met more than once in an epoch (also as the
    replacement tried for another bad file)."""
    counts: dict[str, int] = {}
    for split, _ in {tuple(line.split("\t", 2)[:2]) for line in lines}:
        counts[split] = counts.get(split, 0) + 1
    return counts


def _stages(datamodule: object) -> dict[str, str]:
    """``{split name in the list: "train" or "val"}``: the names the DataModule's training and validation sets give."""
    stages = {}
    for stage, attribute in (("train", "train_set"), ("val", "val_set")):
        name = getattr(getattr(datamodule, attribute, None), "split_name", None)
        if isinstance(name, str):
            stages[name] = stage
    return stages
