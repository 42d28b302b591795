"""Each source's own settings group: what a DataModule adds to the shared groups of ``cltrain.data.settings``.

``FolderChecks`` (``ImageFolderDataModule``), ``ExcludeList`` (it and ``ClipFolderDataModule``), ``PackReading``
and ``ShardCache`` (``ShardsDataModule``; the cache also MDS and WebDataset), ``HFSource`` (``HFImageDataModule``),
``Splits`` with ``LitDataSource``, ``MDSColumns`` or ``StreamOrder`` (the other engines' datasets), ``ClipSampling``
(``ClipFolderDataModule``). Each is a frozen dataclass whose fields are keyword arguments of its
DataModule and ``data.*`` keys of the app, checked when it is made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from cltrain.data.constants import CHECK_MODES

__all__ = ["ClipSampling", "ExcludeList", "FolderChecks", "HFSource", "LitDataSource", "MDSColumns", "PackReading", "ShardCache",
           "Splits", "StreamOrder"]


def _fail(group: Any, text: str) -> None:
    raise ValueError(f"{type(group).__name__}: {text}")


@dataclass(frozen=True)
class FolderChecks:
    """What an image folder is checked against (``ImageFolderDataModule``).

    Args:
        allow_missing_val_classes: accept training classes with no folder in ``val/`` (by default
            that is an error naming them).
        check_val: check the validation files in ``setup``, before training or an evaluation starts: ``"quick"``
            (headers and JPEG end markers), ``"full"`` (decode every file, with ``decoder``) or
            ``"off"`` (see ``cltrain.data.check``). Bad files stop the run (``bad_files="raise"``)
            or are left out and listed (``"skip"``).
        index_cache: reuse the file index of an unchanged tree between runs and ranks
            (``cltrain.data.index``), kept in the user cache folder, never in ``root``; a path keeps it
            there instead; ``False`` walks the tree every run.
    """

    key: ClassVar[str] = "checks"

    allow_missing_val_classes: bool = False
    check_val: str = "quick"
    index_cache: bool | str | os.PathLike = True

    def __post_init__(self) -> None:
        if self.check_val not in CHECK_MODES:
            _fail(self, f"check_val={self.check_val!r} must be one of {CHECK_MODES}.")


@dataclass(frozen=True)
class ExcludeList:
    """Files left out from the start (``ImageFolderDataModule``, ``ClipFolderDataModule``).

    Args:
        exclude_files: a list of files to leave out: the output of ``python -m cltrain.data.check ROOT``, or a
            ``skipped_files.tsv``; a clip is left out when its folder, its video file or any of its frames is listed.
    """

    key: ClassVar[str] = "exclusions"

    exclude_files: str | os.PathLike | None = None


@dataclass(frozen=True)
class PackReading:
    """How a pack of shards is read (``ShardsDataModule``).

    Args:
        seed: seed of the per-epoch training order (the same on every rank).
        shuffle_window: ``None``: each epoch is one permutation of all samples; ``k``: shards permuted,
            samples shuffled within runs of ``k`` shards (see ``ShardBatchSampler``). From object
            storage, ``k`` lets the first epoch start after ``k`` shards.
        fetch: ``"shards"``: a URL's shards fetched whole into the cache, ahead of the batches;
            ``"ranges"``: each sample read with a ranged request, nothing cached.
    """

    key: ClassVar[str] = "reading"

    seed: int = 0
    shuffle_window: int | None = None
    fetch: str = "shards"

    def __post_init__(self) -> None:
        from cltrain.data.shard_source import FETCH_MODES

        window = self.shuffle_window
        if window is not None and not (isinstance(window, int) and window >= 1):
            _fail(self, f"shuffle_window={window!r} must be None (null) or an int >= 1 (shards).")
        if self.fetch not in FETCH_MODES:
            _fail(self, f"fetch={self.fetch!r} must be one of {FETCH_MODES}.")


@dataclass(frozen=True)
class ShardCache:
    """The node's shard cache for a URL (``cltrain.data.shard_cache``), shared by its ranks and workers
    (``ShardsDataModule``, ``WebDatasetModule``, ``MDSModule``).

    Args:
        cache_dir: its folder (``None``: ``$CLTRAIN_SHARD_CACHE``, else ``cltrain-shards`` in ``$TMPDIR``).
        cache_limit: most bytes it holds (``"200GB"``, bytes, or ``None``: half the disk's free space).
    """

    key: ClassVar[str] = "cache"

    cache_dir: str | None = None
    cache_limit: int | str | None = None

    def __post_init__(self) -> None:
        from cltrain.data.shard_cache import parse_size

        parse_size(self.cache_limit, f"{type(self).__name__}: cache_limit")


@dataclass(frozen=True)
class HFSource:
    """Which parts of a Hugging Face dataset are read, and how (``HFImageDataModule``).

    Args:
        streaming: read the splits as streams (``load_dataset(..., streaming=True)``): nothing is
            downloaded or converted first; samples come in the stream's order, shuffled in a buffer.
        train_split: the split trained on.
        val_split: the split evaluated on (also for test and predict); ``None``: the first of
            ``validation``, ``val``, ``valid``, ``test`` the dataset has.
        image_column: the image column; ``None``: the first ``datasets.Image`` feature.
        label_column: the label column; ``None``: the first ``datasets.ClassLabel`` feature.
        shuffle_buffer: with ``streaming``, rows shuffled together for training (``None``: stream order).
        shuffle_seed: with ``streaming``, the seed of the training order: epoch ``e`` shuffles with
            ``shuffle_seed + e``, the same on every rank.
    """

    key: ClassVar[str] = "source"

    streaming: bool = False
    train_split: str = "train"
    val_split: str | None = None
    image_column: str | None = None
    label_column: str | None = None
    shuffle_buffer: int | None = 10_000
    shuffle_seed: int = 0

    def __post_init__(self) -> None:
        buffer, seed = self.shuffle_buffer, self.shuffle_seed
        if buffer is not None and not (isinstance(buffer, int) and buffer >= 1):
            _fail(self, f"shuffle_buffer={buffer!r} must be an int >= 1 or None.")
        if not (isinstance(seed, int) and 0 <= seed < 2**32):
            _fail(self, f"shuffle_seed={seed!r} must be an int in [0, 2**32).")
        for name in ("train_split", "val_split", "image_column", "label_column"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                _fail(self, f"{name}={value!r} must be a name (or None).")


@dataclass(frozen=True)
class Splits:
    """A dataset written by another engine, one per split under ``root`` (LitData, MDS, WebDataset).

    Args:
        num_classes: how many classes the labels (``0 .. num_classes - 1``) name: these formats keep
            no class names.
        train_split: the folder of the training split under ``root``.
        val_split: the folder of the evaluation split (also test and predict).
    """

    key: ClassVar[str] = "splits"

    num_classes: int
    train_split: str = "train"
    val_split: str = "val"

    def __post_init__(self) -> None:
        if not (isinstance(self.num_classes, int) and self.num_classes >= 1):
            _fail(self, f"num_classes={self.num_classes!r} must be an int >= 1.")


@dataclass(frozen=True)
class LitDataSource:
    """LitData's fields and chunk cache (``LitDataModule``).

    Args:
        image_key: the items' image field (``None``: the first bytes field).
        label_key: their label field (``None``: the first int field).
        cache_dir: LitData's chunk cache (``None``: LitData's default).
        max_cache_size: its limit.
    """

    key: ClassVar[str] = "source"

    image_key: str | int | None = None
    label_key: str | int | None = None
    cache_dir: str | None = None
    max_cache_size: str | int = "50GB"


@dataclass(frozen=True)
class MDSColumns:
    """The columns of a Mosaic MDS dataset (``MDSModule``).

    Args:
        image_key: the image column (``None``: the first ``jpeg``, ``png`` or ``bytes`` column).
        label_key: the label column (``None``: the first integer column).
    """

    key: ClassVar[str] = "columns"

    image_key: str | None = None
    label_key: str | None = None


@dataclass(frozen=True)
class StreamOrder:
    """The training order of streamed WebDataset shards (``WebDatasetModule``).

    Args:
        shuffle_buffer: training samples shuffled together (``None``: in the shards' order).
        seed: epoch ``e``'s shards are permuted with ``seed + e`` (every rank the same).
    """

    key: ClassVar[str] = "order"

    shuffle_buffer: int | None = 1000
    seed: int = 0


@dataclass(frozen=True)
class StreamLength:
    """The length of a stream of WebDataset shards (``WebDatasetModule``), which it cannot read.

    Args:
        samples_per_epoch: the training samples of an epoch, over all ranks, for an epoch-based learning-rate
            schedule (the app's); ``None``: not given (the app asks for it).
    """

    key: ClassVar[str] = "length"

    samples_per_epoch: int | None = None

    def __post_init__(self) -> None:
        if self.samples_per_epoch is not None and not (isinstance(self.samples_per_epoch, int)
                                                       and self.samples_per_epoch >= 1):
            _fail(self, f"samples_per_epoch={self.samples_per_epoch!r} must be None (null) or a whole number >= 1 (the "
                  "training samples of an epoch, over all ranks).")


@dataclass(frozen=True)
class ClipSampling:
    """Which frames make a clip (``ClipFolderDataModule``).

    Args:
        num_frames: frames per clip (T).
        frame_stride: step between the sampled frames.
        val_temporal: ``"center"`` segment or ``"uniform"`` frames over the clip for evaluation.
    """

    key: ClassVar[str] = "sampling"

    num_frames: int = 16
    frame_stride: int = 1
    val_temporal: str = "center"

    def __post_init__(self) -> None:
        from cltrain.data.video.transforms import TEMPORAL_MODES

        if self.val_temporal not in TEMPORAL_MODES[1:]:
            _fail(self, f"val_temporal={self.val_temporal!r} must be one of {TEMPORAL_MODES[1:]}.")
