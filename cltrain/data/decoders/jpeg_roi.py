"""Decode only the part of a JPEG under a crop: libjpeg-turbo 3's TurboJPEG API through ctypes.

``tj3SetCroppingRegion`` makes libjpeg-turbo skip the rows above the crop
(``jpeg_skip_scanlines``: their Huffman data is read, no IDCT, no colour
conversion), decode only the iMCU columns under it (``jpeg_crop_scanline``) and
stop after its last row; ``tj3SetScalingFactor`` scales in the DCT at the same time.
Every anchor (torchvision, timm, FFCV) decodes the whole image and then throws
away half of it on average (RandomResizedCrop's mean area); NVIDIA DALI decodes
the region only, as this does.

Why ctypes: no maintained Python binding exposes this (checked: simplejpeg 1.9 and
OpenCV scale only; Pillow's ``draft`` scales only; torchvision's ``decode_jpeg`` decodes
whole; PyTurboJPEG 2.6 decodes whole or crops losslessly and needs a system
``libturbojpeg``; the ``turbojpeg`` wheel's pybind11 module decompresses whole or crops
losslessly). A lossless crop through that supported API followed by a decode took 2.4x
the region decode's time (docs/performance.md). So this module calls libjpeg-turbo 3's
documented C API (five functions of ``turbojpeg.h``) in the ``libturbojpeg`` that the
``turbojpeg`` wheel lists among its own files (found through ``importlib.metadata``),
or a system one of version 3. Without either ``available`` is ``False`` and the
callers decode whole images with simplejpeg.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import threading

import numpy as np

__all__ = ["JpegRegionError", "available", "decode_region", "library_path", "read_header"]

# TurboJPEG 3 constants (turbojpeg.h)
_TJINIT_DECOMPRESS = 1
_TJPARAM_STOPONWARNING, _TJPARAM_SUBSAMP, _TJPARAM_JPEGWIDTH, _TJPARAM_JPEGHEIGHT = 0, 4, 5, 6
_TJPARAM_PRECISION, _TJPARAM_COLORSPACE, _TJPARAM_LOSSLESS = 7, 8, 15
_TJPF_RGB, _TJPF_GRAY = 0, 6
_TJCS_RGB, _TJCS_YCbCr, _TJCS_GRAY = 0, 1, 2
#: iMCU width per TJSAMP (444, 422, 420, GRAY, 440, 411, 441); the crop's left edge must be on one.
_MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)


class JpegRegionError(ValueError):
    """libjpeg-turbo refused or could not fully decode the data (corrupt, truncated, unsupported)."""


class _Scaling(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


def library_path() -> str | None:
    """The libturbojpeg 3.x to use: ``CLTRAIN_TURBOJPEG`` if set, the one among the ``turbojpeg``
    wheel's installed files, else the system's; ``None`` when there is none."""
    env = os.environ.get("CLTRAIN_TURBOJPEG")
    if env is not None:
        return env or None  # CLTRAIN_TURBOJPEG= (empty) turns region decoding off
    try:
        files = importlib.metadata.files("turbojpeg") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in sorted(files, key=str):
        if f.name.startswith("libturbojpeg") and ".so" in f.name:
            return str(f.locate())
    return ctypes.util.find_library("turbojpeg")


def _load() -> ctypes.CDLL | None:
    path = library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.tj3Init  # noqa: B018 - a TurboJPEG 2 library lacks the tj3 API
    except (OSError, AttributeError):
        return None
    vp, buf, size = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
    lib.tj3Init.restype, lib.tj3Init.argtypes = vp, [ctypes.c_int]
    lib.tj3DecompressHeader.argtypes = [vp, buf, size]
    lib.tj3Get.argtypes = [vp, ctypes.c_int]
    lib.tj3Set.argtypes = [vp, ctypes.c_int, ctypes.c_int]
    lib.tj3SetScalingFactor.argtypes = [vp, _Scaling]
    lib.tj3SetScalingFactor.restype = ctypes.c_int
    lib.tj3SetCroppingRegion.argtypes = [vp, _Region]
    lib.tj3Decompress8.argtypes = [vp, buf, size, buf, ctypes.c_int, ctypes.c_int]
    lib.tj3GetErrorStr.restype, lib.tj3GetErrorStr.argtypes = ctypes.c_char_p, [vp]
    lib.tj3Destroy.argtypes = [vp]
    return lib


_LIB = _load()
_LOCAL = threading.local()  # a TurboJPEG handle is not thread-safe: one per thread (and per worker process)


def _forget_handles() -> None:
    """In a forked child (a DataLoader worker): the parent's handles are not this process's to use."""
    global _LOCAL
    _LOCAL = threading.local()


if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_forget_handles)


def available() -> bool:
    """Whether region decoding is possible here (a libturbojpeg 3.x was found)."""
    return _LIB is not None


def _handle() -> ctypes.c_void_p:
    handle = getattr(_LOCAL, "handle", None)
    if handle is None:  # this thread's first (a forked worker starts without its parent's: ``_forget_handles``)
        handle = _LIB.tj3Init(_TJINIT_DECOMPRESS)
        if not handle:
            raise RuntimeError("tj3Init failed: libturbojpeg could not make a decompressor.")
        _LIB.tj3Set(handle, _TJPARAM_STOPONWARNING, 1)  # truncated data is an error, as with simplejpeg
        _LOCAL.handle = handle
    return handle


def _error(handle) -> JpegRegionError:
    error = JpegRegionError((_LIB.tj3GetErrorStr(handle) or b"unknown error").decode(errors="replace"))
    _reset(handle)
    return error


def _reset(handle) -> None:
    """Drop this thread's handle after a failure: libturbojpeg 3 refuses every later header on a
    handle that failed one (measured), so the next call makes a fresh one."""
    _LOCAL.handle = None
    _LIB.tj3Destroy(handle)


def read_header(data: bytes) -> tuple[int, int, int, int] | None:
    """``(width, height, subsampling, colorspace)`` of a baseline/progressive 8-bit
    RGB/YCbCr/grey JPEG that ``decode_region`` can decode; ``None`` otherwise
    (CMYK, 12-bit, lossless, not a JPEG, no library)."""
    if _LIB is None:
        return None
    handle = _handle()
    if _LIB.tj3DecompressHeader(handle, data, len(data)) != 0:
        _reset(handle)
        return None
    cs = _LIB.tj3Get(handle, _TJPARAM_COLORSPACE)
    sub = _LIB.tj3Get(handle, _TJPARAM_SUBSAMP)
    if (cs not in (_TJCS_RGB, _TJCS_YCbCr, _TJCS_GRAY) or _LIB.tj3Get(handle, _TJPARAM_PRECISION) != 8
            or _LIB.tj3Get(handle, _TJPARAM_LOSSLESS) == 1 or not 0 <= sub < len(_MCU_WIDTH)):
        return None
    return _LIB.tj3Get(handle, _TJPARAM_JPEGWIDTH), _LIB.tj3Get(handle, _TJPARAM_JPEGHEIGHT), sub, cs


def decode_region(data: bytes, box: tuple[int, int, int, int], factor: int = 1, channels: int = 3,
                  header: tuple[int, int, int, int] | None = None, buffer: np.ndarray | None = None) -> np.ndarray:
    """HWC uint8 of ``box`` = (left, top, right, bottom), in the pixels of the image decoded at
    ``1 / factor`` (``ceil(width / factor)`` x ``ceil(height / factor)``, as libjpeg scales),
    decoding only the iMCU rows and columns under it.

    The pixels equal those of decoding the whole image at that scale and slicing ``box``.
    ``buffer`` (1-D uint8, large enough) is decoded into instead of a new array: the result is
    then a view of it.

    Raises:
        JpegRegionError: the data is corrupt, truncated or of a kind ``read_header`` refuses.
    """
    header = header or read_header(data)
    if header is None:
        raise JpegRegionError("not a JPEG that libturbojpeg can decode to RGB/grey at 8 bits.")
    sub = header[2]
    if factor not in (1, 2, 4, 8):
        raise ValueError(f"decode_region: factor={factor!r} must be 1, 2, 4 or 8.")
    width_s, height_s = -(-header[0] // factor), -(-header[1] // factor)  # TJSCALED: libjpeg rounds up
    left, top, right, bottom = box
    if not (0 <= left < right <= width_s and 0 <= top < bottom <= height_s):
        raise ValueError(f"decode_region: box={box!r} is not inside the {width_s}x{height_s} decoded image.")
    handle = _handle()  # read_header left this handle holding the header
    mcu = max(_MCU_WIDTH[sub] // factor, 1)
    x = left - left % mcu
    width, height = right - x, bottom - top
    # Both setters refuse what the library cannot do (and then leave the old setting): a decode
    # after a refused region would write a wider image than ``out`` holds, so stop there.
    if (_LIB.tj3SetScalingFactor(handle, _Scaling(1, factor)) != 0
            or _LIB.tj3SetCroppingRegion(handle, _Region(x, top, width, height)) != 0):
        raise _error(handle)
    nbytes = height * width * channels
    if buffer is not None and buffer.size >= nbytes:
        out = buffer[:nbytes].reshape(height, width, channels)
    else:
        out = np.empty((height, width, channels), np.uint8)
    pf = _TJPF_RGB if channels == 3 else _TJPF_GRAY
    if _LIB.tj3Decompress8(handle, data, len(data), out.ctypes.data, width * channels, pf) != 0:
        raise _error(handle)
    return out[:, left - x:]
