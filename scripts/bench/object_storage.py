"""Training from object storage: images/s into normalised NHWC batches from a local S3 endpoint (moto) against the
local disk, WebDataset, LitData and Mosaic Streaming; and shards against the same images as files (the cases:
docs/benchmarks.md#object-storage).

    python -m scripts.bench.object_storage                    # 2,400 photographs in 24 shards, 3 rounds
    python -m scripts.bench.object_storage --workers 1        # one worker per loader (decode threads: the loading plan)
    python -m scripts.bench.object_storage --workers auto     # each loader's default: ours the loading plan, peers a worker per core
    python -m scripts.bench.object_storage --clients          # fsspec (s3fs) against obstore: whole shards, ranges
    python -m scripts.bench.object_storage --cases local s3-cold litdata mosaic   # ours against LitData's and Mosaic's
    python -m scripts.bench.object_storage --cases files local --paired 60        # shards against files
    python -m scripts.bench.object_storage --cases files local --paired 60 --root /data/imagenet-subset --pack /data/pack
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cltrain.data import IMAGENET_MEAN, IMAGENET_STD, ImageFolderDataModule, ShardsDataModule
from cltrain.data.loader_threads import usable_cores
from scripts.bench.loaders import torchvision_train
from scripts.bench.photo_folder import make_photo_folder
from scripts.harness import cpu_seconds, interleaved, machine_line, options, spread, table, timed

KW = dict(batch_size=64, num_workers=2, image_size=224, persistent_workers=False)
#: The folder's validation files go unchecked, as a pack's were when it was made: the same work for both.
FILES_ONLY = {"check_val": "off"}
PEER_WORKERS = [2]  # WebDataset's, LitData's and Mosaic's DataLoader workers: ours, or one per core for ours "auto"
_SERVER: list[int] = []  # the S3 server's process, once it runs
PEERS = ("webdataset", "wds-fsspec", "litdata", "mosaic")  #: the other loaders' cases, each against s3-cold


def _server() -> subprocess.Popen:
    """moto's S3 server in a process of its own on a free port, and the standard variables pointing at it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"  # S3_ENDPOINT_URL: the variable Mosaic's S3 downloader reads
    os.environ.update(AWS_ENDPOINT_URL=endpoint, S3_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:  # not up yet
            time.sleep(0.1)
    return proc


def _upload(folder: Path, prefix: str) -> str:
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="bench")
    for q in sorted(folder.rglob("*"), key=lambda q: q.name == "shards.json"):  # the manifest last
        if q.is_file():
            client.upload_file(str(q), "bench", f"{prefix}/{q.relative_to(folder).as_posix()}")
    return f"s3://bench/{prefix}"


def _mib(folder: Path) -> float:
    return sum(q.stat().st_size for q in folder.rglob("*") if q.is_file()) / 2**20


def _costed(fn: Callable[[], Any], whose: tuple = ("self",)) -> tuple[Any, float, list[float]]:
    """What ``fn()`` returns, its wall seconds, and the CPU seconds each of ``whose`` (``cpu_seconds``) used."""
    before, got = [cpu_seconds(of) for of in whose], []
    seconds = timed(lambda: got.append(fn()))
    return got[0], seconds, [cpu_seconds(of) - b for of, b in zip(whose, before)]


def _rate(loader: Any) -> tuple[float, list[float]]:
    """Images/s over a whole pass, from asking for the first batch (workers start, first shards come) to the last,
    and the CPU seconds of that time: this process (fetches ahead, batches in), its workers (decoding; joined when
    the pass ends), the server (0 where none runs)."""
    images, seconds, used = _costed(lambda: sum(b[0].shape[0] for b in loader), ("self", "children", *_SERVER))
    return images / seconds, used + [0.0] * (3 - len(used))


def _ours(root: str | Path, files: bool = False, **options: Any) -> tuple[float, list[float]]:
    """A pass of cltrain's training loader: ``ShardsDataModule`` on a pack, or with ``files`` ``ImageFolderDataModule``
    on its folder."""
    dm = (ImageFolderDataModule(root, **KW, **FILES_ONLY) if files
          else ShardsDataModule(root, **KW, shuffle_window=4, **options))
    dm.setup("fit")
    return _rate(dm.train_dataloader())


def paired_ratio(root: Path, pack: Path, batches: int) -> tuple[float, float, float]:
    """Median, lower and upper quartile of per-batch (files seconds / shards seconds): in this process at one thread,
    the same samples of each batch with the same crops read, decoded and collated from the folder and from its pack,
    alternately, the batches checked equal (the loaders' workers and a shared machine's noise aside)."""
    settings = {**KW, "num_workers": 0}
    files, shards = ImageFolderDataModule(root, **settings, **FILES_ONLY), ShardsDataModule(pack, **settings)
    files.setup("fit")
    shards.setup("fit")
    fs, hs = files.train_set, shards.train_set
    by_bytes = {hashlib.sha1(Path(path).read_bytes()).digest(): k for k, (path, _) in enumerate(fs.samples)}
    same = [by_bytes.get(hashlib.sha1(hs.read(i)).digest()) for i in range(len(hs))]  # shard sample -> its file
    differs = f"object_storage: the pack {pack} does not hold the folder's images ({root}"
    again = "; pack the folder again to another --pack."
    if None in same:
        raise SystemExit(f"{differs}: sample {same.index(None)} of its train split is not there){again}")
    rng, pending = np.random.default_rng(0), {}
    chosen = [rng.choice(len(hs), KW["batch_size"], replace=False).tolist() for _ in range(batches)]
    reads = {"files": lambda b: hs.collate(fs.__getitems__([same[i] for i in chosen[b]])),
             "shards": lambda b: hs[chosen[b]]}

    def read(kind: str, b: int) -> float:
        torch.manual_seed(b)  # the same crops from both
        batch, seconds, _ = _costed(lambda: reads[kind](b), ())
        if b not in pending:
            pending[b] = batch[0]
        elif not torch.equal(pending.pop(b), batch[0]):
            raise SystemExit(f"{differs}: a batch differs){again}")
        return seconds

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # a pair per batch, which goes first alternating
        took = interleaved({kind: functools.partial(read, kind) for kind in reads}, batches, with_round=True)
    finally:
        torch.set_num_threads(threads)
    q1, median, q3 = statistics.quantiles([f / h for f, h in zip(took["files"], took["shards"])], n=4)
    return median, q1, q3


def _fsspec_streams(shards: Any) -> Any:
    import fsspec

    for shard in shards:
        yield {**shard, "stream": fsspec.open(shard["url"]).open()}


def _webdataset(urls: list[str], fsspec: bool = False) -> tuple[float, list[float]]:
    """WebDataset's README pipeline, each tar through ``pipe:`` (``fsspec``: opened in the worker through fsspec)."""
    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander

    tail = (wds.shuffle(1000), wds.decode("pil"), wds.to_tuple("jpg", "cls"),
            wds.map_tuple(torchvision_train(224), int), wds.batched(KW["batch_size"]))
    if fsspec:
        ds = wds.DataPipeline(wds.SimpleShardList(urls), wds.shuffle(len(urls)), wds.split_by_worker, _fsspec_streams,
                              tar_file_expander, group_by_keys, *tail)
    else:  # its S3 recipe is `pipe:aws s3 cp <url> -`; no AWS CLI here: the pipe runs Python with s3fs (same variables)
        cat = (f"{sys.executable} -c 'import sys, fsspec; "
               "sys.stdout.buffer.write(fsspec.open(sys.argv[1]).open().read())'")
        ds = wds.WebDataset([f"pipe:{cat} {u}" for u in urls], shardshuffle=len(urls), empty_check=False).compose(*tail)
    return _rate(wds.WebLoader(ds, batch_size=None, num_workers=PEER_WORKERS[0]))


def _labelled(root: Path) -> list[tuple[Path, int]]:
    """The training photographs of ``root`` and their classes' indices."""
    files = sorted((root / "train").rglob("*.jpg"))
    classes = sorted({p.parent.name for p in files})
    return [(p, classes.index(p.parent.name)) for p in files]


def _lit_item(labels: dict[str, int], path: str) -> dict:
    """One optimize() item: the photograph as a PIL image (LitData stores a JPEG's own bytes) and its class."""
    from PIL import Image

    return {"image": Image.open(path), "class": labels[path]}


def _litdata_write(root: Path, out: Path) -> str:
    """The photographs ``optimize``-d into ``out`` (written locally and uploaded: LitData 0.2.76 writes to S3 through
    obstore, whose client it builds without ``allow_http``, so a plain-http endpoint is refused)."""
    import multiprocessing

    from litdata import optimize

    if not (out / "index.json").is_file():
        method = multiprocessing.get_start_method()
        labels = {str(p): label for p, label in _labelled(root)}
        try:
            optimize(fn=functools.partial(_lit_item, labels), inputs=list(labels), output_dir=str(out),
                     chunk_bytes="16MB", num_workers=2, mode="overwrite")
        finally:  # optimize() sets the process's start method to spawn: every loader here would start so
            multiprocessing.set_start_method(method, force=True)
    return _upload(out, "litdata")


try:
    from litdata import StreamingDataset as _Streaming
except ImportError:  # the `litdata` case needs it
    _Streaming = object


class _LitImages(_Streaming):  # type: ignore[misc, valid-type]
    """LitData's README ImageNet pipeline: its StreamingDataset (a JPEG decoded to a CHW tensor) + torchvision v2
    (at module level: LitData's loader may start its workers with spawn, which pickles the dataset by name)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.transforms import v2 as T

        if not hasattr(self, "tf"):
            self.tf = T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(),
                                 T.ToDtype(torch.float32, scale=True), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
        item = super().__getitem__(index)
        return self.tf(item["image"]), item["class"]


def _litdata(url: str, cache: Path) -> tuple[float, list[float]]:
    import litdata.streaming.downloader as downloader
    from litdata import StreamingDataLoader

    downloader._OBSTORE_AVAILABLE = False  # its boto3 path: obstore's client refuses http (see _litdata_write)
    shutil.rmtree(cache, ignore_errors=True)
    ds = _LitImages(url, shuffle=True, cache_dir=str(cache))
    return _rate(StreamingDataLoader(ds, batch_size=KW["batch_size"], num_workers=PEER_WORKERS[0]))


def _mosaic_write(root: Path, out: Path) -> str:
    """The photographs written by ``MDSWriter`` into ``out/train`` as Mosaic's ImageNet converter does, uploaded."""
    from PIL import Image
    from streaming import MDSWriter

    if not (out / "train" / "index.json").is_file():
        with MDSWriter(out=str(out / "train"), columns={"x": "jpeg", "y": "int"}, size_limit="16MB") as writer:
            for path, label in _labelled(root):
                writer.write({"x": Image.open(path), "y": label})
    return _upload(out, "mosaic")


def _mosaic(url: str, cache: Path) -> tuple[float, list[float]]:
    """Mosaic's ImageNet pipeline, a fresh local cache each pass; its shared memory and file locks removed after."""
    import gc

    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK
    from streaming.base.shared.prefix import _get_path
    from streaming.base.util import clean_stale_shared_memory
    from streaming.vision import StreamingImageNet
    from torch.utils.data import DataLoader

    shutil.rmtree(cache, ignore_errors=True)
    ds = StreamingImageNet(remote=url, local=str(cache), split="train", shuffle=True, batch_size=KW["batch_size"],
                           transform=torchvision_train(224))
    locks = [os.path.join(ds._filelock_root, _get_path(ds._shm_prefix_int, n))
             for n in (BARRIER_FILELOCK, CACHE_FILELOCK)]
    try:
        return _rate(DataLoader(ds, batch_size=KW["batch_size"], num_workers=PEER_WORKERS[0]))
    finally:
        del ds
        gc.collect()
        clean_stale_shared_memory()
        for lock in locks:
            Path(lock).unlink(missing_ok=True)


def _clients(url: str, names: list[str], sizes: list[tuple[int, int]]) -> None:
    """GET throughput of the shard objects through s3fs and obstore: whole shards, then each sample's range."""
    import obstore
    from obstore.store import S3Store

    from cltrain.data.remote import open_fs

    fs, _ = open_fs(url)
    prefix, env = url.split("/", 3)[3], os.environ
    store = S3Store("bench", endpoint=env["AWS_ENDPOINT_URL"], region="us-east-1", client_options={"allow_http": True},
                    access_key_id=env["AWS_ACCESS_KEY_ID"], secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    cases = {"fsspec whole": lambda: sum(len(fs.cat_file(f"{url}/{n}")) for n in names),
             "obstore whole": lambda: sum(len(obstore.get(store, f"{prefix}/{n}").bytes()) for n in names),
             "fsspec ranges": lambda: sum(len(fs.cat_file(f"{url}/{names[0]}", start=o, end=o + s)) for o, s in sizes),
             "obstore ranges": lambda: sum(len(obstore.get_range(store, f"{prefix}/{names[0]}", start=o, end=o + s))
                                           for o, s in sizes)}
    # bytes, wall seconds, and this process's CPU seconds (the client's cost on the node's cores)
    got = interleaved({k: functools.partial(_costed, f) for k, f in cases.items()}, 5)
    print(table(["client", "MiB/s (median of 5)", "client CPU ms/MiB", "requests"], [
        [k, f"{mb / spread(t for _, t, _ in runs).median:.1f}",
         f"{1000 * spread(c for _, _, (c,) in runs).median / mb:.1f}", len(sizes) if "ranges" in k else len(names)]
        for k, runs in got.items() if (mb := runs[0][0] / 2**20)], align="lrrr"))


def main(argv: list[str] | None = None) -> None:
    p = options(__doc__, train=(2400, "photographs in the training split"), shard_size=100, rounds=3, batch_size=64,
                cases=(["local", "s3-cold", "s3-warm", "s3-ranges", "webdataset", "wds-fsspec", "litdata", "mosaic"],
                       "the table's rows (also: files, the pack's images as files)"),
                paired=(0, "first, this many batches of the paired measurement of shards against files"),
                clients=(False, "only fsspec against obstore on the pack's objects"),
                work=(Path("bench_out/object_storage"),
                      "where the photographs, their pack and LitData's and Mosaic's copies are made (once) and reused"),
                root=(Path, "an ImageNet-layout folder instead of the photographs"),
                pack=(Path, "its pack (made when missing; default ROOT-pack)"))
    p.add_argument("--workers", type=lambda v: v if v == "auto" else int(v), default=2,
                   help="DataLoader workers of every loader; auto: ours the loading plan, the others one per core")
    args = p.parse_args(argv)
    if "mosaic" in args.cases and importlib.util.find_spec("streaming") is None:
        print("mosaic: skipped: mosaicml-streaming is not installed (pip install --no-deps mosaicml-streaming brotli "
              "python-snappy cramjam zstd catalogue)")
        args.cases.remove("mosaic")
    KW.update(batch_size=args.batch_size, num_workers=args.workers)
    PEER_WORKERS[0] = usable_cores() if args.workers == "auto" else args.workers
    from cltrain.data.pack import pack

    photos = args.root or make_photo_folder(args.work / f"photos-{args.train}", train=args.train, val=20)
    local = args.pack or (Path(f"{args.root}-pack") if args.root
                          else args.work / f"pack-{args.train}-{args.shard_size}")
    if not (local / "shards.json").is_file():
        pack(photos, local, shard_size=args.shard_size, progress=False)
    if args.paired:
        median, q1, q3 = paired_ratio(photos, local, args.paired)
        print(f"paired, same images and crops, {args.paired} batches in one thread: shards/files {median:.3f}x "
              f"(quartiles {q1:.3f}-{q3:.3f})", flush=True)
    remote = args.clients or bool(set(args.cases) - {"files", "local"})
    server = _server() if remote else None
    cache = Path(tempfile.mkdtemp(prefix="cltrain-bench-cache-"))
    try:
        url = _upload(local, "pack") if remote else ""
        names = sorted(str(q.relative_to(local)) for q in (local / "train").glob("*.tar"))
        if args.clients:
            index = np.load(local / names[0].replace(".tar", ".idx.npy"))
            _clients(url, names, [(int(o), int(s)) for o, s in index[:, :2]])
            print(machine_line())
            return
        warm = cache / "warm"
        if "s3-warm" in args.cases:
            _ours(url, cache_dir=str(warm))  # fills the warm cache once
        lit = _litdata_write(photos, args.work / f"litdata-{args.train}") if "litdata" in args.cases else ""
        mds = _mosaic_write(photos, args.work / f"mosaic-{args.train}") if "mosaic" in args.cases else ""
        shm = set(os.listdir("/dev/shm"))

        def cold() -> tuple[float, list[float]]:  # an empty node cache each pass
            shutil.rmtree(cache / "cold", ignore_errors=True)
            return _ours(url, cache_dir=str(cache / "cold"))

        cases = {"files": lambda: _ours(photos, files=True), "local": lambda: _ours(str(local)), "s3-cold": cold,
                 "s3-warm": lambda: _ours(url, cache_dir=str(warm)),
                 "s3-ranges": lambda: _ours(url, fetch="ranges", cache_dir=str(cache / "r")),
                 "webdataset": lambda: _webdataset([f"{url}/{n}" for n in names]),
                 "wds-fsspec": lambda: _webdataset([f"{url}/{n}" for n in names], fsspec=True),
                 "litdata": lambda: _litdata(lit, cache / "litdata"), "mosaic": lambda: _mosaic(mds, cache / "mosaic")}
        _SERVER.extend([server.pid] if server else [])
        runs = interleaved({k: cases[k] for k in args.cases}, args.rounds)
        print(f"object storage: {len(_labelled(photos))} photographs, {len(names)} shards of {args.shard_size}, batch "
              f"{args.batch_size}, 224 px, {args.workers} workers (others {PEER_WORKERS[0]}), shuffle_window 4; "
              f"{args.rounds} rounds, median images/s\n")
        med = {k: spread(rate for rate, _ in v).median for k, v in runs.items()}
        print(table(["case", "img/s", "vs local", "each round", "CPU s per pass: main process", "workers", "S3 server"],
                    [[k, f"{med[k]:,.1f}", f"{med[k] / med['local']:.2f}x" if "local" in med else "",
                      ", ".join(f"{rate:.0f}" for rate, _ in v),
                      *(f"{spread(cpu[j] for _, cpu in v).median:.2f}" for j in range(3))]
                     for k, v in runs.items()], align="lrrlrrr"))
        for ours, other in [("local", "files"), *(("s3-cold", peer) for peer in PEERS)]:
            if ours in med and other in med:
                print(f"{ours} / {other}: {med[ours] / med[other]:.2f}x")
        left = sorted(set(os.listdir("/dev/shm")) - shm)
        print(f"the cache on disk: {_mib(warm) if warm.is_dir() else 0:.1f} MiB (the pack: {_mib(local):.1f} MiB); "
              f"peak RSS: this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB, largest "
              f"worker {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**10:.0f} MiB\n"
              f"left in /dev/shm by the passes: {', '.join(left) if left else 'nothing'}\n{machine_line()}")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
