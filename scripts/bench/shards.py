"""Shards against the same images as files: the training loader's images/second, one run.

The same ``ImageFolderDataModule`` settings (batch, workers, crop) read the folder and its
WebDataset pack (``python -m cltrain.data.pack``), one pass each per round, the one that goes
first alternating between rounds; the first batch of each pass (worker start-up) is not
timed. On a shared 2-core machine one pass varies by +-10%, more than the difference looked
for, so a paired measurement comes first: in this process, with one thread as a worker has,
the same samples of each batch with the same crops (the same torch seed), read, decoded and
collated from the files and from the shards, alternately, the batches checked equal. Prints
its median per-batch ratio, then each loader round, the median ratio shards / files, and the
machine.

    python -m scripts.bench.shards                          # a 3000-image demo folder, packed once under bench_out/
    python -m scripts.bench.shards --root /data/imagenet-subset --pack /data/imagenet-subset-shards
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from cltrain.data import ImageFolderDataModule, ShardsDataModule, make_demo_dataset
from scripts.bench.loader import loader_machine_line
from scripts.timing import Stopwatch, rotated

#: The folder's validation files go unchecked, as a pack's were when it was made: the same work for both.
FILES_ONLY = {"check_val": "off"}


def images_per_second(datamodule: ImageFolderDataModule, batches: int) -> float:
    datamodule.setup("fit")
    seen, watch = 0, Stopwatch()
    for k, (images, _) in enumerate(datamodule.train_dataloader()):
        if k == 0:
            watch.start()  # after the first batch: workers are up
            continue
        seen += images.shape[0]
        if k == batches:
            break
    return seen / watch.elapsed()


def paired_ratio(root: Path, pack: Path, settings: dict, batches: int) -> tuple[float, float, float]:
    """Median, lower and upper quartile of per-batch (files seconds / shards seconds): the shards'
    speed relative to the files' for the same images and crops, DataLoader and workers aside."""
    settings = {**settings, "num_workers": 0}
    files, shards = ImageFolderDataModule(root, **settings, **FILES_ONLY), ShardsDataModule(pack, **settings)
    files.setup("fit")
    shards.setup("fit")
    fs, hs = files.train_set, shards.train_set
    by_bytes = {}
    for k, (path, _) in enumerate(fs.samples):
        with open(path, "rb") as f:
            by_bytes[hashlib.sha1(f.read()).digest()] = k
    same = [by_bytes.get(hashlib.sha1(hs.read(i)).digest()) for i in range(len(hs))]  # shard sample -> its file
    if None in same:
        raise SystemExit(f"bench_shards: the pack {pack} does not hold the folder's images ({root}: sample "
                         f"{same.index(None)} of its train split is not there); pack the folder again to another --pack.")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng, ratios = np.random.default_rng(0), []
    try:
        for b in range(batches):
            idx, seed, out, took = rng.choice(len(hs), settings["batch_size"], replace=False).tolist(), b, {}, {}
            for kind in rotated(("files", "shards"), b):
                torch.manual_seed(seed)
                with Stopwatch() as watch:
                    out[kind] = hs.collate(fs.__getitems__([same[i] for i in idx])) if kind == "files" else hs[idx]
                took[kind] = watch.seconds
            if not torch.equal(out["files"][0], out["shards"][0]):
                raise SystemExit(f"bench_shards: the pack {pack} does not hold the folder's images ({root}: a batch differs); "
                                 "pack the folder again to another --pack.")
            ratios.append(took["files"] / took["shards"])
    finally:
        torch.set_num_threads(threads)
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return median, q1, q3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help="ImageNet-layout folder (default: a 3000-image demo folder)")
    parser.add_argument("--pack", type=Path, default=None, help="its pack (made with cltrain.data.pack when missing)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batches", type=int, default=40, help="timed batches per pass")
    parser.add_argument("--rounds", type=int, default=3, help="loader rounds (one pass each)")
    parser.add_argument("--paired", type=int, default=60, help="batches of the paired measurement")
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args(argv)
    root = args.root or make_demo_dataset(Path("bench_out/shards-demo-3k"), train_per_class=300, val_per_class=10)
    pack = args.pack or Path(f"{root}-pack")
    if not (pack / "shards.json").is_file():
        subprocess.run([sys.executable, "-m", "cltrain.data.pack", str(root), str(pack), "--no-progress"], check=True)
    settings = dict(batch_size=args.batch_size, num_workers=args.workers, persistent_workers=False,
                    image_size=args.size, val_resize_size=round(args.size * 8 / 7))
    median, q1, q3 = paired_ratio(root, pack, settings, args.paired)
    print(f"paired, same images and crops, {args.paired} batches in one thread: shards/files {median:.3f}x "
          f"(quartiles {q1:.3f}-{q3:.3f})", flush=True)
    ratios = []
    for r in range(args.rounds):
        rate = {}
        for kind in rotated(("files", "shards"), r):
            module = (ImageFolderDataModule(root, **settings, **FILES_ONLY) if kind == "files"
                      else ShardsDataModule(pack, **settings))
            rate[kind] = images_per_second(module, args.batches)
        ratios.append(rate["shards"] / rate["files"])
        print(f"round {r} ({'files' if r % 2 == 0 else 'shards'} first): files {rate['files']:.0f} img/s, "
              f"shards {rate['shards']:.0f} img/s, shards/files {ratios[-1]:.2f}x", flush=True)
    print(f"median shards/files: {statistics.median(ratios):.2f}x ({args.rounds} rounds, batch {args.batch_size}, "
          f"{args.workers} worker(s), {args.size} px)\nMachine: {loader_machine_line(torch.device('cpu'))}")


if __name__ == "__main__":
    main()
