"""One module's backward given the reference run's inputs: whether a gradient difference at a module is its own
or comes from differences its inputs already had.

A piecewise op (ReLU, max-pooling, a threshold) turns an agreeing forward difference into an O(1) gradient
difference wherever an input near a kink lands on the other side of it. Run again with the module's inputs
replaced by the reference run's values (in the channels_last run's strides, the gradient passed through as it
is), a module whose backward is right in channels_last gives the reference's gradients; a layout fault in it does
not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cltrain.check.fallback import map_images
from cltrain.check.record import floats


class _Substitute(torch.autograd.Function):
    """``value`` in ``x``'s strides; the gradient reaches ``x`` unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return torch.empty_like(x).copy_(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ARG004
        return grad, None


def capture_inputs(model: nn.Module, name: str) -> tuple[list[Any], Any]:
    """Hooks on ``model``'s module ``name`` that keep a detached copy of its inputs at every call: the list they
    fill and the handle to remove."""
    calls: list[Any] = []

    def keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append(map_images((args, kwargs), lambda t: t.detach().clone(), ranks=None))

    return calls, model.get_submodule(name).register_forward_pre_hook(keep, with_kwargs=True, prepend=True)


def substitute_inputs(model: nn.Module, name: str, calls: list[Any]) -> Any:
    """A hook on ``model``'s module ``name`` giving each call the inputs of ``calls`` (``capture_inputs``) in its
    own inputs' strides; the handle to remove. A call without a captured match keeps its inputs."""
    count = [0]

    def give(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        k = count[0]
        count[0] += 1
        if k >= len(calls):
            return None
        theirs, mine = floats(calls[k]), floats((args, kwargs))
        if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
            return None
        values = iter(theirs)

        def swap(t: torch.Tensor) -> torch.Tensor:
            value = next(values).to(t.dtype)
            return _Substitute.apply(t, value) if t.requires_grad else torch.empty_like(t).copy_(value)

        return map_images((args, kwargs), swap, ranks=None)

    return model.get_submodule(name).register_forward_pre_hook(give, with_kwargs=True, prepend=True)

