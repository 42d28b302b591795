"""The learning-rate schedule of apex ``examples/imagenet/main_amp.py``, per iteration.

main_amp.py sets the rate before every batch::

    factor = epoch // 30 (+1 from epoch 80)     -> x0.1 at epochs 30, 60, 80
    if epoch < 5: lr *= (1 + step + epoch * len_epoch) / (5 * len_epoch)

:func:`lr_at` is the same rule with the warm-up length, milestones and factor as
arguments, written in optimizer steps so that a resumed run (which restores
Lightning's ``global_step``) lands on exactly the rate it left off at.

Example::

    >>> lr_at(0, steps_per_epoch=100, base_lr=0.4, warmup_epochs=5)   # first step of warm-up
    0.0008
    >>> lr_at(3000, steps_per_epoch=100, base_lr=0.4)                  # epoch 30
    0.04000000000000001
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["lr_at", "scaled_lr"]


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
    """The learning rate for optimizer step ``step`` (0-based).

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
