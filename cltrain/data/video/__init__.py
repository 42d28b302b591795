"""The channels_last_3d data path for video: clips leave the loader as uint8 NDHWC.

* ``collate``: ``NDHWCCollate`` / ``ndhwc_collate``: (T, H, W, C) clips into one
  ``(N, T, H, W, C)`` buffer, returned as its ``(N, C, T, H, W)`` channels_last_3d view.
* ``transforms``: ``train_clip_transform``, ``eval_clip_transform``: a clip's frames -> (T, H, W, C)
  uint8: ``TemporalSample`` picks T frames, one crop box and flip for all of them.
* ``dataset``: ``ClipFolderDataset``, ``split/<class>/<clip>/<frame>.jpg`` (or video files, with OpenCV).
* ``datamodule``: ``ClipFolderDataModule``, normalised on the device by ``normalize_clips``.
* ``demo``: ``make_demo_videos``, a small clip folder of moving shapes with a learnable motion signal.

Example::

    >>> from torch.utils.data import DataLoader
    >>> from cltrain.data.video import ClipFolderDataset, make_demo_videos, ndhwc_collate, train_clip_transform
    >>> root = make_demo_videos("/tmp/cltrain-video-demo")
    >>> loader = DataLoader(ClipFolderDataset(root / "train", train_clip_transform(8, 2, 56, hflip=0.0)),
    ...                     batch_size=4, num_workers=2, collate_fn=ndhwc_collate)
    >>> clips, targets = next(iter(loader))
    >>> clips.shape
    torch.Size([4, 3, 8, 56, 56])
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cltrain.data.video.collate import NDHWCCollate, ndhwc_collate
    from cltrain.data.video.datamodule import KINETICS_MEAN, KINETICS_STD, ClipFolderDataModule, normalize_clips
    from cltrain.data.video.dataset import VIDEO_EXTENSIONS, ClipFolderDataset, find_clips, read_video
    from cltrain.data.video.demo import make_demo_videos
    from cltrain.data.video.transforms import (TEMPORAL_MODES, ClipParams, ClipTransform, TemporalSample,
                                               eval_clip_transform, train_clip_transform)

#: name -> the module it comes from: imported on first use (PEP 562), so that ``make_demo_videos`` and the
#: transforms come without Lightning.
_MODULES = {
    "NDHWCCollate": "collate", "ndhwc_collate": "collate",
    "KINETICS_MEAN": "datamodule", "KINETICS_STD": "datamodule", "ClipFolderDataModule": "datamodule",
    "normalize_clips": "datamodule",
    "VIDEO_EXTENSIONS": "dataset", "ClipFolderDataset": "dataset", "find_clips": "dataset", "read_video": "dataset",
    "make_demo_videos": "demo",
    "TEMPORAL_MODES": "transforms", "ClipParams": "transforms", "ClipTransform": "transforms",
    "TemporalSample": "transforms", "eval_clip_transform": "transforms", "train_clip_transform": "transforms",
}

__all__ = [
    "KINETICS_MEAN",
    "KINETICS_STD",
    "TEMPORAL_MODES",
    "VIDEO_EXTENSIONS",
    "ClipFolderDataModule",
    "ClipFolderDataset",
    "ClipParams",
    "ClipTransform",
    "NDHWCCollate",
    "TemporalSample",
    "eval_clip_transform",
    "find_clips",
    "make_demo_videos",
    "ndhwc_collate",
    "normalize_clips",
    "read_video",
    "train_clip_transform",
]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES])
