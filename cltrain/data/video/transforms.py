"""Clip transforms: T frames sampled from a clip, one crop box and one flip for all of them, (T, H, W, C) uint8 out.

A clip transform is an image transform of ``cltrain.data.transforms`` whose
random parameters are drawn once per clip: ``ClipTransform.make_params``
picks the frame indices (``TemporalSample``) and one ``CropParams``
from the first frame's size, and ``ClipTransform.apply`` runs the image
transform's own ``apply`` with those parameters on every frame. So every frame
of a clip gets the same box and flip (a moving object is not made to jump), and
the pixel work is the image path's: JPEG files through libjpeg-turbo and torch's
antialiased resize, anything else (and decoded video frames) through Pillow.

Randomness comes from the torch RNG (``torch.randint``), which ``seed_everything``
and DataLoader worker seeding manage; the spatial box comes from the image
transform's ``make_params``.

Example::

    >>> t = train_clip_transform(num_frames=8, stride=2, size=112)
    >>> clip = t(frame_paths)            # a list of the clip's frame files, in order   # doctest: +SKIP
    >>> clip.shape                                                                       # doctest: +SKIP
    (8, 112, 112, 3)
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from cltrain.data.constants import CROP_RATIO, CROP_SCALE
from cltrain.data.crop_kernels import jpeg_size
from cltrain.data.transforms import CropParams, RandomResizedCropFlip, ResizeCenterCrop, _Transform

__all__ = ["ClipParams", "ClipTransform", "FrameError", "TEMPORAL_MODES", "TemporalSample", "eval_clip_transform", "train_clip_transform"]

#: ``random``: a segment at a random start; ``center``: the middle segment; ``uniform``: T frames spread over the clip.
TEMPORAL_MODES: tuple[str, ...] = ("random", "center", "uniform")

#: A frame: a PIL image, an HWC uint8 array (a decoded video frame), a path, or the bytes of an image file.
FrameSource = Image.Image | np.ndarray | str | os.PathLike | bytes


class TemporalSample:
    """Which ``num_frames`` frames of a clip of ``length`` frames to use.

    Args:
        num_frames: frames per sample (T).
        stride: frame step within a segment (``random`` / ``center``); a segment spans
            ``(num_frames - 1) * stride + 1`` frames.
        mode: one of ``TEMPORAL_MODES``. A clip shorter than the segment repeats
            its last frame (as PyTorchVideo's samplers pad).
        generator: a ``torch.Generator`` for ``random``; ``None``: the global torch RNG.

    Raises:
        ValueError: a bad argument (the value is named).
    """

    def __init__(self, num_frames: int, stride: int = 1, mode: str = "random", generator: torch.Generator | None = None) -> None:
        if not (isinstance(num_frames, int) and num_frames >= 1):
            raise ValueError(f"TemporalSample: num_frames={num_frames!r} must be an int >= 1.")
        if not (isinstance(stride, int) and stride >= 1):
            raise ValueError(f"TemporalSample: stride={stride!r} must be an int >= 1.")
        if mode not in TEMPORAL_MODES:
            raise ValueError(f"TemporalSample: mode={mode!r} must be one of {TEMPORAL_MODES}.")
        if mode == "uniform" and stride != 1:
            raise ValueError(f"TemporalSample: stride={stride} has no meaning with mode='uniform' (frames spread over the clip); use 1.")
        self.num_frames, self.stride, self.mode, self.generator = num_frames, stride, mode, generator

    @property
    def span(self) -> int:
        """Frames a segment covers."""
        return (self.num_frames - 1) * self.stride + 1

    def __call__(self, length: int) -> list[int]:
        """The frame indices (ascending, each in ``[0, length)``)."""
        if length < 1:
            raise ValueError("TemporalSample: a clip with no frames.")
        if self.mode == "uniform":  # the centres of T equal segments (TSN's test-time sampling)
            return [min(int((i + 0.5) * length / self.num_frames), length - 1) for i in range(self.num_frames)]
        room = max(length - self.span, 0)
        if self.mode == "center":
            start = room // 2
        else:
            start = int(torch.randint(0, room + 1, (1,), generator=self.generator)) if room else 0
        return [min(start + i * self.stride, length - 1) for i in range(self.num_frames)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_frames={self.num_frames}, stride={self.stride}, mode={self.mode!r})"


@dataclass(frozen=True)
class ClipParams:
    """One call of a clip transform: the frame ``indices`` and the ``crop`` every frame gets."""

    indices: tuple[int, ...]
    crop: CropParams


class FrameError(ValueError):
    """A frame of a clip that cannot be read (the decoder's error is its cause); ``frame``: its source (a frame
    file's path, for a folder of frames)."""

    def __init__(self, message: str, frame: FrameSource | None = None) -> None:
        super().__init__(message)
        self.frame = frame


def _read(index: int, frame: FrameSource, read: Callable[[FrameSource], Any]) -> Any:
    """``read(frame)``; its failure raised as ``FrameError`` naming frame ``index`` (and its file): a decoder's
    message may not name the file it read."""
    try:
        return read(frame)
    except ImportError:
        raise
    except Exception as err:
        name = f" ({os.path.basename(frame)})" if isinstance(frame, (str, os.PathLike)) else ""
        raise FrameError(f"frame {index}{name} cannot be read: {type(err).__name__}: {err}", frame) from err


def _frame_size(frame: FrameSource) -> tuple[int, int]:
    """(width, height) of a frame, from the JPEG header or Pillow's lazy open (no decoding)."""
    if isinstance(frame, np.ndarray):
        return frame.shape[1], frame.shape[0]
    if isinstance(frame, Image.Image):
        return frame.size
    data = frame if isinstance(frame, (bytes, bytearray)) else None
    if data is None:
        with open(frame, "rb") as f:
            data = f.read(1 << 16)  # the header is at the start
        size = jpeg_size(data)
        if size is None:
            with Image.open(frame) as img:
                return img.size
        return size
    size = jpeg_size(bytes(data))
    if size is None:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    return size


class ClipTransform:
    """Frames of a clip -> (T, H, W, C) uint8: ``TemporalSample`` then one image transform with shared parameters.

    Args:
        frame_transform: a ``RandomResizedCropFlip`` (training) or
            ``ResizeCenterCrop`` (evaluation), or any transform with
            ``make_params(width, height)`` and ``apply(frame, params)``.
        temporal: which frames to take.
    """

    #: Datasets hand this transform frame paths (it reads and decodes them itself).
    takes_paths = True

    def __init__(self, frame_transform: _Transform, temporal: TemporalSample) -> None:
        self.frame_transform, self.temporal = frame_transform, temporal

    @property
    def num_frames(self) -> int:
        return self.temporal.num_frames

    @property
    def size(self) -> tuple[int, int]:
        return self.frame_transform.size

    @property
    def channels(self) -> int:
        return self.frame_transform.channels

    def make_params(self, length: int, width: int, height: int) -> ClipParams:
        """Draw the frame indices and the crop (from the frame size) of one clip."""
        return ClipParams(tuple(self.temporal(length)), self.frame_transform.make_params(width, height))

    def apply(self, frames: Sequence[FrameSource], params: ClipParams) -> np.ndarray:
        """The pixel work for ``params`` on ``frames`` (all of the clip's frames, in order)."""
        out = np.empty((len(params.indices), *self.size, self.channels), np.uint8)
        for t, index in enumerate(params.indices):
            frame = frames[index]
            if isinstance(frame, np.ndarray):  # a decoded video frame: Pillow's path, no copy
                frame = Image.fromarray(frame)
            out[t] = _read(index, frame, lambda f: self.frame_transform.apply(f, params.crop))
        return out

    def __call__(self, frames: Sequence[FrameSource]) -> np.ndarray:
        """Sample, crop and resize a clip given as its frames (paths, bytes, PIL images or HWC arrays).

        Raises:
            ValueError: no frames, or sampled frames of different sizes (the box would not fit them all).
            FrameError: a sampled frame that cannot be read, named.
        """
        if len(frames) == 0:
            raise ValueError("ClipTransform: a clip with no frames.")
        indices = self.temporal(len(frames))
        sizes = {index: _read(index, frames[index], _frame_size) for index in dict.fromkeys(indices)}
        first = sizes[indices[0]]
        for index, size in sizes.items():
            if size != first:
                raise ValueError(f"ClipTransform: frame {index} is {size[0]}x{size[1]} but frame {indices[0]} is "
                                 f"{first[0]}x{first[1]}; the frames of a clip must be the same size.")
        return self.apply(frames, ClipParams(tuple(indices), self.frame_transform.make_params(*first)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.frame_transform!r}, {self.temporal!r})"


def train_clip_transform(num_frames: int = 16, stride: int = 1, size: int | tuple[int, int] = 112,
                         scale: tuple[float, float] = CROP_SCALE, ratio: tuple[float, float] = CROP_RATIO,
                         hflip: float = 0.5, channels: int = 3) -> ClipTransform:
    """Training: a random segment of ``num_frames`` frames every ``stride``, one random-resized-crop + flip for the clip."""
    return ClipTransform(RandomResizedCropFlip(size, scale, ratio, hflip, channels), TemporalSample(num_frames, stride, "random"))


def eval_clip_transform(num_frames: int = 16, stride: int = 1, size: int | tuple[int, int] = 112,
                        resize_size: int | None = 128, channels: int = 3, mode: str = "center") -> ClipTransform:
    """Evaluation: the centre segment (or ``mode="uniform"``: frames spread over the clip), resize + centre crop."""
    return ClipTransform(ResizeCenterCrop(size, resize_size, channels), TemporalSample(num_frames, stride, mode))
