"""A folder of real photographs for measuring loaders, made once from images that ship inside scikit-image and
scikit-learn (why and how: docs/benchmarks.md#photo-folder).

    python -m scripts.bench.photo_folder /tmp/cltrain-photos --train 400
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from PIL import Image

from cltrain.data.demo import write_once
from scripts.harness import options

#: skimage/data files that are photographs (colour and grey); all ship in the wheel.
SKIMAGE_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "motorcycle_left.png", "motorcycle_right.png",
                  "rocket.jpg", "retina.jpg", "hubble_deep_field.jpg", "ihc.png", "camera.png", "moon.png")


def bundled_photos() -> list[Image.Image]:
    """The packaged photographs as RGB PIL images (a missing package or file is skipped, nothing is downloaded)."""
    photos: list[Image.Image] = []
    try:
        import skimage

        data_dir = Path(skimage.__file__).parent / "data"
        for name in SKIMAGE_PHOTOS:
            if (data_dir / name).is_file():  # read the file itself: skimage.data.* may fetch with pooch
                with Image.open(data_dir / name) as img:
                    photos.append(img.convert("RGB"))
    except ImportError:
        pass
    try:
        from sklearn.datasets import load_sample_images

        photos += [Image.fromarray(a) for a in load_sample_images().images]  # china.jpg, flower.jpg (bundled)
    except ImportError:
        pass
    if len(photos) < 2:
        raise RuntimeError("no bundled photographs found: pip install 'cltrain[bench]' (scikit-image, scikit-learn).")
    return photos


def _one(photo: Image.Image, rng: random.Random) -> Image.Image:
    w, h = photo.size
    area = rng.uniform(0.3, 1.0)
    aspect = rng.uniform(3 / 4, 4 / 3) if rng.random() < 0.5 else rng.uniform(0.6, 1.7)
    cw, ch = min(w, round((w * h * area * aspect) ** 0.5)), min(h, round((w * h * area / aspect) ** 0.5))
    left, top = rng.randint(0, w - cw), rng.randint(0, h - ch)
    crop = photo.crop((left, top, left + cw, top + ch))
    long_side = rng.randint(400, 800)
    s = long_side / max(cw, ch)
    nw, nh = max(333, min(800, round(cw * s))), max(333, min(800, round(ch * s)))
    return crop.resize((nw, nh), Image.Resampling.LANCZOS)


def make_photo_folder(root: str | os.PathLike, train: int = 400, val: int = 40, classes: int = 10,
                      seed: int = 0) -> Path:
    """``root`` holding ``train`` + ``val`` JPEG photographs in ImageNet layout (made once; reused when complete)."""
    def fill(tmp: Path) -> None:
        photos, rng = bundled_photos(), random.Random(seed)
        for split, count in (("train", train), ("val", val)):
            for i in range(count):
                cls = tmp / split / f"class_{i % classes:02d}"
                cls.mkdir(parents=True, exist_ok=True)
                img = _one(photos[rng.randrange(len(photos))], rng)
                img.save(cls / f"{i:06d}.jpg", quality=rng.randint(75, 95), subsampling=2 if i % 2 == 0 else 0)

    return write_once(root, {"photos": "bundled", "train": train, "val": val, "classes": classes, "seed": seed}, fill,
                      "make_photo_folder")


def main(argv: list[str] | None = None) -> None:
    p = options(__doc__, train=400, val=40, seed=0)
    p.add_argument("root", type=Path)
    args = p.parse_args(argv)
    print(make_photo_folder(args.root, args.train, args.val, seed=args.seed))


if __name__ == "__main__":
    main()
