"""Checkpoints that are never half-written and never run code when loaded.

``AtomicCheckpointIO`` is Lightning's ``TorchCheckpointIO`` with two changes for local
paths:

* **Saving** goes through ``cltrain.atomic.atomic_torch_save`` (a temporary file in the
  checkpoint's own directory, ``fsync``, ``os.replace``); a save that fails for lack of space
  raises ``DiskFullError`` and leaves the previous file as it was.
* **Loading** uses ``torch.load(weights_only=True)`` unless the caller passes
  ``weights_only=False``: a checkpoint holding a type outside torch's allow-list is refused with
  ``UnsafeCheckpointError`` before anything in it runs; a file that cannot be read raises
  ``UnreadableCheckpointError``, naming the Lightning checkpoints of its directory that do load.

Why, and what a full disk or a kill does: docs/resuming.md.

Remote paths (``s3://``, ``gs://``, any fsspec URL other than ``file://``) keep Lightning's
behaviour for saving and removing (its fsspec transaction); loading them is still
``weights_only=True`` by default.

Example::

    >>> from lightning.pytorch import Trainer
    >>> trainer = Trainer(plugins=[AtomicCheckpointIO()])   # doctest: +SKIP
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from typing_extensions import override

from cltrain.atomic import TEMP_PREFIX, atomic_torch_save, remove_leftovers, removed_line

__all__ = ["AtomicCheckpointIO", "CheckpointLoadError", "UnreadableCheckpointError", "UnsafeCheckpointError",
           "load_checkpoint_file", "loadable_checkpoints"]

#: Suffixes of the files ``loadable_checkpoints`` looks at.
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be loaded; the message is one line naming the file."""

    def __init__(self, path: str | os.PathLike, message: str) -> None:
        self.path = Path(path)
        super().__init__(message)


class UnsafeCheckpointError(CheckpointLoadError):
    """The checkpoint holds types that ``weights_only=True`` refuses (loading them could run code).

    Attributes:
        types: the refused types, as ``module.name``.
    """

    def __init__(self, path: str | os.PathLike, types: list[str]) -> None:
        self.types = types
        super().__init__(path, f"{path}: refused to load: it holds {', '.join(types) or 'a type'} outside the types a "
                               "checkpoint may hold (torch.load weights_only=True); unpickling it could run code. Use "
                               "a checkpoint written by Lightning, or allow the types with "
                               "torch.serialization.add_safe_globals if you trust the file")


class UnreadableCheckpointError(CheckpointLoadError):
    """The file is not a complete checkpoint (truncated, empty, another kind of file).

    Attributes:
        reason: why it does not load (``"the file is empty"``, ``"incomplete: ..."``, ...).
        loadable: the other Lightning checkpoints in its directory that load, newest first.
        others: the sentence naming them.
    """

    def __init__(self, path: str | os.PathLike, reason: str, loadable: list[Path]) -> None:
        self.reason, self.loadable = reason, loadable
        where = Path(path).parent
        self.others = (f"checkpoints in {where} that load: {', '.join(p.name for p in loadable)}" if loadable
                       else f"no other checkpoint in {where} loads")
        super().__init__(path, f"{path}: not a readable checkpoint ({reason}); {self.others}")


def _is_local(path: str | os.PathLike) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


def _local(path: str | os.PathLike) -> Path:
    text = str(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


def _why_unreadable(path: Path, err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    text = lines[-1] if lines else ""  # torch's weights_only message puts the cause last
    if path.stat().st_size == 0:
        return "the file is empty"
    if isinstance(err, EOFError) or any(k in text for k in ("central directory", "EOF", "truncated", "Ran out of input")):
        return "incomplete: the file ends before the checkpoint does"
    if isinstance(err, KeyError) or any(k in str(err) for k in ("invalid load key", "Unsupported operand")):
        # (weights_only puts the cause before its advice)
        return "not a file written by torch.save"
    return f"{type(err).__name__}: {text[:200]}"


def _refused_types(path: Path, err: BaseException) -> list[str] | None:
    """The types ``weights_only`` refused in ``path``, or None when the file is not a readable checkpoint."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # noqa: BLE001 - not a zip checkpoint: a legacy pickle, or broken
        found = re.findall(r"GLOBAL ([\w.]+)", str(err))
        return sorted(set(found)) if found else None


def _try_load(path: Path) -> bool:
    """Whether ``path`` loads as a Lightning checkpoint (a dict holding ``state_dict``; a model's weights saved
    with ``torch.save`` load too, but do not resume a run)."""
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mmap: tensors not read
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            loaded = torch.load(path, map_location="cpu", weights_only=True)  # a file in torch's legacy format
        return isinstance(loaded, dict) and "state_dict" in loaded
    except Exception:  # noqa: BLE001 - any failure means "does not load"
        return False


def loadable_checkpoints(directory: str | os.PathLike, exclude: str | os.PathLike | None = None) -> list[Path]:
    """The Lightning checkpoint files (``*.ckpt``, ``*.pt``, ``*.pth``) in ``directory`` that load with
    ``weights_only=True``, newest first; ``exclude`` is left out."""
    try:
        files = [p for p in Path(directory).iterdir() if p.suffix in CHECKPOINT_SUFFIXES and p.is_file()
                 and not p.name.startswith(TEMP_PREFIX)]
    except OSError:
        return []
    skip = Path(exclude).absolute() if exclude is not None else None
    files = [p for p in files if p.absolute() != skip]
    files.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return [p for p in files if _try_load(p)]


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu", *, weights_only: bool = True,
                         mmap: bool = False) -> Any:
    """``torch.load`` with one-line errors that name the file.

    Args:
        path: a local checkpoint file.
        map_location: as ``torch.load``.
        weights_only: ``True`` (default) refuses every type outside torch's allow-list.
        mmap: map the tensors from the file instead of reading them (cheap for a quick look).

    Raises:
        FileNotFoundError: no such file.
        UnsafeCheckpointError: the file holds a type ``weights_only`` refuses; nothing in it ran.
        UnreadableCheckpointError: the file is truncated or not a checkpoint.

    Example::

        >>> state = load_checkpoint_file("outputs/run/checkpoints/last.ckpt", mmap=True)   # doctest: +SKIP
        >>> state["global_step"]                                                        # doctest: +SKIP
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    try:
        try:
            return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)
        except RuntimeError as err:  # not a zip file: a legacy torch.save loads without mmap, anything else says why
            if not (mmap and "mmap can only be used with files saved with" in str(err)):
                raise
            return torch.load(path, map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        types = _refused_types(path, err) if weights_only else None
        if types:
            raise UnsafeCheckpointError(path, types) from None
        reason = _why_unreadable(path, err)
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError, EOFError, ValueError... for a bad file
        reason = _why_unreadable(path, err)
    raise UnreadableCheckpointError(path, reason, loadable_checkpoints(path.parent, exclude=path))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO``: atomic saves on any local filesystem, ``weights_only`` loads
    (see the module docstring). Remote fsspec paths (``s3://`` ...) are saved and removed as
    Lightning's ``TorchCheckpointIO`` does.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(plugins=[AtomicCheckpointIO()])   # doctest: +SKIP
    """

    def __init__(self) -> None:
        super().__init__()
        self._cleaned: set[Path] = set()

    def _remove_leftovers(self, directory: Path) -> None:
        directory = directory.absolute()
        if directory in self._cleaned:
            return
        self._cleaned.add(directory)
        removed = remove_leftovers(directory)
        if removed:
            rank_zero_info(f"AtomicCheckpointIO: {removed_line(removed, 'a run that was stopped while saving')}")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` to ``path`` atomically (local paths; remote ones as Lightning does).

        Raises:
            TypeError: ``storage_options`` was given (as ``TorchCheckpointIO``).
            DiskFullError: no space for the file; the previous file at ``path`` is unchanged.
        """
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        path = _local(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers(path.parent)
        atomic_torch_save(checkpoint, path)

    @override
    def load_checkpoint(self, path: Any, map_location: Callable | Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint at ``path`` (``weights_only=True`` unless ``False`` is passed).

        Raises:
            FileNotFoundError: no such file.
            UnsafeCheckpointError: the file holds a type ``weights_only`` refuses; nothing in it ran.
            UnreadableCheckpointError: the file is truncated or not a checkpoint.
        """
        weights_only = True if weights_only is None else weights_only
        if not _is_local(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        path = _local(path)
        if rank_zero_only.rank == 0 and path.is_file():
            self._remove_leftovers(path.parent)  # a resumed run's source: where a killed run left them
        return load_checkpoint_file(path, map_location=map_location, weights_only=weights_only)
