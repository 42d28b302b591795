"""The pixel kernels of the transforms: JPEG bytes through libjpeg-turbo and torch, anything else through Pillow.

Two kernels do the same work (crop a box, resize it with antialiased bilinear
filtering, mirror it, HWC uint8 out):

* ``jpeg_resized_crop``: JPEG bytes decoded by libjpeg-turbo straight into a numpy
  array: for a training crop only the region under it (``cltrain.data.jpeg_roi``,
  libturbojpeg 3; the same pixels as the whole decode sliced), else the whole image
  (simplejpeg) with the crop taken as a slice; then resized by
  ``torch.nn.functional.interpolate(..., antialias=True)`` as a channels_last
  uint8 tensor (PyTorch's AVX2 uint8 kernel, the one torchvision v2's resize uses).
* ``resized_crop``: a PIL image, ``Image.draft`` then one ``resize(box=...)``;
  the fallback for every other format, CMYK/YCCK JPEGs, files simplejpeg rejects
  (corrupt, truncated, empty: Pillow then reports them with its own message), and
  machines without simplejpeg.

Both decode a crop at least twice the output at a reduced size (libjpeg's DCT
scaling) when that cannot lower the output's resolution: 1/2, 1/4 or 1/8, see
``decode_factor`` (the M/8 scales in between run slower generic IDCTs). The fast
path then rounds the box to the reduced image's pixels (Pillow takes the exact float
box): the crop moves by up to half a decoded pixel, at most half an output pixel, like
torchvision's own whole-pixel crop boxes. Decoding is accurate (no ``fastdct`` /
``fastupsample``), so the evaluation path equals torchvision's decode + ``Resize`` +
``CenterCrop`` on tensors pixel for pixel. Measurements behind these choices:
docs/performance.md.
"""

from __future__ import annotations

import math
import threading
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from cltrain.data import jpeg_roi
from cltrain.data.decode_pool import one_thread

try:
    import simplejpeg
except ImportError:  # optional: without it every file goes through Pillow
    simplejpeg = None

__all__ = ["INTERPOLATIONS", "check_pixels", "decode_factor", "decode_jpeg", "jpeg_resized_crop", "jpeg_size", "resized_crop",
           "to_mode"]

_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_JPEG_MAGIC = b"\xff\xd8\xff"
#: ``interpolation`` names -> (torch ``interpolate`` mode, Pillow filter); both antialiased when shrinking.
INTERPOLATIONS = {"bilinear": ("bilinear", Image.Resampling.BILINEAR), "bicubic": ("bicubic", Image.Resampling.BICUBIC)}
#: JPEG colour spaces libjpeg-turbo turns into RGB/luma as Pillow does; CMYK and YCCK go to Pillow.
_FAST_COLORSPACES = ("YCbCr", "Gray")


def decode_factor(box: tuple[float, float, float, float], size: tuple[int, int]) -> int:
    """The JPEG reduction (1, 2, 4 or 8) for cropping ``box`` to ``size`` = (height, width):
    the largest one that keeps the crop at least ``size`` in the reduced image, so
    decoding smaller never lowers the output's resolution."""
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    for k in (8, 4, 2):
        if crop_w / k >= size[1] and crop_h / k >= size[0]:
            return k
    return 1


def to_mode(img: Image.Image, mode: str) -> Image.Image:
    """``img`` as ``"RGB"`` or ``"L"``: alpha is dropped (as torchvision's loader does),
    palettes are expanded, 16/32-bit integer images are scaled from 0-65535 to 0-255
    (Pillow's own ``convert`` would clip them to 255), CMYK and the rest go through
    ``Image.convert``."""
    if img.mode == mode:
        return img
    if img.mode in _SIXTEEN_BIT:
        arr = np.asarray(img).astype(np.uint32)
        img = Image.fromarray(((np.minimum(arr, 65535) * 255 + 32767) // 65535).astype(np.uint8), "L")
        return img if mode == "L" else img.convert(mode)
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # avoids Pillow's palette-transparency warning
    return img.convert(mode)


def resized_crop(img: Image.Image, box: tuple[float, float, float, float], size: tuple[int, int],
                 channels: int = 3, flip: bool = False, resize: tuple[int, int] | None = None,
                 interpolation: str = "bilinear") -> np.ndarray:
    """Crop ``box`` (left, top, right, bottom in ``img``'s pixels) and resize it to
    ``size`` = (height, width) in one antialiased bilinear resample; HWC uint8 out.

    With ``resize`` = (height, width), ``box`` is in the pixels of the image resized to
    that size and is mapped back to ``img``'s, so the samples are those of resizing
    then cropping. When ``img`` is a JPEG not decoded yet and the crop is at least
    twice the output, ``Image.draft`` makes libjpeg decode at 1/2, 1/4 or 1/8 scale and
    the box is scaled to match; the output has the same size either way.
    """
    mode = "RGB" if channels == 3 else "L"
    width, height = img.size
    if resize is not None:
        sx, sy = width / resize[1], height / resize[0]
        box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    factor = decode_factor(box, size)
    # draft only acts on a JPEG that is not loaded yet (it returns None otherwise);
    # asking for "L" there makes libjpeg output luma only.
    drafted = img.draft(mode, (width // factor, height // factor) if factor > 1 else None)
    if drafted is not None and img.size != (width, height):
        s = drafted[1][2] / width  # the decoded image covers (0, 0, width / scale, height / scale)
        box = (box[0] * s, box[1] * s, box[2] * s, box[3] * s)
    img = to_mode(img, mode)
    out = img.resize((size[1], size[0]), INTERPOLATIONS[interpolation][1], box=box)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    arr = np.asarray(out)
    return arr[:, :, None] if arr.ndim == 2 else arr




def check_pixels(size: tuple[int, int], name: object = "image") -> None:
    """Pillow's decompression-bomb rule for an image of ``size`` = (width, height) that Pillow
    does not open (the libjpeg-turbo paths): above ``Image.MAX_IMAGE_PIXELS`` a
    ``DecompressionBombWarning``, above twice that a ``DecompressionBombError``; off when
    ``Image.MAX_IMAGE_PIXELS`` is ``None``, as in Pillow.

    Raises:
        PIL.Image.DecompressionBombError: ``size`` is over twice the limit.
    """
    limit = Image.MAX_IMAGE_PIXELS
    if limit is None:
        return
    pixels = size[0] * size[1]
    if pixels > 2 * limit:
        raise Image.DecompressionBombError(
            f"{name}: image size ({pixels} pixels) exceeds limit of {2 * limit} pixels, could be decompression bomb DOS "
            "attack; raise PIL.Image.MAX_IMAGE_PIXELS (or set it to None) if the file is trusted.")
    if pixels > limit:
        warnings.warn(f"{name}: image size ({pixels} pixels) exceeds limit of {limit} pixels, could be decompression "
                      "bomb DOS attack.", Image.DecompressionBombWarning, stacklevel=2)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` of a JPEG that ``jpeg_resized_crop`` can decode, from its
    header; ``None`` for anything else (not a JPEG, CMYK/YCCK, an unreadable header,
    simplejpeg not installed), which is Pillow's to read."""
    if simplejpeg is None or not data.startswith(_JPEG_MAGIC):
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return (width, height) if colorspace in _FAST_COLORSPACES else None


def decode_jpeg(data: bytes, channels: int = 3, factor: int = 1, buffer: np.ndarray | None = None) -> np.ndarray:
    """HWC uint8 (RGB or luma) of a JPEG, decoded by libjpeg-turbo at ``1 / factor`` of its
    size (rounded up, as libjpeg does: ``ceil(width / factor)`` x ``ceil(height / factor)``);
    into ``buffer`` (1-D uint8, large enough: the result is a view of it) when given.

    Raises:
        ValueError: simplejpeg cannot decode ``data`` (corrupt, truncated, not a JPEG);
            it is strict, so a truncated file is an error, as it is for Pillow.
    """
    colorspace = "RGB" if channels == 3 else "GRAY"
    height, width = simplejpeg.decode_jpeg_header(data)[:2]
    if buffer is not None and buffer.size < math.ceil(height / factor) * math.ceil(width / factor) * channels:
        buffer = None
    if factor == 1:
        return simplejpeg.decode_jpeg(data, colorspace=colorspace, buffer=buffer)
    # simplejpeg picks the smallest M/8 scale whose output is at least this large: M = 8 / factor.
    return simplejpeg.decode_jpeg(data, colorspace=colorspace, min_height=math.ceil(height / factor),
                                  min_width=math.ceil(width / factor), buffer=buffer)


_SCRATCH = threading.local()


def _scratch(name: str, nbytes: int) -> np.ndarray:
    """This thread's reusable 1-D uint8 buffer ``name`` of at least ``nbytes``.

    Each image's decoded pixels and their dense copy go here, not into new arrays: a new
    multi-megabyte array is a fresh mapping, faulted in page by page, and threads of one
    process doing that serialise on the kernel's memory-map lock (docs/performance.md)."""
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        setattr(_SCRATCH, name, buf)
    return buf


def _resize(arr: np.ndarray, size: tuple[int, int], interpolation: str = "bilinear") -> torch.Tensor:
    """HWC uint8 (a view is fine) -> its ``(1, C, *size)`` channels_last uint8 resample."""
    # A crop is a strided view that interpolate would not see as channels_last: it would
    # take a slower path and return NCHW (another transposing copy). Copying the crop
    # into a dense NHWC buffer first costs ~5 us and halves the resize (0.27 -> 0.11 ms).
    h, w, c = arr.shape
    dense = torch.from_numpy(_scratch("dense", h * w * c)[: h * w * c]).view(1, h, w, c)
    dense.copy_(torch.from_numpy(arr).unsqueeze(0))
    x = dense.permute(0, 3, 1, 2)  # channels_last
    if x.shape[-2:] == size:
        return x.clone(memory_format=torch.channels_last)  # not a view of the scratch buffer
    return F.interpolate(x, size=size, mode=INTERPOLATIONS[interpolation][0], antialias=True, align_corners=False)


def _decode_box(data: bytes, box: tuple[int, int, int, int], factor: int, channels: int,
                scaled: tuple[int, int], region: bool) -> np.ndarray:
    """HWC uint8 of ``box`` (integral, in the pixels of the image decoded at ``1 / factor``, of
    size ``scaled`` = (width, height)): only the region when libturbojpeg 3 is at hand, else
    the whole image sliced."""
    if region and jpeg_roi.available():
        header = jpeg_roi.read_header(data)
        if header is not None:
            # One pixel of margin on each side: libjpeg's fancy (smooth) chroma upsampling of a
            # 4:2:0/4:2:2 image uses the neighbouring sample, which a region's edge lacks; with
            # the margin the pixels equal the whole-image decode's exactly (tested).
            left, top, right, bottom = box
            outer = (max(left - 1, 0), max(top - 1, 0), min(right + 1, scaled[0]), min(bottom + 1, scaled[1]))
            arr = jpeg_roi.decode_region(data, outer, factor, channels, header,
                                         _scratch("decoded", scaled[0] * scaled[1] * channels))
            return arr[top - outer[1]:bottom - outer[1], left - outer[0]:right - outer[0]]
    whole = decode_jpeg(data, channels, factor, _scratch("decoded", scaled[0] * scaled[1] * channels))
    return whole[box[1]:box[3], box[0]:box[2]]


def jpeg_resized_crop(data: bytes, box: tuple[float, float, float, float], size: tuple[int, int], channels: int = 3,
                      flip: bool = False, resize: tuple[int, int] | None = None, reduce: bool = True,
                      region: bool = True, interpolation: str = "bilinear") -> np.ndarray:
    """``resized_crop`` for JPEG bytes, through libjpeg-turbo and torch; HWC uint8 (contiguous) out.

    Without ``resize`` the box (source pixels) is decoded and resized to ``size``, as
    torchvision v2's ``resized_crop`` does on a tensor; with ``region`` (and libturbojpeg 3,
    see ``cltrain.data.jpeg_roi``) only the iMCU rows and columns under the box are
    decoded, with the same pixels. With ``resize`` the whole image is resized to it and
    ``box`` (integral, in those pixels) sliced out: exactly torchvision's ``Resize`` +
    ``CenterCrop`` on the decoded tensor. With ``reduce`` the JPEG is decoded at 1/2, 1/4
    or 1/8 scale when that keeps the region at least the size it is resized to, and the
    box is scaled to the decoded image and rounded to its pixels.

    Raises:
        ValueError: libjpeg-turbo cannot decode ``data`` (see ``decode_jpeg``).
    """
    with one_thread():
        return _jpeg_resized_crop(data, box, size, channels, flip, resize, reduce, region, interpolation)


def _jpeg_resized_crop(data: bytes, box: tuple[float, float, float, float], size: tuple[int, int], channels: int,
                       flip: bool, resize: tuple[int, int] | None, reduce: bool, region: bool,
                       interpolation: str) -> np.ndarray:
    height, width = simplejpeg.decode_jpeg_header(data)[:2]
    region_box, target = ((0, 0, width, height), resize) if resize is not None else (box, size)
    factor = decode_factor(region_box, target) if reduce else 1
    if resize is None:
        sw, sh = -(-width // factor), -(-height // factor)  # libjpeg's ceil(width / factor)
        sx, sy = sw / width, sh / height
        left, top = round(box[0] * sx), round(box[1] * sy)
        right, bottom = min(max(round(box[2] * sx), left + 1), sw), min(max(round(box[3] * sy), top + 1), sh)
        out = _resize(_decode_box(data, (left, top, right, bottom), factor, channels, (sw, sh), region), size,
                      interpolation)
    else:
        need = -(-height // factor) * -(-width // factor) * channels
        arr = decode_jpeg(data, channels, factor, _scratch("decoded", need))
        left, top, right, bottom = (int(v) for v in box)
        out = _resize(arr, resize, interpolation)[:, :, top:bottom, left:right]
    hwc = out[0].permute(1, 2, 0)
    if flip:
        hwc = hwc.flip(1)  # torch's flip writes a dense copy; numpy's [:, ::-1] copy is 10x slower
    return np.ascontiguousarray(hwc.numpy())
