"""The first-batch layout check on a plain step, for Fabric and plain loops and the Hugging Face hook: the model (and,
when given, the loop's forward-and-loss code and its optimizer) run in both layouts on copies.

``check_lightning_step`` is the same check on a Lightning step (``cltrain.check.lightning_step``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cltrain.check.budget import check_within_budget
from cltrain.check.compare import LayoutCheck, check_layout, projection_loss
from cltrain.check.copies import (copy_optimizer, eager_copy, elementwise, float32_tensors, half_dtype, in_float32,
                                  shared_note)
from cltrain.check.record import loss_of
from cltrain.check.result import MODEL_ALONE, STEP_RAISED
from cltrain.check.signature import floats
from cltrain.layout.batches import Inputs, first_image_tensor, map_tensors, restride_batch
from cltrain.precision import autocast_for

__all__ = ["check_plain_step"]


def check_plain_step(model: nn.Module, batch: Any, step: Callable[[nn.Module, Any], Any] | None = None, *,
                     inputs: Inputs = None, autocast_dtype: torch.dtype | None = None,
                     optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
                     samples: int | None = 4, convert_inputs: bool = True) -> LayoutCheck:
    """One step on ``batch`` in both layouts on copies of ``model``, its verdict not applied (the arguments are
    ``cltrain.loops.verify_layout``'s; ``optimizer`` may be the loop's several, each stepped in turn;
    ``convert_inputs=False``: both copies get the batch as it is, as the run leaves it)."""
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))

    def run_in(part: Any, dtype: torch.dtype | None, alone: bool = False, upcast: bool = False,
               ) -> Callable[[nn.Module, str], Any]:
        def run(clone: nn.Module, layout: str) -> Any:
            copied = map_tensors(part, lambda t: (float32_tensors(t) if upcast else t).clone())
            if convert_inputs:
                restride_batch(copied, layout, inputs=inputs, model=clone)
            with autocast_for(device, dtype):
                if step is not None and not alone:  # a step giving no loss (logits, a detector's losses): their
                    result = step(clone, copied)  # projection's backward is checked too
                    done = loss_of(result) is not None or not torch.is_grad_enabled() or not floats(result)
                    return result if done else projection_loss(result)
                return projection_loss(clone(first_image_tensor(copied, inputs)))

        return run

    optimizers: weakref.WeakKeyDictionary[nn.Module, list[torch.optim.Optimizer]] = weakref.WeakKeyDictionary()

    # torch's elementwise optimizers give the same update in any layout: their step is not re-run.
    given = optimizer if isinstance(optimizer, list) else [optimizer] if optimizer is not None else []
    stepped = [o for o in given if not elementwise([o])]

    def copy_model(original: nn.Module, upcast: bool = False) -> nn.Module:
        memo: dict[int, Any] = {}
        clone = eager_copy(original, memo)
        if stepped:
            optimizers[clone] = [copy_optimizer(o, memo) for o in stepped]
        return in_float32(clone, optimizers.get(clone, [])) if upcast else clone

    def after_backward(clone: nn.Module) -> None:
        for copied in optimizers[clone]:
            copied.step()

    options: dict[str, Any] = {"copy_model": copy_model}
    if stepped:
        options["after_backward"] = after_backward

    def check(part: Any) -> LayoutCheck:
        # float32 first: mixed precision's rounding, or 16-bit weights', would hide a wrong op in noise.
        result = None
        if half_dtype(model):
            result = check_layout(model, run_in(part, None, upcast=True),
                                  **{**options, "copy_model": lambda m: copy_model(m, upcast=True)})
        if result is None or result.verdict == "not checked":
            result = check_layout(model, run_in(part, None), **options)
        if result.verdict == "not checked" and autocast_dtype is not None:
            result = check_layout(model, run_in(part, autocast_dtype), **options)
        if result.step_raised is None or step is None or first_image_tensor(part, inputs) is None:
            return result
        # the step cannot run on the copies (a collective, under several ranks): the model alone, on the batch's images
        alone = check_layout(model, run_in(part, None, alone=True), copy_model=copy_model)
        if alone.verdict == "not checked":
            return dataclasses.replace(result, reason=f"{result.reason}; the model alone: {alone.reason}")
        return dataclasses.replace(alone, notes=(f"{MODEL_ALONE}, on the batch's image tensor: {STEP_RAISED} "
                                                 f"({result.step_raised})", *alone.notes), step_raised=result.step_raised)

    result = check_within_budget(check, batch, samples, inputs=inputs)
    note = shared_note(model)
    return dataclasses.replace(result, notes=(*result.notes, note)) if note is not None else result
