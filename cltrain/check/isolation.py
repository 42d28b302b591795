"""Every module run on the reference run's values: whether a difference is a module's own or one that rounding
carried to it.

A piecewise op (ReLU, max-pooling, a threshold) turns a rounding-sized forward difference into an O(1) gradient
difference wherever an input near a kink lands on the other side of it, anywhere upstream of the module compared.
``ReferenceOutputs`` keeps each module call's floating outputs in the reference (NCHW) run and hands them on, in
the later run's strides, in place of that call's own outputs (recorded first, so a module's own difference is
still seen); the gradient passes through unchanged. Every module and every line of code between modules then
computes from the reference's values: a kink lands on the same side in both layouts, while a layout fault (a
``view``, an op reading raw memory, a custom backward) still moves values where it is.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from cltrain.check.fallback import map_images

__all__ = ["ReferenceOutputs"]


class _Substitute(torch.autograd.Function):
    """``value`` in ``x``'s strides; the gradient reaches ``x`` unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return torch.empty_like(x).copy_(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ARG004
        return grad, None


def _floats(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_images(obj, lambda t: found.append(t) or t, ranks=None)
    return found


class ReferenceOutputs:
    """Each module call's floating outputs (by call key, ``"name#k"``) while ``recording``; after that, those
    values handed on in place of the same call's outputs. A call the reference did not make, or whose outputs
    differ in number, shape or container type, keeps its own."""

    def __init__(self) -> None:
        self.calls: dict[str, list[torch.Tensor]] = {}
        self.recording = True
        self._kept: dict[int, tuple[Any, int, torch.Tensor]] = {}  # a tensor kept once (a parent's output is a child's)

    def replay(self) -> None:
        """Recording ends: from now on each call gets the reference's values."""
        self.recording = False
        self._kept.clear()

    def keep(self, call: str, output: Any) -> None:
        """Record ``call``'s outputs (detached copies)."""
        values = []
        for t in _floats(output):
            if t.is_inference():  # no version counter says whether an in-place op (ReLU(inplace)) changed it
                values.append(t.detach().clone())
                continue
            hit = self._kept.get(id(t))
            if hit is None or hit[0]() is not t or hit[1] != t._version:
                hit = (weakref.ref(t), t._version, t.detach().clone())
                self._kept[id(t)] = hit
            values.append(hit[2])
        self.calls[call] = values

    def pass_on(self, call: str, output: Any) -> Any:
        """``output`` with the reference's values of ``call`` (in each tensor's own strides), or ``output`` itself."""
        if self.recording:
            self.keep(call, output)
            return output
        theirs = self.calls.get(call)
        mine = _floats(output)
        if theirs is None or not mine or len(mine) != len(theirs) \
                or any(a.shape != b.shape for a, b in zip(mine, theirs)):
            return output
        values = iter(theirs)

        def swap(t: torch.Tensor) -> torch.Tensor:
            value = next(values).to(t.dtype)
            return _Substitute.apply(t, value) if t.requires_grad else torch.empty_like(t).copy_(value)

        try:
            swapped = map_images(output, swap, ranks=None)
        except Exception:  # noqa: BLE001 - a container that cannot be rebuilt keeps its values
            return output
        return swapped if type(swapped) is type(output) else output
