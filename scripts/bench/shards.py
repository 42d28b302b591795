"""Shards against the same images as files: the training loader's images/second, one run (the method:
docs/benchmarks.md#shards).

    python -m scripts.bench.shards                          # a 3000-image demo folder, packed once under bench_out/
    python -m scripts.bench.shards --root /data/imagenet-subset --pack /data/imagenet-subset-shards
"""

from __future__ import annotations

import hashlib
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from cltrain.data import ImageFolderDataModule, ShardsDataModule, make_demo_dataset
from scripts.bench.loaders import loader_machine_line
from scripts.harness import interleaved, options, rate_after_first, rotated, timed

#: The folder's validation files go unchecked, as a pack's were when it was made: the same work for both.
FILES_ONLY = {"check_val": "off"}


def images_per_second(datamodule: ImageFolderDataModule, batches: int) -> float:
    """Images per second of the training loader over ``batches`` batches, after the first (workers are up)."""
    datamodule.setup("fit")
    return rate_after_first(datamodule.train_dataloader(), lambda b: b[0].shape[0], limit=batches).per_second


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
    rng, pending = np.random.default_rng(0), {}
    chosen = [rng.choice(len(hs), settings["batch_size"], replace=False).tolist() for _ in range(batches)]

    def read(kind: str, b: int) -> float:
        torch.manual_seed(b)  # the same crops from both
        out = {}
        seconds = timed(lambda: out.setdefault("batch", hs.collate(fs.__getitems__([same[i] for i in chosen[b]]))
                                               if kind == "files" else hs[chosen[b]]))
        pending.setdefault(b, {})[kind] = out["batch"][0]
        if len(pending[b]) == 2 and not torch.equal(*pending.pop(b).values()):
            raise SystemExit(f"bench_shards: the pack {pack} does not hold the folder's images ({root}: a batch differs); "
                             "pack the folder again to another --pack.")
        return seconds

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # a pair per batch, which goes first alternating
        took = interleaved({kind: (lambda b, kind=kind: read(kind, b)) for kind in ("files", "shards")}, batches,
                           with_round=True)
    finally:
        torch.set_num_threads(threads)
    ratios = [f / h for f, h in zip(took["files"], took["shards"])]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return median, q1, q3


def main(argv: list[str] | None = None) -> None:
    parser = options(__doc__, batch_size=64, workers=1, batches=(40, "timed batches per pass"),
                     rounds=(3, "loader rounds (one pass each)"), paired=(60, "batches of the paired measurement"),
                     size=224)
    parser.add_argument("--root", type=Path, default=None, help="ImageNet-layout folder (default: a 3000-image demo folder)")
    parser.add_argument("--pack", type=Path, default=None, help="its pack (made with cltrain.data.pack when missing)")
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
    modules = {"files": lambda: ImageFolderDataModule(root, **settings, **FILES_ONLY),
               "shards": lambda: ShardsDataModule(pack, **settings)}
    rates = interleaved({kind: (lambda make=make: images_per_second(make(), args.batches))
                         for kind, make in modules.items()}, args.rounds)
    ratios = [h / f for f, h in zip(rates["files"], rates["shards"])]
    for r, (f, h) in enumerate(zip(rates["files"], rates["shards"])):
        print(f"round {r} ({rotated(list(modules), r)[0]} first): files {f:.0f} img/s, shards {h:.0f} img/s, "
              f"shards/files {h / f:.2f}x")
    print(f"median shards/files: {statistics.median(ratios):.2f}x ({args.rounds} rounds, batch {args.batch_size}, "
          f"{args.workers} worker(s), {args.size} px)\nMachine: {loader_machine_line()}")


if __name__ == "__main__":
    main()
