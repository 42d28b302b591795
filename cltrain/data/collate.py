"""Collate HWC uint8 images straight into one NHWC buffer; hand out its NCHW view.

The batch is ``torch.empty((N, H, W, C), uint8)`` filled image by image with a
plain copy (each image is already HWC, so nothing is transposed), and returned
as ``buffer.permute(0, 3, 1, 2)``: shape (N, C, H, W) with channels_last
strides, for C == 1 and N == 1 as well (``permute`` of a dense NHWC buffer gives
the canonical strides). Tensors coming back from DataLoader worker processes
keep their strides, and so does ``pin_memory``.

Example::

    >>> import numpy as np, torch
    >>> images, targets = nhwc_collate([(np.zeros((32, 32, 3), np.uint8), 1), (np.ones((32, 32, 3), np.uint8), 0)])
    >>> images.shape, images.is_contiguous(memory_format=torch.channels_last), targets.dtype
    (torch.Size([2, 3, 32, 32]), True, torch.int64)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["NHWCCollate", "nhwc_collate"]


def _as_hwc(image: Any, index: int) -> np.ndarray | torch.Tensor:
    if isinstance(image, Image.Image):
        image = np.asarray(image)
    if isinstance(image, np.ndarray):
        arr = image
    elif isinstance(image, torch.Tensor):
        arr = image
        if arr.dim() == 3 and arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3, 4):
            raise TypeError(f"nhwc_collate: image {index} is a tensor of shape {tuple(arr.shape)}, which looks CHW; "
                            "give HWC images (the transforms of cltrain.data do).")
    else:
        raise TypeError(f"nhwc_collate: image {index} is a {type(image).__name__}; expected a numpy array, "
                        "a PIL image or a torch tensor (HWC uint8).")
    if arr.dtype != (torch.uint8 if isinstance(arr, torch.Tensor) else np.uint8):
        raise TypeError(f"nhwc_collate: image {index} has dtype {arr.dtype}; expected uint8 (HWC).")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3:
        raise TypeError(f"nhwc_collate: image {index} has shape {tuple(arr.shape)}; expected (H, W) or (H, W, C).")
    return arr


class NHWCCollate:
    """``collate_fn`` for a DataLoader of ``(image, target)`` samples.

    Args:
        pin_memory: allocate the batch buffer in pinned memory (for CUDA copies with
            ``non_blocking=True``). Pinning is per process: with ``num_workers > 0`` use
            the DataLoader's own ``pin_memory=True`` instead, which pins in the main
            process and keeps the strides.

    Returns (from a call):
        ``(images, targets)``: images ``(N, C, H, W)`` uint8 with channels_last strides
        (a view of an ``(N, H, W, C)`` buffer), targets ``(N,)`` int64.

    Raises:
        ValueError: an empty batch, or images of different shapes (the message names
            both shapes and their positions).
        TypeError: an image that is not HWC uint8 (numpy array, PIL image or tensor).
    """

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = bool(pin_memory)

    def __call__(self, batch: Sequence[Sequence[Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(batch) == 0:
            raise ValueError("nhwc_collate: the batch is empty.")
        images = [_as_hwc(sample[0], i) for i, sample in enumerate(batch)]
        shape = tuple(images[0].shape)
        for i, img in enumerate(images):
            if tuple(img.shape) != shape:
                raise ValueError(f"nhwc_collate: image {i} has shape (H, W, C) = {tuple(img.shape)} but image 0 has {shape}; "
                                 "all images of a batch must be the same size (resize or crop them in the transform).")
        buffer = torch.empty((len(images), *shape), dtype=torch.uint8, pin_memory=self.pin_memory)
        view = buffer.numpy()
        for i, img in enumerate(images):
            if isinstance(img, torch.Tensor):
                buffer[i].copy_(img)
            else:
                view[i] = img
        targets = torch.as_tensor([int(sample[1]) for sample in batch], dtype=torch.int64)
        return buffer.permute(0, 3, 1, 2), targets

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pin_memory={self.pin_memory})"


def nhwc_collate(batch: Sequence[Sequence[Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`NHWCCollate` without pinning, as a function."""
    return NHWCCollate()(batch)
