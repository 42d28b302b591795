"""The evaluation transform against torchvision's, per kind of file, and what DCT-scaled decoding buys (the method:
docs/benchmarks.md#eval-exact).

    python -m scripts.bench.eval_exact --photos /tmp/cltrain-photos
    python -m scripts.bench.eval_exact --photos /tmp/p --quick     # seconds: one photograph, 8 images, one round
"""

from __future__ import annotations

import itertools
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from cltrain.data import eval_transform
from cltrain.data.quirk_files import QUIRKS_READABLE, write_quirks
from scripts.bench.photo_folder import bundled_photos, make_photo_folder
from scripts.harness import machine_line, options, table, time_steps

SIZES = ((224, 256), (64, 73))


def torchvision_eval(path: str | os.PathLike, size: int, resize_size: int) -> np.ndarray:
    """torchvision's evaluation of an image file, HWC uint8: ``decode_image`` (Pillow for BMP and TIFF), ``Resize``,
    ``CenterCrop``; 16-bit images scaled to 8 bits."""
    import torchvision.transforms.v2.functional as F
    from torchvision.io import ImageReadMode, decode_image

    try:
        img = decode_image(str(path), mode=ImageReadMode.RGB)
    except RuntimeError:  # a format torchvision.io does not read
        with Image.open(path) as opened:
            img = F.pil_to_tensor(opened.convert("RGB"))
    if img.dtype != torch.uint8:
        img = F.to_dtype(img, torch.uint8, scale=True)
    return F.center_crop(F.resize(img, [resize_size], antialias=True), [size, size]).permute(1, 2, 0).numpy()


def differences(folder: Path, pictures: list[Image.Image]) -> dict[str, list[str]]:
    """Per kind of file, ``"largest / mean"`` difference per pixel against ``torchvision_eval`` over ``pictures``: at
    each of ``SIZES``, with ``reduce`` off and on."""
    out: dict[str, dict[tuple[int, bool], list[np.ndarray]]] = {}
    for n, picture in enumerate(pictures):
        files = write_quirks(folder / str(n), picture.resize((500, 375), Image.Resampling.LANCZOS))
        for kind in (k for k in QUIRKS_READABLE if k != "one_pixel"):  # one pixel: smaller than any crop
            for size, resize_size in SIZES:
                ref = torchvision_eval(files[kind], size, resize_size).astype(int)
                for reduce in (False, True):
                    ours = eval_transform(size, resize_size, reduce=reduce)(files[kind]).astype(int)
                    out.setdefault(kind, {}).setdefault((size, reduce), []).append(np.abs(ours - ref))
    return {kind: [f"{max(d.max() for d in ds)} / {np.mean([d.mean() for d in ds]):.3f}" for ds in cells.values()]
            for kind, cells in out.items()}


def speed(paths: list[str], size: int, resize_size: int, repeats: int) -> list[str]:
    """Images per second of ``eval_transform`` with ``reduce`` off, and with it on (and the ratio): interleaved,
    median of ``repeats``."""
    transforms = {reduce: eval_transform(size, resize_size, reduce=reduce) for reduce in (False, True)}
    # each step the next image, round after round: a window is the whole folder
    timing = time_steps({reduce: (lambda t=t, images=itertools.cycle(paths): t(next(images)))
                         for reduce, t in transforms.items()},
                        rounds=repeats, warmup=1, min_steps=len(paths), max_steps=len(paths))
    off, on = (timing.rates()[reduce].median for reduce in (False, True))
    return [f"{off:.0f} img/s", f"{on:.0f} ({on / off:.2f}x)"]


def main(argv: list[str] | None = None) -> None:
    args = options(__doc__, photos=(Path(tempfile.gettempdir()) / "cltrain-photos",
                                    "the photo folder (made once from the bundled photographs)"),
                   images=(200, "JPEGs of the photo folder to time"), repeats=5,
                   quick=(dict(images=8, repeats=1), "one photograph, 8 images of a small folder, one round"),
                   ).parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torchvision\.io")  # the reference's decode
    print(f"Machine: {machine_line()}")
    with tempfile.TemporaryDirectory() as tmp:
        diffs = differences(Path(tmp), bundled_photos()[:1] if args.quick else bundled_photos())
    columns = [f"{s}/{r}, {'`reduce=True`' if red else 'default'}" for s, r in SIZES for red in (False, True)]
    print("Difference per pixel against torchvision's decode + Resize + CenterCrop (largest / mean), per kind of file, "
          "over the bundled photographs at 500x375:\n")
    print(table(["kind", *columns], [[kind, *cells] for kind, cells in diffs.items()]))
    root = make_photo_folder(args.photos, **({"train": 8, "val": 1} if args.quick else {}))
    paths = sorted(str(q) for q in root.glob("*/*/*.jpg"))[: args.images]
    cells = [cell for size, resize_size in SIZES for cell in speed(paths, size, resize_size, args.repeats)]
    print("\neval_transform on the JPEGs of the photo folder (333-800 px), one thread:\n")
    print(table(["run", *(c.replace(",", "") for c in columns)],
                [[f"{len(paths)} photos x {args.repeats} repeats, load average {os.getloadavg()[0]:.1f}", *cells]]))


if __name__ == "__main__":
    main()
