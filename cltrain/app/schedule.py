"""Learning-rate schedules per iteration, as ``torch.optim.lr_scheduler`` objects.

apex ``examples/imagenet/main_amp.py`` sets the rate before every batch::

    factor = epoch // 30 (+1 from epoch 80)     -> x0.1 at epochs 30, 60, 80
    if epoch < 5: lr *= (1 + step + epoch * len_epoch) / (5 * len_epoch)

``lr_at`` is that rule with the warm-up length, milestones and factor as
arguments, written in optimizer steps; ``cosine_lr_at`` is the cosine decay
(timm's and torchvision's references' other common choice) after the same
linear warm-up. ``StepScheduler`` turns either into an ``LRScheduler`` that
Lightning steps after every optimizer step (``"interval": "step"``), so
``LearningRateMonitor``, the LR finder and checkpoints all see it.

The scheduler is a closed form of the step count: resuming restores only the
position (``last_epoch``), and the rate is recomputed from the config, so a run
resumed with the same config continues exactly where it stopped, and one
resumed with a changed schedule (say new milestones) follows the new one.

Example::

    >>> lr_at(0, steps_per_epoch=100, base_lr=0.4, warmup_epochs=5)   # first step of warm-up
    0.0008
    >>> lr_at(3000, steps_per_epoch=100, base_lr=0.4)                  # epoch 30
    0.04000000000000001
    >>> round(cosine_lr_at(150, total_steps=200, base_lr=0.4, warmup_steps=100), 4)
    0.2
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["SCHEDULES", "StepScheduler", "cosine_lr_at", "lr_at", "make_scheduler", "scaled_lr"]

SCHEDULES = ("step", "cosine")


def scaled_lr(lr: float, global_batch: int, reference_batch: int = 256) -> float:
    """The linear scaling rule: ``lr`` is given for ``reference_batch`` images per step."""
    return lr * global_batch / reference_batch


def lr_at(
    step: int,
    steps_per_epoch: int,
    base_lr: float,
    warmup_epochs: float = 5,
    milestones: Sequence[int] = (30, 60, 80),
    gamma: float = 0.1,
) -> float:
    """The learning rate for optimizer step ``step`` (0-based): main_amp's warm-up and milestones.

    Args:
        step: optimizer steps taken so far (Lightning's ``trainer.global_step``).
        steps_per_epoch: optimizer steps in one epoch (>= 1).
        base_lr: the peak rate (already scaled for the global batch).
        warmup_epochs: linear warm-up length; the first step uses ``base_lr / warmup_steps``.
        milestones: epochs at which the rate is multiplied by ``gamma``.
        gamma: the decay factor.

    Raises:
        ValueError: ``steps_per_epoch`` < 1 or ``step`` < 0.
    """
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    epoch = step // steps_per_epoch
    lr = base_lr * gamma ** sum(epoch >= m for m in milestones)
    warmup_steps = warmup_epochs * steps_per_epoch
    if step < warmup_steps:
        lr *= (step + 1) / warmup_steps
    return lr


def cosine_lr_at(step: int, total_steps: int, base_lr: float, warmup_steps: float = 0,
                 min_lr_ratio: float = 0.0) -> float:
    """The learning rate for optimizer step ``step`` (0-based): linear warm-up, then a half cosine.

    The warm-up is ``lr_at``'s (``base_lr * (step + 1) / warmup_steps``); then the rate falls
    from ``base_lr`` to ``base_lr * min_lr_ratio`` at ``total_steps`` (and stays there after).

    Raises:
        ValueError: ``total_steps`` < 1, ``step`` < 0 or ``min_lr_ratio`` outside [0, 1].
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    span = max(1.0, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    min_lr = base_lr * min_lr_ratio
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class StepScheduler(LRScheduler):
    """An ``LRScheduler`` whose rate is ``rule(step, base_lr)``, ``step`` = optimizer steps taken.

    Construction applies ``rule(0, base_lr)``; every ``step()`` (one per optimizer step, as
    Lightning calls it with ``"interval": "step"``) applies the next. Its ``state_dict`` holds
    only the position, so the rule always comes from the config (see the module docstring).

    Args:
        optimizer: the optimizer; every param group's ``initial_lr`` (else ``lr``) is its base rate.
        rule: ``(step, base_lr) -> lr``; ``make_scheduler`` builds it from the config.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, rule: Callable[[int, float], float]) -> None:
        self.rule = rule
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:  # closed form: no dependence on the previous rate
        return [self.rule(self.last_epoch, base) for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position and apply the configured rate there (the optimizer's saved
        ``lr``, restored before this by Lightning, came from the old config)."""
        self.last_epoch, self._step_count = state_dict["last_epoch"], state_dict["_step_count"]
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def make_scheduler(optimizer: torch.optim.Optimizer, schedule: str, steps_per_epoch: int, total_steps: int, *,
                   warmup_epochs: float = 5, milestones: Sequence[int] = (30, 60, 80), gamma: float = 0.1,
                   min_lr_ratio: float = 0.0) -> StepScheduler:
    """The configured schedule (``"step"``: ``lr_at``; ``"cosine"``: ``cosine_lr_at``).

    Raises:
        ValueError: an unknown ``schedule``.
    """
    if schedule == "step":
        def rule(step: int, base: float) -> float:
            return lr_at(step, steps_per_epoch, base, warmup_epochs, milestones, gamma)
    elif schedule == "cosine":
        def rule(step: int, base: float) -> float:
            return cosine_lr_at(step, total_steps, base, warmup_epochs * steps_per_epoch, min_lr_ratio)
    else:
        raise ValueError(f"unknown schedule {schedule!r} (allowed: {', '.join(SCHEDULES)})")
    return StepScheduler(optimizer, rule)
