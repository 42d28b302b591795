"""One split of a shard pack (``cltrain.data.pack``) as a Dataset: samples read by offset, batches built in the worker.

A pack is WebDataset tar shards, an ``.idx.npy`` index beside each (offset, size, label per sample,
and where the path of the file it was packed from is stored), and ``shards.json`` (the manifest,
written last), in a local folder or in object storage (``s3://bucket/pack``: ``cltrain.data.shard_source``,
through the node's shard cache). ``ShardsDataset`` reads only the bytes of the samples it is asked for
(``os.pread`` on one descriptor per shard and process); with an index list it decodes a whole batch on its
decode threads and collates it, in the worker that reads it. A sample that cannot be read is named by its
file (a pack of format 1, which stored no paths: by its shard and place) and handled by the
``bad_files`` policy of every source (``cltrain.data.bad_samples``).
``cltrain.data.datamodules.shards`` wraps it for Lightning; ``cltrain.data.shard_sampler`` orders it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from cltrain.data.bad_samples import SkipsBadSamples, unreadable
from cltrain.data.collate import NHWCCollate
from cltrain.data.errors import BadImageError, StorageError
from cltrain.data.shard_source import MANIFEST, LocalPack, RemotePack, open_pack

__all__ = ["MANIFEST", "ShardsDataset", "read_manifest"]


class ShardsDataset(SkipsBadSamples, Dataset):
    """One split of a pack (``cltrain.data.pack``): ``dataset[i]`` is ``(HWC uint8, label)``,
    ``dataset[[i, j, ...]]`` a collated batch ``(images, targets)`` (or ``(images, targets, ids)``
    with ``with_ids``), built in the worker that reads it.

    Args:
        root: the pack's folder (holds ``shards.json``), or its URL (``s3://bucket/pack``, read through
            the node's shard cache with ``source``'s defaults).
        split: ``"train"``, ``"val"``, ...
        transform: JPEG bytes -> HWC uint8 (``cltrain.data.train_transform`` and
            ``eval_transform`` take bytes).
        collate: makes a batch of ``(image, label)`` pairs.
        with_ids: batches also carry the int64 sample indices.
        threads: decode the samples of a batch on this many threads of the reading process
            (``cltrain.data.loader_threads``); 1 decodes them one by one.
        bad_files: ``"raise"``: an unreadable sample raises ``BadImageError`` naming its file;
            ``"skip"``: the next readable sample is returned instead and the file listed in
            ``skip_log`` (``cltrain.data.bad_samples``).
        skip_log: file the skipped samples are appended to (``"skip"`` only); ``None``: none.
        source: where the bytes come from (``cltrain.data.shard_source.open_pack``: its cache folder, limit and
            fetch mode); ``None``: ``open_pack(root)``.

    Raises:
        FileNotFoundError: no complete pack at ``root``.
        RemoteError: a URL that cannot be read (one line: the URL and the fix).
        KeyError: the pack has no ``split``.
    """

    def __init__(self, root: str | os.PathLike, split: str, transform: Callable[[bytes], np.ndarray],
                 collate: Callable[[list], Any] | None = None, with_ids: bool = False, threads: int = 1,
                 bad_files: str = "raise", skip_log: str | os.PathLike | None = None,
                 source: LocalPack | None = None) -> None:
        if not (isinstance(threads, int) and threads >= 1):
            raise ValueError(f"ShardsDataset: threads={threads!r} must be an int >= 1.")
        self._set_policy(bad_files, skip_log)
        self.source = source if source is not None else open_pack(root)
        self.root, self.split, self.threads = self.source.root, split, threads
        manifest = self.source.manifest()
        if split not in manifest["splits"]:
            raise KeyError(f"ShardsDataset: the pack at {self.source.where} has no split {split!r} (it has "
                           f"{sorted(manifest['splits'])}).")
        self.classes: list[str] = manifest["classes"]
        self.shard_names: list[str] = list(manifest["splits"][split]["shards"])  # relative to the root
        self.shards = [self.source.shard_url(s) for s in self.shard_names]
        indexes = self.source.indexes(self.shard_names)
        # offset, size, label (, path offset, path size: packs of format 2; cltrain.data.shard_writer.INDEX_COLUMNS)
        self.index = np.concatenate(indexes) if indexes else np.zeros((0, 3), np.int64)
        self.shard_sizes = [len(i) for i in indexes]
        self.shard_of = np.repeat(np.arange(len(indexes)), self.shard_sizes)
        self._shard_start = np.concatenate([[0], np.cumsum(self.shard_sizes)[:-1]]).astype(np.int64)
        self.transform, self.with_ids = transform, with_ids
        self.collate = collate if collate is not None else NHWCCollate()

    def __len__(self) -> int:
        return len(self.index)

    def _pread(self, i: int, offset: int, size: int) -> bytes:
        return self.source.pread(self.shard_names[int(self.shard_of[i])], offset, size)

    def plan_reads(self, batches: Sequence[Sequence[int]]) -> Callable[[int], None] | None:
        """Tell the source the batches an epoch will read, in order (``ShardBatchSampler`` does, as it starts an
        epoch): a remote pack fetches their shards ahead. The result, if any, is called with each batch's number as
        the batch is served."""
        if not self.source.fetches_ahead:
            return None
        names = self.shard_names
        return self.source.plan([[names[k] for k in np.unique(self.shard_of[np.asarray(b, dtype=np.int64)])]
                                 for b in batches])

    def read(self, i: int) -> bytes:
        """The stored bytes of sample ``i`` (the image file as it was packed)."""
        return self._pread(i, self.index[i, 0], self.index[i, 1])

    def _place(self, i: int) -> str:
        shard = int(self.shard_of[i])
        return f"{self.shards[shard]} sample {i - int(self._shard_start[shard])}"

    def sample_name(self, i: int) -> str:
        """The path of the file sample ``i`` was packed from (a pack of format 1: its shard and place)."""
        if self.index.shape[1] < 5:
            return self._place(i)
        try:
            name = os.fsdecode(self._pread(i, self.index[i, 3], self.index[i, 4]))
        except OSError:
            return self._place(i)
        # a shard swapped for another of its size holds other bytes there (a tar header): not a path, not one line
        return name if name.isprintable() else self._place(i)

    @property
    def split_name(self) -> str:
        """The split, as the skipped-files list names it."""
        return self.split

    @property
    def source_name(self) -> str:
        """The pack and split, for errors."""
        return f"{self.source.where} ({self.split})"

    def load(self, i: int) -> tuple[np.ndarray, int]:
        """``(HWC uint8, label)`` of sample ``i``; ``BadImageError`` names the file it was packed from."""
        try:
            return self.transform(self.read(i)), int(self.index[i, 2])
        except StorageError:  # the bucket or the cache failed, not this sample: never skipped
            raise
        except Exception as err:
            name, reason = self.sample_name(i), unreadable(err)
            where = "" if name == self._place(i) else f" (in {self._place(i)})"
            raise BadImageError(f"{name}{where}: cannot be read as an image ({reason}). Pass bad_files='skip' to leave "
                                "such samples out, or replace the file and pack the folder again"
                                f"{' (and upload the pack)' if isinstance(self.source, RemotePack) else ''}.",
                                reason) from err

    def __getitem__(self, index: int | Sequence[int]) -> Any:
        if isinstance(index, (int, np.integer)):
            return self.fetch(int(index))
        # each sample's crop from a seed of its own, whatever the number of threads (as ImageFolderDataset)
        samples = self.start_batch(self.load, index, getattr(self.transform, "augment", None))()
        batch = self.collate(samples)
        return (*batch, torch.as_tensor(index, dtype=torch.int64)) if self.with_ids else batch


def read_manifest(root: str | os.PathLike) -> dict:
    """The ``shards.json`` of a complete pack (a folder or a URL); ``FileNotFoundError`` (a folder) or
    ``RemoteError`` (a URL) saying how to make one."""
    return open_pack(root).manifest()
