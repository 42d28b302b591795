"""A LitData optimized dataset (``litdata.optimize``) through the NHWC path: each item's image file bytes, undecoded.

LitData stores a JPEG that ``optimize`` was handed as a PIL image opened from a file (``Image.open(path)``, its
README's ImageNet recipe) or as ``litdata.Image(path=...)`` as the file's own bytes; its reader would decode them
into a CHW tensor. ``LitDataImages`` reads the same chunks through LitData (``litdata.StreamingDataset``: its
downloader, chunk cache and ``max_cache_size``, local folders and ``s3://``, ``gs://``, ``azure://``; a bucket's split
larger than ``max_cache_size`` item by item, by ranged GETs, as LitData reads by index), with those
image serializers replaced by one that hands the bytes on, so the loader's decoder writes each image straight into
its NHWC batch slot. Items are read by their global index (``dataset[i]``), so the DataModule's own sampler orders
them: each sample once per epoch over the ranks, and an exact resume mid-epoch, also on another number of ranks
(LitData's own loader resumes only with the same workers, world size and seed).

Needs ``pip install 'cltrain[litdata]'``.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cltrain.data.bad_samples import NamedSplit
from cltrain.data.errors import DataError
from cltrain.data.image_samples import ImageSamples
from cltrain.data.remote import is_url, join, open_fs, redact, remote_error

__all__ = ["LitDataImages", "litdata_index"]

#: LitData serializers whose stored bytes are an image file (handed on undecoded).
_FILE_SERIALIZERS = ("jpeg", "image", "bytes")
#: LitData's reader is not thread-safe: decode threads calling it at once got another item's chunk state
#: (AssertionError, a struct.error of an empty buffer, runs that differ); one read at a time per process
_READING = threading.Lock()


def litdata_index(root: str) -> dict:
    """The ``index.json`` of the optimized dataset at ``root`` (a folder or a URL).

    Raises:
        DataError: no optimized dataset there, or one whose images are stored as decoded pixels.
    """
    url = join(str(root), "index.json")
    try:
        fs, path = open_fs(url, quick=True) if is_url(url) else (None, url)
        index = json.loads(fs.cat_file(path) if fs is not None else Path(path).read_bytes())
    except Exception as err:  # noqa: BLE001 - one line, whatever the store says
        if isinstance(err, FileNotFoundError):
            raise DataError(f"{redact(url)}: not found: {redact(str(root))} is not a LitData optimized dataset (made "
                            "by litdata.optimize, with an index.json); check the URL and the split folder.") from None
        raise remote_error(err, url, "LitData's index") from None
    if not index.get("chunks") or not isinstance(index.get("config"), dict):  # what a failed optimize() leaves
        raise DataError(f"{redact(url)}: an empty LitData dataset (no chunks: litdata.optimize wrote nothing there, "
                        "or failed); run litdata.optimize again and check its output.")
    formats = index["config"].get("data_format", [])
    if "pil" in formats and not any(f.split(":")[0] in _FILE_SERIALIZERS for f in formats):
        raise DataError(f"{redact(str(root))}: LitData stored its images as decoded pixels ('pil'), not as image files; "
                        "optimize the files' bytes instead (Image.open(path) of a JPEG, or litdata.Image(path=...)).")
    return index


def _bytes(size: str | int) -> int:
    """``max_cache_size`` in bytes, as LitData reads it (``"50GB"``)."""
    from litdata.utilities.format import _convert_bytes_to_int

    return size if isinstance(size, int) else _convert_bytes_to_int(size)


def _version() -> str:
    from importlib.metadata import version

    return version("litdata")


def _raw_serializer() -> Any:
    from litdata.streaming.serializers import Serializer

    class Undecoded(Serializer):
        """An image file's stored bytes, handed on as they are (LitData would decode them to a tensor)."""

        def serialize(self, item: Any) -> tuple[bytes, str | None]:  # pragma: no cover - reading only
            raise TypeError("cltrain reads LitData datasets; it does not write them")

        def deserialize(self, data: bytes) -> bytes:
            return bytes(data)

        def can_serialize(self, item: Any) -> bool:
            return False

    return Undecoded()


def _plain_http_endpoint() -> None:
    """LitData 0.2.76 reads S3 through obstore when it can, with a client built without ``allow_http``: a plain-http
    endpoint (a local MinIO: ``AWS_ENDPOINT_URL=http://...``) is refused. Its boto3 path reads one; use it there."""
    if os.environ.get("AWS_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL_S3", "")).startswith("http://"):
        from litdata.streaming import downloader

        downloader._OBSTORE_AVAILABLE = False


class LitDataImages(NamedSplit, ImageSamples):
    """One split of a LitData optimized dataset as ``(transform(image), label)`` samples (see the module docstring).

    Args:
        root: the optimized dataset (a folder or a URL, holding ``index.json``).
        transform: bytes -> HWC uint8 (``cltrain.data.train_transform`` / ``eval_transform``).
        image_key: the item's image field (a dict key, or a position in a tuple); ``None``: the first bytes field.
        label_key: the item's label field; ``None``: the first int field.
        split: the split's name (in the skipped-files list).
        cache_dir: LitData's chunk cache (``None``: LitData's default).
        max_cache_size: its limit (``"50GB"``).
        bad_files: ``"raise"`` or ``"skip"`` (``cltrain.data.bad_samples``); an item is named by its index.
        skip_log: file the skipped samples are appended to (``"skip"`` only).
        threads: decode threads per loading process (``cltrain.data.loader_threads``).

    Raises:
        DataError: ``litdata`` missing, no optimized dataset at ``root``, or no image or label in its items.
    """

    def __init__(self, root: str, transform: Callable[..., Any], image_key: str | int | None = None,
                 label_key: str | int | None = None, split: str = "train", cache_dir: str | None = None,
                 max_cache_size: str | int = "50GB", bad_files: str = "raise",
                 skip_log: str | os.PathLike | None = None, threads: int = 1) -> None:
        try:
            import litdata  # noqa: F401
        except ImportError:
            raise DataError("LitData datasets need the litdata package: pip install 'cltrain[litdata]'.") from None
        self._set_policy(bad_files, skip_log)
        self.root, self.split, self.transform, self.threads = str(root), split, transform, max(1, threads)
        self.where, self.what = redact(self.root), "item"
        self.cache_dir, self.max_cache_size = cache_dir, max_cache_size
        index = litdata_index(self.root)
        self.count = sum(int(c["chunk_size"]) for c in index["chunks"])
        self.size = sum(int(c.get("chunk_bytes", 0)) for c in index["chunks"])
        self.whole_chunks = not is_url(self.root) or self.size <= _bytes(max_cache_size)
        self._ds: Any = None
        self._pid = -1
        self.image_key, self.label_key = self._keys(self._item(0), image_key, label_key) if self.count else (0, 1)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_ds": None, "_pid": -1}  # LitData's reader is opened again in each process

    def __len__(self) -> int:
        return self.count

    def _dataset(self) -> Any:
        if self._ds is None or self._pid != os.getpid():
            from litdata import StreamingDataset

            _plain_http_endpoint()
            raw = _raw_serializer()
            self._ds = StreamingDataset(self.root, cache_dir=self.cache_dir, max_cache_size=self.max_cache_size,
                                        serializers={name: raw for name in ("jpeg", "image")})
            # LitData reads an item got by index with a ranged GET of its bytes, every epoch, caching nothing (its
            # iterator alone turns that off, and there is no argument): where the split fits the chunk cache, its
            # downloader fetches whole chunks once, as with its own loader
            self._ds._on_demand_bytes = not self.whole_chunks
            self._pid = os.getpid()
        return self._ds

    def _item(self, index: int) -> Any:
        try:
            with _READING:
                return self._dataset()[int(index)]
        except (DataError, IndexError):
            raise
        except Exception as err:  # noqa: BLE001 - a chunk that cannot be fetched: one line naming the dataset
            if isinstance(err, struct.error) and not self.whole_chunks:
                raise DataError(f"{self.where} (LitData item {index}): LitData {_version()} fails to read an item by "
                                f"byte range ({err}), which it does where the split ({self.size:,} bytes) is larger "
                                f"than max_cache_size={self.max_cache_size!r}; pass a max_cache_size that holds it, so "
                                "whole chunks are cached.") from None
            if is_url(self.root) and not isinstance(err, (ValueError, TypeError, KeyError)):
                raise remote_error(err, self.root, f"LitData item {index}") from None
            raise

    def _keys(self, item: Any, image: str | int | None, label: str | int | None) -> tuple[str | int, str | int]:
        fields: Sequence[tuple[Any, Any]] = list(item.items()) if isinstance(item, Mapping) else list(enumerate(item))
        kinds = {k: type(v).__name__ for k, v in fields}
        found_image = image if image is not None else next((k for k, v in fields if isinstance(v, bytes)), None)
        found_label = label if label is not None else next((k for k, v in fields if isinstance(v, int)
                                                            and not isinstance(v, bool)), None)
        if found_image not in kinds or found_label not in kinds:
            raise DataError(f"{redact(self.root)}: its items ({kinds}) have no {'image file' if found_image not in kinds else 'int label'} "
                            "field; pass image_key=<the field of the image> and label_key=<the field of the class index>.")
        return found_image, found_label

    def source(self, index: int) -> tuple[bytes, int]:
        """The image file bytes of item ``index`` and its label."""
        item = self._item(index)
        return bytes(item[self.image_key]), int(item[self.label_key])
