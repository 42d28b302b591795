"""A clip-folder dataset: ``split/<class>/<clip>/<frame>.jpg``, one folder of frames per clip, or video files.

Many video datasets ship (or are extracted to) one folder of JPEG frames per
clip; frames are taken in natural name order (``2.jpg`` before ``10.jpg``).
A video file (``.mp4``, ``.avi``, ``.mkv``, ``.webm``, ``.mov``) in a class
folder is a clip too, decoded with OpenCV (``pip install cltrain[video]``).

A video file is decoded whole (fine for the few-second clips of action datasets); folders of
frames decode only the sampled frames. Why OpenCV: docs/guides/video.md.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from cltrain.data.constants import IMG_EXTENSIONS, is_hidden
from cltrain.data.bad_samples import SkipsBadSamples, unreadable
from cltrain.data.errors import BadImageError, DataError
from cltrain.data.image_folder_dataset import find_classes, leave_out
from cltrain.data.index import not_loaded
from cltrain.data.video.transforms import FrameError

__all__ = ["VIDEO_EXTENSIONS", "ClipFolderDataset", "find_clips", "read_video"]

VIDEO_EXTENSIONS: tuple[str, ...] = (".mp4", ".avi", ".mkv", ".webm", ".mov")


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _cv2():
    try:
        import cv2
    except ImportError:
        return None
    return cv2


def read_video(path: str | os.PathLike) -> list[np.ndarray]:
    """Every frame of a video file as an RGB HWC uint8 array (OpenCV's FFmpeg backend).

    Raises:
        ImportError: OpenCV is not installed (the message says which package to install).
        ValueError: the file cannot be opened or holds no frames.
    """
    cv2 = _cv2()
    if cv2 is None:
        raise ImportError(f"reading video files such as {path} needs OpenCV: pip install 'cltrain[video]' "
                          "(opencv-python-headless), or extract the frames to a folder of JPEGs per clip.")
    cap = cv2.VideoCapture(str(path))
    frames = []
    try:
        if not cap.isOpened():
            raise ValueError(f"{path}: OpenCV cannot open it as a video.")
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    finally:
        cap.release()
    if not frames:
        raise ValueError(f"{path}: no frame could be decoded.")
    return frames


def find_clips(split_dir: str | os.PathLike, classes: Sequence[str]) -> list[tuple[str, tuple[str, ...] | None, int]]:
    """``(clip path, frame file names or None for a video file, class index)`` of every clip under ``split_dir/<class>``;
    the other files of the class folders are counted by suffix in one warning (as an image folder's are).

    Raises:
        DataError: a class folder with no clips, a clip folder with no frames, a class
            folder not in ``classes`` or a class of ``classes`` with no folder.
        ValueError: a video file when OpenCV is not installed.
    """
    split_dir = Path(split_dir)
    present = set(find_classes(split_dir))
    if present != set(classes):
        raise DataError(f"{split_dir} has class folders {sorted(present)} but the training split has {sorted(classes)}; "
                         "both splits need the same classes.")
    samples: list[tuple[str, tuple[str, ...] | None, int]] = []
    ignored: dict[str, int] = {}
    for index, name in enumerate(classes):
        class_dir = split_dir / name
        found = 0
        for entry in sorted(os.scandir(class_dir), key=lambda e: _natural(e.name)):
            if is_hidden(entry.name):
                continue
            if entry.is_dir():
                frames = tuple(sorted((f for f in os.listdir(entry.path) if not is_hidden(f)
                                       and f.lower().endswith(IMG_EXTENSIONS)), key=_natural))
                if not frames:
                    raise DataError(f"clip folder {entry.path} has no frames (suffixes {', '.join(IMG_EXTENSIONS)}); "
                                     "add its frames or remove the folder.")
                samples.append((entry.path, frames, index))
            elif entry.name.lower().endswith(VIDEO_EXTENSIONS):
                if _cv2() is None:
                    raise ValueError(f"{entry.path} is a video file and OpenCV is not installed: "
                                     "pip install 'cltrain[video]', or extract its frames to a folder.")
                samples.append((entry.path, None, index))
            else:
                if entry.is_file():  # a dangling link is neither file nor folder: not counted (as in an image folder)
                    suffix = os.path.splitext(entry.name)[1].lower()
                    ignored[suffix] = ignored.get(suffix, 0) + 1
                continue
            found += 1
        if not found:
            raise DataError(f"class folder {class_dir} has no clips (a folder of frames per clip, or video files "
                             f"{', '.join(VIDEO_EXTENSIONS)}); add clips or remove the folder.")
    if ignored:
        warnings.warn(f"{split_dir}: {not_loaded(ignored, ('folders of frames', *VIDEO_EXTENSIONS))}.", stacklevel=2)
    return samples


def _clip_files(sample: tuple[str, tuple[str, ...] | None, int]) -> list[str]:
    """A clip's folder or video file, and its frames."""
    return [sample[0], *(os.path.join(sample[0], f) for f in sample[1] or ())]


class ClipFolderDataset(SkipsBadSamples, Dataset):
    """``(transform(frames), class index)`` for each clip under ``split_dir/<class>/``.

    Args:
        split_dir: e.g. ``root/train``.
        transform: a ``ClipTransform`` (frames -> (T, H, W, C) uint8).
        classes: class folder names in label order; ``None`` takes those of ``split_dir``.
        bad_files: ``"raise"``: an unreadable clip raises ``BadImageError``
            naming it; ``"skip"``: the next readable clip is returned instead and the clip is
            reported (a line in ``skip_log``, a warning once per clip and process).
        skip_log: file the skipped clips are appended to (``"skip"`` only); ``None``: none.
        exclude: the paths of files to leave out from the start, real or as listed
            (``cltrain.data.image_folder_dataset.read_file_list``): a clip whose folder, video file or any
            frame is listed is left out (``excluded`` counts them).

    Raises:
        ValueError, FileNotFoundError: see ``find_clips`` (at construction, before any step); every clip
            excluded.
    """

    what = "clip"

    def __init__(self, split_dir: str | os.PathLike, transform: Callable[[Sequence], np.ndarray],
                 classes: Sequence[str] | None = None, bad_files: str = "raise",
                 skip_log: str | os.PathLike | None = None, exclude: frozenset[str] = frozenset()) -> None:
        self._set_policy(bad_files, skip_log)
        self.split_dir = Path(split_dir)
        self.classes = list(classes) if classes is not None else find_classes(self.split_dir)
        self.samples = find_clips(self.split_dir, self.classes)
        self.samples, self.excluded = leave_out(self.samples, exclude, _clip_files, self.split_dir, "clips")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[np.ndarray, int]:
        """The clip at ``index``; raises ``BadImageError`` for one that cannot be read."""
        path, names, target = self.samples[index]
        try:
            frames = read_video(path) if names is None else [os.path.join(path, n) for n in names]
            return self.transform(frames), target
        except ImportError:
            raise
        except Exception as err:  # any failure of reading or decoding this one clip
            if isinstance(err, FrameError) and isinstance(err.frame, (str, os.PathLike)):  # a frame file: as an image's
                reason = f"{os.path.basename(err.frame)}: {unreadable(err.__cause__ or err, err.frame)}"
            else:
                reason = unreadable(err, path)
            raise BadImageError(f"{path}: cannot be read as a clip ({reason}). "
                                "Replace or remove it, or pass bad_files='skip' to skip such clips.", reason) from err
