"""The image DataModules, and the bases every cltrain DataModule is built on.

========================================  =====================================================
``base.BatchDataModule``                  the loader, the device, normalisation on the device,
                                          the bad-file policy's list of skipped samples
``image_base.ImageDataModule``            + crops, decoding, ``Augmentation``: the image groups
``image_folder.ImageFolderDataModule``    an ImageNet-layout folder
``shards.ShardsDataModule``               a pack of shards (``cltrain.data.pack``)
``hf.HFImageDataModule``                  a Hugging Face image dataset (Hub id, folder, Parquet)
``engines``                               LitData, Mosaic MDS and WebDataset datasets
``class_folders.ClassFolders``            the class folders of ``root/train`` and ``root/val``
``skipped_files.SkippedFilesReport``      the callback that counts ``bad_files="skip"``'s files
``mid_epoch.ResumeMidEpoch``              a ``max_steps`` stop's checkpoint resumes in its epoch
========================================  =====================================================

Each DataModule is made of settings groups (``cltrain.data.settings``): its arguments are their
fields, each default written once there, and the training app's ``data.*`` keys are the same.
The clip DataModule, ``cltrain.data.video.ClipFolderDataModule``, lives with the rest of the
video path. ``HFImageDataModule`` needs ``datasets`` only when it opens a dataset.
"""

from cltrain.data.datamodules.base import BatchDataModule
from cltrain.data.datamodules.class_folders import ClassFolders
from cltrain.data.datamodules.hf import HFImageDataModule
from cltrain.data.datamodules.image_base import ImageDataModule
from cltrain.data.datamodules.image_folder import ImageFolderDataModule
from cltrain.data.datamodules.mid_epoch import ResumeMidEpoch
from cltrain.data.datamodules.shards import ShardsDataModule
from cltrain.data.datamodules.skipped_files import SKIPPED_FILES_NAME, SkippedFilesReport

__all__ = [
    "HFImageDataModule",
    "SKIPPED_FILES_NAME",
    "BatchDataModule",
    "ClassFolders",
    "ImageDataModule",
    "ImageFolderDataModule",
    "ResumeMidEpoch",
    "ShardsDataModule",
    "SkippedFilesReport",
]
