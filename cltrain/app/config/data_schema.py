"""The ``data`` group's schemas: what every DataModule the app builds takes, and each option's shape.

``DataConfig`` is the group's type in ``cltrain.app.config.schema.TrainConfig``; each option's yaml
extends one of its subclasses (``conf/data/demo.yaml`` extends ``ImageFolderDemoConfig``). A demo
option's schema carries the demo set's generator arguments (``data.demo``) and the one ``root`` at
which the set is generated (``demo_home``).

Example::

    >>> from omegaconf import OmegaConf
    >>> demo_home(OmegaConf.structured(ImageFolderDemoConfig))
    'data/demo'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from cltrain.app.config.rules import (
    COUNT_OR_AUTO,
    IMAGE_SIZE_WH,
    NON_NEGATIVE,
    OPT_PATH,
    OPT_POSITIVE,
    OPT_SIZE,
    OPT_TEXT,
    POSITIVE,
    POSITIVE_OR_AUTO,
    RATIO,
    SCALE,
    SEED,
    TEXT,
    UNIT_CLOSED,
    choices,
    key,
)
from cltrain.data.augment_ops import AUGMENT_POLICIES
from cltrain.data.constants import CHECK_MODES
from cltrain.data.bad_samples import BAD_FILE_POLICIES
from cltrain.data.crop_kernels import INTERPOLATIONS
from cltrain.data.decoders import DECODER_NAMES
from cltrain.data.shard_source import FETCH_MODES

__all__ = [
    "DEMO_GENERATORS",
    "ClipFolderConfig",
    "ClipFolderDemoConfig",
    "DataConfig",
    "HFConfig",
    "ImageDemoConfig",
    "ImageFolderConfig",
    "ImageFolderDemoConfig",
    "LitDataConfig",
    "MDSConfig",
    "ShardsConfig",
    "VideoDemoConfig",
    "WebDatasetConfig",
    "demo_home",
]


@dataclass
class ImageDemoConfig:
    """``data.demo``: the generated image demo set (``cltrain.data.make_demo_dataset``'s arguments)."""

    num_classes: int = key(10, POSITIVE)
    train_per_class: int = key(100, POSITIVE)
    val_per_class: int = key(20, POSITIVE)
    image_size: list[int] = key([500, 375], IMAGE_SIZE_WH)  # width, height of the JPEGs (ImageNet-like)
    seed: int = key(0, SEED)
    any_root: bool = False                    # true: generate it at any data.root (else only at the option's own root)


@dataclass
class VideoDemoConfig:
    """``data.demo``: the generated clip demo set (``cltrain.data.video.make_demo_videos``'s arguments)."""

    num_classes: int = key(6, POSITIVE)
    train_per_class: int = key(48, POSITIVE)
    val_per_class: int = key(16, POSITIVE)
    num_frames: int = key(16, POSITIVE)
    frame_size: int = key(64, POSITIVE)
    seed: int = key(0, SEED)
    any_root: bool = False


#: The generator of each demo schema (``data.demo``'s type).
DEMO_GENERATORS: dict[type, str] = {
    ImageDemoConfig: "cltrain.data.make_demo_dataset",
    VideoDemoConfig: "cltrain.data.video.make_demo_videos",
}


@dataclass
class DataConfig:
    """``data``: what every DataModule the app builds takes; the options' schemas extend it."""

    _target_: str = MISSING                   # the DataModule class
    root: str | None = key(None, OPT_PATH)  # relative to the directory you start from; required unless a demo
    batch_size: int = key(256, POSITIVE)       # per device (global batch = batch_size x devices x nodes x accumulation)
    num_workers: Any = key(8, COUNT_OR_AUTO)  # DataLoader worker processes; auto: see the image options
    image_size: int = key(224, POSITIVE)      # training crop; centre crop for validation
    val_resize_size: int | None = key(256, OPT_POSITIVE)  # validation resize before the centre crop


@dataclass
class _ImageCrops(DataConfig):
    """What the image DataModules (``ImageFolderDataModule``, ``ShardsDataModule``) take beyond
    ``DataConfig``: loading, decoding, the training crop and augmentation (docs/guides/data.md)."""

    # auto: cltrain.data.loader_threads.loading_plan, the fastest measured split of the cores (docs/performance.md)
    num_workers: Any = key("auto", COUNT_OR_AUTO)
    decode_threads: Any = key("auto", POSITIVE_OR_AUTO)  # threads decoding each batch inside each loading process
    decoder: str = key("auto", choices(*DECODER_NAMES))  # the JPEG back end (cltrain.data.decoders), or pillow
    val_reduce: bool = False                  # true: large validation JPEGs decoded at 1/2-1/8 scale (not torchvision's)

    scale: list[float] = key([0.08, 1.0], SCALE)  # RandomResizedCrop's area range
    ratio: list[float] = key([0.75, 1.3333333333333333], RATIO)  # and aspect-ratio range (w / h)
    hflip: float = key(0.5, UNIT_CLOSED)      # horizontal flip probability
    interpolation: str = key("bilinear", choices(*INTERPOLATIONS))  # antialiased, training and evaluation
    bad_files: str = key("raise", choices(*BAD_FILE_POLICIES))  # an unreadable image stops the run, or is skipped
    exif_transpose: bool = False              # turn photos upright by their EXIF orientation (off, as torchvision)
    augment: str = key("none", choices(*AUGMENT_POLICIES))  # on the HWC crop in the workers
    random_erasing: float = key(0.0, UNIT_CLOSED)  # probability, timm's per-image erasing on the device batch
    mixup_alpha: float = key(0.0, NON_NEGATIVE)  # timm's mixup / cutmix on the device batch (0 and 0: off);
    cutmix_alpha: float = key(0.0, NON_NEGATIVE)  # targets become probabilities, accuracy reads their argmax
    mixup_prob: float = key(1.0, UNIT_CLOSED)
    mixup_switch_prob: float = key(0.5, UNIT_CLOSED)


@dataclass
class ImageFolderConfig(_ImageCrops):
    """``schema/data/images``: an ImageNet-layout folder, ``<root>/{train,val}/<class>/<image>``."""

    _target_: str = "cltrain.data.ImageFolderDataModule"
    allow_missing_val_classes: bool = False   # true: accept classes with train/ images but no val/ folder
    check_val: str = key("quick", choices(*CHECK_MODES))  # check the validation files before the first epoch
    exclude_files: str | None = key(None, OPT_PATH)  # a bad-files list (cltrain-data-check ROOT --out bad.tsv)
    demo: ImageDemoConfig | None = None    # set: generate the demo set at root when it is missing


@dataclass
class ImageFolderDemoConfig(ImageFolderConfig):
    """``schema/data/images_demo``: the image demo set, generated at ``root`` (its only place) on first use."""

    root: str | None = key("data/demo", OPT_PATH)
    demo: ImageDemoConfig | None = field(default_factory=ImageDemoConfig)


@dataclass
class ShardsConfig(_ImageCrops):
    """``schema/data/shards``: WebDataset shards packed by ``cltrain-pack`` (checked when packed)."""

    _target_: str = "cltrain.data.ShardsDataModule"
    seed: int = key(0, SEED)                  # epoch e's training order is permutation(seed + e), the same on every rank
    shuffle_window: int | None = key(None, OPT_POSITIVE)  # null: all samples permuted; k: shards, mixed in runs of k
    # root may be a URL (s3://bucket/pack, gs://, az://, https://): docs/guides/object-storage.md
    cache_dir: str | None = key(None, OPT_PATH)  # the node's shard cache (null: $CLTRAIN_SHARD_CACHE, else $TMPDIR)
    cache_limit: Any = key(None, OPT_SIZE)    # most bytes it holds (200GB, ...; null: half the disk's free space)
    fetch: str = key("shards", choices(*FETCH_MODES))  # shards: whole, ahead, cached; ranges: per sample, uncached


@dataclass
class LitDataConfig(_ImageCrops):
    """``schema/data/litdata``: LitData optimized datasets (``litdata.optimize``), ``<root>/train`` and ``<root>/val``,
    a folder or a URL (``pip install 'cltrain[litdata]'``); the images' file bytes go to cltrain's decoder."""

    _target_: str = "cltrain.data.datamodules.engines.LitDataModule"
    num_classes: int = key(MISSING, POSITIVE)  # the format keeps no class names: how many classes the labels name
    train_split: str = key("train", TEXT)     # the folder of each split's optimized dataset under root
    val_split: str = key("val", TEXT)
    image_key: str | None = key(None, OPT_TEXT)  # null: the items' first bytes field
    label_key: str | None = key(None, OPT_TEXT)  # null: their first int field
    cache_dir: str | None = key(None, OPT_PATH)  # LitData's chunk cache (null: LitData's default)
    max_cache_size: str = key("50GB", TEXT)   # its limit


@dataclass
class MDSConfig(_ImageCrops):
    """``schema/data/mds``: Mosaic MDS datasets (``<root>/train/index.json``, ``<root>/val/index.json``, uncompressed
    shards), a folder or a URL (``pip install 'cltrain[mds]'``); the image column's bytes go to cltrain's decoder."""

    _target_: str = "cltrain.data.datamodules.engines.MDSModule"
    num_classes: int = key(MISSING, POSITIVE)  # the format keeps no class names: how many classes the labels name
    train_split: str = key("train", TEXT)
    val_split: str = key("val", TEXT)
    image_key: str | None = key(None, OPT_TEXT)  # null: the first jpeg, png or bytes column
    label_key: str | None = key(None, OPT_TEXT)  # null: the first integer column
    cache_dir: str | None = key(None, OPT_PATH)  # the node's shard cache for a URL (as data=shards)
    cache_limit: Any = key(None, OPT_SIZE)


@dataclass
class WebDatasetConfig(_ImageCrops):
    """``schema/data/webdataset``: WebDataset tar shards (``<root>/train/*.tar``, ``<root>/val/*.tar``: ``<key>.jpg``
    and ``<key>.cls``), a folder or a URL; streamed, no mid-epoch resume (WebDataset keeps no place)."""

    _target_: str = "cltrain.data.datamodules.engines.WebDatasetModule"
    num_classes: int = key(MISSING, POSITIVE)  # the format keeps no class names: how many classes the labels name
    train_split: str = key("train", TEXT)
    val_split: str = key("val", TEXT)
    shuffle_buffer: int | None = key(1000, OPT_POSITIVE)  # training samples shuffled together
    seed: int = key(0, SEED)                  # epoch e's shards permuted with seed + e (every rank the same)
    cache_dir: str | None = key(None, OPT_PATH)  # the node's shard cache for a URL (as data=shards)
    cache_limit: Any = key(None, OPT_SIZE)


@dataclass
class HFConfig(_ImageCrops):
    """``schema/data/hf``: a Hugging Face image dataset: a Hub id, a ``save_to_disk`` folder or a folder of
    Parquet files (``pip install 'cltrain[hf]'``); a local ``root`` is a folder, anything else a Hub id."""

    _target_: str = "cltrain.data.HFImageDataModule"
    streaming: bool = False                   # read the splits as streams (nothing downloaded or converted first)
    train_split: str = key("train", TEXT)
    val_split: str | None = key(None, OPT_TEXT)  # null: the first of validation, val, valid, test
    image_column: str | None = key(None, OPT_TEXT)  # null: the first Image feature
    label_column: str | None = key(None, OPT_TEXT)  # null: the first ClassLabel feature
    shuffle_buffer: int | None = key(10000, OPT_POSITIVE)  # streaming: rows shuffled together for training
    shuffle_seed: int = key(0, SEED)          # streaming: epoch e's order is shuffled with shuffle_seed + e (every rank)


@dataclass
class ClipFolderConfig(DataConfig):
    """``schema/data/video``: clips as folders of frames, ``<root>/{train,val}/<class>/<clip>/<frame>``."""

    _target_: str = "cltrain.data.video.ClipFolderDataModule"
    batch_size: int = key(8, POSITIVE)        # clips per device
    num_workers: Any = key(2, COUNT_OR_AUTO)  # auto: a worker per core
    image_size: int = key(112, POSITIVE)
    val_resize_size: int | None = key(128, OPT_POSITIVE)
    num_frames: int = key(16, POSITIVE)       # frames per clip (T)
    frame_stride: int = key(1, POSITIVE)      # every n-th frame
    scale: list[float] = key([0.08, 1.0], SCALE)  # crop area range
    hflip: float = key(0.5, UNIT_CLOSED)
    bad_files: str = key("raise", choices(*BAD_FILE_POLICIES))
    demo: VideoDemoConfig | None = None


@dataclass
class ClipFolderDemoConfig(ClipFolderConfig):
    """``schema/data/video_demo``: the moving-shapes clip demo, generated at ``root`` on first use."""

    root: str | None = key("data/video_demo", OPT_PATH)
    demo: VideoDemoConfig | None = field(default_factory=VideoDemoConfig)


def demo_home(data: DictConfig) -> str | None:
    """The one ``data.root`` at which the data option's demo set is generated: the default ``root`` of
    its schema (``data=demo`` -> ``data/demo``, ``data=video_demo`` -> ``data/video_demo``)."""
    schema = OmegaConf.get_type(data)
    root = next((f.default for f in dataclasses.fields(schema) if f.name == "root"), None) \
        if dataclasses.is_dataclass(schema) else None
    return root if isinstance(root, str) else None
