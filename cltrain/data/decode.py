"""The pixel kernel of the transforms: reduced-size decoding, mode conversion, one-call crop+resize.

Decoder choice (measured on this project's CPU, photo JPEGs ~500x375, random
crop to 224): Pillow decoding then resampling its own image ran at ~950 img/s,
simplejpeg (libjpeg-turbo straight to numpy, also with ``fastdct``) plus the
copy into a Pillow image for the antialiased resample at ~930-990 img/s, and
simplejpeg's M/8 scaled decoding was slower (~880). The resample, not the
decode, is the larger cost, and the Pillow path needs no extra copy, reads any
format, and decodes lazily, so ``Image.draft`` can still shrink the decode. So
Pillow is the decoder, with no optional dependency.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

__all__ = ["decode_factor", "resized_crop", "to_mode"]

_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")


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
                 channels: int = 3, flip: bool = False) -> np.ndarray:
    """Crop ``box`` (left, top, right, bottom in ``img``'s pixels) and resize it to
    ``size`` = (height, width) in one antialiased bilinear resample; HWC uint8 out.

    When ``img`` is a JPEG not decoded yet and the crop is at least twice the output,
    ``Image.draft`` makes libjpeg decode at 1/2, 1/4 or 1/8 scale and the box is
    scaled to match; the output has the same size either way.
    """
    mode = "RGB" if channels == 3 else "L"
    factor = decode_factor(box, size)
    width, height = img.size
    # draft only acts on a JPEG that is not loaded yet (it returns None otherwise);
    # asking for "L" there makes libjpeg output luma only.
    drafted = img.draft(mode, (width // factor, height // factor) if factor > 1 else None)
    if drafted is not None and img.size != (width, height):
        s = drafted[1][2] / width  # the decoded image covers (0, 0, width / scale, height / scale)
        box = (box[0] * s, box[1] * s, box[2] * s, box[3] * s)
    img = to_mode(img, mode)
    out = img.resize((size[1], size[0]), Image.Resampling.BILINEAR, box=box)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    arr = np.asarray(out)
    return arr[:, :, None] if arr.ndim == 2 else arr


