"""The pixel kernels of the transforms: JPEG bytes through libjpeg-turbo and torch, anything else through Pillow.

Two kernels do the same work (crop a box, resize it with antialiased bilinear
filtering, mirror it, HWC uint8 out):

* ``jpeg_resized_crop``: JPEG bytes decoded by a JPEG back end (``cltrain.data.decoders``)
  straight into a numpy array: for a training crop only the region under it where the back
  end can (libturbojpeg 3; the same pixels as the whole decode sliced), else the whole image
  with the crop taken as a slice; then resized by torch's antialiased resampling
  (``F.interpolate(..., antialias=True)``'s op) as a channels_last uint8 tensor (PyTorch's
  AVX2 uint8 kernel, the one torchvision v2's resize uses), into the batch's slot when given one.
* ``resized_crop``: a PIL image, ``Image.draft`` then a crop of whole pixels and a ``resize`` (a training crop, as
  the fast path), or one ``resize(box=...)`` (the evaluation's resize then crop);
  the fallback for every other format, CMYK/YCCK JPEGs, files the back end rejects
  (corrupt, truncated, empty: Pillow then reports them with its own message), and
  machines without a back end (or ``decoder="pillow"``).

With ``reduce`` (the training transform's setting) both decode a crop at least twice the
output at a reduced size (libjpeg's DCT scaling) when that cannot lower the output's
resolution: 1/2, 1/4 or 1/8, see ``decode_factor`` (the M/8 scales in between run slower
generic IDCTs). The fast path then rounds the box to the reduced image's pixels (Pillow takes
the exact float box): the crop moves by up to half a decoded pixel, at most half an output
pixel, like torchvision's own whole-pixel crop boxes. A DCT-scaled decode is a different
picture from a full decode then resized (up to ~100 levels apart at an edge), so the
evaluation transform decodes whole by default (``reduce=False``): decoding is accurate (no
``fastdct`` / ``fastupsample``), and the evaluation path equals torchvision's decode +
``Resize`` + ``CenterCrop`` within one level per pixel, for every kind of file.
Measurements behind these choices: docs/performance.md.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from PIL import Image

from cltrain.data.loader_threads import one_thread, scratch_tensor, thread_scratch
from cltrain.data.decoders import Decoder, JpegHeader, get_decoder

__all__ = ["INTERPOLATIONS", "check_pixels", "decode_factor", "decode_jpeg", "jpeg_resized_crop", "jpeg_size", "resized_crop",
           "to_mode"]

_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")
#: ``interpolation`` names -> (torch ``interpolate`` mode, Pillow filter); both antialiased when shrinking.
INTERPOLATIONS = {"bilinear": ("bilinear", Image.Resampling.BILINEAR), "bicubic": ("bicubic", Image.Resampling.BICUBIC)}


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
                 interpolation: str = "bilinear", reduce: bool = True) -> np.ndarray:
    """Crop ``box`` (left, top, right, bottom in ``img``'s pixels) and resize it to
    ``size`` = (height, width) in one antialiased bilinear resample; HWC uint8 out.

    With ``resize`` = (height, width), ``box`` is in the pixels of the image resized to
    that size and is mapped back to ``img``'s, so the samples are those of resizing
    then cropping. With ``reduce``, when ``img`` is a JPEG not decoded yet and the crop is
    at least twice the output, ``Image.draft`` makes libjpeg decode at 1/2, 1/4 or 1/8 scale
    and the box is scaled to match; the output has the same size either way.
    """
    mode = "RGB" if channels == 3 else "L"
    width, height = img.size
    if resize is not None:
        sx, sy = width / resize[1], height / resize[0]
        box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    factor = decode_factor(box, size) if reduce else 1
    # draft only acts on a JPEG that is not loaded yet (it returns None otherwise);
    # asking for "L" there makes libjpeg output luma only.
    drafted = img.draft(mode, (width // factor, height // factor) if factor > 1 else None)
    if drafted is not None and img.size != (width, height):
        s = drafted[1][2] / width  # the decoded image covers (0, 0, width / scale, height / scale)
        box = (box[0] * s, box[1] * s, box[2] * s, box[3] * s)
    img = to_mode(img, mode)
    resample = INTERPOLATIONS[interpolation][1]
    if resize is None:  # a training crop: whole pixels cropped, then resized (torchvision's RandomResizedCrop, the
        # fast path): the resample stops at the crop's edges, where resize(box=...) would read the pixels beyond
        left, top = round(box[0]), round(box[1])
        right, bottom = min(max(round(box[2]), left + 1), img.width), min(max(round(box[3]), top + 1), img.height)
        out = img.crop((left, top, right, bottom)).resize((size[1], size[0]), resample)
    else:  # resized, then cropped: the resample reads what the whole resized image holds around the box
        out = img.resize((size[1], size[0]), resample, box=box)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    arr = np.array(out)  # writable (np.asarray of a PIL image is read-only, which torch warns about)
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
            "attack; raise PIL.Image.MAX_IMAGE_PIXELS (or set it to None) if the file is trusted, or leave it out "
            "with exclude_files (the app's data.exclude_files).")
    if pixels > limit:
        warnings.warn(f"{name}: image size ({pixels} pixels) exceeds limit of {limit} pixels, could be decompression "
                      "bomb DOS attack.", Image.DecompressionBombWarning, stacklevel=2)


def _decoder(decoder: str | Decoder | None, region: bool = True) -> Decoder | None:
    """A back end from a name (``None``: ``"auto"``, or ``"simplejpeg"`` when ``region`` is off)."""
    if decoder is None:
        decoder = "auto" if region else "simplejpeg"
    return get_decoder(decoder) if isinstance(decoder, str) else decoder


def jpeg_size(data: bytes, decoder: str | Decoder | None = None) -> tuple[int, int] | None:
    """``(width, height)`` of a JPEG that ``jpeg_resized_crop`` can decode with ``decoder``
    (``cltrain.data.decoders``; ``None``: ``"auto"``), from its header; ``None`` for anything
    else (not a JPEG, CMYK/YCCK, an unreadable header, no back end installed), which is Pillow's to read."""
    backend = _decoder(decoder)
    header = None if backend is None else backend.header(data)
    return None if header is None else (header.width, header.height)


def decode_jpeg(data: bytes, channels: int = 3, factor: int = 1, buffer: np.ndarray | None = None,
                decoder: str | Decoder | None = None) -> np.ndarray:
    """HWC uint8 (RGB or luma) of a whole JPEG, decoded at ``1 / factor`` of its size (rounded up,
    as libjpeg does: ``ceil(width / factor)`` x ``ceil(height / factor)``) by ``decoder``; into
    ``buffer`` (1-D uint8, large enough: the result is a view of it) when given.

    Raises:
        ValueError: the back end cannot decode ``data`` (corrupt, truncated, not a JPEG it reads);
            both are strict, so a truncated file is an error, as it is for Pillow.
    """
    backend = _decoder(decoder)
    header = None if backend is None else backend.header(data)
    if header is None:
        raise ValueError(f"not a JPEG the {getattr(backend, 'name', 'pillow')!r} decoder reads (Pillow reads the rest)")
    return backend.decode(data, header, None, factor, channels, buffer)


#: ``interpolation`` -> torch's antialiased resampling op (``F.interpolate(..., antialias=True)`` calls the
#: same): called directly with ``out=``, so the pixels go straight into their batch slot, and without
#: ``interpolate``'s Python checks (held under the GIL while other decode threads wait).
_RESAMPLE = {"bilinear": torch._C._nn._upsample_bilinear2d_aa, "bicubic": torch._C._nn._upsample_bicubic2d_aa}


def _resize(arr: np.ndarray, size: tuple[int, int], interpolation: str = "bilinear",
            out: torch.Tensor | None = None) -> torch.Tensor:
    """HWC uint8 (a view is fine) -> its ``(1, C, *size)`` channels_last uint8 resample, written
    into ``out`` (``(1, C, *size)`` channels_last) when given."""
    # A crop is a strided view that interpolate would not see as channels_last: it would
    # take a slower path and return NCHW (another transposing copy). Copying the crop
    # into a dense NHWC buffer first costs ~5 us and halves the resize (0.27 -> 0.11 ms).
    h, w, c = arr.shape
    x = scratch_tensor("dense", (1, h, w, c)).permute(0, 3, 1, 2)  # channels_last
    x.copy_(torch.from_numpy(arr).permute(2, 0, 1))
    if (h, w) == size:
        if out is None:
            return x.clone(memory_format=torch.channels_last)  # not a view of the scratch buffer
        return out.copy_(x)
    if out is None:
        out = torch.empty((1, *size, c), dtype=torch.uint8).permute(0, 3, 1, 2)
    return _RESAMPLE[interpolation](x, size, False, None, None, out=out)


def jpeg_resized_crop(data: bytes, box: tuple[float, float, float, float], size: tuple[int, int], channels: int = 3,
                      flip: bool = False, resize: tuple[int, int] | None = None, reduce: bool = True,
                      region: bool = True, interpolation: str = "bilinear", out: torch.Tensor | None = None,
                      decoder: str | Decoder | None = None, header: JpegHeader | None = None) -> np.ndarray | torch.Tensor:
    """``resized_crop`` for JPEG bytes, through a JPEG back end and torch; HWC uint8 (contiguous) out,
    or written into ``out`` (an HWC uint8 tensor of ``(*size, channels)``, dense), which is returned.

    Without ``resize`` the box (source pixels) is decoded and resized to ``size``, as
    torchvision v2's ``resized_crop`` does on a tensor; a region back end (``"turbojpeg"``,
    ``cltrain.data.decoders``) decodes only the iMCU rows and columns under the box, with the
    same pixels. With ``resize`` the whole image is resized to it and ``box`` (integral, in those
    pixels) sliced out: exactly torchvision's ``Resize`` + ``CenterCrop`` on the decoded tensor.
    With ``reduce`` the JPEG is decoded at 1/2, 1/4 or 1/8 scale when that keeps the region at
    least the size it is resized to, and the box is scaled to the decoded image and rounded to its pixels.

    Args:
        decoder: a back end or its name (``None``: ``"auto"``, or ``"simplejpeg"`` with ``region=False``).
        header: ``decoder``'s header of ``data``, when already read.

    Raises:
        ValueError: the back end cannot decode ``data`` (see ``decode_jpeg``).
    """
    backend = _decoder(decoder, region)
    header = header or (None if backend is None else backend.header(data))
    if header is None:
        raise ValueError(f"not a JPEG the {getattr(backend, 'name', 'pillow')!r} decoder reads (Pillow reads the rest)")
    if torch.get_num_threads() == 1:  # a decode thread's setting: no context manager to enter per image
        return _jpeg_resized_crop(data, backend, header, box, size, channels, flip, resize, reduce, interpolation, out)
    with one_thread():
        return _jpeg_resized_crop(data, backend, header, box, size, channels, flip, resize, reduce, interpolation, out)


def _jpeg_resized_crop(data: bytes, backend: Decoder, header: JpegHeader, box: tuple[float, float, float, float],
                       size: tuple[int, int], channels: int, flip: bool, resize: tuple[int, int] | None, reduce: bool,
                       interpolation: str, out: torch.Tensor | None) -> np.ndarray | torch.Tensor:
    width, height = header.width, header.height
    region_box, target = ((0, 0, width, height), resize) if resize is not None else (box, size)
    factor = decode_factor(region_box, target) if reduce else 1
    sw, sh = -(-width // factor), -(-height // factor)  # libjpeg's ceil(width / factor)
    decoded = thread_scratch("decoded", sw * sh * channels)
    if resize is None:
        sx, sy = sw / width, sh / height
        left, top = round(box[0] * sx), round(box[1] * sy)
        right, bottom = min(max(round(box[2] * sx), left + 1), sw), min(max(round(box[3] * sy), top + 1), sh)
        dest = None if out is None else out.unsqueeze(0).permute(0, 3, 1, 2)
        nchw = _resize(backend.decode(data, header, (left, top, right, bottom), factor, channels, decoded), size,
                       interpolation, dest)
        if out is not None:  # resized into ``out`` itself
            return out.copy_(out.flip(1)) if flip else out
    else:
        left, top, right, bottom = (int(v) for v in box)
        nchw = _resize(backend.decode(data, header, None, factor, channels, decoded), resize,
                       interpolation)[:, :, top:bottom, left:right]
    hwc = nchw[0].permute(1, 2, 0)
    if flip:
        hwc = hwc.flip(1)  # torch's flip writes a dense copy; numpy's [:, ::-1] copy is 10x slower
    if out is None:
        return np.ascontiguousarray(hwc.numpy())
    return out if hwc.data_ptr() == out.data_ptr() else out.copy_(hwc)  # a flip is a new tensor
