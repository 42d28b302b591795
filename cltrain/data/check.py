"""Find the unreadable files of an image folder before training: ``python -m cltrain.data.check ROOT``.

Checks every image file of ``ROOT/train`` and ``ROOT/val`` (or of ``ROOT`` itself
when it has neither) in parallel worker processes, with a progress bar, and writes
the bad ones as ``split<TAB>path<TAB>reason`` lines (the format of
``skipped_files.tsv``). Exit status 1 when there are bad files, 0 when none, 2 for
a bad argument. Give the list to the training to leave those files out from the
start: ``ImageFolderDataModule(root, exclude_files="bad_files.tsv")``.

Two depths (``--quick``):

* full (default): decodes every pixel as the loader does, with its JPEG decoder
  (``--decoder``, ``cltrain.data.decoders``): a JPEG that back end reads is decoded whole
  by it, and when it refuses the data (a corrupt stream), by Pillow, as the loader falls
  back; every other file (and every file with ``--decoder pillow``) by Pillow. A file is
  bad when the loader with that decoder would fail on it. About ten times the quick
  check's cost.
* quick: a zero-byte file; a header Pillow cannot parse (not an image, unknown
  format, a broken header); a JPEG without its end-of-image marker in the last
  4 KiB (a truncated download: the usual damage); a PNG whose chunk CRCs or
  length fail Pillow's ``verify``. It does not catch corrupt compressed data
  inside a complete JPEG, nor a truncated BMP/TIFF/WebP/PPM. This is what
  ``ImageFolderDataModule`` runs on the validation split in
  ``setup`` (``check_val="quick"``), so a bad validation file stops the run
  before the first training epoch rather than after it.

``check_bytes`` gives the same verdict on a file's bytes already read (``cltrain-pack`` reads each
file once, checks it, and packs the same bytes).

Example::

    python -m cltrain.data.check /data/imagenet --workers 8 --out bad_files.tsv
    cltrain-data-check /data/imagenet --decoder pillow       # as a loader with decoder="pillow" reads
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import BinaryIO

from PIL import Image

from cltrain.atomic import atomic_write_bytes
from cltrain.data.bad_samples import unreadable
from cltrain.data.constants import CHECK_MODES
from cltrain.data.crop_kernels import check_pixels
from cltrain.data.decoders import DECODER_NAMES, Decoder, get_decoder, jpeg_ends
from cltrain.data.index import index_split
from cltrain.data.remote import is_url, redact

__all__ = ["CHECK_MODES", "check_bytes", "check_file", "check_files", "main"]

# A full decode costs about ten times the quick check (docs/guides/data.md), so setup runs the quick one.


def check_file(path: str, full: bool = False, decoder: str = "auto") -> str | None:
    """``None`` if ``path`` reads as an image, else the reason (one line). ``full`` decodes every pixel
    with ``decoder`` (see the module docstring; ``ValueError`` for a name ``get_decoder`` refuses)."""
    backend = get_decoder(decoder) if full else None
    try:
        with open(path, "rb") as f:
            return _check_stream(f, os.fstat(f.fileno()).st_size, full, backend)
    except Exception as err:  # any failure to open this one file
        return unreadable(err, path)


def check_bytes(data: bytes, full: bool = True, decoder: str = "auto") -> str | None:
    """``check_file``'s verdict on a file's bytes (read once by whoever also stores them: ``cltrain.data.pack``)."""
    return _check_stream(io.BytesIO(data), len(data), full, get_decoder(decoder) if full else None)


def _check_stream(f: BinaryIO, size: int, full: bool, backend: Decoder | None) -> str | None:
    try:
        if size == 0:
            return "empty file (0 bytes)"
        if full:
            data = f.read()
            if backend is not None and _decodes(backend, data):
                return None
            with Image.open(io.BytesIO(data)) as img:
                img.load()
            return None
        with Image.open(f) as img:
            fmt = img.format
            if fmt == "PNG":
                try:
                    img.verify()
                except Exception:  # verify() wants every chunk whole (IEND, ancillary CRCs after the pixels);
                    f.seek(0)      # the loader's Image.load() does not: its verdict decides, for these files only
                    with Image.open(f) as again:
                        again.load()
        if fmt in ("JPEG", "MPO") and not jpeg_ends(f, size):
            return "JPEG without its end-of-image marker (truncated?)"
        return None
    except Exception as err:  # any failure to parse or decode this one file
        return unreadable(err)


def _decodes(backend: Decoder, data: bytes) -> bool:
    """Whether ``backend`` decodes the whole of ``data``; ``False`` for a file it does not read or
    whose data it refuses, which the loader hands to Pillow (Pillow's verdict is then the one).

    Raises:
        PIL.Image.DecompressionBombError: the image is over Pillow's pixel limit, which the loader applies too.
    """
    header = backend.header(data)
    if header is None:
        return False
    check_pixels((header.width, header.height), "image")
    try:
        backend.decode(data, header)
    except ValueError:
        return False
    return True


def _check(path: str, full: bool, decoder: str) -> tuple[str, str | None]:
    return path, check_file(path, full, decoder)


def check_files(paths: Sequence[str], mode: str = "quick", workers: int = 0, progress: bool = False,
                decoder: str = "auto") -> dict[str, str]:
    """``{path: reason}`` of the bad files among ``paths``.

    Args:
        paths: the files.
        mode: ``"full"`` (decode) or ``"quick"`` (see the module docstring); ``"off"`` checks nothing.
        workers: processes to check in (0: this process).
        progress: show a tqdm progress bar (on stderr).
        decoder: the loader's JPEG decoder (``DECODER_NAMES``), which the full check decodes with.

    Raises:
        ValueError: an unknown ``mode``, or a ``decoder`` that ``get_decoder`` refuses.
    """
    if mode not in CHECK_MODES:
        raise ValueError(f"check mode {mode!r} must be one of {CHECK_MODES}.")
    get_decoder(decoder)  # a bad name fails here, not in every worker
    if mode == "off" or not paths:
        return {}
    fn: Callable[[str], tuple[str, str | None]] = partial(_check, full=mode == "full", decoder=decoder)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(paths), unit="file", desc=f"checking ({mode})", file=sys.stderr, dynamic_ncols=True)
    bad: dict[str, str] = {}

    def consume(results: Iterable[tuple[str, str | None]]) -> None:
        for path, reason in results:
            if reason is not None:
                bad[path] = reason
            if bar is not None:
                bar.update(1)

    try:
        if workers > 0 and len(paths) > 1:
            chunk = max(1, min(256, len(paths) // (workers * 8)))
            with multiprocessing.get_context().Pool(workers) as pool:
                consume(pool.imap_unordered(fn, paths, chunksize=chunk))
        else:
            consume(map(fn, paths))
    finally:
        if bar is not None:
            bar.close()
    return bad


def _splits(root: Path) -> list[tuple[str, Path]]:
    named = [(s, root / s) for s in ("train", "val") if (root / s).is_dir()]
    return named or [(root.name, root)]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    script = os.path.basename(sys.argv[0])  # cltrain-... where the console script runs it
    parser = argparse.ArgumentParser(prog=script if script.startswith("cltrain-") else "python -m cltrain.data.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="folder with train/ and val/ (or one split folder of <class>/<image>)")
    parser.add_argument("--out", default="bad_files.tsv", help="where to write the bad files (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all CPUs)")
    parser.add_argument("--quick", action="store_true", help="header and end-marker checks only, no decode")
    parser.add_argument("--decoder", choices=DECODER_NAMES, default="auto",
                        help="the JPEG decoder of the loader, which the full check decodes with (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if is_url(args.root):
        print(f"cltrain.data.check: {redact(args.root)} is a URL; the check reads a local folder: check the folder "
              "before it is uploaded, or pack it (cltrain-pack checks every file as it packs).", file=sys.stderr)
        return 2
    root = Path(args.root).absolute()  # the list names each file from /: the run that reads it may start elsewhere
    if not root.is_dir():
        print(f"cltrain.data.check: {root} is not a folder.", file=sys.stderr)
        return 2
    if args.workers < 0:
        print(f"cltrain.data.check: --workers={args.workers} must be >= 0.", file=sys.stderr)
        return 2
    try:
        get_decoder(args.decoder)  # a back end not installed here: ValueError
        listed = [(split, index_split(folder, allow_missing=True).samples) for split, folder in _splits(root)]
    except (OSError, ValueError) as err:
        print(f"cltrain.data.check: {err}", file=sys.stderr)
        return 2
    split_of = {path: split for split, samples in listed for path, _ in samples}
    mode = "quick" if args.quick else "full"
    start = time.perf_counter()
    bad = check_files(list(split_of), mode, args.workers, progress=not args.no_progress, decoder=args.decoder)
    elapsed = time.perf_counter() - start
    out = Path(args.out)
    lines = ["# split\tpath\treason\n"] + [f"{split_of[path]}\t{path}\t{bad[path]}\n" for path in sorted(bad)]
    # a list the user trains with: never half-written; a name that is not UTF-8 kept as its bytes
    atomic_write_bytes(out, "".join(lines).encode("utf-8", "surrogateescape"))
    rate = len(split_of) / elapsed if elapsed > 0 else float("inf")
    print(f"cltrain.data.check: {len(split_of)} files checked ({mode}) in {elapsed:.1f} s ({rate:.0f} files/s); "
          f"{len(bad)} bad, listed in {out}" + (f"; train with exclude_files={str(out)!r}"
                                                     " (the app's data.exclude_files) to leave them out." if bad else "."))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
