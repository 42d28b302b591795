"""JPEG decoders: one small protocol, an ordered list of back ends, and ``get_decoder(name)``.

A back end reads a JPEG's header and decodes a box of it, optionally at a reduced DCT scale
(1/2, 1/4, 1/8), into HWC uint8 (RGB or luma). The transforms, the evaluation path and
``cltrain-data-check`` all decode through the one the loader is given (``decoder=`` of the
transforms and DataModules, ``data.decoder=`` in the app); a file the chosen back end cannot
read (another format, CMYK, a corrupt stream) goes to Pillow, which decodes it or says what is wrong.

Back ends, in the order ``"auto"`` tries them (the first one installed is used):

* ``"turbojpeg"`` (``turbojpeg_region``): libturbojpeg 3 through ctypes, decoding only the iMCU
  rows and columns under the box (the binding: ``jpeg_roi``).
* ``"simplejpeg"`` (``simplejpeg_whole``): the whole image by simplejpeg (libjpeg-turbo), then sliced.

``"pillow"`` decodes every file with Pillow (no back end). Adding a back end is one module in
this package with a class that has ``name``, ``available``, ``header`` and ``decode`` (see
``Decoder``), and one line in ``BACKENDS``.

Example::

    from cltrain.data.decoders import get_decoder

    dec = get_decoder("auto")                       # None when no back end is installed
    data = open("photo.jpg", "rb").read()
    header = dec.header(data)                       # JpegHeader(width, height, ...); None: Pillow's to read
    dec.decode(data, header, box=(0, 0, 64, 48))    # HWC uint8 of shape (48, 64, 3)
"""

from __future__ import annotations

import importlib
from typing import Any, BinaryIO, NamedTuple, Protocol

import numpy as np

__all__ = ["BACKENDS", "DECODER_NAMES", "Decoder", "JpegHeader", "get_decoder", "jpeg_ends"]

#: name -> "module:Class" of each back end, in the order ``"auto"`` tries them.
BACKENDS = {
    "turbojpeg": "cltrain.data.decoders.turbojpeg_region:TurboJpegRegion",
    "simplejpeg": "cltrain.data.decoders.simplejpeg_whole:SimpleJpegWhole",
}
#: What ``decoder=`` accepts: ``"auto"``, a back end, or ``"pillow"`` (every file through Pillow).
DECODER_NAMES = ("auto", *BACKENDS, "pillow")


class JpegHeader(NamedTuple):
    """What a back end read from a JPEG's header: the size, and what its ``decode`` needs (``detail``)."""

    width: int
    height: int
    detail: Any = None


class Decoder(Protocol):
    """A JPEG back end."""

    name: str
    #: Whether ``decode`` reads only the box's part of the image (else the whole image, then a slice).
    region: bool

    def available(self) -> bool:
        """Whether its library is installed here."""

    def header(self, data: bytes) -> JpegHeader | None:
        """The header of a JPEG this back end decodes to RGB/luma; ``None`` for anything else
        (another format, CMYK/YCCK, an unreadable header), which is Pillow's to read."""

    def decode(self, data: bytes, header: JpegHeader, box: tuple[int, int, int, int] | None = None, factor: int = 1,
               channels: int = 3, buffer: np.ndarray | None = None) -> np.ndarray:
        """HWC uint8 of ``box`` = (left, top, right, bottom) (``None``: all of it) in the image decoded
        at ``1 / factor`` (``ceil(width / factor)`` x ``ceil(height / factor)``, as libjpeg scales);
        the same pixels whichever back end decodes. ``buffer`` (1-D uint8) may hold the result
        (it is then a view of it). Raises ``ValueError`` for data it cannot decode."""


_INSTANCES: dict[str, Decoder | None] = {}


def _load(name: str) -> Decoder:
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def get_decoder(name: str = "auto") -> Decoder | None:
    """The back end ``name`` (``None`` for ``"pillow"``, or for ``"auto"`` where none is installed).

    Raises:
        ValueError: ``name`` is not one of ``DECODER_NAMES``, or names a back end not installed here.
    """
    if name in _INSTANCES:
        return _INSTANCES[name]
    names = ("auto", *BACKENDS, "pillow")
    if name not in names:
        raise ValueError(f"decoder={name!r} is not a decoder; use one of {list(names)}.")
    if name == "pillow":
        found = None
    elif name == "auto":
        found = next((d for d in map(_load, BACKENDS) if d.available()), None)
    else:
        found = _load(name)
        if not found.available():
            raise ValueError(f"decoder={name!r} is not installed here ({found.install}); use decoder='auto'.")
    _INSTANCES[name] = found
    return found


_TAIL = 4096  # bytes at the end of a JPEG searched first for its end-of-image marker (``jpeg_ends``)


def jpeg_ends(f: BinaryIO, size: int) -> bool:
    """Whether the JPEG in ``f`` has its own end-of-image marker: one after the start of its first scan. The marker
    segments before the scan are stepped over whole (a camera's EXIF segment holds a preview JPEG, with its own end
    marker); the file's last ``_TAIL`` bytes are searched first, and the rest of the scan only where they hold none
    (data after the image: a Motion Photo's video). A truncated file has none; a region back end, which stops after
    the box's last row, would not find that out (``cltrain-data-check``'s quick check reads this too)."""
    f.seek(0)
    if f.read(2) != b"\xff\xd8":
        return False
    at = 2
    while True:  # the segments up to the first scan (SOS)
        f.seek(at)
        head = f.read(4)
        if head[:1] not in (b"\xff", b""):  # bytes before the marker, which libjpeg skips ("extraneous bytes")
            f.seek(at)
            skipped = f.read(1 << 16).find(b"\xff")
            if skipped < 0:
                return False
            at += skipped
            continue
        if len(head) < 2:
            return False
        if head[1] == 0xFF:  # a fill byte before a marker
            at += 1
            continue
        if head[1] == 0xDA:
            break
        if head[1] == 0xD9:  # the end before any scan
            return False
        if 0xD0 <= head[1] <= 0xD8 or head[1] == 0x01:  # markers without a length
            at += 2
            continue
        if len(head) < 4:
            return False
        at += 2 + int.from_bytes(head[2:4], "big")
    f.seek(max(at, size - _TAIL))
    if b"\xff\xd9" in f.read():
        return True
    f.seek(at)
    last = b""
    while chunk := f.read(1 << 20):
        if b"\xff\xd9" in last + chunk:
            return True
        last = chunk[-1:]
    return False
