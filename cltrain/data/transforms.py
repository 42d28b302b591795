"""Transforms: an image file (path or bytes) or a PIL image in, HWC uint8 numpy array out, in one resample call.

A path or bytes of a JPEG is decoded by libjpeg-turbo (``cltrain.data.crop_kernels``), the crop
taken as a slice and resized by torch; any other file, a JPEG that path cannot read, and a PIL
image go through Pillow. Each transform draws its random parameters in ``make_params`` (the
torch RNG, torchvision's ``RandomResizedCrop`` distribution) and does the deterministic pixel
work in ``apply``, as torchvision's v2 transforms do. Both are picklable, for DataLoader workers.

Example::

    >>> from PIL import Image
    >>> t = train_transform(224)
    >>> t(Image.new("RGB", (500, 375))).shape
    (224, 224, 3)
    >>> p = t.make_params(500, 375)      # CropParams(box=(left, top, right, bottom), flip=...)
    >>> t.apply(Image.new("L", (500, 375)), p).dtype
    dtype('uint8')
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from cltrain.data.constants import CROP_RATIO, CROP_SCALE
from cltrain.data.crop_kernels import INTERPOLATIONS, check_pixels, jpeg_resized_crop, resized_crop
from cltrain.data.decoders import Decoder, JpegHeader, get_decoder
from cltrain.data.errors import EmptyImageError
from cltrain.data.loader_threads import augment_deferred, sample_generator

__all__ = ["CropParams", "RandomResizedCropFlip", "ResizeCenterCrop", "eval_transform", "size_pair", "train_transform"]


#: What the transforms read: a PIL image, a file path, or the bytes of an image file.
ImageSource = Image.Image | str | os.PathLike | bytes


@dataclass(frozen=True)
class CropParams:
    """What one call of a transform does: crop ``box`` = (left, top, right, bottom) in
    source pixels, resize it to the output size, then mirror it if ``flip``.

    With ``resize`` = (height, width) the whole image is first resized to that size and
    ``box`` is in its pixels (the evaluation transform's resize-then-centre-crop)."""

    box: tuple[float, float, float, float]
    flip: bool = False
    resize: tuple[int, int] | None = None


def size_pair(size: int | tuple[int, int], name: str) -> tuple[int, int]:
    """``size`` as (height, width) positive ints; ``name`` is the argument named in the error."""
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2 or not all(isinstance(s, int) and s > 0 for s in pair):
        raise ValueError(f"{name}={size!r} must be a positive int or a (height, width) pair of them.")
    return pair  # type: ignore[return-value]


def _check_interpolation(interpolation: str) -> str:
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation={interpolation!r} must be one of {sorted(INTERPOLATIONS)}.")
    return interpolation


_ORIENTATION = 0x0112  # the EXIF tag


def _orientation(data: bytes) -> int:
    """The EXIF orientation of an image file's bytes (1 when absent), as Pillow's ``getexif`` gives it: a JPEG's read
    from its segments here (3-5 us against Pillow's 22-35 us header parse, on a 1.8 ms decode, AMD EPYC;
    tests/data/test_exif_orientation.py holds it to Pillow's answer), other formats' and a JPEG's with XMP (where
    Pillow also looks) by Pillow, which reads only the header. Any value but 1 sends the file to Pillow's exact
    ``exif_transpose``."""
    if data[:2] == b"\xff\xd8":
        found = _jpeg_orientation(data)
        if found is not None:
            return found
    try:
        with Image.open(io.BytesIO(data)) as img:
            return int(img.getexif().get(_ORIENTATION, 1))
    except Exception:  # an unreadable header is for the decode to report
        return 1


def _jpeg_orientation(data: bytes) -> int | None:
    """The orientation tag in IFD0 of a JPEG's first ``Exif`` APP1 segment before its scan (where Pillow looks); 1
    where there is none; ``None`` where Pillow's answer is needed: no tag there but another APP1 segment (XMP, which
    Pillow reads then), or a tag of an odd type."""
    pos, end, seen, tag, other = 2, len(data), False, None, False
    while pos + 4 <= end and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # the end, the scan: no header after
            break
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker == 0xE1:
            if data[pos + 4:pos + 10] != b"Exif\x00\x00":
                other = True
            elif not seen:
                seen, tag = True, _tiff_orientation(data[pos + 10:pos + 2 + length])
        pos += 2 + length
    if tag is None:
        return None if other else 1
    return tag if tag >= 0 else None


def _tiff_orientation(tiff: bytes) -> int | None:
    """IFD0's orientation in a TIFF header: ``None`` where absent, -1 where of an odd type."""
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return None
    ifd = int.from_bytes(tiff[4:8], order)  # type: ignore[arg-type]
    count = int.from_bytes(tiff[ifd:ifd + 2], order) if ifd + 2 <= len(tiff) else 0  # type: ignore[arg-type]
    for entry in range(ifd + 2, min(ifd + 2 + 12 * count, len(tiff) - 11), 12):
        if int.from_bytes(tiff[entry:entry + 2], order) == _ORIENTATION:  # type: ignore[arg-type]
            kind = int.from_bytes(tiff[entry + 2:entry + 4], order)  # type: ignore[arg-type]
            size = {3: 2, 4: 4}.get(kind)  # SHORT, LONG
            return int.from_bytes(tiff[entry + 8:entry + 8 + size], order) if size else -1  # type: ignore[arg-type]
    return None


def _check_decoder(decoder: str) -> str:
    get_decoder(decoder)  # a one-line ValueError for an unknown name or a back end not installed
    return decoder


def _check_channels(channels: int) -> int:
    if channels not in (1, 3):
        raise ValueError(f"channels={channels!r} must be 3 (RGB) or 1 (grayscale).")
    return channels


def _read(img: ImageSource, owner: str) -> bytes | None:
    """The bytes of a path or bytes source; ``None`` for a PIL image."""
    if isinstance(img, Image.Image):
        return None
    if isinstance(img, (bytes, bytearray, memoryview)):
        if not len(img):
            raise EmptyImageError()
        return bytes(img)
    if isinstance(img, (str, os.PathLike)):
        with open(img, "rb") as f:
            return f.read()
    raise TypeError(f"{owner} expects a PIL image or a path (or the bytes of a file), got {type(img).__name__}.")


def _open(img: ImageSource, data: bytes) -> Image.Image:
    """Pillow's lazy image of a path or bytes source (opening a path keeps the file's name in Pillow's errors)."""
    return Image.open(img if isinstance(img, (str, os.PathLike)) else io.BytesIO(data))


class _Transform:
    size: tuple[int, int]
    channels: int
    interpolation: str = "bilinear"
    exif_transpose: bool = False
    #: Called on the HWC uint8 output (an augmentation such as ``HWCAugment``).
    augment: Callable[[np.ndarray], np.ndarray] | None = None
    #: Datasets hand this transform file paths: it reads and decodes them itself.
    takes_paths = True
    #: The JPEG back end (``cltrain.data.decoders``): ``"auto"``, a back end's name, or ``"pillow"``.
    decoder: str = "auto"
    #: With ``decoder="auto"``, decode only the crop's region where a back end can (False: whole images).
    region = True
    #: Decode a JPEG at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling) when the crop is at least twice the output.
    reduce = True

    def _backend(self) -> Decoder | None:
        return get_decoder("simplejpeg" if self.decoder == "auto" and not self.region else self.decoder)

    def make_params(self, width: int, height: int) -> CropParams:  # pragma: no cover - abstract
        raise NotImplementedError

    def _pillow(self, img: Image.Image, params: CropParams) -> np.ndarray:
        return resized_crop(img, params.box, self.size, self.channels, params.flip, params.resize, self.interpolation,
                            self.reduce)

    def _upright(self, img: Image.Image) -> Image.Image:
        # exif_transpose decodes the whole image (no draft) and copies even an upright one:
        # read the tag first, so only the rare rotated photo pays that
        if self.exif_transpose and img.getexif().get(_ORIENTATION, 1) != 1:
            return ImageOps.exif_transpose(img)
        return img

    def apply(self, img: ImageSource, params: CropParams) -> np.ndarray:
        """The pixel work for ``params``: HWC uint8 of shape ``(*size, channels)``
        (before ``augment``, which only ``__call__`` runs)."""
        data = _read(img, type(self).__name__)
        if data is None:
            return self._pillow(self._upright(img), params)
        backend, header = self._header(data)
        if header is None or (self.exif_transpose and _orientation(data) != 1):
            with _open(img, data) as opened:
                return self.apply(opened, params)
        check_pixels((header.width, header.height), img if not isinstance(img, bytes) else "JPEG bytes")
        return self._apply_jpeg(img, data, params, None, backend, header)

    def _header(self, data: bytes) -> tuple[Decoder | None, JpegHeader | None]:
        backend = self._backend()
        return backend, None if backend is None else backend.header(data)

    def _apply_jpeg(self, img: ImageSource, data: bytes, params: CropParams, out: torch.Tensor | None,
                    backend: Decoder, header: JpegHeader) -> np.ndarray | torch.Tensor:
        try:
            return jpeg_resized_crop(data, params.box, self.size, self.channels, params.flip, params.resize, self.reduce,
                                     interpolation=self.interpolation, out=out, decoder=backend, header=header)
        except ValueError:  # corrupt or truncated: Pillow reads it, or raises saying what is wrong
            with _open(img, data) as opened:
                return self.apply(opened, params)

    def _transform(self, img: ImageSource, out: torch.Tensor | None = None) -> np.ndarray | torch.Tensor:
        data = _read(img, type(self).__name__)
        if data is None:
            img = self._upright(img)
            return self._pillow(img, self.make_params(*img.size))
        backend, header = self._header(data)
        if header is None or (self.exif_transpose and _orientation(data) != 1):
            with _open(img, data) as opened:
                upright = self._upright(opened)
                return self._pillow(upright, self.make_params(*upright.size))
        size = (header.width, header.height)
        check_pixels(size, img if not isinstance(img, bytes) else "JPEG bytes")  # Pillow's rule, as Image.open applies it
        return self._apply_jpeg(img, data, self.make_params(*size), out, backend, header)

    def __call__(self, img: ImageSource, out: torch.Tensor | None = None) -> np.ndarray | torch.Tensor:
        """Transform a file path, the bytes of a file, or a PIL image (best opened lazily,
        so JPEG decoding can be reduced). Paths and bytes of JPEGs take the fast path.

        With ``out`` (an HWC uint8 tensor of ``(*size, channels)``, dense: a batch's slot) the
        result is written there and ``out`` returned; otherwise a new HWC uint8 array."""
        image = self._transform(img, out)
        if self.augment is not None and not augment_deferred():
            image = self.augment(image.numpy() if isinstance(image, torch.Tensor) else image)
        if out is None or image is out:
            return image
        np.copyto(out.numpy(), image)  # Pillow's arrays are read-only: torch would warn about wrapping one
        return out


class RandomResizedCropFlip(_Transform):
    """torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` in one resample.

    The box is drawn as torchvision's ``RandomResizedCrop.get_params`` draws it, and the
    flip with it, from the torch RNG (reproducible under ``seed_everything``, different per worker).

    Args:
        size: output (height, width), or one int for a square.
        scale: range of the crop's area as a fraction of the image's.
        ratio: range of the crop's aspect ratio (width / height), drawn log-uniformly.
        hflip: probability of a horizontal flip.
        channels: 3 (RGB) or 1 (grayscale).
        interpolation: ``"bilinear"`` or ``"bicubic"`` (antialiased).
        exif_transpose: turn photos upright by their EXIF orientation first.
        augment: called on each HWC uint8 output, e.g. ``HWCAugment``.
        decoder: the JPEG back end (``cltrain.data.decoders``): ``"auto"``, ``"turbojpeg"``,
            ``"simplejpeg"`` or ``"pillow"``.
    """

    def __init__(self, size: int | tuple[int, int] = 224, scale: tuple[float, float] = CROP_SCALE,
                 ratio: tuple[float, float] = CROP_RATIO, hflip: float = 0.5, channels: int = 3,
                 interpolation: str = "bilinear", exif_transpose: bool = False,
                 augment: Callable[[np.ndarray], np.ndarray] | None = None, decoder: str = "auto") -> None:
        self.size = size_pair(size, "size")
        if not (len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1):
            raise ValueError(f"scale={scale!r} must be (low, high) with 0 < low <= high <= 1.")
        if not (len(ratio) == 2 and 0 < ratio[0] <= ratio[1]):
            raise ValueError(f"ratio={ratio!r} must be (low, high) with 0 < low <= high.")
        if not 0 <= hflip <= 1:
            raise ValueError(f"hflip={hflip!r} must be a probability in [0, 1].")
        self.scale, self.ratio, self.hflip = (float(scale[0]), float(scale[1])), (float(ratio[0]), float(ratio[1])), float(hflip)
        self.channels = _check_channels(channels)
        self.interpolation = _check_interpolation(interpolation)
        self.exif_transpose, self.augment = bool(exif_transpose), augment
        self.decoder = _check_decoder(decoder)

    def make_params(self, width: int, height: int) -> CropParams:
        """Draw a crop box with torchvision's ``RandomResizedCrop.get_params`` distribution
        (10 tries, then its central fallback) and a flip, from the torch RNG."""
        # torchvision's get_params makes ~8 small tensors and .item() calls per try: 227 us a call
        # against 22 us here (one torch.rand, then the same arithmetic in Python), measured one
        # after the other on a busy 2-core machine, where a whole 333-800 px photo's transform took
        # ~3 ms. The box distribution is tested equal to torchvision's (tests/data/test_data_crop_kernels.py).
        u = torch.rand(41, generator=sample_generator()).tolist()  # a batch-loading thread's own generator
        area = width * height
        s0, s1 = self.scale
        r0, r1 = math.log(self.ratio[0]), math.log(self.ratio[1])
        for i in range(0, 40, 4):
            target_area = area * (s0 + (s1 - s0) * u[i])
            aspect = math.exp(r0 + (r1 - r0) * u[i + 1])
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = min(int(u[i + 2] * (height - h + 1)), height - h)
                left = min(int(u[i + 3] * (width - w + 1)), width - w)
                return CropParams((left, top, left + w, top + h), u[40] < self.hflip)
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            w, h = int(round(height * max(self.ratio))), height
        else:
            w, h = width, height
        top, left = (height - h) // 2, (width - w) // 2
        return CropParams((left, top, left + w, top + h), u[40] < self.hflip)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
                f"hflip={self.hflip}, channels={self.channels}, interpolation={self.interpolation!r}, "
                f"exif_transpose={self.exif_transpose}, augment={self.augment!r}, decoder={self.decoder!r})")


class ResizeCenterCrop(_Transform):
    """torchvision's ``Resize(resize_size)`` + ``CenterCrop(size)``.

    A JPEG file is decoded whole, resized and the centre box sliced out, exactly torchvision's
    ``Resize`` + ``CenterCrop`` on the decoded tensor; any other file (and a PIL image) has the box
    mapped back to source pixels and resampled alone by Pillow (the same samples, within one level).
    ``reduce=True`` decodes a JPEG at least twice the resize target at 1/2, 1/4 or 1/8 scale instead
    (libjpeg's DCT scaling, as the training transform does): faster on large photos, but no longer
    torchvision's pixels (docs/guides/data.md).

    Args:
        size: output (height, width), or one int for a square.
        resize_size: the shorter side after resizing (torchvision's rule for the longer
            one); ``None`` crops the centre of the image as it is.
        channels: 3 (RGB) or 1 (grayscale).
        interpolation: ``"bilinear"`` or ``"bicubic"`` (antialiased).
        exif_transpose: turn photos upright by their EXIF orientation first.
        decoder: the JPEG back end (``cltrain.data.decoders``), as ``RandomResizedCropFlip``.
        reduce: DCT-scaled decoding of large JPEGs (faster, not torchvision's pixels); off by default.
    """

    def __init__(self, size: int | tuple[int, int] = 224, resize_size: int | None = 256, channels: int = 3,
                 interpolation: str = "bilinear", exif_transpose: bool = False, decoder: str = "auto",
                 reduce: bool = False) -> None:
        self.size = size_pair(size, "size")
        self.reduce = bool(reduce)
        self.interpolation = _check_interpolation(interpolation)
        self.exif_transpose = bool(exif_transpose)
        self.decoder = _check_decoder(decoder)
        if resize_size is not None and not (isinstance(resize_size, int) and resize_size >= max(self.size)):
            raise ValueError(f"resize_size={resize_size!r} must be an int >= the crop size {self.size} (or None).")
        self.resize_size = resize_size
        self.channels = _check_channels(channels)

    def make_params(self, width: int, height: int) -> CropParams:
        """The (deterministic) centre box in the image resized to ``resize`` = (height, width)."""
        if self.resize_size is None:
            new_w, new_h = width, height
        else:
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.resize_size, int(self.resize_size * long / short)
            new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
        crop_h, crop_w = self.size
        if crop_h > new_h or crop_w > new_w:
            raise ValueError(f"ResizeCenterCrop: a {width}x{height} image is {new_w}x{new_h} after resizing, "
                             f"smaller than the crop {crop_w}x{crop_h}; set resize_size.")
        top, left = int(round((new_h - crop_h) / 2.0)), int(round((new_w - crop_w) / 2.0))
        return CropParams((left, top, left + crop_w, top + crop_h), False, (new_h, new_w))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(size={self.size}, resize_size={self.resize_size}, channels={self.channels}, "
                f"interpolation={self.interpolation!r}, exif_transpose={self.exif_transpose}, decoder={self.decoder!r}, "
                f"reduce={self.reduce})")


def train_transform(size: int | tuple[int, int] = 224, scale: tuple[float, float] = CROP_SCALE,
                    ratio: tuple[float, float] = CROP_RATIO, hflip: float = 0.5, channels: int = 3,
                    interpolation: str = "bilinear", exif_transpose: bool = False,
                    augment: str | Callable[[np.ndarray], np.ndarray] | None = None,
                    decoder: str = "auto") -> RandomResizedCropFlip:
    """The training transform: random-resized-crop + horizontal flip, then ``augment`` (a
    callable on HWC uint8, or a policy name of ``HWCAugment``:
    ``"trivialaugment"``, ``"randaugment"``, ``"none"``). See ``RandomResizedCropFlip``."""
    if isinstance(augment, str):
        from cltrain.data.augment_ops import HWCAugment

        augment = HWCAugment(augment) if augment != "none" else None  # its geometric ops: torchvision's nearest
    return RandomResizedCropFlip(size, scale, ratio, hflip, channels, interpolation, exif_transpose, augment, decoder)


def eval_transform(size: int | tuple[int, int] = 224, resize_size: int | None = 256, channels: int = 3,
                   interpolation: str = "bilinear", exif_transpose: bool = False, decoder: str = "auto",
                   reduce: bool = False) -> ResizeCenterCrop:
    """The evaluation transform: resize the shorter side, centre crop, HWC uint8 out; torchvision's
    pixels unless ``reduce``. See ``ResizeCenterCrop``."""
    return ResizeCenterCrop(size, resize_size, channels, interpolation, exif_transpose, decoder, reduce)
