"""The bad-file policy every Dataset of the data path shares: ``bad_files="raise"`` or ``"skip"``.

A sample that cannot be read (an image file, a sample of a pack, a row of a Hugging Face dataset,
a clip) raises ``BadImageError`` naming it and the fix under ``bad_files="raise"``; under ``"skip"``
it is replaced by the next readable sample and reported: one ``split<TAB>name<TAB>reason`` line
appended to ``skip_log`` (the run directory's ``skipped_files.tsv``, from whichever worker process
met it) and a warning once per sample and process. A sample's name is its file's path (in a pack:
the path of the file it was packed from) or, in a dataset of rows, ``row <index>``.

The policy is applied here, for every source: ``SkipsBadSamples.fetch`` for one sample,
``SkipsBadSamples.start_batch`` for the samples of a batch decoded on threads (folders, packs,
rows, clips); a stream, which has no next index to fetch, reports what ``start_batch`` let through
(``skip``) and puts its own stand-in in its place.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cltrain.data.errors import BadImageError, EmptyImageError, LabelFault, SampleFault
from cltrain.data.loader_threads import start_batch
from cltrain.data.resume_state import SeededIndex

__all__ = ["BAD_FILE_POLICIES", "NamedSplit", "SkipsBadSamples", "check_bad_files", "printable", "unreadable"]

log = logging.getLogger(__name__)

#: What ``bad_files=`` accepts, in every source.
BAD_FILE_POLICIES: tuple[str, ...] = ("raise", "skip")
_MAX_SKIPS_IN_A_ROW = 50
_IN_MEMORY = re.compile(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>")
_OPENED = re.compile(r" ?<_io\.Buffered\w+ name=(?:'[^']*'|\"[^\"]*\"|\d+)>")


def check_bad_files(bad_files: str, owner: str = "") -> str:
    """``bad_files`` if it is a policy of ``BAD_FILE_POLICIES``; else ``ValueError`` (prefixed by ``owner``)."""
    if bad_files not in BAD_FILE_POLICIES:
        raise ValueError(f"{owner + ': ' if owner else ''}bad_files={bad_files!r} must be one of {BAD_FILE_POLICIES}.")
    return bad_files


def unreadable(err: BaseException, path: str | os.PathLike | None = None) -> str:
    """Why a sample could not be read, in one line (no tabs): a dangling symbolic link says where it points."""
    if path is not None and os.path.islink(path) and not os.path.exists(path):
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
    with contextlib.suppress(OSError, TypeError, ValueError):
        if path is not None and os.path.getsize(path) == 0:
            return str(EmptyImageError())  # as cltrain-data-check says it
    if isinstance(err, SampleFault):  # a stored sample's or a row's 0 bytes, a label that is no class
        return str(err)
    # Pillow names a BytesIO by its address, and a file by the object that read it or by its path: the line names the
    # file already
    text = _OPENED.sub("", _IN_MEMORY.sub("(bytes)", f"{type(err).__name__}: {err}"))
    if path is not None:  # "No such file or directory: '<path>'", "cannot identify image file '<path>'", "<path>: ..."
        named = os.fspath(path)
        text = text.replace(f": {named!r}", "").replace(f" {named!r}", "").replace(f"{named}: ", "")
    return text.replace("\t", " ").replace("\n", " ")


def printable(text: str) -> str:
    """``text`` with the bytes of a name that is not UTF-8 written as escapes (``\\udce9``): any log handler writes
    it."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class SkipsBadSamples:
    """The bad-file policy (see the module docstring) of a Dataset whose ``load(i)`` raises
    ``BadImageError`` for an unreadable sample (its ``reason``, else its ``__cause__``, says why):
    ``"raise"`` passes it on; ``"skip"`` reports the sample (``skip``) and returns the next readable
    one (looking at most 50 samples ahead, or 1% of the split where that is more; a sample found unreadable is
    not loaded again in that walk, in this process). The Dataset calls ``_set_policy`` and says what its samples are
    called (``sample_name``), which split it is (``split_name``) and where (``source_name``);
    ``what`` names a sample in the warning."""

    what = "image"
    #: Where set (a format that keeps no class names: its DataModule's ``num_classes``), a label outside
    #: ``0 .. num_classes - 1`` makes its sample a bad one (``class_index``).
    num_classes: int | None = None
    bad_files: str
    skip_log: str | None
    _warned: set[str]
    _unlisted: dict[str, str]

    def _set_policy(self, bad_files: str, skip_log: str | os.PathLike | None) -> None:
        self.bad_files = check_bad_files(bad_files)
        self.skip_log = None if skip_log is None else str(skip_log)
        self._warned = set()
        self._unlisted = {}

    def list_skips_in(self, skip_log: str | os.PathLike) -> None:
        """Append the samples skipped from now on to ``skip_log``, and those this process skipped before it was
        given (a DataModule's ``setup`` called before the Trainer's, which opens the list)."""
        self.skip_log = str(skip_log)
        unlisted, self._unlisted = self._unlisted, {}
        for name, reason in unlisted.items():
            self.skip(name, reason)

    def class_index(self, label: Any) -> Any:
        """``label``, checked against ``num_classes`` where that is set: a label of no class is a ``SampleFault``
        (without the check it fails the loss, or a device-side assert, naming no sample)."""
        n = self.num_classes
        if n is not None and not 0 <= label < n:
            raise LabelFault(f"label {label} is no class of num_classes={n}")
        return label

    def label_message(self, name: str, reason: str) -> str:
        """The one line of ``BadImageError`` for sample ``name`` whose label is no class (``class_index``)."""
        return (f"{self.source_name} {name}: {reason}. Set num_classes to the number of classes, or mend the label "
                f"(bad_files='skip' leaves such {self.what}s out).")

    def __len__(self) -> int:  # pragma: no cover - the Dataset's
        raise NotImplementedError

    def load(self, index: int) -> tuple[Any, ...]:  # pragma: no cover - the Dataset's
        raise NotImplementedError

    def sample_name(self, index: int) -> str:
        """How the skipped-files list names sample ``index`` (a folder Dataset: its path)."""
        return str(self.samples[index][0])  # type: ignore[attr-defined]

    @property
    def split_name(self) -> str:
        """The split column of the skipped-files list (a folder Dataset: its folder's name)."""
        return self.split_dir.name  # type: ignore[attr-defined]

    @property
    def source_name(self) -> str:
        """Where the samples are, for errors (a folder Dataset: its folder)."""
        return str(self.split_dir)  # type: ignore[attr-defined]

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if isinstance(index, SeededIndex):  # a ResumableSampler's: the sample's randomness from its own seed
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(index.seed)
                return self.fetch(index)
        return self.fetch(index)

    def fetch(self, index: int, out: Any = None) -> tuple[Any, ...]:
        """The sample at ``index`` (its image written into ``out`` when given), or under
        ``bad_files="skip"`` the next readable one."""
        load = self.load if out is None else functools.partial(self.load, out=out)
        if self.bad_files == "raise":
            return load(index)
        n = len(self)
        limit = min(max(_MAX_SKIPS_IN_A_ROW, n // 100), n)  # a broken folder of 60 in a million is skipped too
        known = self.__dict__.setdefault("_known_bad", set())  # this process's: each is loaded once, not per walk
        for attempt in range(limit):
            i = (index + attempt) % n
            if attempt and i in known:
                continue
            try:
                sample = load(i)
                known.discard(i)  # readable again (a file fixed during the run)
                return sample
            except BadImageError as err:
                known.add(i)
                if attempt == 0:  # a stand-in that fails is reported at its own place in the epoch: once
                    name = self.sample_name(i)
                    self.skip(name, getattr(err, "reason", None) or unreadable(err.__cause__ or err, name))
        run = f"all {n} {self.what}s are unreadable" if limit == n else \
            f"{limit} unreadable {self.what}s in a row from {printable(self.sample_name(index))}"
        raise BadImageError(f"{self.source_name}: {run}; the data is not usable as it is: fix or remove them (a "
                            "folder's are all listed by 'cltrain-data-check ROOT', for exclude_files=<that list>).")

    threads: int = 1

    def start_batch(self, load: Callable[..., Any], indices: Sequence[Any], augment: Callable[[Any], Any] | None = None,
                    refetch: Callable[[Any], Any] | None = None) -> Callable[[], list[Any]]:
        """``load`` each of ``indices`` on ``threads`` decode threads (``cltrain.data.loader_threads.start_batch``;
        calling the result waits for them) under the policy: a sample whose ``load`` raises ``BadImageError``
        raises it under ``"raise"``; under ``"skip"`` it is fetched again in the calling thread by ``refetch``
        (default ``fetch``: the next readable sample, reported)."""
        fallback = (refetch or self.fetch) if self.bad_files == "skip" else None
        return start_batch(load, indices, self.threads, augment, retry=BadImageError, fallback=fallback)

    def skip(self, name: str, reason: str) -> None:
        """Report sample ``name`` as skipped: a line in ``skip_log`` and a warning once per sample and process."""
        reason = reason.replace("\t", " ").replace("\n", " ")
        if self.skip_log is not None:
            # one short line per write: atomic with O_APPEND; a name that is not UTF-8 (a file named on another
            # system) kept as its bytes, so the list names it
            with open(self.skip_log, "a", encoding="utf-8", errors="surrogateescape") as f:
                f.write(f"{self.split_name}\t{name}\t{reason}\n")
        else:
            self._unlisted.setdefault(name, reason)  # listed if a list is given later (list_skips_in)
        if name not in self._warned:
            self._warned.add(name)
            said = name if name.startswith(f"{self.what} ") else f"{self.what} {name}"  # "item 15", not "item item 15"
            log.warning("skipping unreadable %s (%s)", printable(said), reason)


class NamedSplit:
    """How a split of a dataset in rows (an engine's items, an MDS dataset, a stream of shards) names itself and its
    samples: ``where`` (the dataset, without secrets) and ``split`` set by the Dataset; a sample is ``<what>
    <index>``."""

    where: str
    split: str
    what = "sample"

    def sample_name(self, index: int) -> str:
        """``<what> <index>``."""
        return f"{self.what} {index}"

    @property
    def split_name(self) -> str:
        """The split, as the skipped-files list names it."""
        return self.split

    @property
    def source_name(self) -> str:
        """The dataset and split, for errors."""
        return f"{self.where} ({self.split})"

    def unreadable_message(self, index: int, reason: str) -> str:
        """The one line of ``BadImageError`` for sample ``index``."""
        return (f"{self.source_name} {self.sample_name(index)}: cannot be read as an image ({reason}). Pass "
                f"bad_files='skip' to leave such {self.what}s out, or write the dataset again.")
