"""The image DataModules, and the bases every cltrain DataModule is built on.

========================================  =====================================================
``base.BatchDataModule``                  the loader, the device, normalisation on the device
``image_base.ImageDataModule``            + crops, decoder, ``Augmentation``: the image arguments
``class_folders.ClassFolderDataModule``   + class folders, ``bad_files`` (images and clips)
``image_folder.ImageFolderDataModule``    an ImageNet-layout folder
``shards.ShardsDataModule``               a pack of shards (``cltrain.data.pack``)
``hf.HFImageDataModule``                  a Hugging Face image dataset (Hub id, folder, Parquet)
``skipped_files.TakesBadFiles``           ``bad_files`` and the run directory's skipped-files list
``skipped_files.SkippedFilesReport``      the callback that counts ``bad_files="skip"``'s files
========================================  =====================================================

The clip DataModule, ``cltrain.data.video.ClipFolderDataModule``, lives with the rest of the
video path. ``ImageFolderDataModule``, ``ShardsDataModule`` and ``HFImageDataModule`` take
``ImageDataModule``'s arguments, written once there, and add their own (``base.takes_arguments_of``).
``HFImageDataModule`` needs ``datasets`` only when it opens a dataset.
"""

from cltrain.data.datamodules.base import BatchDataModule
from cltrain.data.datamodules.class_folders import ClassFolderDataModule
from cltrain.data.datamodules.hf import HFImageDataModule
from cltrain.data.datamodules.image_base import ImageDataModule
from cltrain.data.datamodules.image_folder import ImageFolderDataModule
from cltrain.data.datamodules.shards import ShardsDataModule
from cltrain.data.datamodules.skipped_files import SKIPPED_FILES_NAME, SkippedFilesReport

__all__ = [
    "HFImageDataModule",
    "SKIPPED_FILES_NAME",
    "BatchDataModule",
    "ClassFolderDataModule",
    "ImageDataModule",
    "ImageFolderDataModule",
    "ShardsDataModule",
    "SkippedFilesReport",
]

