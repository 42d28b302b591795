"""The code after the backward starts from the same gradient values in every run of the check.

The reference run keeps each parameter's gradient as its backward leaves it; the other runs record their own and
then take those values, in their own strides. An update rule that turns a near-zero gradient into a full step
(Adam's first step is about ``lr * sign(g)``) then cannot amplify the backward's rounding, while code that reads a
gradient's memory as NCHW still moves values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from cltrain.check.events import Event

__all__ = ["GradientTape"]


class Records(Protocol):
    """What keeps a run's values (``cltrain.check.record.Recorder``)."""

    def record(self, key: Event, obj: Any, context: tuple[str | None, str | None]) -> None: ...


class GradientTape:
    """Each parameter's gradient after each backward of the reference run (``recording``), given to the
    same parameter at the same point of every later run; with ``keep=False`` (no update is compared, so nothing
    after the backward counts) the hooks only record each gradient where it is accumulated."""

    def __init__(self, keep: bool = True) -> None:
        self.grads: dict[tuple[str, int], torch.Tensor] = {}
        self.recording = True
        self.keep = keep

    def hooks(self, model: nn.Module, recorder: Records) -> list[Any]:
        """Post-accumulate-grad hooks on ``model``'s parameters: record the gradient, then keep or take the tape's."""
        fires: dict[str, int] = {}

        def hook_for(name: str) -> Callable[[torch.Tensor], None]:
            def hook(param: torch.Tensor) -> None:
                k = fires[name] = fires.get(name, -1) + 1
                key = Event("param", name)
                recorder.record(key, param.grad, (key.module, None))
                if param.grad is None or not self.keep:
                    return
                if self.recording:
                    self.grads[(name, k)] = param.grad.detach().clone()
                    return
                ref = self.grads.get((name, k))
                if ref is not None and ref.shape == param.grad.shape:
                    with torch.no_grad():
                        param.grad.copy_(ref)  # the reference's values in this run's strides

            return hook

        return [p.register_post_accumulate_grad_hook(hook_for(n)) for n, p in model.named_parameters()
                if p.requires_grad]
