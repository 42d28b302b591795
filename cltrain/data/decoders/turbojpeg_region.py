"""The ``"turbojpeg"`` back end: libturbojpeg 3 decodes only the iMCU rows and columns under the box.

The ctypes binding is ``cltrain.data.decoders.jpeg_roi``; this adds the one-pixel margin that makes a
region's pixels equal the whole image's (libjpeg's smooth chroma upsampling of 4:2:0/4:2:2 reads
the neighbouring sample, which a region's edge lacks), and refuses a JPEG without its end-of-image marker when the
region stops above the last row: libjpeg stops there too and never reaches a truncated file's cut, so a partial
download decoded for some crops and was refused for others (``bad_files`` acted at random).
"""

from __future__ import annotations

import io

import numpy as np

from cltrain.data.decoders import JpegHeader, jpeg_ends, jpeg_roi

__all__ = ["TurboJpegRegion"]


class TurboJpegRegion:
    """Region decoding through libturbojpeg 3 (the ``turbojpeg`` wheel's library, or the system's)."""

    name = "turbojpeg"
    region = True
    install = "pip install turbojpeg, or a system libturbojpeg 3"

    def available(self) -> bool:
        return jpeg_roi.available()

    def header(self, data: bytes) -> JpegHeader | None:
        if not data.startswith(b"\xff\xd8\xff"):  # not a JPEG: no call into the library
            return None
        found = jpeg_roi.read_header(data)
        return None if found is None else JpegHeader(found[0], found[1], found)

    def decode(self, data: bytes, header: JpegHeader, box: tuple[int, int, int, int] | None = None, factor: int = 1,
               channels: int = 3, buffer: np.ndarray | None = None) -> np.ndarray:
        width, height = -(-header.width // factor), -(-header.height // factor)
        left, top, right, bottom = box if box is not None else (0, 0, width, height)
        outer = (max(left - 1, 0), max(top - 1, 0), min(right + 1, width), min(bottom + 1, height))
        # (most files end with the marker: one slice; a cut at an EXIF preview's own marker leaves no main header)
        if outer[3] < height and not data.endswith(b"\xff\xd9") and not jpeg_ends(io.BytesIO(data), len(data)):
            raise jpeg_roi.JpegRegionError("JPEG without its end-of-image marker (truncated?)")
        arr = jpeg_roi.decode_region(data, outer, factor, channels, header.detail, buffer)
        return arr[top - outer[1]:bottom - outer[1], left - outer[0]:right - outer[0]]
