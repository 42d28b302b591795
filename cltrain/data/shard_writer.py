"""One shard of a pack (``cltrain.data.pack``): its files read and checked once, written into a tar with its index.

``CheckedReader`` reads each file once and checks the bytes with ``cltrain-data-check``'s check
(``cltrain.data.check.check_bytes``), on worker processes a shard's files at a time, or in this
process file by file. ``write_shard`` writes the files that pass into one WebDataset tar
(``<key>.<ext>`` the file's own bytes, ``<key>.cls`` the label, ``<key>.path`` the file's path),
atomically, and returns the tar's index and the files left out with their reasons.
"""

from __future__ import annotations

import multiprocessing
import os
import tarfile
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path

import numpy as np

from cltrain.atomic import atomic_open
from cltrain.data.bad_samples import unreadable
from cltrain.data.check import check_bytes
from cltrain.data.errors import DataError

__all__ = ["INDEX_COLUMNS", "CheckedReader", "write_shard"]

#: The columns of a shard's ``.idx.npy`` (int64), one row per image; packs of format 1 have the first three.
INDEX_COLUMNS = ("offset", "size", "label", "path_offset", "path_size")


def _read_checked(path: str, mode: str, decoder: str) -> tuple[bytes | None, str | None]:
    """``(bytes, None)`` of a file that passes the check (``mode``, ``cltrain.data.check``), else ``(None, reason)``."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        return None, unreadable(err, path)
    reason = None if mode == "off" else check_bytes(data, mode == "full", decoder)
    return (None, reason) if reason else (data, None)


class CheckedReader:
    """Reads and checks the files of a shard: on ``workers`` processes, a shard's files at a time
    (``start`` the next shard's before writing this one's), or here, file by file, with none.

    Args:
        mode: the check (``cltrain.data.check``): ``"full"``, ``"quick"`` or ``"off"``.
        decoder: the JPEG decoder the full check decodes with.
        workers: processes (0: this one); ``close`` ends them.
    """

    def __init__(self, mode: str, decoder: str, workers: int) -> None:
        self.read = partial(_read_checked, mode=mode, decoder=decoder)
        self.workers = workers if mode != "off" else 0  # reading alone gains nothing from processes
        self.pool = multiprocessing.get_context().Pool(self.workers) if self.workers > 0 else None

    def start(self, paths: list[str]) -> Callable[[], Iterable[tuple[bytes | None, str | None]]]:
        """Begin reading ``paths``; the result gives their ``(bytes, reason)`` in order."""
        if self.pool is None:
            return lambda: map(self.read, paths)  # lazily: the shard's file is open while each is read
        result = self.pool.map_async(self.read, paths, chunksize=max(1, len(paths) // (self.workers * 4)))
        return result.get

    def close(self) -> None:
        """End the worker processes."""
        if self.pool is not None:
            self.pool.terminate()


def write_shard(path: Path, samples: Sequence[tuple[str, int]], first_key: int,
                 read: Callable[[], Iterable[tuple[bytes | None, str | None]]]) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """Write one tar (atomically) of the samples that pass the check; returns its index (image offset,
    size, label, path offset, size per image) and the ``(path, reason)`` of those left out."""
    import webdataset as wds  # the `shards` extra; only packing needs it

    kept, skipped = [], []
    with atomic_open(path) as f:
        writer = wds.TarWriter(f, mtime=0.0)
        for i, ((src, label), (data, reason)) in enumerate(zip(samples, read())):
            if data is None:
                skipped.append((src, reason or "unreadable"))
                continue
            key = f"{first_key + i:09d}"
            ext = Path(src).suffix.lower().lstrip(".") or "img"
            writer.write({"__key__": key, ext: data, "cls": str(label).encode(), "path": os.fsencode(src)})
            kept.append((key, label))
        writer.close()
    members: dict[str, dict[str, tarfile.TarInfo]] = {}
    with tarfile.open(path) as tar:  # read the offsets back from the tar itself; the shard counts once its index exists
        for m in tar.getmembers():
            key, _, ext = m.name.partition(".")
            members.setdefault(key, {})[ext] = m
    index = np.zeros((len(kept), 5), np.int64)
    for i, (key, label) in enumerate(kept):
        stored = members.get(key, {})
        image = next((m for ext, m in stored.items() if ext not in ("cls", "path")), None)
        if image is None or "path" not in stored:
            raise DataError(f"pack: {path} lacks sample {key}; delete it and run again.")
        index[i] = (image.offset_data, image.size, label, stored["path"].offset_data, stored["path"].size)
    return index, skipped
