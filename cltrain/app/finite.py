"""Stop a run whose training loss is no longer finite, before it spends hours on NaN.

A NaN or infinite loss makes every later step NaN too (the optimizer writes it into the
weights), yet Lightning trains on and would end ``"completed"`` with a chance-level
accuracy. ``StopOnNonFinite`` reads the loss where the app already synchronises with the
device to print it (every ``print_freq`` batches and the last batch of an epoch; no extra sync
per step) and checks the weights once per epoch, before the epoch-end ``last.ckpt`` is written.
On the first non-finite value it raises ``NonFiniteLossError``: the app keeps the
``last.ckpt`` it has (the on-exception checkpoint skips this error, so finite weights are not
overwritten by NaN ones), writes ``metrics.json`` with ``"status": "failed"``, prints one line
and exits with status 1. Under DDP every rank takes the same decision (one collective at the
check, none per step).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["NonFiniteLossError", "StopOnNonFinite"]


class NonFiniteLossError(RuntimeError):
    """The training loss (or the weights) stopped being finite; the message says where and what to try."""


class StopOnNonFinite(Callback):
    """Raise ``NonFiniteLossError`` at the first non-finite training loss read every
    ``every`` batches (and at the last batch of each epoch), or non-finite weights at an epoch's end.

    Args:
        every: check the loss every this many training batches (0: only at the last batch of an epoch).
        hint: appended to the error: what to try (the app names its own config keys).
    """

    def __init__(self, every: int = 10, hint: str = "") -> None:
        if every < 0:
            raise ValueError(f"every={every!r} must be >= 0.")
        self.every, self.hint = every, hint

    def _fail(self, trainer: Trainer, what: str) -> None:
        raise NonFiniteLossError(f"{what} at epoch {trainer.current_epoch}, step {trainer.global_step}; the run is stopped"
                                 f"{self.hint}")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        last = batch_idx + 1 >= trainer.num_training_batches
        if not (last or (self.every > 0 and (batch_idx + 1) % self.every == 0)):
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        value = float(loss.detach())  # at a step the progress line reads too: the second read waits for nothing
        if trainer.strategy.reduce_boolean_decision(not math.isfinite(value), all=False):
            self._fail(trainer, f"training loss is {value} on rank {trainer.global_rank}" if not math.isfinite(value)
                       else "training loss is not finite on another rank")

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Checkpoint callbacks run after this one (Lightning puts them last): check before last.ckpt is written.
        params = [p.detach() for p in pl_module.parameters()]
        finite = bool(torch.stack([p.float().sum() for p in params]).isfinite().all()) if params else True
        if trainer.strategy.reduce_boolean_decision(not finite, all=False):
            self._fail(trainer, "the weights are no longer finite")
