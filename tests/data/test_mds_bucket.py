"""A Mosaic MDS dataset in a bucket (a real S3 server, moto's, on 127.0.0.1; real JPEGs): the batches of the same
dataset read from its folder, bit for bit, with and without workers; written again to the same URL, read anew; a
shard missing or cut short said in one line, at setup where the store lists; a store gone mid-read ends the reads on
one line."""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cltrain.data.errors import StorageError
from cltrain.data.remote import RemoteError
from tests.helpers.data_fixtures import write_image_folder
from tests.helpers.s3 import Fault, FaultProxy, S3Server, s3_env, s3_env_fixture, s3_server_fixture  # noqa: F401 - the fixtures server and env

pytest.importorskip("s3fs", reason="the object-storage tests need s3fs and moto: pip install -e '.[test]'")
pytest.importorskip("moto.server", reason="the object-storage tests need moto[server]: pip install -e '.[test]'")
streaming = pytest.importorskip("streaming", reason="the MDS source needs mosaicml-streaming (the mds extra; not in "
                                                    "test: it pins numpy<2.2 and transformers<5)")

KW = dict(batch_size=4, image_size=24, val_resize_size=28, persistent_workers=False)
SHARD = "train/shard.00001.mds"


def _write_mds(folder: Path, out: Path) -> Path:
    """``folder``'s JPEGs as Mosaic's README writes them (a PIL image opened from the file, an int), several shards
    per split."""
    from PIL import Image

    for split in ("train", "val"):
        with streaming.MDSWriter(out=str(out / split), columns={"image": "jpeg", "class": "int"},
                                 size_limit=6_000) as sink:
            for p in sorted((folder / split).rglob("*.jpg")):
                sink.write({"image": Image.open(p), "class": int(p.parent.name[1:])})
    return out


@pytest.fixture(scope="module")
def local_mds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_image_folder(tmp_path_factory.mktemp("images") / "f", classes=2, train=6, val=3, size=(48, 40))
    return _write_mds(folder, tmp_path_factory.mktemp("mds") / "mds")


@pytest.fixture(scope="module")
def url(server: S3Server, local_mds: Path) -> str:
    return server.upload(local_mds, "bucket", "mds")


def _batches(dm) -> list[torch.Tensor]:  # noqa: ANN001 - an MDSModule
    import lightning

    lightning.seed_everything(0, verbose=False)
    dm.setup("fit")
    return [t.clone() for loader in (dm.train_dataloader(), dm.val_dataloader()) for batch in loader for t in batch[:2]]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_mds_dataset_in_a_bucket_gives_its_folders_batches_bit_for_bit(local_mds, url, env, workers):
    # each sample's shard was cached under its version, and read as split/shard.NNNNN.mds: FileNotFoundError
    from cltrain.data.datamodules.engines import MDSModule

    here = _batches(MDSModule(local_mds, num_classes=2, num_workers=workers, **KW))
    there = _batches(MDSModule(url, num_classes=2, num_workers=workers, **KW))
    assert len(here) == len(there) > 4 and all(torch.equal(a, b) for a, b in zip(here, there))
    cached = sorted(p.name for p in env.rglob("*.mds"))
    assert len(cached) == len(list(local_mds.rglob("*.mds"))) > 2 and all("~" in n for n in cached)  # versioned


def test_an_mds_dataset_written_again_to_the_same_url_is_read_anew(local_mds, server, env, tmp_path):
    from cltrain.data import eval_transform
    from cltrain.data.mds_source import MDSImages

    url, tf = server.upload(local_mds, "bucket", "again"), eval_transform(24, 28)
    first = MDSImages(url, "val", tf)
    before = [first.source(i) for i in range(len(first))]
    other = write_image_folder(tmp_path / "f", classes=2, train=6, val=3, size=(40, 48))  # other pictures, same names
    server.upload(_write_mds(other, tmp_path / "mds"), "bucket", "again")
    again = MDSImages(url, "val", tf)  # the same node cache
    after = [again.source(i) for i in range(len(again))]
    expected = MDSImages(tmp_path / "mds", "val", tf)
    assert after == [expected.source(i) for i in range(len(expected))] and after != before


def _gapped(server: S3Server, local_mds: Path, prefix: str) -> str:
    """``local_mds`` at ``s3://gaps/<prefix>``: ``SHARD`` missing (``"missing"``) or cut to half (``"cut"``), as an
    interrupted upload leaves it."""
    url, client = server.upload(local_mds, "gaps", prefix), server.client()
    if prefix.startswith("missing"):
        client.delete_object(Bucket="gaps", Key=f"{prefix}/{SHARD}")
    else:
        data = (local_mds / SHARD).read_bytes()
        client.put_object(Bucket="gaps", Key=f"{prefix}/{SHARD}", Body=data[: len(data) // 2])
    return url


def _fails_in_one_line(error: type, call) -> str:  # noqa: ANN001 - a callable
    with pytest.raises(error) as caught:
        call()
    line = str(caught.value)
    assert "\n" not in line and "MDSWriter" in line and "cltrain-pack" not in line, line
    return line


def test_an_mds_shard_missing_or_cut_short_is_one_line_at_setup(local_mds, server, env, tmp_path):
    # a cut shard was "the storage endpoint cannot be reached (got 32758 of 65516 bytes)" after 3 retries, a missing
    # one advised cltrain-pack, both when first read, after setup said ok
    from cltrain.data import eval_transform
    from cltrain.data.mds_source import MDSImages

    tf, size = eval_transform(24, 28), (local_mds / SHARD).stat().st_size
    for prefix, flaw in (("missing", "missing"), ("cut", f"{size // 2} bytes where {size} are needed (cut short)")):
        url = _gapped(server, local_mds, prefix)
        line = _fails_in_one_line(RemoteError, lambda: MDSImages(url, "train", tf))
        assert line.startswith(f"{url}/{SHARD}: {flaw}; the MDS dataset at {url} is incomplete"), line
    folder = Path(shutil.copytree(local_mds, tmp_path / "local"))
    (folder / SHARD).write_bytes((local_mds / SHARD).read_bytes()[:100])
    line = _fails_in_one_line(StorageError, lambda: MDSImages(folder, "train", tf))
    assert line.startswith(f"{folder / SHARD}: 100 bytes where {size} are needed (cut short)"), line


def test_where_the_store_does_not_list_a_shard_missing_or_cut_short_is_one_line_when_read(local_mds, server, env,
                                                                                          monkeypatch, caplog):
    from cltrain.data import eval_transform
    from cltrain.data.mds_source import MDSImages

    proxy = FaultProxy(server.endpoint)  # the listing of a split's folder denied: sizes are asked per shard
    proxy.faults.append(Fault("denied", path="train%2F&delimiter", times=1000))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    tf, size = eval_transform(24, 28), (local_mds / SHARD).stat().st_size
    try:
        for prefix, flaw in (("missing-unlisted", "not found"), ("cut-unlisted", f"{size // 2} bytes where {size} "
                                                                                 "are needed (cut short)")):
            ds = MDSImages(_gapped(server, local_mds, prefix), "train", tf, bad_files="skip")
            with caplog.at_level(logging.WARNING):
                line = _fails_in_one_line(RemoteError, lambda: ds.__getitems__([0, ds.starts[1], 1]))  # shard 0, 1, 0
            assert f"{SHARD}: {flaw}" in line and "is incomplete" in line, line
            assert not [r for r in caplog.records if "trying again" in r.getMessage()]  # not read again, and again
            assert not ds._warned  # not a bad sample, whatever bad_files says
        assert proxy.faults[0].hit >= 2  # the listings were denied
    finally:
        proxy.stop()


def test_once_a_read_has_failed_for_good_the_others_give_up_at_once_and_quietly(local_mds, url, server, env,
                                                                                 monkeypatch, caplog):
    # a server stopped mid-run: after the one error line, the other reads went on with "trying again (4 of 4)" lines
    # for about 100 s (207 s from the failure to the end of an MDS run), the error line lost among them
    import pickle

    import fsspec.config

    from cltrain.data import shard_cache

    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"retries": {"max_attempts": 1}}})  # a try: a GET
    monkeypatch.setattr(shard_cache, "RETRY_WINDOW", 3.0)
    cache, names = shard_cache.ShardCache(url, env), [f"train/shard.0000{k}.mds" for k in range(3)]
    cache.listing(names[0])
    worker = pickle.loads(pickle.dumps(cache))  # a DataLoader worker's copy: its own state, the same folder
    worker.listing(names[0])
    proxy.faults = [Fault("reset", path=names[0], times=10**6), Fault("stall", path=names[1], times=10**6, seconds=20)]
    try:
        with caplog.at_level(logging.WARNING), ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(cache.get, names[1])  # its answer is 20 s away
            with pytest.raises(RemoteError, match=names[0]) as first:
                cache.get(names[0])  # its tries, each said
            failed = time.monotonic()
            with pytest.raises(RemoteError) as quiet:
                in_flight.result(timeout=10)
            assert time.monotonic() - failed < 1  # abandoned at once, the client's own attempts with it
            assert str(quiet.value) == str(first.value)  # the failure's own line, naming the file it read
            for reader in (cache, worker):  # not tried: this process's failure, the note in the cache's folder
                with pytest.raises(RemoteError) as quiet:
                    reader.get(names[2])
                assert str(quiet.value) == str(first.value), (quiet.value, first.value)
        retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
        assert len(retries) == shard_cache.ATTEMPTS - 1 and all(names[0] in m for m in retries), retries
        assert proxy.gets(names[2]) == 0
        proxy.faults.clear()  # the store is back: a process that begins now reads (the note is older than it)
        assert shard_cache.ShardCache(url, env).get(names[1]).read_bytes() == (local_mds / names[1]).read_bytes()
        time.sleep(max(0.0, failed + 3.0 - time.monotonic()))  # and the window over: read again
        assert cache.get(names[2]).read_bytes() == (local_mds / names[2]).read_bytes()
    finally:
        proxy.stop()
