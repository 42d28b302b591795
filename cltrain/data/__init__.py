"""The NHWC data path: batches leave the loader as uint8 NHWC, straight from the decoded images.

Its modules, one line each (the names below are importable from ``cltrain.data`` itself):

* ``transforms``: ``train_transform``, ``eval_transform``: image -> HWC uint8 in one crop+resize call.
* ``crop_kernels``: the pixel kernels of the transforms (reduced-size JPEG decoding, antialiased uint8 resize).
* ``decoders``: the JPEG back ends (libturbojpeg region decoding, simplejpeg) and ``get_decoder``.
* ``loader_threads``: the samples of a batch decoded on threads of one loading process.
* ``augment_ops``: ``HWCAugment`` (in the workers), ``RandomErasing``, ``MixupCutmix`` (on the device).
* ``augment_group``: ``Augmentation``, the training augmentation of the image DataModules as one group.
* ``collate``: ``NHWCCollate`` / ``nhwc_collate``: images into one ``(N, H, W, C)`` buffer, seen as NCHW channels_last.
* ``normalize``: ``normalize``: uint8 -> float32/bfloat16/float16 on the device, channels_last.
* ``errors``: ``DataError`` (one line naming the file or folder and the fix), ``BadImageError``.
* ``bad_samples``: the ``bad_files`` policy (``"raise"`` / ``"skip"``) of every Dataset here.
* ``image_folder_dataset``: ``ImageFolderDataset``, an ImageNet-layout split with a bad-file policy.
* ``index``: the cached file index of an image folder split.
* ``check``: ``python -m cltrain.data.check ROOT``: the unreadable files of a folder, before training.
* ``pack``: ``python -m cltrain.data.pack ROOT OUT``: an image folder into WebDataset shards.
* ``shard_dataset``: ``ShardsDataset``, one split of a pack, read by offset.
* ``shard_sampler``: ``ShardBatchSampler``, each sample once per epoch under DDP, ranks in step.
* ``shard_writer``: one shard of a pack: its files read and checked once, written with their paths.
* ``hf_source``: opening a Hugging Face dataset (Hub id, ``save_to_disk`` folder, Parquet), its splits and columns.
* ``hf_dataset``: Hugging Face ``datasets`` rows (encoded bytes) as samples, map-style or streamed.
* ``image_samples``: ``ImageSamples``, the base of the map-style image Datasets (a path or bytes per sample).
* ``prefetch``: ``PrefetchDataLoader``, the next batch copied to the GPU on a side stream.
* ``datamodules``: ``ImageFolderDataModule``, ``ShardsDataModule``, ``HFImageDataModule`` and their bases, for Lightning.
* ``pl``: the same DataModule classes as subclasses of the standalone ``pytorch_lightning``'s too (its LightningCLI).
* ``demo``: ``make_demo_dataset``, a small JPEG folder with a learnable signal, made locally.
* ``constants``: ImageNet statistics, the image suffixes read, the hidden and system entries no walk lists.
* ``video``: the same path for clips, ``(N, C, T, H, W)`` channels_last_3d.

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
    from cltrain.data.augment_group import Augmentation
    from cltrain.data.augment_ops import HWCAugment, MixupCutmix, RandomErasing
    from cltrain.data.collate import NHWCCollate, nhwc_collate
    from cltrain.data.constants import IMAGENET_MEAN, IMAGENET_STD, IMG_EXTENSIONS
    from cltrain.data.datamodules.hf import HFImageDataModule
    from cltrain.data.datamodules.image_folder import ImageFolderDataModule
    from cltrain.data.datamodules.mid_epoch import ResumeMidEpoch
    from cltrain.data.datamodules.shards import ShardsDataModule
    from cltrain.data.datamodules.skipped_files import SKIPPED_FILES_NAME, SkippedFilesReport
    from cltrain.data.demo import make_demo_dataset
    from cltrain.data.errors import BadImageError, DataError
    from cltrain.data.image_folder_dataset import ImageFolderDataset
    from cltrain.data.prefetch import PrefetchDataLoader
    from cltrain.data.shard_dataset import ShardsDataset
    from cltrain.data.transforms import CropParams, RandomResizedCropFlip, ResizeCenterCrop, eval_transform, train_transform

# ``normalize`` is also a submodule's name: bound here, so that importing the submodule later (which
# sets the package's attribute) cannot make ``cltrain.data.normalize`` the module instead of the function.
from cltrain.data.normalize import normalize  # noqa: E402 - torch only

#: name -> the module it comes from: imported on first use (PEP 562), so that a light module
#: (``cltrain.data.constants``, ``cltrain.data.decoders``) comes without Lightning.
_MODULES = {
    "HWCAugment": "augment_ops",
    "MixupCutmix": "augment_ops",
    "RandomErasing": "augment_ops",
    "Augmentation": "augment_group",
    "NHWCCollate": "collate",
    "nhwc_collate": "collate",
    "IMAGENET_MEAN": "constants",
    "IMAGENET_STD": "constants",
    "IMG_EXTENSIONS": "constants",
    "SKIPPED_FILES_NAME": "datamodules.skipped_files",
    "ImageFolderDataModule": "datamodules.image_folder",
    "HFImageDataModule": "datamodules.hf",
    "SkippedFilesReport": "datamodules.skipped_files",
    "ResumeMidEpoch": "datamodules.mid_epoch",
    "BadImageError": "errors",
    "DataError": "errors",
    "ImageFolderDataset": "image_folder_dataset",
    "make_demo_dataset": "demo",
    "PrefetchDataLoader": "prefetch",
    "ShardsDataModule": "datamodules.shards",
    "ShardsDataset": "shard_dataset",
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
    "DataError",
    "HFImageDataModule",
    "HWCAugment",
    "ImageFolderDataModule",
    "ImageFolderDataset",
    "MixupCutmix",
    "NHWCCollate",
    "PrefetchDataLoader",
    "RandomErasing",
    "RandomResizedCropFlip",
    "ResizeCenterCrop",
    "ResumeMidEpoch",
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

    try:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] not in ("torchvision", "PIL", "simplejpeg", "turbojpeg"):
            raise
        raise ModuleNotFoundError(f"cltrain.data.{name} needs {err.name}: pip install 'cltrain[data]'",
                                  name=err.name) from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES])
