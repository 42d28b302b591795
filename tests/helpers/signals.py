"""A Lightning callback that sends this process a signal when training reaches a step, as a scheduler would."""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch.callbacks import Callback


class SignalAtStep(Callback):
    """Sends ``signum`` (default SIGTERM) to this process as the training step ``step`` starts."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class SignalAtValidation(Callback):
    """Sends ``signum`` (default SIGTERM) to this process as the first validation batch starts (not the sanity
    check's)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum

    def on_validation_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if not trainer.sanity_checking:
            os.kill(os.getpid(), self.signum)
