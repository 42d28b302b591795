"""Atomic file writes: a file is its previous version or the complete new one, never half-written.

The standard library only (torch is imported by ``atomic_torch_save``).

Every writer here puts the data into a temporary file in the *target's own directory*
(``.cltrain-tmp-<pid>-<host>-<random>-<name>``), flushes it and ``fsync``-s it, renames it
over the target with ``os.replace`` (atomic on one filesystem, which the same directory
guarantees) and ``fsync``-s the directory, so the rename survives a power loss too. On
any error the temporary file is removed and the target is left as it was. A write that
fails for lack of space (``ENOSPC``, ``EDQUOT``, ``EFBIG``) raises ``DiskFullError``,
which names the directory and the bytes the file needed; one this process may not write (``EACCES``, ``EPERM``,
``EROFS``) raises ``NotWritableError``, which names the directory.

A process killed in the middle of a write leaves its temporary file behind (nothing
can remove it then); ``remove_leftovers`` removes those of processes that are gone.

Example::

    >>> from cltrain.atomic import atomic_open, atomic_write_json
    >>> _ = atomic_write_json("/tmp/cltrain-example.json", {"top1": 76.1})
    >>> with atomic_open("/tmp/cltrain-example.txt", "w") as f:
    ...     _ = f.write("all or nothing\\n")
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = [
    "TEMP_PREFIX", "DiskFullError", "NotWritableError", "atomic_open", "atomic_torch_save", "atomic_write_bytes", "atomic_write_json",
    "atomic_write_text", "is_this_machine", "own_temp_prefix", "pid_running", "remove_leftovers", "removed_line",
    "this_machine",
]

#: Name prefix of the temporary files; a file with it that outlives its writer is a leftover.
TEMP_PREFIX = ".cltrain-tmp-"

_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
         errno.EFBIG: "the file is larger than the filesystem or this process's file size limit allows"}
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS, errno.EXDEV}
_NAME_MAX = 255


def this_machine() -> str:
    """The host's name and, where the system has them, its PID namespace's number (``node7~4026531836``): two
    containers that share the host's name and a disk (Kubernetes ``hostNetwork``, ``docker --net=host``) do not see
    each other's processes, so a pid written by one means nothing to the other."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}~{namespace}" if namespace else socket.gethostname()


def is_this_machine(name: str) -> bool:
    """Whether ``name``, a :func:`this_machine` written down, is this machine's: the same, or the host's name alone
    (written where the system has no PID namespaces, or by an older cltrain)."""
    return name in (this_machine(), socket.gethostname())


def pid_running(pid: int) -> bool:
    """Whether the process ``pid`` of this machine still runs (another user's process does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's running process
        return True
    return True


def _host_tag() -> str:
    return hashlib.sha1(this_machine().encode()).hexdigest()[:8]


def own_temp_prefix() -> str:
    """How this process's temporary files are named first (its pid and this machine: another container's process of
    the same pid is not this one)."""
    return f"{TEMP_PREFIX}{os.getpid()}-{_host_tag()}-"


def _host_tags() -> tuple[str, str]:
    """The tags a temporary file of this machine may carry: :func:`_host_tag`, and the host's name alone (written
    where the system has no PID namespaces, or by an older cltrain)."""
    return _host_tag(), hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


class DiskFullError(OSError):
    """A write failed for lack of space; the target kept its previous content.

    Attributes:
        path: the file that was being written.
        directory: where it was being written.
        needed: bytes the complete file needs (``at_least``: the bytes written when it failed).
        free: bytes free in ``directory`` after the failed write was cleaned up.
    """

    def __init__(self, path: str | os.PathLike, needed: int, code: int, at_least: bool = False,
                 existed: bool = False) -> None:
        self.path = Path(path)
        self.directory = self.path.parent.absolute()
        self.needed, self.at_least = needed, at_least
        try:
            vfs = os.statvfs(self.directory)
            self.free: int | None = vfs.f_bavail * vfs.f_frsize
        except (OSError, AttributeError):
            self.free = None
        free = "" if self.free is None else f", {_size(self.free)} free"
        limit = _file_size_limit() if code == errno.EFBIG else ""
        kept = f"{self.path.name} keeps its previous content" if existed else f"no {self.path.name} was written"
        message = (f"cannot write {self.path.name} in {self.directory}: {_FULL.get(code, os.strerror(code))}{limit}; "
                   f"it needs {'at least ' if at_least else ''}{_size(needed)}{free}; {kept}")
        super().__init__(code, message, str(self.path))

    def __str__(self) -> str:
        return self.strerror


class NotWritableError(OSError):
    """A write was refused: the folder or the file is not writable (``EACCES``, ``EPERM``, ``EROFS``); the target kept
    its previous content.

    Attributes:
        path: the file that was being written.
        directory: where it was being written.
    """

    def __init__(self, path: str | os.PathLike, code: int, existed: bool = False) -> None:
        self.path = Path(path)
        self.directory = self.path.parent.absolute()
        kept = f"{self.path.name} keeps its previous content" if existed else f"no {self.path.name} was written"
        super().__init__(code, f"cannot write {self.path.name} in {self.directory}: {os.strerror(code).lower()} "
                               f"for this process; {kept}; make the folder writable, or write elsewhere", str(self.path))

    def __str__(self) -> str:
        return self.strerror


_REFUSED = {errno.EACCES, errno.EPERM, errno.EROFS}


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:.1f} MiB)" if n < 2**30 else f"{n:,} bytes ({n / 2**30:.1f} GiB)"


def _file_size_limit() -> str:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return ""
    return " (ulimit -f: unlimited)" if soft == resource.RLIM_INFINITY else f" (ulimit -f: {soft:,} bytes)"


def _space_errno(err: BaseException | None) -> int | None:
    """The ``ENOSPC`` / ``EDQUOT`` / ``EFBIG`` behind ``err`` (torch wraps the ``OSError`` of a write)."""
    for _ in range(8):
        if err is None:
            return None
        if isinstance(err, OSError) and err.errno in _FULL:
            return err.errno
        err = err.__cause__ or err.__context__
    return None


def _temp_path(target: Path) -> Path:
    head = f"{own_temp_prefix()}{secrets.token_hex(4)}-"
    name = target.name
    while len((head + name).encode()) > _NAME_MAX:
        name = name[1:]
    return target.with_name(head + name)


def _create_temp(target: Path) -> tuple[int, Path]:
    """A new temporary file next to ``target`` with ``target``'s permissions (or the umask's for a new file)."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        mode = None
    for _ in range(100):
        tmp = _temp_path(target)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
                         | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            continue
        if mode is not None:
            try:
                os.chmod(tmp, mode)
            except OSError:
                pass
        return fd, tmp
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(target))


def _fsync_dir(directory: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # Windows: a directory cannot be opened for fsync
        return
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:  # some network and FUSE filesystems refuse fsync on a directory
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _commit(tmp: Path, target: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, target)
    else:
        try:
            os.link(tmp, target)  # atomic, and fails if target exists
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, f"{target} exists and is not replaced", str(target)) from None
        except OSError as err:
            if err.errno not in _NO_LINKS:
                raise
            if os.path.lexists(target):  # no hard links here: check, then rename
                raise FileExistsError(errno.EEXIST, f"{target} exists and is not replaced", str(target)) from None
            os.replace(tmp, target)
        else:
            os.unlink(tmp)
    _fsync_dir(target.parent)


def _discard(tmp: Path) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


# Our own rather than a package: atomicwrites is archived (last release 2022), atomicwriter (a Rust
# extension) takes text/bytes, not a stream torch.save can write to; neither names the bytes a full disk
# refused nor removes a killed writer's temporary file.
@contextmanager
def _atomic(path: str | os.PathLike, mode: str, encoding: str | None, overwrite: bool,
            needed: int | Callable[[], int] | None) -> Iterator[IO[Any]]:
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open: mode={mode!r} is not supported (allowed: 'wb', 'w')")
    target = Path(path)
    existed = target.exists()
    try:
        fd, tmp = _create_temp(target)
    except OSError as err:  # no inode left, or a quota on files; a folder this process may not write
        if err.errno in _REFUSED:
            raise NotWritableError(target, err.errno, existed=existed) from err
        code = _space_errno(err)
        if code is None:
            raise
        size = _needed(needed)
        raise DiskFullError(target, size or 0, code, at_least=size is None, existed=existed) from err
    f = os.fdopen(fd, mode, encoding=(encoding or "utf-8") if mode == "w" else None)
    written = 0
    try:
        yield f
        f.flush()
        written = f.tell()
        os.fsync(f.fileno())
        f.close()
        _commit(tmp, target, overwrite)
    except BaseException as err:
        try:
            written = max(written, f.tell())
        except (OSError, ValueError):
            pass
        try:
            f.close()  # flushing the buffer may fail again: the file is discarded anyway
        except OSError:
            pass
        _discard(tmp)
        code = _space_errno(err)
        if code is None:
            raise
        size = _needed(needed)
        raise DiskFullError(target, size if size is not None else written, code, at_least=size is None,
                            existed=existed) from err


def _needed(needed: int | Callable[[], int] | None) -> int | None:
    if not callable(needed):
        return needed
    try:
        return needed()
    except Exception:  # noqa: BLE001 - only the message's byte count is lost
        return None


def atomic_open(path: str | os.PathLike, mode: str = "wb", *, encoding: str | None = None,
                overwrite: bool = True) -> Any:
    """Context manager: a file object whose content replaces ``path`` atomically when the block ends.

    Args:
        path: the target file; its directory must exist.
        mode: ``"wb"`` (bytes) or ``"w"`` (text, ``encoding`` default UTF-8).
        overwrite: ``False``: raise ``FileExistsError`` if ``path`` exists when the file is committed.

    Raises:
        DiskFullError: no space for the file (the target is unchanged, the temporary file removed).
        FileExistsError: ``overwrite=False`` and ``path`` exists.

    Example::

        >>> with atomic_open("/tmp/cltrain-example.bin") as f:
        ...     _ = f.write(b"\\x00" * 16)
    """
    return _atomic(path, mode, encoding, overwrite, None)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, overwrite: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically (see ``atomic_open``); returns ``Path(path)``."""
    with _atomic(path, "wb", None, overwrite, len(data)) as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8", overwrite: bool = True) -> Path:
    """Write ``text`` to ``path`` atomically (see ``atomic_open``); returns ``Path(path)``."""
    return atomic_write_bytes(path, text.encode(encoding), overwrite=overwrite)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, overwrite: bool = True, **dump_kwargs: Any) -> Path:
    """Write ``obj`` as JSON (``json.dumps(obj, **dump_kwargs)`` and a newline) to ``path`` atomically."""
    return atomic_write_text(path, json.dumps(obj, **dump_kwargs) + "\n", overwrite=overwrite)


class _Sink(io.RawIOBase):
    """Where ``torch.save`` writes: the temporary file (keeping the ``OSError`` torch turns into a
    ``RuntimeError``), or nothing (``f=None``: counts the bytes a save needs)."""

    def __init__(self, f: IO[bytes] | None = None) -> None:
        self.f, self.count, self.error = f, 0, None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self.f is not None:
            try:
                self.f.write(data)
            except OSError as err:
                self.error = err
                raise
        self.count += n
        return n


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)``, atomically (see ``atomic_open``), streamed to the disk (no copy in memory).

    Raises:
        DiskFullError: no space for the file; ``needed`` is its exact size.

    Example::

        >>> import torch
        >>> _ = atomic_torch_save({"w": torch.zeros(3)}, "/tmp/cltrain-example.pt")
    """
    import torch  # here: the rest of this module is the standard library only

    def size() -> int:
        sink = _Sink()
        torch.save(obj, sink)
        return sink.count

    with _atomic(path, "wb", None, True, size) as f:
        sink = _Sink(f)
        try:
            torch.save(obj, sink)
        except Exception as err:
            if sink.error is not None and sink.error is not err:
                raise sink.error from err
            raise
    return Path(path)


def _writer_gone(name: str, now: float, mtime: float, stale_after_s: float) -> bool:
    pid, host, *_ = name[len(TEMP_PREFIX):].split("-", 2) + ["", ""]
    if host in _host_tags() and pid.isdigit():
        return int(pid) != os.getpid() and not pid_running(int(pid))
    return now - mtime > stale_after_s  # another machine's or container's (or an unparsable) file: by age only


def remove_leftovers(directory: str | os.PathLike, *, stale_after_s: float = 3600.0) -> list[Path]:
    """Remove the temporary files that writers which are gone left in ``directory``; returns them.

    A file's writer is gone when its process (named in the file name) no longer runs on this
    machine; for a file written from another machine (or another PID namespace: ``this_machine``), when it was not
    modified for ``stale_after_s`` seconds. Files of running writers are kept. A missing directory is empty.
    """
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    now, removed = time.time(), []
    for entry in entries:
        if not entry.name.startswith(TEMP_PREFIX):
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or \
                    not _writer_gone(entry.name, now, entry.stat(follow_symlinks=False).st_mtime, stale_after_s):
                continue
            os.unlink(entry.path)
        except FileNotFoundError:  # another process removed it first
            continue
        removed.append(Path(entry.path))
    return removed


def removed_line(removed: Sequence[Path], by: str = "an interrupted write") -> str:
    """One line on what ``remove_leftovers`` removed, e.g. ``removed 1 temporary file(s) left in
    /run/checkpoints by an interrupted write: .cltrain-tmp-...``."""
    shown = ", ".join(p.name for p in removed[:3]) + (", ..." if len(removed) > 3 else "")
    where = removed[0].parent if removed else Path()
    return f"removed {len(removed)} temporary file(s) left in {where} by {by}: {shown}"
