"""An ImageNet-layout folder (``split/<class>/<image>``) as a Dataset, with a bad-file policy.

A transform that takes paths (``takes_paths``, as cltrain's do) is handed each
sample's path, so it reads the bytes and decodes JPEGs with libjpeg-turbo; any
other transform gets the image opened lazily with Pillow, undecoded, so it can
still ask for reduced-size JPEG decoding. A file that cannot be read
(zero bytes, not an image, truncated, an unsupported mode, a dangling link) either raises
``BadImageError`` naming the file and the reason (``bad_files="raise"``),
or is replaced by the next readable sample and reported (``bad_files="skip"``;
``cltrain.data.bad_samples``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from cltrain.data.bad_samples import BAD_FILE_POLICIES, SkipsBadSamples, check_bad_files, printable
from cltrain.data.errors import BadImageError, DataError, MissingDataError
from cltrain.data.image_samples import ImageSamples
from cltrain.data.index import SplitIndex, find_classes, index_split, scan_split

__all__ = ["BAD_FILE_POLICIES", "BadImageError", "ImageFolderDataset", "SkipsBadSamples", "check_bad_files", "find_classes",
           "find_samples", "leave_out", "read_file_list"]


def find_samples(split_dir: str | os.PathLike, classes: Sequence[str], require_all: bool = True) -> list[tuple[str, int]]:
    """``(path, class index)`` of every image file under ``split_dir/<class>`` (each real file once; no cache).

    Raises:
        ValueError: see ``cltrain.data.index.scan_split`` (``require_all=False`` allows missing classes).
    """
    return scan_split(split_dir, classes, allow_missing=not require_all).samples


class FileList(frozenset):
    """The paths of ``read_file_list``; ``listed``: how many files the list names (each once)."""

    listed: int = 0


def read_file_list(path: str | os.PathLike) -> FileList:
    """The files listed in ``path``, each as its real path and as listed (absolute: a symbolic link whose target is
    gone resolves to that target, and is matched by its own path): a bad-files list from
    ``python -m cltrain.data.check`` or a ``skipped_files.tsv`` (``split<TAB>path<TAB>reason`` lines), or one path
    per line. Its ``listed`` counts the files, not the paths (two for a link).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(f"exclude_files={str(path)!r} is not a file; give the list written by "
                                "'python -m cltrain.data.check ROOT' or a skipped_files.tsv.")
    listed = set()
    for line in path.read_text(encoding="utf-8", errors="surrogateescape").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        listed.add(os.path.abspath(line.split("\t")[1] if "\t" in line else line))
    out = FileList(listed | {os.path.realpath(p) for p in listed})
    out.listed = len(listed)
    return out


def leave_out(samples: list, exclude: frozenset[str], files: Callable[[Any], Sequence[str]], split_dir: Path,
              what: str) -> tuple[list, int]:
    """``samples`` without those of which one of ``files(sample)`` is in ``exclude`` (``read_file_list``), and how
    many were left out.

    Raises:
        DataError: every sample is left out (naming ``split_dir`` and ``what`` they are).
    """
    if not exclude:
        return samples, 0
    names = {os.path.basename(p) for p in exclude}  # realpath only for the few candidates

    def listed(path: str) -> bool:
        return os.path.basename(path) in names and not exclude.isdisjoint((os.path.realpath(path),
                                                                           os.path.abspath(path)))

    kept = [s for s in samples if not any(listed(f) for f in files(s))]
    if not kept:
        raise DataError(f"{split_dir}: all {len(samples)} {what} are in the exclude list.")
    return kept, len(samples) - len(kept)


class ImageFolderDataset(ImageSamples):
    """``(transform(image), class index)`` for each image under ``split_dir/<class>/``.

    Args:
        split_dir: e.g. ``root/train``.
        transform: PIL image -> HWC uint8 (see ``cltrain.data.train_transform``), or
            path -> HWC uint8 if it has ``takes_paths = True``.
        classes: class folder names, in label order; ``None`` takes those of ``split_dir``.
        bad_files: ``"raise"`` or ``"skip"`` (see the module docstring).
        skip_log: file the skipped paths are appended to (``"skip"`` only); ``None``: none.
        allow_missing_classes: accept classes of ``classes`` without a folder here
            (otherwise a ``ValueError`` names them).
        exclude: the paths of files to leave out from the start, real or as listed (``read_file_list``).
        index_cache: reuse the file index of an unchanged tree (``cltrain.data.index``): ``True``
            keeps it in the user cache folder, a path keeps it there, ``False`` walks every time.
        threads: decode the samples of a batch on this many threads of the loading process
            (``cltrain.data.loader_threads``; the DataLoader asks for whole batches through
            ``__getitems__``); 1 loads them one by one in the calling thread. Each sample draws
            its crop from a seed of its own, drawn from the torch RNG, so a seeded run gives the
            same samples whatever the number of threads.

    Attributes:
        index: what the walk found (``SplitIndex``: ignored
            suffixes, duplicate links).
        excluded: how many listed files were left out.
    """

    def __init__(self, split_dir: str | os.PathLike, transform: Callable[[Image.Image], np.ndarray],
                 classes: Sequence[str] | None = None, bad_files: str = "raise", skip_log: str | os.PathLike | None = None,
                 allow_missing_classes: bool = False, exclude: set[str] | frozenset[str] = frozenset(),
                 index_cache: bool | str | os.PathLike = True, threads: int = 1) -> None:
        if not (isinstance(threads, int) and threads >= 1):
            raise ValueError(f"ImageFolderDataset: threads={threads!r} must be an int >= 1.")
        self.threads = threads
        self._set_policy(bad_files, skip_log)
        self.split_dir = Path(split_dir)
        cache_dir = None if isinstance(index_cache, bool) else index_cache
        self.index: SplitIndex = index_split(self.split_dir, classes, allow_missing_classes, cache=index_cache is not False,
                                             cache_dir=cache_dir)
        self.classes = list(self.index.classes)
        self.samples = self.index.samples
        self.samples, self.excluded = leave_out(self.samples, exclude, lambda s: (s[0],), self.split_dir, "images")
        summary = self.index.summary(self.split_dir)
        if summary:
            warnings.warn(summary, stacklevel=2)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def source(self, index: int) -> tuple[str, int]:
        """The path and class index of sample ``index``."""
        return self.samples[index]

    def unreadable_message(self, index: int, reason: str) -> str:
        """The one line of ``BadImageError`` for sample ``index``: the file, why, what to do."""
        return (f"{printable(self.samples[index][0])}: cannot be read as an image ({reason}). Replace or remove the "
                f"file, or pass bad_files='skip' to skip such files ('cltrain-data-check {self.split_dir.parent}' "
                "lists them all, for exclude_files=<that list>).")
