"""Where a pack's bytes come from: a local folder, or a bucket through the node's shard cache.

``open_pack(root)`` gives a ``LocalPack`` for a folder and a ``RemotePack`` for a URL (``s3://bucket/pack``,
``cltrain.data.remote``). Both give the manifest, each shard's index and ``pread(shard, offset, size)``, the bytes
of one sample; ``ShardsDataset`` reads through them and is otherwise the same for both. A ``RemotePack`` reads:

* ``fetch="shards"`` (default): whole shards, into the node-local ``ShardCache`` (once per node, bounded, shared by
  ranks and workers), then by offset from the local file as from a local pack. The sampler hands each epoch's
  batches to ``plan`` before it serves them, and a few threads of the main process fetch the shards in the order
  the batches will first need them, ``ahead`` shards in front of the batches served; a worker that needs a shard
  not yet there fetches it itself (the cache's lock makes it one download).
* ``fetch="ranges"``: each sample's bytes with a ranged GET, nothing cached (a pack too large for the node's disk
  read in a full shuffle); every epoch pays for every sample again.

Which is faster, measured: ``python -m scripts.bench.object_storage`` (docs/guides/object-storage.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from cltrain.data.errors import DataError, MissingDataError
from cltrain.data.remote import RemoteError, is_url, join, open_fs, redact, remote_error
from cltrain.data.shard_cache import ShardCache, parse_size

__all__ = ["FETCH_MODES", "MANIFEST", "LocalPack", "RemotePack", "open_pack"]

log = logging.getLogger(__name__)
#: A shard index that is not the one the manifest records.
REPLACED = "not the index the pack's manifest records (another pack's, uploaded or copied over part of this one)"
MANIFEST_ATTEMPTS = 4  # the manifest's reads from a store: 0.5 s, 1 s, 2 s apart


def _transient(err: BaseException) -> bool:
    """Whether a failed read of the manifest may succeed when tried again: a reset, a body cut short, a 5xx or a
    SlowDown (a job's ranks starting at once); not a refused or unknown key, nor an endpoint that cannot be reached
    or does not answer (a connect or read timeout: the client's own attempts have waited for it already), said at
    once."""
    text = f"{type(err).__name__} {err}"
    lasting = ("AccessDenied", "NoSuch", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
               "Could not connect to the endpoint", "EndpointConnectionError", "Forbidden",
               "ConnectTimeout", "ReadTimeout", "Connect timeout", "Read timeout",
               # the client's own settings: a bad endpoint, profile or scheme, no credentials
               "Invalid endpoint", "ProfileNotFound", "ParamValidationError", "SSLError", "NoCredentials",
               "Unable to locate credentials", "InvalidRange", "not satisfiable")
    return (not isinstance(err, (PermissionError, RemoteError, TimeoutError, json.JSONDecodeError))
            and not any(m in text for m in lasting))

#: Written last into a complete pack (by ``cltrain.data.pack``): classes, shards and counts per split.
MANIFEST = "shards.json"
#: How a remote pack's bytes are read (see the module docstring).
FETCH_MODES = ("shards", "ranges")
_OPEN_FILES = 16  # shard files each process keeps open


def _index_name(shard: str) -> str:
    return shard[: -len(".tar")] + ".idx.npy" if shard.endswith(".tar") else shard + ".idx.npy"


def _end(index: np.ndarray) -> int:
    """The byte of its shard an index reads up to."""
    needs = int((index[:, 0] + index[:, 1]).max()) if len(index) and index.ndim == 2 else 0
    if index.ndim == 2 and index.shape[1] >= 5 and len(index):
        needs = max(needs, int((index[:, 3] + index[:, 4]).max()))
    return needs


def index_digest(index: np.ndarray) -> str:
    """A shard index's digest, as a pack's manifest records it (``index_sha256``)."""
    return hashlib.sha256(np.ascontiguousarray(index, dtype=np.int64).tobytes()).hexdigest()


def _made(manifest: dict) -> dict[str, tuple[int, str]]:
    """``{shard: (bytes, index digest)}`` as the pack made them (packs made before the manifest held them: none)."""
    out = {}
    for split in manifest.get("splits", {}).values():
        sizes, digests = split.get("bytes"), split.get("index_sha256")
        if isinstance(sizes, list) and isinstance(digests, list) and len(sizes) == len(digests) == len(split["shards"]):
            out.update({shard: (int(b), str(d)) for shard, b, d in zip(split["shards"], sizes, digests)})
    return out


def _replaced(index: np.ndarray, made: tuple[int, str] | None) -> bool:
    return made is not None and index_digest(index) != made[1]


class LocalPack:
    """A pack in a local folder: files read with ``os.pread`` on one descriptor per shard and process."""

    #: Whether ``plan`` fetches anything ahead.
    fetches_ahead = False

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._files: dict[str, int] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}}  # file descriptors are per process

    def __del__(self) -> None:
        for fd in getattr(self, "_files", {}).values():
            os.close(fd)

    @property
    def where(self) -> str:
        """The pack, for messages."""
        return str(self.root)

    def shard_url(self, shard: str) -> str:
        """Where shard ``shard`` (its name in the manifest) is, for messages."""
        return str(self.root / shard)

    def manifest(self) -> dict:
        """The pack's ``shards.json``; ``FileNotFoundError`` saying how to make one."""
        path = self.root / MANIFEST
        if not path.is_file():
            if any((self.root / split).is_dir() for split in ("train", "val")) and not any(self.root.rglob("*.tar")):
                raise MissingDataError(f"{path} not found: {self.root} is an image folder, not a pack: pack it with "
                                        f"`cltrain-pack {self.root} {self.root}-pack` and read that, or read the folder "
                                        "as it is (ImageFolderDataModule; the app: data=imagenet).")
            raise MissingDataError(f"{path} not found: {self.root} is not a complete cltrain pack. Make one with "
                                    f"`cltrain-pack IMAGEFOLDER {self.root}` (run it again to finish an interrupted "
                                    "one).")
        return json.loads(path.read_text())

    def indexes(self, shards: Sequence[str]) -> list[np.ndarray]:
        """The ``.idx.npy`` of each shard (no pickle), each checked against its shard's size (a stat per shard).

        Raises:
            DataError: a shard or an index the manifest names is missing, unreadable or shorter than its index
                says (an interrupted copy): one line naming the file and the fix.
        """
        made = _made(self.manifest())
        return [self._checked_index(s, made.get(s)) for s in shards]

    def _checked_index(self, shard: str, made: tuple[int, str] | None) -> np.ndarray:
        fix = (f"the pack at {self.root} is incomplete: copy it again whole, or make it anew with `cltrain-pack "
               f"IMAGEFOLDER {self.root}`.")
        path = self.root / _index_name(shard)
        try:
            index = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise DataError(f"{path}: missing; {fix}") from None
        except (OSError, ValueError, EOFError) as err:
            raise DataError(f"{path}: not a shard index ({type(err).__name__}: {err}); {fix}") from None
        if _replaced(index, made):
            raise DataError(f"{path}: {REPLACED}; {fix}")
        needs = _end(index)
        try:
            size = os.stat(self.root / shard).st_size
        except FileNotFoundError:
            raise DataError(f"{self.root / shard}: missing; {fix}") from None
        if made is not None and size != made[0]:
            raise DataError(f"{self.root / shard}: {size} bytes where the manifest says {made[0]} (cut short, or "
                            f"another pack's); {fix}")
        if size < needs:
            raise DataError(f"{self.root / shard}: {size} bytes where its index reads up to byte {needs} (cut short); "
                            f"{fix}")
        return index

    def _path(self, shard: str) -> str:
        return str(self.root / shard)

    def pread(self, shard: str, offset: int, size: int) -> bytes:
        """``size`` bytes of ``shard`` from ``offset``."""
        fd = self._files.get(shard)
        if fd is None:
            fd = self._files[shard] = os.open(self._path(shard), os.O_RDONLY)
        return os.pread(fd, int(size), int(offset))

    def plan(self, shards: Sequence[str]) -> Callable[[int], None] | None:
        """Nothing to fetch ahead on a local disk."""
        return None


class RemotePack(LocalPack):
    """A pack at a URL (see the module docstring).

    Args:
        url: the pack's root (``s3://bucket/imagenet-shards``).
        cache_dir: where the node's shard caches are (``None``: ``shard_cache.default_cache_dir()``).
        cache_limit: most bytes the cache holds (``"200GB"``; ``None``: half the disk's free space).
        fetch: ``"shards"`` or ``"ranges"``.
        ahead: shards fetched in front of the batches served (``fetch="shards"``).
        threads: fetches at once in the main process.
    """

    def __init__(self, url: str, cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 fetch: str = "shards", ahead: int = 8, threads: int = 4) -> None:
        if fetch not in FETCH_MODES:
            raise ValueError(f"RemotePack: fetch={fetch!r} must be one of {FETCH_MODES}.")
        super().__init__(url)
        self.root: str = url.rstrip("/")  # type: ignore[assignment]  # a URL, not a Path
        self.url, self.fetch, self.ahead, self.threads = url.rstrip("/"), fetch, ahead, threads
        self.incomplete = (f"the pack at {redact(self.url)} is incomplete (its manifest names the file): upload it "
                           "again whole, as cltrain-pack wrote it (shards.json last)")
        self.cache = ShardCache(self.url, cache_dir, parse_size(cache_limit), self.incomplete)
        self._files: OrderedDict[str, int] = OrderedDict()  # type: ignore[assignment]
        self._ahead: _FetchAhead | None = None
        self._manifest: dict | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": OrderedDict(), "_ahead": None}

    @property
    def fetches_ahead(self) -> bool:  # type: ignore[override]
        """Whether ``plan`` fetches whole shards ahead (``fetch="shards"``)."""
        return self.fetch == "shards"

    @property
    def where(self) -> str:
        """The pack's URL (without secrets), for messages."""
        return redact(self.url)

    def shard_url(self, shard: str) -> str:
        """The URL of shard ``shard``, for messages."""
        return redact(join(self.url, shard))

    def _image_folder(self) -> bool:
        """Whether the root holds ``train/`` or ``val/`` (an image folder uploaded as it is), asked where the manifest
        is not found; an error here is no answer."""
        try:
            fs, path = open_fs(self.url, quick=True)
            return any(fs.isdir(f"{path.rstrip('/')}/{split}") for split in ("train", "val"))
        except Exception:  # noqa: BLE001 - the manifest's own line is said instead
            return False

    def manifest(self) -> dict:
        """The pack's ``shards.json``, read from the store once (a wrong URL, key or endpoint, or one that does not
        answer, is said quickly; a reset, a 5xx or a SlowDown, as a job's ranks starting at once meet them, is tried
        again up to ``MANIFEST_ATTEMPTS`` times: ``_transient``);
        a complete pack's manifest does not change, and each split's dataset asks for it.

        Raises:
            RemoteError: one line naming the URL and the fix.
        """
        if self._manifest is not None:
            return self._manifest
        url = join(self.url, MANIFEST)
        for attempt in range(MANIFEST_ATTEMPTS):
            try:
                fs, path = open_fs(url, quick=True)
                self._manifest = json.loads(fs.cat_file(path, start=0))  # a range: s3fs asks no size first (a HEAD)
                return self._manifest
            except Exception as err:  # noqa: BLE001 - every failure of the first read is one line
                text = f"{type(err).__name__} {err}"
                if isinstance(err, json.JSONDecodeError) or "InvalidRange" in text or "not satisfiable" in text:
                    raise RemoteError(f"{redact(url)}: not a cltrain pack's manifest (the object is empty or not "
                                      f"JSON: {type(err).__name__}); upload the pack again whole, as `cltrain-pack` "
                                      "wrote it (shards.json last).") from None
                if isinstance(err, FileNotFoundError) and self._image_folder():
                    raise RemoteError(f"{redact(url)}: not found: {self.where} is an image folder, not a pack: pack "
                                      "it with `cltrain-pack IMAGEFOLDER OUT` and upload OUT as it is (shards.json "
                                      "last).") from None
                if isinstance(err, FileNotFoundError):
                    raise RemoteError(f"{redact(url)}: not found: {self.where} is not a complete cltrain pack (no "
                                      "bucket, prefix or manifest there). Check the URL, or make a pack with "
                                      "`cltrain-pack IMAGEFOLDER OUT` and upload OUT there as it is (shards.json "
                                      "last).") from None
                if attempt == MANIFEST_ATTEMPTS - 1 or not _transient(err):
                    raise remote_error(err, url, "the pack's manifest") from None
                log.warning("cltrain: reading %s failed (%s); trying again (%d of %d)", redact(url),
                            redact(" ".join(f"{type(err).__name__}: {err}".split()))[:240], attempt + 2,
                            MANIFEST_ATTEMPTS)
                time.sleep(0.5 * 2 ** attempt)
        raise AssertionError(redact(url))  # not reached

    def indexes(self, shards: Sequence[str]) -> list[np.ndarray]:
        """The shards' indexes, through the cache (once per node), fetched on ``threads`` threads, each checked
        against its shard's size in the folder's listing (where the store lists).

        Raises:
            RemoteError: a shard the manifest names is missing, or shorter than its index says (an interrupted
                upload): one line naming the shard and the fix, before the first step, not when it is first read.
        """
        made = _made(self.manifest())
        indexes = self._fetched_indexes(shards, made)
        for shard, index in zip(shards, indexes):
            flaw = self.cache.flaw(shard, _end(index), made.get(shard, (None,))[0])
            if flaw:
                raise RemoteError(f"{self.shard_url(shard)}: {flaw}; {self.incomplete}")
        return indexes

    def _fetched_indexes(self, shards: Sequence[str], made: dict[str, tuple[int, str]]) -> list[np.ndarray]:
        """The shards' indexes; a cached copy that does not load, or is not the index the manifest records, is
        fetched again once (a node's damaged disk); still so, it is the store's copy: one line."""
        self.cache.open()
        from concurrent.futures import ThreadPoolExecutor

        def load(shard: str) -> np.ndarray:
            name, damaged = _index_name(shard), False
            for _ in range(4):
                path = self.cache.get(name)
                try:
                    index = np.load(path, allow_pickle=False)
                except FileNotFoundError:  # evicted between its fetch and its load (a cache smaller than the pack)
                    continue
                except (OSError, ValueError, EOFError) as err:
                    flaw = f"not a shard index ({' '.join(f'{type(err).__name__}: {err}'.split())[:200]})"
                else:
                    if not _replaced(index, made.get(shard)):
                        return index
                    flaw = REPLACED
                if damaged:  # fetched again, and still so: the store's copy
                    raise RemoteError(f"{self.shard_url(name)}: {flaw}; {self.incomplete}")
                damaged = True
                log.warning("cltrain: %s (the shard cache's copy of %s) is %s; fetching it again", path,
                            self.shard_url(name), flaw)
                path.unlink(missing_ok=True)
            raise RemoteError(f"{self.shard_url(name)}: evicted from the shard cache as often as fetched; set "
                              "data.cache_limit higher")

        with ThreadPoolExecutor(max(1, min(self.threads * 4, len(shards)))) as pool:
            return list(pool.map(load, shards))

    def pread(self, shard: str, offset: int, size: int) -> bytes:
        """``size`` bytes of ``shard`` from ``offset``: from the cached shard (fetched now if need be), or a range."""
        if self.fetch == "ranges":
            return self.cache.read_range(shard, int(offset), int(size))
        fd = self._files.get(shard)
        if fd is None:
            try:
                fd = os.open(self.cache.get(shard), os.O_RDONLY)
            except FileNotFoundError:  # evicted between its fetch and this open: fetched again
                fd = os.open(self.cache.get(shard), os.O_RDONLY)
            self._files[shard] = fd
            while len(self._files) > _OPEN_FILES:  # an open shard stays readable once evicted, so few stay open
                os.close(self._files.popitem(last=False)[1])
        else:
            self._files.move_to_end(shard)
        return os.pread(fd, int(size), int(offset))

    def plan(self, shards: Sequence[str]) -> Callable[[int], None] | None:
        """Fetch ``shards`` (the shard of each batch's samples, in the order the batches come) ahead; the result is
        told the number of each batch as it is served."""
        if self.fetch != "shards":
            return None
        if self._ahead is None:
            self._ahead = _FetchAhead(self.cache, self.threads)
        return self._ahead.plan(shards, self.ahead)


class _FetchAhead:
    """Daemon threads that fetch the shards a plan names, ``ahead`` in front of the batch served."""

    def __init__(self, cache: ShardCache, threads: int) -> None:
        self.cache, self.jobs = cache, queue.Queue()
        self.generation = 0
        for _ in range(threads):
            threading.Thread(target=self._work, daemon=True, name="cltrain-fetch-ahead").start()

    def _work(self) -> None:
        while True:
            generation, name = self.jobs.get()
            if generation != self.generation:
                continue  # an older plan's (the epoch ended or was left)
            try:
                self.cache.get(name)
            except Exception as err:  # noqa: BLE001 - the reader fetches it again and says what is wrong
                log.debug("fetch ahead of %s failed: %s", name, redact(str(err)))

    def plan(self, batches: Sequence[Sequence[str]], ahead: int) -> Callable[[int], None]:
        self.generation += 1
        generation, first = self.generation, {}  # shard -> the first batch that reads it
        for k, shards in enumerate(batches):
            for s in shards:
                first.setdefault(s, k)
        order = sorted(first, key=first.__getitem__)  # shards in the order the batches first need them
        sent = 0

        def reached(k: int) -> None:
            nonlocal sent
            done = sum(1 for s in order[:sent] if first[s] <= k)
            while sent < len(order) and (sent - done < ahead or first[order[sent]] <= k):
                self.jobs.put((generation, order[sent]))
                done += first[order[sent]] <= k
                sent += 1

        return reached


def open_pack(root: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
              cache_limit: int | str | None = None, fetch: str = "shards") -> LocalPack:
    """A ``RemotePack`` for a URL, else a ``LocalPack``."""
    if is_url(str(root)):
        return RemotePack(str(root), cache_dir, cache_limit, fetch)
    return LocalPack(root)
