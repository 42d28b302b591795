"""One file of each kind a real image folder holds, made from a picture: ImageNet's own oddities
(CMYK JPEGs, a PNG named ``.JPEG``, grey JPEGs, upper-case suffixes) and what users' copies add
(progressive and EXIF-rotated JPEGs, 16-bit, palette and RGBA PNGs, WebP, BMP, TIFF, a 1x1 image,
a unicode name; truncated, empty, HTML saved as ``.jpg``, a PNG whose header claims a bomb's size,
a link to nothing): to try what a loader makes of a real folder. ``scripts.bench.eval_exact`` measures the
evaluation transform on them; the tests make them from small pictures.

    >>> from PIL import Image
    >>> files = write_quirks(Path("/tmp/quirks"), Image.new("RGB", (96, 72)))  # doctest: +SKIP
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["QUIRKS_BAD", "QUIRKS_READABLE", "write_quirks"]

#: The readable kinds, and the unreadable ones (the loader's check and its bad-file policy handle those).
QUIRKS_READABLE = ("jpeg", "cmyk", "png_named_jpeg", "grey", "progressive", "exif_rotated", "png", "grey16", "palette",
                   "rgba", "webp", "bmp", "tiff", "one_pixel", "unicode_name")
QUIRKS_BAD = ("truncated", "empty", "html", "bomb", "dangling_link")


def _png_header_only(path: Path, width: int, height: int) -> None:
    """A PNG whose header says ``width`` x ``height`` (a bomb's size) with almost no data: Pillow refuses it at open."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit grey
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


def write_quirks(folder: Path, rgb: Image.Image) -> dict[str, Path]:
    """``rgb`` (an RGB picture) written once as each kind of file a real image folder holds, keyed by
    kind: ``QUIRKS_READABLE`` and ``QUIRKS_BAD`` (those only name what they are, whatever the picture)."""
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}

    def save(kind: str, name: str, img: Image.Image, **kw: object) -> None:
        out[kind] = folder / name
        img.save(out[kind], **kw)

    save("jpeg", "n01_0001.JPEG", rgb, quality=90)
    save("cmyk", "n01_0002.JPEG", rgb.convert("CMYK"), quality=90)
    save("png_named_jpeg", "n01_0003.JPEG", rgb, format="PNG")
    save("grey", "n01_0004.JPEG", rgb.convert("L"), quality=90)
    save("progressive", "n01_0005.jpg", rgb, quality=90, progressive=True)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: torchvision's decode ignores the tag, as the loader does by default
    save("exif_rotated", "n01_0006.jpg", rgb, quality=90, exif=exif)
    save("png", "n01_0007.png", rgb)
    save("grey16", "n01_0008.png", Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 257))
    save("palette", "n01_0009.png", rgb.convert("P", palette=Image.Palette.ADAPTIVE))
    rgba = rgb.convert("RGBA")
    rgba.putalpha(128)
    save("rgba", "n01_0010.png", rgba)
    save("webp", "n01_0011.webp", rgb, lossless=True)
    save("bmp", "n01_0012.bmp", rgb)
    save("tiff", "n01_0013.tif", rgb)
    save("one_pixel", "n01_0014.jpg", rgb.resize((1, 1)), quality=90)
    save("unicode_name", "ünïcödé_画像.jpg", rgb, quality=90)
    good = out["jpeg"].read_bytes()
    for kind, name, data in (("truncated", "n01_0101.JPEG", good[: len(good) // 2]), ("empty", "n01_0102.JPEG", b""),
                             ("html", "n01_0103.jpg", b"<!DOCTYPE html><html><body>404 Not Found</body></html>\n")):
        out[kind] = folder / name
        out[kind].write_bytes(data)
    out["bomb"] = folder / "n01_0104.png"
    _png_header_only(out["bomb"], 20000, 20000)  # 4e8 pixels: over twice Pillow's limit
    out["dangling_link"] = folder / "dangling_link.jpg"
    out["dangling_link"].symlink_to(folder / "gone.jpg")
    return out
