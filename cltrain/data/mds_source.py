"""Mosaic MDS shards (``streaming.MDSWriter``) through the NHWC path: each sample's image column, undecoded.

``MDSImages`` reads one split (``<root>/<split>/index.json`` and its ``shard.NNNNN.mds`` files, a folder or a URL)
with Mosaic's own shard reader (``MDSReader``: its offsets and column layout), the image column's encoding read as
``bytes`` (Mosaic would decode a ``jpeg`` or ``png`` column with PIL), so the loader's decoder writes each image
straight into its NHWC batch slot. A URL's shards come through the node's shard cache (``cltrain.data.shard_cache``:
once per node, bounded, shared by ranks and workers), not through Mosaic's ``StreamingDataset``: no shared memory is
made (Mosaic's is left behind after Ctrl-C, streaming #781), and the DataModule's own sampler orders the samples:
each once per epoch over the ranks, an exact resume mid-epoch, also on another number of ranks.

Shards written with ``compression`` are not read (write them uncompressed: JPEGs do not compress). Needs
``pip install 'cltrain[mds]'`` (mosaicml-streaming).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Callable
from typing import Any

from cltrain.data.bad_samples import NamedSplit
from cltrain.data.errors import DataError
from cltrain.data.image_samples import ImageSamples
from cltrain.data.remote import is_url, join, open_fs, redact, remote_error
from cltrain.data.shard_cache import ShardCache

__all__ = ["MDSImages"]

#: MDS column encodings that hold an image file's bytes.
IMAGE_ENCODINGS = ("jpeg", "png", "bytes")
#: MDS column encodings that hold an integer.
INT_ENCODINGS = ("int", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


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
        self.cache = ShardCache(self.root, cache_dir, cache_limit) if is_url(self.root) else None
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
        if self.image_key not in columns or self.label_key not in columns:
            raise DataError(f"{redact(join(self.root, split))}: no {'image' if self.image_key not in columns else 'integer label'} "
                            f"column among {columns}; pass image_key=<column> and label_key=<column>.")
        dirname = str(self.cache.folder) if self.cache is not None else self.root
        self.readers = []
        for shard in shards:  # the image column read as plain bytes: Mosaic's layout, cltrain's decoder
            obj = {**shard, "column_encodings": ["bytes" if c == self.image_key else e
                                                 for c, e in zip(shard["column_names"], shard["column_encodings"])]}
            self.readers.append(MDSReader.from_json(dirname, split, obj))
        self.starts = [0]
        for shard in shards:
            self.starts.append(self.starts[-1] + int(shard["samples"]))

    def __len__(self) -> int:
        return self.starts[-1]

    def source(self, index: int) -> tuple[bytes, int]:
        """The image file bytes of sample ``index`` and its label (its shard fetched first, for a URL)."""
        k = bisect.bisect_right(self.starts, int(index)) - 1
        reader = self.readers[k]
        if self.cache is not None:
            self.cache.get(f"{self.split}/{reader.raw_data.basename}", reader.raw_data.bytes)
        sample = reader.decode_sample(reader.get_sample_data(int(index) - self.starts[k]))
        return bytes(sample[self.image_key]), int(sample[self.label_key])
