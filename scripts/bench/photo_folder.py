"""The JPEG folders the loader benchmarks read, made once from photographs that ship inside scikit-image and
scikit-learn (why and how: docs/benchmarks.md#photo-folder): ``make_photo_folder`` (real photographs, 333-800 px),
``make_sized_folder`` (mosaics of exactly one size), ``folders`` (the three sets ``scripts.bench.loaders`` times)
and ``save_as_hf`` (a folder's files as a Hugging Face ``datasets`` dataset).

    python -m scripts.bench.photo_folder /tmp/cltrain-photos --train 400
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path

from PIL import Image

from cltrain.data.demo import write_once
from cltrain.data.image_folder_dataset import find_classes, find_samples
from scripts.harness import options

#: skimage/data files that are photographs (colour and grey); all ship in the wheel.
SKIMAGE_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "motorcycle_left.png", "motorcycle_right.png",
                  "rocket.jpg", "retina.jpg", "hubble_deep_field.jpg", "ihc.png", "camera.png", "moon.png")


def bundled_photos() -> list[Image.Image]:
    """The packaged photographs as RGB PIL images (a missing package or file is skipped, nothing is downloaded)."""
    photos: list[Image.Image] = []
    with contextlib.suppress(ImportError):
        import skimage

        data_dir = Path(skimage.__file__).parent / "data"
        for name in SKIMAGE_PHOTOS:
            if (data_dir / name).is_file():  # read the file itself: skimage.data.* may fetch with pooch
                with Image.open(data_dir / name) as img:
                    photos.append(img.convert("RGB"))
    with contextlib.suppress(ImportError):
        from sklearn.datasets import load_sample_images

        photos += [Image.fromarray(a) for a in load_sample_images().images]  # china.jpg, flower.jpg (bundled)
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


def make_sized_folder(root: Path, size: tuple[int, int], count: int, classes: int = 4, seed: int = 0) -> Path:
    """``root/train/<class>/*.jpg``: ``count`` JPEGs of exactly ``size`` = (width, height), each a mosaic of
    500x375 random crops of the bundled photographs (one tile when ``size`` is that small); made once."""
    def fill(tmp: Path) -> None:
        photos, rng = bundled_photos(), random.Random(seed)
        tile_w, tile_h = min(500, size[0]), min(375, size[1])
        for i in range(count):
            canvas = Image.new("RGB", size)
            for top in range(0, size[1], tile_h):
                for left in range(0, size[0], tile_w):
                    big = photos[rng.randrange(len(photos))]
                    x, y = rng.randint(0, max(0, big.width - tile_w)), rng.randint(0, max(0, big.height - tile_h))
                    canvas.paste(big.crop((x, y, x + tile_w, y + tile_h)), (left, top))
            folder = tmp / "train" / f"class_{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            canvas.save(folder / f"{i:05d}.jpg", quality=rng.randint(75, 95), subsampling=2)

    return write_once(root, {"mosaic": list(size), "count": count, "classes": classes, "seed": seed}, fill,
                      "make_sized_folder")


def folders(work: Path, quick: bool, names: list[str] | None = None) -> dict[str, Path]:
    """The training splits of the three folders (those whose name holds one of ``names``), made once under ``work``
    (an eighth as many images when ``quick``)."""
    n, tag = (8, "-quick") if quick else (1, "")
    makers = {"photos 333-800 px": lambda: make_photo_folder(work / f"photos{tag}", train=400 // n,
                                                             val=max(1, 40 // n)),
              "500x375": lambda: make_sized_folder(work / f"500x375{tag}", (500, 375), 256 // n),
              "2000x1500": lambda: make_sized_folder(work / f"2000x1500{tag}", (2000, 1500), 96 // n)}
    return {k: make() / "train" for k, make in makers.items() if not names or any(s in k for s in names)}


def save_as_hf(split: Path, out: Path) -> Path:
    """The files of ``split`` as a ``datasets`` dataset (``save_to_disk``): each row the file's bytes and its label."""
    import datasets

    if not (out / "dataset_dict.json").is_file():
        classes = find_classes(split)
        samples = find_samples(split, classes)
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
        rows = {"image": [{"bytes": Path(p).read_bytes(), "path": Path(p).name} for p, _ in samples],
                "label": [y for _, y in samples]}
        datasets.DatasetDict(train=datasets.Dataset.from_dict(rows, features=features)).save_to_disk(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    p = options(__doc__, train=400, val=40, seed=0)
    p.add_argument("root", type=Path)
    args = p.parse_args(argv)
    print(make_photo_folder(args.root, args.train, args.val, seed=args.seed))


if __name__ == "__main__":
    main()
