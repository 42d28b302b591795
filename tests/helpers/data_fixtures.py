"""Real image files on disk for the cltrain.data tests (small, fast to make)."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
from PIL import Image

from cltrain.data.demo import draw_demo_image
from cltrain.data import quirk_files
from cltrain.data.quirk_files import QUIRKS_BAD, QUIRKS_READABLE

__all__ = ["BAD", "QUIRKS_BAD", "QUIRKS_READABLE", "READABLE", "add_junk", "photo", "write_format1_pack",
           "write_image_folder", "write_jpegs", "write_odd_files", "write_quirks", "write_user_folder"]


def photo(rng: np.random.Generator, size: tuple[int, int] = (96, 72), k: int = 0) -> Image.Image:
    """A small RGB picture with a shape on a noisy gradient (a demo image)."""
    return draw_demo_image(k, rng, size)


def write_jpegs(folder: Path, n: int, size: tuple[int, int] = (96, 72), k: int = 0, seed: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, k])
    paths = []
    for i in range(n):
        p = folder / f"{k}_{i:03d}.jpg"
        photo(rng, size, k).save(p, quality=85)
        paths.append(p)
    return paths


def write_image_folder(root: Path, classes: int = 2, train: int = 6, val: int = 3, size: tuple[int, int] = (96, 72)) -> Path:
    """``root/{train,val}/c<k>/*.jpg``."""
    for split, n in (("train", train), ("val", val)):
        for k in range(classes):
            write_jpegs(root / split / f"c{k}", n, size, k, seed=0 if split == "train" else 1)
    return root


def write_odd_files(folder: Path, size: tuple[int, int] = (96, 72)) -> dict[str, Path]:
    """Readable files in unusual modes, and unreadable ones, keyed by what they are."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    rgb = photo(rng, size)
    out = {}
    good = folder / "good.jpg"
    rgb.save(good, quality=90)
    data = good.read_bytes()
    (folder / "truncated.jpg").write_bytes(data[: len(data) // 2])
    out["truncated"] = folder / "truncated.jpg"
    (folder / "empty.jpg").write_bytes(b"")
    out["empty"] = folder / "empty.jpg"
    (folder / "text.jpg").write_text("this is not an image\n")
    out["text"] = folder / "text.jpg"
    rgb.convert("CMYK").save(folder / "cmyk.jpg", quality=90)
    out["cmyk"] = folder / "cmyk.jpg"
    wide = (np.asarray(rgb.convert("L")).astype(np.uint16) * 257)
    img16 = Image.fromarray(wide)
    assert img16.mode.startswith("I;16")
    img16.save(folder / "gray16.png")
    out["gray16"] = folder / "gray16.png"
    rgba = rgb.convert("RGBA")
    rgba.putalpha(128)
    rgba.save(folder / "rgba.png")
    out["rgba"] = folder / "rgba.png"
    rgb.convert("L").save(folder / "gray.jpg", quality=90)
    out["gray"] = folder / "gray.jpg"
    rgb.convert("P", palette=Image.Palette.ADAPTIVE).save(folder / "palette.png", transparency=0)
    out["palette"] = folder / "palette.png"
    rgb.convert("LA").save(folder / "la.png")
    out["la"] = folder / "la.png"
    # a Motion Photo: a whole JPEG, then a video after its end marker (readers stop at the marker)
    (folder / "motion.jpg").write_bytes(data + b"\x00\x00\x00\x18ftypmp42" + rng.bytes(20_000))
    out["motion"] = folder / "motion.jpg"
    # a camera's JPEG whose EXIF holds a preview JPEG, cut short in its own scan: the preview's end marker is near
    # the end of the file, the image's own is missing
    preview = io.BytesIO()
    rgb.resize((32, 24)).save(preview, "JPEG", quality=75)
    exif = _exif_with_preview(preview.getvalue())
    with_preview = data[:2] + b"\xff\xe1" + struct.pack(">H", len(exif) + 2) + exif + data[2:]
    (folder / "cut_preview.jpg").write_bytes(with_preview[: len(with_preview) - (len(data) - 2) // 2])
    out["cut_preview"] = folder / "cut_preview.jpg"
    # bytes before a marker, which libjpeg skips with a warning ("extraneous bytes before marker"): readable
    first = 4 + int.from_bytes(data[4:6], "big")  # after the JFIF segment
    (folder / "extraneous.jpg").write_bytes(data[:first] + b"\0\0\0" + data[first:])
    out["extraneous"] = folder / "extraneous.jpg"
    out["good"] = good
    return out


def _exif_with_preview(preview: bytes) -> bytes:
    """An APP1 ``Exif`` body (little-endian TIFF) whose IFD1 points at ``preview``, as cameras write their thumbnail."""
    ifd0 = struct.pack("<HHHII", 1, 0x0112, 3, 1, 1) + struct.pack("<I", 8 + 18)  # Orientation 1, then IFD1
    ifd1 = struct.pack("<H", 2) + struct.pack("<HHII", 0x0201, 4, 1, 8 + 18 + 30) \
        + struct.pack("<HHII", 0x0202, 4, 1, len(preview)) + struct.pack("<I", 0)
    return b"Exif\0\0" + b"II*\0" + struct.pack("<I", 8) + ifd0 + ifd1 + preview


BAD = ("truncated", "empty", "text")
READABLE = ("good", "cmyk", "gray16", "rgba", "gray", "palette", "la")
#: JPEGs whose end marker is not where it is usually found: after the image (readable), in a preview only (bad),
#: after bytes a marker follows (readable)
ENDS_ELSEWHERE = {"motion": True, "cut_preview": False, "extraneous": True}



def write_quirks(folder: Path, size: tuple[int, int] = (96, 72), seed: int = 7) -> dict[str, Path]:
    """One file of each kind a real image folder holds (``cltrain.data.quirk_files``), from a demo picture."""
    return quirk_files.write_quirks(folder, photo(np.random.default_rng(seed), size))


def add_junk(folder: Path) -> list[Path]:
    """What copies from laptops, notebooks and zip files leave in a folder: never classes, never samples."""
    junk = [folder / ".DS_Store", folder / "Thumbs.db", folder / "desktop.ini", folder / "._n01_0001.JPEG",
            folder / ".ipynb_checkpoints" / "n01_0001-checkpoint.JPEG", folder / "__MACOSX" / "._n01_0001.JPEG"]
    for path in junk:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x00\x05\x16\x07junk")
    return junk


def write_user_folder(root: Path, size: tuple[int, int] = (96, 72)) -> dict[str, dict[str, Path]]:
    """``root/{train,val}/<class>/`` as users have it: real JPEGs, every quirk in ``train/c0`` (``write_quirks``),
    a link to a file of another class, and OS junk in every folder (``.ipynb_checkpoints`` beside the classes
    too). Returns the quirk files of ``train/c0`` under ``"quirks"`` and the plain images under ``"plain"``."""
    write_image_folder(root, classes=2, train=3, val=2, size=size)
    quirks = write_quirks(root / "train" / "c0", size)
    link = root / "train" / "c1" / "linked.jpg"
    link.symlink_to(root / "train" / "c0" / "0_000.jpg")  # the same real file in another class: listed in both
    for folder in (root / "train", root / "val", *(root / s / c for s in ("train", "val") for c in ("c0", "c1"))):
        add_junk(folder)
    plain = {p.relative_to(root).as_posix(): p for p in root.glob("*/c*/[01]_*.jpg")}
    return {"quirks": quirks, "plain": plain}


def write_format1_pack(root: Path, out: Path, shard_size: int = 5) -> Path:
    """``root``'s train/ and val/ packed as ``cltrain.data.pack`` wrote packs of format 1: tars of
    ``<key>.<ext>`` + ``<key>.cls``, an (n, 3) index (offset, size, label), no source paths, no
    check (an unreadable file is packed as it is). Written here with the standard library and numpy."""
    import io
    import json
    import tarfile

    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    manifest = {"format": "webdataset", "version": 1, "classes": classes, "splits": {}}
    for split in ("train", "val"):
        (out / split).mkdir(parents=True)
        samples = [(p, classes.index(p.parent.name)) for p in sorted((root / split).glob("*/*")) if p.is_file()]
        shards = []
        for k in range(0, len(samples), shard_size):
            name = f"{split}/shard-{k // shard_size:06d}.tar"
            with tarfile.open(out / name, "w", format=tarfile.USTAR_FORMAT) as tar:
                for i, (path, label) in enumerate(samples[k:k + shard_size]):
                    for ext, data in ((path.suffix.lower().lstrip("."), path.read_bytes()), ("cls", str(label).encode())):
                        info = tarfile.TarInfo(f"{k + i:09d}.{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
            with tarfile.open(out / name) as tar:
                members = [m for m in tar.getmembers() if not m.name.endswith(".cls")]
            index = np.array([(m.offset_data, m.size, label) for m, (_, label) in zip(members, samples[k:k + shard_size])],
                             np.int64)
            np.save((out / name).with_suffix(".idx.npy"), index, allow_pickle=False)
            shards.append(name)
        manifest["splits"][split] = {"count": len(samples), "shards": shards}
    (out / "shards.json").write_text(json.dumps(manifest))
    return out
