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
                    (``HFDecoding``: EXIF-upright, as ``datasets`` decodes)
``Augmentation``    scale, ratio, hflip, augment, random_erasing, mixup_alpha, ...      the image ones
``RandomCrop``      scale, ratio, hflip                                                 clips
``BadFilePolicy``   bad_files                                                           every DataModule
==================  ==================================================================  =================

and each source's own group (``cltrain.data.source_settings``: ``FolderChecks``, ``ExcludeList``, ``PackReading``,
``ShardCache``, ``HFSource``, ``Splits``, ``LitDataSource``, ``MDSColumns``, ``StreamOrder``,
``ClipSampling``). ``cltrain.data.datamodules.arguments`` makes a DataModule's signature of its groups. Clips have their
own defaults (``ClipLoading``: 8 clips a batch; ``ClipCrop``: 112 px; ``ClipPixels``: Kinetics'
statistics); ``DATAMODULE_SETTINGS`` lists the groups of every DataModule.

**batch_size is 64 images per device** (8 clips): a batch that fits every device a first run starts
on (a laptop CPU, an 8 GB GPU at 224 px for ResNet-50 in fp32) and any training folder of 64 images
or more (the training loader drops partial batches, so a split smaller than one batch is refused).
A recipe that wants more says so (``experiment=main_amp``: 256, apex's ``-b``); the app's learning
rate scales with the global batch (``optim.scale_lr``), so the recipe's ``lr`` holds at any batch.

Example::

    >>> from cltrain.data.settings import Loading
    >>> Loading().batch_size
    64
    >>> Loading(batch_size=0)
    Traceback (most recent call last):
    ValueError: Loading: batch_size=0 must be an int >= 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from cltrain.data.augment_group import Augmentation, RandomCrop
from cltrain.data.constants import IMAGENET_MEAN, IMAGENET_STD, KINETICS_MEAN, KINETICS_STD
from cltrain.data.source_settings import (ClipSampling, ExcludeList, FolderChecks, HFSource, LitDataSource, MDSColumns,
                                          PackReading, ShardCache, Splits, StreamLength, StreamOrder, _fail)

__all__ = [
    "CLIPS", "DATAMODULE_SETTINGS", "HF", "IMAGES", "IMAGE_FOLDER", "LITDATA", "MDS", "SHARDS", "WEBDATASET",
    "Augmentation", "BadFilePolicy", "ClipCrop", "ClipLoading", "ClipPixels", "ClipSampling", "Crop", "Decoding",
    "ExcludeList", "FolderChecks", "HFDecoding", "HFSource", "LitDataSource", "Loading", "MDSColumns", "PackReading", "Pixels", "RandomCrop",
    "ShardCache", "Splits", "StreamLength", "StreamOrder",
]


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
            if self.channels == 1:
                _fail(self, f"channels=1 takes one mean and one std value, not mean={self.mean} and std={self.std} "
                            "(the RGB defaults' three); pass mean=(0.449,), std=(0.226,) (ImageNet's, averaged over "
                            "its channels) or your images' own.")
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


@dataclass(frozen=True)
class HFDecoding(Decoding):
    """``Decoding`` of Hugging Face datasets: photos turned upright by their EXIF orientation, as ``datasets``' own
    decode turns them (a folder's are not, as torchvision's ``ImageFolder`` leaves them)."""

    exif_transpose: bool = True


# --- what each DataModule is made of ---------------------------------------------------------------
IMAGES = (Loading, Crop, Pixels, Decoding, Augmentation, BadFilePolicy)
IMAGE_FOLDER = (*IMAGES, FolderChecks, ExcludeList)
SHARDS = (*IMAGES, PackReading, ShardCache)
HF = (Loading, Crop, Pixels, HFDecoding, Augmentation, BadFilePolicy, HFSource)
LITDATA = (*IMAGES, Splits, LitDataSource)
MDS = (*IMAGES, Splits, MDSColumns, ShardCache)
WEBDATASET = (*IMAGES, Splits, StreamOrder, StreamLength, ShardCache)
CLIPS = (ClipLoading, ClipCrop, ClipPixels, ClipSampling, RandomCrop, BadFilePolicy, ExcludeList)

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
