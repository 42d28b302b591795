"""``ResumeMidEpoch``: a checkpoint written in the middle of an epoch resumes there, whoever wrote it.

A cltrain DataModule saves its place in the epoch with each checkpoint (the epoch's number, the batches taken);
Lightning's loop counts the epochs apart from it, and its count is off in three cases, where the resumed run did not
end as the uninterrupted run ends (and a fourth: an epoch resumed in its middle calls no ``on_train_epoch_start``, so
a ``GradientAccumulationScheduler`` is asked for its count here):

* ``max_steps`` stopped the fit mid-epoch and ``ModelCheckpoint(save_last=True)`` saved ``last.ckpt`` from the
  epoch's end hooks or at the fit's end, counting the epoch as processed: the run resumed with the next epoch, read
  from the stopped place (short);
* a run resumed from the checkpoint of an epoch's last batch counts the next epoch as the stopped one (its start is
  not counted): a checkpoint it writes in that epoch, resumed, trained a whole epoch more;
* ``max_steps`` stopped the fit at an epoch's end, and the run resumed with ``max_steps`` set: Lightning counts that
  epoch finished only without ``max_steps`` (``FitLoop.on_run_start``; Lightning #19617), so the stopped epoch went on
  with a batch of the next one's order.

This callback writes (and reads) a mid-epoch checkpoint with the epoch counts of the DataModule's place, as a
checkpoint of that epoch's steps in an uninterrupted run has them, and reads a finished epoch's checkpoint under
``max_steps`` as Lightning reads it without. A cltrain DataModule adds it to the Trainer at ``setup``; a checkpoint without a DataModule's
place is left alone.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

__all__ = ["ResumeMidEpoch"]


class ResumeMidEpoch(L.Callback):
    """Makes a checkpoint resume in the epoch its DataModule's place is in (see the module docstring).

    Example::

        trainer = Trainer(max_steps=1000, callbacks=[ModelCheckpoint(save_last=True), ResumeMidEpoch()])
    """

    def __init__(self) -> None:
        self._logged_step: int | None = None  # the loggers' step a finished epoch's checkpoint had, put back

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._logged_step is not None:
            # Lightning's loop, restarting under max_steps where validation ran at the epoch's end, counts one
            # batch that does not train (it skips that validation) into the step its loggers log at
            loop = trainer.fit_loop.epoch_loop
            if isinstance(getattr(loop, "_batches_that_stepped", None), int):
                loop._batches_that_stepped = self._logged_step
            self._logged_step = None

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if getattr(trainer.fit_loop, "restarted_mid_epoch", False):
            # Lightning calls no on_train_epoch_start in an epoch resumed in its middle: the accumulation schedule's
            # count for the epoch is set there (a run resumed with 1 where the schedule says 2)
            for callback in trainer.callbacks:
                if "GradientAccumulationScheduler" in {k.__name__ for k in type(callback).__mro__}:
                    callback.on_train_epoch_start(trainer, pl_module)

    @override
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        _count_the_places_epoch(trainer, checkpoint)

    @override
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        _count_the_places_epoch(trainer, checkpoint)  # one written without this callback
        if trainer.max_steps != -1:
            self._logged_step = _finished_epoch_with_max_steps(trainer, checkpoint)
        _say_if_inside_an_accumulation_window(trainer, checkpoint)


def _parts(trainer: Any, checkpoint: dict[str, Any]) -> tuple[dict | None, dict, dict | None, dict | None]:
    """``checkpoint``'s DataModule place in the training epoch (``None`` without one), its fit loop's state, and that
    loop's epoch and batch counts."""
    datamodule = getattr(trainer, "datamodule", None)
    place = checkpoint.get(type(datamodule).__qualname__) if datamodule is not None else None
    loader = place.get("train_loader") if isinstance(place, dict) else None
    fit = checkpoint.get("loops", {}).get("fit_loop", {})
    return (loader if isinstance(loader, dict) else None), fit, fit.get("epoch_progress"), \
        fit.get("epoch_loop.batch_progress")


def _count_the_places_epoch(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Where ``checkpoint`` was written in the middle of an epoch (its last batch not reached, the DataModule's place
    in it saved): the loop's epoch counts as that epoch's steps have them (started, not processed)."""
    loader, fit, epochs, batches = _parts(trainer, checkpoint)
    if loader is None or not isinstance(loader.get("epoch"), int) or loader.get("finished", True) \
            or not epochs or not batches or batches.get("is_last_batch", True):
        return
    epoch = loader["epoch"]
    for counts in (epochs["total"], epochs["current"]):  # total: the same, counted on from an earlier fit
        before = counts["completed"] - epochs["current"]["completed"]
        counts.update(ready=before + epoch + 1, started=before + epoch + 1, processed=before + epoch,
                      completed=before + epoch)


def _finished_epoch_with_max_steps(trainer: Any, checkpoint: dict[str, Any]) -> int | None:
    """Where ``checkpoint``'s epoch was finished (its last batch done, the DataModule's place at its end) and the fit
    resumes with ``max_steps``: the counts a fit without ``max_steps`` resumes from (the epoch completed, no batch of
    the next one taken), which Lightning's loop restores only without it (it goes on in the finished epoch). Returns
    the loggers' step saved (``None``: nothing rewritten)."""
    loader, fit, epochs, batches = _parts(trainer, checkpoint)
    if loader is None or not loader.get("finished") or not epochs or not batches \
            or not batches.get("is_last_batch") or epochs["current"]["processed"] != epochs["current"]["started"]:
        return None
    for counts in (epochs["total"], epochs["current"]):
        counts["completed"] = counts["processed"]
    batches["current"] = dict.fromkeys(batches["current"], 0)
    batches["is_last_batch"] = False
    return fit.get("epoch_loop.state_dict", {}).get("_batches_that_stepped")


def _say_if_inside_an_accumulation_window(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """One line where ``checkpoint`` was saved between the micro-batches of an ``accumulate_grad_batches`` window (an
    exception's or a signal's checkpoint): Lightning saves no accumulated gradient, so the window's first step lacks
    those micro-batches' gradients and the run is not the uninterrupted one's."""
    every = getattr(trainer, "accumulate_grad_batches", 1)
    batches = _parts(trainer, checkpoint)[3]
    if not isinstance(every, int) or every <= 1 or not batches or batches.get("is_last_batch", True):
        return
    done = batches["current"]["processed"] % every  # completed lags at a batch-end save
    if done:
        rank_zero_warn(f"cltrain: {getattr(trainer, 'ckpt_path', None) or 'the checkpoint'} was saved after {done} of "
                       f"the {every} micro-batches of an accumulate_grad_batches window; Lightning saves no accumulated "
                       f"gradient, so the resumed run's next optimizer step lacks their gradients and does not end bit "
                       f"for bit where the uninterrupted run ends (resume from a checkpoint saved at a step's end, e.g. "
                       f"ModelCheckpoint(every_n_train_steps=...), to continue exactly).")
