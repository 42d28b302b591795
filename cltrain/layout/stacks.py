"""Five-dimensional inputs in the layout the model reads them in: a video clip or a stack of images.

A 5-D input is either a clip, ``(N, C, T, H, W)``, which a ``Conv3d`` reads (torchvision's and PyTorchVideo's video
models): its channels-last format is ``channels_last_3d``, C innermost; or a stack of images, ``(B, T, C, H, W)``
(Hugging Face's video and multi-image models: VideoMAE, TimeSformer, SmolVLM, LLaVA-OneVision), which the model
reshapes to ``(B*T, C, H, W)`` or permutes to ``(B, C, T, H, W)``: its channels-last format keeps each frame NHWC,
C innermost, strides ``(T*H*W*C, H*W*C, 1, W*C, C)``. Then the reshape is a view that is ``channels_last`` and the
permute gives a ``channels_last_3d`` clip, with no copy; ``channels_last_3d`` on a stack would put T innermost.

``channel_dim(x, model)`` tells the two apart: the dimension (1 or 2) whose size is the input channels of the
model's first convolution; where both match (as many frames as channels), 2 if that convolution is 2-D (it reads
frames); by the size alone (1-4 channels) without a model or where neither matches; 1 where nothing tells. ``to_input_layout(x, model)`` and ``in_input_layout(x, model)`` apply that to any tensor:
4-D ``channels_last``, 5-D by ``channel_dim``, other ranks unchanged.

Example::

    >>> import torch
    >>> stack = torch.randn(2, 8, 3, 16, 16)                     # (B, T, C, H, W)
    >>> frames = to_input_layout(stack)
    >>> frames.stride(), frames.reshape(16, 3, 16, 16).is_contiguous(memory_format=torch.channels_last)
    ((6144, 768, 1, 48, 3), True)
    >>> to_input_layout(torch.randn(2, 3, 8, 16, 16)).is_contiguous(memory_format=torch.channels_last_3d)
    True
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from cltrain.layout.tensors import CONV_TYPES, is_channels_last, to_channels_last

__all__ = ["channel_dim", "in_input_layout", "is_frames_last", "to_frames_last", "to_input_layout"]

_FEW_CHANNELS = (1, 2, 3, 4)  # image channels: gray, gray + alpha, RGB, RGBA
_first_conv: weakref.WeakKeyDictionary[nn.Module, tuple[int, bool] | None] = weakref.WeakKeyDictionary()


def _first_conv_of(model: nn.Module) -> tuple[int, bool] | None:
    """The input channels of the model's first convolution, and whether it is 2-D."""
    if model not in _first_conv:
        conv = next((m for m in model.modules() if isinstance(m, CONV_TYPES)), None)
        _first_conv[model] = None if conv is None else (int(conv.in_channels), conv.weight.dim() == 4)
    return _first_conv[model]


def channel_dim(x: torch.Tensor, model: nn.Module | None = None) -> int:
    """Where a 5-D input's channels are: 1 for a clip ``(N, C, T, H, W)``, 2 for a stack ``(B, T, C, H, W)``."""
    sizes = int(x.shape[1]), int(x.shape[2])
    first = _first_conv_of(model) if model is not None else None
    for known in ((first[0],) if first is not None else ()) + (_FEW_CHANNELS,):
        match = [s in known if isinstance(known, tuple) else s == known for s in sizes]
        if match == [True, False]:
            return 1
        if match == [False, True] or (match == [True, True] and first is not None and known == first[0] and first[1]):
            return 2
    return 1


def to_frames_last(x: torch.Tensor) -> torch.Tensor:
    """A ``(B, T, C, H, W)`` stack with each frame channels_last (C innermost); the tensor itself if it is."""
    if is_frames_last(x):
        return x
    return x.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)


def is_frames_last(x: torch.Tensor) -> bool:
    """Whether a 5-D stack has each frame channels_last: its strides, size-1 dims aside, are C innermost."""
    if x.dim() != 5:
        return False
    expected = x.permute(0, 1, 3, 4, 2)
    return expected.is_contiguous()


def to_input_layout(x: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
    """``x`` in the channels-last format the model reads it in (see the module docstring)."""
    if x.dim() == 5 and channel_dim(x, model) == 2:
        return to_frames_last(x)
    return to_channels_last(x)


def in_input_layout(x: torch.Tensor, model: nn.Module | None = None) -> bool:
    """Whether ``x`` already is in the format ``to_input_layout`` gives."""
    if x.dim() == 5 and channel_dim(x, model) == 2:
        return is_frames_last(x)
    return is_channels_last(x)
