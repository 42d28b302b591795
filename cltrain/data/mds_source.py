"""Mosaic MDS shards (``streaming.MDSWriter``) through the NHWC path: each sample's image column, undecoded.

``MDSImages`` reads one split (``<root>/<split>/index.json`` and its ``shard.NNNNN.mds`` files, a folder or a URL)
with Mosaic's own shard reader (``MDSReader``: its column layout) and its offsets, the image column's encoding read as
``bytes`` (Mosaic would decode a ``jpeg`` or ``png`` column with PIL), so the loader's decoder writes each image
straight into its NHWC batch slot. A URL's shards come through the node's shard cache (``cltrain.data.shard_cache``:
once per node, bounded, shared by ranks and workers, each file under its version in the store), not through Mosaic's
``StreamingDataset``: no shared memory is made (Mosaic's is left behind after Ctrl-C, streaming #781), and the
DataModule's own sampler orders the samples: each once per epoch over the ranks, an exact resume mid-epoch, also on
another number of ranks. A sample's bytes are read from the file the cache gives (``MDSReader`` would open
``<split>/shard.NNNNN.mds`` under a folder, not the cached version), at the offsets Mosaic's layout puts them.

Every shard the index names is checked at setup (the store's listing, or the folder): a shard missing or shorter than
the index says (an upload cut short) is one line naming it, before the first step.

Shards written with ``compression`` are not read (write them uncompressed: JPEGs do not compress). Needs
``pip install 'cltrain[mds]'`` (mosaicml-streaming).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cltrain.data.bad_samples import NamedSplit
from cltrain.data.errors import DataError, StorageError
from cltrain.data.image_samples import ImageSamples
from cltrain.data.remote import RemoteError, is_url, join, open_fs, redact, remote_error
from cltrain.data.shard_cache import ShardCache

__all__ = ["MDSImages"]

#: MDS column encodings that hold an image file's bytes.
IMAGE_ENCODINGS = ("jpeg", "png", "bytes")
#: MDS column encodings that hold an integer.
INT_ENCODINGS = ("int", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
#: What to do about a shard missing or cut short, after "the MDS dataset at <root> is incomplete: ".
REMAKE = ("copy or upload its folder again whole, as MDSWriter wrote it (index.json and every shard it names), or "
          "write it again with streaming.MDSWriter")


def _index(root: str, split: str) -> dict:
    url = join(root, split, "index.json")
    try:
        if is_url(url):
            fs, path = open_fs(url, quick=True)
            return json.loads(fs.cat_file(path))
        with open(url, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise DataError(f"{redact(url)}: not found: {redact(join(root, split))} is not an MDS dataset (written by "
                        "streaming.MDSWriter, with an index.json); check the URL and the split folder.") from None
    except Exception as err:  # noqa: BLE001 - one line, whatever the store says
        raise remote_error(err, url, "the MDS index") from None


class MDSImages(NamedSplit, ImageSamples):
    """One split of an MDS dataset as ``(transform(image), label)`` samples (see the module docstring).

    Args:
        root: a folder or a URL holding ``<split>/index.json``.
        split: the split's folder.
        transform: bytes -> HWC uint8.
        image_key: the image column (``None``: the first ``jpeg``, ``png`` or ``bytes`` column).
        label_key: the label column (``None``: the first integer column).
        cache_dir: the node's shard cache for a URL (as ``ShardsDataModule``'s).
        cache_limit: its size.
        bad_files: ``"raise"`` or ``"skip"``.
        skip_log: the skipped-files list.
        threads: decode threads per loading process.

    Raises:
        DataError: ``mosaicml-streaming`` missing, no MDS dataset there, compressed shards, no image or label column.
        StorageError: a shard the index names is missing or cut short (a ``RemoteError`` for a URL; its store's
            listing says so, where it lists).
    """

    def __init__(self, root: str | os.PathLike, split: str, transform: Callable[..., Any], image_key: str | None = None,
                 label_key: str | None = None, cache_dir: str | None = None, cache_limit: int | str | None = None,
                 bad_files: str = "raise", skip_log: str | os.PathLike | None = None, threads: int = 1) -> None:
        try:
            from streaming.base.format.mds.reader import MDSReader
        except ImportError:
            raise DataError("MDS datasets need Mosaic's reader: pip install 'cltrain[mds]' (mosaicml-streaming).") from None
        self._set_policy(bad_files, skip_log)
        self.root, self.split, self.transform, self.threads = str(root).rstrip("/"), split, transform, max(1, threads)
        self.where = redact(self.root)
        incomplete = f"the MDS dataset at {self.where} is incomplete: {REMAKE}"
        self.cache = ShardCache(self.root, cache_dir, cache_limit, incomplete) if is_url(self.root) else None
        shards = _index(self.root, split).get("shards", [])
        if not shards:
            raise DataError(f"{redact(join(self.root, split))}: its index.json lists no shards.")
        first = shards[0]
        if any(s.get("compression") for s in shards):
            raise DataError(f"{redact(join(self.root, split))}: its shards are compressed ({first.get('compression')}); "
                            "cltrain reads uncompressed MDS shards: write them with compression=None.")
        columns = dict(zip(first["column_names"], first["column_encodings"]))
        self.image_key = image_key or next((c for c, e in columns.items() if e in IMAGE_ENCODINGS), None)
        self.label_key = label_key or next((c for c, e in columns.items() if e in INT_ENCODINGS), None)
        pixels = self.image_key or next((c for c, e in columns.items() if e == "pil"), None)  # Mosaic's decoded image
        if pixels in columns and columns[pixels] not in IMAGE_ENCODINGS:
            raise DataError(f"{redact(join(self.root, split))}: its column {pixels!r} holds {columns[pixels]!r} "
                            f"({'decoded pixels' if columns[pixels] == 'pil' else 'no image file'}), not an image "
                            "file's bytes; write the files' bytes (a 'jpeg', 'png' or 'bytes' column) with MDSWriter.")
        if self.image_key not in columns or self.label_key not in columns:
            raise DataError(f"{redact(join(self.root, split))}: no {'image' if self.image_key not in columns else 'integer label'} "
                            f"column among {columns}; pass image_key=<column> and label_key=<column>.")
        self.readers = []
        for shard in shards:  # the image column read as plain bytes: Mosaic's layout, cltrain's decoder
            obj = {**shard, "column_encodings": ["bytes" if c == self.image_key else e
                                                 for c, e in zip(shard["column_names"], shard["column_encodings"])]}
            self.readers.append(MDSReader.from_json(self.root, split, obj))
        self.shards = [f"{split}/{r.raw_data.basename}" for r in self.readers]  # names in the root
        self.starts = [0]
        for shard in shards:
            self.starts.append(self.starts[-1] + int(shard["samples"]))
        for name, reader in zip(self.shards, self.readers):
            flaw = self.cache.flaw(name, reader.raw_data.bytes) if self.cache is not None else \
                _flaw(Path(self.root) / name, reader.raw_data.bytes)
            if flaw:
                raise self._incomplete(name, flaw)

    def __len__(self) -> int:
        return self.starts[-1]

    def source(self, index: int) -> tuple[bytes, int]:
        """The image file bytes of sample ``index`` and its label (its shard fetched first, for a URL)."""
        k = bisect.bisect_right(self.starts, int(index)) - 1
        reader = self.readers[k]
        sample = reader.decode_sample(self._sample_data(k, int(index) - self.starts[k]))
        return bytes(sample[self.image_key]), int(sample[self.label_key])

    def _sample_data(self, k: int, i: int) -> bytes:
        """The bytes of sample ``i`` of shard ``k``, as ``MDSReader.get_sample_data`` reads them (after the sample
        count, a ``uint32`` offset per sample and the end), from the shard's file: the cache's, for a URL.

        Raises:
            StorageError: the shard's file is missing or shorter than its offsets say (never a bad sample to skip).
        """
        name, size = self.shards[k], self.readers[k].raw_data.bytes
        for evicted in (False, True):
            path = self.cache.get(name, size) if self.cache is not None else Path(self.root) / name
            try:
                with open(path, "rb", buffering=0) as f:
                    begin, end = (int(v) for v in np.frombuffer(os.pread(f.fileno(), 8, (1 + i) * 4), np.uint32))
                    data = os.pread(f.fileno(), end - begin, begin)
            except FileNotFoundError:
                if self.cache is not None and not evicted:
                    continue  # evicted between its fetch and this open: fetched again
                raise self._incomplete(name, "missing") from None
            except (OSError, ValueError) as err:
                raise StorageError(f"{redact(join(self.root, name))}: cannot be read ({type(err).__name__}: {err}).") \
                    from None
            if len(data) != end - begin:
                raise self._incomplete(name, _flaw(Path(path), size) or "shorter than its offsets say (cut short)")
            return data
        raise AssertionError(name)  # not reached

    def _incomplete(self, name: str, flaw: str) -> StorageError:
        """One line: shard ``name`` is ``flaw`` (missing, cut short), and the fix."""
        error = RemoteError if self.cache is not None else StorageError
        return error(f"{redact(join(self.root, name))}: {flaw}; the MDS dataset at {self.where} is incomplete: "
                     f"{REMAKE}.")


def _flaw(path: Path, needs: int) -> str | None:
    """What is wrong with the local shard ``path``, which must hold ``needs`` bytes (``ShardCache.flaw``'s words)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    return f"{size} bytes where {needs} are needed (cut short)" if size < needs else None
