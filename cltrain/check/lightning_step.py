"""The first-batch layout check on a Lightning step, for ``ChannelsLast``: which step to run, on what copies, in
which precision; and the fallbacks on averaged copies of the model."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from cltrain.check.compare import LayoutCheck, check_layout, projection_loss
from cltrain.check.copies import copy_optimizer, copy_schedulers, elementwise
from cltrain.check.fallback import Fallback, apply_fallbacks
from cltrain.layout.batches import Inputs, first_image_tensor, restride_batch
from cltrain.layout.lightning_access import detached_copy, overrides, step_target
from cltrain.precision import autocast_dtype

__all__ = ["apply_to_copy", "check_lightning_step"]


def check_lightning_step(trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, stage: str, *,
                         inputs: Inputs = None, one_d: bool = False) -> LayoutCheck:
    """``cltrain.check.compare.check_layout`` on a Lightning step: ``stage``'s step method of copies of
    ``pl_module`` (``training_step``, ``validation_step``, ...) on copies of ``batch`` in each layout.

    In training the whole step runs as the Trainer runs it: the step, the backward, ``on_after_backward``,
    ``on_before_optimizer_step``, ``configure_gradient_clipping`` and the optimizer's step, on copies of the
    optimizers and their state (a manual-optimization step gets the copies from ``self.optimizers()``).
    The copies read the trainer's values through a ``ReadOnlyTrainer``. A step that cannot run on a copy is
    checked through the model's forward alone only where the step gives the model the batch's image tensor
    itself; otherwise it is not checked, and the line says why. Under mixed precision the check runs in
    float32 first and in the training precision only where float32 raises.
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
    train = stage == "train"
    manual = train and not pl_module.automatic_optimization
    optimizers = list(trainer.optimizers) if train else []
    # torch's elementwise optimizers give the same update in any layout: with no code of the user's between the
    # backward and the step, that step is not re-run on the copies.
    hooks = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
    after_code = any(overrides(m, pl_module) for m in hooks) or bool(trainer.gradient_clip_val)
    update = train and (manual or after_code or not elementwise(optimizers))
    uncopied: dict[str, str] = {}

    def batch_in(layout: str, clone: nn.Module) -> Any:
        copied = apply_to_collection(batch, torch.Tensor, torch.Tensor.clone)
        restride_batch(copied, layout, one_d=one_d, inputs=inputs, model=clone)
        return copied

    def copy_model(module: nn.Module) -> nn.Module:
        memo: dict[int, Any] = {}
        copies: list[torch.optim.Optimizer] = []
        schedulers: list[Any] = []
        clone = detached_copy(module, trainer, memo=memo, optimizers=copies if train else None,
                              schedulers=schedulers)
        for optimizer in optimizers:  # what self.optimizers() gives the copy (a fresh run's state is empty)
            try:
                copies.append(copy_optimizer(optimizer, memo))
                memo[id(optimizer)] = copies[-1]
            except TypeError as error:
                uncopied.setdefault(type(optimizer).__name__, str(error))
        if train:
            schedulers += copy_schedulers(trainer.lr_scheduler_configs, memo)
        return clone

    def after_backward(clone: LightningModule) -> None:
        clone.on_after_backward()
        for optimizer in clone.trainer.optimizers:
            clone.on_before_optimizer_step(optimizer)
            clone.configure_gradient_clipping(optimizer, gradient_clip_val=trainer.gradient_clip_val,
                                              gradient_clip_algorithm=trainer.gradient_clip_algorithm)
            optimizer.step()

    # DDP has wrapped the model by now: its buckets keep the parameters' layout, so keep that layout.
    options = dict(step_owner=pl_module, copy_model=copy_model, time_fallbacks=trainer.world_size == 1,
                   after_backward=after_backward if update and not manual else None, updates=update,
                   update_owner=optimizers[0] if optimizers else None)
    fed: dict[str, bool | None] = {}
    result = None
    for context in contexts:

        def step_code(clone: nn.Module, layout: str, context: Any = context) -> Any:
            copied = batch_in(layout, clone)
            image = first_image_tensor(copied, inputs)

            def note_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                fed.setdefault("batch", image is not None and bool(args) and args[0] is image)

            handle = step_target(clone).register_forward_pre_hook(note_input, with_kwargs=True)
            try:
                with grad(), context():
                    result = getattr(clone, method)(copied, batch_idx)
            finally:
                handle.remove()
            return None if manual else result  # a manual step has run its own backward

        def model_only(clone: nn.Module, layout: str, context: Any = context) -> Any:
            x = first_image_tensor(batch_in(layout, clone), inputs)
            with grad(), context():
                out = step_target(clone)(x)
            return projection_loss(out) if train else out

        fed.clear()
        result = check_layout(pl_module, step_code, **options)
        if result.verdict == "not checked":
            if fed.get("batch"):  # the step gives the model the batch's image: check the model alone
                alone = check_layout(pl_module, model_only, step_owner=pl_module, copy_model=copy_model,
                                     time_fallbacks=trainer.world_size == 1)
                if alone.verdict != "not checked":
                    result = alone
            else:
                why = "it raised before calling the model" if "batch" not in fed else \
                    "the step does not give the model the batch's image tensor itself"
                result = LayoutCheck("not checked", reason=f"{result.reason}; the model alone was not checked "
                                     f"either ({why})", seconds=result.seconds)
        if result.verdict != "not checked":
            break
    notes = [f"the optimizer step of {name} was not checked ({why})" for name, why in uncopied.items()]
    return dataclasses.replace(result, notes=tuple(notes)) if notes else result


def apply_to_copy(copy_: nn.Module, fallbacks: list[Fallback]) -> None:
    """The fallbacks on an averaged copy, whose names may sit under ``module.`` (``AveragedModel``)."""
    names = {name for name, _ in copy_.named_modules()}
    wanted = [f for f in fallbacks if f.kind != "model"]
    for prefix in ("", "module."):
        if all(f"{prefix}{f.module}".rstrip(".") in names for f in wanted):
            apply_fallbacks(copy_, [Fallback(f.kind, f"{prefix}{f.module}".rstrip(".")) for f in wanted])
            return
