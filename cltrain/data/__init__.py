"""The NHWC data path: batches leave the loader as uint8 NHWC, straight from the decoded images.

* ``train_transform``, ``eval_transform``: image -> HWC uint8 in one crop+resize
  call, with reduced-size JPEG decoding when it cannot change the output. Given a JPEG path
  (as ``ImageFolderDataset`` does) they decode with libjpeg-turbo (simplejpeg) and
  resize with torch's antialiased uint8 kernel; a PIL image, another format, or no
  simplejpeg takes the Pillow path.
* ``NHWCCollate`` / ``nhwc_collate``: images into one ``(N, H, W, C)``
  buffer, returned as its ``(N, C, H, W)`` channels_last view, plus int64 targets.
* ``normalize``: uint8 -> float32/bfloat16/float16 on the device, channels_last.
* ``ImageFolderDataModule``: all of it for Lightning, from an ImageNet-layout folder; its training
  augmentation is one ``Augmentation`` (or its fields as keywords).
* ``ShardsDataModule``: the same from WebDataset shards packed by ``python -m cltrain.data.pack``.
* ``make_demo_dataset``: a small JPEG folder with a learnable signal, made locally.
* ``HWCAugment`` (TrivialAugment / RandAugment in the workers), ``RandomErasing``
  and ``MixupCutmix`` (on the device batch, channels_last kept): see ``cltrain.data.augment``.

Example::

    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> from cltrain.data import ImageFolderDataset, train_transform, nhwc_collate, normalize, make_demo_dataset
    >>> root = make_demo_dataset("/tmp/cltrain-demo")
    >>> loader = DataLoader(ImageFolderDataset(root / "train", train_transform(224)), batch_size=8,
    ...                     num_workers=2, collate_fn=nhwc_collate)
    >>> images, targets = next(iter(loader))
    >>> x = normalize(images)           # on the GPU: normalize(images.cuda(non_blocking=True))
    >>> x.shape, x.is_contiguous(memory_format=torch.channels_last)
    (torch.Size([8, 3, 224, 224]), True)
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cltrain.data.augment import HWCAugment, MixupCutmix, RandomErasing
    from cltrain.data.augmentation import Augmentation
    from cltrain.data.collate import NHWCCollate, nhwc_collate
    from cltrain.data.constants import IMAGENET_MEAN, IMAGENET_STD, IMG_EXTENSIONS
    from cltrain.data.datamodule import SKIPPED_FILES_NAME, ImageFolderDataModule
    from cltrain.data.folders import SkippedFilesReport
    from cltrain.data.dataset import BadImageError, ImageFolderDataset
    from cltrain.data.demo import make_demo_dataset
    from cltrain.data.prefetch import PrefetchDataLoader
    from cltrain.data.shards import ShardsDataModule, ShardsDataset
    from cltrain.data.transforms import CropParams, RandomResizedCropFlip, ResizeCenterCrop, eval_transform, train_transform

# ``normalize`` is also a submodule's name: bound here, so that importing the submodule later (which
# sets the package's attribute) cannot make ``cltrain.data.normalize`` the module instead of the function.
from cltrain.data.normalize import normalize  # noqa: E402 - torch only

#: name -> the module it comes from: imported on first use (PEP 562), so that a light module
#: (``cltrain.data.constants``, ``cltrain.data.decoders``) comes without Lightning.
_MODULES = {
    "HWCAugment": "augment",
    "MixupCutmix": "augment",
    "RandomErasing": "augment",
    "Augmentation": "augmentation",
    "NHWCCollate": "collate",
    "nhwc_collate": "collate",
    "IMAGENET_MEAN": "constants",
    "IMAGENET_STD": "constants",
    "IMG_EXTENSIONS": "constants",
    "SKIPPED_FILES_NAME": "datamodule",
    "ImageFolderDataModule": "datamodule",
    "SkippedFilesReport": "folders",
    "BadImageError": "dataset",
    "ImageFolderDataset": "dataset",
    "make_demo_dataset": "demo",
    "PrefetchDataLoader": "prefetch",
    "ShardsDataModule": "shards",
    "ShardsDataset": "shards",
    "CropParams": "transforms",
    "RandomResizedCropFlip": "transforms",
    "ResizeCenterCrop": "transforms",
    "eval_transform": "transforms",
    "train_transform": "transforms",
}

__all__ = [
    "Augmentation",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMG_EXTENSIONS",
    "SKIPPED_FILES_NAME",
    "BadImageError",
    "CropParams",
    "HWCAugment",
    "ImageFolderDataModule",
    "ImageFolderDataset",
    "MixupCutmix",
    "NHWCCollate",
    "PrefetchDataLoader",
    "RandomErasing",
    "RandomResizedCropFlip",
    "ResizeCenterCrop",
    "ShardsDataModule",
    "ShardsDataset",
    "SkippedFilesReport",
    "eval_transform",
    "make_demo_dataset",
    "nhwc_collate",
    "normalize",
    "train_transform",
]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES])
