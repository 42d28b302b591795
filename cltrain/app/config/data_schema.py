"""The ``data`` group's schemas, built from the DataModules' own settings groups.

Each data option's schema is its DataModule's settings (``cltrain.data.settings.DATAMODULE_SETTINGS``):
the same fields, types and defaults, so a default is written once, in ``cltrain.data.settings``,
for the library and the app; ``Pixels`` is left out (the app sets ``channels_last`` from its
toggle). What a value may be beyond its type is the rule of its name (``DATA_RULES``; a key that
may be null takes null too). ``DataConfig`` is the group's type in
``cltrain.app.config.schema.TrainConfig``; each option's yaml extends one of its subclasses
(``conf/data/demo.yaml`` extends ``ImageFolderDemoConfig``). A demo option's schema carries the demo
set's generator arguments (``data.demo``) and the one ``root`` at which the set is generated
(``demo_home``).

Example::

    >>> from omegaconf import OmegaConf
    >>> demo_home(OmegaConf.structured(ImageFolderDemoConfig))
    'data/demo'
    >>> OmegaConf.structured(ImageFolderConfig).batch_size
    64
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from omegaconf import MISSING, DictConfig, OmegaConf

from cltrain.app.config.rules import (
    FIELD,
    IMAGE_SIZE_WH,
    INDEX_CACHE,
    NON_NEGATIVE,
    OPT_PATH,
    PATH,
    POSITIVE,
    POSITIVE_OR_AUTO,
    COUNT_OR_AUTO,
    RATIO,
    SCALE,
    SEED,
    SIZE,
    TEXT,
    UNIT_CLOSED,
    Rule,
    choices,
    key,
)
from cltrain.data.augment_ops import AUGMENT_POLICIES
from cltrain.data.bad_samples import BAD_FILE_POLICIES
from cltrain.data.constants import CHECK_MODES
from cltrain.data.crop_kernels import INTERPOLATIONS
from cltrain.data.decoders import DECODER_NAMES
from cltrain.data.settings import DATAMODULE_SETTINGS, Pixels
from cltrain.data.shard_source import FETCH_MODES

__all__ = [
    "DATA_RULES",
    "DEMO_GENERATORS",
    "DEMO_RULES",
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

#: What each ``data.*`` key allows beyond its type, by name (booleans need none).
DATA_RULES: dict[str, Rule] = {
    "batch_size": POSITIVE, "num_workers": COUNT_OR_AUTO, "image_size": POSITIVE, "val_resize_size": POSITIVE,
    "interpolation": choices(*INTERPOLATIONS), "decode_threads": POSITIVE_OR_AUTO, "decoder": choices(*DECODER_NAMES),
    "scale": SCALE, "ratio": RATIO, "hflip": UNIT_CLOSED, "augment": choices(*AUGMENT_POLICIES),
    "random_erasing": UNIT_CLOSED, "mixup_alpha": NON_NEGATIVE, "cutmix_alpha": NON_NEGATIVE,
    "mixup_prob": UNIT_CLOSED, "mixup_switch_prob": UNIT_CLOSED, "bad_files": choices(*BAD_FILE_POLICIES),
    "exclude_files": PATH, "check_val": choices(*CHECK_MODES), "index_cache": INDEX_CACHE,
    "seed": SEED, "shuffle_window": POSITIVE, "fetch": choices(*FETCH_MODES), "cache_dir": PATH, "cache_limit": SIZE,
    "train_split": TEXT, "val_split": TEXT, "image_column": TEXT, "label_column": TEXT, "shuffle_buffer": POSITIVE,
    "shuffle_seed": SEED, "num_classes": POSITIVE, "image_key": FIELD, "label_key": FIELD, "max_cache_size": TEXT,
    "num_frames": POSITIVE, "frame_stride": POSITIVE, "val_temporal": choices("center", "uniform"),
}

@dataclass
class DataConfig:
    """``data``: what every data option has; each option's schema extends it with its DataModule's settings."""

    _target_: str = MISSING                   # the DataModule class
    root: str | None = key(None, OPT_PATH)    # relative to the directory you start from; required unless a demo


_PRIMITIVE = (int, float, str, bool, type(None))
_UNIONS = (Union, types.UnionType)


def _config_type(hint: Any) -> Any:
    """The type a settings field has in the config: its primitive part (``int | tuple[int, int]`` -> ``int``,
    ``str | os.PathLike | None`` -> ``str | None``), a list for a sequence (``scale``)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in _UNIONS else (hint,)
    kept = [t for t in options if t in _PRIMITIVE]
    if not kept:
        sequence = next((t for t in options if typing.get_origin(t) in (tuple, list, collections.abc.Sequence)), None)
        return list[typing.get_args(sequence)[0]] if sequence is not None else Any
    return kept[0] if len(kept) == 1 else Union[tuple(kept)]  # noqa: UP007 - a Union built from a list


def _rule(name: str, tp: Any) -> Rule | None:
    """``DATA_RULES[name]``, taking null too where the type does."""
    rule = DATA_RULES.get(name)
    if rule is None or type(None) not in typing.get_args(tp):
        return rule
    return Rule(lambda v, test=rule.test: v is None or test(v), rule.reason,
                f"{rule.allowed}, or null" if rule.allowed else "or null")


def _schema(name: str, target: str, doc: str, base: type = DataConfig, **extra: Any) -> type:
    """The schema of the data option whose DataModule is ``target``: ``base``, then every field of its
    settings groups (but ``Pixels``) with its default, then ``extra`` (name -> (type, field))."""
    fields: list[tuple[str, Any, Any]] = [("_target_", str, field(default=target))]
    for group in DATAMODULE_SETTINGS[target]:
        if issubclass(group, Pixels):
            continue
        hints = typing.get_type_hints(group)
        for f in dataclasses.fields(group):
            tp = _config_type(hints[f.name])
            default = MISSING if f.default is dataclasses.MISSING else f.default
            fields.append((f.name, tp, key(list(default) if isinstance(default, tuple) else default, _rule(f.name, tp))))
    fields += [(k, tp, f) for k, (tp, f) in extra.items()]
    schema = dataclasses.make_dataclass(name, fields, bases=(base,), namespace={"__doc__": doc})
    schema.__module__ = __name__
    return schema


def _demo_schema(name: str, generator: str, doc: str) -> type:
    """The ``data.demo`` schema of a demo set: ``generator``'s arguments and their defaults (its signature, one
    place), with ``DEMO_RULES``; then ``any_root``: true generates it at any ``data.root``, else only at the
    option's own root."""
    from hydra.utils import get_method

    params = list(inspect.signature(get_method(generator)).parameters.values())[1:]  # after root
    hints = typing.get_type_hints(get_method(generator))
    fields = [(p.name, _config_type(hints[p.name]),
               key(list(p.default) if isinstance(p.default, tuple) else p.default, DEMO_RULES[p.name])) for p in params]
    schema = dataclasses.make_dataclass(name, [*fields, ("any_root", bool, field(default=False))],
                                        namespace={"__doc__": doc})
    schema.__module__ = __name__
    DEMO_GENERATORS[schema] = generator
    return schema


#: The generator of each demo schema (``data.demo``'s type).
DEMO_GENERATORS: dict[type, str] = {}


#: What each ``data.demo.*`` key allows beyond its type.
DEMO_RULES: dict[str, Rule] = {"num_classes": POSITIVE, "train_per_class": POSITIVE, "val_per_class": POSITIVE,
                               "image_size": IMAGE_SIZE_WH, "num_frames": POSITIVE, "frame_size": POSITIVE, "seed": SEED}
ImageDemoConfig = _demo_schema("ImageDemoConfig", "cltrain.data.make_demo_dataset",
                               "``data.demo``: the generated image demo set (``cltrain.data.make_demo_dataset``'s arguments).")
VideoDemoConfig = _demo_schema("VideoDemoConfig", "cltrain.data.video.make_demo_videos",
                               "``data.demo``: the generated clip demo set (``cltrain.data.video.make_demo_videos``'s "
                               "arguments).")

ImageFolderConfig = _schema(
    "ImageFolderConfig", "cltrain.data.ImageFolderDataModule",
    "``schema/data/images``: an ImageNet-layout folder, ``<root>/{train,val}/<class>/<image>``.",
    demo=(ImageDemoConfig | None, field(default=None)))  # set: generate the demo set at root when it is missing
ShardsConfig = _schema(
    "ShardsConfig", "cltrain.data.ShardsDataModule",
    "``schema/data/shards``: WebDataset shards packed by ``cltrain-pack``; ``root`` a folder or a URL "
    "(docs/guides/object-storage.md).")
LitDataConfig = _schema(
    "LitDataConfig", "cltrain.data.datamodules.engines.LitDataModule",
    "``schema/data/litdata``: LitData optimized datasets (``litdata.optimize``), ``<root>/train`` and ``<root>/val``.")
MDSConfig = _schema(
    "MDSConfig", "cltrain.data.datamodules.engines.MDSModule",
    "``schema/data/mds``: Mosaic MDS datasets, ``<root>/train/index.json`` and ``<root>/val/index.json``.")
WebDatasetConfig = _schema(
    "WebDatasetConfig", "cltrain.data.datamodules.engines.WebDatasetModule",
    "``schema/data/webdataset``: WebDataset tar shards, ``<root>/train/*.tar`` and ``<root>/val/*.tar``, streamed.")
HFConfig = _schema(
    "HFConfig", "cltrain.data.HFImageDataModule",
    "``schema/data/hf``: a Hugging Face image dataset: a Hub id, a ``save_to_disk`` folder or Parquet files.")
ClipFolderConfig = _schema(
    "ClipFolderConfig", "cltrain.data.video.ClipFolderDataModule",
    "``schema/data/video``: clips as folders of frames, ``<root>/{train,val}/<class>/<clip>/<frame>``.",
    demo=(VideoDemoConfig | None, field(default=None)))


@dataclass
class ImageFolderDemoConfig(ImageFolderConfig):  # type: ignore[valid-type,misc]
    """``schema/data/images_demo``: the image demo set, generated at ``root`` (its only place) on first use."""

    root: str | None = key("data/demo", OPT_PATH)
    demo: ImageDemoConfig | None = field(default_factory=ImageDemoConfig)


@dataclass
class ClipFolderDemoConfig(ClipFolderConfig):  # type: ignore[valid-type,misc]
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
