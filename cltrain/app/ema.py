"""EMA of the weights (``ema.enabled=true``): Lightning's ``WeightAveraging`` with a sync-free update.

Like timm's and torchvision's ``--model-ema``: a copy of the module (parameters
and buffers, so BatchNorm statistics too) follows the training weights as
``ema = decay * ema + (1 - decay) * weights`` after every ``every_n_steps``
optimizer steps; for the first ``warmup_steps`` updates the copy simply follows
the weights (torchvision's ``--model-ema-warmup-epochs``, in steps).

It is Lightning's ``WeightAveraging``: validation runs on the averaged weights, and a
checkpoint's ``state_dict`` holds them (plain module keys) with the training weights under
``current_model_state`` for resuming. Unlike ``EMAWeightAveraging``, the update never waits for
the host (``EMAModel`` counts updates on the host and updates all tensors with one
``torch._foreach_lerp_``), and the copy follows the module to its device at ``on_fit_start``.

Example::

    >>> from lightning.pytorch import Trainer
    >>> trainer = Trainer(callbacks=[EMA(decay=0.999, warmup_steps=100)])   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import WeightAveraging
from torch import nn
from torch.optim.swa_utils import AveragedModel
from typing_extensions import override

from cltrain.checkpoint_io import load_checkpoint_file

__all__ = ["EMA", "EMAModel", "weights_in_checkpoint"]


class EMAModel(AveragedModel):
    """An ``AveragedModel`` whose EMA update never reads a device value on the host.

    Args:
        model: the module to average (deep-copied).
        decay: the EMA decay, in ``[0, 1)``.
        warmup_steps: updates during which the copy follows ``model`` exactly.
        device: where the copy lives (``None``: with ``model``).
    """

    def __init__(self, model: nn.Module, decay: float, warmup_steps: int = 0,
                 device: torch.device | None = None) -> None:
        super().__init__(model, device=device, use_buffers=True)
        self.decay, self.warmup_steps = decay, warmup_steps
        self._updates: int | None = 0  # n_averaged on the host; None: read it once (after loading a state)

    @override
    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        result = super().load_state_dict(state_dict, *args, **kwargs)
        self._updates = None
        return result

    @override
    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        if self._updates is None:
            self._updates = int(self.n_averaged)  # once after a resume, not per step
        averaged = [t.detach() for t in (*self.module.parameters(), *self.module.buffers())]
        current = [t.detach().to(a.device) for t, a in zip((*model.parameters(), *model.buffers()), averaged)]
        follow = self._updates < max(1, self.warmup_steps)  # the first update (n_averaged 0) copies
        floats = [i for i, a in enumerate(averaged) if a.is_floating_point() and not follow]
        others = [i for i in range(len(averaged)) if i not in set(floats)]
        if floats:
            torch._foreach_lerp_([averaged[i] for i in floats], [current[i] for i in floats], 1.0 - self.decay)
        if others:  # warm-up, and integer buffers (BatchNorm's num_batches_tracked)
            torch._foreach_copy_([averaged[i] for i in others], [current[i] for i in others])
        self.n_averaged += 1
        self._updates += 1


class EMA(WeightAveraging):
    """Keep an EMA of the weights; validate and checkpoint with it (see the module docstring).

    Args:
        decay: the EMA decay per update, ``0 <= decay < 1`` (timm uses 0.9998, torchvision 0.99998
            at batch 1024 over 600 epochs: pick it for the run's number of steps).
        warmup_steps: updates during which the average simply follows the weights.
        every_n_steps: update after every this many optimizer steps.

    Raises:
        ValueError: a value out of range.
    """

    def __init__(self, decay: float = 0.999, warmup_steps: int = 0, every_n_steps: int = 1) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA: decay must be in [0, 1), got {decay}")
        if warmup_steps < 0 or every_n_steps < 1:
            raise ValueError(f"EMA: warmup_steps must be >= 0 and every_n_steps >= 1, got {warmup_steps}, {every_n_steps}")
        super().__init__(device=None, use_buffers=True)
        self.decay, self.warmup_steps, self.every_n_steps = decay, warmup_steps, every_n_steps
        self._swapped = False  # inside a validation: the module holds the average, the copy the training weights

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._average_model = EMAModel(pl_module, self.decay, self.warmup_steps)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # `module.to` keeps each tensor's strides, so a channels_last copy stays channels_last.
        if self._average_model is not None:
            self._average_model.to(pl_module.device)

    @override
    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx % self.every_n_steps == 0

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_epoch_start(trainer, pl_module)
        self._swapped = self._average_model is not None

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_epoch_end(trainer, pl_module)
        self._swapped = False

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._swapped and "current_model_state" in checkpoint:
            # saved inside a validation (a signal's or an exception's checkpoint): Lightning's WeightAveraging read
            # the averaged weights as the module's and the training weights as the average's
            checkpoint["state_dict"], checkpoint["current_model_state"] = \
                checkpoint["current_model_state"], checkpoint["state_dict"]


def weights_in_checkpoint(path: str | None) -> str | None:
    """``"ema"`` when the checkpoint's ``state_dict`` holds averaged weights (it has
    ``current_model_state``), ``"live"`` when it does not, ``None`` without a path."""
    if path is None:
        return None
    checkpoint = load_checkpoint_file(path, map_location="cpu", mmap=True)  # weights_only: nothing in it runs
    return "ema" if "current_model_state" in checkpoint else "live"
