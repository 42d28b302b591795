"""Loader throughput: cltrain's NHWC path against torchvision's, timm's and plain decoding.

Images per second on the same JPEG folder, batch size, worker count and sample order:

  (a) cltrain     train_transform (given the path: libjpeg-turbo + torch resize) + NHWCCollate normalising each
                  image into the channels_last float32 batch (for a GPU: uint8 batches, normalize() on the device)
  (b) torchvision RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize, default_collate, then
                  .contiguous(memory_format=torch.channels_last)
  (c) timm        RandomResizedCrop, flip, PILToTensor + timm.data.fast_collate, then
                  float().sub_(mean).div_(std) and .contiguous(memory_format=channels_last)
  (d) decode      read the file + simplejpeg.decode_jpeg of the whole image and nothing else: the bar to beat

The first batch of each loader (worker start-up) is not timed (``cltrain.timing.rounds.rate_after_first``);
``--repeats`` rounds run the loaders in turn, the order rotating, each round the same samples for every loader.
``--photos DIR`` times a folder of real photographs (``scripts/bench/photo_folder.py``: ``pip install
'cltrain[bench]'``); without it and without --root, the demo folder. ``--augment`` adds a cltrain row with
TrivialAugmentWide in the workers and random erasing + mixup on the batch; ``--whole`` a cltrain row decoding whole
images. ``--device cuda`` also times each loader's whole path to the GPU (pinned batches, one non-blocking copy,
normalisation and layout on the GPU, synchronised before the clock stops).

    python -m scripts.bench.loader --photos /tmp/cltrain-photos       # batch 64, 1 worker
    python -m scripts.bench.loader --root /data/imagenet --workers 4 --batches 50
    python -m scripts.bench.loader --photos /tmp/p --batches 3 --batch-size 16   # a quick check
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from PIL import Image, features
from torch.utils.data import DataLoader, Dataset, RandomSampler, default_collate
from torchvision import transforms as T

from cltrain.data import IMAGENET_MEAN, IMAGENET_STD, NHWCCollate, make_demo_dataset, normalize, train_transform
from cltrain.data.decoders import jpeg_roi
from cltrain.data.image_folder_dataset import find_classes, find_samples
from cltrain.data.normalize import ImageNormalizer
from cltrain.data.prefetch import PrefetchDataLoader
from cltrain.timing.machine import machine, machine_line
from cltrain.timing.report import table
from cltrain.timing.rounds import interleaved, rate_after_first
from cltrain.timing.stats import spread
from scripts.bench.photo_folder import make_photo_folder


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


class DecodeWhole:
    """Read the file and decode the whole image with simplejpeg (accurate defaults): the bar."""

    takes_paths = True

    def __call__(self, path):
        import simplejpeg

        with open(path, "rb") as f:
            return simplejpeg.decode_jpeg(f.read())


def torchvision_train(size: int) -> T.Compose:
    """torchvision's documented training transform: RandomResizedCrop, flip, ToTensor, Normalize."""
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def methods(size, device, augment=False, num_classes=1000, whole=False):
    """name -> (per-image fn, collate, finish(batch) -> images or a count). ``finish`` does what
    the step would get: normalised channels_last float on ``device`` (copied there if CUDA)."""
    from timm.data.loader import fast_collate

    cuda = device.type == "cuda"
    m255, s255 = (torch.tensor(v, device=device).view(1, 3, 1, 1) * 255 for v in (IMAGENET_MEAN, IMAGENET_STD))
    move = (lambda b: [t.to(device, non_blocking=True) for t in b]) if cuda else (lambda b: b)  # pinned by the loader
    # On the CPU the collate normalises each image into the batch (as ImageFolderDataModule does there);
    # for a GPU the loader hands over uint8 and normalize() runs on the device.
    cltrain_row = ((train_transform(size), NHWCCollate(), lambda b: normalize(move(b)[0])) if cuda
                   else (train_transform(size), NHWCCollate(normalize=ImageNormalizer()), lambda b: b[0]))
    rows = {
        "(a) cltrain": cltrain_row,
        "(b) torchvision": (torchvision_train(size), default_collate,
                            lambda b: move(b)[0].contiguous(memory_format=torch.channels_last)),
        "(c) timm": (T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()]), fast_collate,
                     lambda b: move(b)[0].float().sub_(m255).div_(s255).contiguous(memory_format=torch.channels_last)),
    }
    if not cuda:
        rows["(d) decode only"] = (DecodeWhole(), len, lambda b: b)
    if whole:  # the same loader decoding whole images (cltrain before region decoding)
        t = train_transform(size)
        t.region = False
        rows["(a0) cltrain whole"] = (t, *cltrain_row[1:])
    if augment:
        from cltrain.data.augment_ops import MixupCutmix, RandomErasing

        erase, mix = RandomErasing(0.25), MixupCutmix(num_classes, mixup_alpha=0.8, cutmix_alpha=1.0)

        def finish_aug(b):
            images, targets = move(b)
            return mix(erase(normalize(images)), targets)[0]

        rows["(e) cltrain+aug"] = (train_transform(size, augment="trivialaugment"), NHWCCollate(), finish_aug)
    return rows


def loader_rate(dataset, collate, finish, batch_size, workers, batches, seed, device=torch.device("cpu"), **options):
    """Images per second of one pass of a loader over ``dataset`` (``batches`` batches after an untimed first one,
    samples drawn with ``seed``); ``finish(batch)`` does what the step would (images or a count). ``options`` go to
    the loader: with any, cltrain's ``PrefetchDataLoader`` (``decode_ahead=``), else torch's ``DataLoader``."""
    sampler = RandomSampler(range(len(dataset)), replacement=True, num_samples=batch_size * (batches + 1),
                            generator=torch.Generator().manual_seed(seed))
    loader = (PrefetchDataLoader if options else DataLoader)(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, collate_fn=collate,
        persistent_workers=False, pin_memory=device.type == "cuda", **options)
    torch.manual_seed(seed)  # the same crops for each loader with workers=0
    # on CUDA the clock waits for the copies and kernels, not just their launch
    return rate_after_first(loader, lambda b: out if isinstance(out := finish(b), int) else out.shape[0],
                            sync=device).per_second


def time_loader(samples, fn, collate, finish, batch_size, workers, batches, seed, device):
    """Images per second of one loader of ``methods`` over the files ``samples``."""
    return loader_rate(Files(samples, fn), collate, finish, batch_size, workers, batches, seed, device)


def loader_machine_line(device: torch.device) -> str:
    """The machine (``cltrain.timing.machine``) with what a loader figure depends on: Pillow, its libjpeg-turbo,
    simplejpeg, and the region decoder."""
    region = f"libturbojpeg {jpeg_roi.library_path()}" if jpeg_roi.available() else "off (no libturbojpeg 3)"
    return (machine_line(machine(device, packages=("torch", "torchvision", "Pillow", "simplejpeg", "datasets")))
            + f"; Pillow's libjpeg-turbo {features.version('libjpeg_turbo') or 'no'}; region decode {region}")


def ratio_table(med: dict[str, float]) -> str:
    """Each loader's median images/second and its ratio to the reference loaders (b), (c) and (d)."""
    refs = [n for n in med if n[:3] in ("(b)", "(c)", "(d)")]
    return table(["loader", "img/s", *(f"vs {n.split()[0]}" for n in refs)],
                 [[n, f"{v:.0f}", *(f"{v / med[o]:.2f}" for o in refs)] for n, v in med.items()],
                 align="l" + "r" * (1 + len(refs)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, help="folder with train/<class>/<image> (default: the demo folder)")
    p.add_argument("--photos", type=Path, help="time a folder of real photographs, made here once if missing")
    p.add_argument("--photos-count", type=int, default=400, help="training images when --photos makes the folder")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batches", type=int, default=20, help="timed batches per loader and repeat")
    p.add_argument("--repeats", type=int, default=1, help="rounds over all loaders; the median is shown")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--augment", action="store_true", help="add a cltrain row with TrivialAugment, erasing and mixup")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: also time the path to the GPU")
    p.add_argument("--whole", action="store_true", help="add a cltrain row that decodes whole images (no region)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here.")
    if args.photos is not None:
        root = make_photo_folder(args.photos, train=args.photos_count, val=max(1, args.photos_count // 10))
    else:
        root = args.root or make_demo_dataset("/tmp/cltrain-bench-demo", train_per_class=40, val_per_class=1)
    split = root / "train" if (root / "train").is_dir() else root
    classes = find_classes(split)
    samples = find_samples(split, classes)
    print(f"{len(samples)} images under {split}; batch {args.batch_size}, {args.workers} worker(s), "
          f"{args.batches} timed batches x {args.repeats} repeat(s), crop {args.size}")
    print(loader_machine_line(device))
    cpu_decode = None
    for dev in [torch.device("cpu")] + ([device] if device.type == "cuda" else []):
        loaders = methods(args.size, dev, args.augment, len(classes), args.whole)
        rates = interleaved({name: (lambda r, m=m: time_loader(samples, *m, args.batch_size, args.workers, args.batches,
                                                                args.seed + r, dev)) for name, m in loaders.items()},
                            args.repeats, with_round=True)
        med = {k: spread(v).median for k, v in rates.items()}
        # decode-only has no GPU path: the CPU figure stands for it in the ratios
        cpu_decode = med.setdefault("(d) decode only", cpu_decode)
        a = med["(a) cltrain"]
        print(f"\nto {dev} (normalised channels_last float32 {'on the GPU' if dev.type == 'cuda' else 'in this process'})"
              f"\n\n{ratio_table(med)}\n\ncltrain: {a / med['(b) torchvision']:.2f}x torchvision [target 2.5], "
              f"{a / med['(c) timm']:.2f}x timm, {a / med['(d) decode only']:.2f}x whole-image simplejpeg decode "
              "[target 0.9, stretch 1.0]")


if __name__ == "__main__":
    main()
