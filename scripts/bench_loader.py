"""Loader throughput: cltrain's NHWC path against torchvision's, timm's and plain decoding.

Images per second on the same JPEG folder, batch size, worker count and sample
order, measured one after the other in one run:

  (a) cltrain     train_transform (given the path: simplejpeg + torch resize) + NHWCCollate,
                  then normalize() (channels_last float32)
  (b) torchvision RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize,
                  default_collate, then .contiguous(memory_format=torch.channels_last)
  (c) timm        RandomResizedCrop, flip, PILToTensor + timm.data.fast_collate, then
                  float().sub_(mean).div_(std) and .contiguous(memory_format=channels_last)
  (d) decode      PIL open + convert("RGB") and nothing else: the bound

The first batch of each loader (worker start-up) is not timed. Without --root it
times the demo folder (500x375 JPEGs, quality 75-95), made once under /tmp.

    python scripts/bench_loader.py                                   # batch 64, 1 worker
    python scripts/bench_loader.py --root /data/imagenet --workers 4 --batches 50
    python scripts/bench_loader.py --batches 3 --batch-size 16       # a quick check
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import PIL
import torch
import torchvision
from PIL import Image, features
from torch.utils.data import DataLoader, Dataset, RandomSampler, default_collate
from torchvision import transforms as T

from cltrain.data import IMAGENET_MEAN, IMAGENET_STD, NHWCCollate, make_demo_dataset, normalize, train_transform
from cltrain.data.dataset import find_classes, find_samples


class Files(Dataset):
    """(fn(PIL image), target) for each (path, target); fn(path) if fn takes paths (cltrain's
    transforms, which read and decode JPEGs themselves), as ImageFolderDataset does."""

    def __init__(self, samples, fn):
        self.samples, self.fn = samples, fn

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, target = self.samples[i]
        if getattr(self.fn, "takes_paths", False):
            return self.fn(path), target
        with Image.open(path) as img:
            return self.fn(img), target


def to_rgb(img):
    return img.convert("RGB")


def count_only(batch):
    return len(batch)


def _mean_std_255(device="cpu"):
    m = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
    s = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255
    return m, s


def methods(size):
    from timm.data.loader import fast_collate

    m255, s255 = _mean_std_255()
    tv = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    timm_t = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()])
    return {
        "(a) cltrain": (train_transform(size), NHWCCollate(), lambda b: normalize(b[0])),
        "(b) torchvision": (tv, default_collate, lambda b: b[0].contiguous(memory_format=torch.channels_last)),
        "(c) timm": (timm_t, fast_collate,
                     lambda b: b[0].float().sub_(m255).div_(s255).contiguous(memory_format=torch.channels_last)),
        "(d) decode only": (to_rgb, count_only, lambda b: b),
    }


def run(samples, fn, collate, finish, batch_size, workers, batches, seed):
    n = batch_size * (batches + 1)
    sampler = RandomSampler(samples, replacement=True, num_samples=n, generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(Files(samples, fn), batch_size=batch_size, sampler=sampler, num_workers=workers,
                        collate_fn=collate, persistent_workers=False)
    it = iter(loader)
    finish(next(it))  # worker start-up is not timed
    start = time.perf_counter()
    images = 0
    for batch in it:
        out = finish(batch)
        images += out if isinstance(out, int) else out.shape[0]
    return images / (time.perf_counter() - start)


def machine():
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}; {os.cpu_count()} logical CPUs, load avg {os.getloadavg()[0]:.1f}; torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), torchvision {torchvision.__version__}, Pillow {PIL.__version__} "
            f"(libjpeg-turbo {features.version('libjpeg_turbo') or 'no'}), simplejpeg {_simplejpeg_version()}")


def _simplejpeg_version():
    try:
        import simplejpeg
    except ImportError:
        return "not installed (cltrain falls back to Pillow)"
    return simplejpeg.__version__


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, help="folder with train/<class>/<image> (default: the demo folder)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batches", type=int, default=20, help="timed batches per loader and repeat")
    p.add_argument("--repeats", type=int, default=1, help="rounds over all loaders; the median is shown")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    root = args.root or make_demo_dataset("/tmp/cltrain-bench-demo", train_per_class=40, val_per_class=1)
    split = root / "train" if (root / "train").is_dir() else root
    samples = find_samples(split, find_classes(split))
    print(f"{len(samples)} images under {split}; batch {args.batch_size}, {args.workers} worker(s), "
          f"{args.batches} timed batches x {args.repeats} repeat(s), crop {args.size}")
    print(machine())
    rates: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for name, (fn, collate, finish) in methods(args.size).items():
            rates.setdefault(name, []).append(
                run(samples, fn, collate, finish, args.batch_size, args.workers, args.batches, args.seed + r))
    med = {k: statistics.median(v) for k, v in rates.items()}
    names = list(med)
    print(f"\n{'loader':<18}{'img/s':>9}" + "".join(f"{'vs ' + n.split()[0]:>9}" for n in names[1:]))
    for name in names:
        print(f"{name:<18}{med[name]:>9.0f}" + "".join(f"{med[name] / med[o]:>9.2f}" for o in names[1:]))
    a = med[names[0]]
    print(f"\ncltrain vs targets: {a / med[names[1]]:.2f}x (b) [target 2.0], {a / med[names[2]]:.2f}x (c) [1.3], "
          f"{a / med[names[3]]:.2f}x (d) [0.7]")


if __name__ == "__main__":
    main()
