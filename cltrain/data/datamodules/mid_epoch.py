"""``ResumeMidEpoch``: a checkpoint written where ``max_steps`` stopped a fit in the middle of an epoch resumes there.

Lightning saves such a checkpoint from the epoch's end hooks or at the fit's end (``ModelCheckpoint(save_last=True)``)
after counting the epoch as processed, so a run resumed from it starts the next epoch, while a
cltrain DataModule's place in the stopped epoch, saved with it, says the epoch goes on: the next epoch would be read
from that place, short. This callback writes (and reads) such a checkpoint as the mid-epoch state a signal's or a
step's checkpoint is, so the resumed run finishes the stopped epoch and ends where the uninterrupted run ends. A
cltrain DataModule adds it to the Trainer at ``setup``; checkpoints without a DataModule's place are left alone.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

__all__ = ["ResumeMidEpoch"]


class ResumeMidEpoch(L.Callback):
    """Makes a checkpoint written after a ``max_steps`` stop in the middle of an epoch resume there (module docstring).

    Example::

        trainer = Trainer(max_steps=1000, callbacks=[ModelCheckpoint(save_last=True), ResumeMidEpoch()])
    """

    @override
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        _stopped_epoch_goes_on(trainer, checkpoint)

    @override
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        _stopped_epoch_goes_on(trainer, checkpoint)  # one written without this callback


def _stopped_epoch_goes_on(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Where ``checkpoint``'s epoch is counted processed (or completed) though its last batch was not reached, and the
    DataModule's place in it is saved: the epoch counted as going on, as a checkpoint of one of its steps counts it."""
    datamodule = getattr(trainer, "datamodule", None)
    place = checkpoint.get(type(datamodule).__qualname__) if datamodule is not None else None
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    epoch, batches = fit.get("epoch_progress"), fit.get("epoch_loop.batch_progress")
    if not isinstance(place, dict) or "train_loader" not in place or not epoch or not batches \
            or batches.get("is_last_batch", True):
        return
    for counts in (epoch["total"], epoch["current"]):
        # counted processed at the epoch's end hooks (and completed after them, where the save is at the fit's end)
        unfinished = counts["started"] - 1
        counts["processed"] = min(counts["processed"], unfinished)
        counts["completed"] = min(counts["completed"], unfinished)
