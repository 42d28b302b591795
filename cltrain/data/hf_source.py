"""Opening a Hugging Face image dataset as users have it, and reading its rows: the source side of ``cltrain.data.hf_dataset``.

``open_dataset(root)`` opens a folder written by ``save_to_disk``, a folder of Parquet files (or any
folder ``datasets.load_dataset`` reads), or a Hub id (downloaded into the Hugging Face cache on first
use, read from it after; with ``HF_HUB_OFFLINE=1`` only the cache). ``split_names`` picks the training
and evaluation splits, ``columns`` the image and ``ClassLabel`` columns; a row's image is read
undecoded (``datasets.Image(decode=False)``: its encoded bytes, or the path of a local file). Needs
``pip install 'cltrain[hf]'`` (``datasets``); every problem is a one-line ``DataError``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cltrain.data.errors import DataError, EmptyImageError

__all__ = ["READS", "URL_FIX", "VAL_SPLITS", "columns", "is_hub_id", "open_dataset", "row_name", "row_source", "split_names", "undecoded"]

#: What the HF door reads (not a URL), and what to do with a dataset in object storage.
READS = "the HF door (data=hf) reads a local dataset folder or a Hub id"
URL_FIX = ("download it first (e.g. `aws s3 sync <URL> <folder>`, or datasets' load_from_disk with storage_options, "
           "then save_to_disk)")

#: The splits evaluated on, in the order they are looked for when ``val_split`` is not given.
VAL_SPLITS = ("validation", "val", "valid", "test")


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("Hugging Face datasets need the datasets package: pip install 'cltrain[hf]'.") from None
    return datasets


def is_hub_id(root: str | os.PathLike) -> bool:
    """Whether ``open_dataset`` takes ``root`` for a Hub id: no such local path, and ``name`` or ``owner/name``."""
    text = str(root)
    return not Path(os.path.expanduser(text)).exists() and re.fullmatch(r"[\w][\w.-]*(/[\w][\w.-]*)?", text) is not None


def open_dataset(root: str | os.PathLike, streaming: bool = False) -> Mapping[str, Any]:
    """The splits of ``root`` (a ``DatasetDict``, or an ``IterableDatasetDict`` when ``streaming``): a folder
    written by ``save_to_disk`` (a single ``Dataset`` is the split ``"train"``), any other local folder
    through ``datasets.load_dataset`` (a folder of Parquet files: the splits by file name), else a Hub id.

    Raises:
        DataError: ``datasets`` is not installed, or ``root`` cannot be opened (the reason in one line).
    """
    datasets = _datasets()
    folder = Path(os.path.expanduser(str(root)))
    try:
        if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
            loaded = datasets.load_from_disk(str(folder))
            splits = loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded)
            if streaming:  # contiguous shards, enough for the DataLoader's workers to share
                return datasets.IterableDatasetDict({k: v.to_iterable_dataset(num_shards=max(1, min(len(v), 64)))
                                                     for k, v in splits.items()})
            return splits
        return datasets.load_dataset(str(folder) if folder.is_dir() else str(root), streaming=streaming)
    except Exception as err:  # a missing Hub id, no network, a folder datasets does not read
        reason = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        if is_hub_id(root):
            raise DataError(f"{root}: cannot be opened as a Hub dataset ({reason}); a Hub id is read from the local "
                            "Hugging Face cache or downloaded (HF_HUB_OFFLINE=1: the cache only).") from None
        raise DataError(f"{root}: cannot be opened as a Hugging Face dataset ({reason}); pass a folder written by "
                        "save_to_disk or a folder of Parquet files.") from None


def split_names(splits: Mapping[str, Any], root: str | os.PathLike, train_split: str = "train",
                val_split: str | None = None) -> tuple[str, str]:
    """``(train, validation)`` split names of ``splits``; ``val_split=None`` takes the first of ``VAL_SPLITS`` there.

    Raises:
        DataError: a split is missing (the splits there are named).
    """
    have = sorted(splits)
    if train_split not in splits:
        raise DataError(f"{root}: no split {train_split!r} (it has {have}); pass train_split=<one of them>.")
    val = val_split if val_split is not None else next((s for s in VAL_SPLITS if s in splits), None)
    if val is None or val not in splits:
        raise DataError(f"{root}: no split {val or ' or '.join(VAL_SPLITS)!r} to evaluate on (it has {have}); "
                        "pass val_split=<one of them>.")
    return train_split, val


def columns(features: Mapping[str, Any], image_column: str | None = None, label_column: str | None = None,
            where: str = "the dataset") -> tuple[str, str, list[str]]:
    """``(image column, label column, class names)``: the named columns, or the first ``Image`` and the
    first ``ClassLabel`` feature.

    Raises:
        DataError: no such column, or not of that type (the features are named).
    """
    datasets = _datasets()
    kinds = {name: type(f).__name__ for name, f in features.items()}

    def pick(given: str | None, kind: type, what: str) -> str:
        if given is None:
            found = next((n for n, f in features.items() if isinstance(f, kind)), None)
            if found is None:
                raise DataError(f"{where} has no {kind.__name__} column (columns: {kinds}); pass {what}=<the {what[:-7]}>.")
            return found
        if given not in features or not isinstance(features[given], kind):
            raise DataError(f"{where}: {what}={given!r} is not a {kind.__name__} column (columns: {kinds}).")
        return given

    image = pick(image_column, datasets.Image, "image_column")
    label = pick(label_column, datasets.ClassLabel, "label_column")
    return image, label, list(features[label].names)


def undecoded(dataset: Any, image: str, label: str) -> Any:
    """``dataset`` with only the two columns, the images as ``{"bytes", "path"}`` (not decoded by ``datasets``)."""
    return dataset.select_columns([image, label]).cast_column(image, _datasets().Image(decode=False))


def row_source(row: Mapping[str, Any], image: str, label: str) -> tuple[bytes | str, int]:
    """The encoded bytes (or the local path) of a row's image, and its label."""
    value, target = row[image], row[label]
    if value is None:
        raise ValueError("the row has no image")
    data = value.get("bytes")
    if data is None:  # a path only where no bytes are stored: empty bytes are an empty file, not a cue to a path
        data = value.get("path")
    if data is None or data == "":
        raise ValueError("the row's image has neither bytes nor a path")
    if not data:
        raise EmptyImageError()
    if isinstance(data, str) and not os.path.isfile(data):  # datasets stores an empty file's bytes as none
        raise ValueError(f"the row's image has no bytes and its path {data!r} is no file here (an empty image file "
                         "when the dataset was made, or a path relative to another folder)")
    if target is None or target < 0:
        raise ValueError(f"the row has no label ({target})")
    return data, int(target)


def row_name(index: int | str, row: Mapping[str, Any], image: str) -> str:
    """``row <index> (<file name>)`` (the file name when the row has one)."""
    value = row.get(image)
    name = value.get("path") if isinstance(value, Mapping) else None
    return f"row {index}" + (f" ({name})" if name else "")
