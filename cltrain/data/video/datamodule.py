"""``ClipFolderDataModule``: a clip folder as channels_last_3d batches for Lightning.

``root/train/<class>/<clip>/<frame>.jpg`` and ``root/val/<class>/<clip>/...``
(or video files in place of the clip folders); test and predict use ``val``.
Workers sample and crop clips with ``train_clip_transform`` /
``eval_clip_transform`` and collate them with ``NDHWCCollate``, so
uint8 NDHWC buffers cross the process boundary and the host-to-device copy; the
batch is normalised on its device in ``on_after_batch_transfer``: every step
receives ``(clips, targets)`` with clips ``(N, C, T, H, W)`` float,
channels_last_3d (or contiguous with ``channels_last=False``). The training
loader drops its last partial batch (stable shapes, no batch of 1 for BatchNorm).

Example::

    >>> from cltrain.data.video import ClipFolderDataModule, make_demo_videos
    >>> dm = ClipFolderDataModule(make_demo_videos("/tmp/cltrain-video-demo"), batch_size=8, num_frames=8, image_size=56)
    >>> dm.num_classes, dm.input_shape
    (6, (8, 3, 8, 56, 56))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from cltrain.data.augment_group import RandomCrop
from cltrain.data.constants import KINETICS_MEAN, KINETICS_STD
from cltrain.data.datamodules.base import BatchDataModule
from cltrain.data.datamodules.class_folders import ClassFolders
from cltrain.data.normalize import normalize
from cltrain.data.prefetch import PrefetchDataLoader
from cltrain.data.settings import CLIPS
from cltrain.data.transforms import size_pair
from cltrain.data.video.collate import NDHWCCollate
from cltrain.data.video.dataset import ClipFolderDataset
from cltrain.data.video.transforms import eval_clip_transform, train_clip_transform

__all__ = ["KINETICS_MEAN", "KINETICS_STD", "ClipFolderDataModule", "normalize_clips"]


def normalize_clips(clips: torch.Tensor, mean: Sequence[float] = KINETICS_MEAN, std: Sequence[float] = KINETICS_STD,
                    dtype: torch.dtype = torch.float32, channels_last: bool = True) -> torch.Tensor:
    """``(clips / 255 - mean) / std`` of an ``(N, C, T, H, W)`` uint8 channels_last_3d batch, with the
    Kinetics statistics by default, through ``cltrain.data.normalize`` (which takes 5-D batches);
    channels_last_3d out (or contiguous with ``channels_last=False``)."""
    if not isinstance(clips, torch.Tensor) or clips.dim() != 5 or clips.dtype != torch.uint8:
        what = f"{clips.dtype} tensor of shape {tuple(clips.shape)}" if isinstance(clips, torch.Tensor) else type(clips).__name__
        raise TypeError(f"normalize_clips expects an (N, C, T, H, W) uint8 tensor, got a {what}.")
    fmt = torch.channels_last_3d if channels_last else torch.contiguous_format
    return normalize(clips, mean, std, dtype, memory_format=fmt)


class ClipFolderDataModule(BatchDataModule):
    """Train/val clip folders as normalised channels_last_3d ``(N, C, T, H, W)`` batches.

    Made of ``cltrain.data.settings.CLIPS``: ``ClipLoading`` (``batch_size``: 8 clips, ``num_workers``,
    ...), ``ClipCrop`` (``image_size``: 112, ``val_resize_size``: 128), ``ClipPixels`` (Kinetics'
    ``mean`` and ``std``, ``channels_last``, ...), ``ClipSampling`` (``num_frames``, ``frame_stride``,
    ``val_temporal``), ``RandomCrop`` (``scale``, ``ratio``, ``hflip``: 0 for data whose label depends
    on left and right) and ``BadFilePolicy`` (``bad_files``: a clip that cannot be read stops the run,
    or is replaced by the next readable clip and listed, as images are) and ``ExcludeList``
    (``exclude_files``: clips left out from the start, by a list from ``python -m cltrain.data.check ROOT``
    or a ``skipped_files.tsv``); each argument is documented in its group. ``root`` holds ``train/`` and
    ``val/``, each ``<class>/<clip>/<frame>``.

    Raises:
        ValueError: a bad argument (at construction); a split without class folders, a
            class without clips, a clip folder without frames, classes that differ (in ``setup``).
        FileNotFoundError: a missing root or split.
    """

    layout_hint = ("a folder with train/<class>/<clip>/ and val/<class>/<clip>/, or make one with "
                   "cltrain.data.video.make_demo_videos(root)")
    settings = CLIPS
    augmentation: RandomCrop

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.folders = ClassFolders(self.root, type(self).__name__, self.layout_hint)
        self.image_size = size_pair(self.image_size, "image_size")
        # Built now so that bad sizes, frame counts or channels fail here, not in a worker.
        crop = self.augmentation
        self.train_transform = train_clip_transform(self.num_frames, self.frame_stride, self.image_size, crop.scale,
                                                    crop.ratio, crop.hflip, self.channels)
        eval_stride = self.frame_stride if self.val_temporal == "center" else 1
        self.eval_transform = eval_clip_transform(self.num_frames, eval_stride, self.image_size, self.val_resize_size,
                                                  self.channels, self.val_temporal)
        self.train_set: ClipFolderDataset | None = None
        self.val_set: ClipFolderDataset | None = None
        self._told_excluded = False

    @property
    def input_shape(self) -> tuple[int, int, int, int, int]:
        """``(batch_size, channels, num_frames, height, width)`` of a training batch."""
        return (self.batch_size, self.channels, self.num_frames, *self.image_size)

    @override
    def setup(self, stage: str) -> None:
        self._join_trainer()
        # Everything is listed here, before the first step (the clips are decoded when read).
        exclude = self.folders.exclusions(self.exclude_files)
        if stage == "fit" and self.train_set is None:
            self.train_set = ClipFolderDataset(self.folders.split("train"), self.train_transform, self.classes, self.bad_files,
                                               self._skip_log, exclude)
        if self.val_set is None:
            self.val_set = ClipFolderDataset(self.folders.split("val"), self.eval_transform, self.classes, self.bad_files,
                                             self._skip_log, exclude)
            if exclude and not self._told_excluded:
                self._told_excluded = True
                self.folders.tell_excluded(self.exclude_files, exclude.listed,
                                           {"train": self.train_set, "val": self.val_set}, "clip")

    @override
    def _collate(self, pin_memory: bool) -> NDHWCCollate:
        return NDHWCCollate(pin_memory=pin_memory)

    @override
    def train_dataloader(self) -> PrefetchDataLoader:
        # whole batches only, unless the (small) set holds less than one
        return self._loader(self.train_set, train=True, drop_last=len(self.train_set or ()) >= self.batch_size)
