"""Shards against the same images as files: the training loader's images/second, one run.

The same ``ImageFolderDataModule`` settings (batch, workers, crop) read the folder and its
WebDataset pack (``python -m cltrain.data.pack``), alternating per round so both see the same
machine state; the first batch of each pass (worker start-up) is not timed. Prints each round,
the median ratio shards / files, and the machine.

    python scripts/bench_shards.py                          # the demo folder, packed once under bench_out/
    python scripts/bench_shards.py --root /data/imagenet-subset --pack /data/imagenet-subset-shards
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cltrain.data import ImageFolderDataModule, ShardsDataModule, make_demo_dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from bench_loader import machine  # noqa: E402


def images_per_second(datamodule: ImageFolderDataModule, batches: int) -> float:
    datamodule.setup("fit")
    seen, start = 0, None
    for k, (images, _) in enumerate(datamodule.train_dataloader()):
        if k == 0:
            start = time.perf_counter()  # after the first batch: workers are up
            continue
        seen += images.shape[0]
        if k == batches:
            break
    return seen / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help="ImageNet-layout folder (default: a 1000-image demo folder)")
    parser.add_argument("--pack", type=Path, default=None, help="its pack (made with cltrain.data.pack when missing)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batches", type=int, default=14, help="timed batches per pass")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args(argv)
    root = args.root or make_demo_dataset(Path("bench_out/shards-demo"), train_per_class=100, val_per_class=10)
    pack = args.pack or Path(f"{root}-pack")
    if not (pack / "shards.json").is_file():
        subprocess.run([sys.executable, "-m", "cltrain.data.pack", str(root), str(pack), "--no-progress"], check=True)
    settings = dict(batch_size=args.batch_size, num_workers=args.workers, persistent_workers=False,
                    image_size=args.size, val_resize_size=round(args.size * 8 / 7), check_val="off")
    ratios = []
    for r in range(args.rounds):
        files = images_per_second(ImageFolderDataModule(root, **settings), args.batches)
        shards = images_per_second(ShardsDataModule(pack, **settings), args.batches)
        ratios.append(shards / files)
        print(f"round {r}: files {files:.0f} img/s, shards {shards:.0f} img/s, shards/files {shards / files:.2f}x",
              flush=True)
    print(f"median shards/files: {statistics.median(ratios):.2f}x ({args.rounds} rounds, batch {args.batch_size}, "
          f"{args.workers} worker(s), {args.size} px)\nMachine: {machine(torch.device('cpu'))}")


if __name__ == "__main__":
    main()
