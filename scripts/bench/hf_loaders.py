"""Hugging Face's documented ``datasets`` image pipeline against cltrain's ``HFImageDataset`` and folder loader on
the same photographs: ``python -m scripts.bench.loaders --tables hf`` (scripts/bench/loaders.py runs it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cltrain.data import ImageFolderDataset, NHWCCollate, train_transform
from cltrain.data.loader_threads import loading_plan
from cltrain.data.normalize import ImageNormalizer
from cltrain.timing.report import table
from cltrain.timing.rounds import interleaved
from cltrain.timing.stats import spread
from scripts.bench.loaders import loader_rate, torchvision_train
from scripts.bench.photo_folder import save_as_hf

__all__ = ["hf_documented", "hf_table"]


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


def hf_table(split: Path, args: argparse.Namespace) -> dict[tuple[str, str], float]:
    """(a) Hugging Face's documented pipeline, (b) cltrain's ``HFImageDataset`` and (c) its folder loader on the same
    photographs, with ``--workers`` worker processes each, then (b) and (c) with cltrain's own plan."""
    import datasets

    from cltrain.data.hf_dataset import HFImageDataset

    saved = save_as_hf(split, split.parent.parent / f"{split.parent.name}-hf")
    rows_of = datasets.load_from_disk(str(saved))["train"]
    plan = loading_plan()
    print(f"\n{split} as a datasets dataset in {saved}; cltrain's plan here: {plan[0]} workers x {plan[1]} threads")
    configs = {f"{args.workers} workers (all)": (args.workers, 1),
               f"cltrain's plan ({plan[0]} workers x {plan[1]} threads)": plan}
    cases = {}
    for config, (workers, threads) in configs.items():
        collate = NHWCCollate(normalize=ImageNormalizer(), threads=threads)
        rows = {"(a) HF docs": hf_documented(rows_of, 224)} if workers == args.workers else {}
        rows["(b) cltrain hf"] = (HFImageDataset(rows_of, train_transform(224), threads=threads), collate, lambda b: b[0])
        rows["(c) cltrain dir"] = (ImageFolderDataset(split, train_transform(224), threads=threads), collate,
                                   lambda b: b[0])
        cases.update({(config, name): (lambda r, row=row, workers=workers: loader_rate(
            *row, args.batch_size, workers, args.batches, seed=r, decode_ahead=True)) for name, row in rows.items()})
    med = {k: spread(v).median for k, v in interleaved(cases, args.repeats, with_round=True).items()}
    first = next(iter(configs))
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
