"""The training data for ``train(cfg)``: the DataModule built from ``cfg.data``, its folder checked first.

``build_datamodule`` generates the demo set when configured, checks the ImageNet layout
cheaply (one directory listing per class folder, before anything is built; hidden and system
entries such as ``.ipynb_checkpoints`` or ``Thumbs.db`` are skipped by the data path's one rule,
``cltrain.data.constants.is_hidden``) and instantiates ``data._target_``; every problem is a
one-line ``ConfigError``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from cltrain.app.config.errors import ConfigError
from cltrain.data.demo import NotADemoFolder
from cltrain.app.config.data_schema import DEMO_GENERATORS
from cltrain.data.constants import is_hidden
from cltrain.data.hf_source import is_hub_id
from cltrain.data.index import unicode_twins
from cltrain.data.remote import RemoteError, is_url, redact

__all__ = ["absolute", "build_datamodule"]


def absolute(path: Any) -> str | None:
    """``path`` as an absolute string (``~`` expanded), or None."""
    return None if path is None else str(Path(str(path)).expanduser().resolve())


def build_datamodule(cfg: DictConfig) -> pl.LightningDataModule:
    """The configured DataModule (``data._target_``), with the demo set generated first when configured."""
    data = OmegaConf.to_container(cfg.data, resolve=True)
    demo = data.pop("demo", None)
    crop, resize = data.get("image_size"), data.get("val_resize_size")
    if isinstance(crop, int) and isinstance(resize, int) and resize < crop:  # validation: a crop of the resize
        raise ConfigError("data.val_resize_size", resize, f"smaller than data.image_size={crop}, which validation "
                          "crops from it", f"data.val_resize_size={round(crop / 0.875)} (the 0.875 crop ratio) or "
                          f"anything >= {crop}, set with data.image_size")
    keep = is_url(data["root"]) or (data["_target_"].endswith("HFImageDataModule") and is_hub_id(data["root"]))
    if not keep:  # a URL or a Hub id is not a path
        data["root"] = absolute(data["root"])
    if demo is not None:
        from hydra.utils import get_method

        demo.pop("any_root")
        make_demo = get_method(DEMO_GENERATORS[OmegaConf.get_type(cfg.data.demo)])  # the demo schema names its generator
        try:
            make_demo(data["root"], **demo)
        except NotADemoFolder:  # the user's own images, maybe: read as an image folder
            raise ConfigError("data.root", data["root"], f"{data['root']} exists and is not a cltrain demo folder; "
                              "it is left untouched", f"data=imagenet data.root={data['root']} to train on the "
                              "images in it") from None
        except FileExistsError as err:  # a demo folder made with other settings
            raise ConfigError("data.root", data["root"], str(err).split(": ", 1)[-1],
                              "the data.demo settings the demo folder was made with") from None
    try:
        datamodule = instantiate(data, channels_last=cfg.channels_last)
    except InstantiationException as err:  # a bad data.* argument: the DataModule's ValueError names it
        raise ConfigError("data", data.get("_target_"), str(err.__cause__ or err).splitlines()[0]) from None
    if getattr(datamodule, "folders", None) is not None:  # class folders (ClassFolders); a pack or a dataset of rows says what it holds itself
        _check_layout(Path(data["root"]), bool(data.get("allow_missing_val_classes", False)), cfg.evaluate_only)
    try:
        datamodule.num_classes  # reads the class folders (or the dataset's labels): a missing split fails here
    except (FileNotFoundError, NotADirectoryError, ValueError) as err:
        if isinstance(err, RemoteError):  # it names the URL and the fix itself
            raise ConfigError("data.root", redact(data["root"]), str(err).split(": ", 1)[-1]) from None
        hint = getattr(datamodule, "root_hint", "an ImageNet-layout folder: train/<class>/, val/<class>/")
        raise ConfigError("data.root", data["root"], str(err).splitlines()[0], hint) from None
    return datamodule


def _check_layout(root: Path, allow_missing_val_classes: bool, evaluate_only: bool) -> None:
    """The ImageNet layout, checked cheaply (one directory listing per class) before anything is built:
    both splits there, no empty class folder, every training class in ``val/``."""
    layout = "an ImageNet-layout folder: train/<class>/<image>, val/<class>/<image>"
    classes: dict[str, set[str]] = {}
    for split in ("val",) if evaluate_only else ("train", "val"):
        folder = root / split
        if not folder.is_dir():
            raise ConfigError("data.root", str(root), f"has no {split}/ folder", layout)
        classes[split] = {e.name for e in os.scandir(folder) if not is_hidden(e.name) and e.is_dir()}
        if not classes[split]:
            raise ConfigError("data.root", str(root), f"{split}/ has no class folders", layout)
        for name in sorted(classes[split]):
            with os.scandir(folder / name) as entries:
                hidden = []
                for entry in entries:
                    if not is_hidden(entry.name):
                        break
                    hidden.append(entry.name)
                else:
                    what = f"holds only {', '.join(sorted(hidden)[:3])}" if hidden else "is empty"
                    raise ConfigError("data.root", str(root), f"the class folder {split}/{name}/ {what}",
                                      "remove it, or put its images there")
    missing = sorted(classes.get("train", set()) - classes["val"])
    if missing and not allow_missing_val_classes:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        twins = unicode_twins(sorted(classes["val"] - classes["train"]), missing)  # the same name, other code points
        raise ConfigError("data.root", str(root), f"{len(missing)} training class(es) have no val/ folder "
                          f"({shown}){twins}", "rename the val/ folder as the training split names it" if twins else
                          "add them to val/, or data.allow_missing_val_classes=true")
