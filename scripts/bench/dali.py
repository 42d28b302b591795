"""cltrain's loader against NVIDIA DALI's CPU pipeline, torchvision, timm and a bare decode, on the same JPEGs.

The work, for every loader: random-resized crop (area 0.08-1, aspect 3/4-4/3), antialiased
bilinear resize to 224, random horizontal flip, and a normalised float32 NHWC batch of 64 in
this process's memory:

  DALI            readers.file + decoders.image_random_crop (libjpeg-turbo, decodes only the
                  crop's region) + resize (antialias) + crop_mirror_normalize (mirror, float,
                  HWC); ``num_threads`` = T, no GPU (``pip install nvidia-dali-cuda130``)
  cltrain float   ImageFolderDataset(train_transform(224), threads=T) in the DataModules' loader
                  (PrefetchDataLoader) with no worker process: each image is decoded and written
                  normalised (float32) straight into its slot of the channels_last batch
                  (NHWCCollate(normalize=ImageNormalizer())), the next batch decoding meanwhile
  cltrain uint8   the same, uint8: the batch the loader hands a GPU (normalised there)
  cltrain N proc  (T > 1) cltrain float in T worker processes of 1 thread each
  torchvision     RandomResizedCrop + flip + ToTensor + Normalize, default_collate, then
                  .contiguous(channels_last); T = 1: in this process, T = 2: two worker processes
  timm            RandomResizedCrop + flip + PILToTensor + fast_collate, float().sub_().div_(),
                  .contiguous(channels_last); worker processes as torchvision
  decode          read the file and decode the whole image (simplejpeg, accurate defaults) on
                  T threads, nothing else: the bar for the in-process loader

on three folders: real photographs (333-800 px, made from the images bundled with
scikit-image and scikit-learn, see ``scripts/bench/photo_folder.py``), and generated
ImageNet-sized JPEGs of 500x375 and 2000x1500 (mosaics of 500x375 crops of the same
photographs, so they hold as much detail as a photograph: quality 75-95, 4:2:0). Each
loader runs ``--repeats`` times, interleaved (``cltrain.timing.rounds.interleaved``: the order
rotates each round, every loader the same samples in a round); the first table (the one in
docs/performance.md) gives a row per folder and thread count, the median images/second and the
spread (lowest-highest) of each loader, the second the ratios of cltrain's median to DALI's and
to the bare decode. ``--levers`` adds rows for the choices
the default path makes (normalize() on the whole uint8 batch afterwards; whole-image
decoding instead of the crop's region; batch by batch, no batch decoding ahead). The CPU model, its SIMD flags and
the load average before and after are printed: figures from a busy machine say so.

    pip install 'cltrain[bench]'                      # DALI, timm, scikit-image, scikit-learn
    python -m scripts.bench.dali                      # the docs/performance.md table
    python -m scripts.bench.dali --quick              # seconds: checks that it runs
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from PIL import Image

from cltrain.data import IMAGENET_MEAN, IMAGENET_STD, ImageFolderDataset, NHWCCollate, normalize, train_transform
from cltrain.data.demo import write_once
from cltrain.data.image_folder_dataset import find_classes, find_samples
from cltrain.data.normalize import ImageNormalizer
from cltrain.timing.clock import timed
from cltrain.timing.report import table
from cltrain.timing.rounds import interleaved, rate_after_first
from cltrain.timing.stats import spread
from scripts.bench.loader import DecodeWhole, loader_machine_line, loader_rate, methods, time_loader
from scripts.bench.photo_folder import bundled_photos, make_photo_folder

SIZE = 224
#: The loaders, in the order the table gives them.
LOADERS = ("DALI", "cltrain float", "cltrain uint8", "cltrain N proc", "torchvision", "timm", "decode",
           "lever: normalize() after", "lever: whole-image decode", "lever: batch by batch")


# --- the folders -----------------------------------------------------------------------------------
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
                    photo = photos[rng.randrange(len(photos))]
                    w, h = photo.size
                    scale = max(tile_w / w, tile_h / h) * rng.uniform(1.0, 1.6)  # some enlarged, never stretched
                    big = photo.resize((max(tile_w, round(w * scale)), max(tile_h, round(h * scale))),
                                       Image.Resampling.LANCZOS)
                    x, y = rng.randint(0, big.width - tile_w), rng.randint(0, big.height - tile_h)
                    canvas.paste(big.crop((x, y, x + tile_w, y + tile_h)), (left, top))
            folder = tmp / "train" / f"class_{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            canvas.save(folder / f"{i:05d}.jpg", quality=rng.randint(75, 95), subsampling=2)

    return write_once(root, {"mosaic": list(size), "count": count, "classes": classes, "seed": seed}, fill,
                      "make_sized_folder")


def folders(work: Path, quick: bool) -> dict[str, Path]:
    n = 8 if quick else 1
    return {
        "photos 333-800 px": make_photo_folder(work / ("photos-quick" if quick else "photos"), train=400 // n,
                                               val=max(1, 40 // n)) / "train",
        "500x375": make_sized_folder(work / ("500x375-quick" if quick else "500x375"), (500, 375), 256 // n) / "train",
        "2000x1500": make_sized_folder(work / ("2000x1500-quick" if quick else "2000x1500"), (2000, 1500), 96 // n) / "train",
    }


# --- the loaders -------------------------------------------------------------------------------------
class Dali:
    """DALI's CPU pipeline for one folder and thread count, built anew for each measurement.

    A pipeline keeps computing batches ahead (its prefetch queue) after ``run()`` returns; kept
    between measurements, it would decode on the cores while the next loader is timed. So each
    measurement builds its own pipeline and deletes it (which stops its threads) before returning.
    """

    def __init__(self, split: Path, threads: int, batch_size: int, seed: int) -> None:
        self.split, self.threads, self.batch_size, self.seed = split, threads, batch_size, seed

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads, device_id=None, seed=self.seed)
        def pipe():
            jpegs, labels = fn.readers.file(file_root=str(self.split), random_shuffle=True, name="reader")
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                   random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3],
                                                   num_attempts=10)
            images = fn.resize(images, resize_x=SIZE, resize_y=SIZE, antialias=True, interp_type=types.INTERP_LINEAR)
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="HWC",
                                              mean=[m * 255 for m in IMAGENET_MEAN], std=[s * 255 for s in IMAGENET_STD],
                                              mirror=fn.random.coin_flip(probability=0.5))
            return images, labels

        built = pipe()
        built.build()
        return built

    def __call__(self, batches: int) -> float:
        pipe = self._build()
        # its first batch, as each loader's first, is not timed; each batch as the dense (N, H, W, C) tensor
        rate = rate_after_first((pipe.run()[0].as_tensor() for _ in range(batches + 1)), lambda t: t.shape()[0]).per_second
        del pipe
        gc.collect()
        return rate


def cltrain_loader(split: Path, threads: int, workers: int, batch_size: int, batches: int, seed: int,
                   output: str = "float", decoder: str = "auto", ahead: bool = True) -> float:
    """``output``: ``"float"`` normalised by the collate, image by image on the loader's threads;
    ``"after"``: a uint8 batch, then normalize() on the whole batch; ``"uint8"``: the uint8 batch."""
    dataset = ImageFolderDataset(split, train_transform(SIZE, decoder=decoder), threads=threads, index_cache=False)
    collate = NHWCCollate(normalize=ImageNormalizer() if output == "float" else None, threads=threads)
    finish = normalize if output == "after" else (lambda x: x)
    return loader_rate(dataset, collate, lambda batch: finish(batch[0]), batch_size, workers, batches, seed,
                       decode_ahead=ahead)


def bare_decode(samples: list[tuple[str, int]], threads: int, images: int, seed: int) -> float:
    """Images/second of ``scripts.bench.loader.DecodeWhole`` (read the file, decode it whole) on ``threads``."""
    rng, decode = random.Random(seed), DecodeWhole()
    paths = [samples[rng.randrange(len(samples))][0] for _ in range(images)]
    one = lambda path: decode(path).shape[0]  # noqa: E731 - the rows: no image kept
    if threads == 1:
        return images / timed(lambda: [one(p) for p in paths])
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, paths[:threads]))
        return images / timed(lambda: list(pool.map(one, paths)))


def rows_for(split: Path, threads: int, batch_size: int, batches: int, has_dali: bool, levers: bool) -> dict:
    """name -> f(seed) -> images/second, for one folder and thread count."""
    samples = find_samples(split, find_classes(split))
    plain = methods(SIZE, torch.device("cpu"))
    workers = 0 if threads == 1 else threads
    rows = {}
    if has_dali:
        dali = Dali(split, threads, batch_size, seed=1)
        rows["DALI"] = lambda seed: dali(batches)
    rows["cltrain float"] = lambda seed: cltrain_loader(split, threads, 0, batch_size, batches, seed, "float")
    rows["cltrain uint8"] = lambda seed: cltrain_loader(split, threads, 0, batch_size, batches, seed, "uint8")
    if threads > 1:
        rows["cltrain N proc"] = lambda seed: cltrain_loader(split, 1, threads, batch_size, batches, seed, "float")
    if levers:  # what each choice of the default path is worth, measured beside it
        rows["lever: normalize() after"] = lambda seed: cltrain_loader(split, threads, 0, batch_size, batches, seed, "after")
        rows["lever: whole-image decode"] = lambda seed: cltrain_loader(split, threads, 0, batch_size, batches, seed,
                                                                         "float", decoder="simplejpeg")
        if threads > 1:
            rows["lever: batch by batch"] = lambda seed: cltrain_loader(split, threads, 0, batch_size, batches, seed,
                                                                         "float", ahead=False)
    for name, key in (("torchvision", "(b) torchvision"), ("timm", "(c) timm")):
        fn, collate, finish = plain[key]
        rows[name] = (lambda seed, fn=fn, collate=collate, finish=finish:
                      time_loader(samples, fn, collate, finish, batch_size, workers, batches, seed, torch.device("cpu")))
    rows["decode"] = lambda seed: bare_decode(samples, threads, batch_size * batches, seed)
    return rows


# --- the run ------------------------------------------------------------------------------------------
def pivot(results: dict[tuple[str, int], dict[str, list[float]]]) -> str:
    """A row per folder and thread count, a column per loader: median images/s (lowest-highest)."""
    names = [n for n in LOADERS if any(n in rates for rates in results.values())]
    return table(["folder", "threads", *names],
                 [[folder, threads, *(spread(rates[n]).cell(0) if n in rates else "-" for n in names)]
                  for (folder, threads), rates in results.items()], align="lr" + "r" * len(names))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "cltrain-bench-dali",
                   help="where the JPEG folders are made (once) and reused")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--sets", nargs="+", default=None, help="folder names to run (default: all three)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=10, help="timed batches per measurement (a quarter for 2000x1500)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-dali", action="store_true", help="leave DALI out (it is not installed here)")
    p.add_argument("--levers", action="store_true", help="add rows for the default path's choices")
    p.add_argument("--quick", action="store_true", help="tiny folders and runs: checks that the script works")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_size, args.batches, args.repeats = 8, 1, 1
    has_dali = not args.no_dali
    if has_dali:
        try:
            import nvidia.dali
        except ImportError:
            p.error("NVIDIA DALI is not installed: pip install nvidia-dali-cuda130 (or pass --no-dali).")
    sets = folders(args.work, args.quick)
    if args.sets:
        sets = {k: v for k, v in sets.items() if any(s in k for s in args.sets)}
    print(loader_machine_line(torch.device("cpu")))
    if has_dali:
        print(f"NVIDIA DALI {nvidia.dali.__version__} (CPU only)")
    print(f"batch {args.batch_size}, {args.batches} timed batches per measurement, {args.repeats} interleaved repeats")
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    for set_name, split in sets.items():
        batches = max(1, args.batches // 4) if set_name.startswith("2000") else args.batches
        for threads in args.threads:
            rows = rows_for(split, threads, args.batch_size, batches, has_dali, args.levers)
            results[(set_name, threads)] = interleaved(rows, args.repeats, with_round=True)
            print(f"{set_name}, {threads} thread(s): done", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}\n\nMedian images/second (lowest-highest):\n")
    print(pivot(results))
    print("\n### cltrain against DALI, against the bare decode, and what more threads add\n")
    med = {key: {n: spread(v).median for n, v in rates.items()} for key, rates in results.items()}
    cells = []
    for (set_name, t), r in med.items():
        one = med.get((set_name, 1))
        gain = (lambda k: f"{r[k] / one[k] - 1:+.0%}" if one and k in one and k in r else "-")
        cells.append([set_name, t, f"{r['cltrain float'] / r['DALI']:.2f}x" if "DALI" in r else "-",
                      f"{r['cltrain uint8'] / r['decode']:.2f}x", f"{r['cltrain float'] / r['decode']:.2f}x",
                      gain("cltrain float"), gain("cltrain uint8"), gain("DALI")])
    print(table(["folder", "threads", "float / DALI", "uint8 / decode", "float / decode", "float vs 1 thread",
                 "uint8 vs 1 thread", "DALI vs 1 thread"], cells, align="lrrrrrrr"))
    return {f"{k[0]}, {k[1]} thread(s)": v for k, v in med.items()}

if __name__ == "__main__":
    main()
