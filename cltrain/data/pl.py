"""cltrain's DataModules as DataModules of the standalone ``pytorch_lightning`` package too, by their classes.

An instance of any cltrain DataModule made where ``pytorch_lightning`` is imported is already one (its ``Trainer``
checks ``isinstance``); what asks of the class itself, ``pytorch_lightning``'s ``LightningCLI``
(``--data cltrain.data.pl.ImageFolderDataModule``, or ``LightningCLI(model, cltrain.data.pl.ShardsDataModule)``),
takes these: each the same class made a subclass of both packages' ``LightningDataModule``, with the same hooks and
arguments. Importing this module imports ``pytorch_lightning``.
"""

from __future__ import annotations

import pytorch_lightning  # noqa: F401 - what for_loaded_trainers makes each class a DataModule of

from cltrain.data.datamodules.base import for_loaded_trainers
from cltrain.data.datamodules.engines import LitDataModule, MDSModule, WebDatasetModule
from cltrain.data.datamodules.hf import HFImageDataModule
from cltrain.data.datamodules.image_folder import ImageFolderDataModule
from cltrain.data.datamodules.shards import ShardsDataModule
from cltrain.data.video.datamodule import ClipFolderDataModule

__all__ = ["ClipFolderDataModule", "HFImageDataModule", "ImageFolderDataModule", "LitDataModule", "MDSModule",
           "ShardsDataModule", "WebDatasetModule"]

ClipFolderDataModule = for_loaded_trainers(ClipFolderDataModule)  # type: ignore[misc]
HFImageDataModule = for_loaded_trainers(HFImageDataModule)  # type: ignore[misc]
ImageFolderDataModule = for_loaded_trainers(ImageFolderDataModule)  # type: ignore[misc]
LitDataModule = for_loaded_trainers(LitDataModule)  # type: ignore[misc]
MDSModule = for_loaded_trainers(MDSModule)  # type: ignore[misc]
ShardsDataModule = for_loaded_trainers(ShardsDataModule)  # type: ignore[misc]
WebDatasetModule = for_loaded_trainers(WebDatasetModule)  # type: ignore[misc]
