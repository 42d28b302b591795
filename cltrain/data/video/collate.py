"""Collate (T, H, W, C) uint8 clips into one (N, T, H, W, C) buffer; hand out its (N, C, T, H, W) view.

The 5-D twin of ``cltrain.data.nhwc_collate``: the batch is
``torch.empty((N, T, H, W, C), uint8)`` filled clip by clip with plain copies
(clips are already THWC, nothing is transposed) and returned as
``buffer.permute(0, 4, 1, 2, 3)``: shape (N, C, T, H, W) with
``torch.channels_last_3d`` strides, for C == 1 and N == 1 as well. A clip is a
(T, H, W, C) or (T, H, W) array or tensor, or a sequence of T frames, each
checked by the image collate's own frame check (HWC uint8; numpy, PIL or torch).
The fields after the clip (target, and any more) are collated by
``torch.utils.data.default_collate``: int targets become int64, floats stay floats.

Example::

    >>> import numpy as np, torch
    >>> clips, targets = ndhwc_collate([(np.zeros((8, 32, 32, 3), np.uint8), 1), (np.ones((8, 32, 32, 3), np.uint8), 0)])
    >>> clips.shape, clips.is_contiguous(memory_format=torch.channels_last_3d), targets.dtype
    (torch.Size([2, 3, 8, 32, 32]), True, torch.int64)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate

from cltrain.data.collate import as_hwc

__all__ = ["NDHWCCollate", "ndhwc_collate"]

_NAME = "ndhwc_collate"


def _as_thwc(clip: Any, index: int) -> np.ndarray | torch.Tensor | list[np.ndarray | torch.Tensor]:
    """``clip`` as a (T, H, W, C) uint8 array/tensor, or a list of T equal HWC frames."""
    if isinstance(clip, (list, tuple)):
        if not clip:
            raise ValueError(f"{_NAME}: clip {index} has no frames.")
        try:
            frames = [as_hwc(frame, t) for t, frame in enumerate(clip)]  # the image collate's own checks
        except TypeError as err:
            raise TypeError(f"{_NAME}: clip {index}: {str(err).removeprefix('nhwc_collate: ')}") from None
        for t, frame in enumerate(frames):
            if tuple(frame.shape) != tuple(frames[0].shape):
                raise ValueError(f"{_NAME}: clip {index}: frame {t} has shape (H, W, C) = {tuple(frame.shape)} but frame 0 "
                                 f"has {tuple(frames[0].shape)}; the frames of a clip must be the same size.")
        return frames
    if isinstance(clip, Image.Image):
        raise TypeError(f"{_NAME}: clip {index} is a single PIL image; give T frames (a list) or a (T, H, W, C) array.")
    if not isinstance(clip, (np.ndarray, torch.Tensor)):
        raise TypeError(f"{_NAME}: clip {index} is a {type(clip).__name__}; expected a (T, H, W, C) uint8 numpy array "
                        "or torch tensor, or a list of HWC frames.")
    if clip.dtype != (torch.uint8 if isinstance(clip, torch.Tensor) else np.uint8):
        raise TypeError(f"{_NAME}: clip {index} has dtype {clip.dtype}; expected uint8 (T, H, W, C).")
    if isinstance(clip, torch.Tensor) and clip.dim() == 4 and clip.shape[0] in (1, 3) and clip.shape[-1] not in (1, 3, 4):
        raise TypeError(f"{_NAME}: clip {index} is a tensor of shape {tuple(clip.shape)}, which looks (C, T, H, W); "
                        "give (T, H, W, C) clips (the clip transforms of cltrain.data.video do).")
    if clip.ndim == 3:
        clip = clip[..., None]
    if clip.ndim != 4:
        raise TypeError(f"{_NAME}: clip {index} has shape {tuple(clip.shape)}; expected (T, H, W) or (T, H, W, C).")
    return clip


def _shape(clip: Any) -> tuple[int, ...]:
    return (len(clip), *clip[0].shape) if isinstance(clip, list) else tuple(clip.shape)


class NDHWCCollate:
    """``collate_fn`` for a DataLoader of ``(clip, target, ...)`` samples.

    Args:
        pin_memory: allocate the batch buffer in pinned memory. As for
            ``NHWCCollate``, with ``num_workers > 0`` use the
            DataLoader's ``pin_memory=True`` instead (it pins in the main process and
            keeps the strides).

    Returns (from a call):
        ``(clips, targets, ...)``: clips ``(N, C, T, H, W)`` uint8 with channels_last_3d
        strides (a view of an ``(N, T, H, W, C)`` buffer), the other fields as
        ``default_collate`` makes them (int targets: ``(N,)`` int64).

    Raises:
        ValueError: an empty batch, a clip without frames, or clips (or frames) of
            different shapes (the message names both shapes and their positions).
        TypeError: a clip that is not THWC uint8, or a sample without a target.
    """

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = bool(pin_memory)

    def __call__(self, batch: Sequence[Sequence[Any]]) -> tuple[torch.Tensor, ...]:
        if len(batch) == 0:
            raise ValueError(f"{_NAME}: the batch is empty.")
        for i, sample in enumerate(batch):
            if not isinstance(sample, (tuple, list)) or len(sample) < 2:
                raise TypeError(f"{_NAME}: sample {i} is a {type(sample).__name__}; expected (clip, target, ...).")
        clips = [_as_thwc(sample[0], i) for i, sample in enumerate(batch)]
        shape = _shape(clips[0])
        for i, clip in enumerate(clips):
            if _shape(clip) != shape:
                raise ValueError(f"{_NAME}: clip {i} has shape (T, H, W, C) = {_shape(clip)} but clip 0 has {shape}; "
                                 "all clips of a batch must be the same size (sample as many frames and crop them "
                                 "to one size in the clip transform).")
        buffer = torch.empty((len(clips), *shape), dtype=torch.uint8, pin_memory=self.pin_memory)
        view = buffer.numpy()
        for i, clip in enumerate(clips):
            for t, frame in enumerate(clip) if isinstance(clip, list) else ((None, clip),):
                dst, dst_np = (buffer[i], view[i]) if t is None else (buffer[i, t], view[i, t])
                if isinstance(frame, torch.Tensor):
                    dst.copy_(frame)
                else:
                    dst_np[...] = frame
        rest = default_collate([tuple(sample[1:]) for sample in batch])
        return (buffer.permute(0, 4, 1, 2, 3), *rest)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pin_memory={self.pin_memory})"


def ndhwc_collate(batch: Sequence[Sequence[Any]]) -> tuple[torch.Tensor, ...]:
    """``NDHWCCollate`` without pinning, as a function."""
    return NDHWCCollate()(batch)
