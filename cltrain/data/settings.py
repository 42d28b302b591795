"""The data settings: one small typed definition per concept, each default written once.

A DataModule is made of settings groups: its keyword arguments are their fields, in order
(``ImageFolderDataModule(root, batch_size=256, scale=(0.5, 1.0), bad_files="skip")``), and it holds
each group, checked when it is made (``dm.loading``, ``dm.crop``, ``dm.augmentation``, ...). The
training app's ``data.*`` keys are the same fields: ``cltrain.app.config.data_schema`` builds its
Hydra schema from these classes, so a default is one value, here, for the library and the app.

==================  ==================================================================  =================
group               fields                                                              taken by
==================  ==================================================================  =================
``Loading``         batch_size, num_workers, persistent_workers, pin_memory,            every DataModule
                    cuda_prefetch
``Crop``            image_size, val_resize_size                                         every DataModule
``Pixels``          channels, mean, std, dtype, channels_last (not ``data.*`` keys:     every DataModule
                    the app sets channels_last from its toggle)
``Decoding``        interpolation, exif_transpose, decode_threads, decoder, val_reduce  the image ones
``Augmentation``    scale, ratio, hflip, augment, random_erasing, mixup_alpha, ...      the image ones
``RandomCrop``      scale, ratio, hflip                                                 clips
``BadFilePolicy``   bad_files                                                           every DataModule
==================  ==================================================================  =================

and each source's own group (``FolderChecks``, ``PackReading``, ``ShardCache``, ``HFSource``,
``Splits``, ``LitDataSource``, ``MDSColumns``, ``StreamOrder``, ``ClipSampling``). Clips have their
own defaults (``ClipLoading``: 8 clips a batch; ``ClipCrop``: 112 px; ``ClipPixels``: Kinetics'
statistics); ``DATAMODULE_SETTINGS`` lists the groups of every DataModule.

**batch_size is 64 images per device** (8 clips): a batch that fits every device a first run starts
on (a laptop CPU, an 8 GB GPU at 224 px for ResNet-50 in fp32) and any training folder of 64 images
or more (the training loader drops partial batches, so a split smaller than one batch is refused).
A recipe that wants more says so (``experiment=main_amp``: 256, apex's ``-b``); the app's learning
rate scales with the global batch (``optim.scale_lr``), so the recipe's ``lr`` holds at any batch.

Example::

    >>> from cltrain.data.settings import Loading, signature_of, IMAGE_FOLDER
    >>> Loading().batch_size
    64
    >>> Loading(batch_size=0)
    Traceback (most recent call last):
    ValueError: Loading: batch_size=0 must be an int >= 1.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cltrain.data.augment_group import Augmentation, RandomCrop
from cltrain.data.constants import CHECK_MODES, IMAGENET_MEAN, IMAGENET_STD, KINETICS_MEAN, KINETICS_STD

__all__ = [
    "CLIPS", "DATAMODULE_SETTINGS", "HF", "IMAGE_FOLDER", "LITDATA", "MDS", "SHARDS", "WEBDATASET",
    "Augmentation", "BadFilePolicy", "ClipCrop", "ClipLoading", "ClipPixels", "ClipSampling", "Crop", "Decoding",
    "FolderChecks", "HFSource", "LitDataSource", "Loading", "MDSColumns", "PackReading", "Pixels", "RandomCrop",
    "ShardCache", "Splits", "StreamOrder", "bind_settings", "default_of", "signature_of",
]


def _fail(group: Any, text: str) -> None:
    raise ValueError(f"{type(group).__name__}: {text}")


# --- every DataModule ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loading:
    """How batches are loaded.

    Args:
        batch_size: samples per batch, per device (see the module docstring for why 64).
        num_workers: DataLoader worker processes (0: load in the main process; ``"auto"``: the image
            DataModules follow ``cltrain.data.loader_threads.loading_plan``, clips a process per core).
        persistent_workers: keep workers between epochs (when ``num_workers > 0``).
        pin_memory: ``None`` pins only when the trainer runs on a GPU.
        cuda_prefetch: on a CUDA device, copy the next batch on a side stream (``PrefetchDataLoader``);
            off: Lightning copies each batch when its step starts.
    """

    key: ClassVar[str] = "loading"

    batch_size: int = 64
    num_workers: int | str = "auto"
    persistent_workers: bool = True
    pin_memory: bool | None = None
    cuda_prefetch: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.batch_size, int) and not isinstance(self.batch_size, bool) and self.batch_size >= 1):
            _fail(self, f"batch_size={self.batch_size!r} must be an int >= 1.")
        workers = self.num_workers
        if workers != "auto" and not (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 0):
            _fail(self, f"num_workers={workers!r} must be an int >= 0 or 'auto'.")


@dataclass(frozen=True)
class ClipLoading(Loading):
    """``Loading`` of clips: 8 clips a batch (a clip is 16 images), 2 worker processes."""

    batch_size: int = 8
    num_workers: int | str = 2


@dataclass(frozen=True)
class Crop:
    """The sizes of the crops.

    Args:
        image_size: training crop and evaluation crop (an int, or ``(height, width)``).
        val_resize_size: shorter side before the evaluation centre crop (``None``: no resize).
    """

    key: ClassVar[str] = "crop"

    image_size: int | tuple[int, int] = 224
    val_resize_size: int | None = 256

    def __post_init__(self) -> None:
        from cltrain.data.transforms import size_pair

        if isinstance(self.image_size, list):
            object.__setattr__(self, "image_size", tuple(self.image_size))
        try:
            size_pair(self.image_size, "image_size")
        except ValueError as err:
            _fail(self, str(err))
        size = self.val_resize_size
        if size is not None and not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
            _fail(self, f"val_resize_size={size!r} must be an int >= 1 or None.")


@dataclass(frozen=True)
class ClipCrop(Crop):
    """``Crop`` of clips: 112 px crops of frames resized to 128 (torchvision's video models)."""

    image_size: int | tuple[int, int] = 112
    val_resize_size: int | None = 128


@dataclass(frozen=True)
class Pixels:
    """What a batch's pixels are once normalised on their device.

    Args:
        channels: 3 (RGB) or 1 (grayscale).
        mean: per-channel normalisation mean (0-1 units).
        std: per-channel normalisation standard deviation (0-1 units).
        dtype: dtype of the normalised batch (float32, bfloat16 or float16).
        channels_last: ``False`` gives contiguous batches (the NCHW baseline).
    """

    key: ClassVar[str] = "pixels"

    channels: int = 3
    mean: Sequence[float] = IMAGENET_MEAN  # kept as a tuple
    std: Sequence[float] = IMAGENET_STD
    dtype: torch.dtype = torch.float32
    channels_last: bool = True

    def __post_init__(self) -> None:
        from cltrain.data.normalize import NORMALIZE_DTYPES, check_statistics

        object.__setattr__(self, "mean", tuple(self.mean))
        object.__setattr__(self, "std", tuple(self.std))
        if self.channels not in (1, 3):
            _fail(self, f"channels={self.channels!r} must be 1 (grayscale) or 3 (RGB).")
        if self.dtype not in NORMALIZE_DTYPES:
            _fail(self, f"dtype={self.dtype!r} must be one of {NORMALIZE_DTYPES}.")
        if len(self.mean) not in (1, self.channels) or len(self.std) not in (1, self.channels):
            _fail(self, f"mean={self.mean} and std={self.std} need 1 or {self.channels} values each.")
        check_statistics(self.mean, self.std, type(self).__name__)


@dataclass(frozen=True)
class ClipPixels(Pixels):
    """``Pixels`` of clips: the statistics torchvision's Kinetics-400 video models were trained with."""

    mean: Sequence[float] = KINETICS_MEAN
    std: Sequence[float] = KINETICS_STD


@dataclass(frozen=True)
class BadFilePolicy:
    """What a sample that cannot be read does (``cltrain.data.bad_samples``).

    Args:
        bad_files: ``"raise"``: it stops the run with an error naming it; ``"skip"``: the next readable
            sample stands in for it, and under a Trainer it is listed in the run directory's
            ``skipped_files.tsv`` (``SkippedFilesReport`` counts them per epoch).
    """

    key: ClassVar[str] = "bad_file_policy"

    bad_files: str = "raise"

    def __post_init__(self) -> None:
        from cltrain.data.bad_samples import check_bad_files

        check_bad_files(self.bad_files, type(self).__name__)


# --- images ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decoding:
    """How the images are decoded and resampled.

    Args:
        interpolation: the resampling, ``"bilinear"`` or ``"bicubic"`` (training and evaluation).
        exif_transpose: turn photos upright by their EXIF orientation (off, as torchvision).
        decode_threads: threads that decode a batch's images in each loading process
            (``cltrain.data.loader_threads``): with ``num_workers=0`` and 2 threads, two cores load in
            one process; 1 decodes them one by one; ``"auto"``: as ``num_workers``.
        decoder: the JPEG decoder (``cltrain.data.decoders``): ``"auto"`` (the first back end
            installed), ``"turbojpeg"``, ``"simplejpeg"``, or ``"pillow"`` (every file through Pillow).
        val_reduce: decode evaluation JPEGs at least twice the resize target at 1/2, 1/4 or 1/8 scale
            (libjpeg's DCT scaling, as training crops are): faster on large photos, but not
            torchvision's pixels. Off: evaluation equals torchvision's decode + ``Resize`` +
            ``CenterCrop`` within one level.
    """

    key: ClassVar[str] = "decoding"

    interpolation: str = "bilinear"
    exif_transpose: bool = False
    decode_threads: int | str = "auto"
    decoder: str = "auto"
    val_reduce: bool = False

    def __post_init__(self) -> None:
        from cltrain.data.crop_kernels import INTERPOLATIONS
        from cltrain.data.decoders import get_decoder

        if self.interpolation not in INTERPOLATIONS:
            _fail(self, f"interpolation={self.interpolation!r} must be one of {sorted(INTERPOLATIONS)}.")
        threads = self.decode_threads
        if threads != "auto" and not (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
            _fail(self, f"decode_threads={threads!r} must be an int >= 1 or 'auto'.")
        try:
            get_decoder(self.decoder)
        except ValueError as err:  # an unknown name, or a back end not installed here
            _fail(self, str(err))


# --- each source's own -----------------------------------------------------------------------------
@dataclass(frozen=True)
class FolderChecks:
    """What an image folder is checked against (``ImageFolderDataModule``).

    Args:
        allow_missing_val_classes: accept training classes with no folder in ``val/`` (by default
            that is an error naming them).
        exclude_files: a list of files to leave out from the start: the output of
            ``python -m cltrain.data.check ROOT``, or a ``skipped_files.tsv``.
        check_val: check the validation files in ``setup`` before training starts: ``"quick"``
            (headers and JPEG end markers), ``"full"`` (decode every file, with ``decoder``) or
            ``"off"`` (see ``cltrain.data.check``). Bad files stop the run (``bad_files="raise"``)
            or are left out and listed (``"skip"``).
        index_cache: reuse the file index of an unchanged tree between runs and ranks
            (``cltrain.data.index``), kept in the user cache folder, never in ``root``; a path keeps it
            there instead; ``False`` walks the tree every run.
    """

    key: ClassVar[str] = "checks"

    allow_missing_val_classes: bool = False
    exclude_files: str | os.PathLike | None = None
    check_val: str = "quick"
    index_cache: bool | str | os.PathLike = True

    def __post_init__(self) -> None:
        if self.check_val not in CHECK_MODES:
            _fail(self, f"check_val={self.check_val!r} must be one of {CHECK_MODES}.")


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
    """The node's shard cache for a URL (``cltrain.data.shard_cache``), shared by its ranks and workers.

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


# --- what each DataModule is made of ---------------------------------------------------------------
IMAGES = (Loading, Crop, Pixels, Decoding, Augmentation, BadFilePolicy)
IMAGE_FOLDER = (*IMAGES, FolderChecks)
SHARDS = (*IMAGES, PackReading, ShardCache)
HF = (*IMAGES, HFSource)
LITDATA = (*IMAGES, Splits, LitDataSource)
MDS = (*IMAGES, Splits, MDSColumns, ShardCache)
WEBDATASET = (*IMAGES, Splits, StreamOrder, ShardCache)
CLIPS = (ClipLoading, ClipCrop, ClipPixels, ClipSampling, RandomCrop, BadFilePolicy)

#: Every DataModule's class path -> its settings groups, in the order of its arguments.
DATAMODULE_SETTINGS: dict[str, tuple[type, ...]] = {
    "cltrain.data.ImageFolderDataModule": IMAGE_FOLDER,
    "cltrain.data.ShardsDataModule": SHARDS,
    "cltrain.data.HFImageDataModule": HF,
    "cltrain.data.datamodules.engines.LitDataModule": LITDATA,
    "cltrain.data.datamodules.engines.MDSModule": MDS,
    "cltrain.data.datamodules.engines.WebDatasetModule": WEBDATASET,
    "cltrain.data.video.ClipFolderDataModule": CLIPS,
}

#: The groups a DataModule also takes whole, by their key (``augmentation=Augmentation(...)``).
WHOLE: tuple[type, ...] = (Augmentation,)
#: The arguments after ``root`` that may also be given by position (``ImageFolderDataModule(root, 32)``).
POSITIONAL = ("batch_size", "num_workers", "persistent_workers", "pin_memory")


# --- a DataModule's arguments from its groups ------------------------------------------------------
def default_of(group: type, name: str) -> Any:
    """The default of field ``name`` of ``group`` (``inspect.Parameter.empty`` when it has none)."""
    f = next(f for f in dataclasses.fields(group) if f.name == name)
    return inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default


def signature_of(groups: Sequence[type]) -> inspect.Signature:
    """``(self, root, <every field of groups>)``: a DataModule's signature, as ``inspect``, ``help`` and
    LightningCLI read it. ``POSITIONAL`` fields may also be given by position; a group of ``WHOLE`` is
    also taken whole, by its key, before its fields."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD), P("root", P.POSITIONAL_OR_KEYWORD, annotation=str | os.PathLike)]
    for group in groups:
        hints = typing.get_type_hints(group)
        if group in WHOLE:
            params.append(P(group.key, P.KEYWORD_ONLY, default=None, annotation=group | None))
        for f in dataclasses.fields(group):
            kind = P.POSITIONAL_OR_KEYWORD if f.name in POSITIONAL else P.KEYWORD_ONLY
            params.append(P(f.name, kind, default=default_of(group, f.name), annotation=hints[f.name]))
    return inspect.Signature(params)


def _differs(value: Any, default: Any) -> bool:
    if isinstance(value, Sequence) and not isinstance(value, str) and isinstance(default, Sequence):
        return tuple(value) != tuple(default)
    return value != default


def bind_settings(owner: str, groups: Sequence[type], args: tuple, kwargs: dict[str, Any]
                  ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """``(root, values, made)`` of a DataModule's call: every argument by name (defaults filled in) and each
    group made from its fields (by its ``key``), or taken whole.

    Raises:
        TypeError: an argument it does not take, or a group of the wrong type (one line naming ``owner``).
        ValueError: a bad value, or a group given whole and by some of its fields too (one line naming ``owner``).
    """
    signature = signature_of(groups)
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError as err:  # Python's message: name the class called
        raise TypeError(f"{owner}: {err}") from None
    bound.apply_defaults()
    values = dict(bound.arguments)
    values.pop("self")
    root = values.pop("root")
    made: dict[str, Any] = {}
    for group in groups:
        names = [f.name for f in dataclasses.fields(group)]
        whole = values.pop(group.key, None) if group in WHOLE else None
        if whole is not None:
            if not isinstance(whole, group):
                raise TypeError(f"{owner}: {group.key}={whole!r} must be a cltrain.data.{group.__name__}.")
            changed = sorted(n for n in names if _differs(values[n], default_of(group, n)))
            if changed:
                raise ValueError(f"{owner}: pass {', '.join(changed)} inside {group.key}={group.__name__}(...), "
                                 f"or leave {group.key} out; not both.")
            made[group.key] = whole
        else:
            try:
                made[group.key] = group(**{n: values[n] for n in names})
            except ValueError as err:  # "<Group>: name=value ...": the DataModule's name instead
                raise ValueError(f"{owner}: {re.sub(r'^[A-Z][A-Za-z]*: ', '', str(err))}") from None
        values.update({n: getattr(made[group.key], n) for n in names})
    return root, values, made
