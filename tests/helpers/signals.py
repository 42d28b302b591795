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
