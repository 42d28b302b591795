"""WebDataset tar shards (any writer's, local or at a URL) streamed through the NHWC path: the image bytes undecoded.

``WebDatasetImages`` reads the tars of one split (``<root>/<split>/*.tar``; a URL's through the node's shard cache,
``cltrain.data.shard_cache``: once per node, bounded, shared by ranks and workers) with WebDataset's own tar reader
(``tar_file_expander`` + ``group_by_keys``), and hands each sample's image file bytes (``jpg``, ``jpeg``, ``png``,
``webp``) and ``cls`` label to cltrain's transforms: no PIL decode, no CHW tensor on the way.

Every epoch the shards are permuted (``seed + epoch``, the same on every rank) and dealt to the DataLoader workers in
turn (worker ``w`` reads shards ``w, w + workers, ...``, samples shuffled in a buffer of ``shuffle_buffer``); every
rank reads them all and keeps one sample of every ``world_size``, whole groups only, so every rank makes the same
number of steps whatever the number of shards (WebDataset's ``split_by_node`` hangs DDP with fewer shards than ranks x
workers, webdataset #188): each sample at most once per epoch, up to ``world_size - 1`` per worker left out. Each
sample's crop and flip come from a seed of its own (the seed, the epoch, its shard and place).

WebDataset keeps no place in an epoch: a run resumed mid-epoch starts that epoch again from its first batch.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from cltrain.data.bad_samples import NamedSplit, SkipsBadSamples, unreadable
from cltrain.data.constants import IMG_EXTENSIONS
from cltrain.data.errors import BadImageError, DataError, LabelFault, StorageError
from cltrain.data.remote import is_url, open_fs, redact, remote_error
from cltrain.data.resume_state import SeededIndex
from cltrain.data.shard_cache import ShardCache
from cltrain.data.stream_place import row_seed

__all__ = ["IMAGE_KEYS", "WebDatasetImages", "list_shards"]

#: The sample fields read as the image, first found first (any case): the image folder's suffixes, which
#: ``cltrain-pack`` keeps as each file's field.
IMAGE_KEYS = tuple(ext.lstrip(".") for ext in IMG_EXTENSIONS)


def list_shards(root: str, split: str) -> list[str]:
    """The ``.tar`` files of ``<root>/<split>``, sorted, relative to ``root``.

    Raises:
        DataError: none there (one line naming the place).
    """
    where = f"{str(root).rstrip('/')}/{split}"
    try:
        if is_url(where):
            fs, path = open_fs(where, quick=True)
            found = sorted(p for p in fs.glob(f"{path}/*.tar"))
            names = [f"{split}/{p.rsplit('/', 1)[1]}" for p in found]
        else:
            names = sorted(f"{split}/{p.name}" for p in Path(where).glob("*.tar"))
    except Exception as err:  # noqa: BLE001 - a listing that fails: one line
        raise remote_error(err, where, "listing the shards") from None
    if not names:
        raise DataError(f"{redact(where)}: no .tar shards there; point root at a folder or prefix holding "
                        f"{split}/<shard>.tar (WebDataset shards).")
    return names


class WebDatasetImages(NamedSplit, SkipsBadSamples, IterableDataset):
    """One split of WebDataset shards as ``(transform(image), label)`` samples (see the module docstring).

    Args:
        root: a folder or a URL holding ``<split>/*.tar``.
        split: the split's folder.
        transform: bytes -> HWC uint8.
        rank: this process's rank.
        world_size: the number of ranks.
        shuffle_buffer: samples shuffled together (``None``: the shards' order, unshuffled).
        seed: the order's seed (every rank the same).
        cache_dir: the node's shard cache for a URL (``None``: ``shard_cache.default_cache_dir()``).
        cache_limit: its size.
        bad_files: ``"raise"`` or ``"skip"``.
        skip_log: the skipped-files list.
        threads: decode threads: samples are decoded ``threads * 8`` at a time.
    """

    def __init__(self, root: str | os.PathLike, split: str, transform: Callable[..., Any], rank: int = 0,
                 world_size: int = 1, shuffle_buffer: int | None = 1000, seed: int = 0,
                 cache_dir: str | None = None, cache_limit: int | str | None = None, bad_files: str = "raise",
                 skip_log: str | os.PathLike | None = None, threads: int = 1) -> None:
        self._set_policy(bad_files, skip_log)
        self.root, self.split, self.transform = str(root).rstrip("/"), split, transform
        self.where = redact(self.root)
        self.rank, self.world_size, self.shuffle_buffer, self.seed = rank, world_size, shuffle_buffer, seed
        self.threads, self.epoch = max(1, threads), 0
        self.shards = list_shards(self.root, split)
        gone = (f"{self.where}/{split} lost a shard listed when the run began: upload the split's shards again whole "
                "and start the run again")
        self.cache = ShardCache(self.root, cache_dir, cache_limit, gone) if is_url(self.root) else None

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration gives (``PrefetchDataLoader`` sets it)."""
        self.epoch = epoch

    def _open(self, shard: str) -> Any:
        if self.cache is None:
            return open(os.path.join(self.root, shard), "rb")
        return open(self.cache.get(shard), "rb")

    def _samples(self, shards: list[str]) -> Iterator[tuple[str, int, dict]]:
        """``(shard, place, sample)`` of ``shards`` in order, WebDataset's tar reader grouping each key's files."""
        from webdataset.tariterators import group_by_keys, tar_file_expander

        for shard in shards:
            with self._open(shard) as stream:
                grouped = group_by_keys(tar_file_expander([{"url": shard, "stream": stream}]))
                for place, sample in enumerate(grouped):
                    yield shard, place, sample

    def _load(self, shard: str, place: int, sample: dict) -> tuple[Any, int]:
        try:
            fields = {k.lower(): k for k in sample}
            data = next((sample[fields[k]] for k in IMAGE_KEYS if k in fields), None)
            if data is None:
                raise ValueError(f"no image field ({', '.join(IMAGE_KEYS)}) among {sorted(k for k in sample if not k.startswith('_'))}")
            label = int(bytes(sample["cls"]).decode().strip()) if "cls" in sample else None
            if label is None:
                raise ValueError("no cls field (the class index)")
            return self.transform(bytes(data)), self.class_index(label)
        except StorageError:
            raise
        except Exception as err:  # any failure of this one sample
            reason = unreadable(err)
            if isinstance(err, LabelFault):
                raise BadImageError(self.label_message(_name(shard, place, sample), reason), reason) from err
            raise BadImageError(f"{self.source_name} {_name(shard, place, sample)}: cannot be read "
                                f"as an image ({reason}). Pass bad_files='skip' to leave such samples out, or write the "
                                "shard again.", reason) from err

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        order = list(self.shards)
        random.Random(self.seed + self.epoch).shuffle(order) if self.shuffle_buffer else None
        mine = order[worker::workers]
        seed, epoch = self.seed, self.epoch
        augment = getattr(self.transform, "augment", None)

        def kept() -> Iterator[tuple[str, int, dict]]:
            # the buffer's order is the rank's own: the same on every rank, each global batch held tar neighbours
            rng, buffer, group = random.Random(row_seed(seed, epoch, worker, self.rank)), [], []
            items = self._samples(mine)
            for item in items:  # one of every world_size, whole groups only: every rank as many
                group.append(item)
                if len(group) < self.world_size:
                    continue
                buffer.append(group[self.rank])
                group = []
                if self.shuffle_buffer and len(buffer) >= self.shuffle_buffer:
                    yield buffer.pop(rng.randrange(len(buffer)))
                elif not self.shuffle_buffer:
                    yield buffer.pop()
            rng.shuffle(buffer)
            yield from buffer

        number = {s: k for k, s in enumerate(self.shards)}

        def samples() -> Iterator[tuple[Any, int]]:
            stream, last, owed = kept(), None, 0
            while True:
                chunk = [item for _, item in zip(range(self.threads * 8), stream)]
                if not chunk:
                    return
                seeds = [SeededIndex(k, row_seed(seed, epoch, number[s], p)) for k, (s, p, _) in enumerate(chunk)]
                errors: dict[int, BadImageError] = {}

                def load(k: int) -> tuple[Any, int]:
                    try:
                        return self._load(*chunk[k])
                    except BadImageError as err:
                        errors[k] = err
                        raise

                done = self.start_batch(load, seeds, augment, refetch=lambda k: None)()  # "skip": a bad one is None
                for k, sample in enumerate(done):
                    if k in errors:
                        shard, place, raw = chunk[k]
                        self.skip(_name(shard, place, raw), errors[k].reason or str(errors[k]))
                        if last is None:  # the first readable one will stand in
                            owed += 1
                            continue
                        sample = last  # the last readable one stands in: every rank keeps its count (DDP in step)
                    last = sample
                    for _ in range(1 + owed):
                        yield sample
                    owed = 0

        return samples()

    def __len__(self) -> int:
        raise TypeError("a stream of WebDataset shards has no length")


def _name(shard: str, place: int, sample: dict) -> str:
    """``<shard> sample <place> (<key>)``, and the file it was made from where the sample keeps it (``cltrain-pack``'s
    ``path`` field)."""
    path = sample.get("path")
    made_from = f": {bytes(path).decode(errors='replace')}" if isinstance(path, (bytes, bytearray, memoryview)) else ""
    return f"{shard} sample {place} ({sample.get('__key__')}{made_from})"
