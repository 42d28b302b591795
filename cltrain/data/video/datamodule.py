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

import os
from collections.abc import Sequence

import torch
from typing_extensions import override

from cltrain.data.datamodules.class_folders import ClassFolderDataModule
from cltrain.data.normalize import normalize
from cltrain.data.prefetch import PrefetchDataLoader
from cltrain.data.transforms import size_pair
from cltrain.data.video.collate import NDHWCCollate
from cltrain.data.video.dataset import ClipFolderDataset
from cltrain.data.video.transforms import TEMPORAL_MODES, eval_clip_transform, train_clip_transform

__all__ = ["KINETICS_MEAN", "KINETICS_STD", "ClipFolderDataModule", "normalize_clips"]

#: The statistics torchvision's Kinetics-400 video models were trained with.
KINETICS_MEAN: tuple[float, float, float] = (0.43216, 0.394666, 0.37645)
KINETICS_STD: tuple[float, float, float] = (0.22803, 0.22145, 0.216989)


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


class ClipFolderDataModule(ClassFolderDataModule):
    """Train/val clip folders as normalised channels_last_3d ``(N, C, T, H, W)`` batches.

    Args:
        root: folder holding ``train/`` and ``val/``, each ``<class>/<clip>/<frame>``.
        batch_size: clips per batch.
        num_workers: DataLoader worker processes (0: load in the main process).
        persistent_workers: keep workers between epochs (when ``num_workers > 0``).
        pin_memory: ``None`` pins only when the trainer runs on a GPU.
        num_frames: frames per clip (T).
        frame_stride: step between the sampled frames.
        image_size: training crop and evaluation crop (int or (height, width)).
        val_resize_size: shorter side before the evaluation centre crop (``None``: no resize).
        scale: area range of the training random-resized-crop.
        hflip: flip probability in training (0 for data whose label depends on left/right).
        val_temporal: ``"center"`` segment or ``"uniform"`` frames over the clip for evaluation.
        channels: 3 (RGB) or 1 (grayscale).
        mean: per-channel normalisation mean (0-1 units); torchvision's Kinetics one by default.
        std: per-channel normalisation standard deviation (0-1 units); Kinetics' by default.
        dtype: dtype of the normalised clips (float32, bfloat16 or float16).
        channels_last: ``False`` gives contiguous NCTHW batches (the baseline).
        cuda_prefetch: on a CUDA device, copy the next batch on a side stream (as
            ``ImageFolderDataModule``).
        bad_files: ``"raise"``: a clip that cannot be read stops with an error naming it;
            ``"skip"``: it is replaced by the next readable clip, listed in the run directory's
            ``skipped_files.tsv`` and counted per epoch (``data/skipped_<split>``), as images are.

    Raises:
        ValueError: a bad argument (at construction); a split without class folders, a
            class without clips, a clip folder without frames, classes that differ (in ``setup``).
        FileNotFoundError: a missing root or split.
    """

    layout_hint = ("a folder with train/<class>/<clip>/ and val/<class>/<clip>/, or make one with "
                   "cltrain.data.video.make_demo_videos(root)")

    def __init__(self, root: str | os.PathLike, batch_size: int = 8, num_workers: int = 2, persistent_workers: bool = True,
                 pin_memory: bool | None = None, num_frames: int = 16, frame_stride: int = 1,
                 image_size: int | tuple[int, int] = 112, val_resize_size: int | None = 128,
                 scale: Sequence[float] = (0.08, 1.0), hflip: float = 0.5, val_temporal: str = "center", channels: int = 3,
                 mean: Sequence[float] = KINETICS_MEAN, std: Sequence[float] = KINETICS_STD,
                 dtype: torch.dtype = torch.float32, channels_last: bool = True, cuda_prefetch: bool = False,
                 bad_files: str = "raise") -> None:
        if val_temporal not in TEMPORAL_MODES[1:]:
            raise ValueError(f"ClipFolderDataModule: val_temporal={val_temporal!r} must be one of {TEMPORAL_MODES[1:]}.")
        super().__init__(root, batch_size=batch_size, num_workers=num_workers, persistent_workers=persistent_workers,
                         pin_memory=pin_memory, channels=channels, mean=mean, std=std, dtype=dtype,
                         channels_last=channels_last, cuda_prefetch=cuda_prefetch, bad_files=bad_files)
        self.num_frames, self.frame_stride = num_frames, frame_stride
        self.image_size = size_pair(image_size, "image_size")
        # Built now so that bad sizes, frame counts or channels fail here, not in a worker.
        self.train_transform = train_clip_transform(num_frames, frame_stride, self.image_size, tuple(scale),
                                                    hflip=hflip, channels=channels)
        eval_stride = frame_stride if val_temporal == "center" else 1
        self.eval_transform = eval_clip_transform(num_frames, eval_stride, self.image_size, val_resize_size, channels, val_temporal)
        self.train_set: ClipFolderDataset | None = None
        self.val_set: ClipFolderDataset | None = None

    @property
    def input_shape(self) -> tuple[int, int, int, int, int]:
        """``(batch_size, channels, num_frames, height, width)`` of a training batch."""
        return (self.batch_size, self.channels, self.num_frames, *self.image_size)

    @override
    def setup(self, stage: str) -> None:
        self._choose_device()
        self._open_skip_log()
        # Everything is listed and checked here, before the first step.
        if stage == "fit" and self.train_set is None:
            self.train_set = ClipFolderDataset(self._split_dir("train"), self.train_transform, self.classes, self.bad_files,
                                               self._skip_log)
        if self.val_set is None:
            self.val_set = ClipFolderDataset(self._split_dir("val"), self.eval_transform, self.classes, self.bad_files,
                                             self._skip_log)

    @override
    def _collate(self, pin_memory: bool) -> NDHWCCollate:
        return NDHWCCollate(pin_memory=pin_memory)

    @override
    def train_dataloader(self) -> PrefetchDataLoader:
        # whole batches only, unless the (small) set holds less than one
        return self._loader(self.train_set, train=True, drop_last=len(self.train_set or ()) >= self.batch_size)
