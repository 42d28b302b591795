"""Device-side normalisation: uint8 channels_last batch -> float32 / bfloat16 / float16.

``normalize`` runs wherever the batch is (CPU or CUDA, same code), after the
transfer, so the loader only ever moves uint8 (4x less than float32).

How, and why this way: the per-channel affine ``x / 255 * (1 / std) - mean / std``
is applied on a ``(N * H, W * C)`` view of the NHWC buffer with the scale and
shift repeated ``W`` times, so the innermost loop runs over ``W * C`` contiguous
values with contiguous operands. Broadcasting a ``(1, C, 1, 1)`` tensor over a
channels_last tensor instead gives an inner loop of length C == 3, which on a
CPU was measured 2x slower, as was a single mixed-dtype ``addcmul`` on the uint8
input. So it is two passes: one conversion copy (uint8 -> float32, exact) and one
in-place ``addcmul``; for bfloat16/float16 the float32 work is done 16 images at a
time in a cache-sized buffer and rounded once on the way out (not once per op).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from cltrain.data.constants import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["NORMALIZE_DTYPES", "normalize"]

NORMALIZE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK = 16  # images per float32 work buffer for low-precision outputs


def _affine(mean: Sequence[float], std: Sequence[float], channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per (statistics, channels, device): building them per batch meant a blocking
    # host-to-device copy every step on CUDA, which stalls the side-stream prefetch.
    mean_key = tuple(float(m) for m in torch.as_tensor(mean, dtype=torch.float64).flatten().tolist())
    std_key = tuple(float(v) for v in torch.as_tensor(std, dtype=torch.float64).flatten().tolist())
    return _affine_cached(mean_key, std_key, channels, device)


@functools.lru_cache(maxsize=32)
def _affine_cached(mean: tuple[float, ...], std: tuple[float, ...], channels: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    mean_t = torch.tensor(mean, dtype=torch.float64)
    std_t = torch.tensor(std, dtype=torch.float64)
    for name, t in (("mean", mean_t), ("std", std_t)):
        if t.numel() not in (1, channels):
            raise ValueError(f"normalize: {name} has {t.numel()} values for a batch of {channels} channels; give 1 or {channels}.")
    if (std_t == 0).any():
        raise ValueError(f"normalize: std={tuple(std_t.tolist())} contains a zero.")
    scale = (1.0 / (255.0 * std_t)).expand(channels)
    shift = (-mean_t / std_t).expand(channels)
    return scale.to(device, torch.float32), shift.to(device, torch.float32)


def normalize(batch: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
              dtype: torch.dtype = torch.float32, memory_format: torch.memory_format = torch.channels_last) -> torch.Tensor:
    """``(batch / 255 - mean) / std`` as ``dtype``, on ``batch``'s device.

    Args:
        batch: ``(N, C, H, W)`` uint8 tensor, typically the channels_last view
            :class:`~cltrain.data.NHWCCollate` makes (any layout is accepted).
        mean, std: per-channel statistics in [0, 1] units (1 or C values each).
        dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.
        memory_format: ``torch.channels_last`` (default) or
            ``torch.contiguous_format`` for the plain NCHW baseline.

    Returns:
        A new tensor in ``memory_format`` (real channels_last strides also for C == 1).

    Raises:
        TypeError: ``batch`` is not a 4-D uint8 tensor, or ``dtype`` is not one of the three.
        ValueError: ``mean``/``std`` do not match C, a zero std, or another ``memory_format``.

    Example::

        >>> x = torch.full((2, 224, 224, 3), 255, dtype=torch.uint8).permute(0, 3, 1, 2)
        >>> y = normalize(x, dtype=torch.bfloat16)
        >>> y.dtype, y.is_contiguous(memory_format=torch.channels_last)
        (torch.bfloat16, True)
    """
    if not isinstance(batch, torch.Tensor) or batch.dtype != torch.uint8 or batch.dim() != 4:
        what = f"{batch.dtype} tensor of shape {tuple(batch.shape)}" if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise TypeError(f"normalize expects an (N, C, H, W) uint8 tensor, got a {what}.")
    if dtype not in NORMALIZE_DTYPES:
        raise TypeError(f"normalize: dtype={dtype} is not one of {NORMALIZE_DTYPES}.")
    if memory_format not in (torch.channels_last, torch.contiguous_format):
        raise ValueError(f"normalize: memory_format={memory_format} must be torch.channels_last or torch.contiguous_format.")
    n, c, h, w = batch.shape
    scale, shift = _affine(mean, std, c, batch.device)
    out = torch.empty(batch.shape, dtype=dtype, device=batch.device, memory_format=memory_format)
    if out.numel() == 0:
        return out
    if memory_format is torch.channels_last:
        # (N*H, W*C) rows over the NHWC buffers; the affine repeats every C values.
        dst = out.permute(0, 2, 3, 1).view(n * h, w * c)
        src = batch.permute(0, 2, 3, 1).reshape(n * h, w * c)  # a view for NHWC input, a copy otherwise
        scale, shift = scale.repeat(w), shift.repeat(w)
        rows_per_image = h
    else:
        dst, src = out.view(n * c, h * w), batch.reshape(n * c, h * w)
        scale, shift = scale.repeat(n)[:, None], shift.repeat(n)[:, None]
        rows_per_image = c
    if dtype == torch.float32:
        dst.copy_(src)
        torch.addcmul(shift, dst, scale, out=dst)
        return out
    step = _CHUNK * rows_per_image
    work = torch.empty((min(step, dst.shape[0]), dst.shape[1]), dtype=torch.float32, device=batch.device)
    for start in range(0, dst.shape[0], step):
        rows = slice(start, min(start + step, dst.shape[0]))
        buf = work[: rows.stop - rows.start]
        buf.copy_(src[rows])
        sc, sh = (scale, shift) if memory_format is torch.channels_last else (scale[rows], shift[rows])
        torch.addcmul(sh, buf, sc, out=buf)
        dst[rows].copy_(buf)
    return out
