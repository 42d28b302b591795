"""Pack an ImageNet-layout folder into WebDataset shards that ``ShardsDataModule`` reads.

::

    python -m cltrain.data.pack /data/imagenet /data/imagenet-shards --shard-size 1000

``ROOT/{train,val}/<class>/<image>`` becomes::

    OUT/train/shard-000000.tar        # WebDataset tar: <key>.jpg (the file's own bytes), <key>.cls (label)
    OUT/train/shard-000000.idx.npy    # int64 (n, 3): data offset, size, label of each image in the tar
    OUT/val/...
    OUT/shards.json                   # written last: classes, shards and counts per split
    OUT/.cltrain_pack.json            # what is being packed (root, shard size, seed, a fingerprint of the tree)

The image bytes are stored as they are on disk (no re-encoding), so decoding a
shard gives the same pixels as decoding the file. The samples of a split are
shuffled once (``--seed``) before packing, so every shard holds every class.
The tars are plain WebDataset shards (``webdataset.WebDataset(urls)`` reads
them); the ``.idx.npy`` files let the reader fetch any sample directly, which is
how it gives each sample exactly once per epoch under DDP x workers.

Resumable: every file is written atomically (a temporary file renamed when complete), and a
shard's index after its tar, so a killed pack, run again with the same arguments, keeps every
finished shard, removes the killed one's temporary files and continues with the next shard. It never overwrites:
a non-empty ``OUT`` that is not this pack's own (unfinished or finished) output is
refused, and so is a tree that changed since the pack started.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cltrain.atomic import atomic_open, atomic_write_json, remove_leftovers, removed_line
from cltrain.data.image_folder_dataset import find_classes, find_samples
from cltrain.data.shard_dataset import MANIFEST

__all__ = ["MANIFEST", "PACK_STATE", "PackError", "pack", "shard_name"]

#: Written first: marks ``OUT`` as this pack's own, with what it packs.
PACK_STATE = ".cltrain_pack.json"
FORMAT_VERSION = 1


class PackError(RuntimeError):
    """The pack cannot start or continue (the message says why and what to do)."""


def shard_name(index: int) -> str:
    """File stem of shard ``index``: ``shard-000123``."""
    return f"shard-{index:06d}"


def _fingerprint(root: Path, samples: Sequence[tuple[str, int]]) -> str:
    """A hash of the relative paths, sizes and labels: a tree that changed gives another one."""
    h = hashlib.sha256()
    for path, label in samples:
        h.update(f"{os.path.relpath(path, root)}\0{os.path.getsize(path)}\0{label}\n".encode())
    return h.hexdigest()


def _plan(root: Path, splits: Sequence[str], seed: int) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
    missing = [s for s in splits if not (root / s).is_dir()]
    if missing:
        have = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise FileNotFoundError(f"pack: ROOT {root} has no split folder {', '.join(missing)}; it has {have}. "
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


def _write_shard(path: Path, samples: Sequence[tuple[str, int]], first_key: int) -> np.ndarray:
    """Write one tar (atomically) and return its index: (data offset, size, label) per image."""
    import webdataset as wds  # the `shards` extra; only packing needs it

    with atomic_open(path) as f:
        writer = wds.TarWriter(f, mtime=0.0)
        for i, (src, label) in enumerate(samples):
            ext = Path(src).suffix.lower().lstrip(".") or "img"
            with open(src, "rb") as img:
                writer.write({"__key__": f"{first_key + i:09d}", ext: img.read(), "cls": str(label).encode()})
        writer.close()
    index = np.zeros((len(samples), 3), np.int64)
    with tarfile.open(path) as tar:  # read the offsets back from the tar itself; the shard counts once its index exists
        members = [m for m in tar.getmembers() if not m.name.endswith(".cls")]
    if len(members) != len(samples):
        raise PackError(f"pack: {path} has {len(members)} images, expected {len(samples)}; delete it and run again.")
    for i, (m, (_, label)) in enumerate(zip(members, samples)):
        index[i] = (m.offset_data, m.size, label)
    return index


def pack(root: str | os.PathLike, out: str | os.PathLike, shard_size: int = 1000, splits: Sequence[str] = ("train", "val"),
         seed: int = 0, progress: bool = True) -> Path:
    """Pack ``root``'s splits into shards under ``out`` (see the module docstring); returns the manifest's path.

    Raises:
        PackError: ``out`` is not empty and not this pack's own, or was started with other
            arguments or on a tree that changed since.
        FileNotFoundError, ValueError: ``root`` is not an ImageNet-layout folder.
    """
    from tqdm.auto import tqdm

    if not (isinstance(shard_size, int) and shard_size >= 1):
        raise ValueError(f"pack: shard_size={shard_size!r} must be an int >= 1.")
    root, out = Path(root).resolve(), Path(out)
    if not root.is_dir():
        raise FileNotFoundError(f"pack: ROOT {root} is not a folder; pass an ImageNet-layout folder (train/<class>/...).")
    classes, plan = _plan(root, list(splits), seed)
    state = {"version": FORMAT_VERSION, "root": str(root), "shard_size": shard_size, "splits": list(splits), "seed": seed,
             "fingerprint": {s: _fingerprint(root, plan[s]) for s in splits}}
    _remove_leftovers([out, *(out / s for s in splits)])
    if _claim(out, state):
        return out / MANIFEST
    manifest: dict = {"format": "webdataset", "version": FORMAT_VERSION, "classes": classes, "splits": {}}
    for split, samples in plan.items():
        folder = out / split
        folder.mkdir(exist_ok=True)
        chunks = [samples[i:i + shard_size] for i in range(0, len(samples), shard_size)]
        done = [(folder / f"{shard_name(k)}.idx.npy").is_file() and (folder / f"{shard_name(k)}.tar").is_file()
                for k in range(len(chunks))]
        with tqdm(total=len(samples), initial=sum(len(c) for c, d in zip(chunks, done) if d), unit="img",
                  desc=f"pack {split}", disable=not progress) as bar:
            for k, chunk in enumerate(chunks):
                if done[k]:
                    continue
                index = _write_shard(folder / f"{shard_name(k)}.tar", chunk, k * shard_size)
                with atomic_open(folder / f"{shard_name(k)}.idx.npy") as f:  # last: marks the shard finished
                    np.save(f, index, allow_pickle=False)
                bar.update(len(chunk))
        manifest["splits"][split] = {"count": len(samples), "shards": [f"{split}/{shard_name(k)}.tar" for k in range(len(chunks))]}
    return atomic_write_json(out / MANIFEST, manifest, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cltrain.data.pack ROOT OUT [--shard-size N] [--splits train val] [--seed S]``."""
    parser = argparse.ArgumentParser(prog="python -m cltrain.data.pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="ImageNet-layout folder: ROOT/<split>/<class>/<image>")
    parser.add_argument("out", help="new (or empty) folder for the shards; run again with the same arguments to resume")
    parser.add_argument("--shard-size", type=int, default=1000, help="images per shard (default 1000)")
    parser.add_argument("--splits", nargs="+", default=["train", "val"], help="splits to pack; the first one names the classes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the order the samples are packed in")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        manifest = pack(args.root, args.out, args.shard_size, args.splits, args.seed, progress=not args.no_progress)
    except (PackError, FileNotFoundError, ValueError) as err:
        print(str(err), file=sys.stderr)
        return 2
    counts = json.loads(manifest.read_text())["splits"]
    print(f"pack: {manifest.parent} complete: " + ", ".join(f"{s} {c['count']} images in {len(c['shards'])} shards"
                                                           for s, c in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
