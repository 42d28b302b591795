"""What the benchmarks that time whole Lightning fits share: ``quiet_trainer`` (no logger, checkpoint, progress bar,
summary or sanity check), ``NetModule`` (a network, a loss, an optimizer) and ``StepClock`` (the steps' seconds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from scripts.harness import Stopwatch, synchronize

__all__ = ["NetModule", "StepClock", "quiet_trainer"]


def quiet_trainer(trainer: Callable[..., Any] = Trainer, **options: Any) -> Trainer:
    """A ``trainer`` (Lightning's ``Trainer`` class, or ``pytorch_lightning``'s) of ``options`` that writes and prints
    nothing of its own and validates only when asked."""
    return trainer(**{"devices": 1, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                      "enable_model_summary": False, "num_sanity_val_steps": 0, "limit_val_batches": 0, **options})


class NetModule(LightningModule):
    """``net`` trained on ``loss(output, batch)`` with the optimizer ``optimizer(parameters)`` makes."""

    def __init__(self, net: torch.nn.Module, loss: Callable[[Any, Any], torch.Tensor],
                 optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
        super().__init__()
        self.net, self.loss, self.make_optimizer = net, loss, optimizer

    def forward(self, x: torch.Tensor) -> Any:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self(batch[0]), batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.make_optimizer(self.parameters())


class StepClock(Callback):
    """The training steps' seconds on the harness's clock: a Lightning callback, and :meth:`begin` / :meth:`end` for
    another trainer's hooks (``scripts.bench.hf_trainer``).

    Args:
        window: ``(first, last)`` step indices: one window from the start of ``first`` to the end of ``last``, the
            device synchronised at those two points only (the steps between run as they would): ``seconds``.
            ``None``: every step from its start to its end, the device synchronised at the end: ``steps``.
    """

    def __init__(self, window: tuple[int, int] | None = None) -> None:
        self.window, self.steps, self.seconds = window, [], None
        self.watch: Stopwatch | None = None

    def begin(self, step: int, device: torch.device | str) -> None:
        """A step starts; ``step``: the steps taken before it."""
        if self.window is None or step == self.window[0]:
            # a window opens on a synchronised device; a single step's start is not synchronised
            self.watch = Stopwatch(device if self.window else None).start()

    def end(self, steps: int, device: torch.device | str) -> None:
        """A step ends; ``steps``: the steps taken with it."""
        if self.window is None or steps == self.window[1] + 1:
            synchronize(device)  # the steps' kernels, done
            seconds = self.watch.elapsed()
            if self.window is None:
                self.steps.append(seconds)
            else:
                self.seconds = seconds

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.begin(trainer.global_step, trainer.strategy.root_device)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.end(trainer.global_step, trainer.strategy.root_device)  # global_step: the steps taken
