"""``KeepOnException``: write ``last.ckpt`` when a run stops on an exception or a signal, and keep it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, ContextManager

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from cltrain.app.finite import NonFiniteLossError
from cltrain.atomic import DiskFullError, NotWritableError

__all__ = ["KeepOnException"]


class KeepOnException(Callback):
    """Writes ``last.ckpt`` when a run stops on an exception or signal, and keeps it.

    Not Lightning's ``OnExceptionCheckpoint``: that one deletes its file in ``teardown`` (after a
    normal run, the epoch-end ``last.ckpt``), and its presence makes ``fit(ckpt_path=None)`` look
    for a checkpoint to resume from. A run stopped for a non-finite loss is not saved: its weights
    are NaN, and the ``last.ckpt`` it has is the latest finite state; nor is a run stopped by a full
    disk: the save would fail again, and the ``last.ckpt`` it has is intact; nor is a run a second signal stopped in
    the middle of a step; nor, under several ranks, a run an error stopped on one rank (the save's barrier would
    wait for the other ranks, which are in their next collective).

    Args:
        dirpath: the checkpoint folder.
        filename: the checkpoint's name, without ``.ckpt``.
        holding: a context the save runs in (``SignalStop.holding``: signals wait for the file).

    Example::

        trainer = Trainer(callbacks=[KeepOnException("run/checkpoints")])
    """

    def __init__(self, dirpath: str | Path, filename: str = "last",
                 holding: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> None:
        self.ckpt_path = str(Path(dirpath) / f"{filename}.ckpt")
        self.holding = holding

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, (NonFiniteLossError, DiskFullError, NotWritableError)) \
                or getattr(exception, "at_once", False):  # a save would fail again; a second signal: the middle of
            return  # a step, perhaps of the optimizer's update
        if trainer.global_step == 0 and not trainer.ckpt_path:  # nothing trained (a data error found at setup): a
            return  # step-0 file would resume nothing and keep a retry out of the run directory
        if trainer.world_size > 1 and isinstance(exception, Exception):
            # An error on one rank: the save's barrier would meet the other ranks' next collective (DDP's buffer
            # broadcast) and every rank would wait for ever. The other ranks stop when this one's connections close
            # (and a rank whose peer a second signal stopped is in the middle of a step).
            return
        with self.holding():  # a signal now waits for the file (``SignalStop.holding``)
            trainer.save_checkpoint(self.ckpt_path, weights_only=False)  # the whole state (Lightning logs its default)

