"""The first-batch layout check on a Lightning step, for ``ChannelsLast``: which step to run, on what copies, in
which precision; and the fallbacks on averaged copies of the model."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from cltrain.layout.batches import Inputs, first_image_tensor, restride_batch
from cltrain.check.compare import LayoutCheck, check_layout, projection_loss
from cltrain.layout.lightning_access import detached_copy, step_target
from cltrain.check.fallback import Fallback, apply_fallbacks
from cltrain.precision import autocast_dtype

__all__ = ["apply_to_copy", "check_lightning_step"]


def check_lightning_step(trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, stage: str, *,
                         inputs: Inputs = None, one_d: bool = False) -> LayoutCheck:
    """``cltrain.check.compare.check_layout`` on a Lightning step: ``stage``'s step method of copies of
    ``pl_module`` (``training_step``, ``validation_step``, ...) on copies of ``batch`` in each layout.

    A manual-optimization module, or a step that cannot run on a copy (it needs ``self.trainer``), is
    checked through the model's forward (and, in training, a backward) alone. Under mixed precision the
    check runs in float32 first and in the training precision only where float32 raises.
    """
    from lightning_utilities.core.apply_func import apply_to_collection

    precision = trainer.strategy.precision_plugin
    method = {"train": "training_step", "validation": "validation_step", "test": "test_step",
              "predict": "predict_step"}[stage]
    own_context = precision.train_step_context if stage == "train" else getattr(
        precision, f"{'val' if stage == 'validation' else stage}_step_context")
    grad = torch.enable_grad if stage == "train" else torch.no_grad
    # Mixed precision's rounding would hide a wrong op in noise (bf16 gradients through BatchNorm differ
    # by O(1) between any two kernels): check in float32 first, in the training precision if that raises.
    contexts = [contextlib.nullcontext, own_context] if autocast_dtype(trainer.precision) is not None \
        else [own_context]

    def batch_in(layout: str) -> Any:
        copied = apply_to_collection(batch, torch.Tensor, torch.Tensor.clone)
        restride_batch(copied, layout, one_d=one_d, inputs=inputs)
        return copied

    use_step = stage != "train" or pl_module.automatic_optimization
    # DDP has wrapped the model by now: its buckets keep the parameters' layout, so keep that layout.
    options = dict(step_owner=pl_module, copy_model=detached_copy, time_fallbacks=trainer.world_size == 1)
    result = None
    for context in contexts:

        def step_code(clone: nn.Module, layout: str, context: Any = context) -> Any:
            with grad(), context():
                return getattr(clone, method)(batch_in(layout), batch_idx)

        def model_only(clone: nn.Module, layout: str, context: Any = context) -> Any:
            x = first_image_tensor(batch_in(layout), inputs)
            with grad(), context():
                out = step_target(clone)(x)
            return projection_loss(out) if stage == "train" else out

        result = check_layout(pl_module, step_code if use_step else model_only, **options)
        if use_step and result.verdict == "not checked" and first_image_tensor(batch, inputs) is not None:
            # The step code needs the trainer (or raises anyway): check the model's forward and backward alone.
            alone = check_layout(pl_module, model_only, **options)
            if alone.verdict != "not checked":
                result = alone
        if result.verdict != "not checked":
            break
    return result


def apply_to_copy(copy_: nn.Module, fallbacks: list[Fallback]) -> None:
    """The fallbacks on an averaged copy, whose names may sit under ``module.`` (``AveragedModel``)."""
    names = {name for name, _ in copy_.named_modules()}
    wanted = [f for f in fallbacks if f.kind != "model"]
    for prefix in ("", "module."):
        if all(f"{prefix}{f.module}".rstrip(".") in names for f in wanted):
            apply_fallbacks(copy_, [Fallback(f.kind, f"{prefix}{f.module}".rstrip(".")) for f in wanted])
            return
