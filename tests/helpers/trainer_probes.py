"""Lightning ``Trainer`` subclasses that tests select from the config (``trainer._target_=tests.helpers.trainer_probes.X``),
so ``train(cfg)`` runs unchanged: each only adds a callback to the ones it is given.

- :class:`CountingTrainer` counts host-sync ATen ops per training step (``tests/test_sync.py``).
- :class:`CrashingTrainer` raises at a given step, as a crash would (``tests/test_schedule.py``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from cltrain.timing.host_syncs import SyncOps


class StepSyncCounter(Callback):
    """Attributes everything between one training batch start and the next (logging, progress,
    optimizer and scheduler steps included) to that batch; epoch ends and validation apart."""

    def __init__(self, mode: SyncOps) -> None:
        self.mode = mode
        #: (epoch, batch_idx, batches_that_stepped) of every training batch, in order
        self.steps: list[tuple[int, int, int]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = (trainer.current_epoch, batch_idx, trainer.fit_loop.epoch_loop._batches_that_stepped)
        self.steps.append(step)
        self.mode.phase = step

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.mode.phase = "epoch_end"

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.mode.phase = "validation"

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.mode.phase = "end"


class CountingTrainer(Trainer):
    """A Lightning ``Trainer`` with a :class:`StepSyncCounter` appended; the mode is ``CountingTrainer.mode``."""

    mode: SyncOps | None = None
    last: CountingTrainer | None = None

    def __init__(self, *args: Any, callbacks: list[Callback] | None = None, **kwargs: Any) -> None:
        assert CountingTrainer.mode is not None, "set CountingTrainer.mode before train(cfg)"
        self.counter = StepSyncCounter(CountingTrainer.mode)
        super().__init__(*args, callbacks=[*(callbacks or []), self.counter], **kwargs)
        CountingTrainer.last = self


class Crash(RuntimeError):
    """Raised by :class:`CrashingTrainer`."""


class _CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise Crash(f"crash at step {self.step}")


class CrashingTrainer(Trainer):
    """A Lightning ``Trainer`` that raises :class:`Crash` before optimizer step ``crash_at_step``."""

    def __init__(self, *args: Any, crash_at_step: int, callbacks: list[Callback] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, callbacks=[*(callbacks or []), _CrashAt(crash_at_step)], **kwargs)
