"""An ImageNet-layout folder (``split/<class>/<image>``) as a Dataset, with a bad-file policy.

A transform that takes paths (``takes_paths``, as cltrain's do) is handed each
sample's path, so it reads the bytes and decodes JPEGs with libjpeg-turbo; any
other transform gets the image opened lazily with Pillow, undecoded, so it can
still ask for reduced-size JPEG decoding. A file that cannot be read
(zero bytes, not an image, truncated, an unsupported mode) either raises
:class:`BadImageError` naming the file and the reason (``bad_files="raise"``),
or is replaced by the next readable sample and reported (``bad_files="skip"``):
one ``split<TAB>path<TAB>reason`` line appended to ``skip_log`` (from whichever
worker process met it) and a warning once per file and process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from cltrain.data.constants import IMG_EXTENSIONS

__all__ = ["BAD_FILE_POLICIES", "BadImageError", "ImageFolderDataset", "find_classes", "find_samples"]

log = logging.getLogger(__name__)

BAD_FILE_POLICIES: tuple[str, ...] = ("raise", "skip")
_MAX_SKIPS_IN_A_ROW = 50


class BadImageError(RuntimeError):
    """A file of the image folder cannot be read as an image."""


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMG_EXTENSIONS)


def find_classes(split_dir: str | os.PathLike) -> list[str]:
    """Sorted names of the class folders of ``split_dir``.

    Raises:
        FileNotFoundError: ``split_dir`` is missing.
        ValueError: it holds no class folders.
    """
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise FileNotFoundError(f"{split_dir} is not a folder. Expected the ImageNet layout: "
                                f"{split_dir.parent}/train/<class>/<image> and {split_dir.parent}/val/<class>/<image>.")
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"{split_dir} holds no class folders; put each class's images in {split_dir}/<class>/.")
    return classes


def find_samples(split_dir: str | os.PathLike, classes: Sequence[str], require_all: bool = True) -> list[tuple[str, int]]:
    """``(path, class index)`` of every image file (by suffix, any depth) under ``split_dir/<class>``.

    Raises:
        ValueError: a class folder with no images, a class folder not in ``classes``,
            or (``require_all``) a class of ``classes`` with no folder.
    """
    split_dir = Path(split_dir)
    present = set(find_classes(split_dir))
    unknown = sorted(present - set(classes))
    if unknown:
        raise ValueError(f"{split_dir} has class folders {unknown} that the training split does not have.")
    missing = [c for c in classes if c not in present]
    if require_all and missing:
        raise ValueError(f"{split_dir} lacks the class folders {missing}.")
    samples: list[tuple[str, int]] = []
    for index, name in enumerate(classes):
        if name not in present:
            continue
        found = [os.path.join(d, f) for d, _, files in sorted(os.walk(split_dir / name, followlinks=True))
                 for f in sorted(files) if _is_image(f)]
        if not found:
            raise ValueError(f"class folder {split_dir / name} has no images (suffixes {', '.join(IMG_EXTENSIONS)}); "
                             "add images or remove the folder.")
        samples += [(p, index) for p in found]
    return samples


class ImageFolderDataset(Dataset):
    """``(transform(image), class index)`` for each image under ``split_dir/<class>/``.

    Args:
        split_dir: e.g. ``root/train``.
        transform: PIL image -> HWC uint8 (see :func:`cltrain.data.train_transform`), or
            path -> HWC uint8 if it has ``takes_paths = True``.
        classes: class folder names, in label order; ``None`` takes those of ``split_dir``.
        bad_files: ``"raise"`` or ``"skip"`` (see the module docstring).
        skip_log: file the skipped paths are appended to (``"skip"`` only); ``None``: none.
    """

    def __init__(self, split_dir: str | os.PathLike, transform: Callable[[Image.Image], np.ndarray],
                 classes: Sequence[str] | None = None, bad_files: str = "raise", skip_log: str | os.PathLike | None = None) -> None:
        if bad_files not in BAD_FILE_POLICIES:
            raise ValueError(f"bad_files={bad_files!r} must be one of {BAD_FILE_POLICIES}.")
        self.split_dir = Path(split_dir)
        self.classes = list(classes) if classes is not None else find_classes(self.split_dir)
        self.samples = find_samples(self.split_dir, self.classes, require_all=classes is None)
        self.transform = transform
        self.bad_files = bad_files
        self.skip_log = None if skip_log is None else str(skip_log)
        self._warned: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[np.ndarray, int]:
        """The sample at ``index``; raises :class:`BadImageError` for an unreadable file."""
        path, target = self.samples[index]
        try:
            if getattr(self.transform, "takes_paths", False):
                return self.transform(path), target
            with Image.open(path) as img:
                return self.transform(img), target
        except Exception as err:  # any failure of decoding or converting this one file
            raise BadImageError(f"{path}: cannot be read as an image ({type(err).__name__}: {err}). "
                                "Replace or remove the file, or pass bad_files='skip' to skip such files.") from err

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        if self.bad_files == "raise":
            return self.load(index)
        for attempt in range(min(_MAX_SKIPS_IN_A_ROW, len(self.samples))):
            i = (index + attempt) % len(self.samples)
            try:
                return self.load(i)
            except BadImageError as err:
                self._report(self.samples[i][0], err)
        raise BadImageError(f"{self.split_dir}: {_MAX_SKIPS_IN_A_ROW} unreadable files in a row from index {index}; "
                            "the folder is not usable as it is (see the skipped-files log).")

    def _report(self, path: str, err: BadImageError) -> None:
        cause = err.__cause__
        reason = f"{type(cause).__name__}: {cause}".replace("\t", " ").replace("\n", " ")
        if self.skip_log is not None:
            with open(self.skip_log, "a", encoding="utf-8") as f:  # one short line per write: atomic with O_APPEND
                f.write(f"{self.split_dir.name}\t{path}\t{reason}\n")
        if path not in self._warned:
            self._warned.add(path)
            log.warning("skipping unreadable image %s (%s)", path, reason)
