"""``DataError``: a problem with the user's data (a file, a folder, a row), said in one line with its fix.

Every error the data path raises about the data itself is a ``DataError``: a layout problem, an
empty class folder, a split with fewer images than a batch, and ``BadImageError`` for a sample that
cannot be read as an image. Its message is one line: the file or folder, what is wrong, what to do.

Raised in a DataLoader worker process, it reaches the main process as the same type with
PyTorch's account of the worker's traceback around the message; ``error_line`` gives back the one
line either way, which is what the training application prints (exit status 2, no traceback).

Example::

    >>> error_line(DataError("/data/train/cat: no images (only .DS_Store); add images or remove the folder."))
    '/data/train/cat: no images (only .DS_Store); add images or remove the folder.'
"""

from __future__ import annotations

__all__ = ["BadImageError", "DataError", "EmptyImageError", "LabelFault", "MissingDataError", "SampleFault",
           "StorageError", "error_line"]


class DataError(ValueError):
    """A problem with the data: the message names the file or folder and the fix, in one line."""


class MissingDataError(DataError, FileNotFoundError):
    """A folder or file the data needs is not there (a root, a split, a pack's manifest, a list of files); a
    ``FileNotFoundError`` too."""


class BadImageError(DataError, RuntimeError):
    """A sample (a file, a stored sample, a row) cannot be read as an image; ``reason`` says why in a few words."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class SampleFault(ValueError):
    """What is wrong with one sample, in words that read the same in every source (its reason, without a type's
    name)."""


class LabelFault(SampleFault):
    """A sample whose label is no class of the data (its image is not at fault)."""


class EmptyImageError(SampleFault):
    """An image of 0 bytes (a file, a stored sample, a row)."""

    def __init__(self) -> None:
        super().__init__("empty file (0 bytes)")


class StorageError(DataError):
    """The storage failed (a bucket that cannot be reached or read, a full cache disk), not a sample: never a bad
    sample to skip, whatever ``bad_files`` says."""


def error_line(err: BaseException) -> str:
    """The one line of ``err``'s message: for an error re-raised from a DataLoader worker (PyTorch's
    ``Caught <Type> in DataLoader worker process N.`` and the worker's traceback), the original
    error's own message."""
    text = str(err).strip()
    if text.startswith("Caught ") and "\nOriginal Traceback" in text:
        last = text.splitlines()[-1]  # "<module>.<Type>: <message>", the worker's exception itself
        kind, sep, message = last.partition(": ")
        if sep and " " not in kind:
            return message
    return text.splitlines()[0] if text else type(err).__name__
