"""Which of a batch's converted inputs reach a convolution in the layout they were converted to.

``ConvReach(tensors)`` is a ``TorchFunctionMode`` held around one forward: each tensor computed from one of
``tensors`` (by views, reshapes, elementwise ops, indexing, ...) is traced back to it until a convolution takes
it as input. ``reached`` holds the keys of the tensors that arrived at some convolution in their rank's
channels-last format; ``convolutions`` counts the convolutions seen. A (B, T, C, H, W) stack converted to
channels_last_3d that the model flattens to (B*T, C, H, W) arrives contiguous: converting it helped nothing.

Example::

    >>> import torch
    >>> conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    >>> stack = torch.randn(2, 5, 3, 8, 8).to(memory_format=torch.channels_last_3d)
    >>> image = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    >>> with ConvReach({"stack": stack, "image": image}) as reach:
    ...     _ = conv(stack.flatten(0, 1)), conv(image * 2)
    >>> sorted(reach.reached), reach.convolutions
    (['image'], 2)
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from cltrain.layout.function_mode import UserFrameMode
from cltrain.layout.tensors import is_channels_last, is_channels_last_1d

__all__ = ["CONV_FUNCTIONS", "ConvReach"]

#: The functions a convolution layer calls: their first argument is the input.
CONV_FUNCTIONS = frozenset({
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, torch.convolution,
})


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)


def _in_its_format(x: torch.Tensor) -> bool:
    return is_channels_last_1d(x) if x.dim() == 3 else is_channels_last(x)


class ConvReach(UserFrameMode):
    """Trace ``tensors`` (key -> tensor) to the convolutions that take them; see the module docstring.

    Attributes:
        reached: the keys whose tensor (or one computed from it) a convolution took in channels-last format.
        reached_otherwise: the keys that reached a convolution only out of that format (a strided slice of it, a
            permute).
        convolutions: how many convolution calls were seen.
    """

    def __init__(self, tensors: Mapping[Hashable, torch.Tensor]) -> None:
        super().__init__()
        self.reached: set[Hashable] = set()
        self.reached_otherwise: set[Hashable] = set()
        self.convolutions = 0
        self._from: dict[int, tuple[weakref.ref, frozenset]] = {}
        for key, t in tensors.items():
            self._mark(t, frozenset({key}))

    def _mark(self, t: torch.Tensor, keys: frozenset) -> None:
        old = self._origin(t)
        self._from[id(t)] = (weakref.ref(t), keys | old)

    def _origin(self, t: torch.Tensor) -> frozenset:
        entry = self._from.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else frozenset()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in CONV_FUNCTIONS:
            self.convolutions += 1
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, torch.Tensor):
                if _in_its_format(x):
                    self.reached |= self._origin(x)
                else:
                    self.reached_otherwise |= self._origin(x)
            return func(*args, **kwargs)  # a convolution's output has the convolution's layout, not the input's
        result = func(*args, **kwargs)
        keys = frozenset().union(*(self._origin(t) for t in _tensors((args, kwargs))))
        if keys:
            for t in _tensors(result):
                self._mark(t, keys)
        return result
