"""The file index of an image folder split (``split/<class>/<image>``), built once and cached.

A walk skips hidden and system entries (``cltrain.data.constants.is_hidden``: dot names such as
``.ipynb_checkpoints`` and ``.DS_Store``, ``Thumbs.db``, ``desktop.ini``), counts each image file
once, by its real path (a symlink loop is walked once, a second link to a listed file is dropped;
hard links are not recognised), and counts the files whose suffix is not in ``IMG_EXTENSIONS``
(torchvision's ``ImageFolder`` list) as ``ignored``.

``index_split`` stores what one walk found as one JSON file per split in
``default_cache_dir()`` (or ``cache_dir``), keyed by the split's real path, written atomically;
an index found in ``<root>/.cltrain_index/`` is moved there on first use. It is reused while the
modification time of every folder the walk visited is unchanged (a folder changed within 2 s of
the walk is not trusted), and ranks share it through a file lock: the first walks and writes,
the others read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import unicodedata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from cltrain.atomic import atomic_write_bytes, atomic_write_json, remove_leftovers, removed_line
from cltrain.data.constants import IMG_EXTENSIONS, is_hidden
from cltrain.data.errors import DataError, MissingDataError

__all__ = ["SplitIndex", "default_cache_dir", "find_classes", "index_split", "not_loaded", "scan_split",
           "unicode_twins"]

log = logging.getLogger(__name__)

_VERSION = 2  # 2: an image and a link to it in its class listed as the image; links from other classes counted
_RACY_S = 2.0  # folders modified this recently are not trusted to show a later change
#: The folder in a dataset root where older versions kept the index (moved out on first use).
LEGACY_DIR_NAME = ".cltrain_index"


@dataclass
class SplitIndex:
    """What one walk of ``split_dir`` found.

    Attributes:
        classes: class folder names, in label order.
        samples: ``(path, class index)`` of every image file, each real file once.
        ignored: count of files not loaded (hidden and system files aside), by lower-case suffix (``""``: none).
        duplicates: image paths dropped because their real file was already listed in their class.
        shared: images listed in a class and, through a link, in another class too.
        signature: modification time (ns) of every folder walked, by real path.
    """

    classes: list[str]
    samples: list[tuple[str, int]]
    ignored: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    shared: int = 0
    signature: dict[str, int] = field(default_factory=dict)

    def summary(self, split_dir: str | os.PathLike) -> str | None:
        """One line on the ignored and duplicate files, or ``None`` when there are none."""
        parts = []
        if self.ignored:
            parts.append(not_loaded(self.ignored, IMG_EXTENSIONS))
        if self.duplicates:
            parts.append(f"{self.duplicates} link(s) to an image already listed in its class, counted once")
        if self.shared:
            parts.append(f"{self.shared} image(s) linked into another class, listed in each (as torchvision lists them)")
        return f"{split_dir}: " + "; ".join(parts) + "." if parts else None


def not_loaded(ignored: dict[str, int], loaded: Sequence[str]) -> str:
    """``N file(s) not loaded (.txt: 2, ...; loaded: ...)``: the files a walk left out, counted by lower-case suffix
    (``""``: none), most first, and what it loads."""
    kinds = ", ".join(f"{k or '(no suffix)'}: {n}" for k, n in sorted(ignored.items(), key=lambda kv: -kv[1]))
    return f"{sum(ignored.values())} file(s) not loaded ({kinds}; loaded: {', '.join(loaded)})"


def find_classes(split_dir: str | os.PathLike) -> list[str]:
    """Sorted names of the class folders of ``split_dir``.

    Raises:
        FileNotFoundError: ``split_dir`` is missing.
        DataError: it holds no class folders (hidden and system folders are not classes).
    """
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise MissingDataError(f"{split_dir} is not a folder. Expected the ImageNet layout: "
                                f"{split_dir.parent}/train/<class>/<image> and {split_dir.parent}/val/<class>/<image>.")
    with os.scandir(split_dir) as scan:
        entries = [e for e in scan if not is_hidden(e.name)]
    classes = sorted(e.name for e in entries if e.is_dir())
    if not classes:
        raise DataError(f"{split_dir} holds no class folders; put each class's images in {split_dir}/<class>/.")
    loose = sum(e.name.lower().endswith(IMG_EXTENSIONS) and not e.is_dir() for e in entries)
    if loose and str(split_dir) not in _TOLD_LOOSE:  # ImageNet's raw val/ is flat: its labels come from elsewhere
        _TOLD_LOOSE.add(str(split_dir))
        warnings.warn(f"{split_dir}: {loose} image(s) lie in it outside a class folder and are left out (each class's "
                      f"images go in {split_dir}/<class>/).", stacklevel=2)
    return classes


_TOLD_LOOSE: set[str] = set()  # the split folders whose loose images were said


def _walk(folder: str, real: str, seen_dirs: set[str], seen_files: dict[str, dict[str, str]], index: SplitIndex,
          out: list[str], name: str) -> None:
    """Depth-first, sorted, following folder links once each (by real path); an image reached twice in class
    ``name`` is listed once, as the file itself rather than a link to it (one linked from another class is listed in
    both, as torchvision's ``ImageFolder`` lists it)."""
    seen_dirs.add(real)
    index.signature[real] = os.stat(real).st_mtime_ns
    subdirs = []
    with os.scandir(folder) as entries:
        for e in sorted(entries, key=lambda e: e.name):
            if is_hidden(e.name):
                continue
            if e.is_dir():
                sub_real = os.path.realpath(e.path) if e.is_symlink() else os.path.join(real, e.name)
                if sub_real not in seen_dirs:
                    subdirs.append((e.path, sub_real))
                continue
            if not e.name.lower().endswith(IMG_EXTENSIONS):
                if e.is_file():  # a dangling link is neither file nor folder: not counted
                    suffix = os.path.splitext(e.name)[1].lower()
                    index.ignored[suffix] = index.ignored.get(suffix, 0) + 1
                continue
            file_real = os.path.realpath(e.path) if e.is_symlink() else os.path.join(real, e.name)
            listed = seen_files.setdefault(file_real, {})
            if name in listed:
                index.duplicates += 1
                if os.path.islink(listed[name]) and not e.is_symlink():  # the file itself kept, not a link to it
                    out[out.index(listed[name])] = listed[name] = e.path
                continue
            index.shared += bool(listed)  # linked from another class: listed there too, as torchvision lists it
            listed[name] = e.path
            out.append(e.path)
    for path, sub_real in subdirs:
        if sub_real not in seen_dirs:  # a sibling may have linked it meanwhile
            _walk(path, sub_real, seen_dirs, seen_files, index, out, name)


def scan_split(split_dir: str | os.PathLike, classes: Sequence[str] | None = None, allow_missing: bool = False,
               split_name: str | None = None) -> SplitIndex:
    """Walk ``split_dir/<class>/`` (any depth) and list its images (no cache; see ``index_split``).

    Args:
        split_dir: e.g. ``root/train``.
        classes: class names in label order; ``None`` takes the folders of ``split_dir``.
        allow_missing: accept classes of ``classes`` that have no folder here.
        split_name: how the errors name the split's role (default: the folder name).

    Raises:
        FileNotFoundError: ``split_dir`` is missing.
        DataError: no class folders, a class folder without images, a class folder not in
            ``classes``, or (unless ``allow_missing``) a class of ``classes`` with no folder.
    """
    split_dir = Path(split_dir)
    present = find_classes(split_dir)
    classes = list(present if classes is None else classes)
    unknown = sorted(set(present) - set(classes))
    if unknown:
        raise DataError(f"{split_dir} has class folders {unknown} that the training split does not have"
                        f"{unicode_twins(unknown, classes)}; remove them or add them to the training split.")
    missing = [c for c in classes if c not in set(present)]
    if missing and not allow_missing:
        raise DataError(f"{split_dir} lacks the class folders {missing} that the training split has; add them, "
                         f"or allow it explicitly with allow_missing_val_classes=True.")
    index = SplitIndex(classes=classes, samples=[])
    seen_dirs = {os.path.realpath(split_dir)}
    index.signature[os.path.realpath(split_dir)] = os.stat(split_dir).st_mtime_ns
    seen_files: dict[str, dict[str, str]] = {}  # an image's real path -> its classes' paths listed
    walked_by: dict[str, str] = {}  # a folder's real path -> the class whose walk listed it
    for label, name in enumerate(classes):
        if name not in present:
            continue
        folder = split_dir / name
        real = os.path.realpath(folder)
        found: list[str] = []
        if real in seen_dirs:  # listed already: its images are another class's (an image belongs to one class)
            owner = walked_by.get(real)
            how = f"a link to {real}, whose images" if os.path.islink(folder) else "reached through a link inside " \
                  "another class's folder: its images"
            raise DataError(f"class folder {folder} is {how} are listed under "
                            f"{f'class {owner!r}' if owner else 'the split'} already; an image belongs to one class: "
                            "remove the link, or copy the images.")
        before = set(seen_dirs)
        _walk(str(folder), real, seen_dirs, seen_files, index, found, name)
        walked_by.update(dict.fromkeys(seen_dirs - before, name))
        # torchvision's order (its folders sorted as strings: sub, sub-x, sub/deeper), so a seed picks the same images
        found.sort(key=lambda p: (os.path.dirname(p), os.path.basename(p)))
        if not found:
            raise DataError(f"class folder {folder} has no images (suffixes {', '.join(IMG_EXTENSIONS)}"
                            f"{_only(folder)}); add images or remove the folder.")
        index.samples += [(p, label) for p in found]
    return index


def unicode_twins(names: Sequence[str], others: Sequence[str]) -> str:
    """Where a name of ``names`` is one of ``others`` written with other Unicode code points (a folder copied
    between macOS, NFD, and Linux, NFC): `` ('café' there is 'café' here, in other code points: rename one)``."""
    nfc = {unicodedata.normalize("NFC", o): o for o in others}
    twins = [(n, nfc[unicodedata.normalize("NFC", n)]) for n in names if unicodedata.normalize("NFC", n) in nfc]
    if not twins:
        return ""
    n, o = twins[0]
    return (f" ({n!r} is the training split's {o!r} in other Unicode code points, {ascii(n)} against {ascii(o)}: "
            "rename one)")


def _only(folder: Path) -> str:
    """``"; it holds only .DS_Store, Thumbs.db"``: what a class folder without images holds (up to 3 names)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return ""
    if not names:
        return "; it is empty"
    return "; it holds only " + ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def default_cache_dir() -> Path:
    """Where index files go by default: ``$CLTRAIN_CACHE_DIR/index``, else
    ``$XDG_CACHE_HOME/cltrain/index`` (``~/.cache/cltrain/index`` when that is unset)."""
    own = os.environ.get("CLTRAIN_CACHE_DIR")
    if own:
        return Path(own) / "index"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cltrain" / "index"


def _cache_file(split_dir: Path, cache_dir: str | os.PathLike | None) -> Path:
    key = hashlib.sha1(os.path.realpath(split_dir).encode()).hexdigest()[:16]
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"{split_dir.name}-{key}.json"


def _migrate(split_dir: Path, path: Path) -> None:
    """Move the index an older version wrote to ``<root>/.cltrain_index/`` to ``path`` (a missing file: nothing)."""
    legacy_dir = split_dir.parent / LEGACY_DIR_NAME
    legacy = legacy_dir / path.name
    if path.exists() or not legacy.is_file():
        return
    try:
        atomic_write_bytes(path, legacy.read_bytes())
    except OSError:
        return  # the index is rebuilt in the new place
    try:
        legacy.unlink()
        for lock in legacy_dir.glob("*.lock"):
            lock.unlink()
        legacy_dir.rmdir()  # only when nothing else is left in it
    except OSError:
        pass  # a read-only root keeps its copy, which is no longer read
    log.info("moved the file index of %s from %s to %s", split_dir, legacy, path)


def _load(path: Path, key: dict, split_dir: Path) -> SplitIndex | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    signature = data["signature"]
    for folder, mtime in signature.items():
        try:
            if os.stat(folder).st_mtime_ns != mtime:
                return None
        except OSError:
            return None
    prefix = str(split_dir) + os.sep  # stored relative: the same tree may be named from another folder
    samples = []
    for label, names in enumerate(data["files"]):
        samples += [(prefix + p, label) for p in names.split("\n")] if names else []
    return SplitIndex(classes=key["classes"], samples=samples, ignored=data["ignored"], duplicates=data["duplicates"],
                      shared=data["shared"], signature=signature)


def _store(path: Path, key: dict, index: SplitIndex, started: float, split_dir: Path) -> None:
    if any(started - mtime / 1e9 < _RACY_S for mtime in index.signature.values()):
        return  # a folder changed just before the walk: a later change in the same clock tick could go unseen
    files: list[list[str]] = [[] for _ in index.classes]
    skip = len(str(split_dir)) + 1  # every walked path starts with split_dir + "/"
    for p, label in index.samples:
        files[label].append(p[skip:])
    data = {"key": key, "signature": index.signature, "ignored": index.ignored, "duplicates": index.duplicates,
            "shared": index.shared, "files": ["\n".join(f) for f in files]}  # one string per class: loads ~10x faster than a list of paths
    atomic_write_json(path, data)


def index_split(split_dir: str | os.PathLike, classes: Sequence[str] | None = None, allow_missing: bool = False,
                cache: bool = True, cache_dir: str | os.PathLike | None = None) -> SplitIndex:
    """``scan_split``, from the cache when the tree is unchanged (see the module docstring).

    Args:
        split_dir: as ``scan_split``.
        classes: as ``scan_split``.
        allow_missing: as ``scan_split``.
        cache: ``False`` always walks and stores nothing.
        cache_dir: where the index files go; ``None``: ``default_cache_dir``.
    """
    split_dir = Path(split_dir)
    if not cache:
        return scan_split(split_dir, classes, allow_missing)
    present = find_classes(split_dir)  # cheap, and its errors come first
    key = {"version": _VERSION, "split": os.path.realpath(split_dir), "classes": list(present if classes is None else classes),
           "allow_missing": bool(allow_missing), "extensions": list(IMG_EXTENSIONS)}
    path = _cache_file(split_dir, cache_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path) + ".lock", timeout=3600)
        lock.acquire()
    except OSError:  # no writable cache anywhere: walk
        return scan_split(split_dir, classes, allow_missing)
    try:
        _migrate(split_dir, path)
        removed = remove_leftovers(path.parent)  # under the lock: no other rank is writing
        if removed:
            warnings.warn(f"index_split: {removed_line(removed, 'a run stopped while writing the file index')}",
                          stacklevel=2)
        cached = _load(path, key, split_dir)
        if cached is not None:
            return cached
        started = time.time()
        index = scan_split(split_dir, key["classes"], allow_missing)
        try:
            _store(path, key, index, started, split_dir)
        except OSError:
            pass
        return index
    finally:
        lock.release()
