"""Real image files on disk for the cltrain.data tests (small, fast to make)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from cltrain.data.demo import draw_demo_image


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
    out["good"] = good
    return out


BAD = ("truncated", "empty", "text")
READABLE = ("good", "cmyk", "gray16", "rgba", "gray", "palette", "la")
