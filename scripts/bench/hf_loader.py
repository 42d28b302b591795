"""Loading a Hugging Face image dataset: the pipeline Hugging Face documents against cltrain's, and cltrain's folder loader.

The same real photographs (``scripts/bench/photo_folder.py``), as a folder and as a ``datasets``
dataset written with ``save_to_disk`` whose rows hold the files' bytes and a ``ClassLabel``; images per
second of a training batch (RandomResizedCrop 224 + flip, normalised channels_last float32 in this
process), the same sample order and batch size for every loader:

  (a) HF docs      ``dataset.set_transform``: Pillow decodes each row (``datasets.Image``), torchvision's
                   RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize; a ``DataLoader`` stacks
                   the tensors, then ``.contiguous(memory_format=torch.channels_last)``
  (b) cltrain hf   ``HFImageDataset`` (the rows' bytes to libjpeg-turbo, crops into the batch) +
                   ``NHWCCollate`` normalising into the channels_last batch, as ``data=hf`` loads
  (c) cltrain dir  ``ImageFolderDataset`` on the files, the rest as (b): as ``data=imagenet`` loads

Each configuration is timed with the same worker processes for all three (``--workers``), and (b)
and (c) also with cltrain's own plan for this machine (``loading_plan``: on 2 cores no worker
process and 2 decode threads, the next batch decoding while one is used). Interleaved repeats
(``cltrain.timing.rounds.interleaved``: the order rotating, the same samples for every loader in a
round), the median; the first batch of each loader (worker start-up) is not timed.

    python -m scripts.bench.hf_loader --photos /tmp/cltrain-photos --workers 2 --repeats 5
    python -m scripts.bench.hf_loader --photos /tmp/p --photos-count 64 --batches 2 --repeats 1   # a quick check
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from cltrain.data import ImageFolderDataset, NHWCCollate, train_transform
from cltrain.data.hf_dataset import HFImageDataset
from cltrain.data.image_folder_dataset import find_classes, find_samples
from cltrain.data.loader_threads import loading_plan
from cltrain.data.normalize import ImageNormalizer
from cltrain.timing.report import table
from cltrain.timing.rounds import interleaved
from cltrain.timing.stats import spread
from scripts.bench.loader import loader_machine_line, loader_rate, torchvision_train
from scripts.bench.photo_folder import make_photo_folder


def save_as_hf(samples: list[tuple[str, int]], classes: list[str], out: Path) -> Path:
    """The files of ``samples`` as a ``datasets`` dataset (``save_to_disk``): each row the file's bytes and its label."""
    import datasets

    if not (out / "dataset_dict.json").is_file():
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
        rows = {"image": [{"bytes": Path(p).read_bytes(), "path": Path(p).name} for p, _ in samples],
                "label": [y for _, y in samples]}
        datasets.DatasetDict(train=datasets.Dataset.from_dict(rows, features=features)).save_to_disk(str(out))
    return out


def hf_documented(dataset: Any, size: int) -> tuple[Dataset, Callable, Callable]:
    """Hugging Face's image-classification recipe: ``set_transform`` with torchvision transforms on Pillow images."""
    tv = torchvision_train(size)

    def transform(batch: dict) -> dict:
        batch["pixel_values"] = [tv(img.convert("RGB")) for img in batch["image"]]
        del batch["image"]
        return batch

    dataset = dataset.with_transform(transform)

    def collate(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([r["pixel_values"] for r in rows]), torch.tensor([r["label"] for r in rows])

    return dataset, collate, lambda b: b[0].contiguous(memory_format=torch.channels_last)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--photos", type=Path, default=Path(tempfile.gettempdir()) / "cltrain-photos")
    p.add_argument("--photos-count", type=int, default=400, help="training images when --photos makes the folder")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes of every loader")
    p.add_argument("--batches", type=int, default=10, help="timed batches per loader and repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--size", type=int, default=224)
    args = p.parse_args(argv)
    import datasets

    root = make_photo_folder(args.photos, train=args.photos_count, val=max(1, args.photos_count // 10))
    classes = find_classes(root / "train")
    samples = find_samples(root / "train", classes)
    saved = save_as_hf(samples, classes, root.parent / f"{root.name}-hf")
    split = datasets.load_from_disk(str(saved))["train"]
    plan = loading_plan()
    print(f"{len(samples)} photographs under {root / 'train'} and in {saved}; batch {args.batch_size}, crop {args.size}, "
          f"{args.batches} timed batches x {args.repeats} repeats; cltrain's plan here: {plan[0]} workers x {plan[1]} threads")
    print(loader_machine_line(torch.device("cpu")))

    def cltrain_rows(workers: int, threads: int) -> dict[str, tuple]:
        collate = NHWCCollate(normalize=ImageNormalizer(), threads=threads)
        return {"(b) cltrain hf": (HFImageDataset(split, train_transform(args.size), threads=threads), collate),
                "(c) cltrain dir": (ImageFolderDataset(root / "train", train_transform(args.size), threads=threads), collate)}

    configs = {f"{args.workers} workers (all)": (args.workers, 1),
               f"cltrain's plan ({plan[0]} workers x {plan[1]} threads)": plan}
    cases = {}
    for config, (workers, threads) in configs.items():
        rows = {"(a) HF docs": hf_documented(split, args.size)} if workers == args.workers else {}
        rows.update({k: (*v, lambda b: b[0]) for k, v in cltrain_rows(workers, threads).items()})
        cases.update({(config, name): (lambda r, row=row, workers=workers: loader_rate(
            *row, args.batch_size, workers, args.batches, seed=r, decode_ahead=True))
                      for name, row in rows.items()})
    rates = interleaved(cases, args.repeats, with_round=True)
    med = {k: spread(v).median for k, v in rates.items()}
    hf_docs = med[(next(iter(configs)), "(a) HF docs")]
    print("\n" + table(["configuration", "loader", "img/s", "vs (a)", "vs (c)"],
                       [[config, name, f"{v:.0f}", f"{v / hf_docs:.2f}", f"{v / med[(config, '(c) cltrain dir')]:.2f}"]
                        for (config, name), v in med.items()], align="llrrr"))
    best_hf = max(v for (c, n), v in med.items() if n == "(b) cltrain hf")
    same = med[(next(iter(configs)), "(b) cltrain hf")]
    print(f"cltrain hf: {same / hf_docs:.2f}x the HF pipeline with the same workers, {best_hf / hf_docs:.2f}x with its "
          f"own plan [target 2]; {min(med[(c, '(b) cltrain hf')] / med[(c, '(c) cltrain dir')] for c in configs):.2f}x "
          "the folder loader at worst [target 0.9]")


if __name__ == "__main__":
    main()
