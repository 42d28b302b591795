"""Pack an ImageNet-layout folder into WebDataset shards that ``ShardsDataModule`` reads.

::

    python -m cltrain.data.pack /data/imagenet /data/imagenet-shards --shard-size 1000

``ROOT/{train,val}/<class>/<image>`` becomes::

    OUT/train/shard-000000.tar        # WebDataset tar: <key>.jpg (the file's own bytes), <key>.cls (label),
                                      #   <key>.path (the path of the file it was packed from)
    OUT/train/shard-000000.idx.npy    # int64 (n, 5): image offset, size, label, path offset, size in the tar
    OUT/train/shard-000000.skipped.tsv  # the shard's files the check found unreadable (only if any)
    OUT/val/...
    OUT/skipped_files.tsv             # every file left out: split<TAB>path<TAB>reason (as cltrain-data-check)
    OUT/shards.json                   # written last: classes, shards (each one's bytes and index digest), counts
    OUT/.cltrain_pack.json            # what is being packed (root, shard size, seed, check, a fingerprint of the tree)

Every file is checked as it is packed, by the check of ``cltrain-data-check`` (``--check full``, the
default: decoded whole with the loader's ``--decoder``; ``quick``: headers and end markers; ``off``),
on ``--workers`` processes that read each file once and hand its bytes on. A file that fails (empty,
not an image, truncated, over Pillow's pixel limit, a link to nothing) is left out and listed with
its path and reason. Hidden and system entries (``.DS_Store``, ``.ipynb_checkpoints``, ``Thumbs.db``)
are not packed; links are followed (each real file once).

The image bytes are stored as they are on disk (no re-encoding), so decoding a
shard gives the same pixels as decoding the file. The samples of a split are
shuffled once (``--seed``) before packing, so every shard holds every class.
The tars are plain WebDataset shards (``webdataset.WebDataset(urls)`` reads
them); the ``.idx.npy`` files let the reader fetch any sample directly, which is
how it gives each sample exactly once per epoch under DDP x workers, and name a bad
sample by the file it came from.

Resumable: every file is written atomically (a temporary file renamed when complete), and a
shard's index after its tar and its list of skipped files, so a killed pack, run again with the
same arguments, keeps every finished shard (checked), removes the killed one's temporary files and
continues with the next shard. It never overwrites: a non-empty ``OUT`` that is not this pack's own
(unfinished or finished) output is refused, and so is a tree that changed since the pack started.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cltrain.atomic import atomic_open, atomic_write_json, remove_leftovers, removed_line
from cltrain.data.constants import CHECK_MODES, is_hidden
from cltrain.data.decoders import DECODER_NAMES, get_decoder
from cltrain.data.image_folder_dataset import find_classes, find_samples
from cltrain.data.remote import is_url, redact
from cltrain.data.shard_dataset import MANIFEST
from cltrain.data.shard_source import index_digest
from cltrain.data.shard_writer import CheckedReader, write_shard
from cltrain.data.errors import MissingDataError

__all__ = ["MANIFEST", "PACK_STATE", "SKIPPED_LIST", "PackError", "pack", "shard_name"]

#: Written first: marks ``OUT`` as this pack's own, with what it packs.
PACK_STATE = ".cltrain_pack.json"
#: Every file the check left out, ``split<TAB>path<TAB>reason`` (written before the manifest).
SKIPPED_LIST = "skipped_files.tsv"
#: 2: each sample's source path stored, files checked as packed. Packs of version 1 are still read.
FORMAT_VERSION = 2


class PackError(RuntimeError):
    """The pack cannot start or continue (the message says why and what to do)."""


def shard_name(index: int) -> str:
    """File stem of shard ``index``: ``shard-000123``."""
    return f"shard-{index:06d}"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # a link to nothing: the check lists it
        return -1


def _fingerprint(root: Path, samples: Sequence[tuple[str, int]]) -> str:
    """A hash of the relative paths, sizes and labels: a tree that changed gives another one."""
    h = hashlib.sha256()
    for path, label in samples:
        h.update(f"{os.path.relpath(path, root)}\0{_size(path)}\0{label}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _plan(root: Path, splits: Sequence[str], seed: int) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
    missing = [s for s in splits if not (root / s).is_dir()]
    if missing:
        have = sorted(p.name for p in root.iterdir() if not is_hidden(p.name) and p.is_dir())
        raise MissingDataError(f"pack: ROOT {root} has no split folder {', '.join(missing)}; it has {have}. "
                                "Pass the ones to pack with --splits.")
    classes = find_classes(root / splits[0])
    plan = {}
    for split in splits:
        samples = find_samples(root / split, classes, require_all=split == splits[0])
        random.Random(f"{seed}/{split}").shuffle(samples)
        plan[split] = samples
    return classes, plan


def _claim(out: Path, state: dict) -> bool:
    """Make ``out`` this pack's own, or check it is. ``True``: the pack there is complete."""
    marker = out / PACK_STATE
    if out.exists() and not out.is_dir():
        raise PackError(f"pack: OUT {out} exists and is not a folder; pass a new folder.")
    if marker.is_file():
        mine = json.loads(marker.read_text())
        if mine != state:
            diff = sorted(k for k in state if mine.get(k) != state[k])
            raise PackError(f"pack: {out} holds a pack of other settings or of a changed tree (differs in {', '.join(diff)}); "
                            "it is left untouched. Pass a new OUT, or the arguments it was started with.")
        return (out / MANIFEST).is_file()
    if out.is_dir() and any(out.iterdir()):
        raise PackError(f"pack: OUT {out} is not empty and is not a cltrain pack; it is left untouched. Pass a new or empty folder.")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(marker, state, indent=1)
    return False


def _remove_leftovers(folders: Sequence[Path]) -> None:
    """The temporary files a killed pack left (a shard, an index, the manifest being written)."""
    for folder in folders:
        removed = remove_leftovers(folder)
        if removed:
            print(f"pack: {removed_line(removed, 'a pack that was stopped')}", file=sys.stderr)


def _skip_lines(split: str, skipped: Sequence[tuple[str, str]]) -> str:
    return "".join(f"{split}\t{p}\t{r}\n" for p, r in skipped)


def pack(root: str | os.PathLike, out: str | os.PathLike, shard_size: int = 1000, splits: Sequence[str] = ("train", "val"),
         seed: int = 0, progress: bool = True, check: str = "full", workers: int = 0, decoder: str = "auto") -> Path:
    """Pack ``root``'s splits into shards under ``out`` (see the module docstring); returns the manifest's path.

    Args:
        check: ``"full"``, ``"quick"`` or ``"off"``: the check every file gets as it is packed.
        workers: processes that read and check the files (0: this one).
        decoder: the JPEG decoder the full check decodes with (the loader's, ``cltrain.data.decoders``).

    Raises:
        PackError: ``out`` is not empty and not this pack's own, or was started with other
            arguments or on a tree that changed since.
        FileNotFoundError, ValueError: ``root`` is not an ImageNet-layout folder, or a bad argument.
    """
    from tqdm.auto import tqdm

    try:
        import webdataset  # noqa: F401 - the shards' writer (the `shards` extra), asked before anything is written
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("pack needs webdataset: pip install 'cltrain[shards]'", name=err.name) from None
    if not (isinstance(shard_size, int) and shard_size >= 1):
        raise ValueError(f"pack: shard_size={shard_size!r} must be an int >= 1.")
    if check not in CHECK_MODES:
        raise ValueError(f"pack: check={check!r} must be one of {CHECK_MODES}.")
    if not (isinstance(workers, int) and workers >= 0):
        raise ValueError(f"pack: workers={workers!r} must be an int >= 0.")
    get_decoder(decoder)  # an unknown or missing back end: a one-line ValueError now
    if is_url(root):
        raise ValueError(f"pack: ROOT {redact(str(root))} is a URL; pack reads a local folder: download the images, "
                         "or pack where they are and upload OUT.")
    if is_url(out):
        raise ValueError(f"pack: OUT {redact(str(out))} is a URL; pack writes a local folder: pack to one, then upload "
                         "it as it is (e.g. aws s3 sync OUT s3://bucket/pack).")
    root, out = Path(root).resolve(), Path(out)
    if not root.is_dir():
        raise MissingDataError(f"pack: ROOT {root} is not a folder; pass an ImageNet-layout folder (train/<class>/...).")
    classes, plan = _plan(root, list(splits), seed)
    state = {"version": FORMAT_VERSION, "root": str(root), "shard_size": shard_size, "splits": list(splits), "seed": seed,
             "check": check, "decoder": decoder if check == "full" else None,
             "fingerprint": {s: _fingerprint(root, plan[s]) for s in splits}}
    _remove_leftovers([out, *(out / s for s in splits)])
    if _claim(out, state):
        return out / MANIFEST
    manifest: dict = {"format": "webdataset", "version": FORMAT_VERSION, "classes": classes, "check": check, "splits": {}}
    skipped_lines = []
    reader = CheckedReader(check, decoder, workers)
    try:
        for split, samples in plan.items():
            folder = out / split
            folder.mkdir(exist_ok=True)
            chunks = [samples[i:i + shard_size] for i in range(0, len(samples), shard_size)]
            stems = [folder / shard_name(k) for k in range(len(chunks))]
            done = [stem.with_suffix(".idx.npy").is_file() and stem.with_suffix(".tar").is_file() for stem in stems]
            todo = [k for k in range(len(chunks)) if not done[k]]
            started = {}
            with tqdm(total=len(samples), initial=sum(len(c) for c, d in zip(chunks, done) if d), unit="img",
                      desc=f"pack {split}", disable=not progress) as bar:
                for n, k in enumerate(todo):
                    for ahead in todo[n:n + 2]:  # the next shard's files are read while this one is written
                        if ahead not in started:
                            started[ahead] = reader.start([p for p, _ in chunks[ahead]])
                    index, skipped = write_shard(stems[k].with_suffix(".tar"), chunks[k], k * shard_size, started.pop(k))
                    if skipped:  # before the index, which marks the shard finished
                        with atomic_open(stems[k].with_suffix(".skipped.tsv"), "w") as f:
                            f.write(_skip_lines(split, skipped))
                    with atomic_open(stems[k].with_suffix(".idx.npy")) as f:
                        np.save(f, index, allow_pickle=False)
                    bar.update(len(chunks[k]))
            indexes = [np.load(stem.with_suffix(".idx.npy")) for stem in stems]  # kilobytes each
            counts = [len(index) for index in indexes]
            lines = "".join(stem.with_suffix(".skipped.tsv").read_text(encoding="utf-8")
                            for stem in stems if stem.with_suffix(".skipped.tsv").is_file())
            skipped_lines.append(lines)
            manifest["splits"][split] = {"count": sum(counts), "skipped": lines.count("\n"),
                                         "shards": [f"{split}/{stem.name}.tar" for stem in stems],
                                         # what each shard was made as: a shard or index replaced since is said
                                         "bytes": [stem.with_suffix(".tar").stat().st_size for stem in stems],
                                         "index_sha256": [index_digest(index) for index in indexes]}
    finally:
        reader.close()
    with atomic_open(out / SKIPPED_LIST, "w") as f:
        f.write("# split\tpath\treason\n" + "".join(skipped_lines))
    return atomic_write_json(out / MANIFEST, manifest, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cltrain.data.pack ROOT OUT [--shard-size N] [--splits train val] [--seed S] [--check full]
    [--workers N]``."""
    script = os.path.basename(sys.argv[0])  # cltrain-... where the console script runs it
    parser = argparse.ArgumentParser(prog=script if script.startswith("cltrain-") else "python -m cltrain.data.pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="ImageNet-layout folder: ROOT/<split>/<class>/<image>")
    parser.add_argument("out", help="new (or empty) folder for the shards; run again with the same arguments to resume")
    parser.add_argument("--shard-size", type=int, default=1000, help="images per shard (default 1000)")
    parser.add_argument("--splits", nargs="+", default=["train", "val"], help="splits to pack; the first one names the classes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the order the samples are packed in")
    parser.add_argument("--check", choices=CHECK_MODES, default="full",
                        help="the check of every file as it is packed, as cltrain-data-check's (default: %(default)s)")
    parser.add_argument("--decoder", choices=DECODER_NAMES, default="auto",
                        help="the JPEG decoder of the loader, which the full check decodes with (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes that read and check the files (default: all CPUs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        manifest = pack(args.root, args.out, args.shard_size, args.splits, args.seed, progress=not args.no_progress,
                        check=args.check, workers=args.workers, decoder=args.decoder)
    except (PackError, FileNotFoundError, ValueError) as err:
        print(str(err), file=sys.stderr)
        return 2
    counts = json.loads(manifest.read_text())["splits"]
    skipped = sum(c.get("skipped", 0) for c in counts.values())
    left_out = f"; {skipped} unreadable file(s) left out, listed in {manifest.parent / SKIPPED_LIST}" if skipped else ""
    print(f"pack: {manifest.parent} complete: " + ", ".join(f"{s} {c['count']} images in {len(c['shards'])} shards"
                                                           for s, c in counts.items()) + left_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
