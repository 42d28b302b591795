"""The ``"simplejpeg"`` back end: simplejpeg (libjpeg-turbo) decodes the whole image; the box is a slice."""

from __future__ import annotations

import math

import numpy as np

from cltrain.data.decoders import JpegHeader

try:
    import simplejpeg
except ImportError:  # optional: without it this back end is not available
    simplejpeg = None

__all__ = ["SimpleJpegWhole"]

_JPEG_MAGIC = b"\xff\xd8\xff"
#: JPEG colour spaces libjpeg-turbo turns into RGB/luma as Pillow does; CMYK and YCCK go to Pillow.
_COLORSPACES = ("YCbCr", "Gray")


class SimpleJpegWhole:
    """Whole-image decoding through simplejpeg (accurate DCT and upsampling, as Pillow and torchvision)."""

    name = "simplejpeg"
    region = False
    install = "pip install simplejpeg"

    def available(self) -> bool:
        return simplejpeg is not None

    def header(self, data: bytes) -> JpegHeader | None:
        if not data.startswith(_JPEG_MAGIC):
            return None
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            return None
        return JpegHeader(width, height) if colorspace in _COLORSPACES else None

    def decode(self, data: bytes, header: JpegHeader, box: tuple[int, int, int, int] | None = None, factor: int = 1,
               channels: int = 3, buffer: np.ndarray | None = None) -> np.ndarray:
        colorspace = "RGB" if channels == 3 else "GRAY"
        height, width = math.ceil(header.height / factor), math.ceil(header.width / factor)
        if buffer is not None and buffer.size < height * width * channels:
            buffer = None
        if factor == 1:
            whole = simplejpeg.decode_jpeg(data, colorspace=colorspace, buffer=buffer)
        else:  # simplejpeg picks the smallest M/8 scale whose output is at least this large: M = 8 / factor
            whole = simplejpeg.decode_jpeg(data, colorspace=colorspace, min_height=height, min_width=width, buffer=buffer)
        return whole if box is None else whole[box[1]:box[3], box[0]:box[2]]
