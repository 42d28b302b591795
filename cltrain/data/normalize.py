"""Device-side normalisation: uint8 channels_last batch -> float32 / bfloat16 / float16.

``normalize`` runs wherever the batch is (CPU or CUDA, same code), after the
transfer, so the loader only ever moves uint8 (4x less than float32).

The per-channel affine ``x / 255 * (1 / std) - mean / std`` runs on a ``(N * H, W * C)``
view of the NHWC buffer with the scale and shift repeated ``W`` times, so the innermost loop
runs over ``W * C`` contiguous values (broadcasting a ``(1, C, 1, 1)`` tensor would give an
inner loop of length C == 3). bfloat16/float16 outputs are computed in float32 a few images at a
time and rounded once.

A 5-D clip batch ``(N, C, T, H, W)`` (channels_last_3d, as an NTHWC buffer's view)
goes the same way, with ``(N*T*H, W*C)`` rows. Statistics are checked to be in 0-1
units: ImageNet's in 0-255 units (123.7, ...) would shift every pixel to about -2.1.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from cltrain.data.constants import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["NORMALIZE_DTYPES", "ImageNormalizer", "check_statistics", "normalize"]

NORMALIZE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK = 16  # images per float32 work buffer for low-precision outputs


def check_statistics(mean: Sequence[float], std: Sequence[float], owner: str = "normalize") -> None:
    """Refuse statistics that look like 0-255 units (any mean or std above 1) or a std <= 0.

    Raises:
        ValueError: one line naming the values and what to do.
    """
    m = torch.as_tensor(mean, dtype=torch.float64).flatten()
    s = torch.as_tensor(std, dtype=torch.float64).flatten()
    if (m.abs() > 1).any() or (s > 1).any():
        raise ValueError(f"{owner}: mean={tuple(m.tolist())}, std={tuple(s.tolist())} look like 0-255 units; "
                         "give them in 0-1 units (divide by 255), e.g. IMAGENET_MEAN / IMAGENET_STD.")
    if (s <= 0).any():
        raise ValueError(f"{owner}: std={tuple(s.tolist())} contains a zero or a negative value; each must be > 0.")


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
    check_statistics(mean, std)
    scale = (1.0 / (255.0 * std_t)).expand(channels)
    shift = (-mean_t / std_t).expand(channels)
    return scale.to(device, torch.float32), shift.to(device, torch.float32)


def normalize(batch: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
              dtype: torch.dtype = torch.float32, memory_format: torch.memory_format = torch.channels_last) -> torch.Tensor:
    """``(batch / 255 - mean) / std`` as ``dtype``, on ``batch``'s device.

    Args:
        batch: ``(N, C, H, W)`` uint8 tensor, typically the channels_last view
            ``NHWCCollate`` makes, or a ``(N, C, T, H, W)`` clip
            batch (channels_last_3d); any layout is accepted.
        mean: per-channel mean in [0, 1] units (1 or C values).
        std: per-channel standard deviation in [0, 1] units (1 or C values).
        dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.
        memory_format: ``torch.channels_last`` (default; for a 5-D batch it means
            ``torch.channels_last_3d``), ``torch.channels_last_3d`` (5-D only) or
            ``torch.contiguous_format`` for the plain NCHW / NCTHW baseline.

    Returns:
        A new tensor in ``memory_format`` (real channels-last strides also for C == 1).

    Raises:
        TypeError: ``batch`` is not a 4-D or 5-D uint8 tensor, or ``dtype`` is not one of the three.
        ValueError: ``mean``/``std`` do not match C, look like 0-255 units, a zero std, or
            another ``memory_format``.

    Example::

        >>> x = torch.full((2, 224, 224, 3), 255, dtype=torch.uint8).permute(0, 3, 1, 2)
        >>> y = normalize(x, dtype=torch.bfloat16)
        >>> y.dtype, y.is_contiguous(memory_format=torch.channels_last)
        (torch.bfloat16, True)
    """
    if not isinstance(batch, torch.Tensor) or batch.dtype != torch.uint8 or batch.dim() not in (4, 5):
        what = f"{batch.dtype} tensor of shape {tuple(batch.shape)}" if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise TypeError(f"normalize expects an (N, C, H, W) or (N, C, T, H, W) uint8 tensor, got a {what}.")
    if dtype not in NORMALIZE_DTYPES:
        raise TypeError(f"normalize: dtype={dtype} is not one of {NORMALIZE_DTYPES}.")
    five = batch.dim() == 5
    channels_last = torch.channels_last_3d if five else torch.channels_last
    if five and memory_format is torch.channels_last:
        memory_format = torch.channels_last_3d
    if memory_format not in (channels_last, torch.contiguous_format):
        raise ValueError(f"normalize: memory_format={memory_format} must be {channels_last} or torch.contiguous_format "
                         f"for a {batch.dim()}-D batch.")
    n, c = batch.shape[:2]
    spatial = batch.shape[2:]  # (H, W) or (T, H, W)
    w, outer = spatial[-1], math.prod(spatial[:-1])  # W, and H or T*H
    scale, shift = _affine(mean, std, c, batch.device)
    out = torch.empty(batch.shape, dtype=dtype, device=batch.device, memory_format=memory_format)
    if out.numel() == 0:
        return out
    if memory_format is channels_last:
        # (N*H, W*C) rows over the NHWC buffers (N*T*H for NTHWC); the affine repeats every C values.
        to_last = (0, *range(2, batch.dim()), 1)
        dst = out.permute(to_last).view(n * outer, w * c)
        src = batch.permute(to_last).reshape(n * outer, w * c)  # a view for channels-last input, a copy otherwise
        scale, shift = scale.repeat(w), shift.repeat(w)
        rows_per_image = outer
    else:
        dst, src = out.view(n * c, outer * w), batch.reshape(n * c, outer * w)
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
        sc, sh = (scale, shift) if memory_format is channels_last else (scale[rows], shift[rows])
        torch.addcmul(sh, buf, sc, out=buf)
        dst[rows].copy_(buf)
    return out


class ImageNormalizer:
    """``normalize`` one HWC uint8 image at a time, into its slot of a batch buffer.

    The same arithmetic as ``normalize`` (a float32 conversion copy, then one ``addcmul``
    over ``(H, W * C)`` rows; bfloat16/float16 rounded once at the end), so the values are
    bitwise equal; done per image, the float work stays in the CPU cache instead of passing
    over a whole batch in memory twice, and images can be done on different threads.

    Args:
        mean: per-channel mean in [0, 1] units (1 or C values).
        std: per-channel standard deviation in [0, 1] units (1 or C values).
        dtype: ``torch.float32``, ``torch.bfloat16`` or ``torch.float16``.

    Example::

        >>> n = ImageNormalizer()
        >>> out = torch.empty(2, 224, 224, 3)
        >>> n(torch.full((224, 224, 3), 255, dtype=torch.uint8), out[0])
    """

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32) -> None:
        if dtype not in NORMALIZE_DTYPES:
            raise TypeError(f"ImageNormalizer: dtype={dtype} is not one of {NORMALIZE_DTYPES}.")
        check_statistics(mean, std, "ImageNormalizer")
        self.mean, self.std, self.dtype = tuple(float(m) for m in mean), tuple(float(v) for v in std), dtype
        self._rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _affine(self, width: int, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (width, channels)
        if key not in self._rows:
            scale, shift = _affine(self.mean, self.std, channels, torch.device("cpu"))
            self._rows[key] = (scale.repeat(width), shift.repeat(width))
        return self._rows[key]

    def __call__(self, image: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``image`` (HWC uint8, CPU) normalised into ``out`` (HWC of ``dtype``, dense)."""
        h, w, c = image.shape
        scale, shift = self._affine(w, c)
        src = image.reshape(h, w * c)
        if self.dtype == torch.float32:
            dst = out.view(h, w * c)
            dst.copy_(src)
            torch.addcmul(shift, dst, scale, out=dst)
            return
        work = torch.empty((h, w * c), dtype=torch.float32)
        work.copy_(src)
        torch.addcmul(shift, work, scale, out=work)
        out.view(h, w * c).copy_(work)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rows": {}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={self.mean}, std={self.std}, dtype={self.dtype})"
