"""Loaders on the same JPEGs: cltrain's NHWC path against NVIDIA DALI's CPU pipeline, torchvision, timm, a bare
decode and Hugging Face's documented ``datasets`` pipeline (the cases: docs/benchmarks.md#loaders).

    pip install 'cltrain[bench]'                      # DALI, timm, datasets, scikit-image, scikit-learn
    python -m scripts.bench.loaders --levers --threads 1 2 4 --batches 15 --repeats 3    # docs/performance.md
    python -m scripts.bench.loaders --tables hf --workers 2 --repeats 5 --batches 10
    python -m scripts.bench.loaders --root /data/imagenet --threads 4 --no-dali
    python -m scripts.bench.loaders --quick --tables folders hf   # seconds: checks that it runs
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, features
from torch.utils.data import DataLoader, Dataset, RandomSampler, default_collate
from torchvision import transforms as T

from cltrain.data import IMAGENET_MEAN, IMAGENET_STD, ImageFolderDataset, NHWCCollate, normalize, train_transform
from cltrain.data.decoders import jpeg_roi
from cltrain.data.image_folder_dataset import find_classes, find_samples
from cltrain.data.loader_threads import loading_plan
from cltrain.data.normalize import ImageNormalizer
from cltrain.data.prefetch import PrefetchDataLoader
from scripts.bench.photo_folder import folders, save_as_hf
from scripts.harness import interleaved, machine_line, options, rate_after_first, spread, table, timed

__all__ = ["CASES", "hf_table", "loader_machine_line", "loader_rate", "torchvision_train"]


# --- the pieces of the loaders ---------------------------------------------------------------------
class Files(Dataset):
    """(fn(PIL image), target) for each (path, target) of ``samples``."""

    def __init__(self, samples: list[tuple[str, int]], fn: Callable) -> None:
        self.samples, self.fn = samples, fn

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, target = self.samples[i]
        with Image.open(path) as img:
            return self.fn(img), target


def torchvision_train(size: int) -> T.Compose:
    """torchvision's documented training transform: RandomResizedCrop, flip, ToTensor, Normalize."""
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def loader_rate(dataset: Any, collate: Callable, finish: Callable, batch_size: int, workers: int, batches: int,
                seed: int, **options: Any) -> float:
    """Images per second of one pass over ``dataset`` after an untimed first batch; ``finish(batch)`` returns the
    images. With ``options``, cltrain's ``PrefetchDataLoader``, else torch's ``DataLoader``."""
    sampler = RandomSampler(range(len(dataset)), replacement=True, num_samples=batch_size * (batches + 1),
                            generator=torch.Generator().manual_seed(seed))
    loader = (PrefetchDataLoader if options else DataLoader)(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, collate_fn=collate,
        persistent_workers=False, **options)
    torch.manual_seed(seed)  # the same crops for each loader with workers=0
    return rate_after_first(loader, lambda b: finish(b).shape[0]).per_second


def loader_machine_line() -> str:
    """The machine (``cltrain.timing.machine``) with what a loader figure depends on: Pillow, its libjpeg-turbo,
    simplejpeg, and the region decoder."""
    region = f"libturbojpeg {jpeg_roi.library_path()}" if jpeg_roi.available() else "off (no libturbojpeg 3)"
    return (machine_line(packages=("torch", "torchvision", "Pillow", "simplejpeg", "datasets"))
            + f"; Pillow's libjpeg-turbo {features.version('libjpeg_turbo') or 'no'}; region decode {region}")


@dataclass(frozen=True)
class Setting:
    """What every case of a measurement shares: the files, T threads (or worker processes), the batches."""

    split: Path
    threads: int
    batch_size: int
    batches: int
    size: int = 224

    @property
    def samples(self) -> list[tuple[str, int]]:
        return find_samples(self.split, find_classes(self.split))


def cltrain(s: Setting, seed: int, output: str = "float", *, threads: int | None = None, workers: int = 0,
            ahead: bool = True, rows: Any = None, mix: Callable | None = None, **transform: Any) -> float:
    """cltrain's folder loader (``rows``: its ``HFImageDataset`` on these ``datasets`` rows). ``output``: ``"float"``
    normalised by the collate, image by image on the loader's threads; ``"after"``: a uint8 batch, then normalize()
    on the whole batch; ``"uint8"``: the uint8 batch. ``mix(images, targets)``: then applied to the batch."""
    from cltrain.data.hf_dataset import HFImageDataset

    threads = s.threads if threads is None else threads
    tf = train_transform(s.size, **transform)
    dataset = (ImageFolderDataset(s.split, tf, threads=threads, index_cache=False) if rows is None
               else HFImageDataset(rows, tf, threads=threads))
    collate = NHWCCollate(normalize=ImageNormalizer() if output == "float" else None, threads=threads)
    finish, then = normalize if output == "after" else (lambda x: x), mix or (lambda x, y: x)
    return loader_rate(dataset, collate, lambda b: then(finish(b[0]), b[1]), s.batch_size, workers, s.batches, seed,
                       decode_ahead=ahead)


def augmented(s: Setting, seed: int) -> float:
    """cltrain with TrivialAugmentWide in the loader, then random erasing and mixup/cutmix on the batch."""
    from cltrain.data.augment_ops import MixupCutmix, RandomErasing

    erase, mix = RandomErasing(0.25), MixupCutmix(len(find_classes(s.split)), mixup_alpha=0.8, cutmix_alpha=1.0)
    return cltrain(s, seed, "after", mix=lambda x, y: mix(erase(x), y)[0], augment="trivialaugment")


def plain(s: Setting, seed: int, library: str) -> float:
    """torchvision's or timm's standard pipeline, in this process at one thread, else in T worker processes."""
    if library == "torchvision":
        fn, collate = torchvision_train(s.size), default_collate
        finish = lambda b: b[0].contiguous(memory_format=torch.channels_last)  # noqa: E731
    else:
        from timm.data.loader import fast_collate

        fn, collate = T.Compose([T.RandomResizedCrop(s.size), T.RandomHorizontalFlip(), T.PILToTensor()]), fast_collate
        m255, s255 = (torch.tensor(v).view(1, 3, 1, 1) * 255 for v in (IMAGENET_MEAN, IMAGENET_STD))
        finish = lambda b: (b[0].float().sub_(m255).div_(s255)  # noqa: E731
                            .contiguous(memory_format=torch.channels_last))
    return loader_rate(Files(s.samples, fn), collate, finish, s.batch_size, 0 if s.threads == 1 else s.threads,
                       s.batches, seed)


def bare_decode(s: Setting, seed: int) -> float:
    """Images/second of reading each file and decoding the whole image with simplejpeg (accurate defaults) on T
    threads, nothing else: the bar."""
    import simplejpeg

    samples, rng = s.samples, random.Random(seed)
    paths = [samples[rng.randrange(len(samples))][0] for _ in range(s.batch_size * s.batches)]
    one = lambda path: simplejpeg.decode_jpeg(Path(path).read_bytes()).shape[0]  # noqa: E731 - no image kept
    if s.threads == 1:
        return len(paths) / timed(lambda: [one(p) for p in paths])
    with ThreadPoolExecutor(s.threads) as pool:
        list(pool.map(one, paths[:s.threads]))
        return len(paths) / timed(lambda: list(pool.map(one, paths)))


def dali(s: Setting, seed: int) -> float:
    """DALI's CPU pipeline, built anew for each measurement and deleted after it: a pipeline kept alive computes
    batches ahead (its prefetch queue) while the next loader is timed."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=s.batch_size, num_threads=s.threads, device_id=None, seed=1)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(s.split), random_shuffle=True, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0],
                                               random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
        images = fn.resize(images, resize_x=s.size, resize_y=s.size, antialias=True, interp_type=types.INTERP_LINEAR)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="HWC",
                                          mean=[m * 255 for m in IMAGENET_MEAN], std=[v * 255 for v in IMAGENET_STD],
                                          mirror=fn.random.coin_flip(probability=0.5))
        return images, labels

    built = pipe()
    built.build()
    # its first batch, as each loader's first, is not timed; each batch as the dense (N, H, W, C) tensor
    rate = rate_after_first((built.run()[0].as_tensor() for _ in range(s.batches + 1)), lambda t: t.shape()[0])
    del built
    gc.collect()
    return rate.per_second


#: The loaders of ``--tables folders``, in the table's order: name -> (f(setting, seed) -> images/s, the fewest
#: threads it runs at, the option that adds it).
CASES: dict[str, tuple[Callable[[Setting, int], float], int, str | None]] = {
    "DALI": (dali, 1, "dali"),
    "cltrain float": (cltrain, 1, None),
    "cltrain uint8": (lambda s, seed: cltrain(s, seed, "uint8"), 1, None),
    "cltrain N proc": (lambda s, seed: cltrain(s, seed, threads=1, workers=s.threads), 2, None),
    "torchvision": (lambda s, seed: plain(s, seed, "torchvision"), 1, None),
    "timm": (lambda s, seed: plain(s, seed, "timm"), 1, None),
    "decode": (bare_decode, 1, None),
    "lever: normalize() after": (lambda s, seed: cltrain(s, seed, "after"), 1, "levers"),
    "lever: whole-image decode": (lambda s, seed: cltrain(s, seed, decoder="simplejpeg"), 1, "levers"),
    "lever: batch by batch": (lambda s, seed: cltrain(s, seed, ahead=False), 2, "levers"),
    "cltrain+aug": (augmented, 1, "augment"),
}


# --- the tables ------------------------------------------------------------------------------------
def folders_tables(sets: dict[str, Path], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Every case of ``CASES`` asked for, per folder and thread count: the pivot table and the ratios."""
    chosen = {"dali": not args.no_dali, "levers": args.levers, "augment": args.augment, None: True}
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    for name, split in sets.items():
        batches = max(1, args.batches // 4) if name.startswith("2000") else args.batches
        for threads in args.threads:
            s = Setting(split, threads, args.batch_size, batches)
            cases = {k: functools.partial(f, s) for k, (f, least, opt) in CASES.items()
                     if chosen[opt] and threads >= least}
            results[(name, threads)] = interleaved(cases, args.repeats, with_round=True)
            print(f"{name}, {threads} thread(s): done", flush=True)
    names = [n for n in CASES if any(n in rates for rates in results.values())]
    print(f"\nload average after: {os.getloadavg()[0]:.2f}\n\nMedian images/second (lowest-highest):\n")
    print(table(["folder", "threads", *names],
                [[folder, t, *(spread(rates[n]).cell(0) if n in rates else "-" for n in names)]
                 for (folder, t), rates in results.items()], align="lr" + "r" * len(names)))
    print("\n### cltrain against DALI, against the bare decode, and what more threads add\n")
    med = {key: {n: spread(v).median for n, v in rates.items()} for key, rates in results.items()}
    cells = []
    for (name, t), r in med.items():
        one = med.get((name, 1))
        gain = (lambda k: f"{r[k] / one[k] - 1:+.0%}" if one and k in one and k in r else "-")
        cells.append([name, t, f"{r['cltrain float'] / r['DALI']:.2f}x" if "DALI" in r else "-",
                      f"{r['cltrain uint8'] / r['decode']:.2f}x", f"{r['cltrain float'] / r['decode']:.2f}x",
                      gain("cltrain float"), gain("cltrain uint8"), gain("DALI")])
    print(table(["folder", "threads", "float / DALI", "uint8 / decode", "float / decode", "float vs 1 thread",
                 "uint8 vs 1 thread", "DALI vs 1 thread"], cells, align="lrrrrrrr"))
    return {f"{k[0]}, {k[1]} thread(s)": v for k, v in med.items()}


# --- Hugging Face's documented pipeline against cltrain's (--tables hf) ------------------------------
def hf_documented(dataset: Any, size: int) -> tuple[Any, Callable, Callable]:
    """Hugging Face's image-classification recipe: ``set_transform`` with torchvision transforms on Pillow images."""
    tv = torchvision_train(size)

    def transform(batch: dict) -> dict:
        batch["pixel_values"] = [tv(img.convert("RGB")) for img in batch["image"]]
        del batch["image"]
        return batch

    def collate(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([r["pixel_values"] for r in rows]), torch.tensor([r["label"] for r in rows])

    return dataset.with_transform(transform), collate, lambda b: b[0].contiguous(memory_format=torch.channels_last)


def hf_table(sets: dict[str, Path], args: argparse.Namespace) -> dict[tuple[str, str], float]:
    """(a) Hugging Face's documented pipeline, (b) cltrain's ``HFImageDataset`` and (c) its folder loader on the
    photographs of the first folder, with ``--workers`` worker processes each, then (b) and (c) with cltrain's own
    plan."""
    import datasets

    split = next(iter(sets.values()))
    saved = save_as_hf(split, split.parent.parent / f"{split.parent.name}-hf")
    rows_of = datasets.load_from_disk(str(saved))["train"]
    plan = loading_plan()
    print(f"\n{split} as a datasets dataset in {saved}; cltrain's plan here: {plan[0]} workers x {plan[1]} threads")
    configs = {f"{args.workers} workers (all)": (args.workers, 1),
               f"cltrain's plan ({plan[0]} workers x {plan[1]} threads)": plan}
    first = next(iter(configs))
    cases = {(first, "(a) HF docs"): lambda r: loader_rate(*hf_documented(rows_of, 224), args.batch_size,
                                                            args.workers, args.batches, seed=r, decode_ahead=True)}
    for config, (workers, threads) in configs.items():
        s = Setting(split, threads, args.batch_size, args.batches)
        cases[(config, "(b) cltrain hf")] = functools.partial(cltrain, s, workers=workers, rows=rows_of)
        cases[(config, "(c) cltrain dir")] = functools.partial(cltrain, s, workers=workers)
    med = {k: spread(v).median for k, v in interleaved(cases, args.repeats, with_round=True).items()}
    hf_docs = med[(first, "(a) HF docs")]
    print("\n" + table(["configuration", "loader", "img/s", "vs (a)", "vs (c)"],
                       [[config, name, f"{v:.0f}", f"{v / hf_docs:.2f}", f"{v / med[(config, '(c) cltrain dir')]:.2f}"]
                        for (config, name), v in med.items()], align="llrrr"))
    best_hf = max(v for (c, n), v in med.items() if n == "(b) cltrain hf")
    print(f"cltrain hf: {med[(first, '(b) cltrain hf')] / hf_docs:.2f}x the HF pipeline with the same workers, "
          f"{best_hf / hf_docs:.2f}x with its own plan [target 2]; "
          f"{min(med[(c, '(b) cltrain hf')] / med[(c, '(c) cltrain dir')] for c in configs):.2f}x "
          "the folder loader at worst [target 0.9]")
    return med


def main(argv: list[str] | None = None) -> dict:
    p = options(__doc__, work=(Path(tempfile.gettempdir()) / "cltrain-bench-dali",
                               "where the JPEG folders are made (once) and reused"),
                threads=([1, 2], "--tables folders: threads (or workers)"),
                workers=(2, "--tables hf: worker processes of every loader"), batch_size=64,
                batches=(10, "timed batches per measurement (a quarter for 2000x1500)"), repeats=3,
                no_dali=(False, "leave DALI out (it is not installed here)"),
                levers=(False, "add rows for the default path's choices"),
                augment=(False, "add a cltrain row with TrivialAugment, erasing and mixup"),
                quick=(dict(batch_size=8, batches=1, repeats=1), "tiny folders and runs: checks that the script works"),
                root=(Path, "time this folder (train/<class>/<image>) instead of the three"),
                sets=([], "folder names to run (default: all three)"))
    p.add_argument("--tables", nargs="+", choices=("folders", "hf"), default=["folders"])
    args = p.parse_args(argv)
    if not args.no_dali and "folders" in args.tables:
        try:
            import nvidia.dali
        except ImportError:
            p.error("NVIDIA DALI is not installed: pip install nvidia-dali-cuda130 (or pass --no-dali).")
    if args.root is not None:
        sets = {str(args.root): args.root / "train" if (args.root / "train").is_dir() else args.root}
    else:
        sets = folders(args.work, args.quick, args.sets)
    print(loader_machine_line())
    if "folders" in args.tables and not args.no_dali:
        print(f"NVIDIA DALI {nvidia.dali.__version__} (CPU only)")
    print(f"batch {args.batch_size}, {args.batches} timed batches per measurement, {args.repeats} interleaved repeats")
    tables = {"folders": folders_tables, "hf": hf_table}
    return {name: run(sets, args) for name, run in tables.items() if name in args.tables}


if __name__ == "__main__":
    main()
