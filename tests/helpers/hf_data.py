"""Real Hugging Face ``datasets`` on disk for the tests: the same rows written with ``save_to_disk``, as a
folder of Parquet files, and into a ``datasets`` cache as a Hub id leaves it after a download."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from tests.helpers.data_fixtures import photo

#: The Hub id the cache is written for (no such dataset exists on the Hub).
HUB_ID = "cltrain-tests/tiny-images"


def image_rows(n: int, classes: int, size: tuple[int, int] = (64, 48), seed: int = 0,
               odd: dict[int, bytes] | None = None) -> tuple[list[dict], list[int]]:
    """``n`` image cells (``{"bytes", "path"}``: JPEGs of demo pictures, ``odd[i]`` for row ``i``) and labels."""
    rng = np.random.default_rng(seed)
    cells, labels = [], []
    for i in range(n):
        buf = io.BytesIO()
        photo(rng, size, i % classes).save(buf, format="JPEG", quality=85)
        cells.append({"bytes": (odd or {}).get(i, buf.getvalue()), "path": f"img_{i:04d}.jpg"})
        labels.append(i % classes)
    return cells, labels


def png_bytes(size: tuple[int, int] = (64, 48), mode: str = "RGBA") -> bytes:
    """A PNG of a demo picture in ``mode`` (goes through Pillow, as from a folder)."""
    buf = io.BytesIO()
    photo(np.random.default_rng(5), size).convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def write_hf_dataset(root: Path, splits: dict[str, tuple[list[dict], list[int]]], names: list[str],
                     parquet_files: int = 2) -> dict[str, Path]:
    """``splits`` (name -> cells, labels) as ``root/saved`` (``save_to_disk``), ``root/parquet``
    (``<split>-0000k-of-0000n.parquet``, the Hub's naming) and ``root/hub-cache`` (``HUB_ID`` prepared
    in a ``datasets`` cache, as ``load_dataset`` leaves it: read it with ``HF_HUB_OFFLINE=1`` and
    ``HF_DATASETS_CACHE`` pointing there)."""
    import datasets
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    dd = datasets.DatasetDict({s: datasets.Dataset.from_dict({"image": c, "label": y}, features=features)
                               for s, (c, y) in splits.items()})
    dd.save_to_disk(str(root / "saved"))
    files: dict[str, list[str]] = {}
    for split, ds in dd.items():
        for k in range(parquet_files):
            name = f"{split}-{k:05d}-of-{parquet_files:05d}.parquet"
            ds.shard(parquet_files, k, contiguous=True).to_parquet(str(root / "parquet" / name))
            files.setdefault(split, []).append(name)
    # The cache as a download of HUB_ID leaves it (datasets 3-5): <owner>___<name>/default/0.0.0/<hash>/
    built = Parquet(cache_dir=str(root / "build"), dataset_name=HUB_ID.split("/")[1], config_name="default", hash="0" * 16,
                    data_files=DataFilesDict.from_local_or_remote(files, base_path=str(root / "parquet")))
    built.download_and_prepare()
    dest = root / "hub-cache" / HUB_ID.replace("/", "___") / "default"
    dest.parent.mkdir(parents=True)
    shutil.move(str(Path(built.cache_dir).parents[1]), str(dest))
    shutil.rmtree(root / "build")
    return {"saved": root / "saved", "parquet": root / "parquet", "hub-cache": root / "hub-cache"}


def decoded(cell: dict) -> Image.Image:
    """A cell's image, as the Hugging Face pipeline decodes it (Pillow)."""
    return Image.open(io.BytesIO(cell["bytes"]))
