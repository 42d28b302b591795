"""The EXIF orientation read from a JPEG's segments (``cltrain.data.transforms._orientation``) against Pillow's
``getexif`` on the same bytes: every layout of the header a camera, an editor or Pillow writes."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image

from cltrain.data.transforms import _orientation

_XMP = b"http://ns.adobe.com/xap/1.0/\x00"


def _pillow(data: bytes) -> int:
    try:
        with Image.open(io.BytesIO(data)) as img:
            return int(img.getexif().get(0x0112, 1))
    except Exception:  # noqa: BLE001 - as _orientation: an unreadable header counts as upright
        return 1


def _jpeg(**save) -> bytes:
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(buf, format="JPEG", **save)
    return buf.getvalue()


def _tiff(order: str, entries: list[tuple[int, int, int, bytes]]) -> bytes:
    """A TIFF header with IFD0 holding ``entries`` (tag, type, count, 4 value bytes), in ``order`` ("<" or ">")."""
    head = (b"II" if order == "<" else b"MM") + struct.pack(order + "HI", 42, 8)
    ifd = struct.pack(order + "H", len(entries)) + b"".join(
        struct.pack(order + "HHI", tag, kind, count) + value for tag, kind, count, value in entries)
    return head + ifd + b"\x00\x00\x00\x00"


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def _with(data: bytes, *segments: bytes) -> bytes:
    """``data`` (a JPEG) with ``segments`` put right after its SOI."""
    return data[:2] + b"".join(segments) + data[2:]


def _exif(order: str, orientation: int | None, kind: int = 3) -> bytes:
    entries = [(0x010F, 2, 4, b"cam\x00")]
    if orientation is not None:
        value = struct.pack(order + "H", orientation) + b"\x00\x00" if kind == 3 else struct.pack(order + "I", orientation)
        entries.append((0x0112, kind, 1, value))
    return _segment(0xE1, b"Exif\x00\x00" + _tiff(order, entries))


def _xmp(orientation: int) -> bytes:
    return _segment(0xE1, _XMP + f'<x:xmpmeta><rdf:Description tiff:Orientation="{orientation}"/></x:xmpmeta>'.encode())


def _cases() -> dict[str, bytes]:
    plain = _jpeg(quality=90)
    cases = {"no exif": plain, "progressive": _jpeg(progressive=True), "grey": _jpeg(quality=50, subsampling=0),
             "truncated": plain[:40], "not a jpeg": b"<html>404</html>", "empty": b""}
    for k in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = k
        cases[f"pillow's exif {k}"] = _jpeg(exif=exif)
        for order in "<>":
            cases[f"{order} exif {k}"] = _with(plain, _exif(order, k))
    cases["long-typed tag"] = _with(plain, _exif(">", 6, kind=4))
    cases["odd-typed tag"] = _with(plain, _exif("<", 6, kind=1))
    cases["exif without the tag"] = _with(plain, _exif("<", None))
    cases["xmp alone"] = _with(plain, _xmp(6))
    cases["xmp, exif without the tag"] = _with(plain, _xmp(8), _exif("<", None))
    cases["xmp 8, exif 3"] = _with(plain, _xmp(8), _exif(">", 3))
    cases["two exif segments"] = _with(plain, _exif("<", 6), _exif("<", 3))
    cases["comment and icc first"] = _with(plain, _segment(0xFE, b"a comment"), _segment(0xE2, b"ICC_PROFILE\x00" + bytes(64)),
                                           _exif(">", 5))
    cases["fill bytes"] = plain[:2] + b"\xff\xff" + _exif("<", 7) + plain[2:]
    cases["cut inside the exif"] = _with(plain, _exif("<", 6))[:30]
    return cases


@pytest.mark.parametrize("name", list(_cases()))
def test_the_orientation_read_from_the_segments_is_pillows(name):
    data = _cases()[name]
    assert _orientation(data) == _pillow(data), name


def test_the_cases_hold_every_answer():
    # the comparison means something only if the cases give both answers, in both byte orders and through XMP
    answers = {name: _pillow(data) for name, data in _cases().items()}
    assert set(answers.values()) == set(range(1, 9))
    assert answers["xmp alone"] == 6 and answers["xmp 8, exif 3"] == 3 and answers["> exif 6"] == 6
