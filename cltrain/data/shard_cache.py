"""A bounded node-local cache of remote files (a pack's shards and indexes), shared by every process of a node.

``ShardCache(url, folder, limit)`` keeps the files of one remote root under ``folder/<key of url>/``, each under
its name in the root with its version in the store (``shard-000000~<key of its ETag or time>.tar``). ``get(name)``
returns the local path, fetching the file first when the cache does not hold that version:

* **current**: a file replaced in the store (a pack uploaded again to the same URL, or the same URL on another
  endpoint) is another version, fetched anew; the version it replaces is removed then, or evicted in time. The
  versions come from the listing that gives the sizes (ETag, else modification time; a store without either is
  trusted by name). On S3 every GET of a listed file asks ``If-Match`` its listed ETag: a file replaced during the
  run (a pack uploaded again over a running one) is one line, not read as the file listed.

* **once per node**: a fetch holds a lock on the file's name (a byte-range ``fcntl`` lock in one lock file, so a
  killed process never leaves a stale lock), so the ranks and DataLoader workers of a node that want the same shard
  wait for one download instead of making their own; another epoch, run or rank finds it there.
* **atomic**: written to a temporary file in the same folder (``cltrain.atomic``), renamed when complete and of the
  listed size; a reader sees a whole file or none.
* **bounded**: before a download, files unused longest (their modification time is set when used) are removed
  until the cache holds at most ``limit`` bytes with the new file, and the disk keeps ``RESERVE`` free; the space
  is then reserved (``posix_fallocate``) under the same lock, and a download waits while the node's downloads in flight
  hold the room, so concurrent downloads never overshoot (after ``IN_FLIGHT_WAIT`` s, one line says so). A reader that
  has a file open keeps reading it when it is removed (POSIX). A file larger than the limit, or a disk full even
  after eviction, is one line (``CacheFullError``).
* **few requests**: a file's size (the room made for it) and version come from one listing of its folder per
  process, not a request per file; a store or a key that may not list (no ``ListBucket``) is asked per file, once
  per process.
* **retried**: each file comes in ranges of ``CHUNK`` bytes; a range that fails with a transient error (the client
  already retries each request) or comes back short is fetched again with backoff, up to ``ATTEMPTS`` times
  within ``RETRY_WINDOW`` seconds of its first try (no try starts that would end past it at the last try's pace).
  Once one read has failed for good (the store went away), the cache's other reads give up with its line (the file
  it read, its error) and without a word: those in flight at once (the client's own attempts cancelled), those
  asked for within ``RETRY_WINDOW`` seconds without a try (unless a read has succeeded since), so the run ends on
  that one line, not minutes of their retries later. The job's other processes on the node (DataLoader workers,
  ranks) do the same: the failure leaves a note in the cache's folder (``.cltrain-failed-<job>``: the file and the
  reason, redacted), which a process of that job heeds where it was written after that process began reading and
  after its last read that succeeded. Another job reading the same pack through the same folder (an eval job beside
  a training job) does not heed it: its own endpoint, credentials and network may be fine. A file the store holds
  shorter than its reader needs (an upload cut short) is one line, not retried.
* **clean**: temporary files of this process are removed when it exits (also a DataLoader worker), those of
  processes that are gone when a cache is opened or a process using it exits.

Example::

    >>> cache = ShardCache("s3://bucket/pack", "/tmp/cltrain-shards", limit=20 * 2**30)   # doctest: +SKIP
    >>> path = cache.get("train/shard-000000.tar")                                        # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import errno
import fcntl
import glob
import hashlib
import ipaddress
import logging
import os
import re
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator

from cltrain.atomic import (TEMP_PREFIX, DiskFullError, atomic_open, atomic_write_text, own_temp_prefix,
                            remove_leftovers, this_machine)
from cltrain.data.errors import DataError, StorageError
from cltrain.data.remote import RemoteError, join, open_fs, redact, remote_error, split_query

__all__ = ["CacheFullError", "ShardCache", "default_cache_dir", "parse_size"]

log = logging.getLogger(__name__)

#: Bytes fetched per request when a whole file is fetched.
CHUNK = 16 * 2**20
#: Tries of one range before the fetch fails (each try is itself retried by the client).
ATTEMPTS = 4
#: Seconds after which a read that keeps failing is not tried again (an endpoint that stalls: the client's own
#: attempts, each waiting for its read timeout, already take this long).
RETRY_WINDOW = 120
#: Seconds a download waits for the node's downloads in flight to make room under the limit.
IN_FLIGHT_WAIT = 120
#: Bytes the cache always leaves free on its disk.
RESERVE = 2**30
#: Seconds after which a temporary file of another machine or container (a PID namespace of its own), untouched, is
#: a download that died with its writer: a live one writes at least every chunk.
STALE_AFTER = 3600
_LOCKS = ".cltrain-locks"
_FAILED = ".cltrain-failed"  # + "-<job>", in the cache's folder: a read failed for good, for the job's other processes
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class CacheFullError(StorageError):
    """The cache's disk cannot take a file, even with every other file of the cache removed."""


class _GivenUp(Exception):
    """A read abandoned because another read of the cache failed for good (``reason``: that read's failure and URL)."""

    def __init__(self, reason: tuple[BaseException, str]) -> None:
        super().__init__(reason[0])
        self.reason = reason


def parse_size(value: int | str | None, owner: str = "cache_limit") -> int | None:
    """Bytes of ``value``: an int, or a string such as ``"200GB"`` / ``"1.5TiB"``; ``None`` / ``"auto"``: ``None``.

    Raises:
        ValueError: anything else, quoted.
    """
    if value is None or value == "auto":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"{owner}={value!r} must be a size such as 200GB, 500GiB or a number of bytes, or 'auto'.")
    return int(float(match.group(1)) * _UNITS[unit])


def default_cache_dir() -> Path:
    """``$CLTRAIN_SHARD_CACHE``, else ``cltrain-shards`` in the temporary folder (``$TMPDIR``: on a cluster, the
    node's own disk), shared by the node's processes."""
    own = os.environ.get("CLTRAIN_SHARD_CACHE")
    return Path(own) if own else Path(tempfile.gettempdir()) / "cltrain-shards"


_thread_locks: dict[tuple[str, str], threading.Lock] = {}
_guard = threading.Lock()
_lock_files: dict[str, int] = {}  # folder -> this process's descriptor of its lock file (never closed: see _locked)
_folders: set[str] = set()


def _folders_of(folder: str | Path) -> list[Path]:
    """The cache's folder and every folder in it (a pack's splits: the shards' temporary files are there)."""
    try:
        return [Path(folder), *(p for p in Path(folder).rglob("*") if p.is_dir())]
    except OSError:
        return []


def _own_temps(folder: str) -> None:
    """Remove this process's temporary files and those of processes that are gone (at exit), in every folder of the
    cache."""
    prefix = own_temp_prefix()  # not another container's with the same pid (often 1)
    for sub in _folders_of(folder):
        try:
            for entry in os.scandir(sub):
                if entry.name.startswith(prefix):
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        pass
        except OSError:
            continue
        remove_leftovers(sub, stale_after_s=STALE_AFTER)


_leaving = threading.Event()  # this process is exiting: no download starts (its temporary file would stay)
_temps_guard = threading.Lock()  # a download's temporary file is made, or the exit's clean-up begins, not both


def _leave(folder: str | None = None) -> None:
    """At exit: no new download, then this process's temporary files removed (``folder``'s, or every cache's)."""
    with _temps_guard:
        _leaving.set()
    for each in [folder] if folder is not None else list(_folders):
        _own_temps(each)


def _at_exit() -> None:
    _leave()


atexit.register(_at_exit)


def _after_fork() -> None:
    """A forked child (a DataLoader worker) starts with fresh thread locks: one held by a thread of the parent at the
    fork would never be released there."""
    global _guard, _temps_guard
    _guard, _temps_guard = threading.Lock(), threading.Lock()
    _thread_locks.clear()


os.register_at_fork(after_in_child=_after_fork)


def _in_worker_exit(folder: str) -> None:
    """DataLoader workers (multiprocessing children) leave through ``os._exit``: its finalizers, not atexit, run."""
    try:
        from multiprocessing import parent_process, util

        if parent_process() is not None:
            util.Finalize(None, _leave, args=(folder,), exitpriority=100)
    except (ImportError, AttributeError):
        pass


def _job(own: str) -> str:
    """What the processes of one job on a node share and another job's do not, asked when a note is written or read
    (a launcher may set its variables after the cache is made): the SLURM step (every task of an ``srun``), the
    torchrun rendezvous, the address and port every rank of a distributed job is given (with the machine's name where
    the address is loopback: torchrun's default on every node); else ``own``, the token of the process that made the
    cache (its DataLoader workers get the cache pickled)."""
    env = os.environ
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        return f"slurm {env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchelastic {env['TORCHELASTIC_RUN_ID']}"
    if env.get("MASTER_PORT") and env.get("WORLD_SIZE", "1") != "1":  # not a port exported for every job alike
        addr = env.get("MASTER_ADDR", "")
        if _loopback(addr):  # a one-node job's: two nodes share it
            addr = f"{this_machine()} {addr}"
        return f"ranks {addr}:{env['MASTER_PORT']}"
    return own


def _loopback(addr: str) -> bool:
    """Whether a master address names this machine only (``127.0.0.1``, ``localhost``, ``[::1]``, ``0.0.0.0``)."""
    host = addr.strip().strip("[]").lower()
    if host in ("", "localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or ip.is_unspecified or (mapped is not None and mapped.is_loopback)


class ShardCache:
    """The node-local cache of the files of the remote root ``url`` (see the module docstring).

    Args:
        url: the remote root (``s3://bucket/pack``).
        folder: where caches live (``default_cache_dir()`` when ``None``); this root's files go in a folder of
            their own under it.
        limit: most bytes the cache holds (an int, or a size such as ``"200GB"``); ``None``: half the free space
            of ``folder``'s disk when first opened, plus what the cache holds already.
        incomplete: the fix where a file is missing or cut short in the store (``"the MDS dataset at ... is
            incomplete: ..."``); ``None``: ``remote_error``'s.
    """

    def __init__(self, url: str, folder: str | os.PathLike | None = None, limit: int | str | None = None,
                 incomplete: str | None = None) -> None:
        place, query = split_query(url)
        place = place.rstrip("/")
        self.url = place + query
        base = Path(folder) if folder is not None else default_cache_dir()
        # named by the place alone: a signed URL's query (its credentials, renewed) neither names nor splits the cache
        key = hashlib.sha1(place.encode()).hexdigest()[:12]
        self.folder = base / f"{re.sub(r'[^A-Za-z0-9._-]', '_', place.rsplit('/', 1)[-1])[:40]}-{key}"
        self._limit = parse_size(limit)
        self._fs: Any = None
        self._pid = -1
        # folder of the root -> its files' (bytes, version), listed once; a file of a folder that does not list
        self._listing: dict[str, dict[str, tuple[int, str | None]]] = {}
        self._asked: dict[str, tuple[int, str | None]] = {}
        self._etags: dict[str, str] = {}  # "bucket/key" -> the ETag the listing gave (S3)
        self.incomplete = incomplete
        # when a read failed for good, why, and of what URL (_given_up)
        self.failed: tuple[float, BaseException, str] | None = None
        self._since = time.time()  # this process began reading, or last read successfully: an older note is not heeded
        self._own_job = f"{os.getpid()}-{time.time_ns()}"  # see _job
        self.fetched = 0  # files this process fetched (what a test or a benchmark counts)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fs"], state["_pid"], state["failed"] = None, -1, None  # a filesystem is opened again in each process
        return state

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of ``url`` (opened in each process: after a fork the client starts anew)."""
        if self._fs is None or self._pid != os.getpid():
            self._fs, _ = open_fs(self.url)
            self._pid, self._since = os.getpid(), time.time()
            session = getattr(self._fs, "session", None)
            if hasattr(session, "register"):  # S3: every GET of a listed file asks for the listed version
                session.register("before-parameter-build.s3.GetObject", self._if_match)
        return self._fs

    def _if_match(self, params: dict[str, Any], **kwargs: Any) -> None:
        """botocore's hook before a GET: ``If-Match`` the ETag the listing gave, so that a file replaced in the store
        during the run is refused (412), not read as the file listed (a pack uploaded again over a running one)."""
        etag = self._etags.get(f"{params.get('Bucket')}/{params.get('Key')}")
        if etag is not None:
            params.setdefault("IfMatch", etag)

    def remote(self, name: str) -> str:
        """The URL of ``name``."""
        return join(self.url, name)

    def local(self, name: str, version: str | None = None) -> Path:
        """Where ``name`` (in ``version``, as ``entry`` gives it) is, or would be, in the cache."""
        path = self.folder / name
        return path if version is None else path.with_name(f"{path.stem}~{version}{path.suffix}")

    def open(self) -> None:
        """Create the cache's folder, remove what killed processes left there, fix the limit."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CacheFullError(f"shard cache {self.folder}: cannot be created ({err}); set data.cache_dir "
                                 "(or CLTRAIN_SHARD_CACHE) to a writable folder on the node's disk.") from None
        if str(self.folder) not in _folders:
            _folders.add(str(self.folder))
            for sub in _folders_of(self.folder):
                remove_leftovers(sub, stale_after_s=STALE_AFTER)
            _in_worker_exit(str(self.folder))
        if self._limit is None:
            self._limit = self._used() + _free(self.folder) // 2

    @property
    def limit(self) -> int:
        """Most bytes the cache holds."""
        if self._limit is None:
            self.open()
        return int(self._limit)  # type: ignore[arg-type]

    def get(self, name: str, size: int | None = None) -> Path:
        """The local path of ``name``, fetched first (once per node) when the cache does not hold it; ``size``: the
        bytes its reader needs (an index's), else the store's.

        Raises:
            RemoteError: the file cannot be read, or the store holds fewer than ``size`` bytes of it (one line: the
                URL and the fix).
            CacheFullError: the cache's disk cannot take it.
        """
        listed, version = self.entry(name)
        if size is not None and listed < size:  # an upload cut short: no retry reads more of it
            fix = self.incomplete or "upload it again whole"
            raise RemoteError(f"{redact(self.remote(name))}: {listed} bytes where {size} are needed (cut short); "
                              f"{fix}.")
        path = self.local(name, version)
        if _touch(path):
            return path
        if str(self.folder) not in _folders or self._limit is None:
            self.open()
        with self._locked(name):
            if _touch(path):  # another process fetched it meanwhile
                return path
            self._fetch(name, path, listed if size is None else size)
            plain = self.local(name)
            versions = re.compile(re.escape(plain.stem) + r"(~[0-9a-f]{10})?" + re.escape(plain.suffix))
            for old in path.parent.glob(f"{glob.escape(plain.stem)}*"):  # the versions it replaces
                if old != path and versions.fullmatch(old.name):
                    old.unlink(missing_ok=True)
        return path

    def size(self, name: str) -> int:
        """Bytes of ``name`` in the store (``entry``)."""
        return self.entry(name)[0]

    def entry(self, name: str) -> tuple[int, str | None]:
        """Bytes and version of ``name`` in the store: from one listing of its folder per process (one request for a
        folder of shards, where a size asked per file is a request per file: a HEAD costs the client about as much CPU
        as 2 MiB of a shard, and the server as much again), else asked alone (a store or a key that may not list),
        once per process."""
        listed = self.listing(name)
        if name in listed:
            return listed[name]
        if name not in self._asked:
            url = self.remote(name)
            info = self._retried(lambda: self._call("info", url), url)
            self._asked[name] = int(info["size"]), _version(info)
        return self._asked[name]

    def listing(self, name: str) -> dict[str, tuple[int, str | None]]:
        """``{name: (bytes, version)}`` of the files beside ``name`` in the store, listed once per process; ``{}``
        where its folder cannot be listed."""
        folder = name.rpartition("/")[0]
        with _thread_lock((str(self.folder), f"\0ls {folder}")):  # the fetch threads start at once: one listing
            listed = self._listing.get(folder)
            if listed is None:
                listed = self._listing[folder] = self._listed(folder)
        return listed

    def flaw(self, name: str, needs: int, made: int | None = None) -> str | None:
        """What the store's listing says is wrong with ``name``, which must hold ``needs`` bytes (exactly ``made``,
        where that is known): ``"missing"``, ``"N bytes where M are needed (cut short)"`` (an interrupted upload), or
        not the bytes it was made with; ``None`` where nothing is (or its folder does not list: a missing file is
        then said when it is read)."""
        listed = self.listing(name)
        if not listed:
            return None
        if name not in listed:
            return "missing"
        size = listed[name][0]
        if made is not None and size != made:
            return f"{size} bytes where the manifest says {made} (cut short, or another pack's)"
        return f"{size} bytes where {needs} are needed (cut short)" if size < needs else None

    def _listed(self, folder: str) -> dict[str, tuple[int, str | None]]:
        """``{name: (bytes, version)}`` of the files directly in ``folder`` (names relative to the root); ``{}``
        when the folder cannot be listed (no ``ListBucket`` permission, an HTTP root, a transient error)."""
        try:
            entries = self.fs.ls(self.remote(folder) if folder else self.url, detail=True)
        except Exception as err:  # noqa: BLE001 - sizes are then asked per file, which says what is wrong
            log.debug("listing %s failed: %s", redact(self.remote(folder)), redact(str(err)))
            return {}
        prefix = f"{folder}/" if folder else ""
        files = [e for e in entries if e.get("type") == "file" and isinstance(e.get("size"), int)]
        self._etags.update({e["name"]: e["ETag"] for e in files if isinstance(e.get("ETag"), str)})
        return {prefix + e["name"].rstrip("/").rsplit("/", 1)[-1]: (int(e["size"]), _version(e)) for e in files}

    def read_range(self, name: str, offset: int, size: int) -> bytes:
        """``size`` bytes of ``name`` from ``offset``, read from the store (not cached), retried."""
        return self._retried(lambda: self._range(self.remote(name), offset, size), self.remote(name))

    def _range(self, url: str, offset: int, size: int) -> bytes:
        data = self._call("cat_file", url, start=offset, end=offset + size)
        if len(data) != size:
            raise ConnectionError(f"got {len(data)} of {size} bytes")
        return data

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)``; on an async filesystem (s3fs, gcsfs, adlfs, HTTP) run on its loop as
        fsspec's own call is, and abandoned (cancelled, the client's own attempts with it) once another read has
        failed for good."""
        fs = self.fs
        if not getattr(fs, "async_impl", False):
            return getattr(fs, method)(*args, **kwargs)
        future = asyncio.run_coroutine_threadsafe(getattr(fs, f"_{method}")(*args, **kwargs), fs.loop)
        while not concurrent.futures.wait([future], timeout=0.1).done:
            given_up = self._given_up()
            if given_up is not None:
                future.cancel()
                raise _GivenUp(given_up)
        return future.result()

    def _given_up(self) -> tuple[BaseException, str] | None:
        """Why a read of this cache failed for good, less than ``RETRY_WINDOW`` seconds ago, with no read succeeding
        since, and the URL it read; ``None`` where none did."""
        failed = self.failed
        if failed is not None and time.monotonic() - failed[0] < RETRY_WINDOW:
            return failed[1:]
        note = self._note()
        try:
            written = note.stat().st_mtime
            if written < self._since or time.time() - written >= RETRY_WINDOW:
                return None
            name, url, reason = (note.read_text().split("\n", 2) + ["", ""])[:3]
        except OSError:  # no note (the usual case), or one removed meanwhile
            return None
        return type(name or "Exception", (Exception,), {})(reason), url  # as the failing process read its error

    def _note(self) -> Path:
        """This job's failure note: another job reading through the same folder may well be reading fine."""
        return self.folder / f"{_FAILED}-{hashlib.sha1(_job(self._own_job).encode()).hexdigest()[:12]}"

    def _note_failure(self, err: BaseException, url: str) -> None:
        """A read of ``url`` failed for good: for this process (``failed``) and, in the cache's folder, for the node's
        others."""
        self.failed = (time.monotonic(), err, url)
        try:
            reason = redact(" ".join(str(err).split()), self.url)
            atomic_write_text(self._note(), f"{type(err).__name__}\n{redact(url)}\n{reason}")
        except OSError:  # a note not written: the others retry as long as they would have
            pass
        for old in glob.glob(glob.escape(str(self.folder / _FAILED)) + "-*"):  # other jobs' notes, no longer heeded
            with suppress(OSError):
                if time.time() - os.stat(old).st_mtime >= RETRY_WINDOW:
                    os.unlink(old)

    def _retried(self, read: Callable[[], Any], url: str) -> Any:
        """``read()``, again after a transient failure (backoff 0.2 s, 0.4 s, ...); a lasting one as one line. Once a
        read of this cache has failed for good, the others give up with its line, quietly and at once (see the
        module docstring): the run ends on the first one's line, not after their retries."""
        started = time.monotonic()
        for attempt in range(ATTEMPTS):
            tried = time.monotonic()
            try:
                given_up = self._given_up()
                if given_up is not None:
                    raise _GivenUp(given_up)
                data = read()
                self.failed, self._since = None, time.time()
                return data
            except (FileNotFoundError, PermissionError, RemoteError, DataError) as err:
                raise remote_error(err, url, missing=self.incomplete) from None
            except Exception as err:  # noqa: BLE001 - a reset, a timeout, a 5xx the client gave up on, a short body
                if "AccessDenied" in str(err) or "NoSuch" in str(err):
                    raise remote_error(err, url, missing=self.incomplete) from None
                if "PreconditionFailed" in str(err) or "pre-conditions" in str(err):  # If-Match: replaced since listed
                    raise RemoteError(f"{redact(url)}: replaced in the store during the run (not the version listed "
                                      "when the run began): the pack was uploaded again meanwhile. Start the run again "
                                      "once the upload is complete.") from None
                # the read that failed for good names itself: its error quotes its own URL and host, not this one's
                given_up = err.reason if isinstance(err, _GivenUp) else self._given_up()
                now, pause = time.monotonic(), min(0.2 * 2 ** attempt, 5.0)
                # the next try, as long as this one (the client's own attempts and backoff in it), must end in the window
                late = now - started + pause + (now - tried) > RETRY_WINDOW
                if given_up is not None or attempt == ATTEMPTS - 1 or late:
                    if given_up is None:
                        self._note_failure(err, url)
                    raise remote_error(*(given_up or (err, url))) from None
                log.warning("cltrain: reading %s failed (%s); trying again (%d of %d)", redact(url),
                            redact(" ".join(f"{type(err).__name__}: {err}".split()))[:240], attempt + 2, ATTEMPTS)
                time.sleep(pause)
        raise AssertionError(redact(url))  # not reached

    def _fetch(self, name: str, path: Path, size: int | None) -> None:
        if size is None:
            size = self.size(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with ExitStack() as stack:
                deadline = time.monotonic() + IN_FLIGHT_WAIT
                while True:
                    with self._locked(""):  # room made and reserved under one lock: concurrent fetches add up
                        if self._make_room(size, name, time.monotonic() > deadline):
                            with _temps_guard:  # a fetch-ahead thread at exit: its file would outlive the clean-up
                                if _leaving.is_set():
                                    raise StorageError(f"{name}: not fetched, the process is exiting")
                                f = stack.enter_context(atomic_open(path))
                            if size and hasattr(os, "posix_fallocate"):
                                os.posix_fallocate(f.fileno(), 0, size)
                            break
                    time.sleep(0.05)  # the node's other downloads hold the room: evictable once they are done
                for start in range(0, size, CHUNK):
                    f.write(self.read_range(name, start, min(CHUNK, size - start)))
                f.truncate(size)
        except OSError as err:  # atomic_open removed the temporary file; a full disk is a DiskFullError
            if isinstance(err, DiskFullError) or err.errno in _FULL:
                raise self._full(name, size, err) from None
            raise
        self.fetched += 1

    def _full(self, name: str, size: int, err: BaseException) -> CacheFullError:
        return CacheFullError(f"shard cache {self.folder}: no room for {name} ({_mib(size)}; "
                              f"{_free(self.folder) / 2**20:.0f} MiB free on its disk, limit {self.limit / 2**20:.0f} "
                              f"MiB; {' '.join(str(err).split())[:120]}); set data.cache_dir (or CLTRAIN_SHARD_CACHE) "
                              "to a disk with room, or data.cache_limit lower.")

    def _files(self) -> list[tuple[float, int, Path]]:
        """``(last use, bytes, path)`` of every cached file and temporary file (in-flight, reserved) of the cache."""
        found = []
        for root, _, names in os.walk(self.folder):
            for n in names:
                if n == _LOCKS or n.startswith(_FAILED):
                    continue
                p = Path(root) / n
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, max(st.st_size, st.st_blocks * 512), p))
        return found

    def _used(self) -> int:
        return sum(size for _, size, _ in self._files()) if self.folder.is_dir() else 0

    def _make_room(self, size: int, name: str, late: bool = False) -> bool:
        """Remove the files unused longest until ``size`` more bytes fit the limit and the disk's reserve; ``False``
        where only downloads in flight (reserved, not yet evictable) hold the room, unless ``late`` (then one line, and
        the cache goes over its limit by what is in flight)."""
        if size > self.limit:
            raise CacheFullError(f"shard cache {self.folder}: {name} ({_mib(size)}) is larger than the "
                                 f"cache's limit ({_mib(self.limit)}); set data.cache_limit higher.")
        files = sorted(self._files())
        used = sum(s for _, s, _ in files)
        free = _free(self.folder)
        for _, bytes_, p in files:
            if used + size <= self.limit and free - size >= RESERVE:
                break
            if p.name.startswith(TEMP_PREFIX):
                continue  # another process's download in flight
            try:
                p.unlink()
            except FileNotFoundError:
                continue
            used, free = used - bytes_, free + bytes_
        if used + size > self.limit:  # what is left is in flight
            if not late:
                return False
            log.warning("cltrain: shard cache %s: %s goes over data.cache_limit (%.1f MiB) while other downloads of "
                        "%.1f MiB have been in flight for %d s", self.folder, name, self.limit / 2**20,
                        used / 2**20, IN_FLIGHT_WAIT)
        if free - size < RESERVE and free < size + RESERVE:
            raise self._full(name, size, OSError(errno.ENOSPC, "fewer free bytes than the file and the reserve"))
        return True

    @contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        """Exclusive use of ``name`` (``""``: of the cache's accounting) among the threads and processes of the node:
        a byte-range lock (per process; released by the kernel when a process dies), and a thread lock (record
        locks do not exclude threads of one process)."""
        lock = _thread_lock((str(self.folder), name))
        with _guard:
            fd = _lock_files.get(str(self.folder))
            if fd is None:  # never closed: closing any descriptor of the file drops all of this process's locks
                fd = _lock_files[str(self.folder)] = os.open(self.folder / _LOCKS, os.O_RDWR | os.O_CREAT, 0o666)
        offset = zlib.crc32(name.encode()) + 1 if name else 0
        with lock:
            _lock_range(fd, offset)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)


def _lock_range(fd: int, offset: int) -> None:
    """Wait for the byte at ``offset``. Record locks belong to a process, so where threads of two processes wait on
    each other's bytes the kernel sees a cycle and answers EDEADLK, though none is possible here (a thread takes a
    file's byte, then the accounting's, never the reverse, and lets both go): ask again after a pause."""
    pause = 0.001
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, offset)
            return
        except OSError as err:
            if err.errno != errno.EDEADLK:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _thread_lock(key: tuple[str, str]) -> threading.Lock:
    """The process's lock of ``key`` (fresh in a forked child: see ``_after_fork``)."""
    with _guard:
        return _thread_locks.setdefault(key, threading.Lock())


#: What names a file's version in fsspec's listings and infos (s3fs, gcsfs, adlfs, HTTP), first found first.
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "content_md5", "Content-MD5", "Digest", "LastModified", "last_modified",
                 "updated", "mtime")


def _version(entry: dict[str, Any]) -> str | None:
    """A short key of the version a listing's or an info's entry gives (``None``: it gives none)."""
    value = next((entry[k] for k in _VERSION_KEYS if entry.get(k)), None)
    return None if value is None else hashlib.sha1(str(value).encode()).hexdigest()[:10]


def _touch(path: Path) -> bool:
    """Mark ``path`` used now (what eviction orders by); ``False`` if it is not there."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


def _mib(n: int) -> str:
    """A size as the lines give it: MiB to one decimal, KiB below 1 MiB (a 120 KiB shard against a 100 KB limit)."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _free(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize
